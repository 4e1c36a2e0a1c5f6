"""Task records: what a validated task is, and its JSONL form.

A task is everything the RL loop and the benchmark need to run one episode and grade
it, frozen at build time:

* ``repo``: the repository the agent starts from, at a pinned state. The hidden test
  files are *not* in it. Stored either inline as a base64 tar.gz (``"archive"``: the
  stdlib and tiny families, a few KB each, so a dataset is one self-contained file)
  or as a directory beside the JSONL file (``"dir"``: large repositories). Both carry
  ``tree_sha256``, a hash of the file tree (paths and contents) that is the same for
  either form and is checked when the snapshot is unpacked. Files are UTF-8 text
  (Autoinstall leaves a repository's binary files out).
* ``hidden_tests``: test files (path -> text) restored over the agent's tree before
  grading; ``test_framework`` (``unittest``/``pytest``) and ``test_command`` say how
  they run (the command is for people: grading runs the listed ids with the harness
  runner); ``fail_to_pass`` / ``pass_to_pass`` are the test ids in the runner's format
  (``test_textwrap.WrapTestCase.test_simple``, ``tests/test_x.py::test_y``) that must
  pass for reward.
* ``solution_patch``: a unified diff from ``repo`` to the reference solution (never
  shown to the agent; used by the contamination check and for demonstrations).
* ``category`` (feature, bug, refactor), ``generator`` (its registry name),
  ``difficulty`` (static features; the RL loop adds measured solve rates with
  ``attach_solve_rates``) and ``provenance`` (``source``, ``repo``, ``module``,
  ``file``, ``symbol``).
* ``environment``: the interpreter recipe (``cursor_rl.tasks.environments``);
  ``validation``: how it was validated (seconds, test seconds, runs, flaky tests
  dropped, and the FAIL_TO_PASS tests' failure reports on the starting state).

Design choices:

1. Field names are snake_case and equal the JSON keys; ``SCHEMA_VERSION`` is written
   in every line, and a loader refuses versions it does not know rather than
   guessing.
2. Loading validates every field's presence and type and raises ``TaskRecordError``
   naming the file, line, task id and field, so a hand-edited or truncated dataset
   fails loudly at load time instead of in the middle of an RL run.
3. Archives are deterministic (sorted members, zero mtimes and owners), so the same
   tree always produces the same bytes.

Pure Python, no JAX.
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

SCHEMA_VERSION = 1
CATEGORIES = ("feature", "bug", "refactor")
SNAPSHOT_FORMATS = ("archive", "dir")
FRAMEWORKS = ("unittest", "pytest")  # the harness test runner's frameworks
TASKS_FILE = "tasks.jsonl"  # the records file inside a dataset directory


class TaskRecordError(ValueError):
    """A task record is malformed; the message names the record and the field."""


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where a task's code comes from (for contamination checks and reports).

    Attributes:
      source: the source kind: ``stdlib``, ``tiny``, ``local`` or ``sdist``.
      repo: the repository: ``cpython-3.11.7``, a path, ``pypi:NAME==VERSION``, ...
      module: the dotted module the task is about.
      file: the file changed, relative to the repository root.
      symbol: the function, method (``Class.method``) or class changed.
    """

    source: str
    repo: str
    module: str
    file: str
    symbol: str


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A repository tree at a pinned state.

    Attributes:
      format: ``"archive"`` (``data`` holds a base64 tar.gz) or ``"dir"`` (``path`` is a
        directory, relative to the dataset directory).
      tree_sha256: ``tree_hash`` of the tree.
      data: the base64 archive (format ``archive``), else ``""``.
      path: the directory (format ``dir``), else ``""``.
    """

    format: str
    tree_sha256: str
    data: str = ""
    path: str = ""


@dataclasses.dataclass(frozen=True)
class TaskRecord:
    """One validated task (see the module docstring for the meaning of each field)."""

    task_id: str
    split: str
    family: str
    category: str
    generator: str
    prompt: str
    repo: Snapshot
    hidden_tests: dict[str, str]
    setup_commands: list[str]
    test_framework: str
    test_command: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    solution_patch: str
    difficulty: dict[str, float]
    provenance: Provenance
    environment: dict[str, Any]
    validation: dict[str, Any]
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict (field names are the keys)."""
        return dataclasses.asdict(self)


# field -> (expected type description, checker). Checked in this order.
def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _is_str_map(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(x, str) for k, x in v.items()
    )


def _is_number_map(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(x, int | float) and not isinstance(x, bool)
        for k, x in v.items()
    )


