"""The outer loop in one command: feedback -> weak areas -> new evals and tasks -> report.

    python -m cursor_rl.outer.run --feedback=cursor_rl/outer/example_feedback.jsonl \\
        --workdir=/tmp/outer
    python -m cursor_rl.outer.run --feedback=feedback.jsonl --workdir=/tmp/outer \\
        --eval_workdir=workdirs/tiny-2026... [--checkpoint=rl:20] [--judge=pkg.mod:fn]

Steps: ingest and validate the feedback (``ingest``), classify each negative event
(``classify``), rank the weak areas by count and by the current checkpoint's pass@1
(``rank``, when ``--eval_workdir`` has eval results), build new train and bench
datasets for the ``--top_areas`` first areas and register each new bench
(``factory``), write ``WORKDIR/outer_report.md`` and ``WORKDIR/outer_summary.json``
(``report``). What ``WORKDIR`` holds afterwards::

    outer_report.md  outer_summary.json  registry.json (unless --registry)
    tasks/<area>/train/  tasks/<area>/bench/  tasks/reference_train/

From ``--eval_workdir`` (an RL run's workdir; only read, never written) come: its
eval results (``eval/<bench>/results.jsonl``), its datasets (``rl.tasks.train`` /
``rl.tasks.bench`` of its ``config.json``, else ``tasks/train`` and ``tasks/bench``) to
resolve snapshot task ids, map results to generators and decontaminate the new
benches against, its tokenizer (for episode-format trajectories) and its task family
(the default ``--task_source``).

Exit status: 0 when every step did its work (bad feedback rows are reported, and do
not fail the run); 1 when there was no valid event, or a selected area got no train
or bench task, or the registry could not be written (all in the report); 2 for
unusable flags or inputs (a message says which).

On the example file (15 events; 2 areas x (2 train + 2 bench) tiny tasks) it took
11-30 s on this project's 2-core machine while a training run and other jobs shared it
(load average 5-8); ``--nobuild`` takes under 2 s.

Pure Python, no JAX.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from absl import flags

from cursor_rl.chat.protocol import ChatFormat
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.eval import registry as registry_lib
from cursor_rl.outer import classify, factory, ingest, rank, report
from cursor_rl.tasks import records
from cursor_rl.tasks import workdir as task_workdir
from cursor_rl.workdir import Workdir, WorkdirError, is_remote

REGISTRY_FILE = "registry.json"
TASKS_DIR = "tasks"


class UsageError(ValueError):
    """A flag or an input the command cannot use (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class OuterConfig:
    """The command's settings (its flags; see ``main``)."""

    feedback: str
    workdir: str
    eval_workdir: str = ""
    checkpoint: str = ""
    train_tasks: tuple[str, ...] = ()
    bench_tasks: tuple[str, ...] = ()
    tokenizer: str = ""
    judge: str = "rules"
    top_areas: int = 2
    train_per_area: int = 2
    bench_per_area: int = 2
    task_source: str = ""
    seed: int = 0
    workers: int = 2
    registry: str = ""
    build: bool = True


@dataclasses.dataclass(frozen=True)
class _RunInputs:
    """What the eval workdir and the flags resolve to."""

    train_tasks: tuple[str, ...]
    bench_tasks: tuple[str, ...]
    tokenizer: str
    task_source: str
    eval_dir: str


def _resolve_inputs(config: OuterConfig) -> _RunInputs:
    train, bench = list(config.train_tasks), list(config.bench_tasks)
    tokenizer, source, eval_dir = config.tokenizer, config.task_source, ""
    if config.eval_workdir:
        try:
            run = Workdir.of(config.eval_workdir)
        except WorkdirError as e:
            raise UsageError(f"--eval_workdir: {e}") from e
        if not run.root.is_dir():
            raise UsageError(f"--eval_workdir={config.eval_workdir}: no such directory")
        run_tasks: dict[str, Any] = {}
        if run.config_file.exists():
            try:
                run_config = json.loads(run.config_file.read_text(encoding="utf-8"))
                run_tasks = dict(run_config.get("rl", {}).get("tasks", {}) or {})
            except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
                raise UsageError(f"{run.config_file}: not a run's config ({e})") from e
        for split, found in (("train", train), ("bench", bench)):
            directory = run_tasks.get(split) or run.local_path(run.tasks_dir(split))
            if task_workdir.is_built(directory) and directory not in found:
                found.append(directory)
        if not tokenizer and run.tokenizer_file.exists():
            tokenizer = os.fspath(run.tokenizer_file)
        source = source or run_tasks.get("family", "")
        eval_dir = os.fspath(run.eval_dir)
    for directory in (*train, *bench):
        path = (
            directory
            if directory.endswith(".jsonl")
            else os.path.join(directory, records.TASKS_FILE)
        )
        if not os.path.exists(path):
            raise UsageError(f"{directory}: not a task dataset (no {path})")
    return _RunInputs(tuple(train), tuple(bench), tokenizer, source or "tiny", eval_dir)


def run(config: OuterConfig, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the outer loop and writes its report.

    Args:
      config: the settings.
      log: progress lines.

    Returns:
      The summary written to ``outer_summary.json``.

    Raises:
      UsageError: an unusable flag or input (nothing is written).
    """
    began = time.monotonic()
    seconds: dict[str, float] = {}
    if is_remote(config.workdir):
        raise UsageError(f"--workdir={config.workdir}: must be local (sandboxes build tasks there)")
    if not os.path.exists(config.feedback):
        raise UsageError(f"--feedback={config.feedback}: no such file")
    if config.top_areas < 0 or config.train_per_area < 1 or config.bench_per_area < 1:
        raise UsageError("--top_areas must be >= 0, --train_per_area and --bench_per_area >= 1")
    try:
        judge = classify.load_judge(config.judge)
    except ValueError as e:
        raise UsageError(str(e)) from e
    inputs = _resolve_inputs(config)
    chat = None
    if inputs.tokenizer:
        try:
            chat = ChatFormat(Tokenizer.load(inputs.tokenizer))
        except (OSError, ValueError) as e:
            raise UsageError(f"tokenizer {inputs.tokenizer}: {e}") from e
    os.makedirs(config.workdir, exist_ok=True)

    step = time.monotonic()
    feedback = ingest.load_feedback(config.feedback, chat=chat)
    seconds["ingest"] = time.monotonic() - step
    log(
        f"feedback: {feedback.rows} rows, {len(feedback.events)} valid events "
        f"({len(feedback.negative)} negative), {len(feedback.bad_rows)} bad rows"
    )
    for bad in feedback.bad_rows:
        log(f"  bad row: {bad}")

    step = time.monotonic()
    try:
        tasks = classify.task_index((*inputs.bench_tasks, *inputs.train_tasks))
    except records.TaskRecordError as e:
        raise UsageError(f"a task dataset is malformed: {e}") from e
    classified = classify.classify_events(feedback.negative, tasks=tasks, judge=judge)
    seconds["classify"] = time.monotonic() - step

    step = time.monotonic()
    results = None
    if inputs.eval_dir:
        bench_index = classify.task_index(inputs.bench_tasks)
        try:
            results = rank.load_results(inputs.eval_dir, bench_index, checkpoint=config.checkpoint)
        except ValueError as e:
            raise UsageError(str(e)) from e
        if results is None:
            log(f"no eval results in {inputs.eval_dir}: areas are ranked by count")
    elif config.checkpoint:
        raise UsageError("--checkpoint needs --eval_workdir")
    areas = rank.weak_areas(classified.classifications, results)
    selected = rank.select(areas, config.top_areas)
    seconds["rank"] = time.monotonic() - step
    for i, area in enumerate(areas, 1):
        score = "" if area.pass_at_1 is None else f", pass@1 {area.pass_at_1:.3f}"
        chosen = " (selected)" if area in selected else ""
        log(
            f"  {i}. {area.name}: {area.count} event{'s' if area.count != 1 else ''}{score}{chosen}"
        )

    step = time.monotonic()
    registry_path = config.registry or os.path.join(config.workdir, REGISTRY_FILE)
    builds: list[factory.AreaBuild] = []
    if config.build and selected:
        builds = factory.build_areas(
            selected,
            os.path.join(config.workdir, TASKS_DIR),
            factory.FactoryConfig(
                source=inputs.task_source,
                train_per_area=config.train_per_area,
                bench_per_area=config.bench_per_area,
                seed=config.seed,
                workers=config.workers,
                reference_train=inputs.train_tasks,
            ),
            feedback=feedback,
            registry=registry_lib.Registry(registry_path),
            checkpoint=results.label if results is not None and results.stage else "",
            log=log,
        )
    seconds["build"] = time.monotonic() - step

    problems = [] if feedback.events else [f"no valid event in {config.feedback}"]
    problems += [f"{b.area}: {p}" for b in builds for p in b.problems]
    seconds["total"] = time.monotonic() - began
    summary = report.make_summary(
        feedback=feedback,
        judge=config.judge or "rules",
        classified=classified,
        results=results,
        areas=areas,
        selected=selected,
        builds=builds,
        registry=registry_path if builds else None,
        inputs={
            **dataclasses.asdict(config),
            "resolved": dataclasses.asdict(inputs),
        },
        problems=problems,
        seconds=seconds,
    )
    json_path, md_path = report.write(summary, config.workdir)
    log(f"wrote {md_path} and {json_path} in {seconds['total']:.1f}s")
    for problem in problems:
        log(f"problem: {problem}")
    return summary


def _paths(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(v for value in values for v in value.split(",") if v)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (flags as in the module docstring)."""
    fv = flags.FlagValues()
    flags.DEFINE_string("feedback", None, "The feedback JSONL file.", flag_values=fv)
    flags.DEFINE_string("workdir", None, "Where the report and new tasks go.", flag_values=fv)
    flags.DEFINE_string(
        "eval_workdir", "", "An RL run's workdir: eval results, datasets.", flag_values=fv
    )
    flags.DEFINE_string(
        "checkpoint", "", "STAGE:STEP of the eval to rank by (default: the latest).", flag_values=fv
    )
    flags.DEFINE_multi_string(
        "train_tasks", [], "More training datasets (resolve, decontaminate).", flag_values=fv
    )
    flags.DEFINE_multi_string(
        "bench_tasks", [], "More bench datasets (resolve, map eval results).", flag_values=fv
    )
    flags.DEFINE_string(
        "tokenizer", "", "Tokenizer of episode-format trajectories.", flag_values=fv
    )
    flags.DEFINE_string(
        "judge",
        "rules",
        "rules, a registered judge, package.module:function or package.module:factory=ARG "
        "(a derived judge: cursor_rl.outer.judge:category_judge=DIR).",
        flag_values=fv,
    )
    flags.DEFINE_integer("top_areas", 2, "Weak areas that become new tasks.", flag_values=fv)
    flags.DEFINE_integer("train_per_area", 2, "New training tasks per area.", flag_values=fv)
    flags.DEFINE_integer("bench_per_area", 2, "New bench tasks per area.", flag_values=fv)
    flags.DEFINE_string(
        "task_source", "", "Task source (default: the run's family, else tiny).", flag_values=fv
    )
    flags.DEFINE_integer("seed", 0, "Mixed into each area's build seed.", flag_values=fv)
    flags.DEFINE_integer("workers", 2, "Repositories validated in parallel.", flag_values=fv)
    flags.DEFINE_string(
        "registry", "", "Saturation registry file (default WORKDIR/registry.json).", flag_values=fv
    )
    flags.DEFINE_bool(
        "build", True, "Build tasks (--nobuild: classify and rank only).", flag_values=fv
    )
    try:
        fv(list(argv if argv is not None else sys.argv))
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not fv.feedback or not fv.workdir:
        print("error: --feedback and --workdir are required", file=sys.stderr)
        return 2
    config = OuterConfig(
        feedback=fv.feedback,
        workdir=fv.workdir,
        eval_workdir=fv.eval_workdir,
        checkpoint=fv.checkpoint,
        train_tasks=_paths(fv.train_tasks),
        bench_tasks=_paths(fv.bench_tasks),
        tokenizer=fv.tokenizer,
        judge=fv.judge,
        top_areas=fv.top_areas,
        train_per_area=fv.train_per_area,
        bench_per_area=fv.bench_per_area,
        task_source=fv.task_source,
        seed=fv.seed,
        workers=fv.workers,
        registry=fv.registry,
        build=fv.build,
    )
    try:
        summary = run(config)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
