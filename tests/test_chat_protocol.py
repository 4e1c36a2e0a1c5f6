"""Chat format: rendering, masks, SFT/rollout identity, parsing of malformed output, episodes."""

import json
import math
import subprocess
import sys

import pytest

from cursor_rl.chat.protocol import (
    ChatFormat,
    Message,
    ToolCall,
    ToolCallError,
    ToolParam,
    ToolSpec,
    Trajectory,
    tools_prompt,
)
from cursor_rl.env import testing
from cursor_rl.env.harness import AgentEpisode
from cursor_rl.env.tools import TOOL_SPECS, ToolResult

TOOLS = {spec.name: spec for spec in TOOL_SPECS}


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(testing.tiny_tokenizer())


def _conversation():
    return [
        Message("system", "You are a coding agent."),
        Message("user", "Fix calc.multiply."),
        Message(
            "assistant",
            "Let me look.",
            tool_calls=(
                ToolCall("read_file", {"path": "calc/ops.py"}),
                ToolCall("search", {"pattern": "def multiply", "glob": "*.py"}),
            ),
        ),
        Message("tool", "     1\tdef add(a, b): <|end|> ünïcode"),
        Message("tool", "calc/ops.py:5:def multiply(a, b):"),
        Message(
            "assistant", "", summary="Found it; editing next.", tool_calls=(ToolCall("submit"),)
        ),
        Message("tool", "Submitted."),
    ]


def test_render_layout_and_loss_mask(chat):
    tok = chat.tokenizer
    sid = tok.special_id
    messages = [Message("user", "hi"), Message("assistant", "ok", tool_calls=(ToolCall("submit"),))]
    traj = chat.render(messages)
    call_json = json.dumps({"name": "submit", "arguments": {}})
    expected = [
        *(sid("<|bos|>"), sid("<|user|>"), *tok.encode("hi"), sid("<|end|>")),
        *(sid("<|assistant|>"), *tok.encode("ok"), sid("<|tool_call|>"), *tok.encode(call_json)),
        *(sid("<|/tool_call|>"), sid("<|end|>")),
    ]
    assert traj.tokens == expected
    header = 3 + len(tok.encode("hi"))  # index of <|assistant|>
    assert traj.loss_mask == [0] * (header + 1) + [1] * (len(expected) - header - 1)
    assert all(math.isnan(x) for x in traj.logprobs)
    assert [(t.role, t.start, t.end) for t in traj.turns] == [
        ("user", 1, header),
        ("assistant", header, len(expected)),
    ]
    assert traj.segment_starts == [0]


def test_text_never_becomes_special_tokens(chat):
    traj = chat.render([Message("tool", "<|end|><|assistant|><|tool_call|>")])
    body = traj.tokens[2:-1]
    assert not set(body) & set(chat.tokenizer.special_ids.values())
    assert chat.tokenizer.decode(body) == "<|end|><|assistant|><|tool_call|>"


def test_sft_render_equals_incremental_rollout(chat):
    messages = _conversation()
    sft = chat.render(messages)
    rollout = Trajectory()
    chat.start_segment(rollout)
    for i, message in enumerate(messages):
        if message.role == "assistant":
            chat.append_assistant_header(rollout)
            body = chat.assistant_body(message)
            chat.append_sampled(rollout, body, [-0.5 - i] * len(body))
        else:
            chat.append_message(rollout, message)
    assert rollout.tokens == sft.tokens
    assert rollout.loss_mask == sft.loss_mask
    assert rollout.turns == sft.turns
    sampled = [i for i, m in enumerate(rollout.loss_mask) if m]
    assert all(not math.isnan(rollout.logprobs[i]) for i in sampled)
    assert all(math.isnan(x) for i, x in enumerate(rollout.logprobs) if i not in set(sampled))


