"""Product feedback events: the JSONL format and its validating loader.

    feedback = load_feedback("feedback.jsonl", chat=None)   # chat: for episode-format rows
    feedback.events       # valid FeedbackEvents, in file order
    feedback.bad_rows     # BadRow(line, event_id, problem) for every row that was not

One line per event (``docs/outer_loop.md`` has the full field list and an example)::

    {"schema_version": 1, "event_id": "fb-0007", "rating": "down", "reverted": true,
     "comment": "it edited the test instead of the code", "time": "2026-12-01T10:04:00Z",
     "policy": "rl step 20",
     "snapshot": {"task_id": "tiny-1000101-off_by_one-0a1b2c3d4e"}
              |  {"source": "/src/myrepo", "tree_sha256": "<64 hex>"},
     "trajectory": {"format": "messages", "messages": [MESSAGE, ...],
                    "finish_reason": "submitted", "max_turns": 12}
                |  {"format": "episode", "episode": Episode.to_json(), "max_turns": 12}}

    MESSAGE := {"role": "system" | "user" | "tool", "content": "..."}
             | {"role": "assistant", "content": "...", "summary": "...",
                "tool_calls": [{"name": "edit_file", "arguments": {...}} | "<raw text>", ...]}

Choices:

1. **The trajectory is the harness's own.** Either the token-level episode a rollout
   or an eval writes (``cursor_rl.chat.episodes.Episode.to_json``, read with the
   tokenizer that wrote it), or its message form (``cursor_rl.chat.protocol.Message``
   fields), which is what a product log holds. A tool call is the JSON object the
   model wrote between the call tokens, or, when that was not a valid object, the
   raw text itself; either way it is checked by ``protocol.validate_call`` against
   the harness's tools (``cursor_rl.env.tools.TOOL_SPECS``), so a malformed call in a
   log is malformed exactly when the harness would have said so.
2. **Both forms become the detectors' view** (``cursor_rl.rl.feedback.EpisodeView``):
   an episode through ``feedback.view``, messages turn by turn, so classification
   runs the textual-feedback detectors unchanged. A turn's position is its token
   position (episodes) or its message index (messages); only their order matters.
3. **A row is valid or it is a bad row.** Every field's presence, type and value is
   checked (unknown fields too, and the schema version: a loader refuses versions
   it does not know rather than guessing); the first problem of a row becomes a
   ``BadRow`` with its 1-based line number and, when readable, its event id. Good
   rows still load. A line that is not UTF-8 or not JSON is a bad row too; blank
   lines are skipped; a repeated ``event_id`` is a bad row naming the first line.
4. **Negative** means a thumbs down or reverted edits (``reverted``: the product saw
   the user undo the agent's change), whatever the rating: both say the work was
   not wanted.
5. **The snapshot is a reference**, not a copy: a task id of a task dataset (resolved
   later against the datasets the command is given) and/or a source (a path, an
   sdist spec, ``tiny:SEED``) with the sha256 of its file tree as
   ``cursor_rl.tasks.records.tree_hash`` computes it. Only the form is checked here.

Pure Python, no JAX.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from cursor_rl.chat import protocol
from cursor_rl.chat.episodes import Episode
from cursor_rl.env import tools as env_tools
from cursor_rl.rl import feedback

SCHEMA_VERSION = 1
RATINGS = ("up", "down")
TRAJECTORY_FORMATS = ("messages", "episode")
# The harness's finish reasons (cursor_rl.chat.episodes.Episode), and "stopped": the
# product session ended while the agent was still working (the user stopped it).
FINISH_REASONS = (
    "submitted",
    "answered",
    "turn_limit",
    "token_budget",
    "context",
    "lost",
    "stopped",
)
_TREE_SHA = re.compile(r"^[0-9a-f]{64}$")
MAX_EVENT_ID_CHARS = 200


class RowError(ValueError):
    """One row of a feedback file is malformed; the message says what is wrong."""

    event_id = ""  # the row's event id, when it could be read


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The repository state the agent worked on (choice 5).

    Attributes:
      task_id: a task of a task dataset, or ``""``.
      source: a source tree (path, ``sdist:...``, ``tiny:SEED``), or ``""``.
      tree_sha256: the tree's ``records.tree_hash`` (with ``source``), or ``""``.
    """

    task_id: str = ""
    source: str = ""
    tree_sha256: str = ""


