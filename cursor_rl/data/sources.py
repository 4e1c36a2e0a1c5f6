"""Document sources for pretraining: the standard library, files, JSONL and ArrayRecord.

A source is a random-access sequence of documents (``len`` and ``[i]``), which is
what ``grain.MapDataset.source`` needs for a global, seekable shuffle. A document is
a dict ``{"text": str, "source": str, "id": str}``; an index whose document cannot
be used (not UTF-8, empty) yields ``None`` and grain drops it.

Sources are named by spec strings so configs and the ``prepare`` command line can
list them::

    stdlib                      the running interpreter's standard library (*.py)
    files:GLOB[,GLOB...]        files; a directory means every *.py file under it
    jsonl:GLOB[,GLOB...]        one JSON object per line, text in ``text_field``
    array_record:GLOB[,...]     records written by ``prepare`` (JSON objects)
    tiny[:N]                    N generated tiny-family modules of the train split
                                (``cursor_rl.data.tiny_modules``; 4096 by default)
    copy[:N]                    N generated copy drills: a random line of the stdlib's
                                identifiers, then the same line again (4096 by default)

Design choices:

1. **The benchmark never reaches pretraining.** The stdlib modules reserved for
   evaluation (``cursor_rl.data.splits.BENCH_MODULES`` unless configured) are
   removed together with everything that would leak their solution or their hidden
   tests:

   a. the module itself: ``name.py`` or the package directory ``name/`` (which also
      holds in-package tests such as ``idlelib/idle_test``);
   b. its pure-Python twins that carry the same code (``_pyname.py``, ``_py_name.py``
      and the known private halves listed in ``_TWINS``, e.g. ``_collections_abc``);
   c. its unit tests in the ``test`` package: ``test/test_name.py``,
      ``test/test_name_*.py`` and the directory ``test/test_name/`` (for a dotted
      module ``a.b`` also ``test/test_a/test_b.py``, where CPython keeps them);
   d. exact copies anywhere else: every document of every source (not just the
      stdlib) whose whitespace-normalised content equals a reserved file is dropped
      (``BenchGuard``), so a CPython checkout or vendored copy given as ``files:``
      cannot smuggle them back in. Near-duplicates are the task factory's
      contamination check (n-gram overlap), not this module's job;
   e. ``site-packages``/``dist-packages`` (third-party code, not the stdlib) and
      ``__pycache__`` are never part of the stdlib corpus.

2. **Files are read lazily** (only the sorted list of paths is built up front), so a
   large directory costs nothing until its documents are drawn.
3. **JSONL lines are indexed by byte offset** once, then read on demand; a
   malformed line raises an error naming the file and line number.
4. **Generated code of the task family, train split only** (``tiny``): each document
   is one tiny module followed by its unit tests, the code the tiny RL tasks are cut
   from. The benchmark's modules come from a disjoint seed range
   (``cursor_rl.data.splits``), so no benchmark module is ever a document. At
   scale the same role is played by code of the repositories tasks come from.
5. **Copy drills** (``copy``), an opt-in source for curriculum experiments: an
   agent must copy names from its context (a file path from the task, a function
   name from the file it read), and a model of a few million parameters trained for
   a few hundred steps on code barely learns to (tiny model: 3 of 39 module names
   copied after 150 steps, 14 of 39 after 500). Repeated random sequences are the
   classic way induction heads are made to form (Olsson et al., 2022): each
   document is a line of identifiers drawn uniformly from the stdlib corpus's, then
   the same line again, whose second half is predictable only by copying.
   Deterministic per index, pure text (tokenized like any document). Measured on
   the tiny model (2-core CPU, 200 steps): mixed into stdlib + tiny code (~5-15%
   of tokens) it did *not* make copying appear, so no config uses it by default.
   (Uniform random repeats of one fixed length are copied within 150 steps, but by
   a fixed look-back; with varying lengths the model stays at chance:
   ``cursor_rl.eval.probes``.)
6. **Bytes that are not UTF-8 are skipped**, not decoded with replacement
   characters: a few CPython test files are deliberately in other encodings, and
   U+FFFD noise teaches the model nothing.

Pure Python and NumPy-free: no JAX import, so CPU-only workers can read data.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import random
import re
import sysconfig
from collections.abc import Iterable, Sequence
from typing import Any

from cursor_rl.data import splits, tiny_modules

# Pure-Python halves of a module that live under another name (see choice 1b).
_TWINS: dict[str, tuple[str, ...]] = {
    "collections": ("_collections_abc",),
    "collections.abc": ("_collections_abc",),
    "weakref": ("_weakrefset",),
    "threading": ("_threading_local",),
    "html.parser": ("_markupbase",),
    "datetime": ("_pydatetime", "_strptime"),
    "abc": ("_py_abc",),
}

# Directories never part of the stdlib corpus (choice 1e).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

SOURCE_KINDS = ("stdlib", "files", "jsonl", "array_record", "tiny", "copy")
TINY_DEFAULT_REPOS = 4096
COPY_DEFAULT_DOCS = 4096

Document = dict[str, str]
_IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,30}\b")


def default_excluded_modules() -> tuple[str, ...]:
    """The stdlib modules reserved for evaluation: ``cursor_rl.data.splits.BENCH_MODULES``."""
    return tuple(splits.BENCH_MODULES)


def stdlib_root() -> str:
    """The running interpreter's standard library directory."""
    return sysconfig.get_paths()["stdlib"]


