"""What every task generator shares: the repository it reads, the candidate it
proposes, the string registry, and source-code surgery helpers.

A *generator* turns a working repository (``SourceRepo``: a file tree whose tests
pass) into candidate tasks (``Candidate``): a set of file changes that makes the
agent's starting state (feature removed, bug injected) and, for refactors, the
changes that make the reference solution plus extra hidden tests (a structural
check). Whether a candidate becomes a task is decided later by running the tests
(``cursor_rl.tasks.validation``); generators only propose.

Design choices:

1. **Text surgery, not ``ast.unparse``.** Changes are spliced into the original text
   at the AST node's exact position, so a task's diff is the few lines a human would
   change, comments and formatting survive, and the prompt can quote real lines.
2. **Registries by string.** ``register(name, category)`` records a generator; the
   build command and configs name generators, tests enumerate ``names()``.
3. **Deterministic.** A generator returns every candidate it can make, in source
   order; sampling (with a seeded RNG) is the build's job, so the same repository
   always yields the same candidates.

Pure Python, no JAX.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import keyword
import re
import tokenize
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from cursor_rl.tasks import records

# ---- what generators consume and produce ----


@dataclasses.dataclass(frozen=True)
class SourceRepo:
    """A working repository tasks are made from.

    Attributes:
      name: a short name for ids and reports (``textwrap``, ``tiny-000042``).
      tree: every file, relative ``/`` path -> text (tests included).
      test_files: the test files; they are hidden from the agent and restored for
        grading.
      target_files: code files generators may change, each mapped to its dotted
        module name.
      test_framework: ``unittest`` or ``pytest`` (the harness runner's frameworks).
      test_command: the command a developer runs for the whole suite (recorded
        for people; grading runs the listed test ids with the harness runner).
      setup_commands: commands that prepare the environment (installs).
      source: the source kind (``stdlib``, ``tiny``, ``local``, ``sdist``).
      repo: the repository's identity for provenance (``cpython-3.11.7``, a path).
      family: the task family (``stdlib``, ``tiny``, ``repo``).
      environment: the environment recipe (interpreter, virtualenv, ...).
      prompt_style: ``full`` or ``short`` (tiny models have a ~1-2K token context).
    """

    name: str
    tree: Mapping[str, str]
    test_files: tuple[str, ...]
    target_files: Mapping[str, str]
    test_framework: str
    test_command: str
    setup_commands: tuple[str, ...] = ()
    source: str = "local"
    repo: str = ""
    family: str = "repo"
    environment: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    prompt_style: str = "full"

    def visible_files(self) -> dict[str, str]:
        """The files the agent sees (everything but the tests)."""
        hidden = set(self.test_files)
        return {path: text for path, text in self.tree.items() if path not in hidden}


Changes = Mapping[str, str | None]  # path -> new text, or None to delete the file


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A proposed task, before validation.

    Attributes:
      generator: the registry name of the generator that made it.
      category: ``feature``, ``bug`` or ``refactor``.
      file: the file changed (relative path).
      symbol: the function, method (``Class.method``) or class concerned.
      start_changes: changes from the original tree to the agent's starting tree.
      solution_changes: changes from the original tree to the reference solution
        (empty: the original is the solution, as for removed features and bugs).
      test_changes: hidden test files added or replaced (refactor checks).
      prompt: renders the user prompt from the validated failing tests, a sequence
        of ``(test_id, failure_detail)``; only bug reports use them.
      features: static difficulty features (``lines_removed``, ``call_sites``, ...).
      description: one line for logs.
    """

    generator: str
    category: str
    file: str
    symbol: str
    start_changes: Changes
    prompt: Callable[[Sequence[tuple[str, str]]], str]
    features: Mapping[str, float]
    solution_changes: Changes = dataclasses.field(default_factory=dict)
    test_changes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    description: str = ""


Generator = Callable[[SourceRepo], list[Candidate]]


@dataclasses.dataclass(frozen=True)
class GeneratorSpec:
    """A registered generator: its name, task category and function."""

    name: str
    category: str
    fn: Generator


_REGISTRY: dict[str, GeneratorSpec] = {}


def register(name: str, category: str) -> Callable[[Generator], Generator]:
    """Decorator registering a generator under ``name`` for ``category`` tasks."""

    def wrap(fn: Generator) -> Generator:
        if name in _REGISTRY:
            raise ValueError(f"generator {name!r} is registered twice")
        _REGISTRY[name] = GeneratorSpec(name, category, fn)
        return fn

    return wrap


def get(name: str) -> GeneratorSpec:
    """The generator registered as ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown generator {name!r}; known: {sorted(_REGISTRY)}") from None


def names(category: str | None = None) -> list[str]:
    """Registered generator names (of one category, when given), sorted."""
    return sorted(n for n, spec in _REGISTRY.items() if category in (None, spec.category))


# ---- locating code ----


@dataclasses.dataclass(frozen=True)
class TargetFile:
    """A parsed code file a generator may change.

    Attributes:
      path: relative path.
      dotted: its module name.
      text: its source.
      module: its AST.
      lines: its lines (``lines_of``).
    """

    path: str
    dotted: str
    text: str
    module: ast.Module
    lines: list[str]


def target_files(repo: SourceRepo) -> Iterator[TargetFile]:
    """The repository's target files that parse, in path order."""
    for path, dotted in sorted(repo.target_files.items()):
        text = repo.tree[path]
        module = parse(text, path)
        if module is not None:
            yield TargetFile(path, dotted, text, module, lines_of(text))


@dataclasses.dataclass(frozen=True)
class FunctionSite:
    """A module-level function or a method of a module-level class.

    Attributes:
      symbol: ``name`` or ``Class.name``.
      node: the function's AST node.
      class_node: the enclosing class, or None.
      docstring: the docstring, or None.
      body: the statements after the docstring.
    """

    symbol: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    class_node: ast.ClassDef | None
    docstring: str | None
    body: list[ast.stmt]

    @property
    def name(self) -> str:
        return self.node.name


def function_sites(module: ast.Module) -> Iterator[FunctionSite]:
    """Module-level functions and methods of module-level classes, in source order."""
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in module.body:
        if isinstance(node, funcs):
            yield _site(node, None)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, funcs):
                    yield _site(item, node)


