"""From token sequences to packed, fixed-shape training rows: the one packer.

Every training example (a pretraining document, an SFT conversation, an RL
episode's context window) becomes aligned per-token arrays before packing:

- ``tokens``: the model input, ids ``x[0 .. n-2]``;
- ``targets``: the next token, ids ``x[1 .. n-1]`` — the shift happens here, on the
  data side, per example, so a packed row never asks a document's last token to
  predict the next document's first one;
- ``loss_mask``: 1 where ``targets`` is trained (every token for pretraining; only
  the assistant's own tokens for SFT and RL);
- any other per-token field a stage needs (RL: ``advantages``, the sampler's
  log-probs, a sequence id), shifted like the mask: a value belongs to the token it
  sits on, so it lands where that token is the target.

Examples longer than ``seq_len`` are cut into ``seq_len`` chunks (each chunk becomes
its own segment, positions restarting at 0), or truncated (``max_chunks=1``). The
chunks are then packed into rows by grain's first-fit or best-fit packer
(``pack_rows``), which carries every field and adds ``segment_ids`` (1..k per example
within a row, 0 = padding) and ``positions`` (0-based within each segment). Padding
has ``loss_mask`` 0. Pretraining and SFT pack a stream (``pack_and_batch``); RL packs
one rollout batch's finite list of sequences (``pack_examples``); both go through
``pack_rows``, so a row is laid out the same way in every stage.

A pretraining batch is a dict of int32 NumPy arrays ``[rows, seq_len]`` named
``BATCH_KEYS``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

BATCH_KEYS = ("tokens", "targets", "loss_mask", "segment_ids", "positions")
# The per-token fields every example has (``example_from_ids``).
EXAMPLE_KEYS = ("tokens", "targets", "loss_mask")
PACKING_STRATEGIES = ("first_fit", "best_fit")

Example = dict[str, np.ndarray]


def example_from_ids(
    ids: Sequence[int],
    mask: Sequence[int] | None = None,
    fields: Mapping[str, Sequence[Any]] | None = None,
    *,
    require_loss: bool = True,
) -> Example | None:
    """Shifts one token sequence into an (inputs, targets, loss_mask, ...) example.

    Args:
      ids: the full token sequence of one document or conversation.
      mask: per-token train mask aligned with ``ids`` (1 = a token the model should
        learn to produce); None trains every token.
      fields: more per-token values aligned with ``ids`` (NumPy-convertible, their
        dtype kept); each is shifted like the mask, onto the target it belongs to.
      require_loss: return None when no target is masked in (RL keeps such
        sequences; they weigh 0).

    Returns:
      The example, or None when there is nothing to train (fewer than 2 tokens, or
      no masked target while ``require_loss``).
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
        if require_loss and not loss_mask.any():
            return None
    example = {"tokens": ids[:-1], "targets": ids[1:], "loss_mask": loss_mask}
    for name, values in (fields or {}).items():
        if name in example:
            raise ValueError(f"field {name!r} is one of the example's own {EXAMPLE_KEYS}")
        values = np.asarray(values)
        if values.shape[:1] != ids.shape:
            raise ValueError(
                f"field {name!r} length {values.shape[0]} != token length {ids.shape[0]}"
            )
        example[name] = values[1:]
    return example


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


def pack_rows(
    examples: grain.IterDataset,
    *,
    seq_len: int,
    fields: Sequence[str] = EXAMPLE_KEYS,
    padding: Mapping[str, Any] | None = None,
    strategy: str = "first_fit",
    num_packing_bins: int,
    shuffle_rows: bool = True,
    seed: int = 0,
) -> grain.IterDataset:
    """Packs examples (each field at most ``seq_len`` long) into ``seq_len`` rows.

    Examples arrive in order; ``num_packing_bins`` rows are open at a time. Each
    example goes into the first open row with room (``first_fit``) or the fullest
    one with room (``best_fit``); one that fits in none closes the open rows (they
    are emitted) and starts the next set. Rows are emitted in the order they were
    opened, or shuffled (``shuffle_rows``, seeded).

    Args:
      examples: dicts holding at least ``fields``, all of one length per example.
      seq_len: the row length.
      fields: the per-token fields to pack (other keys are dropped); the first one
        defines ``segment_ids`` and ``positions``.
      padding: the value written into padded cells per field (default 0).
      strategy: ``first_fit`` or ``best_fit``.
      num_packing_bins: rows packed at a time.
      shuffle_rows: shuffle each set of packed rows before emitting them.
      seed: seeds that shuffle.

    Returns:
      An IterDataset of row dicts: each field (its dtype kept), ``segment_ids`` and
      ``positions`` (int32), all ``[seq_len]``.
    """
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(f"data.packing={strategy!r}: must be one of {PACKING_STRATEGIES}")
    fields = tuple(fields)
    if not fields or {"segment_ids", "positions"} & set(fields):
        raise ValueError(f"fields {fields}: need one or more, not segment_ids / positions")
    padding = dict(padding or {})
    unknown = sorted(set(padding) - set(fields))
    if unknown:
        raise ValueError(f"padding for unpacked field(s) {unknown}")
    packer = {
        "first_fit": grain.experimental.FirstFitPackIterDataset,
        "best_fit": grain.experimental.BestFitPackIterDataset,
    }[strategy]
    packed = packer(
        examples,
        length_struct={k: seq_len for k in fields},
        num_packing_bins=num_packing_bins,
        seed=seed,
        shuffle_bins=shuffle_rows,
        padding_struct={k: padding.get(k, 0) for k in fields},
    )

    def rename(row: dict[str, Any]) -> dict[str, np.ndarray]:
        # grain adds segment ids and positions per field; all fields agree.
        out = {k: row[k] for k in fields}
        out["segment_ids"] = row[f"{fields[0]}_segment_ids"].astype(np.int32)
        out["positions"] = row[f"{fields[0]}_positions"].astype(np.int32)
        return out

    return packed.map(rename)


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
    """Packs a stream of chunked examples into ``seq_len`` rows and batches them.

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
    rows = pack_rows(
        examples,
        seq_len=seq_len,
        padding={"tokens": pad_id, "targets": pad_id},
        strategy=strategy,
        num_packing_bins=num_packing_bins or 4 * batch_size,
        seed=seed,
    )
    return rows.batch(batch_size, drop_remainder=True)


def pack_examples(
    examples: Sequence[Example],
    *,
    seq_len: int,
    padding: Mapping[str, Any] | None = None,
    strategy: str = "first_fit",
) -> list[dict[str, np.ndarray]]:
    """Packs a finite list of examples, in the order given, into as few rows as it takes.

    The same packer as the pretraining stream (``pack_rows``) with every row open at
    once, so no example is ever turned away for lack of a row: with the examples
    sorted longest first, ``first_fit`` is first-fit decreasing.

    Args:
      examples: dicts with the same per-token fields, each at most ``seq_len`` long.
      seq_len: the row length.
      padding: the value written into padded cells per field (default 0).
      strategy: ``first_fit`` or ``best_fit``.

    Returns:
      The rows in the order they were opened (see ``pack_rows``); none for no examples.
    """
    if not examples:
        return []
    source = grain.MapDataset.source(list(examples)).to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    )
    rows = pack_rows(
        source,
        seq_len=seq_len,
        fields=tuple(examples[0]),
        padding=padding,
        strategy=strategy,
        num_packing_bins=len(examples),
        shuffle_rows=False,
    )
    return list(rows)
