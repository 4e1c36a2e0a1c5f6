"""The one packer: extra per-token fields ride along, and RL rows are laid out exactly
as pretraining rows for the same documents."""

import grain
import numpy as np
import pytest

from cursor_rl.chat import protocol
from cursor_rl.data import packing
from cursor_rl.rl.rollout import Episode
from cursor_rl.rl.trainer import build_batch


def test_extra_fields_are_shifted_packed_and_padded():
    """A field aligned with the ids lands on the targets (like the mask), keeps its
    dtype, shares the row's segment ids and positions, and pads with its own value."""
    first = packing.example_from_ids(
        [5, 6, 7, 8], [0, 1, 1, 0], {"score": np.array([0.5, 1.5, 2.5, 3.5], np.float32)}
    )
    second = packing.example_from_ids([9, 10, 11], None, {"score": np.full(3, 4.0, np.float32)})
    np.testing.assert_array_equal(first["score"], [1.5, 2.5, 3.5])
    rows = packing.pack_examples([first, second], seq_len=8, padding={"score": -1.0})
    assert len(rows) == 1
    (row,) = rows
    np.testing.assert_array_equal(row["tokens"], [5, 6, 7, 9, 10, 0, 0, 0])
    np.testing.assert_array_equal(row["targets"], [6, 7, 8, 10, 11, 0, 0, 0])
    np.testing.assert_array_equal(row["loss_mask"], [1, 1, 0, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 2, 2, 0, 0, 0])
    np.testing.assert_array_equal(row["positions"], [0, 1, 2, 0, 1, 0, 0, 0])
    assert row["score"].dtype == np.float32
    np.testing.assert_array_equal(row["score"], [1.5, 2.5, 3.5, 4.0, 4.0, -1, -1, -1])
    # Without require_loss a loss-free sequence is still an example (RL keeps it).
    assert packing.example_from_ids([1, 2], [1, 0]) is None
    assert packing.example_from_ids([1, 2], [1, 0], require_loss=False)["loss_mask"].sum() == 0
    with pytest.raises(ValueError, match="length"):
        packing.example_from_ids([1, 2, 3], None, {"score": [1.0, 2.0]})


def test_rl_rows_are_the_pretraining_rows_for_the_same_documents():
    """The same documents, each an RL episode of one fully trained segment and a
    pretraining example, give the same rows: RL's ``build_batch`` and the
    pretraining stream's ``pack_and_batch`` (all documents in one set of bins) pack
    through the one packer; the pretraining stream only shuffles the row order."""
    seq_len = 16
    rng = np.random.default_rng(0)
    # Mostly short documents, some filling a whole row (seq_len + 1 ids).
    lengths = [*rng.integers(2, 10, 32), *[seq_len + 1] * 4, *rng.integers(10, 17, 4)]
    docs = [rng.integers(1, 300, int(n)).tolist() for n in rng.permutation(lengths)]
    episodes = [
        Episode(
            f"t{i}",
            "feature",
            i,
            0,
            protocol.Trajectory.from_json_dict(
                {
                    "tokens": doc,
                    "loss_mask": [1] * len(doc),
                    "logprobs": [0.0] * len(doc),
                    "turns": [],
                    "segment_starts": [0],
                }
            ),
            "submitted",
        )
        for i, doc in enumerate(docs)
    ]
    rl, stats = build_batch(
        episodes, [1.0] * len(docs), seq_len=seq_len, rows_multiple=1, aggregation="token_mean"
    )
    assert stats.truncated == 0 and stats.sequences == len(docs)
    used = rl["segment_ids"].any(axis=1)
    num_rows = int(used.sum())
    assert num_rows < len(docs) and not rl["tokens"][~used].any()  # packed, padded after
    # RL feeds its sequences longest first; the pretraining stream gets that order.
    ordered = sorted(docs, key=len, reverse=True)
    examples = grain.MapDataset.source([packing.example_from_ids(d) for d in ordered])
    stream = packing.pack_and_batch(
        examples.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)),
        seq_len=seq_len,
        batch_size=num_rows,
        num_packing_bins=len(docs),
        pad_id=0,
    )
    pretrain = next(iter(stream))
    key = lambda batch, r: tuple(batch[k][r].tobytes() for k in packing.BATCH_KEYS)
    rl_rows = sorted(key(rl, r) for r in range(num_rows))
    pretrain_rows = sorted(key(pretrain, r) for r in range(num_rows))
    assert rl_rows == pretrain_rows
    # ... and they are not trivially equal: several documents share a row.
    assert rl["segment_ids"].max() >= 3