_FIELDS: dict[str, tuple[str, Any]] = {
    "schema_version": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "task_id": ("a non-empty string", lambda v: isinstance(v, str) and bool(v)),
    "split": ("a string", lambda v: isinstance(v, str)),
    "family": ("a string", lambda v: isinstance(v, str)),
    "category": (f"one of {CATEGORIES}", lambda v: v in CATEGORIES),
    "generator": ("a string", lambda v: isinstance(v, str)),
    "prompt": ("a non-empty string", lambda v: isinstance(v, str) and bool(v)),
    "repo": ("an object", lambda v: isinstance(v, dict)),
    "hidden_tests": ("an object of path -> text", _is_str_map),
    "setup_commands": ("a list of strings", _is_str_list),
    "test_framework": (f"one of {FRAMEWORKS}", lambda v: v in FRAMEWORKS),
    "test_command": ("a non-empty string", lambda v: isinstance(v, str) and bool(v)),
    "fail_to_pass": ("a non-empty list of strings", lambda v: _is_str_list(v) and bool(v)),
    "pass_to_pass": ("a list of strings", _is_str_list),
    "solution_patch": ("a string", lambda v: isinstance(v, str)),
    "difficulty": ("an object of name -> number", _is_number_map),
    "provenance": ("an object", lambda v: isinstance(v, dict)),
    "environment": ("an object", lambda v: isinstance(v, dict)),
    "validation": ("an object", lambda v: isinstance(v, dict)),
}
_PROVENANCE_FIELDS = tuple(f.name for f in dataclasses.fields(Provenance))


def record_from_json(obj: Any, *, where: str = "record") -> TaskRecord:
    """Builds a ``TaskRecord`` from a decoded JSON object, checking every field.

    Args:
      obj: the decoded JSON value.
      where: how to name the record in errors (e.g. ``tasks.jsonl:12``).

    Returns:
      The record.

    Raises:
      TaskRecordError: a field is missing, has the wrong type, or the schema version
        is unknown; the message names ``where``, the task id and the field.
    """
    if not isinstance(obj, dict):
        raise TaskRecordError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    task_id = obj.get("task_id", "?")
    name = f"{where} (task_id {task_id!r})"

    def fail(field: str, expected: str) -> TaskRecordError:
        if field.split(".")[0] not in obj:
            return TaskRecordError(f"{name}: missing field {field!r}")
        return TaskRecordError(f"{name}: field {field!r} must be {expected}")

    for field, (expected, check) in _FIELDS.items():
        if field not in obj or not check(obj[field]):
            raise fail(field, expected)
    if obj["schema_version"] != SCHEMA_VERSION:
        raise TaskRecordError(
            f"{name}: field 'schema_version' is {obj['schema_version']}, this code reads "
            f"version {SCHEMA_VERSION}"
        )
    unknown = sorted(set(obj) - set(_FIELDS))
    if unknown:
        raise TaskRecordError(f"{name}: unknown field {unknown[0]!r}")
    prov = obj["provenance"]
    for field in _PROVENANCE_FIELDS:
        if not isinstance(prov.get(field), str):
            raise TaskRecordError(f"{name}: field 'provenance.{field}' must be a string")
    repo = obj["repo"]
    if repo.get("format") not in SNAPSHOT_FORMATS:
        raise TaskRecordError(f"{name}: field 'repo.format' must be one of {SNAPSHOT_FORMATS}")
    key = "data" if repo["format"] == "archive" else "path"
    for field in ("tree_sha256", key):
        if not isinstance(repo.get(field), str) or not repo[field]:
            raise TaskRecordError(f"{name}: field 'repo.{field}' must be a non-empty string")
    return TaskRecord(
        **{k: v for k, v in obj.items() if k not in ("repo", "provenance")},
        repo=Snapshot(**{k: repo[k] for k in ("format", "tree_sha256", key)}),
        provenance=Provenance(**{k: prov[k] for k in _PROVENANCE_FIELDS}),
    )


def read_tasks(path: str) -> Iterator[TaskRecord]:
    """Reads task records lazily from a JSONL file or a dataset directory.

    Args:
      path: a ``.jsonl`` file, or a directory holding ``tasks.jsonl``.

    Yields:
      Records in file order.

    Raises:
      TaskRecordError: a line is not JSON or not a valid record (named by line).
    """
    if os.path.isdir(path):
        path = os.path.join(path, TASKS_FILE)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskRecordError(f"{where}: not valid JSON: {e}") from None
            yield record_from_json(obj, where=where)


def load_tasks(path: str) -> list[TaskRecord]:
    """All records of a JSONL file or dataset directory (see ``read_tasks``)."""
    return list(read_tasks(path))


def write_tasks(records: Iterable[TaskRecord], path: str) -> int:
    """Writes records as JSONL (one object per line, keys sorted). Returns the count."""
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record.to_json(), sort_keys=True, ensure_ascii=False) + "\n")
            count += 1
    return count


