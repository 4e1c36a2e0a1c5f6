"""The RL stage's task datasets: given paths, or built once into the workdir.

With ``rl.tasks.train``/``bench`` empty, the configured family is built by the task
factory (``cursor_rl.tasks.build``) into ``WORKDIR/tasks/{train,bench}``: the same
generators, sandbox validation and records as any dataset. A finished build leaves
its ``stats.json``; a directory without it (an interrupted build) is rebuilt.
"""

from __future__ import annotations

import os
import shutil

from cursor_rl.tasks import build, records


def _built(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, build.STATS_FILE)) and os.path.exists(
        os.path.join(directory, records.TASKS_FILE)
    )


def ensure_tasks(cfg, workdir: str, log=print) -> tuple[str, str]:
    """Directories of the train and bench task datasets, building what is missing."""
    t = cfg.rl.tasks
    train = t.train or os.path.join(workdir, "tasks", "train")
    bench = t.bench or os.path.join(workdir, "tasks", "bench")
    for split, directory, count, given in (
        ("train", train, int(t.train_count), bool(t.train)),
        ("bench", bench, int(t.bench_count), bool(t.bench)),
    ):
        if given:
            if not _built(directory):
                raise FileNotFoundError(
                    f"rl.tasks.{split}={directory} is not a task dataset "
                    f"(no {records.TASKS_FILE} and {build.STATS_FILE})"
                )
            continue
        if _built(directory):
            continue
        shutil.rmtree(directory, ignore_errors=True)
        log(f"[rl] building {count} {t.family} {split} tasks into {directory}")
        build.build(
            build.BuildConfig(
                source=t.family,
                out=directory,
                split=split,
                count=count,
                seed=int(t.build_seed),
                max_per_repo=4,
                # Tiny splits share templates: only a solution that occurs whole in the
                # training tasks counts as contamination (see cursor_rl.tasks.build).
                decontaminate_against=train if split == "bench" else "",
                decontaminate_threshold=0.99,
                workers=1,
            ),
            log=lambda line: None,
        )
    return train, bench
