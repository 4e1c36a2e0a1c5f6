"""Contamination check: does a benchmark solution appear in what the model trained on?

    python -m cursor_rl.tasks.contamination --bench=/data/tasks/bench \\
        --train=/data/tasks/train --corpus=stdlib --threshold=0.5 --report=contamination.json

Excluding the benchmark modules by name (``splits.BENCH_MODULES``, applied by the
pretraining corpus) cannot catch copies under another name, vendored code, or
training tasks that happen to contain the same code. This check measures it:

1. **What is compared.** A task's *solution* is its reference patch's hunks after
   the change (added lines with their context lines): the removed body, the
   corrected line in its surroundings, the refactored code. It is compared with
   every document of the pretraining corpus
   (``--corpus``: the data pipeline's source specs) and with everything in the
   training tasks (their repositories, hidden tests and patches).
2. **How.** Code is split into tokens (identifiers, numbers, single punctuation
   characters; comment lines dropped) and compared as token n-grams (``--n``, 8 by
   default: long enough that common idioms such as ``for i in range(len(x)):`` do
   not count, short enough to catch a copied statement). A task's overlap with a
   reference is the fraction of its solution's n-grams that occur there; a solution
   shorter than ``n`` tokens counts as found when its whole token sequence occurs.
3. **Streaming.** Only the benchmark's n-grams are held in memory; the corpus is
   read once, document by document, so a corpus of any size fits.
4. **Verdict.** The report lists every task's overlap with the corpus and with the
   training tasks and the document that matched most; the command exits 1 when
   any task's overlap exceeds ``--threshold``.

Pure Python, no JAX (ArrayRecord shards are read with ``array_record`` directly,
not through grain, which would import JAX).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from absl import flags
from array_record.python.array_record_module import ArrayRecordReader

from cursor_rl.data import sources as data_sources
from cursor_rl.data import splits
from cursor_rl.tasks import records

_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d+)?|[^\sA-Za-z0-9_]")
DEFAULT_N = 8
DEFAULT_THRESHOLD = 0.5
# The tiny family's splits share templates: only a solution that occurs whole in the
# training tasks counts as contamination there.
TINY_THRESHOLD = 0.99


def threshold_for(family: str) -> float:
    """The decontamination threshold for a task family's bench."""
    return TINY_THRESHOLD if family == "tiny" else DEFAULT_THRESHOLD


def code_tokens(text: str) -> list[str]:
    """Tokens of code text (comment-only lines dropped)."""
    kept = [line for line in text.split("\n") if not line.lstrip().startswith("#")]
    return _TOKEN.findall("\n".join(kept))


def solution_text(task: records.TaskRecord) -> str:
    """The solved code of a task: each hunk of its patch after the change.

    The added lines with the patch's context lines: a one-line bug fix such as
    ``if i == 0:`` occurs all over any corpus, the fixed line in its surroundings only
    where the module itself was copied.
    """
    lines = []
    in_hunk = False
    for line in task.solution_patch.split("\n"):
        if line.startswith("@@"):
            in_hunk = True
        elif line.startswith(("--- ", "+++ ")) and not in_hunk:
            continue
        elif line.startswith("--- "):
            in_hunk = False
        elif in_hunk and line[:1] in ("+", " "):
            lines.append(line[1:])
    return "\n".join(lines)


def ngrams(tokens: Sequence[str], n: int) -> set[tuple[str, ...]]:
    """The set of token n-grams (a shorter sequence is its own single gram)."""
    if len(tokens) < n:
        return {tuple(tokens)} if tokens else set()
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


@dataclasses.dataclass
class _Probe:
    """One benchmark solution and what has been found of it so far."""

    task_id: str
    module: str
    grams: set[tuple[str, ...]]
    short: str | None  # the whole token sequence, when shorter than n
    found: dict[str, set[tuple[str, ...]]] = dataclasses.field(default_factory=dict)
    best: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)


