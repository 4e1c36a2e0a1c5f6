"""seqio bridge: the corpus as a seqio Task, a Mixture feeding the trainer's batch dict.

Runs where the ``seqio`` extra is installed (``launch/run_tests.sh`` runs it in
``.venv-seqio``); skips elsewhere, unless CURSOR_RL_REQUIRE_SEQIO=1 makes that a failure.
"""

import json
import os

import numpy as np
import pytest

if os.environ.get("CURSOR_RL_REQUIRE_SEQIO") == "1":
    import seqio
else:
    seqio = pytest.importorskip("seqio")

from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.data import packing, pipeline, seqio_bridge

SEQ_LEN = 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("seqio_corpus")
    code, notes = root / "code", root / "notes.jsonl"
    code.mkdir()
    for i in range(24):
        (code / f"m{i:02d}.py").write_text(f"def f_{i}(x):\n    return x + {i}\n" * (1 + i % 5))
    notes.write_text(
        "".join(json.dumps({"text": f"note {i}: " + "ab " * i}) + "\n" for i in range(20))
    )
    code_cfg = pipeline.DataConfig(
        sources=(f"files:{code}",), exclude_modules=(), eval_fraction=0.2
    )
    notes_cfg = pipeline.DataConfig(
        sources=(f"jsonl:{notes}",), exclude_modules=(), eval_fraction=0.2
    )
    tok = Tokenizer.train(
        [d["text"] for c in (code_cfg, notes_cfg) for d in pipeline.iter_documents(c)], 320
    )
    seqio_bridge.register_corpus_task("cursor_rl_test_code", code_cfg, tok)
    seqio_bridge.register_corpus_task("cursor_rl_test_notes", notes_cfg, tok)
    seqio.MixtureRegistry.remove("cursor_rl_test_mix")
    seqio.MixtureRegistry.add(
        "cursor_rl_test_mix", [("cursor_rl_test_code", 3.0), ("cursor_rl_test_notes", 1.0)]
    )
    config = pipeline.DataConfig(seqio_mixture="cursor_rl_test_mix", shuffle_window=4)
    return code_cfg, notes_cfg, tok, config


def test_task_tokens_match_the_native_rendering(setup):
    code_cfg, _, tok, _ = setup
    task = seqio.get_mixture_or_task("cursor_rl_test_code")
    ds = task.get_dataset(sequence_length=None, split="train", shuffle=False, num_epochs=1)
    got = sorted(tuple(ex["targets"].tolist()) for ex in ds.as_numpy_iterator())
    want = sorted(
        (*tok.encode(d["text"]), tok.eos_id)
        for d in pipeline.iter_documents(code_cfg, split="train")
    )
    assert got == want
    vocab = task.output_features["targets"].vocabulary
    assert vocab.decode(vocab.encode("def g(): pass")) == "def g(): pass"


def test_mixture_feeds_the_same_batch_dict_and_resumes_exactly(setup):
    code_cfg, notes_cfg, tok, config = setup
    documents = [d["text"] for c in (code_cfg, notes_cfg) for d in pipeline.iter_documents(c)]
    kwargs = dict(seq_len=SEQ_LEN, global_batch_size=4, seed=1)
    it = pipeline.make_pretrain_iterator(config, tok, **kwargs)
    first = [next(it) for _ in range(3)]
    for batch in first:
        assert set(batch) == set(packing.BATCH_KEYS)
        assert all(v.shape == (4, SEQ_LEN) and v.dtype == np.int32 for v in batch.values())
        for row in range(4):
            seg = batch["segment_ids"][row]
            for s in range(1, seg.max() + 1):
                inputs, targets = batch["tokens"][row][seg == s], batch["targets"][row][seg == s]
                np.testing.assert_array_equal(inputs[1:], targets[:-1])
                if inputs[0] == tok.bos_id:  # a document's first chunk: a known document
                    text = tok.decode(targets)
                    assert any(d.startswith(text.removesuffix("<|eos|>")) for d in documents)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(4)]
    fresh = pipeline.make_pretrain_iterator(config, tok, **kwargs)
    fresh.set_state(state)
    for a, b in zip(expected, [next(fresh) for _ in range(4)]):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    again = pipeline.make_pretrain_iterator(config, tok, **kwargs)
    np.testing.assert_array_equal(next(again)["tokens"], first[0]["tokens"])


def test_unregistered_mixture_names_the_field(setup):
    tok = setup[2]
    config = pipeline.DataConfig(seqio_mixture="no_such_mixture")
    with pytest.raises(ValueError, match=r"data\.seqio_mixture='no_such_mixture'"):
        pipeline.make_pretrain_dataset(config, tok, seq_len=8, global_batch_size=1, seed=0)
