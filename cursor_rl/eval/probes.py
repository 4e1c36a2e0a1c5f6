"""Copy probe: does a checkpoint copy from its context?

    python -m cursor_rl.eval.probes --workdir=/tmp/tiny --stage=pretrain
    python -m cursor_rl.eval.probes --checkpoint=/tmp/tiny/sft/checkpoints/150

Every held-out coding task names, in its prompt, a file, function or constant that
the answer must repeat. A model that cannot copy a token it has just seen solves
none of them, so RL has no reward to work with. This probe measures that ability
directly, for any checkpoint, in one forward pass.

Choices:

1. **Repeated random tokens of varying length.** Each document is ``n`` token ids
   drawn uniformly (``n`` in ``[min_len, max_len]``), then the same ``n`` again.
   Rows are packed with segment ids and reset positions. The lengths vary because a
   repeat of fixed length can be copied by looking a fixed distance back, which is
   positional and not the content-based copying (induction) that tasks need. A
   fixed-length version looked solved in a bare loop, while the same model scored
   at chance once the lengths varied.
2. **Scored on the repeat after its first token.** The first token of the repeat
   cannot be predicted (the document could have gone on), so it is not scored; nor
   is anything in the first half. ``copy_accuracy`` is the argmax hit rate and
   ``copy_nll`` the mean negative log-likelihood (nats) on the scored tokens. Chance
   is about ``1 / (vocab - low)`` accuracy and ``log(vocab - low)`` nats.
3. **Only ordinary trained ids are drawn**: ``[low, high)``. ``low`` defaults to the
   number of special tokens, which a tokenizer trained here puts first; ``high`` to
   the model's vocabulary. For a loaded HF tokenizer (special tokens elsewhere) or a
   model vocabulary padded past the tokenizer's, pass the range that holds the
   ordinary tokens.
4. **Deterministic for a seed**, so two checkpoints are compared on the same rows.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from cursor_rl import checkpoints, model
from cursor_rl.data.tokenizer import SPECIAL_TOKENS
from cursor_rl.model.config import ModelConfig
from cursor_rl.workdir import Workdir

DEFAULT_LOW = len(SPECIAL_TOKENS)  # choice 3: a tokenizer trained here puts them first
_KEYS = ("tokens", "targets", "positions", "segment_ids", "score_mask")
_forward = jax.jit(model.forward, static_argnums=0)  # once per (hashable) model config


def check_lengths(seq_len: int, min_len: int, max_len: int) -> None:
    """Raises ValueError unless ``[min_len, max_len]`` is a range whose doubles fit a row."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    if 2 * max_len + 1 > seq_len:
        raise ValueError(f"seq_len={seq_len} cannot hold a doubled sequence of {max_len}")


def repeat_rows(
    vocab_size: int,
    *,
    rows: int = 16,
    seq_len: int = 256,
    min_len: int = 8,
    max_len: int = 60,
    low: int = DEFAULT_LOW,
    high: int | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Packed rows of repeated random sequences (choice 1) and the scored positions.

    Returns:
      int32 ``[rows, seq_len]`` arrays: ``tokens``, ``targets`` (the next token),
      ``positions``, ``segment_ids`` (0 = padding) and ``score_mask`` (1 where the
      target is a repeat token after the repeat's first, choice 2).
    """
    check_lengths(seq_len, min_len, max_len)
    high = vocab_size if high is None else high
    if not 0 <= low < high - 1 or high > vocab_size:
        raise ValueError(
            f"token ids [low={low}, high={high}) must hold at least two ids of the "
            f"vocabulary of {vocab_size}"
        )
    rng = np.random.default_rng(seed)
    out = {k: np.zeros((rows, seq_len), np.int32) for k in _KEYS}
    for row in range(rows):
        start, segment = 0, 1
        while True:
            n = int(rng.integers(min_len, max_len + 1))
            if start + 2 * n > seq_len:
                break
            half = rng.integers(low, high, n)
            doc = np.concatenate([half, half])
            span = slice(start, start + 2 * n - 1)  # 2n tokens give 2n - 1 targets
            out["tokens"][row, span] = doc[:-1]
            out["targets"][row, span] = doc[1:]
            out["positions"][row, span] = np.arange(2 * n - 1)
            out["segment_ids"][row, span] = segment
            # Target index i predicts doc[i + 1]; doc[n] (the repeat's first) is i = n - 1.
            out["score_mask"][row, start + n : start + 2 * n - 1] = 1
            start, segment = start + 2 * n - 1, segment + 1
    return out


def score(logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """Argmax accuracy and mean NLL of ``targets`` where ``mask`` is 1 (choice 2)."""
    keep = np.asarray(mask, bool)
    if not keep.any():
        raise ValueError("no scored positions")
    # Only the scored rows, in float64: [N, V] rather than [rows, seq, V].
    logits = np.asarray(logits)[keep].astype(np.float64)
    targets = np.asarray(targets)[keep]
    top = logits.max(-1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
    target_logit = np.take_along_axis(logits, targets[:, None], -1)[:, 0]
    return {
        "copy_accuracy": float((logits.argmax(-1) == targets).mean()),
        "copy_nll": float((log_z - target_logit).mean()),
        "scored_tokens": int(keep.sum()),
    }


def copy_score(
    config: ModelConfig,
    variables: Any,
    *,
    low: int = DEFAULT_LOW,
    high: int | None = None,
    **row_kwargs: Any,
) -> dict[str, float]:
    """The copy probe of ``variables`` (other ``repeat_rows`` arguments pass through)."""
    high = config.vocab_size if high is None else high
    batch = repeat_rows(config.vocab_size, low=low, high=high, **row_kwargs)
    logits = _forward(
        config,
        variables,
        jnp.asarray(batch["tokens"]),
        positions=jnp.asarray(batch["positions"]),
        segment_ids=jnp.asarray(batch["segment_ids"]),
    )
    result = score(np.asarray(logits), batch["targets"], batch["score_mask"])
    return {**result, "chance_accuracy": 1.0 / (high - low)}


def checkpoint_paths(workdir: Workdir | str, stage: str) -> list[str]:
    """The finalised step directories of ``workdir``'s ``stage``, oldest first."""
    directory = Workdir.of(workdir).checkpoint_dir(stage)
    steps = checkpoints.finalised_steps(directory)
    if not steps:
        raise FileNotFoundError(f"no finalised checkpoints of stage {stage!r} under {directory}")
    return [os.fspath(directory / str(step)) for step in steps]


def probe_checkpoint(path: str, **row_kwargs: Any) -> dict[str, float]:
    """Restores the parameters of checkpoint ``path`` and runs ``copy_score`` on them."""
    from cursor_rl.sampler import weights  # the sampler's params-only restore

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
