"""Corpus sources: the stdlib default with benchmark exclusion, files, JSONL, ArrayRecord."""

import json
import os
import shutil

import pytest

from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.data import pipeline, prepare, sources, splits, tiny_modules

RESERVED = ("json", "textwrap", "email.utils")


@pytest.mark.parametrize(
    "relpath, reserved",
    [
        ("json/__init__.py", True),
        ("json/decoder.py", True),
        ("textwrap.py", True),
        ("email/utils.py", True),
        ("email/parser.py", False),
        ("email/_parseaddr.py", False),
        ("test/test_json/test_fail.py", True),
        ("test/test_json/__init__.py", True),
        ("test/test_textwrap.py", True),
        ("test/test_email/test_utils.py", True),
        ("test/test_email/test_email.py", False),
        ("test/test_jsonrpc.py", False),
        ("test/test_os.py", False),
        ("jsonx.py", False),
        ("_pytextwrap.py", True),
        ("_pyio.py", False),
        ("string.py", False),
    ],
)
def test_reserved_paths(relpath, reserved):
    assert sources.is_reserved_path(relpath, RESERVED) is reserved


def test_twins_are_reserved_with_their_module():
    assert sources.is_reserved_path("_pyio.py", ("io",))
    assert sources.is_reserved_path("_pydecimal.py", ("decimal",))
    assert sources.is_reserved_path("_collections_abc.py", ("collections.abc",))
    assert sources.is_reserved_path("_weakrefset.py", ("weakref",))


@pytest.fixture(scope="module")
def stdlib():
    return sources.StdlibSource(exclude_modules=RESERVED)


def test_stdlib_source_excludes_the_benchmark_and_site_packages(stdlib):
    rel = {os.path.relpath(p, stdlib.root).replace(os.sep, "/") for p in stdlib.paths}
    assert "os.py" in rel and "test/test_os.py" in rel
    assert "textwrap.py" not in rel and "test/test_textwrap.py" not in rel
    assert not any(r.startswith(("json/", "test/test_json/")) for r in rel)
    assert not any(part in r for r in rel for part in ("site-packages/", "__pycache__/"))
    assert {"textwrap.py", "json/decoder.py", "test/test_json/test_fail.py"} <= set(stdlib.excluded)
    assert len(stdlib) > 1000
    doc = stdlib[0]
    assert set(doc) == {"text", "source", "id"} and doc["source"] == "stdlib"


def test_default_exclusions_are_the_benchmark_split():
    assert sources.default_excluded_modules() == tuple(splits.BENCH_MODULES)
    source = sources.StdlibSource()
    assert source.exclude_modules == tuple(splits.BENCH_MODULES)
    for module in splits.BENCH_MODULES:
        top = module.replace(".", "/")
        assert not any(p.endswith(f"/{top}.py") or f"/{top}/" in p for p in source.paths), module


def test_bench_guard_drops_copies_smuggled_in_through_other_sources(stdlib, tmp_path):
    copied = tmp_path / "vendored_textwrap.py"
    original = os.path.join(stdlib.root, "textwrap.py")
    with open(original, encoding="utf-8") as fh:
        text = fh.read()
    copied.write_text(text.replace("\n", "   \r\n"))  # whitespace noise does not help
    (tmp_path / "mine.py").write_text("print('mine')\n")
    config = pipeline.DataConfig(sources=(f"files:{tmp_path}",), exclude_modules=RESERVED)
    ids = [d["id"] for d in pipeline.iter_documents(config)]
    assert ids == [str(tmp_path / "mine.py")]


