"""From weak area to work: new train and bench datasets for the top weak areas.

    builds = build_areas(selected, "OUT/tasks", FactoryConfig(source="tiny"),
                         feedback=feedback_set, registry=Registry("OUT/registry.json"))
    builds[0].bench_dir     # OUT/tasks/<area>/bench: tasks.jsonl, stats.json,
                            # rejections.jsonl, provenance.json

Every task is made by the task factory as today: ``cursor_rl.tasks.build.build``
(the generators, sandbox validation and records of any dataset), restricted to the
area's generators (``rank.area_generators``). Layout under ``OUT``::

    <area>/train/   <area>/bench/          one dataset each, provenance.json beside
    reference_train/tasks.jsonl            what the new benches were decontaminated against

Choices:

1. **Train first, then bench, then the same contamination check as today**: every
   area's training set is built, then each bench is built with
   ``decontaminate_against`` a reference made of the existing training datasets
   (``FactoryConfig.reference_train``: the RL run's) plus every new training set,
   at the threshold the pipeline uses (0.99 for the tiny family, whose splits share
   templates; ``contamination.DEFAULT_THRESHOLD`` otherwise). The split discipline
   is the build's (``cursor_rl.data.splits``): train tasks from train code, bench
   tasks from bench code. Areas are built side by side (``workers`` at a time; each
   build validates no more repositories at once than its count needs), since a
   build mostly waits on sandboxed test runs.
2. **Fresh code per area, reproducibly.** For the tiny family the build's ``seed``
   is also the first module of the split it reads; each area starts at
   ``OUTER_SEED_BASE`` plus a hash of the area, its event ids, the feedback file's
   hash and ``FactoryConfig.seed``, far from the modules a run's own datasets use
   (they start at 0), so the same feedback gives the same tasks and new feedback new
   ones.
3. **No endless builds.** The tiny family never runs out of modules, so a generator
   that cannot make a candidate there (``remove_class``: tiny modules have no
   classes) would keep the build looking forever; generators without a candidate
   on the first ``probe_repos`` modules are dropped before building, and named in
   the provenance and the report.
4. **Provenance is a file beside the tasks** (``provenance.json``: the weak area, its
   event ids, the feedback file's path and hash, the generators, the pass@1 that
   motivated it, the decontamination reference, the task ids), so the registry's
   format stays its own; the registry gets the new bench through its public
   ``record``: one history entry of stage ``outer``, step 0, with the task count and
   no pass@1 (created, not yet evaluated). A bench already in the registry is not
   recorded again (re-running on the same feedback changes nothing there).
5. **Nothing is lost silently**: an area with no usable generator, a build that
   fails (the other areas go on) or yields no train or no bench task, a registry that
   cannot be written are each a ``problem`` of the area's ``AreaBuild`` (the command
   reports them and exits 1); dropped generators (choice 3) are listed, not problems
   (the others still run).

Pure Python, no JAX.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

from cursor_rl.eval import registry as registry_lib
from cursor_rl.outer.ingest import FeedbackSet
from cursor_rl.outer.rank import WeakArea
from cursor_rl.tasks import build, contamination, generators, records, tiny

PROVENANCE_FILE = "provenance.json"
PROVENANCE_FORMAT = 1
REFERENCE_DIR = "reference_train"
OUTER_SEED_BASE = 100_000
OUTER_SEED_SPAN = 800_000
REGISTRY_STAGE = "outer"


@dataclasses.dataclass(frozen=True)
class FactoryConfig:
    """How new datasets are built.

    Attributes:
      source: the task source (``tiny``, ``stdlib``, a repository path, ``sdist:...``).
      train_per_area: training tasks per area.
      bench_per_area: bench tasks per area.
      max_per_repo: tasks per repository (variety across modules).
      seed: mixed into each area's start (choice 2).
      workers: repositories validated in parallel (at most as many as the count needs).
      runs: validation runs per state.
      reference_train: existing training datasets (the RL run's ``tasks/train``).
      decontaminate_corpus: pretraining corpus specs the benches are checked against.
      probe_repos: tiny modules probed for candidates per generator (choice 3).
    """

    source: str = "tiny"
    train_per_area: int = 2
    bench_per_area: int = 2
    max_per_repo: int = 2
    seed: int = 0
    workers: int = 2
    runs: int = 2
    reference_train: tuple[str, ...] = ()
    decontaminate_corpus: tuple[str, ...] = ()
    probe_repos: int = 8

    @property
    def threshold(self) -> float:
        return contamination.threshold_for(self.source)


@dataclasses.dataclass
class AreaBuild:
    """What one weak area became.

    Attributes:
      area: the weak area's name.
      bench_name: the new benchmark's registry name.
      generators: the generators built with.
      dropped_generators: generator -> why it was not used.
      start: the build seed (choice 2).
      train_dir, bench_dir: the new datasets.
      train_stats, bench_stats: ``build.build``'s statistics (None: not built).
      registered: whether the bench is in the registry (recorded now or by an
        earlier run on the same feedback).
      problems: what went wrong (choice 5).
    """

    area: str
    bench_name: str
    generators: tuple[str, ...]
    dropped_generators: dict[str, str]
    start: int
    train_dir: str
    bench_dir: str
    train_stats: dict[str, Any] | None = None
    bench_stats: dict[str, Any] | None = None
    registered: bool = False
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def train_tasks(self) -> int:
        return int(self.train_stats["tasks"]) if self.train_stats else 0

    @property
    def bench_tasks(self) -> int:
        return int(self.bench_stats["tasks"]) if self.bench_stats else 0

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(train_tasks=self.train_tasks, bench_tasks=self.bench_tasks)
        return out


def area_start(area: WeakArea, feedback_sha256: str, seed: int) -> int:
    """The build seed of an area (choice 2)."""
    key = f"{seed}:{area.name}:{','.join(sorted(area.events))}:{feedback_sha256}"
    digest = int(hashlib.sha256(key.encode()).hexdigest()[:12], 16)
    return OUTER_SEED_BASE + digest % OUTER_SEED_SPAN


def bench_name(area: WeakArea, feedback_sha256: str) -> str:
    """The registry name of an area's new bench: ``outer-<area>-<hash>``."""
    key = f"{area.name}:{','.join(sorted(area.events))}:{feedback_sha256}"
    return f"outer-{area.name}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def usable_generators(
    names: Sequence[str], config: FactoryConfig, split: str, start: int
) -> tuple[tuple[str, ...], dict[str, str]]:
    """The generators that make candidates on the source, and why the others do not
    (choice 3; only the tiny family, whose modules never run out, is probed)."""
    if config.source != "tiny":
        return tuple(names), {}
    repos = list(itertools.islice(tiny.tiny_repos(split, start=start), config.probe_repos))
    kept, dropped = [], {}
    for name in names:
        if any(generators.get(name).fn(repo) for repo in repos):
            kept.append(name)
        else:
            dropped[name] = f"no candidate on {len(repos)} tiny {split} modules"
    return tuple(kept), dropped


