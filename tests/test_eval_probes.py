"""The copy probe: its rows repeat varying-length random sequences, it scores only the
predictable repeat tokens, and a checkpoint on disk scores as its variables do."""

import jax
import numpy as np
import pytest

from cursor_rl import checkpoints, model
from cursor_rl.chat.tokenizer import SPECIAL_TOKENS
from cursor_rl.eval import probes
from tests.train_helpers import MICRO_MODEL

CONFIG = MICRO_MODEL


def test_rows_repeat_varying_lengths_and_score_only_predictable_tokens():
    rows = probes.repeat_rows(100, rows=4, seq_len=128, min_len=5, max_len=20, low=10, seed=3)
    lengths = set()
    for r in range(4):
        seg = rows["segment_ids"][r]
        for s in set(seg.tolist()) - {0}:
            idx = np.flatnonzero(seg == s)
            doc = np.append(rows["tokens"][r, idx], rows["targets"][r, idx[-1]])
            n = len(doc) // 2
            lengths.add(n)
            np.testing.assert_array_equal(doc[:n], doc[n:])  # the second half repeats the first
            np.testing.assert_array_equal(rows["positions"][r, idx], np.arange(len(idx)))
            np.testing.assert_array_equal(rows["targets"][r, idx[:-1]], rows["tokens"][r, idx[1:]])
            # Scored: targets doc[n + 1 :], i.e. the repeat after its first token.
            np.testing.assert_array_equal(
                rows["score_mask"][r, idx], (np.arange(len(idx)) >= n).astype(np.int32)
            )
        assert not rows["score_mask"][r][seg == 0].any()  # padding is never scored
    assert len(lengths) > 3  # varying lengths: no fixed look-back solves it
    assert rows["tokens"][rows["segment_ids"] > 0].min() >= 10  # no special tokens
    again = probes.repeat_rows(100, rows=4, seq_len=128, min_len=5, max_len=20, low=10, seed=3)
    for key in rows:
        np.testing.assert_array_equal(rows[key], again[key])


def test_score_separates_a_copier_from_a_uniform_guesser():
    rows = probes.repeat_rows(50, rows=2, seq_len=64, min_len=4, max_len=10, low=5, seed=0)
    targets, mask = rows["targets"], rows["score_mask"]
    copier = np.where(np.arange(50) == targets[..., None], 20.0, 0.0)  # sure of the target
    result = probes.score(copier, targets, mask)
    assert result["copy_accuracy"] == 1.0
    assert result["copy_nll"] == pytest.approx(np.log(1 + 49 * np.exp(-20.0)), rel=1e-6)
    assert result["scored_tokens"] == mask.sum()
    uniform = probes.score(np.zeros((*targets.shape, 50)), targets, mask)
    assert uniform["copy_accuracy"] == 0.0  # argmax is id 0, below every drawn id
    assert uniform["copy_nll"] == pytest.approx(np.log(50))
    with pytest.raises(ValueError, match="no scored"):
        probes.score(copier, targets, np.zeros_like(mask))


def test_bad_row_settings_are_refused():
    with pytest.raises(ValueError, match="cannot hold"):
        probes.repeat_rows(100, seq_len=32, max_len=20)
    with pytest.raises(ValueError, match="min_len"):
        probes.repeat_rows(100, min_len=9, max_len=8)
    with pytest.raises(ValueError, match="low"):
        probes.repeat_rows(10, low=9)
    with pytest.raises(ValueError, match="high"):
        probes.repeat_rows(10, low=0, high=11)
    narrow = probes.repeat_rows(100, rows=2, low=40, high=50)
    drawn = narrow["tokens"][narrow["segment_ids"] > 0]
    assert drawn.min() >= 40 and drawn.max() < 50


@pytest.mark.slow
def test_a_saved_checkpoint_scores_as_its_variables(tmp_path):
    variables = model.init(CONFIG, jax.random.key(0))
    direct = probes.copy_score(CONFIG, variables, rows=2, seq_len=64, max_len=20)
    # An untrained model is at chance: it has no reason to prefer the repeated token.
    assert direct["copy_accuracy"] < 0.1
    assert direct["chance_accuracy"] == pytest.approx(1 / (CONFIG.vocab_size - len(SPECIAL_TOKENS)))
    stage_dir = tmp_path / "pretrain" / "checkpoints"
    for step in (10, 9):
        metadata = checkpoints.make_metadata(CONFIG, stage="pretrain", step=step)
        checkpoints.save_variables(str(stage_dir), variables, metadata)
    (stage_dir / "11").mkdir()  # no commit marker: not finalised, never probed
    paths = probes.checkpoint_paths(str(tmp_path), "pretrain")
    assert paths == [str(stage_dir / "9"), str(stage_dir / "10")]  # numeric order
    restored = probes.probe_checkpoint(paths[-1], rows=2, seq_len=64, max_len=20)
    assert restored == pytest.approx(direct)
    with pytest.raises(FileNotFoundError, match="sft"):
        probes.checkpoint_paths(str(tmp_path), "sft")
