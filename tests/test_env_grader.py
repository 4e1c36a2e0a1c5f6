"""Grading: per-test outcomes under unittest and pytest, crashes, hangs, restoring test files."""

import os
import shutil

import pytest

from cursor_rl.env import testing
from cursor_rl.env.grader import GradeSpec, framework_of, grade


@pytest.fixture(autouse=True, scope="module")
def _needs_sandbox():
    testing.skip_without_sandbox()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return testing.make_toy_task(str(tmp_path_factory.mktemp("task")))


def agent_copy(task, tmp_path, multiply_body=None, files=None):
    """The agent's final workspace: the pristine repo with ``multiply`` replaced."""
    ws = str(tmp_path / "ws")
    shutil.copytree(task.repo, ws, symlinks=True)
    if multiply_body is not None:
        ops = os.path.join(ws, "calc", "ops.py")
        with open(ops) as f:
            text = f.read()
        broken = text[text.index("def multiply") :]
        with open(ops, "w") as f:
            f.write(text.replace(broken, "def multiply(a, b):\n" + multiply_body))
    for path, content in (files or {}).items():
        full = os.path.join(ws, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(content)
    return ws


def test_spec_validation(task):
    assert framework_of("tests/test_x.py::T::test_a[1-2]") == "pytest"
    assert framework_of("test.test_heapq.TestHeapPython.test_push_pop") == "unittest"
    for bad in ("test_x", "../x.py::t", "/abs.py::t", "tests/x.py", "a b.c"):
        with pytest.raises(ValueError):
            framework_of(bad)
    with pytest.raises(ValueError, match="at least one"):
        GradeSpec(pristine_repo=task.repo, fail_to_pass=())
    with pytest.raises(ValueError, match="twice"):
        GradeSpec(pristine_repo=task.repo, fail_to_pass=("a.b",), pass_to_pass=("a.b",))


@pytest.mark.parametrize("framework", ["unittest", "pytest"])
def test_pristine_fails_and_solution_resolves(task, tmp_path, framework):
    spec = task.spec(framework)
    f2p, p2p = spec.fail_to_pass[0], spec.pass_to_pass[0]
    before = grade(spec, task.repo)
    assert not before.resolved and before.changed_paths == () and before.flags == ()
    assert before.tests[f2p].status in ("failed", "error")
    assert "NotImplementedError" in before.tests[f2p].detail
    assert before.tests[p2p].status == "passed" and before.pass_to_pass == {p2p: True}
    after = grade(spec, agent_copy(task, tmp_path, "    return a * b\n"))
    assert after.resolved and after.fail_to_pass == {f2p: True}
    assert after.changed_paths == ("calc/ops.py",) and after.discarded_paths == ()
    assert set(after.timings) == {"prepare", "setup", "tests", "total"}
    assert after.tests[f2p].duration_s >= 0


def test_crash_costs_one_test(task, tmp_path):
    spec = task.spec()
    result = grade(spec, agent_copy(task, tmp_path, "    import os\n    os._exit(0)\n"))
    assert result.tests[testing.UNITTEST_F2P].status == "crashed"
    assert result.tests[testing.UNITTEST_P2P].status == "passed"  # rerun in a fresh process
    assert "crashed" in result.flags and not result.resolved


def test_kill_all_in_a_test_cannot_end_the_run(task, tmp_path):
    """kill(-1) from code under test finds no other process to kill (the runner is
    exec'd, not a shell's child), so the run goes on and no test is charged a crash;
    with a shell in between, the run was torn down during the sleep."""
    body = (
        "    import os, signal, time\n"
        "    try:\n"
        "        os.kill(-1, signal.SIGKILL)\n"
        "    except ProcessLookupError:\n"
        "        pass\n"
        "    time.sleep(0.5)\n"
        "    return a * b\n"
    )
    result = grade(task.spec(), agent_copy(task, tmp_path, body))
    assert result.tests[testing.UNITTEST_F2P].status == "passed", result.tests
    assert result.tests[testing.UNITTEST_P2P].status == "passed"
    assert result.resolved and "crashed" not in result.flags


def test_hang_costs_one_test(task, tmp_path):
    spec = task.spec(test_timeout_s=3)
    result = grade(spec, agent_copy(task, tmp_path, "    while True:\n        pass\n"))
    assert result.tests[testing.UNITTEST_F2P].status == "timeout"
    assert result.tests[testing.UNITTEST_P2P].status == "passed"
    assert "timeout" in result.flags and not result.resolved


@pytest.mark.parametrize("framework", ["unittest", "pytest"])
def test_import_errors_are_reported(task, tmp_path, framework):
    ws = agent_copy(task, tmp_path, "    return a *\n")  # a syntax error
    result = grade(task.spec(framework), ws)
    assert not result.resolved
    assert all(o.status in ("error", "not_run") for o in result.tests.values())
    assert all("SyntaxError" in o.detail for o in result.tests.values())


def test_setup_command_cannot_plant_files(task, tmp_path):
    ws = agent_copy(task, tmp_path, "    return a * b\n")
    setup = "echo 'raise SystemExit(3)' > tests/test_ops.py && touch setup_ran && exit 1"
    result = grade(task.spec(setup_command=setup), ws)
    assert result.resolved and "setup_failed" in result.flags


def test_repository_modules_shadow_the_interpreters(tmp_path):
    # unittest itself imports textwrap; the repository's textwrap must still win.
    repo = tmp_path / "repo"
    (repo / "Lib" / "test").mkdir(parents=True)
    (repo / "Lib" / "textwrap.py").write_text("def shout(s):\n    return s.upper()\n")
    (repo / "Lib" / "test" / "__init__.py").write_text("")
    (repo / "Lib" / "test" / "test_textwrap.py").write_text(
        "import textwrap, unittest\n\n\nclass T(unittest.TestCase):\n"
        "    def test_shout(self):\n        self.assertEqual(textwrap.shout('a'), 'A')\n"
    )
    spec = GradeSpec(
        pristine_repo=str(repo),
        fail_to_pass=("test.test_textwrap.T.test_shout",),
        python_path=("Lib",),
    )
    result = grade(spec, str(repo))
    assert result.resolved, result.tests