def build_areas(
    areas: Sequence[WeakArea],
    out_dir: str,
    config: FactoryConfig,
    *,
    feedback: FeedbackSet,
    registry: registry_lib.Registry | None = None,
    checkpoint: str = "",
    log: Callable[[str], None] = print,
) -> list[AreaBuild]:
    """Builds each area's train and bench datasets and registers the benches.

    Args:
      areas: the selected weak areas (``rank.select``).
      out_dir: where the datasets go (see the module docstring's layout).
      config: build settings.
      feedback: the feedback the areas came from (its path and hash are provenance).
      registry: the saturation registry to record each new bench in (None: none).
      checkpoint: the checkpoint whose pass@1 ranked the areas (provenance).
      log: progress lines.

    Returns:
      One ``AreaBuild`` per area, in order.
    """
    os.makedirs(out_dir, exist_ok=True)
    log = _one_line_at_a_time(log)  # the build threads log too
    builds = []
    for area in areas:  # generators parse code: probe them all before any build thread
        start = area_start(area, feedback.sha256, config.seed)
        used, dropped = usable_generators(area.generators, config, "train", start)
        result = AreaBuild(
            area=area.name,
            bench_name=bench_name(area, feedback.sha256),
            generators=used,
            dropped_generators=dropped,
            start=start,
            train_dir=os.path.join(out_dir, area.name, "train"),
            bench_dir=os.path.join(out_dir, area.name, "bench"),
        )
        if not used:
            result.problems.append(f"no generator of {config.source} can make {area.name} tasks")
        builds.append(result)

    def build_split(result: AreaBuild, split: str, reference: str) -> dict[str, Any] | None:
        count = config.train_per_area if split == "train" else config.bench_per_area
        log(f"{result.area}: building {count} {split} tasks ({', '.join(result.generators)})")
        try:
            return build.build(
                _build_config(config, result, split, reference),
                log=lambda line: log(f"  {result.area} {split}: {line}"),
            )
        except Exception as e:  # choice 5: one area's failure is reported, the others go on
            result.problems.append(f"the {split} build failed: {e!r}")
            return None

    runnable = [b for b in builds if b.generators]
    with futures.ThreadPoolExecutor(max(1, min(config.workers, len(runnable) or 1))) as pool:
        for result, stats in zip(
            runnable, pool.map(lambda b: build_split(b, "train", ""), runnable), strict=True
        ):
            result.train_stats = stats
        reference = _write_reference(builds, out_dir, config)
        trained = [b for b in runnable if not b.problems]
        for result, stats in zip(
            trained, pool.map(lambda b: build_split(b, "bench", reference), trained), strict=True
        ):
            result.bench_stats = stats
    for area, result in zip(areas, builds, strict=True):
        if result.problems:
            continue  # said already (no generator, a failed build)
        if not result.train_tasks:
            result.problems.append("no training task was built")
        if not result.bench_tasks:
            result.problems.append("no bench task was built: no new eval for this area")
        for split in ("train", "bench"):
            stats = getattr(result, f"{split}_stats")
            if stats is not None:
                _write_provenance(
                    result, area, split, config, feedback, reference, checkpoint, registry
                )
        if registry is not None and result.bench_tasks:
            _register(result, registry)
    return builds