@dataclasses.dataclass(frozen=True)
class FeedbackEvent:
    """One valid feedback event.

    Attributes:
      event_id: unique within its file.
      line: its 1-based line in the file.
      rating: ``up`` or ``down``.
      reverted: whether the user reverted the agent's edits.
      comment: the user's comment (``""`` when none).
      time: when it was given (ISO 8601, as written; ``""`` when unknown).
      policy: which policy or checkpoint produced the trajectory (free text).
      snapshot: the repository reference.
      trajectory_format: ``messages`` or ``episode``.
      request: the first user message of the trajectory (the task asked for).
      view: the trajectory as the textual-feedback detectors read it.
      row: the decoded JSON row, for a judge that wants everything.
    """

    event_id: str
    line: int
    rating: str
    reverted: bool
    comment: str
    time: str
    policy: str
    snapshot: Snapshot
    trajectory_format: str
    request: str
    view: feedback.EpisodeView
    row: Mapping[str, Any]

    @property
    def negative(self) -> bool:
        """A thumbs down or reverted edits (choice 4)."""
        return self.rating == "down" or self.reverted

    @property
    def assistant_turns(self) -> int:
        return len(self.view.turns)


@dataclasses.dataclass(frozen=True)
class BadRow:
    """A row that did not load: its line, its event id when readable, the problem."""

    line: int
    event_id: str
    problem: str

    def __str__(self) -> str:
        name = f" (event {self.event_id!r})" if self.event_id else ""
        return f"line {self.line}{name}: {self.problem}"


@dataclasses.dataclass
class FeedbackSet:
    """What a feedback file held.

    Attributes:
      path: the file.
      sha256: the file's bytes' sha256 (provenance of everything derived from it).
      rows: non-blank lines read.
      events: the valid events, in file order.
      bad_rows: every other row, in file order.
    """

    path: str
    sha256: str
    rows: int
    events: list[FeedbackEvent]
    bad_rows: list[BadRow]

    @property
    def negative(self) -> list[FeedbackEvent]:
        return [e for e in self.events if e.negative]


# ---- the loader ----------------------------------------------------------------------


def load_feedback(path: str, *, chat: protocol.ChatFormat | None = None) -> FeedbackSet:
    """Reads and validates a feedback JSONL file.

    Args:
      path: the file.
      chat: the chat format of the tokenizer that wrote episode-format trajectories;
        without it such rows are bad rows (their token ids cannot be read).

    Returns:
      The valid events and the bad rows (choice 3).

    Raises:
      FileNotFoundError: no such file (a missing file is not a bad row).
    """
    events: list[FeedbackEvent] = []
    bad: list[BadRow] = []
    first_line: dict[str, int] = {}
    rows = 0
    digest = hashlib.sha256()
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is one bad row
        for lineno, raw in enumerate(f, 1):
            digest.update(raw)
            if not raw.strip():
                continue
            rows += 1
            try:
                event = _read_line(raw, lineno, chat)
            except RowError as e:
                bad.append(BadRow(lineno, e.event_id, str(e)))
                continue
            if event.event_id in first_line:
                first = first_line[event.event_id]
                problem = f"duplicate event_id {event.event_id!r} (first on line {first})"
                bad.append(BadRow(lineno, event.event_id, problem))
                continue
            first_line[event.event_id] = lineno
            events.append(event)
    return FeedbackSet(path, digest.hexdigest(), rows, events, bad)


def _read_line(raw: bytes, lineno: int, chat: protocol.ChatFormat | None) -> FeedbackEvent:
    """One line's event; a ``RowError`` (carrying the event id when readable) if not."""
    event_id = ""
    try:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RowError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise RowError(f"not valid JSON ({e.msg} at character {e.pos})") from None
        except (ValueError, RecursionError) as e:
            raise RowError(f"not valid JSON ({type(e).__name__})") from None
        if isinstance(obj, dict) and isinstance(obj.get("event_id"), str):
            event_id = obj["event_id"][:MAX_EVENT_ID_CHARS]
        return parse_event(obj, line=lineno, chat=chat)
    except RowError as e:
        e.event_id = event_id
        raise


# ---- one row -------------------------------------------------------------------------

_REQUIRED = ("schema_version", "event_id", "rating", "snapshot", "trajectory")
_OPTIONAL = ("reverted", "comment", "time", "policy")


