"""Repeat rows: span, gap, span with varying lengths; mixed into pretraining batches at
the configured share, deterministically, on the train split only."""

import numpy as np
import pytest

from cursor_rl.data import synthetic

SPEC = synthetic.RepeatSpec(low=12, high=300, min_len=4, max_len=20)


def test_rows_hold_span_gap_span_documents():
    rows = synthetic.repeat_rows(6, 128, SPEC, seed=5)
    gaps, lengths = set(), set()
    for r in range(6):
        seg = rows["segment_ids"][r]
        for s in set(seg.tolist()) - {0}:
            idx = np.flatnonzero(seg == s)
            doc = np.append(rows["tokens"][r, idx], rows["targets"][r, idx[-1]])
            scored = np.flatnonzero(rows["repeat_mask"][r, idx])
            n = len(scored) + 1  # the repeat's first token is not scored
            np.testing.assert_array_equal(doc[:n], doc[-n:])  # the span comes back
            lengths.add(n)
            gaps.add(len(doc) - 2 * n)
            np.testing.assert_array_equal(rows["positions"][r, idx], np.arange(len(idx)))
            assert rows["loss_mask"][r, idx].all()
        assert not rows["loss_mask"][r][seg == 0].any()
    assert len(lengths) > 3 and len(gaps) > 3  # no fixed look-back solves them
    drawn = rows["tokens"][rows["segment_ids"] > 0]
    assert drawn.min() >= 12 and drawn.max() < 300


def test_spec_refuses_what_cannot_fit():
    with pytest.raises(ValueError, match="does not fit seq_len=32"):
        synthetic.repeat_rows(1, 32, SPEC, seed=0)
    with pytest.raises(ValueError, match="min_len"):
        synthetic.RepeatSpec(low=0, high=10, min_len=5, max_len=4)


def test_replace_rows_keeps_the_share_and_leaves_other_rows_alone():
    batch = {k: np.full((64, 96), 7, np.int32) for k in synthetic.ROW_KEYS}
    batch["extra"] = np.ones((64, 96), np.int32)
    replace = synthetic.ReplaceRows(0.25, SPEC, pad_id=0)
    out = replace(batch, np.random.default_rng(0))
    changed = (out["tokens"] != 7).any(axis=1)
    assert 8 <= changed.sum() <= 24  # about a quarter of 64 rows
    np.testing.assert_array_equal(out["tokens"][~changed], batch["tokens"][~changed])
    np.testing.assert_array_equal(out["extra"], batch["extra"])
    assert (batch["tokens"] == 7).all()  # the input batch is not modified


def test_pretraining_pipeline_mixes_repeat_rows_reproducibly(tmp_path):
    from cursor_rl.data import pipeline
    from cursor_rl.train import loop
    from tests.train_helpers import micro_config

    cfg = micro_config()
    cfg.train.seq_len = 64
    cfg.data.repeat_rows = 0.5
    cfg.data.repeat_max_len = 20
    tokenizer = loop.ensure_tokenizer(cfg, str(tmp_path))

    def first_batches(split):
        it = iter(loop.make_data(cfg, tokenizer, split, seed=0))
        return [next(it) for _ in range(3)]

    def repeat_like(batch):  # rows packed only with span-gap-span documents
        return sum(
            1
            for r in range(batch["tokens"].shape[0])
            if batch["segment_ids"][r].max() > 1
            and (batch["tokens"][r][batch["segment_ids"][r] > 0] >= 12).all()
        )

    train = first_batches("train")
    assert sum(repeat_like(b) for b in train) > 0
    again = first_batches("train")
    for a, b in zip(train, again):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    # Rows shorter than the configured spans allow still work: the spans are capped.
    cfg.train.seq_len = 32
    short = next(iter(loop.make_data(cfg, tokenizer, "train", seed=0)))
    assert short["tokens"].shape == (cfg.train.batch_size, 32)
    assert isinstance(pipeline.DataConfig.from_mapping({"repeat_rows": 0.5}), pipeline.DataConfig)
    with pytest.raises(ValueError, match="repeat_rows"):
        pipeline.DataConfig.from_mapping({"repeat_rows": 1.5})
