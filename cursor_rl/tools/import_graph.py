"""The package's import graph by floor: what may import what, and whether it holds.

    python -m cursor_rl.tools.import_graph    # the floors, bottom first, with their imports

A *floor* is a subpackage of ``cursor_rl`` (``chat``, ``data``, ``env``, ...) or a
top-level module (``partitioning``, ``stages``, ``pipeline``, ...). Floor A depends
on floor B when a module of A imports a module of B, at the top of the file or
inside a function alike: a cycle hidden in a function is still a cycle. The graph
must have none, so the floors stack and every import points down
(``tests/test_import_graph.py`` checks it, and the BUILD generator reads imports
with the same parser).

Inside a function only optional extras are imported (torch, seqio, ...). A module
of ``cursor_rl`` imported there is reported unless ``DEFERRED`` names it, with the
reason.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import os
from collections.abc import Iterable, Mapping

PACKAGE = "cursor_rl"

# (importer, imported) -> why the import waits inside a function.
DEFERRED: dict[tuple[str, str], str] = {
    ("cursor_rl.data.pipeline", "cursor_rl.data.seqio_bridge"): (
        "the seqio bridge imports the seqio extra (seqio, tensorflow) at its top"
    ),
    **{
        ("cursor_rl.tasks.autoinstall", module): (
            "only Autoinstall's agent mode loads a model (JAX, Orbax); the heuristic and "
            "scripted modes, and the task factory that imports them, stay pure Python"
        )
        for module in (
            "cursor_rl.sampler.chat",
            "cursor_rl.sampler.sampler",
            "cursor_rl.sampler.sampling",
            "cursor_rl.bases",
            "cursor_rl.checkpoints",
        )
    },
}


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement.

    Attributes:
      module: the module after ``import`` or ``from`` (relative imports resolved).
      names: for ``from M import a, b``: ``("a", "b")``; empty for ``import M``.
      line: its line number.
      in_function: whether it sits inside a function (runs only when called).
    """

    module: str
    names: tuple[str, ...]
    line: int
    in_function: bool

    @property
    def candidates(self) -> list[str]:
        """What it may load: the module, and ``module.name`` for each imported name."""
        return [self.module, *(f"{self.module}.{name}" for name in self.names)]


def imports(source: str, module: str, is_package: bool, filename: str = "<source>") -> list[Import]:
    """Every import statement of ``source``, the module named ``module``.

    Args:
      source: the file's text.
      module: its dotted name (resolves relative imports).
      is_package: whether the file is a package's ``__init__.py``.
      filename: for syntax errors.
    """
    tree = ast.parse(source, filename=filename)
    in_function = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(function)
    }
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        deferred = id(node) in in_function
        if isinstance(node, ast.Import):
            found += [Import(alias.name, (), node.lineno, deferred) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            names = tuple(alias.name for alias in node.names)
            found.append(Import(name, names, node.lineno, deferred))
    return sorted(found, key=lambda i: i.line)


def package_modules(root: str) -> dict[str, str]:
    """Every module of the package under ``root`` (the repository): dotted name -> path."""
    modules = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, PACKAGE)):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
        for filename in sorted(f for f in filenames if f.endswith(".py")):
            path = os.path.join(dirpath, filename)
            parts = os.path.relpath(path, root)[: -len(".py")].split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def floor(module: str) -> str:
    """The floor of a ``cursor_rl`` module: its subpackage or top-level module name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@dataclasses.dataclass(frozen=True)
class Edge:
    """One import of a package module by another."""

    importer: str
    imported: str
    path: str
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = " (inside a function)" if self.in_function else ""
        return f"{self.path}:{self.line} imports {self.imported}{where}"


def edges(root: str) -> list[Edge]:
    """Every import of a ``cursor_rl`` module by a ``cursor_rl`` module under ``root``."""
    modules = package_modules(root)
    found = []
    for name, path in modules.items():
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
        rel = os.path.relpath(path, root)
        for statement in imports(source, name, path.endswith("__init__.py"), rel):
            if statement.module.split(".")[0] != PACKAGE:
                continue
            # ``from P import x``: x is a module of P, or a name defined in P.
            targets = [c for c in statement.candidates[1:] if c in modules]
            if len(targets) < len(statement.names) or not statement.names:
                targets.append(statement.module)
            for target in targets:
                found.append(Edge(name, target, rel, statement.line, statement.in_function))
    return found


def floor_graph(all_edges: Iterable[Edge]) -> dict[str, dict[str, list[Edge]]]:
    """Floor -> the floors it imports -> the imports that make it so."""
    graph: dict[str, dict[str, list[Edge]]] = {}
    for edge in all_edges:
        source, target = floor(edge.importer), floor(edge.imported)
        out = graph.setdefault(source, {})  # a node even when it imports no other floor
        if source != target:
            out.setdefault(target, []).append(edge)
    return graph


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """A cycle of ``graph`` as its nodes, the first repeated at the end; None if acyclic."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for neighbour in sorted(graph.get(node, ())):
            if neighbour in on_path:
                return [*path[path.index(neighbour) :], neighbour]
            if neighbour not in done:
                cycle = visit(neighbour)
                if cycle:
                    return cycle
        on_path.discard(path.pop())
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def describe_cycle(cycle: list[str], graph: Mapping[str, Mapping[str, list[Edge]]]) -> str:
    """The cycle and, for each step, the first import that makes it."""
    steps = [f"{a} -> {b}: {graph[a][b][0]}" for a, b in itertools.pairwise(cycle)]
    return " -> ".join(cycle) + "\n  " + "\n  ".join(steps)


def stack(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The floors of an acyclic graph, bottom first: each lies one above the highest it imports."""
    height: dict[str, int] = {}

    def of(node: str) -> int:
        if node not in height:
            height[node] = 1 + max((of(n) for n in graph.get(node, ())), default=-1)
        return height[node]

    nodes = set(graph) | {n for targets in graph.values() for n in targets}
    levels: list[list[str]] = [[] for _ in range(1 + max(map(of, nodes), default=-1))]
    for node in sorted(nodes):
        levels[of(node)].append(node)
    return levels


def undeclared_deferred(all_edges: Iterable[Edge]) -> list[Edge]:
    """Package modules imported inside a function without a ``DEFERRED`` entry."""
    return [e for e in all_edges if e.in_function and (e.importer, e.imported) not in DEFERRED]


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    graph = floor_graph(edges(root))
    cycle = find_cycle(graph)
    if cycle:
        raise SystemExit(f"import cycle: {describe_cycle(cycle, graph)}")
    for level, nodes in enumerate(stack(graph)):
        for node in nodes:
            below = ", ".join(sorted(graph.get(node, {}))) or "-"
            print(f"{level:>2}  {node:<13} imports {below}")


if __name__ == "__main__":
    main()