class OverlapIndex:
    """Benchmark solutions, probed against reference documents one at a time."""

    def __init__(self, tasks: Iterable[records.TaskRecord], n: int = DEFAULT_N):
        self.n = n
        self.probes: list[_Probe] = []
        self._owners: dict[tuple[str, ...], list[int]] = {}  # n-gram -> probes holding it
        self._short: list[int] = []  # probes shorter than n tokens
        for task in tasks:
            tokens = code_tokens(solution_text(task))
            probe = _Probe(
                task.task_id,
                task.provenance.module,
                ngrams(tokens, n),
                " ".join(tokens) if 0 < len(tokens) < n else None,
            )
            index = len(self.probes)
            self.probes.append(probe)
            if probe.short is not None:
                self._short.append(index)
            for gram in probe.grams if probe.short is None else ():
                self._owners.setdefault(gram, []).append(index)

    def add_document(self, text: str, doc_id: str, reference: str) -> None:
        """Records which benchmark n-grams occur in one reference document."""
        tokens = code_tokens(text)
        hits: dict[int, set] = {}
        for i in range(len(tokens) - self.n + 1):
            gram = tuple(tokens[i : i + self.n])
            for owner in self._owners.get(gram, ()):
                hits.setdefault(owner, set()).add(gram)
        if self._short:
            joined = " " + " ".join(tokens) + " "
            for index in self._short:
                if f" {self.probes[index].short} " in joined:
                    hits[index] = set(self.probes[index].grams)
        for index, grams in hits.items():
            probe = self.probes[index]
            probe.found.setdefault(reference, set()).update(grams)
            if len(grams) > probe.best.get(reference, (0, ""))[0]:
                probe.best[reference] = (len(grams), doc_id)

    def report(self, threshold: float) -> dict[str, Any]:
        """Per-task overlaps and the verdict."""
        rows = []
        for probe in self.probes:
            total = max(1, len(probe.grams))
            row = {"task_id": probe.task_id, "module": probe.module, "ngrams": len(probe.grams)}
            for reference in ("corpus", "train_tasks"):
                found = probe.found.get(reference, set())
                row[f"{reference}_overlap"] = round(len(found) / total, 4) if probe.grams else 0.0
                row[f"{reference}_best_match"] = probe.best.get(reference, (0, ""))[1]
            row["max_overlap"] = max(row["corpus_overlap"], row["train_tasks_overlap"])
            rows.append(row)
        rows.sort(key=lambda r: -r["max_overlap"])
        flagged = [r["task_id"] for r in rows if r["max_overlap"] > threshold]
        return {
            "n": self.n,
            "threshold": threshold,
            "tasks": len(rows),
            "flagged": flagged,
            "max_overlap": max((r["max_overlap"] for r in rows), default=0.0),
            "mean_corpus_overlap": round(
                sum(r["corpus_overlap"] for r in rows) / max(1, len(rows)), 4
            ),
            "mean_train_tasks_overlap": round(
                sum(r["train_tasks_overlap"] for r in rows) / max(1, len(rows)), 4
            ),
            "rows": rows,
        }


class ReferenceIndex:
    """The n-grams of a reference set held in memory, for checking tasks one at a time.

    The build uses it to drop a benchmark task as soon as it is validated (so
    ``--count`` counts clean tasks); ``OverlapIndex`` is the streaming form for corpora.
    """

    def __init__(self, documents: Iterable[str], n: int = DEFAULT_N):
        self.n = n
        self._grams: set[int] = set()
        texts = []
        for text in documents:
            tokens = code_tokens(text)
            self._grams.update(hash(g) for g in ngrams(tokens, n))
            texts.append(" ".join(tokens))
        self._joined = " " + " \n ".join(texts) + " "

    def overlap(self, task: records.TaskRecord) -> float:
        """The fraction of the task's solution n-grams found in the reference set."""
        tokens = code_tokens(solution_text(task))
        if not tokens:
            return 0.0
        if len(tokens) < self.n:
            return float(f" {' '.join(tokens)} " in self._joined)
        grams = ngrams(tokens, self.n)
        return sum(hash(g) in self._grams for g in grams) / len(grams)


def task_documents(task: records.TaskRecord) -> Iterator[tuple[str, str]]:
    """``(doc_id, text)`` of everything a training task shows or teaches."""
    for path, text in sorted(records.snapshot_tree(task.repo).items()):
        yield f"{task.task_id}:{path}", text
    for path, text in sorted(task.hidden_tests.items()):
        yield f"{task.task_id}:{path}", text
    yield f"{task.task_id}:solution", solution_text(task)