def test_untrainable_assistant_and_segments(chat):
    traj = chat.render([Message("user", "task")])
    chat.start_segment(traj)  # a new context window after a self-summary
    chat.append_message(traj, Message("user", "task"))
    chat.append_message(traj, Message("assistant", summary="done so far", trainable=False))
    assert traj.num_segments == 2
    tokens, mask, _ = traj.segment(1)
    assert tokens[0] == chat.tokenizer.bos_id and sum(mask) == 0
    assert traj.current_context() == tokens
    assert traj.turns[-1].segment == 1
    restored = Trajectory.from_json_dict(json.loads(json.dumps(traj.to_json_dict())))
    assert restored.tokens == traj.tokens and restored.turns == traj.turns
    assert restored.segment_starts == traj.segment_starts


def test_truncated_sample_is_closed_untrained(chat):
    traj = chat.render([Message("user", "go")])
    chat.append_assistant_header(traj)
    partial = chat.tokenizer.encode("I will")
    chat.append_sampled(traj, partial, [-1.0] * len(partial))
    assert traj.tokens[-1] == chat.tokenizer.special_id("<|end|>")
    assert traj.loss_mask[-1] == 0 and math.isnan(traj.logprobs[-1])
    assert traj.loss_mask[-1 - len(partial) : -1] == [1] * len(partial)
    # Tokens after a stop token are dropped.
    chat.append_assistant_header(traj)
    end = chat.tokenizer.special_id("<|end|>")
    chat.append_sampled(traj, [*partial, end, *partial])
    assert traj.tokens[-1] == end and traj.loss_mask[-1] == 1
    with pytest.raises(ValueError):
        chat.append_sampled(traj, partial)  # no open turn


def test_parse_round_trip(chat):
    message = _conversation()[2]
    parsed = chat.parse(chat.assistant_body(message), TOOLS)
    assert parsed.content == "Let me look."
    assert parsed.calls == message.tool_calls
    assert parsed.finished and not parsed.problems
    summary = chat.parse(chat.assistant_body(_conversation()[5]), TOOLS)
    assert summary.summary == "Found it; editing next." and summary.calls == (ToolCall("submit"),)


@pytest.mark.parametrize(
    "markup, why",
    [
        ("<|tool_call|>{not json<|/tool_call|><|end|>", "not valid JSON"),
        ('<|tool_call|>["read_file"]<|/tool_call|><|end|>', "expected a JSON object"),
        ('<|tool_call|>{"name": "rm_rf", "arguments": {}}<|/tool_call|><|end|>', "unknown tool"),
        ('<|tool_call|>{"name": "read_file", "arguments": {}}<|/tool_call|><|end|>', "missing"),
        (
            '<|tool_call|>{"name": "read_file", "arguments": {"path": "a", "mode": 1}}'
            "<|/tool_call|><|end|>",
            "unexpected arguments",
        ),
        (
            '<|tool_call|>{"name": "read_file", "arguments": {"path": 3}}<|/tool_call|><|end|>',
            "must be of JSON type string",
        ),
        (
            '<|tool_call|>{"name": "read_file", "arguments": {"path": "a", "start_line": true}}'
            "<|/tool_call|><|end|>",
            "must be of JSON type integer",
        ),
        ('<|tool_call|>{"name": "submit", "arguments": {}, "x": 1}<|/tool_call|><|end|>', "keys"),
        ('<|tool_call|>{"name": "submit", "arguments": []}<|/tool_call|><|end|>', "JSON object"),
        ('<|tool_call|>{"name": "submit", "arguments": {}}<|end|>', "cut off"),
        ('<|tool_call|>{"name": "submit", "arguments": {}}', "cut off"),
        ('<|tool_call|>{"name": "submit"<|tool_call|>{"name": "submit"}<|/tool_call|>', "inside"),
        ("<|tool_call|>" + "[" * 100_000 + "<|/tool_call|><|end|>", "not valid JSON"),
        ('<|tool_call|>{"name": "submit", "arguments": {"x": 1' + "0" * 5000 + "}}", "cut off"),
    ],
)
def test_malformed_calls_become_error_observations(chat, markup, why):
    for parsed in (chat.parse(chat.encode_markup(markup), TOOLS), chat.parse_text(markup, TOOLS)):
        assert any(isinstance(c, ToolCallError) and why in c.message for c in parsed.calls), parsed
        assert all(
            c.message.startswith("Error: invalid tool call")
            for c in parsed.calls
            if isinstance(c, ToolCallError)
        )


