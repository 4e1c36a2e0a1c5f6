"""Weak areas ranked: by negative feedback, and by the current checkpoint's pass@1.

    results = load_results(Workdir(run).eval_dir, tasks)       # None: no eval results
    areas = weak_areas(judged.classifications, results)        # ranked, most urgent first
    areas[0].name, areas[0].count, areas[0].pass_at_1, areas[0].generators

Choices:

1. **An area maps to generators**, the task factory's unit of kind: a task-kind area
   to every generator of its kind (``bug_fix`` -> the ``bug`` generators); a behaviour
   area (or ``other``) to the generators of its events' tasks where the snapshot
   resolved to a task, else to every generator of its events' task kinds, else to
   all generators (a behaviour seen on unknown work is worth measuring anywhere).
2. **The current checkpoint** is the (stage, step) of the eval written last (its
   largest ``time``) across every ``EVAL_DIR/<bench>/results.jsonl`` of the run, or
   the one named (``--checkpoint=STAGE:STEP``). Its episodes are joined to bench
   tasks by id (the datasets give each task's generator); episodes whose task no
   dataset holds are counted (``unmapped``), lost episodes are not scored (as in
   ``cursor_rl.eval.metrics``), unreadable lines are counted with file and line.
3. **pass@1 of an area** is the mean over matching bench tasks of each task's pass@1
   (``metrics.pass_at_k(n, c, 1)``, tasks weigh equally), with the bootstrap 95%
   interval over tasks (``metrics.bootstrap_ci``); None when no task matches.
4. **Ranking**: more negative events first; among equal counts the lower pass@1
   first (a known weakness the bench confirms), areas without a pass@1 last; then
   by name. ``other`` is ranked and reported but never selected for new tasks
   (nothing says what work it is). The report also lists the areas by pass@1.

Pure Python and NumPy, no JAX.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from etils import epath

from cursor_rl.eval import metrics, runner
from cursor_rl.outer.classify import KIND_OF_CATEGORY, Classification, TaskInfo
from cursor_rl.tasks import generators


@dataclasses.dataclass
class CheckpointResults:
    """The current checkpoint's held-out episodes, per task (choice 2).

    Attributes:
      eval_dir: where they were read (``WORKDIR/eval``).
      stage, step: the checkpoint.
      benches: the benchmarks that evaluated it.
      outcomes: task id -> (scored samples, resolved samples).
      generator_of: task id -> generator, for the tasks a dataset holds.
      unmapped: episodes whose task no dataset holds.
      lost: lost episodes (not scored).
      bad_lines: ``file:line: problem`` of every unreadable line.
      checkpoints: every (stage, step) found, as ``STAGE:STEP``, oldest first.
    """

    eval_dir: str
    stage: str
    step: int
    benches: list[str]
    outcomes: dict[str, tuple[int, int]]
    generator_of: dict[str, str]
    unmapped: int = 0
    lost: int = 0
    bad_lines: list[str] = dataclasses.field(default_factory=list)
    checkpoints: list[str] = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.stage}:{self.step}"

    def pass_at_1(self, task_ids: Sequence[str]) -> tuple[float | None, Any, int]:
        """Mean pass@1 over ``task_ids`` that were scored, its interval and how many."""
        values = []
        for task_id in task_ids:
            n, c = self.outcomes.get(task_id, (0, 0))
            if n:
                values.append(metrics.pass_at_k(n, c, 1))
        if not values:
            return None, None, 0
        return sum(values) / len(values), metrics.bootstrap_ci(values), len(values)

    def summary(self) -> dict[str, Any]:
        overall, ci, n = self.pass_at_1(list(self.outcomes))
        return {
            "eval_dir": self.eval_dir,
            "checkpoint": self.label if self.stage else None,
            "checkpoints_found": list(self.checkpoints),
            "benches": list(self.benches),
            "tasks": n,
            "pass@1": overall,
            "pass@1_ci": ci,
            "unmapped_episodes": self.unmapped,
            "lost_episodes": self.lost,
            "bad_lines": list(self.bad_lines),
        }


def load_results(
    eval_dir: str | os.PathLike,
    tasks: Mapping[str, TaskInfo],
    *,
    checkpoint: str = "",
) -> CheckpointResults | None:
    """Reads a run's eval results and keeps the current checkpoint's (choice 2).

    Args:
      eval_dir: the run's eval directory (``Workdir.eval_dir``).
      tasks: known tasks by id (``classify.task_index`` of the bench datasets).
      checkpoint: ``STAGE:STEP`` to read instead of the latest.

    Returns:
      The checkpoint's results, or None when the directory holds no results file.

    Raises:
      ValueError: ``checkpoint`` is malformed or was never evaluated.
    """
    root = epath.Path(eval_dir)
    files = sorted(root.glob(f"*/{runner.RESULTS_FILE}")) if root.is_dir() else []
    if not files:
        return None
    lines: list[tuple[str, dict[str, Any]]] = []
    bad: list[str] = []
    latest: dict[tuple[str, int], float] = {}
    for path in files:
        bench = path.parent.name
        for lineno, text in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
            if not text.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(text)
                key = (str(row["stage"]), int(row["step"]))
                when = float(row.get("time") or 0.0)
                if not isinstance(row["task_id"], str) or not isinstance(row["finish_reason"], str):
                    raise TypeError("task_id and finish_reason must be strings")
                if not isinstance(row["resolved"], bool):
                    raise TypeError("resolved must be true or false")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                bad.append(f"{where}: {type(e).__name__}: {e}")
                continue
            latest[key] = max(latest.get(key, when), when)
            lines.append((bench, row))
    if not latest:
        return CheckpointResults(str(root), "", 0, [], {}, {}, bad_lines=bad)
    order = sorted(latest, key=lambda k: (latest[k], k))
    if checkpoint:
        stage, sep, step = checkpoint.rpartition(":")
        if not sep or not stage or not step.isdigit():
            raise ValueError(f"--checkpoint={checkpoint!r}: expected STAGE:STEP, e.g. rl:20")
        chosen = (stage, int(step))
        if chosen not in latest:
            found = ", ".join(f"{s}:{n}" for s, n in order)
            raise ValueError(f"checkpoint {checkpoint} has no eval results in {root} ({found})")
    else:
        chosen = order[-1]
    counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    benches: set[str] = set()
    unmapped = lost = 0
    for bench, row in lines:
        if (str(row["stage"]), int(row["step"])) != chosen:
            continue
        benches.add(bench)
        if row["finish_reason"] == metrics.LOST:
            lost += 1
            continue
        if row["task_id"] not in tasks:
            unmapped += 1
            continue
        counts[row["task_id"]][0] += 1
        counts[row["task_id"]][1] += int(bool(row["resolved"]))
    return CheckpointResults(
        eval_dir=str(root),
        stage=chosen[0],
        step=chosen[1],
        benches=sorted(benches),
        outcomes={t: (n, c) for t, (n, c) in counts.items()},
        generator_of={t: tasks[t].generator for t in counts},
        unmapped=unmapped,
        lost=lost,
        bad_lines=bad,
        checkpoints=[f"{s}:{n}" for s, n in order],
    )


# ---- weak areas ---------------------------------------------------------------------------


@dataclasses.dataclass
class WeakArea:
    """One weak area: its events and what it maps to.

    Attributes:
      name: the category.
      events: the ids of its negative events, in file order.
      difficulty: level -> events.
      task_kinds: kind -> events (``unknown`` where no kind was found).
      generators: the task generators it maps to (choice 1).
      pass_at_1: the current checkpoint's pass@1 on matching bench tasks, or None.
      pass_at_1_ci: its bootstrap 95% interval, or None.
      bench_tasks: matching bench tasks with scored episodes.
    """

    name: str
    events: list[str]
    difficulty: dict[str, int]
    task_kinds: dict[str, int]
    generators: tuple[str, ...]
    pass_at_1: float | None = None
    pass_at_1_ci: tuple[float, float] | None = None
    bench_tasks: int = 0

    @property
    def count(self) -> int:
        return len(self.events)

    @property
    def selectable(self) -> bool:
        return self.name != "other"

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["count"] = self.count
        return out


def area_generators(name: str, members: Sequence[Classification]) -> tuple[str, ...]:
    """The generators an area maps to (choice 1)."""
    if name in KIND_OF_CATEGORY:
        return tuple(generators.names(KIND_OF_CATEGORY[name]))
    known = {c.generator for c in members if c.generator}
    kinds = {c.task_kind for c in members if c.task_kind and not c.generator}
    names = known | {g for kind in sorted(kinds) for g in generators.names(kind)}
    return tuple(sorted(names)) if names else tuple(generators.names())


def weak_areas(
    classifications: Sequence[Classification], results: CheckpointResults | None = None
) -> list[WeakArea]:
    """The weak areas of ``classifications``, ranked (choice 4)."""
    by_area: dict[str, list[Classification]] = collections.defaultdict(list)
    for c in classifications:
        by_area[c.category].append(c)
    areas = []
    for name, members in by_area.items():
        area = WeakArea(
            name=name,
            events=[c.event_id for c in members],
            difficulty=dict(collections.Counter(c.difficulty for c in members)),
            task_kinds=dict(collections.Counter(c.task_kind or "unknown" for c in members)),
            generators=area_generators(name, members),
        )
        if results is not None:
            matching = [t for t, g in results.generator_of.items() if g in area.generators]
            area.pass_at_1, area.pass_at_1_ci, area.bench_tasks = results.pass_at_1(matching)
        areas.append(area)
    return sorted(areas, key=_rank_key)


def _rank_key(area: WeakArea) -> tuple:
    unknown = area.pass_at_1 is None
    return (-area.count, unknown, area.pass_at_1 or 0.0, area.name)


def by_pass_at_1(areas: Sequence[WeakArea]) -> list[WeakArea]:
    """The areas with a pass@1, lowest first (ties: more events first)."""
    scored = [a for a in areas if a.pass_at_1 is not None]
    return sorted(scored, key=lambda a: (a.pass_at_1, -a.count, a.name))


def select(areas: Sequence[WeakArea], top: int) -> list[WeakArea]:
    """The ``top`` highest-ranked areas that can become tasks (not ``other``)."""
    return [a for a in areas if a.selectable][: max(0, top)]
