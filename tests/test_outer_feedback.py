"""Feedback ingest and weak-area classification (cursor_rl.outer.ingest, .classify):
the example file loads clean; malformed rows are reported by line and the good rows
kept; both trajectory forms read alike; each category has a rule that finds it; the
judge hook overrides, abstains and fails safely."""

import json
import os

import pytest

from cursor_rl.chat.episodes import Episode
from cursor_rl.chat.protocol import END, ChatFormat, Message, ToolCall, ToolCallError
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.env import harness
from cursor_rl.env.tools import TOOL_SPECS, ToolResult
from cursor_rl.outer import classify, ingest
from cursor_rl.tasks import records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "cursor_rl", "outer", "example_feedback.jsonl")
TINY_TOKENIZER = os.path.join(ROOT, "cursor_rl", "bases", "tiny", "tokenizer.json")
HASH = "ab" * 32


def _call(name, **arguments):
    return {"name": name, "arguments": arguments}


def _assistant(*calls, content=""):
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def _row(event_id="e1", *, messages=None, comment=None, rating="down", snapshot=None, **extra):
    """A valid messages-format row (a fixed bug, tests run, submitted) unless overridden."""
    if messages is None:
        messages = [
            {"role": "user", "content": "Bug: test_mod fails. Fix `mod.py`."},
            _assistant(_call("edit_file", path="mod.py", old_str="a", new_str="b")),
            {"role": "tool", "content": "ok"},
            _assistant(_call("run_terminal", command="python -m unittest")),
            {"role": "tool", "content": "exit 0"},
            _assistant(_call("submit")),
            {"role": "tool", "content": "ok"},
        ]
    row = {
        "schema_version": 1,
        "event_id": event_id,
        "rating": rating,
        "snapshot": snapshot or {"task_id": "t-1"},
        "trajectory": {"format": "messages", "messages": messages},
    }
    if comment is not None:
        row["comment"] = comment
    row.update(extra)
    return row


def _event(**kwargs):
    return ingest.parse_event(_row(**kwargs), line=1)


def _write_lines(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else line.encode("utf-8"))
            f.write(b"\n")
    return str(path)


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(Tokenizer.load(TINY_TOKENIZER))


# ---- ingest ------------------------------------------------------------------------------


def test_the_example_file_is_valid_and_covers_every_category():
    """The shipped example loads without a bad row; its negative events fall in every
    category but ``other``, and its two positive events are not classified."""
    feedback = ingest.load_feedback(EXAMPLE)
    assert feedback.bad_rows == []
    assert feedback.rows == len(feedback.events) == 15
    assert len(feedback.negative) == 13
    assert os.path.getsize(EXAMPLE) < 16_000
    judged = classify.classify_events(feedback.negative)
    assert set(judged.stats()["by_category"]) == set(classify.CATEGORIES) - {"other"}
    assert judged.detector_errors == [] and judged.judge_errors == []


