"""A run's task datasets: given paths, or built once into its workdir.

Without explicit dataset directories, the family (``tiny`` by default) is built by
the task factory (``cursor_rl.tasks.build``) into ``WORKDIR/tasks/{train,bench}``:
the same generators, sandbox validation and records as any dataset. A finished
build leaves its ``stats.json``; a directory without it (an interrupted build) is
built again. The benchmark is decontaminated against the training tasks and against
the pretraining corpus's sources of the same family (``family_corpus``: e.g. the
``tiny:64`` modules a tiny run pretrains on).

Sandboxes need the datasets on local disk: with a remote (``gs://``) workdir they are
built in the workdir's local cache and copied to the workdir, and a job that finds
them in the workdir but not locally (a restart elsewhere) copies them back
(``cursor_rl.workdir.Workdir.publish`` / ``fetch``).

Pure Python, no JAX.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence

from cursor_rl.tasks import build, contamination, records
from cursor_rl.workdir import Workdir, is_remote


def is_built(directory: str) -> bool:
    """Whether ``directory`` holds a finished dataset build."""
    return os.path.exists(os.path.join(directory, build.STATS_FILE)) and os.path.exists(
        os.path.join(directory, records.TASKS_FILE)
    )


def family_corpus(sources: Sequence[str], family: str) -> tuple[str, ...]:
    """The pretraining corpus specs (``data.sources``) drawn from the task family itself.

    A ``tiny`` bench is checked against a ``tiny`` or ``tiny:N`` corpus: its modules share
    the family's templates, so a benchmark function can occur whole in them (with
    ``tiny``'s 4,096 modules, 11 of a 32-task bench did, 2026-12-07). Other families'
    sources are left to the contamination command, which streams them: indexing the
    standard library in memory took 26 s and 0.6 GB, and a tiny bench's mean overlap with
    it is 0.05, none near the tiny threshold (2026-12-07).
    """
    return tuple(s for s in sources if s.split(":", 1)[0] == family)


def ensure_datasets(
    workdir: Workdir | str,
    *,
    family: str = "tiny",
    train: str = "",
    bench: str = "",
    train_count: int = 256,
    bench_count: int = 64,
    seed: int = 0,
    generators: tuple[str, ...] = (),
    max_per_generator: int = 2,
    decontaminate_corpus: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> tuple[str, str]:
    """Directories of the train and bench datasets, building what is missing.

    Args:
      workdir: the run's workdir (datasets go to ``WORKDIR/tasks/<split>``).
      family: the task source to build from (``tiny``, ``stdlib``, ...).
      train, bench: existing dataset directories to use instead (must be built).
      train_count, bench_count: tasks to build per split.
      seed: the build seed.
      generators: generator names (empty: all registered), e.g. one category only.
      max_per_generator: tasks per repository and generator.
      decontaminate_corpus: pretraining corpus specs the benchmark is also checked
        against (``family_corpus``); the training tasks always are.
      log: progress messages.

    Returns:
      The local directories of the train and bench datasets.
    """
    workdir = Workdir.of(workdir)
    built = (build.STATS_FILE,)  # copied last: its presence says the copy is whole
    train_dir = train or workdir.local_path(workdir.tasks_dir("train"))
    bench_dir = bench or workdir.local_path(workdir.tasks_dir("bench"))
    for split, directory, count, given in (
        ("train", train_dir, train_count, bool(train)),
        ("bench", bench_dir, bench_count, bool(bench)),
    ):
        if given:
            if is_remote(directory):
                raise ValueError(
                    f"rl.tasks.{split}={directory}: sandboxes need a local dataset directory"
                )
            if not is_built(directory):
                raise FileNotFoundError(
                    f"{directory} is not a task dataset (no {records.TASKS_FILE} and "
                    f"{build.STATS_FILE}); build one with python -m cursor_rl.tasks.build"
                )
            continue
        if is_built(directory):
            continue
        shutil.rmtree(directory, ignore_errors=True)
        if workdir.fetch(workdir.tasks_dir(split), last=built) and is_built(directory):
            log(f"copied the {split} tasks from {workdir.tasks_dir(split)} to {directory}")
            continue
        shutil.rmtree(directory, ignore_errors=True)
        log(f"building {count} {family} {split} tasks into {directory}")
        build.build(
            build.BuildConfig(
                source=family,
                out=directory,
                split=split,
                count=count,
                seed=seed,
                generators=tuple(generators),
                max_per_generator=max_per_generator,
                max_per_repo=4,
                decontaminate_against=train_dir if split == "bench" else "",
                decontaminate_corpus=tuple(decontaminate_corpus) if split == "bench" else (),
                decontaminate_threshold=contamination.threshold_for(family),
                workers=2,
            ),
            log=lambda line: None,
        )
        workdir.publish(workdir.tasks_dir(split), last=built)
    return train_dir, bench_dir