def attach_solve_rates(
    path: str, outcomes: Mapping[str, tuple[int, int]], *, prefix: str = "solve"
) -> int:
    """Adds measured solve rates to a dataset's difficulty features, in place.

    The RL loop (or an eval) calls this with what it observed; static features stay.

    Args:
      path: a ``.jsonl`` file or a dataset directory.
      outcomes: task id -> (episodes solved, episodes attempted).
      prefix: feature names written: ``{prefix}_rate`` and ``{prefix}_attempts``.

    Returns:
      How many records were updated.
    """
    tasks = load_tasks(path)
    updated = 0
    for i, task in enumerate(tasks):
        if task.task_id in outcomes:
            solved, attempts = outcomes[task.task_id]
            difficulty = dict(task.difficulty)
            difficulty[f"{prefix}_rate"] = solved / attempts if attempts else 0.0
            difficulty[f"{prefix}_attempts"] = float(attempts)
            tasks[i] = dataclasses.replace(task, difficulty=difficulty)
            updated += 1
    target = os.path.join(path, TASKS_FILE) if os.path.isdir(path) else path
    write_tasks(tasks, target + ".tmp")
    os.replace(target + ".tmp", target)  # readers never see a half-written file
    return updated


# ---- file trees and snapshots ----

FileTree = Mapping[str, str]  # relative path ('/'-separated) -> text


def read_tree(root: str, *, skip_dirs: Iterable[str] = (".git", "__pycache__")) -> dict[str, str]:
    """Reads every file under ``root`` as UTF-8 text (relative ``/`` paths -> text)."""
    skip = set(skip_dirs)
    tree = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for filename in sorted(filenames):
            full = os.path.join(dirpath, filename)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            with open(full, encoding="utf-8") as f:
                tree[rel] = f.read()
    return tree


def write_tree(tree: FileTree, root: str) -> None:
    """Writes a file tree under ``root`` (creating directories as needed)."""
    for rel, text in tree.items():
        full = _safe_join(root, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(text)


def _safe_join(root: str, rel: str) -> str:
    """``root/rel``, refusing absolute paths and ``..`` (a record must stay inside)."""
    if os.path.isabs(rel) or ".." in rel.split("/") or not rel:
        raise TaskRecordError(f"unsafe path in task files: {rel!r}")
    return os.path.join(root, *rel.split("/"))


def split_lines(text: str) -> list[str]:
    """Lines with their ``\\n`` endings, split at ``\\n`` only.

    ``str.splitlines`` also splits at form feeds and other separators that Python
    source contains (CPython's stdlib has ``^L`` page breaks); diffs must not.
    """
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def tree_hash(tree: FileTree) -> str:
    """A content hash of a file tree: sorted paths with each file's sha256."""
    h = hashlib.sha256()
    for rel in sorted(tree):
        digest = hashlib.sha256(tree[rel].encode("utf-8")).hexdigest()
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


def archive_snapshot(tree: FileTree) -> Snapshot:
    """Packs a file tree into a deterministic inline archive snapshot."""
    buf = io.BytesIO()
    # mtime=0 in the gzip header too, so equal trees give equal bytes.
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for rel in sorted(tree):
            data = tree[rel].encode("utf-8")
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return Snapshot(
        format="archive",
        tree_sha256=tree_hash(tree),
        data=base64.b64encode(buf.getvalue()).decode("ascii"),
    )


def dir_snapshot(tree: FileTree, dataset_dir: str, relpath: str) -> Snapshot:
    """Writes a file tree to ``dataset_dir/relpath`` and returns a ``dir`` snapshot."""
    write_tree(tree, os.path.join(dataset_dir, relpath))
    return Snapshot(format="dir", tree_sha256=tree_hash(tree), path=relpath)


def snapshot_tree(snapshot: Snapshot, dataset_dir: str = "") -> dict[str, str]:
    """Unpacks a snapshot into a file tree, checking its ``tree_sha256``.

    Args:
      snapshot: the record's ``repo``.
      dataset_dir: the directory ``dir`` snapshots are relative to.

    Returns:
      Relative path -> text.

    Raises:
      TaskRecordError: the snapshot is corrupt or its hash does not match.
    """
    if snapshot.format == "archive":
        tree = {}
        try:
            raw = base64.b64decode(snapshot.data, validate=True)
            with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar:
                for member in tar.getmembers():
                    if not member.isfile():
                        raise TaskRecordError(f"archive member {member.name!r} is not a file")
                    _safe_join("/", member.name)
                    tree[member.name] = tar.extractfile(member).read().decode("utf-8")
        except (ValueError, tarfile.TarError, OSError) as e:
            raise TaskRecordError(f"corrupt repo archive: {e}") from None
    else:
        root = os.path.join(dataset_dir, snapshot.path)
        if not os.path.isdir(root):
            raise TaskRecordError(f"repo directory {root} does not exist")
        tree = read_tree(root)
    if tree_hash(tree) != snapshot.tree_sha256:
        raise TaskRecordError("repo snapshot does not match its tree_sha256")
    return tree


def materialize(record: TaskRecord, dest: str, *, dataset_dir: str = "") -> None:
    """Writes the task's starting repository (no hidden tests) into ``dest``.

    Args:
      record: the task.
      dest: an empty or missing directory; it becomes the agent's workspace.
      dataset_dir: the dataset directory (for ``dir`` snapshots).
    """
    os.makedirs(dest, exist_ok=True)
    write_tree(snapshot_tree(record.repo, dataset_dir), dest)