def test_malformed_rows_are_counted_by_line_and_good_rows_still_load(tmp_path):
    """Each kind of bad row becomes a BadRow naming its line (1-based, blank lines
    counted but skipped) and what is wrong; the good rows around them load."""
    no_assistant = _row("e11", messages=[{"role": "user", "content": "hi"}])
    bad_calls = _row("e12", messages=[{"role": "assistant", "tool_calls": [3]}])
    episode_row = _row("e14")
    episode_row["trajectory"] = {"format": "episode", "episode": {}}
    lines = [
        json.dumps(_row("good-1")),  # 1
        "",  # 2: blank, skipped
        "{not json",  # 3
        "[1, 2]",  # 4
        json.dumps({k: v for k, v in _row("e5").items() if k != "rating"}),  # 5
        json.dumps(_row("e6", mood="sad")),  # 6
        json.dumps(_row("e7", rating="meh")),  # 7
        json.dumps(_row("e8", schema_version=2)),  # 8
        json.dumps(_row("good-1")),  # 9: duplicate id
        json.dumps(_row("e10", snapshot={"source": "/src/x", "tree_sha256": "xyz"})),  # 10
        json.dumps(no_assistant),  # 11
        json.dumps(bad_calls),  # 12
        b'{"event_id": "e13", "comment": "\xff"}',  # 13: not UTF-8
        json.dumps(episode_row),  # 14: episode form without a tokenizer
        json.dumps(_row("good-2", reverted=True, rating="up", time="2026-12-01T10:00:00Z")),
    ]
    feedback = ingest.load_feedback(_write_lines(tmp_path / "fb.jsonl", lines))
    assert [e.event_id for e in feedback.events] == ["good-1", "good-2"]
    assert [e.line for e in feedback.events] == [1, 15]
    assert feedback.rows == 14
    problems = {b.line: (b.event_id, b.problem) for b in feedback.bad_rows}
    assert sorted(problems) == [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    expected = {
        3: ("", "not valid JSON"),
        4: ("", "expected a JSON object, got an array"),
        5: ("e5", "missing field 'rating'"),
        6: ("e6", "unknown field 'mood'"),
        7: ("e7", "field 'rating' must be one of"),
        8: ("e8", "schema_version' is 2"),
        9: ("good-1", "duplicate event_id 'good-1' (first on line 1)"),
        10: ("e10", "tree_sha256' must be 64 lower-case hex"),
        11: ("e11", "no assistant turn"),
        12: ("e12", "tool_calls[0]' must be an object"),
        13: ("", "not UTF-8"),
        14: ("e14", "give the tokenizer"),
    }
    for line, (event_id, words) in expected.items():
        assert problems[line][0] == event_id, line
        assert words in problems[line][1], (line, problems[line][1])
    assert str(feedback.bad_rows[0]).startswith("line 3: not valid JSON")
    # reverted edits make an event negative whatever the rating
    assert feedback.events[1].rating == "up" and feedback.events[1].negative


def test_tool_calls_are_checked_as_the_harness_checks_them_and_finish_is_derived():
    """An object call is validated against the harness's tools (unknown tool, missing
    argument: a ToolCallError), a string is the raw text between the call tokens; a
    log's finish reason follows from its last assistant turn."""
    event = _event(
        messages=[
            {"role": "user", "content": "Fix it."},
            _assistant(_call("read_file", path="a.py"), _call("patch", file="a.py")),
            {"role": "tool", "content": "1 x"},
            {"role": "tool", "content": "Error"},
            _assistant('{"name": "edit_file", "arguments": {'),
            _assistant(_call("edit_file", path="a.py")),
        ]
    )
    calls = [c for turn in event.view.turns for c in turn.calls]
    assert isinstance(calls[0], ToolCall) and calls[0].name == "read_file"
    assert "unknown tool 'patch'" in calls[1].message
    assert isinstance(calls[2], ToolCallError) and "not valid JSON" in calls[2].message
    assert "missing the required argument 'old_str'" in calls[3].message
    assert event.view.turns[0].results == ("1 x", "Error")
    assert event.view.episode.finish_reason == "stopped"
    assert event.request == "Fix it."
    answered = _event(messages=[{"role": "user", "content": "x"}, _assistant(content="No.")])
    assert answered.view.episode.finish_reason == "answered"
    assert _event().view.episode.finish_reason == "submitted"


def _recorded_episode(chat, turns, request):
    """An episode as the harness records it: each turn a list of calls or raw markup."""

    def execute(call):
        if isinstance(call, ToolCallError):
            return ToolResult(call.message, ok=False)
        return ToolResult("ok", submitted=call.name == "submit")

    agent = harness.AgentEpisode(
        chat, TOOL_SPECS, execute, system="Fix it.", task=request, tools_style="compact"
    )
    for turn in turns:
        agent.prompt()
        if isinstance(turn, str):
            ids = chat.encode_markup(turn + END)
        else:
            ids = chat.assistant_body(Message("assistant", "", tool_calls=tuple(turn)))
        agent.step(ids)
    return Episode(
        task_id="t-1", category="bug", task_index=0, sample=0, trajectory=agent.trajectory,
        finish_reason="submitted" if agent.submitted else "answered",
    )  # fmt: skip


def test_an_episode_and_its_message_form_read_alike(chat, tmp_path):
    """The same conversation as a token-level episode (Episode.to_json, read with its
    tokenizer) and as messages gives the same request, turns and detector hits; token
    ids outside the vocabulary make a bad row."""
    edit_test = ToolCall("edit_file", {"path": "test_mod.py", "old_str": "1", "new_str": "2"})
    raw = '<|tool_call|>{"name": "oops"<|/tool_call|>'
    episode = _recorded_episode(chat, [[edit_test], raw, [ToolCall("submit")]], "Fix `mod.py`.")
    as_episode = _row("ep")
    as_episode["trajectory"] = {"format": "episode", "episode": episode.to_json()}
    as_messages = _row(
        "msg",
        messages=[
            {"role": "user", "content": "Fix `mod.py`."},
            _assistant(_call("edit_file", path="test_mod.py", old_str="1", new_str="2")),
            {"role": "tool", "content": "ok"},
            _assistant('{"name": "oops"'),
            {"role": "tool", "content": "error"},
            _assistant(_call("submit")),
            {"role": "tool", "content": "ok"},
        ],
    )
    broken = json.loads(json.dumps(as_episode))
    broken["event_id"] = "broken"
    broken["trajectory"]["episode"]["trajectory"]["tokens"][3] = 10**9
    path = _write_lines(tmp_path / "fb.jsonl", map(json.dumps, [as_episode, as_messages, broken]))
    feedback = ingest.load_feedback(path, chat=chat)
    assert [(b.line, b.event_id) for b in feedback.bad_rows] == [(3, "broken")]
    assert "token ids must be integers in [0, " in feedback.bad_rows[0].problem
    from_episode, from_messages = feedback.events
    assert from_episode.request == from_messages.request == "Fix `mod.py`."
    assert from_episode.assistant_turns == from_messages.assistant_turns == 3
    hits = [classify.run_detectors(e)[0] for e in (from_episode, from_messages)]
    assert [h[1:] for h in hits[0]] == [h[1:] for h in hits[1]]
    assert [name for _, name, _ in hits[0]] == [
        "edited_tests",
        "malformed_tool_call",
        "submitted_without_tests",
    ]


# ---- classification ----------------------------------------------------------------------


def _turns(*calls_per_turn):
    messages = [{"role": "user", "content": "Please help with mod.py."}]
    for calls in calls_per_turn:
        messages.append(
            _assistant(*calls) if isinstance(calls, list) else _assistant(content=calls)
        )
        messages.append({"role": "tool", "content": "ok"})
    return messages


EDIT = _call("edit_file", path="mod.py", old_str="a", new_str="b")
TESTS = _call("run_terminal", command="python -m pytest -q")
SUBMIT = _call("submit")
CLEAN = _turns([EDIT], [TESTS], [SUBMIT])


@pytest.mark.parametrize(
    "category, comment, messages",
    [
        ("feature", "It did not implement the function I asked for.", CLEAN),
        ("bug_fix", "The bug is still there, wrong output.", CLEAN),
        ("refactor", "The refactor renamed only half of the uses.", CLEAN),
        ("tool_misuse", "", _turns([EDIT], ['{"name": "edit_file"'], [TESTS], [SUBMIT])),
        ("tool_misuse", "", _turns([EDIT], [TESTS], [EDIT], [TESTS], [SUBMIT])),
        ("tool_misuse", "It kept calling the wrong tool.", CLEAN),
        ("test_handling", "", _turns([EDIT], [SUBMIT])),
        (
            "test_handling",
            "",
            _turns(
                [_call("edit_file", path="tests/test_mod.py", old_str="1", new_str="2")], [TESTS]
            ),
        ),
        ("test_handling", "It deleted the tests to make them pass.", CLEAN),
        ("incomplete", "", _turns([EDIT], "I am not sure how to continue.")),
        ("incomplete", "It gave up halfway.", CLEAN),
        ("style", "Works, but the formatting and naming are a mess.", CLEAN),
        ("other", "Not what I wanted.", CLEAN),
    ],
)
def test_each_category_has_a_rule_that_finds_it(category, comment, messages):
    """Comment words or the trajectory (via the rl.feedback detectors) decide the
    category; an event no rule speaks to is ``other``."""
    event = _event(comment=comment, messages=messages)
    result, errors = classify.classify_event(event)
    assert result.category == category, result.evidence
    assert errors == []
    assert result.decided_by == "rules" and result.evidence


def test_rules_apply_in_order_behaviour_detectors_kind_then_task():
    """A behaviour named in the comment beats the detectors; the detectors beat kind
    words; kind words beat the task's kind; the task kind comes from the snapshot's
    task when a dataset holds it (else the request, else the comment)."""
    edited_tests = _turns([_call("edit_file", path="test_mod.py", old_str="1", new_str="2")])
    # comment behaviour (style) wins over the edited_tests detector
    styled, _ = classify.classify_event(_event(comment="Ugly style.", messages=edited_tests))
    assert styled.category == "style" and styled.detectors == ("edited_tests",)
    # the detector wins over bug words in the comment
    tested, _ = classify.classify_event(_event(comment="Still a bug.", messages=edited_tests))
    assert tested.category == "test_handling" and tested.task_kind == "bug"
    # no comment, no detector: the snapshot task's kind, from the dataset
    tasks = {
        "t-1": classify.TaskInfo(
            "t-1", "bench", "refactor", "rename_symbol", HASH, {"patch_lines": 20}
        )
    }
    resolved, _ = classify.classify_event(_event(), tasks)
    assert (resolved.category, resolved.task_kind, resolved.generator) == (
        "refactor",
        "refactor",
        "rename_symbol",
    )
    assert resolved.difficulty == "hard"  # a 20-line reference patch
    # unresolved: the request's kind words ("Bug: ... Fix")
    unresolved, _ = classify.classify_event(_event())
    assert (unresolved.category, unresolved.task_kind, unresolved.generator) == (
        "bug_fix",
        "bug",
        "",
    )


def test_difficulty_from_comment_then_task_then_length():
    """The comment's words first, then the task's measured solve rate (or patch
    size), then the trajectory's length in assistant turns."""
    tasks = {
        "t-1": classify.TaskInfo("t-1", "bench", "bug", "off_by_one", HASH, {"solve_rate": 0.05})
    }
    said, _ = classify.classify_event(_event(comment="A trivial one-line fix."), tasks)
    assert said.difficulty == "easy"
    measured, _ = classify.classify_event(_event(), tasks)
    assert measured.difficulty == "hard"  # solved 5% of the time
    long = _turns(*[[EDIT]] * 11, [TESTS], [SUBMIT])
    assert classify.classify_event(_event(messages=long))[0].difficulty == "hard"
    assert classify.classify_event(_event())[0].difficulty == "easy"  # 3 turns


def test_unresolved_tasks_and_snapshot_mismatches_are_counted():
    """A task id no dataset holds, and a tree hash that is not its task's, are
    counted by event; the events are still classified."""
    tasks = {"t-1": classify.TaskInfo("t-1", "bench", "bug", "off_by_one", HASH, {})}
    events = [
        _event(event_id="known"),
        _event(event_id="unknown", snapshot={"task_id": "t-9"}),
        _event(
            event_id="other-tree",
            snapshot={"task_id": "t-1", "source": "x", "tree_sha256": "cd" * 32},
        ),
        _event(event_id="source-only", snapshot={"source": "/src/x", "tree_sha256": HASH}),
    ]
    judged = classify.classify_events(events, tasks=tasks)
    assert judged.unresolved_tasks == ["unknown"]
    assert judged.snapshot_mismatches == ["other-tree"]
    assert len(judged.classifications) == 4


def test_a_judge_overrides_abstains_or_fails_without_losing_an_event():
    """A configured judge's category replaces the rules' (which stay recorded); None
    abstains; an answer outside the categories or an exception is counted and the
    rules stand."""
    answers = {"a": "style", "b": None, "c": "nonsense"}

    def judge(event):
        if event.event_id == "d":
            raise RuntimeError("model server down")
        return answers[event.event_id]

    events = [_event(event_id=x, comment="wrong output") for x in "abcd"]
    judged = classify.classify_events(events, judge=judge)
    by_id = {c.event_id: c for c in judged.classifications}
    assert (by_id["a"].category, by_id["a"].rule_category, by_id["a"].decided_by) == (
        "style",
        "bug_fix",
        "judge",
    )
    assert by_id["a"].evidence[0] == "judge -> style (rules: bug_fix)"
    for x in "bcd":
        assert (by_id[x].category, by_id[x].decided_by) == ("bug_fix", "rules")
    assert judged.judged == 1 and judged.judge_abstained == 1
    assert len(judged.judge_errors) == 2
    assert "'nonsense', not a category" in judged.judge_errors[0]
    assert "model server down" in judged.judge_errors[1]


def test_judges_are_loaded_by_name_or_dotted_path():
    """``rules`` means no judge; ``module:attribute`` imports a callable; anything
    else is an error naming what is wrong."""
    assert classify.load_judge("rules") is None and classify.load_judge("") is None
    assert classify.load_judge("os.path:basename") is os.path.basename
    with pytest.raises(ValueError, match="unknown judge 'gpt'"):
        classify.load_judge("gpt")
    with pytest.raises(ValueError, match="no callable 'nope'"):
        classify.load_judge("os.path:nope")
    with pytest.raises(ValueError, match="cannot import"):
        classify.load_judge("no_such_module_xyz:judge")


def test_task_index_reads_datasets(tmp_path):
    """Snapshot task ids resolve through the datasets' records (kind, generator, tree)."""
    record = records.TaskRecord(
        task_id="t-1", split="bench", family="tiny", category="bug", generator="off_by_one",
        prompt="Fix.", repo=records.archive_snapshot({"mod.py": "x = 1\n"}),
        hidden_tests={"test_mod.py": "pass\n"}, setup_commands=[], test_framework="unittest",
        test_command="python -m unittest", fail_to_pass=["test_mod.T.t"], pass_to_pass=[],
        solution_patch="", difficulty={"patch_lines": 2.0},
        provenance=records.Provenance("tiny", "tiny:1", "mod", "mod.py", "f"),
        environment={}, validation={},
    )  # fmt: skip
    records.write_tasks([record], str(tmp_path / records.TASKS_FILE))
    index = classify.task_index([str(tmp_path)])
    assert index["t-1"].generator == "off_by_one"
    assert index["t-1"].tree_sha256 == record.repo.tree_sha256