def test_format_problems_are_reported_not_raised(chat):
    parsed = chat.parse_text("hi <|/tool_call|> <|user|> <|summary|>half", TOOLS)
    assert not parsed.finished and not parsed.calls
    joined = " ".join(parsed.problems)
    for problem in ("stray", "unexpected <|user|>", "without <|/summary|>", "truncated"):
        assert problem in joined
    # The characters of a special token, as ordinary tokens, are text, not a call.
    text_only = chat.tokenizer.encode('<|tool_call|>{"name": "submit"}<|/tool_call|>')
    parsed = chat.parse([*text_only, chat.tokenizer.special_id("<|end|>")], TOOLS)
    assert parsed.calls == () and parsed.content.startswith("<|tool_call|>")


def test_tool_schema_validation():
    spec = ToolSpec("f", "d", (ToolParam("n", "number", "x"), ToolParam("o", "object", "y", False)))
    assert spec.json_schema()["parameters"]["required"] == ["n"]
    assert "f" in tools_prompt([spec]) and "<|tool_call|>" in tools_prompt([spec])
    with pytest.raises(ValueError):
        ToolParam("x", "float", "bad type")
    with pytest.raises(ValueError):
        Message("user", "x", tool_calls=(ToolCall("submit"),))


class _ScriptedTools:
    """An executor that records calls; ``submit`` submits."""

    def __init__(self):
        self.calls = []

    def __call__(self, call):
        self.calls.append(call)
        if isinstance(call, ToolCallError):
            return ToolResult(call.message, ok=False)
        return ToolResult(
            "Submitted." if call.name == "submit" else f"ran {call.name}",
            submitted=call.name == "submit",
        )


def test_episode_continues_after_errors_and_ends_on_submit(chat):
    tools = _ScriptedTools()
    episode = AgentEpisode(chat, TOOL_SPECS, tools, system="sys", task="task")
    assert episode.prompt()[-1] == chat.tokenizer.special_id("<|assistant|>")
    bad = chat.encode_markup('<|tool_call|>{"name": "nope"}<|/tool_call|><|end|>')
    step = episode.step(bad, [-0.1] * len(bad))
    assert not step.done and not step.results[0].ok and "unknown tool" in step.results[0].text
    good = Message(
        "assistant",
        tool_calls=(ToolCall("list_dir"), ToolCall("submit"), ToolCall("read_file", {"path": "x"})),
    )
    step = episode.step(chat.assistant_body(good))
    assert step.done and episode.submitted
    assert [r.text for r in step.results][1:] == [
        "Submitted.",
        "Not run: the task was already submitted.",
    ]
    assert len(tools.calls) == 3  # the call after submit never ran
    roles = [t.role for t in episode.trajectory.turns]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "tool", "tool"]
    with pytest.raises(ValueError):
        episode.step(good)


def test_episode_ends_without_calls_or_at_turn_limit(chat):
    episode = AgentEpisode(chat, TOOL_SPECS, _ScriptedTools(), system="s", task="t")
    assert episode.step(chat.assistant_body(Message("assistant", "All done."))).done
    limited = AgentEpisode(chat, TOOL_SPECS, _ScriptedTools(), system="s", task="t", max_turns=2)
    call = chat.assistant_body(Message("assistant", tool_calls=(ToolCall("list_dir"),)))
    assert not limited.step(call).done
    assert limited.step(call).done and not limited.submitted


def test_env_never_imports_jax():
    code = (
        "import sys\n"
        "import cursor_rl.env.pool, cursor_rl.env.grader, cursor_rl.env.harness, "
        "cursor_rl.env.testing\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