def _one_line_at_a_time(log: Callable[[str], None]) -> Callable[[str], None]:
    lock = threading.Lock()

    def locked(line: str) -> None:
        with lock:
            log(line)

    return locked


def _build_config(
    config: FactoryConfig, result: AreaBuild, split: str, reference: str
) -> build.BuildConfig:
    count = config.train_per_area if split == "train" else config.bench_per_area
    # The build counts a repository's tasks when it is done with it: validating more
    # than the count in one repository, or a second repository beside a first that
    # fills the count, is work thrown away.
    per_repo = min(config.max_per_repo, count) if config.max_per_repo else count
    repos_needed = -(-count // per_repo)
    return build.BuildConfig(
        source=config.source,
        out=result.train_dir if split == "train" else result.bench_dir,
        split=split,
        generators=result.generators,
        count=count,
        max_per_repo=per_repo,
        seed=result.start,
        workers=max(1, min(config.workers, repos_needed)),
        runs=config.runs,
        decontaminate_against=reference,
        decontaminate_corpus=config.decontaminate_corpus if split == "bench" else (),
        decontaminate_threshold=config.threshold,
    )


def _write_reference(builds: Sequence[AreaBuild], out_dir: str, config: FactoryConfig) -> str:
    """The training tasks every new bench is checked against (choice 1); ``""`` when
    there are none."""
    dirs = [*config.reference_train, *(b.train_dir for b in builds if b.train_tasks)]
    tasks = [task for d in dirs for task in records.read_tasks(d)]
    if not tasks:
        return ""
    reference = os.path.join(out_dir, REFERENCE_DIR)
    os.makedirs(reference, exist_ok=True)
    records.write_tasks(tasks, os.path.join(reference, records.TASKS_FILE))
    with open(os.path.join(reference, "sources.json"), "w", encoding="utf-8") as f:
        json.dump({"datasets": dirs, "tasks": len(tasks)}, f, indent=2)
    return reference


def _write_provenance(
    result: AreaBuild,
    area: WeakArea,
    split: str,
    config: FactoryConfig,
    feedback: FeedbackSet,
    reference: str,
    checkpoint: str,
    registry: registry_lib.Registry | None,
) -> None:
    directory = result.train_dir if split == "train" else result.bench_dir
    task_ids = [t.task_id for t in records.read_tasks(directory)]
    provenance = {
        "format": PROVENANCE_FORMAT,
        "split": split,
        "bench": result.bench_name,
        "weak_area": area.name,
        "event_ids": list(area.events),
        "difficulty": dict(area.difficulty),
        "task_kinds": dict(area.task_kinds),
        "pass@1_before": area.pass_at_1,
        "pass@1_tasks_before": area.bench_tasks,
        "checkpoint": checkpoint or None,
        "feedback": {"path": os.path.abspath(feedback.path), "sha256": feedback.sha256},
        "source": config.source,
        "generators": list(result.generators),
        "generators_dropped": dict(result.dropped_generators),
        "build_seed": result.start,
        "decontaminated_against": reference if split == "bench" else None,
        "decontamination_threshold": config.threshold if split == "bench" else None,
        "registry": os.fspath(registry.path) if registry is not None and split == "bench" else None,
        "train_dir": os.path.abspath(result.train_dir),
        "bench_dir": os.path.abspath(result.bench_dir),
        "tasks": len(task_ids),
        "task_ids": task_ids,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    with open(os.path.join(directory, PROVENANCE_FILE), "w", encoding="utf-8") as f:
        json.dump(provenance, f, indent=2, sort_keys=True)
        f.write("\n")


def _register(result: AreaBuild, registry: registry_lib.Registry) -> None:
    """Records the new bench unless the registry has it (choice 4); a registry error
    is a problem, not a crash."""
    try:
        if result.bench_name in registry.benchmarks():
            result.registered = True
            return
        registry.record(
            {
                "bench": result.bench_name,
                "stage": REGISTRY_STAGE,
                "step": 0,
                "k_values": [],
                "overall": {"tasks": result.bench_tasks, "episodes": 0},
            }
        )
        result.registered = True
    except (registry_lib.RegistryError, OSError) as e:
        result.problems.append(f"registry {registry.path}: {e}")