def normalized_hash(text: str) -> bytes:
    """Hash of ``text`` insensitive to trailing whitespace and line-ending style."""
    lines = (line.rstrip() for line in text.splitlines())
    canonical = "\n".join(lines).strip()
    return hashlib.blake2b(canonical.encode("utf-8"), digest_size=16).digest()


def is_reserved_path(relpath: str, modules: Iterable[str]) -> bool:
    """Whether ``relpath`` (relative to the stdlib root, ``/``-separated) is reserved.

    Args:
      relpath: a path such as ``json/decoder.py`` or ``test/test_json/test_fail.py``.
      modules: dotted module names reserved for evaluation.

    Returns:
      True when the file is one of a module's sources, twins or tests (choice 1).
    """
    parts = relpath.split("/")
    directory, filename = parts[:-1], parts[-1]
    stem = filename.removesuffix(".py")
    for module in modules:
        names = module.split(".")
        # (a) the module file, or anything inside its package directory.
        if directory[: len(names)] == names:
            return True
        if directory == names[:-1] and stem == names[-1]:
            return True
        # (b) pure-Python twins beside it, and known private halves at the top level.
        if directory == names[:-1] and stem in (f"_py{names[-1]}", f"_py_{names[-1]}"):
            return True
        if not directory and stem in _TWINS.get(module, ()):
            return True
        # (c) its tests in the `test` package.
        if directory[:1] == ["test"] and _is_test_of(parts[1:], names):
            return True
    return False


def _is_test_of(test_parts: list[str], names: list[str]) -> bool:
    """Whether ``test/<test_parts>`` tests the module ``names`` (CPython's layout)."""

    def named(part: str, name: str) -> bool:
        stem = part.removesuffix(".py")
        return stem == f"test_{name}" or stem.startswith(f"test_{name}_")

    flat = "_".join(names)
    if named(test_parts[0], flat):  # test_json.py, test_json_x.py, test_json/..., test_a_b.py
        return True
    # A dotted module's tests sit in its package's test directory: test/test_a/test_b.py.
    return (
        len(names) > 1
        and test_parts[0] == f"test_{names[0]}"
        and any(named(part, names[-1]) for part in test_parts[1:])
    )


def _decode(data: bytes) -> str | None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


class FileSource:
    """Text files from a sorted path list, read on access."""

    def __init__(self, paths: Sequence[str], name: str, root: str | None = None):
        self._paths = list(paths)
        self._root = root
        self.name = name

    def __len__(self) -> int:
        return len(self._paths)

    def __getitem__(self, index: int) -> Document | None:
        path = self._paths[index]
        try:
            with open(path, "rb") as fh:
                text = _decode(fh.read())
        except OSError as e:
            raise OSError(f"cannot read corpus file {path}: {e}") from e
        if text is None:
            return None
        doc_id = os.path.relpath(path, self._root) if self._root else path
        return {"text": text, "source": self.name, "id": doc_id}

    @property
    def paths(self) -> list[str]:
        return list(self._paths)


class StdlibSource(FileSource):
    """The interpreter's standard library ``*.py`` files minus the reserved modules.

    Attributes:
      excluded: paths (relative to the stdlib root) removed as reserved for evaluation.
    """

    def __init__(self, exclude_modules: Sequence[str] | None = None, root: str | None = None):
        root = root or stdlib_root()
        if exclude_modules is None:
            exclude_modules = default_excluded_modules()
        self.exclude_modules = tuple(exclude_modules)
        kept, self.excluded = [], []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
            for filename in sorted(filenames):
                if not filename.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, filename), root).replace(os.sep, "/")
                if is_reserved_path(rel, self.exclude_modules):
                    self.excluded.append(rel)
                else:
                    kept.append(os.path.join(root, rel))
        if not kept:
            raise ValueError(f"no Python files found in the standard library at {root}")
        super().__init__(sorted(kept), name="stdlib", root=root)
        self.root = root

    def excluded_texts(self) -> list[str]:
        """Contents of the reserved files (for ``BenchGuard``); undecodable ones skipped."""
        texts = []
        for rel in self.excluded:
            with open(os.path.join(self.root, rel), "rb") as fh:
                text = _decode(fh.read())
            if text is not None:
                texts.append(text)
        return texts


