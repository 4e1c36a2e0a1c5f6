"""Writes a corpus as ArrayRecord shards and prints its statistics.

    python -m cursor_rl.data.prepare --source=stdlib --out=/tmp/corpus
    python -m cursor_rl.data.prepare --source=stdlib --source='files:~/src/**/*.py' \\
        --out=/tmp/corpus --num_shards=8 --vocab_size=16384
    python -m cursor_rl.data.prepare --source='jsonl:/data/*.jsonl' --out=/tmp/corpus \\
        --tokenizer=WORKDIR/tokenizer

Then train on it with ``data.sources=("array_record:/tmp/corpus/*.array_record",)``.

Each record is a JSON object ``{"text", "source", "id"}`` (what ``ArrayRecordSource``
reads). Documents are written in a seeded shuffled order, round-robin over shards,
so every shard is a sample of the whole corpus. Exact duplicates (up to whitespace)
are written once, benchmark copies never. ``stats.json`` beside the shards holds
documents, bytes and tokens per source and per split; the tokens are counted with
``--tokenizer`` or with a tokenizer trained here (saved in ``OUT/tokenizer/``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Sequence
from typing import Any

from absl import app, flags
from array_record.python.array_record_module import ArrayRecordWriter

from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.data import pipeline, sources

STATS_FILE = "stats.json"


@dataclasses.dataclass
class SourceStats:
    """Counts for one source (or the total)."""

    documents: int = 0
    bytes: int = 0
    tokens: int = 0
    train_documents: int = 0
    eval_documents: int = 0
    eval_tokens: int = 0
    skipped: int = 0  # not UTF-8, or empty
    duplicates: int = 0
    benchmark_copies: int = 0

    def add(self, other: SourceStats) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


def prepare_corpus(
    config: pipeline.DataConfig,
    out_dir: str,
    tokenizer: Tokenizer,
    *,
    num_shards: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Writes ``config``'s corpus to ``out_dir`` as shards; returns (and saves) its stats.

    Args:
      config: names the sources, exclusions and eval fraction.
      out_dir: output directory (created).
      tokenizer: counts tokens.
      num_shards: number of ``corpus-XXXXX-of-YYYYY.array_record`` files.
      seed: order of documents across shards.

    Returns:
      The stats dict written to ``out_dir/stats.json``.
    """
    if num_shards < 1:
        raise ValueError(f"--num_shards={num_shards} must be >= 1")
    start = time.time()
    opened = pipeline.open_sources(config)
    guard = pipeline.bench_guard(config, opened)
    per_source = {spec: SourceStats() for spec in config.sources}
    order = [(s, i) for s, source in enumerate(opened) for i in range(len(source))]
    random.Random(seed).shuffle(order)
    os.makedirs(out_dir, exist_ok=True)
    paths = [
        os.path.join(out_dir, f"corpus-{k:05d}-of-{num_shards:05d}.array_record")
        for k in range(num_shards)
    ]
    writers = [ArrayRecordWriter(path, "group_size:1") for path in paths]
    seen: set[bytes] = set()
    written = 0
    pending: list[tuple[str, dict[str, str]]] = []

    def flush() -> None:
        nonlocal written
        counts = tokenizer.encode_batch([doc["text"] for _, doc in pending])
        for (spec, doc), ids in zip(pending, counts):
            stats = per_source[spec]
            split = pipeline.split_of(doc["text"], config.eval_fraction)
            stats.documents += 1
            stats.bytes += len(doc["text"].encode("utf-8"))
            stats.tokens += len(ids)
            if split == "eval":
                stats.eval_documents += 1
                stats.eval_tokens += len(ids)
            else:
                stats.train_documents += 1
            record = {"text": doc["text"], "source": doc["source"], "id": doc["id"]}
            writers[written % num_shards].write(json.dumps(record).encode("utf-8"))
            written += 1
        pending.clear()

    try:
        for s, i in order:
            spec = config.sources[s]
            doc = opened[s][i]
            if doc is None:
                per_source[spec].skipped += 1
                continue
            digest = sources.normalized_hash(doc["text"])
            if guard.is_reserved(doc["text"]):
                per_source[spec].benchmark_copies += 1
                continue
            if digest in seen:
                per_source[spec].duplicates += 1
                continue
            seen.add(digest)
            pending.append((spec, doc))
            if len(pending) >= 256:
                flush()
        flush()
    finally:
        for writer in writers:
            writer.close()
    if written == 0:
        raise ValueError(f"corpus {list(config.sources)} has no usable document")

    total = SourceStats()
    for stats in per_source.values():
        total.add(stats)
    result = {
        "sources": {spec: dataclasses.asdict(st) for spec, st in per_source.items()},
        "total": dataclasses.asdict(total),
        "shards": [os.path.basename(p) for p in paths],
        "vocab_size": tokenizer.vocab_size,
        "eval_fraction": config.eval_fraction,
        "excluded_modules": list(_excluded(config, opened)),
        "seconds": round(time.time() - start, 2),
    }
    with open(os.path.join(out_dir, STATS_FILE), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    return result


def _excluded(config: pipeline.DataConfig, opened: Sequence[Any]) -> tuple[str, ...]:
    for source in opened:
        if isinstance(source, sources.StdlibSource):
            return source.exclude_modules
    if config.exclude_modules is not None:
        return config.exclude_modules
    return sources.default_excluded_modules()


def format_stats(stats: dict[str, Any]) -> str:
    """A plain-text table of ``prepare_corpus``'s stats."""
    columns = ("documents", "bytes", "tokens", "eval_documents", "skipped", "duplicates")
    rows = [("source", *columns)]
    for spec, st in [*stats["sources"].items(), ("TOTAL", stats["total"])]:
        rows.append((spec, *(f"{st[c]:,}" for c in columns)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    total = stats["total"]
    lines.append(
        f"vocab {stats['vocab_size']}: {total['bytes'] / max(total['tokens'], 1):.2f} bytes/token; "
        f"benchmark copies dropped: {total['benchmark_copies']}; "
        f"{len(stats['shards'])} shard(s); {stats['seconds']} s"
    )
    return "\n".join(lines)


def define_flags() -> None:
    """Defines the command-line flags (only when run as a program: no clashes on import)."""
    flags.DEFINE_multi_string("source", ["stdlib"], "Corpus source spec (repeatable).")
    flags.DEFINE_string("out", None, "Output directory for shards and stats.json.")
    flags.DEFINE_integer("num_shards", 1, "Number of ArrayRecord shards.")
    flags.DEFINE_string("tokenizer", None, "tokenizer.json (or its directory).")
    flags.DEFINE_integer("vocab_size", 4096, "Vocab size when training one here.")
    flags.DEFINE_integer("max_chars", 8_000_000, "Tokenizer training budget.")
    flags.DEFINE_string("text_field", "text", "JSON text field (JSONL/ArrayRecord).")
    flags.DEFINE_list(
        "exclude_modules", None, "Stdlib modules reserved for eval (default: BENCH_MODULES)."
    )
    flags.DEFINE_float("eval_fraction", 0.05, "Held-out share of documents.")
    flags.DEFINE_integer("seed", 0, "Shuffle seed.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = pipeline.DataConfig(
        sources=tuple(flags.FLAGS.source),
        text_field=flags.FLAGS.text_field,
        exclude_modules=None
        if flags.FLAGS.exclude_modules is None
        else tuple(flags.FLAGS.exclude_modules),
        eval_fraction=flags.FLAGS.eval_fraction,
    )
    if flags.FLAGS.tokenizer:
        tokenizer = Tokenizer.load(flags.FLAGS.tokenizer)
    else:
        start = time.time()
        tokenizer = pipeline.train_tokenizer(
            config, flags.FLAGS.vocab_size, max_chars=flags.FLAGS.max_chars, seed=flags.FLAGS.seed
        )
        path = tokenizer.save(os.path.join(flags.FLAGS.out, "tokenizer"))
        seconds = time.time() - start
        print(f"trained a {tokenizer.vocab_size}-token tokenizer in {seconds:.1f} s: {path}")
    stats = prepare_corpus(
        config, flags.FLAGS.out, tokenizer, num_shards=flags.FLAGS.num_shards, seed=flags.FLAGS.seed
    )
    print(format_stats(stats))


if __name__ == "__main__":
    define_flags()
    flags.mark_flag_as_required("out")
    app.run(main)