def corpus_documents(spec: str) -> Iterator[tuple[str, str]]:
    """``(doc_id, text)`` of a pretraining corpus source spec (``cursor_rl.data.sources``).

    ``stdlib`` excludes ``splits.BENCH_MODULES``, as the pretraining corpus does.
    """
    if spec.startswith("array_record:"):
        for path in sorted(p for g in spec.split(":", 1)[1].split(",") for p in glob.glob(g)):
            reader = ArrayRecordReader(path)
            try:
                for i in range(reader.num_records()):
                    record = json.loads(reader.read([i])[0])
                    yield f"{path}:{i}", str(record.get("text", ""))
            finally:
                reader.close()
        return
    source = data_sources.open_source(spec, exclude_modules=splits.BENCH_MODULES)
    for i in range(len(source)):
        document = source[i]
        if document is not None:
            yield document["id"], document["text"]


def check(
    bench: Sequence[records.TaskRecord],
    *,
    train: Sequence[records.TaskRecord] = (),
    corpus: Sequence[str] = (),
    n: int = DEFAULT_N,
    threshold: float = DEFAULT_THRESHOLD,
) -> dict[str, Any]:
    """Measures every benchmark task's overlap with the corpus and the training tasks.

    Args:
      bench: the benchmark tasks.
      train: the training tasks.
      corpus: pretraining corpus source specs (``stdlib``, ``files:...``, ...).
      n: n-gram length in tokens.
      threshold: overlap above which a task is flagged.

    Returns:
      The report (see ``OverlapIndex.report``).
    """
    index = OverlapIndex(bench, n)
    for task in train:
        for doc_id, text in task_documents(task):
            index.add_document(text, doc_id, "train_tasks")
    documents = 0
    for spec in corpus:
        for doc_id, text in corpus_documents(spec):
            index.add_document(text, doc_id, "corpus")
            documents += 1
    report = index.report(threshold)
    report.update(corpus=list(corpus), corpus_documents=documents, train_tasks=len(train))
    return report


def format_report(report: dict[str, Any], top: int = 10) -> str:
    """A short human-readable summary."""
    lines = [
        f"{report['tasks']} benchmark tasks, n={report['n']}: corpus "
        f"({report['corpus_documents']} documents) mean overlap "
        f"{report['mean_corpus_overlap']:.3f}, training tasks ({report['train_tasks']}) mean "
        f"overlap {report['mean_train_tasks_overlap']:.3f}, max {report['max_overlap']:.3f}; "
        f"{len(report['flagged'])} above {report['threshold']}"
    ]
    for row in report["rows"][:top]:
        lines.append(
            f"  {row['task_id']}: corpus {row['corpus_overlap']:.3f} "
            f"({row['corpus_best_match'] or '-'}), train {row['train_tasks_overlap']:.3f} "
            f"({row['train_tasks_best_match'] or '-'})"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    fv = flags.FlagValues()
    flags.DEFINE_string("bench", None, "Benchmark dataset (directory or JSONL).", flag_values=fv)
    flags.DEFINE_list("train", [], "Training datasets to compare with.", flag_values=fv)
    flags.DEFINE_multi_string("corpus", [], "Pretraining corpus source specs.", flag_values=fv)
    flags.DEFINE_integer("n", DEFAULT_N, "n-gram length in tokens.", flag_values=fv)
    flags.DEFINE_float("threshold", DEFAULT_THRESHOLD, "Fail above this overlap.", flag_values=fv)
    flags.DEFINE_string("report", None, "Where to write the JSON report.", flag_values=fv)
    fv(list(argv if argv is not None else sys.argv))
    if not fv.bench:
        print("--bench is required", file=sys.stderr)
        return 2
    bench = records.load_tasks(fv.bench)
    train = [t for path in fv.train for t in records.load_tasks(path)]
    report = check(bench, train=train, corpus=fv.corpus, n=fv.n, threshold=fv.threshold)
    if fv.report:
        with open(fv.report, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    print(format_report(report))
    return 1 if report["flagged"] else 0


if __name__ == "__main__":
    sys.exit(main())