class TinySource:
    """Train-split tiny-family modules, each with its tests, generated on access."""

    def __init__(self, count: int = TINY_DEFAULT_REPOS):
        seeds = splits.tiny_seeds("train")
        if not 0 < count <= len(seeds):
            raise ValueError(f"tiny:{count}: the count must be in 1..{len(seeds)}")
        self._seeds = seeds[:count]
        self.name = f"tiny:{count}"

    def __len__(self) -> int:
        return len(self._seeds)

    def __getitem__(self, index: int) -> Document:
        module = tiny_modules.tiny_module(self._seeds[index])  # a train seed by construction
        text = f"# {module.code_file}\n{module.source}\n# {module.test_file}\n{module.tests}"
        return {"text": text, "source": "tiny", "id": module.id}


@functools.cache
def _stdlib_identifiers(exclude_modules: tuple[str, ...] | None) -> tuple[str, ...]:
    """The distinct identifiers of the stdlib corpus (once per process: ~1 s)."""
    stdlib = StdlibSource(exclude_modules=exclude_modules)
    names: set[str] = set()
    for i in range(len(stdlib)):
        document = stdlib[i]
        if document is not None:
            names.update(_IDENTIFIER.findall(document["text"]))
    return tuple(sorted(names))


class CopySource:
    """Copy drills (choice 5): a line of identifiers, then the same line again.

    The identifiers are drawn uniformly from those of the standard-library corpus
    (with the same reserved modules excluded as the ``stdlib`` source), so the repeat
    is predictable only by copying: drawn from a low-entropy pool (e.g. made-up
    syllables) a tiny model settles on the pool's statistics and never learns to
    copy (measured: no copying after 150 steps on such drills alone).
    """

    _WORDS = (4, 16)  # identifiers per line: the doubled line fits a 256-token row

    def __init__(
        self, count: int = COPY_DEFAULT_DOCS, exclude_modules: Sequence[str] | None = None
    ):
        if count < 1:
            raise ValueError(f"copy:{count}: the count must be at least 1")
        self._count = count
        self._exclude = None if exclude_modules is None else tuple(exclude_modules)
        self.name = f"copy:{count}"

    def __len__(self) -> int:
        return self._count

    def _identifiers(self) -> tuple[str, ...]:
        return _stdlib_identifiers(self._exclude)

    def __getitem__(self, index: int) -> Document:
        if not 0 <= index < self._count:
            raise IndexError(index)
        pool = self._identifiers()
        rng = random.Random(f"copy:{index}")
        line = " ".join(rng.choice(pool) for _ in range(rng.randint(*self._WORDS)))
        return {"text": f"{line}\n{line}\n", "source": "copy", "id": f"copy-{index:07d}"}


class JsonlSource:
    """JSONL files, one document per line, indexed by byte offset."""

    def __init__(self, paths: Sequence[str], text_field: str = "text", name: str = "jsonl"):
        self.name = name
        self._text_field = text_field
        self._paths = list(paths)
        self._index: list[tuple[int, int, int]] = []  # (file number, byte offset, line number)
        for file_no, path in enumerate(self._paths):
            with open(path, "rb") as fh:
                offset = 0
                for line_no, line in enumerate(fh, start=1):
                    if line.strip():
                        self._index.append((file_no, offset, line_no))
                    offset += len(line)

    def __len__(self) -> int:
        return len(self._index)

    def record(self, index: int) -> tuple[dict[str, Any], str]:
        """The JSON object on the ``index``-th non-blank line, and ``file:line`` for errors."""
        file_no, offset, line_no = self._index[index]
        path = self._paths[file_no]
        with open(path, "rb") as fh:
            fh.seek(offset)
            line = fh.readline()
        where = f"{path}:{line_no}"
        return parse_json_record(line, where), where

    def __getitem__(self, index: int) -> Document | None:
        record, where = self.record(index)
        text = record_text(record, self._text_field, where)
        if not text.strip():
            return None
        return {"text": text, "source": self.name, "id": str(record.get("id", where))}


