"""Builds a validated task dataset and prints its statistics.

    python -m cursor_rl.tasks.build --source=stdlib --split=train --out=/data/tasks/train
    python -m cursor_rl.tasks.build --source=stdlib --split=bench --out=/data/tasks/bench \
        --decontaminate_against=/data/tasks/train --decontaminate_corpus=stdlib
    python -m cursor_rl.tasks.build --source=tiny --split=train --count=2000 --out=/data/tiny/train
    python -m cursor_rl.tasks.build --source=tiny --split=bench --count=200 --out=/data/tiny/bench \
        --decontaminate_against=/data/tiny/train --decontaminate_threshold=0.99
    python -m cursor_rl.tasks.build --source=/src/myrepo --split=train --out=/data/myrepo
    python -m cursor_rl.tasks.build --source=sdist:attrs==23.2.0 --out=/data/attrs
    python -m cursor_rl.tasks.build --source=/src/myrepo --out=/data/myrepo \
        --autoinstall=agent --autoinstall_policy=WORKDIR/sft/checkpoints
    python -m cursor_rl.tasks.build --source=/src/myrepo --out=/data/myrepo --autoinstall=scripted

Writes into ``--out``: ``tasks.jsonl`` (the records, see ``cursor_rl.tasks.records``),
``stats.json`` (counts per category, source, generator; rejection reasons;
timings), ``rejections.jsonl`` (every rejected candidate with its reason) and, for
repositories, ``autoinstall/`` (the environment recipe and logs).

How a repository source is installed (``--autoinstall``, ``cursor_rl.tasks.autoinstall``):

* ``heuristic`` (default): read the build files, install, validate;
* ``agent``: a model finds the install and test commands itself in the sandbox,
  with the harness tools; ``--autoinstall_policy`` names it (a trainer checkpoint,
  an HF directory or a built-in base such as ``tiny``) and is required: a model is
  never picked implicitly, so a recipe's provenance is always the one asked for;
* ``scripted``: the scripted agent (the heuristic plan replayed through the same
  tools; no model), for the agent mode's plumbing and as its baseline.

Either agent's recipe is kept only if the same validation test passes; otherwise
(no recipe, a recipe that fails the test, an error, ``--autoinstall_max_turns`` turns
used up) the heuristic mode runs as the fallback. ``OUT/autoinstall/autoinstall.log``
says which agent ran and what it did, then the fallback's log; the recipe's ``mode``
says which recipe was kept. The flags apply to repository sources only: with
``stdlib`` or ``tiny`` (nothing to install) a mode other than ``heuristic`` is an
error, as are ``--autoinstall_policy`` without ``agent`` and an unknown mode.

How candidates are chosen: for each repository and each generator, the candidates
are shuffled with ``--seed`` and validated in that order until
``--max_per_generator`` are accepted or ``--max_attempts`` were tried, so a dataset
covers every generator and symbol kind instead of the first hundred comparisons
of one module, and a build's cost is bounded. ``--max_per_repo`` caps a repository's
tasks (the tiny family uses a few per module, for variety). Repositories are
validated in parallel (``--workers`` threads; each test run is a sandboxed process);
the threads take turns generating candidates (``_AST_LOCK``).

Pure Python, no JAX (but for the agent mode's model, imported only when it loads).
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import hashlib
import json
import os
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from typing import Any

from absl import flags

from cursor_rl.data import splits
from cursor_rl.tasks import (
    autoinstall,
    contamination,
    generators,
    records,
    sources,
    tiny,
    validation,
)
from cursor_rl.tasks.generators.base import SourceRepo

STATS_FILE = "stats.json"
REJECTIONS_FILE = "rejections.jsonl"
AUTOINSTALL_MODES = ("heuristic", "agent", "scripted")  # --autoinstall

# Candidate generation parses Python with ``ast``, which CPython 3.11 cannot do on two
# threads at once: the conversion to ``ast`` objects counts its recursion depth in
# interpreter-wide state, so when one thread's parse is interrupted (a finalizer that
# runs Python code during its allocations is enough) and another thread parses, the
# first fails with "SystemError: AST constructor recursion depth mismatch" (CPython
# issue gh-106905). Generation is pure-Python work that the GIL serialises anyway, so
# the build's threads take turns there, and when formatting a traceback (which parses
# the failing lines); they overlap where it pays, validating in sandboxed processes.
_AST_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """Settings of one dataset build (the command-line flags).

    Attributes:
      source: ``stdlib``, ``tiny``, a repository path, or ``sdist:NAME[==VERSION]``.
      out: the dataset directory.
      split: ``train`` or ``bench``.
      generators: generator names (empty: all registered).
      max_per_generator: accepted tasks per repository and generator.
      generator_caps: per-generator overrides of ``max_per_generator`` (e.g. more
        feature removals than refactors).
      max_attempts: candidates tried per repository and generator.
      max_per_repo: accepted tasks per repository (0: no cap).
      count: stop after this many tasks (0: no cap; the tiny family needs it).
      modules: stdlib modules to use (empty: all of the split).
      seed: candidate order and tiny seed offset.
      workers: repositories validated in parallel.
      runs: runs per state in validation.
      snapshot: ``archive`` (inline) or ``dir`` (``repos/<task_id>/`` beside the JSONL).
      decontaminate_against: a training dataset; tasks whose solution overlaps its
        tasks by more than ``decontaminate_threshold`` are dropped (reason
        ``contaminated``). For the tiny family, whose splits share templates (and so
        docstring and code n-grams), use a threshold near 1: only a solution that
        occurs whole in the training tasks is dropped.
      decontaminate_corpus: pretraining corpus specs (``stdlib``, ``files:...``) whose
        documents count as training data for the same check.
      decontaminate_threshold: see above (n-gram overlap, ``cursor_rl.tasks.contamination``).
      autoinstall: how a repository source is installed: ``heuristic``, ``agent`` or
        ``scripted`` (module docstring).
      autoinstall_policy: the agent mode's model (required by ``agent`` only).
      autoinstall_max_turns: the agent's assistant turns before it is cut off.
    """

    source: str
    out: str
    split: str = "train"
    generators: tuple[str, ...] = ()
    max_per_generator: int = 2
    generator_caps: Mapping[str, int] = dataclasses.field(default_factory=dict)
    max_attempts: int = 8
    max_per_repo: int = 0
    count: int = 0
    modules: tuple[str, ...] = ()
    seed: int = 0
    workers: int = 2
    runs: int = 2
    snapshot: str = "archive"
    decontaminate_against: str = ""
    decontaminate_corpus: tuple[str, ...] = ()
    decontaminate_threshold: float = 0.5
    autoinstall: str = "heuristic"
    autoinstall_policy: str = ""
    autoinstall_max_turns: int = 30


@dataclasses.dataclass
class RepoResult:
    """What one repository produced."""

    repo: SourceRepo
    tasks: list[records.TaskRecord] = dataclasses.field(default_factory=list)
    rejections: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    baseline_seconds: float = 0.0
    seconds: float = 0.0


def solution_patch(start: dict[str, str], reference: dict[str, str]) -> str:
    """A unified diff (``a/``, ``b/`` paths) from the starting tree to the reference."""
    chunks = []
    for path in sorted(set(start) | set(reference)):
        before, after = start.get(path), reference.get(path)
        if before == after:
            continue
        chunks += difflib.unified_diff(
            records.split_lines(before or ""),
            records.split_lines(after or ""),
            fromfile=f"a/{path}" if before is not None else "/dev/null",
            tofile=f"b/{path}" if after is not None else "/dev/null",
        )
    # difflib leaves a last line without newline bare; mark it as `diff -u` does.
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
        for line in chunks
    )


def task_id(repo: SourceRepo, generator: str, task: validation.ValidatedTask) -> str:
    """A stable id: repository, generator and a hash of the starting tree and tests."""
    digest = hashlib.sha256()
    digest.update(records.tree_hash(task.start_tree).encode())
    digest.update(records.tree_hash(task.hidden_tests).encode())
    return f"{repo.name}-{generator}-{digest.hexdigest()[:10]}"


def make_record(
    repo: SourceRepo,
    task: validation.ValidatedTask,
    *,
    split: str,
    out: str,
    snapshot: str,
    environment: dict[str, Any],
    runs: int,
) -> records.TaskRecord:
    """Turns a validated task into its record."""
    cand = task.candidate
    tid = task_id(repo, cand.generator, task)
    if snapshot == "dir":
        repo_snapshot = records.dir_snapshot(task.start_tree, out, f"repos/{tid}")
    else:
        repo_snapshot = records.archive_snapshot(task.start_tree)
    prompt = cand.prompt(task.failures)
    patch = solution_patch(task.start_tree, task.reference_tree)
    difficulty = {k: float(v) for k, v in cand.features.items()}
    difficulty.update(
        tests_affected=float(len(task.fail_to_pass)),
        pass_to_pass=float(len(task.pass_to_pass)),
        patch_lines=float(sum(1 for line in patch.splitlines() if line[:1] in "+-")),
        prompt_chars=float(len(prompt)),
    )
    return records.TaskRecord(
        task_id=tid,
        split=split,
        family=repo.family,
        category=cand.category,
        generator=cand.generator,
        prompt=prompt,
        repo=repo_snapshot,
        hidden_tests=dict(sorted(task.hidden_tests.items())),
        setup_commands=list(repo.setup_commands),
        test_framework=repo.test_framework,
        test_command=repo.test_command,
        fail_to_pass=task.fail_to_pass,
        pass_to_pass=task.pass_to_pass,
        solution_patch=patch,
        difficulty=difficulty,
        provenance=records.Provenance(
            source=repo.source,
            repo=repo.repo,
            module=repo.target_files.get(cand.file, ""),
            file=cand.file,
            symbol=cand.symbol,
        ),
        environment=environment,
        validation={
            "seconds": round(task.seconds, 3),
            "test_seconds": round(task.test_seconds, 3),
            "runs": runs,
            "flaky_dropped": task.flaky_dropped,
            # What the starting state's failing tests reported (a few, truncated):
            # bug reports are written from it, and RL feedback can use it.
            "failures": [[t, detail[-1500:]] for t, detail in task.failures[:5]],
        },
    )


def build_repo(
    repo: SourceRepo,
    config: BuildConfig,
    *,
    seen: set[str],
    lock: threading.Lock,
    budget: Callable[[], bool] = lambda: True,
    reference: Any = None,
) -> RepoResult:
    """Generates and validates one repository's tasks.

    Args:
      repo: the working repository.
      config: build settings.
      seen: starting-state hashes already accepted (shared; guarded by ``lock``).
      lock: guards ``seen``.
      budget: returns False once the build has enough tasks.
      reference: a ``contamination.ReferenceIndex`` of the training tasks; a task whose
        solution overlaps it above ``config.decontaminate_threshold`` is rejected.

    Returns:
      The repository's records and rejections.
    """
    began = time.monotonic()
    result = RepoResult(repo)
    validator = validation.RepoValidator(repo, validation.ValidationConfig(runs=config.runs))
    rejected = validator.baseline()
    result.baseline_seconds = validator.baseline_seconds
    if rejected is not None:
        result.rejections.append(
            {
                "repo": repo.name,
                "generator": "",
                "reason": rejected.reason,
                "detail": rejected.detail,
            }
        )
        result.seconds = time.monotonic() - began
        return result
    # Round-robin over generators, so a per-repository cap keeps every kind of task.
    # The generator order is shuffled per repository too: with a per-repository cap
    # the first generators of a fixed order would always win.
    names = list(config.generators or generators.names())
    random.Random(f"{config.seed}:{repo.name}").shuffle(names)
    queues = {}
    for name in names:
        with _AST_LOCK:
            candidates = generators.get(name).fn(repo)
        random.Random(f"{config.seed}:{repo.name}:{name}").shuffle(candidates)
        queues[name] = iter(candidates[: config.max_attempts])
    accepted: collections.Counter = collections.Counter()
    while queues and budget():
        for name in list(queues):
            cand = next(queues[name], None)
            if cand is None or accepted[name] >= config.generator_caps.get(
                name, config.max_per_generator
            ):
                del queues[name]
                continue
            if not budget() or (config.max_per_repo and len(result.tasks) >= config.max_per_repo):
                queues.clear()
                break
            outcome = validator.validate(cand)
            if isinstance(outcome, validation.ValidatedTask):
                key = records.tree_hash({**outcome.start_tree, **outcome.hidden_tests})
                with lock:
                    duplicate = key in seen
                    seen.add(key)
                if duplicate:
                    outcome = validation.Rejection("duplicate")
            if isinstance(outcome, validation.Rejection):
                result.rejections.append(
                    {
                        "repo": repo.name,
                        "generator": name,
                        "candidate": cand.description,
                        "reason": outcome.reason,
                        "detail": outcome.detail[:500],
                    }
                )
                continue
            record = make_record(
                repo,
                outcome,
                split=config.split,
                out=config.out,
                snapshot=config.snapshot,
                environment=validator.environment,
                runs=config.runs,
            )
            if reference is not None:
                overlap = reference.overlap(record)
                if overlap > config.decontaminate_threshold:
                    result.rejections.append(
                        {
                            "repo": repo.name,
                            "generator": name,
                            "candidate": cand.description,
                            "reason": "contaminated",
                            "detail": f"solution overlap {overlap:.2f} with the training data",
                        }
                    )
                    continue
            result.tasks.append(record)
            accepted[name] += 1
    result.seconds = time.monotonic() - began
    return result


def iter_repos(config: BuildConfig, failures: list[dict[str, Any]]) -> Iterator[SourceRepo]:
    """The repositories named by ``config.source`` (see ``cursor_rl.tasks.sources``).

    A repository that Autoinstall cannot set up is appended to ``failures`` (reason
    ``autoinstall_failed``, with Autoinstall's own reason and log path) instead of
    ending the build.
    """
    if config.source == "stdlib":
        yield from sources.stdlib_repos(config.split, config.modules or None)
    elif config.source == "tiny":
        yield from tiny.tiny_repos(config.split, start=config.seed)
    else:
        workdir = os.path.join(config.out, "autoinstall")
        try:
            yield sources.repo_source(config.source, workdir, autoinstall_config(config))
        except autoinstall.AutoinstallFailed as e:
            failures.append(
                {
                    "repo": config.source,
                    "generator": "",
                    "reason": "autoinstall_failed",
                    "detail": f"{e.result.reason}; log in {e.result.workdir}",
                }
            )


def check_autoinstall(config: BuildConfig) -> None:
    """Raises ValueError for an Autoinstall setting that cannot apply (module docstring)."""
    mode = config.autoinstall
    if mode not in AUTOINSTALL_MODES:
        raise ValueError(f"--autoinstall={mode!r}: must be one of {', '.join(AUTOINSTALL_MODES)}")
    if mode != "heuristic" and config.source in ("stdlib", "tiny"):
        raise ValueError(
            f"--autoinstall={mode} applies to repository sources (a path or sdist:NAME); "
            f"--source={config.source} has nothing to install"
        )
    if config.autoinstall_policy and mode != "agent":
        raise ValueError(f"--autoinstall_policy is used by --autoinstall=agent only (here {mode})")
    if mode == "agent":
        if not config.autoinstall_policy:
            raise ValueError(
                "--autoinstall=agent needs --autoinstall_policy (a trainer checkpoint, an HF "
                "directory or a built-in base such as tiny); --autoinstall=scripted runs the "
                "scripted agent without a model"
            )
        autoinstall.resolve_policy(config.autoinstall_policy)
    if config.autoinstall_max_turns < 1:
        raise ValueError(f"--autoinstall_max_turns={config.autoinstall_max_turns} must be >= 1")


def autoinstall_config(config: BuildConfig) -> autoinstall.AutoinstallConfig:
    """Autoinstall's settings for ``config.autoinstall`` (the agent mode loads its model)."""
    if config.autoinstall == "scripted":
        agent = autoinstall.scripted_agent(max_turns=config.autoinstall_max_turns)
    elif config.autoinstall == "agent":
        agent = autoinstall.model_agent(
            config.autoinstall_policy, max_turns=config.autoinstall_max_turns, seed=config.seed
        )
    else:
        agent = None
    return autoinstall.AutoinstallConfig(agent=agent)


def build(config: BuildConfig, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Builds the dataset described by ``config`` into ``config.out``.

    Returns:
      The statistics also written to ``stats.json``.

    Raises:
      ValueError: a setting that cannot apply (split, generator, Autoinstall mode),
        before anything is built.
    """
    if config.split not in splits.SPLITS:
        raise ValueError(f"--split must be one of {splits.SPLITS}")
    check_autoinstall(config)
    for name in (*config.generators, *config.generator_caps):
        generators.get(name)  # fail early on a typo
    os.makedirs(config.out, exist_ok=True)
    began = time.monotonic()
    seen: set[str] = set()
    lock = threading.Lock()
    accepted = [0]
    results: list[RepoResult] = []
    source_failures: list[dict[str, Any]] = []

    def budget() -> bool:
        return not config.count or accepted[0] < config.count

    reference = None
    if config.decontaminate_against or config.decontaminate_corpus:
        train = (
            records.load_tasks(config.decontaminate_against) if config.decontaminate_against else []
        )
        documents = [text for task in train for _, text in contamination.task_documents(task)]
        for spec in config.decontaminate_corpus:
            documents += [text for _, text in contamination.corpus_documents(spec)]
        reference = contamination.ReferenceIndex(documents)
        log(f"decontaminating against {len(train)} training tasks and {len(documents)} documents")

    def run(repo: SourceRepo) -> RepoResult:
        try:
            result = build_repo(
                repo, config, seen=seen, lock=lock, budget=budget, reference=reference
            )
        except Exception:  # one repository must not end the build; its tasks are lost
            with _AST_LOCK:
                detail = traceback.format_exc()[-2000:]
            result = RepoResult(repo)
            result.rejections.append(
                {"repo": repo.name, "generator": "", "reason": "crashed", "detail": detail}
            )
        with lock:
            accepted[0] += len(result.tasks)
        log(
            f"{repo.name}: {len(result.tasks)} tasks, {len(result.rejections)} rejected, "
            f"{result.seconds:.1f}s"
        )
        return result

    with futures.ThreadPoolExecutor(max(1, config.workers)) as pool:
        pending: dict[futures.Future, int] = {}
        order = 0
        repos = iter_repos(config, source_failures)
        while True:
            while budget() and len(pending) < max(1, config.workers):
                repo = next(repos, None)
                if repo is None:
                    break
                pending[pool.submit(run, repo)] = order
                order += 1
            if not pending:
                break
            done, _ = futures.wait(pending, return_when=futures.FIRST_COMPLETED)
            for future in done:
                pending.pop(future)
                results.append(future.result())
    results.sort(key=lambda r: r.repo.name)
    for failure in source_failures:
        log(f"{failure['repo']}: {failure['reason']} ({failure['detail']})")
    tasks = [t for r in results for t in r.tasks]
    if config.count:
        tasks = tasks[: config.count]
    records.write_tasks(tasks, os.path.join(config.out, records.TASKS_FILE))
    with open(os.path.join(config.out, REJECTIONS_FILE), "w", encoding="utf-8") as f:
        for failure in source_failures:
            f.write(json.dumps(failure) + "\n")
        for r in results:
            for rejection in r.rejections:
                f.write(json.dumps(rejection) + "\n")
    stats = summarize(config, results, tasks, time.monotonic() - began)
    for failure in source_failures:
        stats["rejections"][failure["reason"]] = stats["rejections"].get(failure["reason"], 0) + 1
    with open(os.path.join(config.out, STATS_FILE), "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=2, sort_keys=True)
    return stats


def summarize(
    config: BuildConfig,
    results: Sequence[RepoResult],
    tasks: Sequence[records.TaskRecord],
    seconds: float,
) -> dict[str, Any]:
    """Counts and timings of a build."""
    count = collections.Counter
    seconds_per_task = [t.validation["seconds"] for t in tasks]
    by_generator: dict[str, collections.Counter] = collections.defaultdict(count)
    for r in results:
        for rejection in r.rejections:
            by_generator[rejection["generator"] or "(repository)"][rejection["reason"]] += 1
    return {
        "source": config.source,
        "split": config.split,
        "tasks": len(tasks),
        "repositories": len(results),
        "by_category": dict(count(t.category for t in tasks)),
        "by_generator": dict(count(t.generator for t in tasks)),
        "by_source": dict(count(t.provenance.module or t.provenance.repo for t in tasks)),
        "rejections": dict(count(rej["reason"] for r in results for rej in r.rejections)),
        "rejections_by_generator": {k: dict(v) for k, v in sorted(by_generator.items())},
        "seconds": {
            "total": round(seconds, 1),
            "baseline_total": round(sum(r.baseline_seconds for r in results), 1),
            "validation_per_task_mean": round(
                sum(seconds_per_task) / max(1, len(seconds_per_task)), 3
            ),
            "validation_per_task_max": round(max(seconds_per_task, default=0.0), 3),
            "test_seconds_per_task_mean": round(
                sum(t.validation["test_seconds"] for t in tasks) / max(1, len(tasks)), 3
            ),
        },
    }


def format_stats(stats: dict[str, Any]) -> str:
    """A human-readable summary of ``stats``."""
    lines = [
        f"{stats['tasks']} tasks from {stats['repositories']} repositories "
        f"({stats['source']}, split {stats['split']}) in {stats['seconds']['total']}s"
    ]
    for key in ("by_category", "by_generator", "by_source", "rejections"):
        items = sorted(stats[key].items(), key=lambda kv: (-kv[1], kv[0]))
        lines.append(f"  {key}: " + ", ".join(f"{k}={v}" for k, v in items))
    s = stats["seconds"]
    lines.append(
        f"  validation: {s['validation_per_task_mean']}s mean, {s['validation_per_task_max']}s "
        f"max per task; tests {s['test_seconds_per_task_mean']}s mean; baselines "
        f"{s['baseline_total']}s"
    )
    return "\n".join(lines)


def _split_list(value: str | None) -> tuple[str, ...]:
    return tuple(v for v in (value or "").split(",") if v)


def main(argv: Iterable[str] | None = None) -> int:
    """Command-line entry point (flags as in the module docstring)."""
    fv = flags.FlagValues()
    flags.DEFINE_string(
        "source", None, "stdlib, tiny, a repository path or sdist:NAME", flag_values=fv
    )
    flags.DEFINE_string("out", None, "Dataset directory to write.", flag_values=fv)
    flags.DEFINE_enum(
        "split", "train", list(splits.SPLITS), "Which split to build.", flag_values=fv
    )
    flags.DEFINE_string(
        "generators", "", "Comma-separated generator names (default all).", flag_values=fv
    )
    flags.DEFINE_integer(
        "max_per_generator", 2, "Tasks per repository and generator.", flag_values=fv
    )
    flags.DEFINE_list(
        "generator_caps", [], "NAME=N overrides of --max_per_generator.", flag_values=fv
    )
    flags.DEFINE_integer(
        "max_attempts", 8, "Candidates tried per repository and generator.", flag_values=fv
    )
    flags.DEFINE_integer("max_per_repo", 0, "Tasks per repository (0: no cap).", flag_values=fv)
    flags.DEFINE_integer("count", 0, "Stop after this many tasks (0: no cap).", flag_values=fv)
    flags.DEFINE_string(
        "modules", "", "Comma-separated stdlib modules (default: the split).", flag_values=fv
    )
    flags.DEFINE_integer("seed", 0, "Candidate order; tiny: first seed offset.", flag_values=fv)
    flags.DEFINE_integer("workers", 2, "Repositories validated in parallel.", flag_values=fv)
    flags.DEFINE_integer("runs", 2, "Runs per state (flaky tests are dropped).", flag_values=fv)
    flags.DEFINE_enum(
        "snapshot", "archive", ["archive", "dir"], "How repositories are stored.", flag_values=fv
    )
    flags.DEFINE_string(
        "decontaminate_against", "", "Drop tasks overlapping this train dataset.", flag_values=fv
    )
    flags.DEFINE_multi_string(
        "decontaminate_corpus", [], "Drop tasks overlapping this corpus spec.", flag_values=fv
    )
    flags.DEFINE_float("decontaminate_threshold", 0.5, "Overlap threshold.", flag_values=fv)
    flags.DEFINE_enum(
        "autoinstall",
        "heuristic",
        list(AUTOINSTALL_MODES),
        "How a repository source is installed: heuristic (its build files), agent (the "
        "model of --autoinstall_policy in the sandbox) or scripted (the scripted agent); "
        "both agents fall back to the heuristic.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "autoinstall_policy",
        "",
        "The agent mode's model: a trainer checkpoint, an HF directory or a built-in base.",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "autoinstall_max_turns", 30, "Agent turns before it is cut off.", flag_values=fv
    )
    try:
        fv(list(argv if argv is not None else sys.argv))
    except flags.Error as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not fv.source or not fv.out:
        print("--source and --out are required", file=sys.stderr)
        return 2
    config = BuildConfig(
        source=fv.source,
        out=fv.out,
        split=fv.split,
        generators=_split_list(fv.generators),
        max_per_generator=fv.max_per_generator,
        generator_caps={
            name: int(cap) for name, _, cap in (item.partition("=") for item in fv.generator_caps)
        },
        max_attempts=fv.max_attempts,
        max_per_repo=fv.max_per_repo,
        count=fv.count,
        modules=_split_list(fv.modules),
        seed=fv.seed,
        workers=fv.workers,
        runs=fv.runs,
        snapshot=fv.snapshot,
        decontaminate_against=fv.decontaminate_against,
        decontaminate_corpus=tuple(fv.decontaminate_corpus),
        decontaminate_threshold=fv.decontaminate_threshold,
        autoinstall=fv.autoinstall,
        autoinstall_policy=fv.autoinstall_policy,
        autoinstall_max_turns=fv.autoinstall_max_turns,
    )
    try:
        check_autoinstall(config)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    stats = build(config)
    print(format_stats(stats))
    return 0 if stats["tasks"] else 1


if __name__ == "__main__":
    sys.exit(main())
