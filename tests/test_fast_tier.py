"""The fast tier (``pytest -m "not slow"``) still reaches every part of the package.

Tests marked ``@pytest.mark.slow`` leave the fast tier; this test reads the test
modules' source (no imports, so it costs nothing) and checks that every subpackage
and top-level module of ``cursor_rl`` is named by at least one test module that keeps
a test in the fast tier: imported, or run as ``python -m cursor_rl.<name>`` (running
``cursor_rl.main`` runs ``cli`` and ``pipeline`` too, which only the entry point imports).
It checks what is named, not what is exercised: a cheap guard against marking a whole
package's tests slow.
"""

import ast
import pathlib
import re

import cursor_rl

TESTS = pathlib.Path(__file__).parent
PACKAGE = pathlib.Path(cursor_rl.__file__).parent
_NAMED = re.compile(r"\bcursor_rl\.(\w+)")
# What running an entry point reaches beyond the module itself.
_RUNS = {"main": ("cli", "pipeline")}


def _parts() -> set[str]:
    """Every subpackage and top-level module of cursor_rl ("__init__" excluded)."""
    parts = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    parts |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    return parts


def _is_slow(node: ast.expr) -> bool:
    """Whether a decorator or ``pytestmark`` value is (or holds) ``pytest.mark.slow``."""
    return any(isinstance(n, ast.Attribute) and n.attr == "slow" for n in ast.walk(node))


def _has_fast_test(tree: ast.Module) -> bool:
    """Whether a test module keeps at least one test function outside the slow mark."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        marks_module = any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets)
        if marks_module and _is_slow(node.value):
            return False
    tests = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    ]
    return any(not any(_is_slow(d) for d in node.decorator_list) for node in tests)


def _named_parts(tree: ast.Module) -> set[str]:
    """The cursor_rl parts a test module imports or names in a string."""
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                named |= set(_NAMED.findall(alias.name))
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "cursor_rl":
                named |= {alias.name for alias in node.names}
            else:
                named |= set(_NAMED.findall(node.module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named |= set(_NAMED.findall(node.value))
    for entry, reached in _RUNS.items():
        if entry in named:
            named |= set(reached)
    return named


def fast_tier_coverage() -> dict[str, list[str]]:
    """For each part of cursor_rl, the fast-tier test modules that name it."""
    coverage: dict[str, list[str]] = {part: [] for part in sorted(_parts())}
    for path in sorted(TESTS.glob("test_*.py")):
        if path.name == pathlib.Path(__file__).name:
            continue  # its own strings name parts of the package
        tree = ast.parse(path.read_text(), filename=str(path))
        if not _has_fast_test(tree):
            continue
        for part in _named_parts(tree) & coverage.keys():
            coverage[part].append(path.name)
    return coverage


def test_every_part_of_the_package_is_in_the_fast_tier():
    coverage = fast_tier_coverage()
    missing = sorted(part for part, modules in coverage.items() if not modules)
    assert not missing, f"no test outside @pytest.mark.slow names cursor_rl.{missing}"


def test_slow_marks_are_seen():
    """The detector itself: a slow-only module is not fast, a mixed one is."""
    slow_only = ast.parse("import pytest\n@pytest.mark.slow\ndef test_a():\n    pass\n")
    module_mark = ast.parse("import pytest\npytestmark = [pytest.mark.slow]\ndef test_a(): ...\n")
    mixed = ast.parse("import pytest\n@pytest.mark.slow\ndef test_a(): ...\ndef test_b(): ...\n")
    assert not _has_fast_test(slow_only)
    assert not _has_fast_test(module_mark)
    assert _has_fast_test(mixed)
    named = _named_parts(ast.parse("from cursor_rl import stages\nx = 'cursor_rl.main'"))
    assert named == {"stages", "main", "cli", "pipeline"}
