"""Autoinstall on locally created sample repositories (and one that cannot install).

The install runs in the harness sandbox; packages come from the host's pip
configuration (a local index where the machine has one, else PyPI).
"""

import json
import os

import pytest

from cursor_rl.env import sandbox
from cursor_rl.tasks import autoinstall, buildfiles

SETUP_PY_UNITTEST = {
    "setup.py": (
        "from setuptools import setup\n\n"
        "setup(name='mathx', version='0.1', packages=['mathx'], install_requires=[])\n"
    ),
    "mathx/__init__.py": "def double(x):\n    return 2 * x\n",
    "tests/__init__.py": "",
    "tests/test_mathx.py": (
        "import unittest\n\nimport mathx\n\n\n"
        "class DoubleTest(unittest.TestCase):\n"
        "    def test_double(self):\n        self.assertEqual(mathx.double(4), 8)\n"
    ),
}
PYPROJECT_PYTEST = {
    "pyproject.toml": (
        '[project]\nname = "greet"\nversion = "0.1"\ndependencies = []\n\n'
        '[project.optional-dependencies]\ntest = ["pytest"]\n\n'
        '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n'
    ),
    "src/greet/__init__.py": "def hello(name):\n    return f'hello {name}'\n",
    "tests/test_greet.py": (
        "import pytest\n\nfrom greet import hello\n\n\n"
        "@pytest.mark.parametrize('name', ['ann', 'bob'])\n"
        "def test_hello(name):\n    assert hello(name) == 'hello ' + name\n"
    ),
}
REQUIREMENTS_MAKEFILE = {
    "requirements.txt": "six\n",
    "Makefile": (
        "PYTHON ?= python\n\n.PHONY: test\ntest:\n\t$(PYTHON) -m unittest discover -s tests -v\n"
    ),
    "textstats.py": (
        "import six\n\n\ndef words(text):\n    return len(six.text_type(text).split())\n"
    ),
    "tests/test_textstats.py": (
        "import unittest\n\nimport textstats\n\n\n"
        "class WordsTest(unittest.TestCase):\n"
        "    def test_words(self):\n        self.assertEqual(textstats.words('a b c'), 3)\n"
    ),
}
BROKEN = {
    "requirements.txt": "cursor-rl-no-such-package-anywhere==9.9.9\n",
    "app.py": "def main():\n    return 0\n",
    "test_app.py": (
        "import unittest\n\nimport app\n\n\n"
        "class AppTest(unittest.TestCase):\n"
        "    def test_main(self):\n        self.assertEqual(app.main(), 0)\n"
    ),
}


def write_repo(root, files) -> str:
    for path, text in files.items():
        full = root / path
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_text(text)
    return str(root)


needs_sandbox = pytest.mark.skipif(
    sandbox.unavailable_reason() is not None, reason=f"{sandbox.unavailable_reason()}"
)


def _package_index_reachable() -> bool:
    _, hosts, local_paths = autoinstall.host_pip_options()
    return bool(local_paths) or bool(autoinstall._reachable(hosts))


needs_index = pytest.mark.skipif(
    not _package_index_reachable(), reason="no package index (local or PyPI) is reachable"
)


def test_discover_reads_each_kind_of_build_file(tmp_path):
    found = buildfiles.discover(write_repo(tmp_path / "a", SETUP_PY_UNITTEST))
    assert found.framework == "unittest"
    assert found.test_command == "python -m unittest discover -s tests -t ."
    assert found.packages == ("mathx",) and found.python_path == (".",)
    assert "setup.py" in found.build_files and found.requirements == ()

    found = buildfiles.discover(write_repo(tmp_path / "b", PYPROJECT_PYTEST))
    assert found.framework == "pytest" and found.test_command == "python -m pytest -q"
    assert found.requirements == ("pytest",)
    assert found.python_path == ("src", ".") and found.packages == ("greet",)

    found = buildfiles.discover(write_repo(tmp_path / "c", REQUIREMENTS_MAKEFILE))
    assert found.test_command == "python -m unittest discover -s tests -v"
    assert found.requirement_files == ("requirements.txt",)
    assert any("Makefile" in note for note in found.notes)
    assert found.packages == ("textstats",)


def test_normalize_command_accepts_only_test_runners():
    norm = buildfiles._normalize_command
    assert norm("pytest {posargs} tests") == "python -m pytest tests"
    assert norm("COVERAGE=1 coverage run -m pytest -x") == "python -m pytest -x"
    assert norm("@$(PYTHON) -m unittest discover") == "python -m unittest discover"
    assert norm("python3 -m pytest && rm -rf /") is None
    assert norm("flake8 src") is None


