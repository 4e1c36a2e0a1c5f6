"""From token sequences to packed, fixed-shape training rows.

Every training example (a pretraining document, an SFT conversation) becomes three
aligned int32 arrays before packing:

- ``tokens``: the model input, ids ``x[0 .. n-2]``;
- ``targets``: the next token, ids ``x[1 .. n-1]`` — the shift happens here, on the
  data side, per example, so a packed row never asks a document's last token to
  predict the next document's first one;
- ``loss_mask``: 1 where ``targets`` is trained (every token for pretraining; only
  the assistant's own tokens for SFT).

Examples longer than ``seq_len`` are cut into ``seq_len`` chunks (each chunk becomes
its own segment, positions restarting at 0), or truncated (``max_chunks=1``). The
chunks are then packed into rows by grain's first-fit or best-fit packer, which adds
``segment_ids`` (1..k per example within a row, 0 = padding) and ``positions``
(0-based within each segment). Padding has ``loss_mask`` 0.

A batch is a dict of int32 NumPy arrays ``[rows, seq_len]`` named ``BATCH_KEYS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

BATCH_KEYS = ("tokens", "targets", "loss_mask", "segment_ids", "positions")
_PACKED_KEYS = ("tokens", "targets", "loss_mask")
PACKING_STRATEGIES = ("first_fit", "best_fit")

Example = dict[str, np.ndarray]


def example_from_ids(ids: Sequence[int], mask: Sequence[int] | None = None) -> Example | None:
    """Shifts one token sequence into an (inputs, targets, loss_mask) example.

    Args:
      ids: the full token sequence of one document or conversation.
      mask: per-token train mask aligned with ``ids`` (1 = a token the model should
        learn to produce); None trains every token.

    Returns:
      The example, or None when there is nothing to train (fewer than 2 tokens, or
      no masked target).
    """
    ids = np.asarray(ids, dtype=np.int32)
    if ids.shape[0] < 2:
        return None
    if mask is None:
        loss_mask = np.ones(ids.shape[0] - 1, dtype=np.int32)
    else:
        mask = np.asarray(mask, dtype=np.int32)
        if mask.shape != ids.shape:
            raise ValueError(f"loss mask length {mask.shape[0]} != token length {ids.shape[0]}")
        loss_mask = mask[1:]
        if not loss_mask.any():
            return None
    return {"tokens": ids[:-1], "targets": ids[1:], "loss_mask": loss_mask}


def split_example(example: Example, seq_len: int, max_chunks: int | None = None) -> list[Example]:
    """Cuts an example into pieces of at most ``seq_len``; drops pieces with no loss.

    Args:
      example: an example from ``example_from_ids``.
      seq_len: the row length.
      max_chunks: keep at most this many leading chunks (1 = truncate); None keeps all.

    Returns:
      The chunks, in order.
    """
    starts = range(0, example["tokens"].shape[0], seq_len)
    if max_chunks is not None:
        starts = starts[:max_chunks]
    chunks = [{k: v[start : start + seq_len] for k, v in example.items()} for start in starts]
    return [chunk for chunk in chunks if chunk["loss_mask"].any()]


class SplitToSeqLen(grain.experimental.FlatMapTransform):
    """grain flat-map: one example in, its ``seq_len`` chunks out."""

    def __init__(self, seq_len: int, max_chunks: int | None = None):
        self.seq_len = seq_len
        self.max_chunks = max_chunks
        # Only consulted by grain's MapDataset flat-map; the IterDataset one is unbounded.
        self.max_fan_out = 1 << 16

    def flat_map(self, element: Example) -> list[Example]:
        return split_example(element, self.seq_len, self.max_chunks)


def _rename_packed(batch: dict[str, Any]) -> dict[str, np.ndarray]:
    # grain names the packing metadata after each packed feature; all three agree.
    return {
        "tokens": batch["tokens"].astype(np.int32),
        "targets": batch["targets"].astype(np.int32),
        "loss_mask": batch["loss_mask"].astype(np.int32),
        "segment_ids": batch["tokens_segment_ids"].astype(np.int32),
        "positions": batch["tokens_positions"].astype(np.int32),
    }


def pack_and_batch(
    examples: grain.IterDataset,
    *,
    seq_len: int,
    batch_size: int,
    strategy: str = "first_fit",
    num_packing_bins: int = 0,
    pad_id: int = 0,
    seed: int = 0,
) -> grain.IterDataset:
    """Packs chunked examples into ``seq_len`` rows and batches them.

    Args:
      examples: examples no longer than ``seq_len`` (see ``SplitToSeqLen``).
      seq_len: the row length.
      batch_size: rows per batch (the per-process batch).
      strategy: ``first_fit`` (fill bins in arrival order) or ``best_fit`` (the bin
        left with the least room; less padding for mixed lengths).
      num_packing_bins: rows packed at a time; more bins, less padding, more mixing
        of far-apart examples. 0 means ``4 * batch_size``.
      pad_id: the id written into padded ``tokens``/``targets`` (masked anyway).
      seed: seeds grain's shuffle of the packed rows.

    Returns:
      An IterDataset of batch dicts (``BATCH_KEYS``, int32 ``[batch_size, seq_len]``).
    """
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(f"data.packing={strategy!r}: must be one of {PACKING_STRATEGIES}")
    packer = {
        "first_fit": grain.experimental.FirstFitPackIterDataset,
        "best_fit": grain.experimental.BestFitPackIterDataset,
    }[strategy]
    packed = packer(
        examples,
        length_struct={k: seq_len for k in _PACKED_KEYS},
        num_packing_bins=num_packing_bins or 4 * batch_size,
        seed=seed,
        shuffle_bins=True,
        padding_struct={"tokens": pad_id, "targets": pad_id, "loss_mask": 0},
    )
    return packed.batch(batch_size, drop_remainder=True).map(_rename_packed)