def parse_event(
    obj: Any, *, line: int = 0, chat: protocol.ChatFormat | None = None
) -> FeedbackEvent:
    """Builds a ``FeedbackEvent`` from one decoded row, checking every field.

    Args:
      obj: the decoded JSON value.
      line: its line number (recorded in the event).
      chat: see ``load_feedback``.

    Returns:
      The event.

    Raises:
      RowError: the first problem found, naming the field.
    """
    if not isinstance(obj, dict):
        raise RowError(f"expected a JSON object, got {_json_type(obj)}")
    for field in _REQUIRED:
        if field not in obj:
            raise RowError(f"missing field {field!r}")
    unknown = sorted(set(obj) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise RowError(f"unknown field {unknown[0]!r}")
    version = obj["schema_version"]
    if not _is_int(version):
        raise RowError("field 'schema_version' must be an integer")
    if version != SCHEMA_VERSION:
        raise RowError(
            f"field 'schema_version' is {version}, this code reads version {SCHEMA_VERSION}"
        )
    event_id = obj["event_id"]
    if not isinstance(event_id, str) or not event_id.strip():
        raise RowError("field 'event_id' must be a non-empty string")
    if len(event_id) > MAX_EVENT_ID_CHARS:
        raise RowError(f"field 'event_id' is longer than {MAX_EVENT_ID_CHARS} characters")
    if obj["rating"] not in RATINGS:
        raise RowError(f"field 'rating' must be one of {RATINGS}, got {obj['rating']!r}")
    reverted = obj.get("reverted", False)
    if not isinstance(reverted, bool):
        raise RowError("field 'reverted' must be true or false")
    for field in ("comment", "time", "policy"):
        if not isinstance(obj.get(field, ""), str):
            raise RowError(f"field {field!r} must be a string")
    when = obj.get("time", "")
    if when:
        try:
            datetime.datetime.fromisoformat(when)
        except ValueError:
            raise RowError(f"field 'time' is not an ISO 8601 time: {when!r}") from None
    snapshot = _snapshot(obj["snapshot"])
    fmt, view, request = _trajectory(obj["trajectory"], snapshot, chat)
    return FeedbackEvent(
        event_id=event_id,
        line=line,
        rating=obj["rating"],
        reverted=reverted,
        comment=obj.get("comment", ""),
        time=when,
        policy=obj.get("policy", ""),
        snapshot=snapshot,
        trajectory_format=fmt,
        request=request,
        view=view,
        row=obj,
    )


def _snapshot(obj: Any) -> Snapshot:
    if not isinstance(obj, dict):
        raise RowError("field 'snapshot' must be an object")
    unknown = sorted(set(obj) - {"task_id", "source", "tree_sha256"})
    if unknown:
        raise RowError(f"unknown field 'snapshot.{unknown[0]}'")
    for field in ("task_id", "source", "tree_sha256"):
        if field in obj and (not isinstance(obj[field], str) or not obj[field]):
            raise RowError(f"field 'snapshot.{field}' must be a non-empty string")
    if ("source" in obj) != ("tree_sha256" in obj):
        raise RowError("fields 'snapshot.source' and 'snapshot.tree_sha256' come together")
    if "tree_sha256" in obj and not _TREE_SHA.match(obj["tree_sha256"]):
        raise RowError("field 'snapshot.tree_sha256' must be 64 lower-case hex digits")
    if "task_id" not in obj and "source" not in obj:
        raise RowError("field 'snapshot' needs a 'task_id' or a 'source' with 'tree_sha256'")
    return Snapshot(obj.get("task_id", ""), obj.get("source", ""), obj.get("tree_sha256", ""))


def _trajectory(
    obj: Any, snapshot: Snapshot, chat: protocol.ChatFormat | None
) -> tuple[str, feedback.EpisodeView, str]:
    if not isinstance(obj, dict):
        raise RowError("field 'trajectory' must be an object")
    fmt = obj.get("format")
    if fmt not in TRAJECTORY_FORMATS:
        raise RowError(f"field 'trajectory.format' must be one of {TRAJECTORY_FORMATS}")
    allowed = {"format", "max_turns"} | (
        {"messages", "finish_reason"} if fmt == "messages" else {"episode"}
    )
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise RowError(f"unknown field 'trajectory.{unknown[0]}' (format {fmt})")
    max_turns = obj.get("max_turns")
    if max_turns is not None and not (_is_int(max_turns) and max_turns > 0):
        raise RowError("field 'trajectory.max_turns' must be a positive integer")
    if fmt == "messages":
        view, request = _messages_view(obj, snapshot, max_turns)
    else:
        view, request = _episode_view(obj, chat, max_turns)
    if not view.turns:
        raise RowError("the trajectory has no assistant turn")
    return fmt, view, request


_TOOLS = {spec.name: spec for spec in env_tools.TOOL_SPECS}


def _messages_view(
    obj: Mapping[str, Any], snapshot: Snapshot, max_turns: int | None
) -> tuple[feedback.EpisodeView, str]:
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RowError("field 'trajectory.messages' must be a non-empty list")
    turns: list[feedback.Turn] = []
    request = ""
    for index, message in enumerate(messages):
        where = f"trajectory.messages[{index}]"
        if not isinstance(message, dict):
            raise RowError(f"field {where!r} must be an object")
        role = message.get("role")
        if role not in protocol.ROLES:
            raise RowError(f"field '{where}.role' must be one of {protocol.ROLES}")
        allowed = {"role", "content"} | (
            {"tool_calls", "summary"} if role == "assistant" else set()
        )
        unknown = sorted(set(message) - allowed)
        if unknown:
            raise RowError(f"unknown field '{where}.{unknown[0]}' (role {role})")
        content = message.get("content", "")
        if not isinstance(content, str):
            raise RowError(f"field '{where}.content' must be a string")
        if not isinstance(message.get("summary", ""), str):
            raise RowError(f"field '{where}.summary' must be a string")
        if role == "user" and not request:
            request = content
        elif role == "assistant":
            calls = message.get("tool_calls", [])
            if not isinstance(calls, list):
                raise RowError(f"field '{where}.tool_calls' must be a list")
            parsed = []
            for j, call in enumerate(calls):
                if isinstance(call, dict):
                    raw = json.dumps(call, ensure_ascii=False)
                elif isinstance(call, str):
                    raw = call
                else:
                    raise RowError(
                        f"field '{where}.tool_calls[{j}]' must be an object (the call) or a "
                        "string (its raw text)"
                    )
                parsed.append(protocol.validate_call(raw, _TOOLS))
            turns.append(feedback.Turn(index, tuple(parsed), ()))
        elif role == "tool" and turns:
            last = turns[-1]
            turns[-1] = dataclasses.replace(last, results=(*last.results, content))
    finish = obj.get("finish_reason") or _finish_reason(turns)
    if finish not in FINISH_REASONS:
        raise RowError(f"field 'trajectory.finish_reason' must be one of {FINISH_REASONS}")
    episode = Episode(
        task_id=snapshot.task_id or snapshot.source,
        category="",
        task_index=0,
        sample=0,
        trajectory=protocol.Trajectory(),  # the message form has no tokens
        finish_reason=finish,
        tool_calls=sum(len(t.calls) for t in turns),
    )
    return feedback.EpisodeView(episode, turns, tuple(_TOOLS), max_turns), request


def _finish_reason(turns: Sequence[feedback.Turn]) -> str:
    """How a logged conversation ended, as the harness would have said (choice 2 of
    ``cursor_rl.env.harness``): a ``submit`` call, a turn without calls (an answer), or
    neither (the session stopped while the agent worked)."""
    if not turns:
        return "stopped"
    calls = turns[-1].calls
    if any(isinstance(c, protocol.ToolCall) and c.name == "submit" for c in calls):
        return "submitted"
    return "answered" if not calls else "stopped"


def _episode_view(
    obj: Mapping[str, Any], chat: protocol.ChatFormat | None, max_turns: int | None
) -> tuple[feedback.EpisodeView, str]:
    if chat is None:
        raise RowError(
            "an episode-format trajectory holds token ids: give the tokenizer that wrote it "
            "(--tokenizer)"
        )
    data = obj.get("episode")
    if not isinstance(data, dict):
        raise RowError("field 'trajectory.episode' must be an object (Episode.to_json)")
    try:
        episode = Episode.from_json(data)
    except (KeyError, TypeError, ValueError) as e:
        raise RowError(f"field 'trajectory.episode' is not an episode: {e!r}") from None
    traj = episode.trajectory
    vocab = chat.tokenizer.vocab_size
    if not all(_is_int(t) and 0 <= t < vocab for t in traj.tokens):
        raise RowError(f"trajectory token ids must be integers in [0, {vocab})")
    if not len(traj.tokens) == len(traj.loss_mask) == len(traj.logprobs):
        raise RowError("trajectory tokens, loss_mask and logprobs differ in length")
    for span in traj.turns:
        if span.role not in protocol.ROLES or not 0 <= span.start < span.end <= len(traj):
            raise RowError(f"trajectory turn {span} lies outside its tokens")
    try:
        view = feedback.view(episode, chat, env_tools.TOOL_SPECS, max_turns)
    except Exception as e:  # a corrupt trajectory must become a bad row, whatever it is
        raise RowError(f"the trajectory could not be read: {e!r}") from None
    specials = set(chat.tokenizer.special_ids.values())
    request = ""
    for span in traj.turns:
        if span.role == "user":
            body = [t for t in traj.tokens[span.start + 1 : span.end] if t not in specials]
            request = chat.tokenizer.decode(body)
            break
    return view, request


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )
