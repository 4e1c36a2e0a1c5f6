"""grain pretraining pipeline: packing layout, determinism, exact resume, sharding, splits."""

import json

import numpy as np
import pytest

from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.data import packing, pipeline

SEQ_LEN = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 small files of varied length (some longer than SEQ_LEN tokens)."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        body = "".join(f"    total += {j} * x_{i}\n" for j in range(1 + (i * 7) % 23))
        (root / f"mod_{i:02d}.py").write_text(f"def f_{i}(x_{i}):\n    total = 0\n{body}")
    return root


@pytest.fixture(scope="module")
def config(corpus):
    return pipeline.DataConfig(
        sources=(f"files:{corpus}",), exclude_modules=(), eval_fraction=0.2, shuffle_window=8
    )


@pytest.fixture(scope="module")
def tok(config):
    return Tokenizer.train((d["text"] for d in pipeline.iter_documents(config)), 320)


def _doc_ids(tok, text):
    return [tok.bos_id, *tok.encode(text), tok.eos_id]


def _segments(batch):
    """(row, segment id, slice) for every segment in a batch."""
    out = []
    for row in range(batch["tokens"].shape[0]):
        seg = batch["segment_ids"][row]
        for s in np.unique(seg[seg > 0]):
            where = np.flatnonzero(seg == s)
            out.append((row, s, slice(where[0], where[-1] + 1)))
    return out


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.mark.parametrize("strategy", packing.PACKING_STRATEGIES)
def test_batches_are_packed_document_chunks(config, tok, strategy):
    cfg = pipeline.DataConfig(**{**config.__dict__, "packing": strategy})
    docs = {d["id"]: _doc_ids(tok, d["text"]) for d in pipeline.iter_documents(cfg, split="train")}
    it = pipeline.make_pretrain_iterator(cfg, tok, seq_len=SEQ_LEN, global_batch_size=4, seed=3)
    seen_chunks = set()
    for batch in _take(it, 12):
        assert set(batch) == set(packing.BATCH_KEYS)
        for key in packing.BATCH_KEYS:
            assert batch[key].shape == (4, SEQ_LEN) and batch[key].dtype == np.int32
        pad = batch["segment_ids"] == 0
        assert not batch["loss_mask"][pad].any() and (batch["loss_mask"][~pad] == 1).all()
        assert (batch["tokens"][pad] == tok.pad_id).all()
        for row in range(4):  # segments are numbered 1..k left to right, then padding
            seg = batch["segment_ids"][row]
            k = seg.max()
            assert list(np.unique(seg[seg > 0])) == list(range(1, k + 1))
            assert (np.diff(seg[seg > 0]) >= 0).all() and not (pad[row][:-1] & ~pad[row][1:]).any()
        for row, _, sl in _segments(batch):
            np.testing.assert_array_equal(
                batch["positions"][row, sl], np.arange(sl.stop - sl.start)
            )
            inputs, targets = batch["tokens"][row, sl], batch["targets"][row, sl]
            # The segment is the chunk at a multiple of SEQ_LEN of one train document.
            matches = [
                (doc_id, start)
                for doc_id, ids in docs.items()
                for start in range(0, len(ids) - 1, SEQ_LEN)
                if ids[start : start + len(inputs)] == list(inputs)
                and ids[start + 1 : start + 1 + len(targets)] == list(targets)
                and len(inputs) == min(SEQ_LEN, len(ids) - 1 - start)
            ]
            assert matches, "segment is not a chunk of any train document"
            seen_chunks.add(matches[0])
    assert len(seen_chunks) > 20


def test_same_seed_same_batches_other_seed_other_batches(config, tok):
    make = lambda seed: pipeline.make_pretrain_iterator(
        config, tok, seq_len=SEQ_LEN, global_batch_size=4, seed=seed
    )
    first = _take(make(0), 6)
    _assert_same(first, _take(make(0), 6))
    assert not np.array_equal(first[0]["tokens"], next(make(1))["tokens"])


@pytest.mark.parametrize("strategy", packing.PACKING_STRATEGIES)
def test_state_round_trip_resumes_exactly(config, tok, strategy):
    """Take N batches, save, take M; a fresh iterator restored from the state gives the same M."""
    cfg = pipeline.DataConfig(**{**config.__dict__, "packing": strategy})
    kwargs = dict(seq_len=SEQ_LEN, global_batch_size=4, seed=5)
    it = pipeline.make_pretrain_iterator(cfg, tok, **kwargs)
    # Enough batches to cross several packing rounds, windows and an epoch boundary.
    for n in (0, 1, 7, 30):
        state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
        expected = _take(it, 9)
        fresh = pipeline.make_pretrain_iterator(cfg, tok, **kwargs)
        fresh.set_state(state)
        _assert_same(expected, _take(fresh, 9))
        _take(it, n)


def test_processes_read_disjoint_documents_covering_the_corpus(config, tok):
    """Two processes split the documents; each gets its half of the global batch."""
    seen = []
    for index in range(2):
        docs = pipeline.document_dataset(
            config, split="train", seed=0, process_index=index, process_count=2
        )
        ids = {d["id"] for d in (docs[i] for i in range(40)) if d is not None}  # 2 epochs
        seen.append(ids)
        it = pipeline.make_pretrain_iterator(
            config,
            tok,
            seq_len=SEQ_LEN,
            global_batch_size=4,
            seed=0,
            process_index=index,
            process_count=2,
        )
        assert next(it)["tokens"].shape == (2, SEQ_LEN)
    train_ids = {d["id"] for d in pipeline.iter_documents(config, split="train")}
    assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == train_ids
    with pytest.raises(ValueError, match="multiple of process_count=3"):
        pipeline.make_pretrain_dataset(
            config,
            tok,
            seq_len=SEQ_LEN,
            global_batch_size=4,
            seed=0,
            process_index=0,
            process_count=3,
        )


def test_eval_split_is_held_out_by_content(config, tok):
    train = {d["id"] for d in pipeline.iter_documents(config, split="train")}
    held_out = {d["id"]: d["text"] for d in pipeline.iter_documents(config, split="eval")}
    assert held_out and train and train.isdisjoint(held_out)
    assert all(pipeline.split_of(t, 0.2) == "eval" for t in held_out.values())
    eval_texts = {tuple(_doc_ids(tok, t)[1:]) for t in held_out.values()}
    it = pipeline.make_pretrain_iterator(
        config, tok, seq_len=512, global_batch_size=2, seed=0, split="eval"
    )
    for batch in _take(it, 3):
        for row, _, sl in _segments(batch):
            assert tuple(batch["targets"][row, sl]) in eval_texts


def test_weighted_mixture_of_sources(corpus, tok, tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": f"zz_{i} = {i}\n" * 3}) + "\n" for i in range(9)))
    cfg = pipeline.DataConfig(
        sources=(f"files:{corpus}", f"jsonl:{other}"),
        weights=(1.0, 3.0),
        exclude_modules=(),
        eval_fraction=0.01,
        shuffle_window=0,
    )
    docs = pipeline.document_dataset(cfg, split="train", seed=0)
    drawn = [docs[i] for i in range(400)]
    from_jsonl = sum(d is not None and d["source"].startswith("jsonl") for d in drawn)
    from_files = sum(d is not None and d["source"].startswith("files") for d in drawn)
    assert 2.0 < from_jsonl / from_files < 4.5


def test_config_errors_name_the_field(config, tok, tmp_path):
    with pytest.raises(ValueError, match=r"data\.packing"):
        pipeline.DataConfig(packing="worst_fit")
    with pytest.raises(ValueError, match=r"data\.weights"):
        pipeline.DataConfig(sources=("stdlib",), weights=(1.0, 2.0))
    with pytest.raises(ValueError, match=r"data\.eval_fraction"):
        pipeline.DataConfig(eval_fraction=0.0)
    with pytest.raises(ValueError, match="unknown data config fields \\['bogus'\\]"):
        pipeline.DataConfig.from_mapping({"bogus": 1})
    cfg = pipeline.DataConfig.from_mapping({"sources": ["stdlib"], "weights": [2.0]})
    assert cfg.sources == ("stdlib",) and cfg.weights == (2.0,)
    with pytest.raises(ValueError, match="split='test'"):
        pipeline.make_pretrain_dataset(
            config, tok, seq_len=8, global_batch_size=1, seed=0, split="test"
        )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        pipeline.make_pretrain_dataset(
            pipeline.DataConfig(sources=(f"jsonl:{empty}",), exclude_modules=()),
            tok,
            seq_len=8,
            global_batch_size=1,
            seed=0,
        )
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": "   "}\n')
    with pytest.raises(ValueError, match="has no documents"):
        pipeline.make_pretrain_dataset(
            pipeline.DataConfig(sources=(f"jsonl:{blank}",), exclude_modules=()),
            tok,
            seq_len=8,
            global_batch_size=1,
            seed=0,
        )


def test_default_stdlib_pipeline(tok):
    """The embedded default corpus end to end (small tokenizer; exclusions explicit)."""
    cfg = pipeline.DataConfig(exclude_modules=("json", "textwrap"))
    small = pipeline.train_tokenizer(cfg, 512, max_chars=300_000)
    it = pipeline.make_pretrain_iterator(cfg, small, seq_len=128, global_batch_size=8, seed=0)
    batches = _take(it, 4)
    fill = np.mean([b["loss_mask"].mean() for b in batches])
    assert fill > 0.9  # long files: packing leaves little padding
    text = small.decode(batches[0]["tokens"][0])
    assert text.strip()


def test_split_example_truncates_by_position_and_drops_loss_free_chunks():
    ids = np.arange(11)
    mask = np.array([0] * 5 + [1] * 6)  # only the tail is trained
    example = packing.example_from_ids(ids, mask)
    chunks = packing.split_example(example, 4)
    assert [c["tokens"].tolist() for c in chunks] == [[4, 5, 6, 7], [8, 9]]
    assert packing.split_example(example, 4, max_chunks=1) == []  # head only: no loss
    (first,) = packing.split_example(example, 4, max_chunks=2)
    assert first["targets"].tolist() == [5, 6, 7, 8] and first["loss_mask"].tolist() == [1] * 4
    assert packing.example_from_ids([3]) is None
    assert packing.example_from_ids([1, 2, 3], [1, 0, 0]) is None