class ArrayRecordSource:
    """ArrayRecord shards of JSON records, as ``prepare`` writes them."""

    def __init__(self, paths: Sequence[str], text_field: str = "text", name: str = "array_record"):
        import grain  # grain is a core dependency; imported here to keep `sources` light

        self.name = name
        self._text_field = text_field
        self._paths = list(paths)
        self._reader = grain.sources.ArrayRecordDataSource(self._paths)

    def __len__(self) -> int:
        return len(self._reader)

    def __getitem__(self, index: int) -> Document | None:
        where = (
            f"{self._paths[0] if len(self._paths) == 1 else 'ArrayRecord shards'} record {index}"
        )
        record = parse_json_record(self._reader[index], where)
        text = record_text(record, self._text_field, where)
        if not text.strip():
            return None
        return {
            "text": text,
            "source": str(record.get("source", self.name)),
            "id": str(record.get("id", index)),
        }

    def __getstate__(self) -> dict[str, Any]:
        # The reader holds file handles; workers reopen the shards.
        return {"name": self.name, "text_field": self._text_field, "paths": self._paths}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["paths"], state["text_field"], state["name"])


def parse_json_record(line: bytes | str, where: str) -> dict[str, Any]:
    """Parses one JSON object; errors name ``where`` (``file:line`` or record)."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: malformed JSON ({e})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def record_text(record: dict[str, Any], text_field: str, where: str) -> str:
    """The text field of a record; errors name ``where`` and the field."""
    if text_field not in record:
        raise ValueError(f"{where}: no {text_field!r} field (has {sorted(record)})")
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string")
    return text


def expand_paths(patterns: Sequence[str], *, directory_suffix: str | None = ".py") -> list[str]:
    """Sorted files matched by globs (``**`` recursive); a directory means all files in it.

    Args:
      patterns: file paths, directories or glob patterns.
      directory_suffix: files under a named directory must end with this (None: all).

    Returns:
      Sorted, de-duplicated file paths.

    Raises:
      FileNotFoundError: a pattern matches nothing (naming the pattern).
    """
    found: set[str] = set()
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matches:
            raise FileNotFoundError(f"corpus pattern {pattern!r} matches no file")
        for match in matches:
            if os.path.isdir(match):
                for dirpath, dirnames, filenames in os.walk(match):
                    dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
                    for filename in filenames:
                        if directory_suffix is None or filename.endswith(directory_suffix):
                            found.add(os.path.join(dirpath, filename))
            else:
                found.add(match)
    return sorted(found)


def open_source(
    spec: str,
    *,
    text_field: str = "text",
    exclude_modules: Sequence[str] | None = None,
) -> FileSource | JsonlSource | ArrayRecordSource | TinySource | CopySource:
    """Opens the source named by a spec string (see the module docstring).

    Args:
      spec: ``stdlib``, ``files:GLOBS``, ``jsonl:GLOBS``, ``array_record:GLOBS``
        (globs separated by commas), ``tiny[:COUNT]`` or ``copy[:COUNT]``.
      text_field: the JSON field holding the text (JSONL and ArrayRecord).
      exclude_modules: stdlib modules reserved for evaluation; None means
        ``cursor_rl.data.splits.BENCH_MODULES``.

    Returns:
      A random-access source of documents.
    """
    kind, _, arg = spec.partition(":")
    if kind not in SOURCE_KINDS:
        raise ValueError(f"unknown corpus source {spec!r}: the kind must be one of {SOURCE_KINDS}")
    if kind in ("tiny", "copy"):
        if arg and not arg.isdigit():
            raise ValueError(f"corpus source {spec!r}: use {kind} or {kind}:COUNT")
        if kind == "copy":
            return CopySource(int(arg) if arg else COPY_DEFAULT_DOCS, exclude_modules)
        return TinySource(int(arg) if arg else TINY_DEFAULT_REPOS)
    if kind == "stdlib":
        root = arg or None
        return StdlibSource(exclude_modules=exclude_modules, root=root)
    patterns = [p for p in arg.split(",") if p]
    if not patterns:
        raise ValueError(f"corpus source {spec!r} names no path: use {kind}:GLOB[,GLOB...]")
    if kind == "files":
        return FileSource(expand_paths(patterns), name=spec)
    if kind == "jsonl":
        return JsonlSource(expand_paths(patterns, directory_suffix=".jsonl"), text_field, spec)
    return ArrayRecordSource(
        expand_paths(patterns, directory_suffix=".array_record"), text_field, spec
    )


class BenchGuard:
    """Drops documents identical (up to whitespace) to a reserved benchmark file."""

    def __init__(self, reserved_texts: Iterable[str]):
        self._hashes = frozenset(normalized_hash(t) for t in reserved_texts)

    def __len__(self) -> int:
        return len(self._hashes)

    def is_reserved(self, text: str) -> bool:
        return bool(self._hashes) and normalized_hash(text) in self._hashes

    @classmethod
    def for_stdlib(cls, exclude_modules: Sequence[str] | None = None) -> BenchGuard:
        """The guard for the reserved stdlib modules of the running interpreter."""
        source = StdlibSource(exclude_modules=exclude_modules)
        return cls(source.excluded_texts())
