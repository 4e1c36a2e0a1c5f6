"""Autoinstall's agent mode from the task builder's command line (issue 23, item 6).

What is checked, through ``cursor_rl.tasks.build.main`` on a small source tree (no
dependencies, so no package index is needed): ``--autoinstall=scripted`` installs
through the agent mode and its recipe is kept; an agent cut off before writing its
recipe falls back to the heuristic and the build still gets its task; bad values
and combinations of the flags are clear errors before anything is built; and a
real model (the built-in tiny base) runs as the agent and falls back too.
"""

import json
import os

import pytest

from cursor_rl.env import sandbox
from cursor_rl.tasks import autoinstall, build, records

SOURCE_TREE = {
    "setup.py": (
        "from setuptools import setup\n\n"
        "setup(name='mathx', version='0.1', packages=['mathx'], install_requires=[])\n"
    ),
    "mathx/__init__.py": (
        "def double(x):\n    return 2 * x\n\n\n"
        "def clamp(x, low, high):\n"
        "    if x < low:\n        return low\n"
        "    if x > high:\n        return high\n"
        "    return x\n"
    ),
    "tests/__init__.py": "",
    "tests/test_mathx.py": (
        "import unittest\n\nimport mathx\n\n\n"
        "class MathxTest(unittest.TestCase):\n"
        "    def test_double(self):\n        self.assertEqual(mathx.double(4), 8)\n\n"
        "    def test_clamp(self):\n"
        "        self.assertEqual(mathx.clamp(5, 0, 3), 3)\n"
        "        self.assertEqual(mathx.clamp(-1, 0, 3), 0)\n"
        "        self.assertEqual(mathx.clamp(2, 0, 3), 2)\n"
    ),
}

needs_sandbox = pytest.mark.skipif(
    sandbox.unavailable_reason() is not None, reason=f"{sandbox.unavailable_reason()}"
)


def _source(tmp_path) -> str:
    root = tmp_path / "src"
    for path, text in SOURCE_TREE.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return str(root)


def _build(source, out, *flags):
    """``python -m cursor_rl.tasks.build`` with one quick generator and one task."""
    argv = ["build", f"--source={source}", f"--out={out}", "--generators=flip_comparison",
            "--max_per_generator=1", "--runs=1", "--count=1", *flags]  # fmt: skip
    return build.main(argv)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--autoinstall=magic"], "--autoinstall=magic: value should be one of"),
        (["--autoinstall=agent"], "--autoinstall=agent needs --autoinstall_policy"),
        (["--autoinstall=scripted", "--autoinstall_policy=tiny"], "used by --autoinstall=agent"),
        (["--autoinstall=agent", "--autoinstall_policy=/no/such/model"], "is not a built-in"),
        (["--autoinstall=scripted", "--autoinstall_max_turns=0"], "must be >= 1"),
        (["--autoinstall=scripted", "--source=tiny"], "applies to repository sources"),
    ],
)
def test_bad_autoinstall_flags_are_clear_errors(tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    assert _build(_source(tmp_path), out, *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    if "magic" in message:
        assert "<heuristic|agent|scripted>" in err
    assert not out.exists()  # refused before anything is built


@needs_sandbox
def test_scripted_agent_installs_the_source_from_the_cli(tmp_path):
    out = tmp_path / "out"
    assert _build(_source(tmp_path), out, "--autoinstall=scripted") == 0
    with open(out / "autoinstall" / autoinstall.RECIPE_FILE) as f:
        recipe = json.load(f)
    assert recipe["mode"] == "agent"  # the agent's recipe passed the validation test
    assert recipe["test_command"] == "python -m unittest discover -s tests -t ."
    log = (out / "autoinstall" / autoinstall.LOG_FILE).read_text()
    assert log.startswith("agent: scripted")
    assert "ToolCall(name='list_dir'" in log and "mathx/" in log  # through the tools
    assert "heuristic fallback" not in log
    (task,) = records.load_tasks(str(out))
    assert task.environment["venv"] == str(out / "autoinstall" / "env" / "venv")


@needs_sandbox
def test_agent_that_fails_falls_back_to_the_heuristic_from_the_cli(tmp_path):
    """Cut off after one turn (it only listed the repository), the scripted agent
    writes no recipe; the heuristic installs the tree and the build goes on."""
    out = tmp_path / "out"
    flags = ["--autoinstall=scripted", "--autoinstall_max_turns=1"]
    assert _build(_source(tmp_path), out, *flags) == 0
    log = (out / "autoinstall" / autoinstall.LOG_FILE).read_text()
    assert log.startswith("agent: scripted")
    assert "agent cut off after max_turns=1 turns" in log
    assert "the agent wrote no valid recipe" in log and "--- heuristic fallback ---" in log
    assert not (out / "autoinstall" / autoinstall.RECIPE_FILE).exists()
    with open(out / "autoinstall" / "heuristic" / autoinstall.RECIPE_FILE) as f:
        assert json.load(f)["mode"] == "heuristic"
    (task,) = records.load_tasks(str(out))
    assert task.environment["venv"] == str(out / "autoinstall" / "heuristic" / "env" / "venv")


def test_heuristic_stays_the_default():
    config = build.BuildConfig(source="/src/repo", out="/data/out")
    assert config.autoinstall == "heuristic" and config.autoinstall_policy == ""
    build.check_autoinstall(config)
    assert build.autoinstall_config(config).agent is None  # Autoinstall as before
    scripted = build.autoinstall_config(
        build.BuildConfig(source="/src/repo", out="/o", autoinstall="scripted")
    ).agent
    assert scripted.name == "scripted" and scripted.max_turns == 30


@needs_sandbox
@pytest.mark.slow
def test_a_model_runs_as_the_agent_and_falls_back(tmp_path):
    """The built-in tiny base (no agent training) as the policy: its turn is sampled
    and run in the harness; it writes no recipe, so the heuristic's is kept."""
    agent = autoinstall.model_agent("tiny", max_turns=1, max_new_tokens=8, temperature=0.0)
    assert agent.name == "tiny"
    repo = _source(tmp_path)
    result = autoinstall.autoinstall(
        repo, str(tmp_path / "work"), autoinstall.AutoinstallConfig(agent=agent)
    )
    assert result.ok and result.recipe.mode == "heuristic", result.log[-3000:]
    assert result.log.startswith("agent: tiny")
    assert "agent cut off after max_turns=1 turns" in result.log or "made no call" in result.log
    assert "the agent wrote no valid recipe" in result.log
    assert os.path.exists(tmp_path / "work" / "heuristic" / autoinstall.RECIPE_FILE)