def test_files_source_globs_dirs_and_skips_non_utf8(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("a = 1\n")
    (tmp_path / "pkg" / "notes.txt").write_text("text\n")
    (tmp_path / "pkg" / "latin1.py").write_bytes("x = 'caf\xe9'\n".encode("latin-1"))
    (tmp_path / "pkg" / "empty.py").write_text("\n")
    src = sources.open_source(f"files:{tmp_path}/pkg")
    assert [os.path.basename(p) for p in src.paths] == ["a.py", "empty.py", "latin1.py"]
    assert src[0]["text"] == "a = 1\n" and src[1] is None and src[2] is None
    src = sources.open_source(f"files:{tmp_path}/**/*.txt")
    assert len(src) == 1 and src[0]["text"] == "text\n"
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        sources.open_source(f"files:{tmp_path}/nothing_here/*.py")
    with pytest.raises(ValueError, match="kind must be one of"):
        sources.open_source("ftp:somewhere")
    with pytest.raises(ValueError, match="names no path"):
        sources.open_source("jsonl:")


def test_jsonl_source_reads_lazily_and_names_bad_lines(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "a = 1\\n", "id": "x"}\n\n{"content": "b = 2"}\n')
    src = sources.open_source(f"jsonl:{good}", text_field="text")
    assert len(src) == 2
    assert src[0] == {"text": "a = 1\n", "source": f"jsonl:{good}", "id": "x"}
    with pytest.raises(ValueError, match=f"{good}:3: no 'text' field"):
        src[1]
    assert sources.open_source(f"jsonl:{good}", text_field="content")[1]["text"] == "b = 2"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n[1, 2]\n{"text": 3}\n')
    src = sources.open_source(f"jsonl:{bad}")
    with pytest.raises(ValueError, match=f"{bad}:2: malformed JSON"):
        src[1]
    with pytest.raises(ValueError, match=f"{bad}:3: expected a JSON object"):
        src[2]
    with pytest.raises(ValueError, match=f"{bad}:4: field 'text' is int"):
        src[3]


def test_tiny_source_is_train_split_modules_with_their_tests():
    source = sources.open_source("tiny:5")
    assert len(source) == 5 and len(sources.open_source("tiny")) == sources.TINY_DEFAULT_REPOS
    seeds = list(splits.tiny_seeds("train")[:5])
    for index, seed in enumerate(seeds):
        doc = source[index]
        module = tiny_modules.tiny_module(seed)
        # The module first, then its tests, each under its file name: tests call the
        # functions defined above (what teaches a small model to copy names).
        text = doc["text"]
        assert text.index(f"# {module.code_file}\n") < text.index(f"# {module.test_file}\n")
        assert module.source in text and module.tests in text
        assert doc["id"] == module.id == f"tiny-{seed:07d}"
    # No benchmark module can be a document: the seed ranges are disjoint.
    assert not any(seed in splits.tiny_seeds("bench") for seed in seeds)
    for bad in ("tiny:x", "tiny:0"):
        with pytest.raises(ValueError, match="tiny"):
            sources.open_source(bad)


def test_copy_source_repeats_a_line_of_corpus_identifiers():
    source = sources.open_source("copy:20")
    assert len(source) == 20 and len(sources.open_source("copy")) == sources.COPY_DEFAULT_DOCS
    pool = set(source._identifiers())
    assert len(pool) > 10_000  # high entropy: the repeat is predictable only by copying
    lines = set()
    for index in range(20):
        doc = source[index]
        first, second, rest = doc["text"].split("\n")
        assert first == second and rest == "", doc["text"]  # the line, then the same line
        words = first.split(" ")
        assert 4 <= len(words) <= 16 and set(words) <= pool
        assert doc == source[index]  # deterministic per index
        lines.add(first)
    assert len(lines) == 20
    with pytest.raises(IndexError):
        source[20]
    for bad in ("copy:x", "copy:0"):
        with pytest.raises(ValueError, match="copy"):
            sources.open_source(bad)


def test_prepare_writes_array_record_shards_the_pipeline_reads(tmp_path):
    corpus = tmp_path / "src"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * (i + 1))
    shutil.copy(corpus / "m3.py", corpus / "dup.py")
    config = pipeline.DataConfig(sources=(f"files:{corpus}",), exclude_modules=())
    tok = Tokenizer.train((d["text"] for d in pipeline.iter_documents(config)), 300)
    out = tmp_path / "out"
    stats = prepare.prepare_corpus(config, str(out), tok, num_shards=3)
    total = stats["total"]
    assert total["documents"] == 12 and total["duplicates"] == 1
    assert total["bytes"] == sum(len((corpus / f"m{i}.py").read_bytes()) for i in range(12))
    assert total["tokens"] == sum(
        len(tok.encode((corpus / f"m{i}.py").read_text())) for i in range(12)
    )
    assert total["train_documents"] + total["eval_documents"] == 12
    assert json.loads((out / "stats.json").read_text()) == stats
    assert "TOTAL" in prepare.format_stats(stats)
    shards = sorted(out.glob("*.array_record"))
    assert len(shards) == 3
    src = sources.open_source(f"array_record:{out}")
    assert sorted(src[i]["text"] for i in range(len(src))) == sorted(
        (corpus / f"m{i}.py").read_text() for i in range(12)
    )
    ar_config = pipeline.DataConfig(
        sources=(f"array_record:{out}/*.array_record",), exclude_modules=()
    )
    batch = next(
        pipeline.make_pretrain_iterator(ar_config, tok, seq_len=32, global_batch_size=2, seed=0)
    )
    assert batch["tokens"].shape == (2, 32)


def test_prepare_command_line(tmp_path):
    corpus = tmp_path / "src"
    corpus.mkdir()
    for i in range(5):
        (corpus / f"m{i}.py").write_text(f"value_{i} = {i}\n" * 40)
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cursor_rl.data.prepare",
            f"--source=files:{corpus}",
            f"--out={out}",
            "--vocab_size=300",
            "--exclude_modules=",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "TOTAL" in proc.stdout and (out / "tokenizer" / "tokenizer.json").exists()
    assert json.loads((out / "stats.json").read_text())["total"]["documents"] == 5
