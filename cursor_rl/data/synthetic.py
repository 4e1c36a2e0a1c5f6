"""Repeated random spans: the data that makes a small model learn to copy from context.

Every coding task names, in its prompt, a file, function or constant the answer has
to repeat, so a policy that cannot copy a token it has just seen solves none of them.
Copying is done by induction heads (Olsson et al., 2022), and they form late: after
about ``10^5.7 * sqrt(B * C)`` tokens of natural data (Aoyama et al., 2025,
arXiv 2511.16893), sooner on data with exact repeats. This module writes such data.

A *repeat document* is ``span, gap, span``: ``n`` token ids drawn uniformly, ``g``
more drawn ids, then the first ``n`` again. The second copy of the span is
predictable only by finding where the current token occurred before and reading the
token after it, which is what an induction head does. Design choices:

1. **Lengths and gaps vary** (``n`` uniform in ``[min_len, max_len]``, ``g`` uniform
   in ``[0, n]`` when ``gap`` is on), so the repeat sits at no fixed distance: a
   fixed-length repeat is solved by looking a fixed distance back, which is
   positional and not the content-based copying tasks need.
2. **Whole rows, mixed with code** (``replace_rows``): a fraction of each batch's
   rows is replaced by rows packed with repeat documents (segment ids and positions
   restart per document, like packed corpus documents). Measured on the tiny model
   (H200, bare loop, 2026-12-04): repeat rows alone never left chance in 5,000
   steps (loss stuck at log V), code alone did not copy in 19M tokens, and one row
   in four of repeats with batch 32 x 256 formed copying abruptly at ~22M tokens
   (step ~2,750) and lowered the held-out code loss as well; half the rows at batch
   16 had not formed it at 20M tokens.
3. **Loss on every token**, as for corpus documents: the random first span is
   unpredictable (it teaches only the unigram floor); the repeat carries the signal.
4. **Ordinary ids only**: ``[low, high)``, by default past the tokenizer's special
   tokens, which a tokenizer trained here puts first.
5. **Deterministic for an RNG**: the pipeline draws through grain's ``random_map``,
   whose per-element generators are seeded from the pipeline seed and the element's
   index, so a resumed iterator writes the same rows.

The copy probe (``cursor_rl.eval.probes``) scores a checkpoint on rows written here
from a separate seed.

Pure NumPy, no JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ROW_KEYS = ("tokens", "targets", "loss_mask", "segment_ids", "positions")


@dataclasses.dataclass(frozen=True)
class RepeatSpec:
    """What repeat documents look like (see the module docstring).

    Attributes:
      low: first token id drawn.
      high: one past the last id drawn.
      min_len: shortest span.
      max_len: longest span.
      gap: draw a gap of ``[0, n]`` random ids between the span and its repeat.
    """

    low: int
    high: int
    min_len: int = 8
    max_len: int = 100
    gap: bool = True

    def __post_init__(self):
        if not 0 <= self.low < self.high - 1:
            raise ValueError(
                f"token ids [low={self.low}, high={self.high}) must hold at least two ids"
            )
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")

    def longest(self) -> int:
        """Tokens of the longest document (span, largest gap, span)."""
        return (3 if self.gap else 2) * self.max_len

    def check_fits(self, seq_len: int) -> None:
        """Raises ValueError unless the longest document fits a row of ``seq_len`` targets."""
        if self.longest() > seq_len + 1:
            raise ValueError(
                f"a repeat document of up to {self.longest()} tokens (max_len={self.max_len}, "
                f"gap={self.gap}) does not fit seq_len={seq_len}"
            )


def repeat_row(
    rng: np.random.Generator, seq_len: int, spec: RepeatSpec, *, pad_id: int = 0
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One row packed with repeat documents until the next would not fit.

    Returns:
      ``(row, repeat_mask)``: ``row`` holds int32 ``[seq_len]`` arrays named
      ``ROW_KEYS`` (padding: segment 0, loss 0); ``repeat_mask`` is 1 where the
      target is a token of a repeated span after its first (the first token of a
      repeat cannot be predicted: the document could have gone on).
    """
    spec.check_fits(seq_len)
    row = {k: np.zeros(seq_len, np.int32) for k in ROW_KEYS}
    row["tokens"][:] = pad_id
    row["targets"][:] = pad_id
    repeat_mask = np.zeros(seq_len, np.int32)
    start, segment = 0, 1
    while True:
        n = int(rng.integers(spec.min_len, spec.max_len + 1))
        g = int(rng.integers(0, n + 1)) if spec.gap else 0
        length = 2 * n + g  # tokens; length - 1 targets
        if start + length - 1 > seq_len:
            break
        span = rng.integers(spec.low, spec.high, n)
        doc = np.concatenate([span, rng.integers(spec.low, spec.high, g), span])
        targets = slice(start, start + length - 1)
        row["tokens"][targets] = doc[:-1]
        row["targets"][targets] = doc[1:]
        row["loss_mask"][targets] = 1
        row["segment_ids"][targets] = segment
        row["positions"][targets] = np.arange(length - 1)
        # Target i predicts doc[i + 1]; the repeat's first token is doc[n + g].
        repeat_mask[start + n + g : start + length - 1] = 1
        start, segment = start + length - 1, segment + 1
    return row, repeat_mask


def repeat_rows(
    rows: int, seq_len: int, spec: RepeatSpec, *, seed: int, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """``rows`` rows of ``repeat_row`` stacked, plus their ``repeat_mask`` [rows, seq_len]."""
    rng = np.random.default_rng(seed)
    made = [repeat_row(rng, seq_len, spec, pad_id=pad_id) for _ in range(rows)]
    out = {k: np.stack([row[k] for row, _ in made]) for k in ROW_KEYS}
    out["repeat_mask"] = np.stack([mask for _, mask in made])
    return out


class ReplaceRows:
    """grain random map over batches: each row becomes a repeat row with probability
    ``fraction`` (choice 2); other keys of the batch pass through untouched."""

    def __init__(self, fraction: float, spec: RepeatSpec, pad_id: int):
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"repeat row fraction {fraction} must be in (0, 1]")
        self.fraction = fraction
        self.spec = spec
        self.pad_id = pad_id

    def __call__(self, batch: dict[str, np.ndarray], rng: np.random.Generator):
        rows, seq_len = batch["tokens"].shape
        self.spec.check_fits(seq_len)
        replace = rng.random(rows) < self.fraction
        if not replace.any():
            return batch
        out = {k: np.array(v, copy=True) for k, v in batch.items()}
        for r in np.flatnonzero(replace):
            row, _ = repeat_row(rng, seq_len, self.spec, pad_id=self.pad_id)
            for key in ROW_KEYS:
                out[key][r] = row[key]
        return out
