"""The copy probe: does a model copy from its context? (core; CLI: ``cursor_rl.eval.probes``)

Every held-out coding task names, in its prompt, a file, function or constant that
the answer must repeat. A model that cannot copy a token it has just seen solves
none of them, so RL has no reward to work with. This probe measures that ability
directly, in one forward pass: the pretraining loop logs it (``train.probe_every``)
and ``python -m cursor_rl.eval.probes`` runs it on any checkpoint.

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

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cursor_rl import model
from cursor_rl.chat.tokenizer import SPECIAL_TOKENS
from cursor_rl.data import synthetic
from cursor_rl.model.config import ModelConfig

DEFAULT_LOW = len(SPECIAL_TOKENS)  # choice 3: a tokenizer trained here puts them first
_KEYS = ("tokens", "targets", "positions", "segment_ids", "score_mask")
_forward = jax.jit(model.forward, static_argnums=0)  # once per (hashable) model config
# What the training loop logs as ``copy_probe``: spans of 64-120 tokens repeated right
# after themselves (so at offsets >= 64), from a seed no training row uses.
TRAINING_PROBE = dict(rows=16, seq_len=256, min_len=64, max_len=120, seed=1)


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
    spec = synthetic.RepeatSpec(low=low, high=high, min_len=min_len, max_len=max_len, gap=False)
    out = synthetic.repeat_rows(rows, seq_len, spec, seed=seed)
    out["score_mask"] = out.pop("repeat_mask")
    return {k: out[k] for k in _KEYS}


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