def _site(node, class_node) -> FunctionSite:
    docstring = ast.get_docstring(node, clean=False)
    body = node.body[1:] if docstring is not None else list(node.body)
    symbol = f"{class_node.name}.{node.name}" if class_node is not None else node.name
    return FunctionSite(symbol, node, class_node, docstring, body)


def lines_of(text: str) -> list[str]:
    """Source lines as the AST numbers them (split at ``\\n`` only, unlike ``splitlines``)."""
    return text.split("\n")


def lines_with_ends(text: str) -> list[str]:
    """``lines_of`` with each line's ``\\n`` kept."""
    return records.split_lines(text)


def parse(text: str, path: str = "<source>") -> ast.Module | None:
    """Parses Python source; None when it does not parse."""
    try:
        return ast.parse(text, filename=path)
    except (SyntaxError, ValueError):
        return None


def header_end(
    lines: Sequence[str], node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
) -> int:
    """The last line of a ``def``/``class`` header: before comments that open its body."""
    line = node.body[0].lineno - 1
    while line > node.lineno and (
        not lines[line - 1].strip() or lines[line - 1].strip().startswith("#")
    ):
        line -= 1
    return max(line, node.lineno)


def signature(text: str, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str:
    """The ``def``/``class`` header of a node as written (no decorators, no body comments)."""
    lines = lines_of(text)
    if node.body[0].lineno == node.lineno:  # one-line body ("def f(x): return x")
        return _cut_at_col(lines[node.lineno - 1], node.body[0].col_offset).rstrip().strip()
    joined = "\n".join(lines[node.lineno - 1 : header_end(lines, node)]).rstrip()
    return joined.strip() if "\n" not in joined else _dedent_block(joined)


def _dedent_block(text: str) -> str:
    lines = lines_of(text)
    indent = len(lines[0]) - len(lines[0].lstrip())
    return "\n".join(line[indent:] if line[:indent].isspace() else line for line in lines)


def _cut_at_col(line: str, col: int) -> str:
    """``line`` up to the UTF-8 byte column ``col`` (AST columns count bytes)."""
    return line.encode("utf-8")[:col].decode("utf-8", errors="ignore")


def line_span(node: ast.AST) -> tuple[int, int]:
    """First and last line of a node, decorators included (1-based, inclusive)."""
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return first, node.end_lineno


def segment(text: str, node: ast.AST) -> str:
    """The exact source text of a node."""
    return ast.get_source_segment(text, node) or ""


# ---- editing source text ----


class SourceEdit:
    """Replacements on one source text at AST positions, applied together.

    Positions are (line, byte column) as in the AST; edits must not overlap.
    """

    def __init__(self, text: str):
        self.text = text
        self._lines = lines_with_ends(text)
        self._starts = [0]
        for line in self._lines:
            self._starts.append(self._starts[-1] + len(line.encode("utf-8")))
        self._edits: list[tuple[int, int, str]] = []

    def offset(self, lineno: int, col: int) -> int:
        """Byte offset of an AST position."""
        return self._starts[lineno - 1] + col

    def replace_node(self, node: ast.AST, new: str) -> SourceEdit:
        """Replaces the exact source of ``node``."""
        start = self.offset(node.lineno, node.col_offset)
        end = self.offset(node.end_lineno, node.end_col_offset)
        return self.replace_bytes(start, end, new)

    def replace_lines(self, first: int, last: int, new_lines: Sequence[str]) -> SourceEdit:
        """Replaces whole lines ``first..last`` (1-based, inclusive)."""
        text = "".join(line if line.endswith("\n") else line + "\n" for line in new_lines)
        return self.replace_bytes(self._starts[first - 1], self._starts[last], text)

    def insert_lines(self, after: int, new_lines: Sequence[str]) -> SourceEdit:
        """Inserts whole lines after line ``after`` (1-based)."""
        text = "".join(line + "\n" for line in new_lines)
        if not self._lines[after - 1].endswith("\n"):
            text = "\n" + text.rstrip("\n")
        return self.replace_bytes(self._starts[after], self._starts[after], text)

    def replace_bytes(self, start: int, end: int, new: str) -> SourceEdit:
        self._edits.append((start, end, new))
        return self

    def apply(self) -> str:
        data = self.text.encode("utf-8")
        last = len(data) + 1
        for start, end, new in sorted(self._edits, reverse=True):
            if end > last:
                raise ValueError("overlapping source edits")
            data = data[:start] + new.encode("utf-8") + data[end:]
            last = start
        return data.decode("utf-8")


def indent_of(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def contains_multiline_string(node: ast.AST) -> bool:
    """Whether a node holds a string literal spanning lines (dedenting would change it)."""
    return any(
        isinstance(n, ast.Constant | ast.JoinedStr) and n.end_lineno != n.lineno
        for n in ast.walk(node)
    )


# ---- references ----


def count_references(tree: Mapping[str, str], name: str, *, skip: Sequence[str] = ()) -> int:
    """Loads of ``name`` (as a name or an attribute) across the Python files of a tree."""
    total = 0
    for path, text in tree.items():
        if not path.endswith(".py") or path in skip:
            continue
        module = parse(text, path)
        if module is None:
            continue
        for node in ast.walk(module):
            if (isinstance(node, ast.Name) and node.id == name) or (
                isinstance(node, ast.Attribute) and node.attr == name
            ):
                total += isinstance(node.ctx, ast.Load)
    return total


def call_site_lines(
    tree: Mapping[str, str], name: str, *, exclude: tuple[str, int, int] | None = None, limit=3
) -> list[str]:
    """Up to ``limit`` ``path:line: code`` lines that reference ``name``.

    Args:
      tree: the files to search (the visible repository).
      name: the function or class name.
      exclude: ``(path, first, last)`` lines to skip (the definition itself).
      limit: the most lines returned.
    """
    pattern = re.compile(rf"\b{re.escape(name)}\b")
    found = []
    for path in sorted(tree):
        if not path.endswith(".py"):
            continue
        module = parse(tree[path], path)
        if module is None:
            continue
        lines = lines_of(tree[path])
        seen = set()
        for node in ast.walk(module):
            ref = (isinstance(node, ast.Name) and node.id == name) or (
                isinstance(node, ast.Attribute) and node.attr == name
            )
            if not ref or not isinstance(node.ctx, ast.Load) or node.lineno in seen:
                continue
            if exclude and path == exclude[0] and exclude[1] <= node.lineno <= exclude[2]:
                continue
            seen.add(node.lineno)
            code = lines[node.lineno - 1].strip()
            if pattern.search(code):
                found.append((path, node.lineno, code))
    found.sort()
    return [f"{path}:{lineno}: {code}" for path, lineno, code in found[:limit]]


def rename_identifiers(text: str, old: str, new: str, *, strings: bool = False) -> str:
    """Renames NAME tokens ``old`` to ``new`` (and exact string literals, if asked).

    Token-based, so comments and unrelated substrings are untouched.
    """
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    edits = []
    lines = lines_with_ends(text)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    for tok in tokens:
        hit = tok.type == tokenize.NAME and tok.string == old
        if strings and tok.type == tokenize.STRING and tok.string in (f"'{old}'", f'"{old}"'):
            edits.append((tok, tok.string[0] + new + tok.string[0]))
        elif hit:
            edits.append((tok, new))
    for tok, replacement in reversed(edits):
        (sl, sc), (el, ec) = tok.start, tok.end
        a, b = starts[sl - 1] + sc, starts[el - 1] + ec
        text = text[:a] + replacement + text[b:]
    return text


def name_tokens(text: str) -> set[str]:
    """Every identifier token in a source text (keywords excluded)."""
    try:
        return {
            tok.string
            for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type == tokenize.NAME and not keyword.iskeyword(tok.string)
        }
    except (tokenize.TokenError, SyntaxError):
        return set()
