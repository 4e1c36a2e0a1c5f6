"""Task generators on a fixture repository (no sandbox: pure source transformations).

The fixture (``tests/fixtures/tasks/shapes``, stored as ``*.py.txt`` so that neither
pytest nor the BUILD generator mistakes it for project code) has two modules and
two unittest files.
"""

import ast
import os
import subprocess
import sys

import pytest

from cursor_rl.tasks import generators
from cursor_rl.tasks.generators import base
from cursor_rl.tasks.validation import apply_changes

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "tasks", "shapes")


def shapes_repo() -> generators.SourceRepo:
    tree = {}
    for name in sorted(os.listdir(FIXTURE)):
        with open(os.path.join(FIXTURE, name)) as f:
            tree[name.removesuffix(".txt")] = f.read()
    return generators.SourceRepo(
        name="shapes",
        tree=tree,
        test_files=("test_geometry.py", "test_report.py"),
        target_files={"geometry.py": "geometry", "report.py": "report"},
        test_framework="unittest",
        test_command="python -m unittest",
    )


def run_unittest(tree, tmp_path) -> subprocess.CompletedProcess:
    root = tmp_path / "repo"
    for path, text in tree.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "unittest", "-q"], cwd=root, capture_output=True, text=True
    )


def by_description(candidates, text):
    found = [c for c in candidates if text in c.description]
    assert found, [c.description for c in candidates]
    return found[0]


def changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    return [(a, b) for a, b in zip(before.split("\n"), after.split("\n")) if a != b]


def test_registry_enumerates_every_generator():
    assert generators.names("feature") == ["remove_class", "remove_function_body", "remove_module"]
    assert generators.names("bug") == [
        "drop_condition",
        "flip_comparison",
        "off_by_one",
        "swap_arguments",
        "wrong_return",
    ]
    assert generators.names("refactor") == ["extract_function", "rename_symbol"]
    with pytest.raises(KeyError, match="unknown generator"):
        generators.get("delete_everything")


@pytest.mark.parametrize("name", generators.names())
def test_every_generator_proposes_parsable_changes(name):
    repo = shapes_repo()
    candidates = generators.get(name).fn(repo)
    assert candidates, name
    for cand in candidates:
        assert cand.generator == name and cand.category == generators.get(name).category
        start = apply_changes(repo.tree, cand.start_changes)
        solution = apply_changes(repo.tree, cand.solution_changes)
        assert start != solution, cand.description  # the task asks for some change
        for tree in (start, solution, cand.test_changes):
            for path, text in tree.items():
                assert ast.parse(text), (cand.description, path)
        assert cand.prompt([("test_x.T.test_y", "AssertionError: 1 != 2")]).strip()


def test_remove_function_body_keeps_the_spec_and_drops_the_code():
    repo = shapes_repo()
    cand = by_description(generators.get("remove_function_body").fn(repo), ":perimeter")
    broken = cand.start_changes["geometry.py"]
    assert "total += distance" not in broken
    assert '"""Return the length of the closed polygon through points."""' in broken
    assert "    raise NotImplementedError\n" in broken
    prompt = cand.prompt([])
    assert "def perimeter(points):" in prompt and "closed polygon" in prompt
    assert "report.py:8: length = perimeter(points)" in prompt  # a call site
    assert "total" not in prompt and "distance(points" not in prompt  # no solution leak
    assert cand.features["lines_removed"] == 5 and cand.features["call_sites"] == 1


def test_remove_class_and_module_list_the_interface():
    repo = shapes_repo()
    cand = generators.get("remove_class").fn(repo)[0]
    assert "class Point" not in cand.start_changes["geometry.py"]
    prompt = cand.prompt([])
    assert "def shifted(self, dx, dy):" in prompt and "Return a new point moved" in prompt
    assert "Point(self.x + dx" not in prompt
    module = by_description(generators.get("remove_module").fn(repo), "report.py")
    assert module.start_changes == {"report.py": None}
    assert "def describe(points):" in module.prompt([])


