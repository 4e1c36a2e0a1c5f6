"""Copy probe on saved checkpoints: does a checkpoint copy from its context?

    python -m cursor_rl.eval.probes --workdir=/tmp/tiny --stage=pretrain
    python -m cursor_rl.eval.probes --checkpoint=/tmp/tiny/sft/checkpoints/150

The probe itself (its rows, its score and why they are built that way) is
``cursor_rl.train.copy_probe``, which the training loop also logs; this module
restores checkpoints and runs it on them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import app, flags

from cursor_rl import checkpoints
from cursor_rl.sampler import weights  # the sampler's params-only restore
from cursor_rl.train.copy_probe import (  # the probe itself; this module is its CLI
    DEFAULT_LOW,
    check_lengths,
    copy_score,
    repeat_rows,
    score,
)
from cursor_rl.workdir import Workdir

__all__ = ["DEFAULT_LOW", "check_lengths", "copy_score", "repeat_rows", "score"]


def checkpoint_paths(workdir: Workdir | str, stage: str) -> list[str]:
    """The finalised step directories of ``workdir``'s ``stage``, oldest first."""
    directory = Workdir.of(workdir).checkpoint_dir(stage)
    steps = checkpoints.finalised_steps(directory)
    if not steps:
        raise FileNotFoundError(f"no finalised checkpoints of stage {stage!r} under {directory}")
    return [os.fspath(directory / str(step)) for step in steps]


def probe_checkpoint(path: str, **row_kwargs: Any) -> dict[str, float]:
    """Restores the parameters of checkpoint ``path`` and runs ``copy_score`` on them."""
    config = checkpoints.model_config_from_metadata(checkpoints.read_metadata(path), path)
    variables, _ = weights.restore_checkpoint(path, config, None)
    return copy_score(config, variables, **row_kwargs)


def define_flags() -> None:
    """Defines the command-line flags (only when run as a program: no clashes on import)."""
    flags.DEFINE_string("workdir", None, "A run's workdir: probe every checkpoint of --stage.")
    flags.DEFINE_string("stage", "pretrain", "The stage whose checkpoints --workdir probes.")
    flags.DEFINE_multi_string("checkpoint", [], "Checkpoint step directories to probe.")
    flags.DEFINE_integer("rows", 16, "Rows of repeated sequences.")
    flags.DEFINE_integer("seq_len", 256, "Row length.")
    flags.DEFINE_integer("seed", 0, "Row seed (the same rows for every checkpoint).")
    flags.DEFINE_integer("min_len", 8, "Shortest random sequence.")
    flags.DEFINE_integer("max_len", 60, "Longest random sequence (2 x max_len < seq_len).")
    flags.DEFINE_integer("low", DEFAULT_LOW, "First token id drawn (choice 3).")
    flags.DEFINE_integer("high", None, "One past the last id drawn; default the vocabulary.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    paths = list(f.checkpoint)
    if f.workdir:
        paths += checkpoint_paths(f.workdir, f.stage)
    if not paths:
        raise app.UsageError("give --workdir (with --stage) or --checkpoint")
    settings = dict(
        rows=f.rows, seq_len=f.seq_len, seed=f.seed, min_len=f.min_len, max_len=f.max_len,
        low=f.low, high=f.high,
    )  # fmt: skip
    try:  # bad lengths are a usage error, before any checkpoint is read
        check_lengths(f.seq_len, f.min_len, f.max_len)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    for path in paths:
        r = probe_checkpoint(path, **settings)
        print(
            f"{path}: copy_accuracy {r['copy_accuracy']:.3f} copy_nll {r['copy_nll']:.2f} "
            f"({r['scored_tokens']} tokens; chance {r['chance_accuracy']:.4f}, "
            f"{-np.log(r['chance_accuracy']):.2f} nats)",
            flush=True,
        )


if __name__ == "__main__":
    define_flags()
    app.run(main)