@needs_sandbox
@needs_index
@pytest.mark.slow
@pytest.mark.parametrize(
    "files, framework",
    [
        (SETUP_PY_UNITTEST, "unittest"),
        (PYPROJECT_PYTEST, "pytest"),
        (REQUIREMENTS_MAKEFILE, "unittest"),
    ],
)
def test_autoinstall_sample_repositories(tmp_path, files, framework):
    repo = write_repo(tmp_path / "repo", files)
    result = autoinstall.autoinstall(repo, str(tmp_path / "work"))
    assert result.ok, result.log[-3000:]
    recipe = result.recipe
    assert recipe.framework == framework and recipe.mode == "heuristic"
    assert os.path.exists(recipe.python)
    with open(tmp_path / "work" / autoinstall.RECIPE_FILE) as f:
        assert json.load(f)["test_command"] == recipe.test_command
    check = (tmp_path / "work" / "env" / autoinstall.CHECK_FILE).read_text()
    assert "test_imports" in check and recipe.test_command in check
    # The validation test really checks: break the project and it fails.
    env_repo = tmp_path / "work" / "env" / "repo"
    victim = next(
        p for p in env_repo.rglob("*.py") if "test" not in p.name and p.name != "setup.py"
    )
    victim.write_text("raise ImportError('broken on purpose')\n")
    with sandbox.Sandbox(
        str(tmp_path / "work" / "env"), readonly_paths=recipe.readonly_paths
    ) as sb:
        rerun = sb.run(f"venv/bin/python {autoinstall.CHECK_FILE}", timeout_s=300)
    assert rerun.exit_code != 0 and "broken on purpose" in rerun.stderr


@needs_sandbox
@pytest.mark.slow
def test_broken_repository_is_a_recorded_failure(tmp_path):
    repo = write_repo(tmp_path / "repo", BROKEN)
    results = autoinstall.autoinstall_batch(
        [repo, str(tmp_path / "missing")], str(tmp_path / "out")
    )
    assert [r.ok for r in results] == [False, False]
    assert results[0].reason == "install_failed"
    assert "cursor-rl-no-such-package-anywhere" in results[0].log
    with open(os.path.join(results[0].workdir, autoinstall.FAILURE_FILE)) as f:
        failure = json.load(f)
    assert failure["reason"] == "install_failed" and failure["log"] == autoinstall.LOG_FILE
    assert results[1].reason in autoinstall.FAILURE_REASONS  # a missing path: no crash


def scripted_agent(chat, turns):
    """A policy that plays fixed tool calls, one per assistant turn, then stops."""
    from cursor_rl.chat.protocol import Message

    queue = list(turns)

    def policy(prompt):
        del prompt
        calls = (queue.pop(0),) if queue else ()
        return chat.assistant_body(Message("assistant", "" if calls else "done", tool_calls=calls))

    return policy


def oracle_turns(repo, recipe_overrides=None):
    """The heuristic plan, replayed as harness tool calls (the agent mode's oracle)."""
    return autoinstall.scripted_turns(repo, autoinstall.AutoinstallConfig(), recipe_overrides)


@needs_sandbox
@pytest.mark.slow
def test_agent_mode_is_checked_and_falls_back_to_heuristics(tmp_path):
    from cursor_rl.chat.protocol import ChatFormat
    from cursor_rl.env import testing

    chat = ChatFormat(testing.tiny_tokenizer())
    repo = write_repo(tmp_path / "repo", SETUP_PY_UNITTEST)
    agent = scripted_agent(chat, oracle_turns(repo))
    result = autoinstall.agent_install(repo, str(tmp_path / "agent"), agent, chat)
    assert result.ok and result.recipe.mode == "agent", result.log[-3000:]
    heuristic = buildfiles.discover(repo)
    assert result.recipe.test_command == heuristic.test_command  # agrees with the oracle
    assert "list_dir" in result.log and "mathx/" in result.log  # it went through the tools
    # A recipe whose test command does not work is rejected; the heuristic takes over.
    wrong = oracle_turns(repo, {"test_command": "python -m unittest discover -s nowhere"})
    result = autoinstall.agent_install(
        repo, str(tmp_path / "bad"), scripted_agent(chat, wrong), chat
    )
    assert result.ok and result.recipe.mode == "heuristic"
    assert "agent recipe rejected by the validation test: tests_failed" in result.log


def test_validation_test_reads_pytest_and_unittest_summaries():
    namespace = {"__file__": "/env/autoinstall_check.py", "__name__": "check"}
    exec(autoinstall.check_source(["pkg"], ["."], "python -m pytest"), namespace)
    counts = namespace["counts"]
    assert counts("== 1 failed, 198 passed, 1 skipped in 0.85s ==") == (198, 1)
    assert counts("== 3 passed, 2 errors in 1s ==") == (3, 2)
    assert counts("....\nRan 4 tests in 0.1s\n\nOK\n") == (4, 0)
    assert counts("Ran 5 tests in 0.1s\n\nFAILED (failures=1, errors=1, skipped=1)") == (2, 2)
    assert counts("no tests here") == (0, 0)
