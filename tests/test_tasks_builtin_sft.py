"""Built-in SFT set: scripted episodes in the real harness, and the shipped demonstrations."""

import json
import shlex
import subprocess
import sys
import types

import numpy as np
import pytest

from cursor_rl.chat import protocol
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.data import pipeline, sft
from cursor_rl.tasks import builtin_sft


def test_hunks_become_unique_edits_reproducing_the_solution():
    old = "def a():\n    return 1\n\n\ndef b():\n    return 1\n"
    new = "def a():\n    return 2\n\n\ndef b():\n    return 1\n"
    patch = ["@@ -1,3 +1,3 @@\n", " def a():\n", "-    return 1\n", "+    return 2\n", " \n"]
    edits = builtin_sft._hunk_edits(old, new, patch)
    # `    return 1` alone occurs twice: the line before it is the context that makes it
    # unique; the unchanged blank line after it is dropped.
    assert edits == [("def a():\n    return 1\n", "def a():\n    return 2\n")]
    # A changed line that is unique on its own is the whole edit.
    old2 = old.replace("def b():\n    return 1", "def b():\n    return 3")
    new2 = new.replace("def b():\n    return 1", "def b():\n    return 3")
    assert builtin_sft._hunk_edits(old2, new2, patch) == [("    return 1\n", "    return 2\n")]
    # A hunk whose text is not unique in the file falls back to replacing the file.
    ambiguous = ["@@ -2,1 +2,1 @@\n", "-    return 1\n", "+    return 2\n"]
    assert builtin_sft._hunk_edits(old, new, ambiguous) == [(old, new)]