@pytest.mark.parametrize(
    "name, where, before, after",
    [
        ("flip_comparison", ":clamp", "    if value < low:", "    if value > low:"),
        (
            "off_by_one",
            "line 36: 1 -> 2",
            "        total += distance(points[i], points[(i + 1) % count])",
            "        total += distance(points[i], points[(i + 2) % count])",
        ),
        ("drop_condition", "if n < 0:", "    if n < 0:", "    return False"),
        (
            "swap_arguments",
            "'a.x' and 'b.x'",
            "    dx = a.x - b.x",
            "    dx = b.x - a.x",
        ),
        (
            "wrong_return",
            "line 54:",
            "    return root * root == n",
            "    return not (root * root == n)",
        ),
    ],
)
def test_bug_transforms_change_exactly_one_place(name, where, before, after):
    repo = shapes_repo()
    cand = by_description(generators.get(name).fn(repo), where)
    original = repo.tree["geometry.py"]
    broken = cand.start_changes["geometry.py"]
    diff = changed_lines(original, broken)
    assert diff[0] == (before, after), cand.description
    prompt = cand.prompt([("test_geometry.FunctionsTest.test_clamp", "AssertionError: 5 != 3")])
    assert "test_geometry.FunctionsTest.test_clamp" in prompt
    assert before.strip() not in prompt and after.strip() not in prompt  # no location leak


def test_rename_symbol_renames_across_files_and_checks_structure(tmp_path):
    repo = shapes_repo()
    cand = by_description(generators.get("rename_symbol").fn(repo), "perimeter")
    new = cand.description.split("-> ")[1]
    solution = apply_changes(repo.tree, cand.solution_changes)
    assert f'"{new}"' in solution["geometry.py"] and f"def {new}(points)" in solution["geometry.py"]
    assert f"from geometry import clamp, {new}" in solution["report.py"]
    assert "perimeter" not in base.name_tokens(solution["report.py"])
    hidden = {**{p: repo.tree[p] for p in repo.test_files}, **cand.test_changes}
    # The solved tree passes the original tests (through the alias preamble) and the check.
    solved = run_unittest({**solution, **hidden}, tmp_path / "solved")
    assert solved.returncode == 0, solved.stderr
    # The unchanged tree passes the behavioural tests but fails the structural check.
    start = run_unittest({**repo.tree, **hidden}, tmp_path / "start")
    assert start.returncode != 0
    assert "test_new_name_is_defined" in start.stderr and "test_old_name_is_gone" in start.stderr
    assert "test_perimeter_square" not in start.stderr
    # Leaving the old name behind as an alias fails the check.
    alias = dict(solution)
    alias["geometry.py"] += f"\nperimeter = {new}\n"
    aliased = run_unittest({**alias, **hidden}, tmp_path / "alias")
    assert "test_old_name_is_gone" in aliased.stderr


def test_extract_function_reference_preserves_behaviour(tmp_path):
    repo = shapes_repo()
    cand = by_description(generators.get("extract_function").fn(repo), "perimeter")
    solution = apply_changes(repo.tree, cand.solution_changes)
    text = solution["geometry.py"]
    assert "def _finish_perimeter(points, total):" in text
    assert "    return _finish_perimeter(points, total)" in text
    hidden = {**{p: repo.tree[p] for p in repo.test_files}, **cand.test_changes}
    solved = run_unittest({**solution, **hidden}, tmp_path / "solved")
    assert solved.returncode == 0, solved.stderr
    start = run_unittest({**repo.tree, **hidden}, tmp_path / "start")
    assert "test_helper_is_defined" in start.stderr
    assert "test_statements_moved_out" in start.stderr
    # A helper that exists and is called, but the code left in place, still fails.
    lazy = dict(repo.tree)
    lazy["geometry.py"] = (
        lazy["geometry.py"].replace(
            "    total = 0.0\n", "    total = 0.0\n    _finish_perimeter()\n"
        )
        + "\n\ndef _finish_perimeter():\n    return None\n"
    )
    cheated = run_unittest({**lazy, **hidden}, tmp_path / "lazy")
    assert "test_statements_moved_out" in cheated.stderr
    assert "test_function_calls_helper" not in cheated.stderr


def test_source_edit_counts_utf8_columns():
    text = 'def f(s):\n    return "é" + s < "b"\n'
    module = ast.parse(text)
    compare = next(n for n in ast.walk(module) if isinstance(n, ast.Compare))
    edited = base.SourceEdit(text).replace_node(compare.comparators[0], '"c"').apply()
    assert edited == 'def f(s):\n    return "é" + s < "c"\n'


def test_new_names_avoid_collisions():
    from cursor_rl.tasks.generators.refactor import new_name

    assert new_name("get_value", set()) == "fetch_value"
    assert new_name("TextWrapper", set()) == "StringWrapper"
    assert new_name("dedent", set()) == "dedent_impl"
    assert new_name("get_value", {"fetch_value"}) == "get_item"