def test_check_command_runs_in_a_shell(tmp_path):
    (tmp_path / "mod.py").write_text("def f(s):\n    return s + '!'\n")

    task = types.SimpleNamespace(
        category="bug",
        provenance=types.SimpleNamespace(module="mod"),
        fail_to_pass=["test_mod.T.test_f"],
        hidden_tests={
            "test_mod.py": "import unittest\nimport mod\nclass T(unittest.TestCase):\n"
            "    def test_f(self):\n        self.assertEqual(mod.f('a \"b\"'), 'a \"b\"!')\n"
            "        self.assertEqual(mod.f('x'), 'x?')\n"
        },
    )
    command = builtin_sft._check_command(task)
    argv = shlex.split(command)
    assert argv[:2] == ["python", "-c"]
    proc = subprocess.run(
        [sys.executable, "-c", argv[2]], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 1 and "AssertionError: x!" in proc.stderr


def test_shipped_set_is_agent_trajectories_in_the_harness_format():
    source = sft.open_conversations([sft.BUILTIN])
    assert len(source) >= 40
    tools_used = set()
    for i in range(len(source)):
        messages = source[i]["messages"]
        assert [m.role for m in messages[:2]] == ["system", "user"]
        assert messages[0].content.startswith(builtin_sft.SYSTEM_PROMPT)
        calls = [c.name for m in messages for c in m.tool_calls]
        assert calls[0] == "read_file" and calls[-1] == "submit" and "edit_file" in calls
        tools_used |= set(calls)
        observations = [m.content for m in messages if m.role == "tool"]
        assert len(observations) == len(calls)  # one tool turn per call
        assert observations[-1] == "Submitted."
        assert any("exit code: 0" in o for o in observations)  # the final check ran
    assert {"read_file", "edit_file", "run_terminal", "submit"} <= tools_used
    tok = Tokenizer.train([source[i]["text"] for i in range(5)], 600)
    config = pipeline.DataConfig(sft_sources=(sft.BUILTIN,), exclude_modules=())
    batch = next(pipeline.make_sft_iterator(config, tok, seq_len=2048, global_batch_size=2, seed=0))
    trained = tok.decode(batch["targets"][batch["loss_mask"] == 1])
    assert "<|tool_call|>" in trained and "Submitted." not in trained
    assert np.isin(batch["loss_mask"], (0, 1)).all()
    # The system prompt alone exceeds 32 tokens: truncation would train on nothing.
    truncate = pipeline.DataConfig(sft_sources=(sft.BUILTIN,), exclude_modules=(), sft_max_chunks=1)
    with pytest.raises(ValueError, match=r"seq_len=32 .* no assistant token"):
        pipeline.make_sft_dataset(truncate, tok, seq_len=32, global_batch_size=2, seed=0)
    # Kept whole (the default), the later chunks carry the assistant's turns.
    batch = next(pipeline.make_sft_iterator(config, tok, seq_len=256, global_batch_size=2, seed=0))
    assert batch["loss_mask"].any()


@pytest.fixture(scope="module")
def tiny_tasks(tmp_path_factory):
    from cursor_rl.env.sandbox import Sandbox, SandboxUnavailableError

    root = tmp_path_factory.mktemp("sandbox_probe")
    try:
        with Sandbox(str(root)):
            pass
    except SandboxUnavailableError as e:
        pytest.skip(f"no sandbox on this machine: {e}")
    out = tmp_path_factory.mktemp("tiny_tasks")
    return str(out), builtin_sft.build_tiny_tasks(str(out), 3, per_module=3)


@pytest.mark.slow
def test_scripted_episode_runs_the_real_tools_and_resolves(tiny_tasks):
    dataset_dir, tasks = tiny_tasks
    chat = protocol.ChatFormat(builtin_sft.harness_tokenizer())
    for task in tasks:
        demo = builtin_sft.run_demonstration(task, chat, dataset_dir=dataset_dir)
        assert demo.resolved and demo.check_passed and demo.usable, task.task_id
        observations = [m.content for m in demo.messages if m.role == "tool"]
        assert observations[0].lstrip().startswith("1\t")  # read_file's numbered lines
        if task.category in ("bug", "feature"):  # the first check shows the failure
            assert "exit code: 1" in observations[1]
        assert "check passed" in observations[-2] or "imports fine" in observations[-2]
    bench = tasks[0].__class__(**{**tasks[0].__dict__, "split": "bench"})
    with pytest.raises(ValueError, match="only train tasks"):
        builtin_sft.run_demonstration(bench, chat, dataset_dir=dataset_dir)


@pytest.mark.slow
def test_demonstrations_round_trip_through_jsonl(tiny_tasks, tmp_path):
    dataset_dir, tasks = tiny_tasks
    chat = protocol.ChatFormat(builtin_sft.harness_tokenizer())
    demos = list(builtin_sft.demonstrations(tasks[:1], chat, dataset_dir=dataset_dir, log=print))
    path = tmp_path / "demo.jsonl"
    builtin_sft.write_demonstrations(str(path), demos)
    record = json.loads(path.read_text())
    assert record["id"] == demos[0].task_id
    loaded = sft.conversation_from_record(record, str(path))
    assert chat.render(loaded).tokens == chat.render(list(demos[0].messages)).tokens


def test_hinted_plans_spread_the_share_evenly():
    """hinted_plans puts the hinted plan on round(share * n) tasks, spread out."""
    plans = builtin_sft.hinted_plans(8, "short", 0.25)
    assert plans == ["short", "short", "short", "hinted"] * 2
    assert builtin_sft.hinted_plans(5, "full", 0.0) == ["full"] * 5
    assert builtin_sft.hinted_plans(3, "short", 1.0) == ["hinted"] * 3
    with pytest.raises(ValueError, match="hinted_share"):
        builtin_sft.hinted_plans(3, "short", 1.5)


@pytest.mark.slow
def test_hinted_demonstration_runs_the_check_the_hint_asks_for(tiny_tasks):
    """The hinted plan: read, edit, the hint as a user turn, the check, submit; the
    episode resolves and its messages render to the harness's own tokens."""
    dataset_dir, tasks = tiny_tasks
    chat = protocol.ChatFormat(builtin_sft.harness_tokenizer())
    hint = "Before you submit, run the tests."
    demo = builtin_sft.run_demonstration(
        tasks[0], chat, dataset_dir=dataset_dir, plan="hinted", hint=hint
    )
    assert demo.resolved and demo.check_passed and demo.usable
    roles = [m.role for m in demo.messages]
    assert roles.count("user") == 2 and demo.messages[roles.index("user", 2)].content == hint
    after = demo.messages[roles.index("user", 2) + 1 :]
    calls = [c.name for m in after for c in m.tool_calls]
    assert calls == ["run_terminal", "submit"]
    before = demo.messages[: roles.index("user", 2)]
    before_calls = [c.name for m in before for c in m.tool_calls]
    assert before_calls[0] == "read_file" and set(before_calls[1:]) == {"edit_file"}
    with pytest.raises(ValueError, match="hint"):
        builtin_sft.run_demonstration(tasks[0], chat, dataset_dir=dataset_dir, plan="hinted")
