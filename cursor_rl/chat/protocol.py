"""The chat / tool-call format of the whole project: rendering, parsing, token-level trajectories.

Every stage that shows the model a conversation uses this module: SFT data
(``ChatFormat.render``), RL rollouts (``ChatFormat.append_*`` on a growing
``Trajectory``) and evaluation. The format, with ``S(x)`` the special token ``x`` and
``T(text)`` the tokenizer's encoding of plain text::

    conversation := S(<|bos|>) turn*
    turn         := role body S(<|end|>)
    role         := S(<|system|>) | S(<|user|>) | S(<|assistant|>) | S(<|tool|>)
    body         := T(content)                                   system, user, tool turns
                  | T(content) summary? call*                    assistant turns
    summary      := S(<|summary|>) T(summary) S(<|/summary|>)
    call         := S(<|tool_call|>) T(json) S(<|/tool_call|>)
    json         := {"name": "<tool>", "arguments": {...}}       (json.dumps, ensure_ascii=False)

Tool results come back as ``<|tool|>`` turns, one per call and in call order (a
malformed call gets an error turn in its slot). A self-summary is assistant text
inside ``<|summary|>...<|/summary|>``; it lets an episode continue in a new context
window, which starts a new *segment* (a fresh ``<|bos|>``).

Loss mask: 1 exactly on the tokens the model produces (assistant body and the
``<|end|>`` closing an assistant turn), 0 on ``<|bos|>``, every role header and every
system/user/tool token. Log-probs: the sampler's value on sampled tokens, NaN
elsewhere (rendered text, including SFT assistant turns, was not sampled).

Design choices:

1. **Pieces, never re-tokenization.** Every piece (a special token, one text field)
   is encoded on its own and appended; history is never decoded and re-encoded.
   Special tokens separate the pieces, so ``render(messages)`` and the incremental
   ``append_*`` calls of a rollout give identical ids for the same conversation.
2. **Text cannot forge structure.** ``Tokenizer.encode`` encodes a literal
   ``"<|end|>"`` inside a file or a tool observation as ordinary characters, so only
   this module places special tokens.
3. **The parser reads token ids.** Structure is found by special-token id, the text
   between them is decoded; ``parse_text`` applies the same rules to a string (for
   scripted agents and logs). A model writing the *characters* ``<|tool_call|>``
   has not called a tool.
4. **Malformed output is an observation, never an exception.** Bad JSON, a non-object,
   an unknown tool, a missing, unexpected or wrongly typed argument, or a call cut off
   before ``<|/tool_call|>`` become ``ToolCallError`` entries whose message the
   harness shows the model in that call's ``<|tool|>`` turn.
5. **Truncated turns are closed, untrained.** When sampling stops before ``<|end|>``
   (token budget), ``append_sampled`` adds ``<|end|>`` with mask 0 so the next turn
   is well formed; the model is not trained on a token it did not produce.
6. **Arguments are checked against a small schema** (``ToolSpec``: JSON types
   string, integer, number, boolean, object, array; required or optional), which is
   also what the system prompt shows the model.

Pure Python, no JAX: rollout workers and the SFT data pipeline import it on CPUs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cursor_rl.chat.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")

BOS = "<|bos|>"
EOS = "<|eos|>"
END = "<|end|>"
CALL_OPEN = "<|tool_call|>"
CALL_CLOSE = "<|/tool_call|>"
SUMMARY_OPEN = "<|summary|>"
SUMMARY_CLOSE = "<|/summary|>"
ROLE_TOKENS = {role: f"<|{role}|>" for role in ROLES}

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}

# ---- messages and tools ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A well-formed call of a known tool with schema-valid arguments."""

    name: str
    arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        """The canonical JSON the renderer places between the call tokens."""
        return json.dumps(
            {"name": self.name, "arguments": dict(self.arguments)}, ensure_ascii=False
        )


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call the parser rejected; ``message`` is the observation shown to the model."""

    message: str
    raw: str = ""


@dataclasses.dataclass(frozen=True)
class Message:
    """One turn of a conversation.

    Attributes:
      role: "system", "user", "assistant" or "tool".
      content: the turn's text (for an assistant, the free text before any summary
        and tool calls; for a tool, the observation).
      tool_calls: assistant only; rendered after the text.
      summary: assistant only; a self-summary rendered inside the summary tokens.
      trainable: assistant only; False renders the turn with loss mask 0 (e.g. a
        summary carried into a new segment as context, or SFT turns to skip).
    """

    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    summary: str | None = None
    trainable: bool = True

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; expected one of {ROLES}")
        if self.role != "assistant" and (self.tool_calls or self.summary is not None):
            raise ValueError(
                f"only assistant messages carry tool calls or a summary, not {self.role}"
            )


@dataclasses.dataclass(frozen=True)
class ToolParam:
    """One argument of a tool: a JSON type, a description, and whether it is required."""

    name: str
    type: str
    description: str
    required: bool = True

    def __post_init__(self):
        if self.type not in _JSON_TYPES:
            raise ValueError(f"parameter {self.name}: unknown JSON type {self.type!r}")


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """A tool's name, description and argument schema (what the model is shown)."""

    name: str
    description: str
    params: tuple[ToolParam, ...] = ()

    def json_schema(self) -> dict[str, Any]:
        """The function-calling schema of this tool (name, description, JSON-schema parameters)."""
        return {
            "name": self.name,
            "description": self.description,
            "parameters": {
                "type": "object",
                "properties": {
                    p.name: {"type": p.type, "description": p.description} for p in self.params
                },
                "required": [p.name for p in self.params if p.required],
            },
        }


TOOL_PROMPT_STYLES = ("json", "compact")


def tools_prompt(tools: Iterable[ToolSpec], style: str = "json") -> str:
    """Text for the system prompt that tells the model the call format and the tools.

    Args:
      tools: the tools the episode offers.
      style: ``json``: each tool's full JSON schema (as function-calling APIs show
        them); ``compact``: one line per tool, ``name(arg, optional?): what it does``,
        a fifth of the tokens — for small models with short contexts.

    Returns:
      Plain text (the token names in it are encoded as ordinary characters; the
      model learns to emit the special tokens themselves).
    """
    call = f'{CALL_OPEN}{{"name": "<tool>", "arguments": {{...}}}}{CALL_CLOSE}'
    if style == "compact":
        lines = []
        for t in tools:
            args = ", ".join(p.name + ("" if p.required else "?") for p in t.params)
            lines.append(f"{t.name}({args}): {t.description.split('. ')[0].rstrip('.')}.")
        return f"Call tools as {call}, one or more at the end of a message. Tools:\n" + "\n".join(
            lines
        )
    if style != "json":
        raise ValueError(f"tools prompt style {style!r}: one of {TOOL_PROMPT_STYLES}")
    schemas = "\n".join(json.dumps(t.json_schema(), ensure_ascii=False) for t in tools)
    return (
        "You can call tools. To call one, end your message with one or more calls, each "
        f"written as {call}. "
        "Each call's result comes back in its own tool turn, in order. The tools:\n" + schemas
    )


def validate_call(raw: str, tools: Mapping[str, ToolSpec]) -> ToolCall | ToolCallError:
    """Parses the JSON between the call tokens and checks it against the tool schemas.

    Args:
      raw: the text between ``<|tool_call|>`` and ``<|/tool_call|>``.
      tools: the episode's tools by name.

    Returns:
      A ``ToolCall``, or a ``ToolCallError`` whose message says what is wrong.
    """

    def error(why: str) -> ToolCallError:
        return ToolCallError(f"Error: invalid tool call: {why}", raw)

    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return error(f"not valid JSON ({e.msg} at character {e.pos})")
    except (ValueError, RecursionError) as e:  # huge integers, absurd nesting
        return error(f"not valid JSON ({type(e).__name__})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return error('expected a JSON object {"name": "<tool>", "arguments": {...}}')
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return error(f"unexpected keys {extra}; only name and arguments are allowed")
    name = obj["name"]
    spec = tools.get(name)
    if spec is None:
        return error(f"unknown tool {name!r}; available tools: {', '.join(sorted(tools))}")
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return error(f"arguments of {name} must be a JSON object")
    params = {p.name: p for p in spec.params}
    unexpected = sorted(set(arguments) - set(params))
    if unexpected:
        return error(f"{name} got unexpected arguments {unexpected}; it takes {sorted(params)}")
    for p in spec.params:
        if p.name not in arguments:
            if p.required:
                return error(f"{name} is missing the required argument {p.name!r}")
            continue
        value = arguments[p.name]
        # bool is an int subclass in Python but not a JSON integer or number.
        if isinstance(value, bool) != (p.type == "boolean") or not isinstance(
            value, _JSON_TYPES[p.type]
        ):
            return error(f"argument {p.name!r} of {name} must be of JSON type {p.type}")
    return ToolCall(name, arguments)


# ---- trajectories -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TurnSpan:
    """Where a turn lies in a trajectory: ``tokens[start:end]`` (header to ``<|end|>``)."""

    role: str
    start: int
    end: int
    segment: int


class Trajectory:
    """An append-only token sequence with per-token loss mask and sampler log-prob.

    Built only through ``ChatFormat``; the lists are exposed for reading (do not
    mutate them). ``segment_starts[i]`` is where context window ``i`` begins (its
    ``<|bos|>``); each segment is trained as its own sequence.
    """

    def __init__(self):
        self.tokens: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[TurnSpan] = []
        self.segment_starts: list[int] = []
        self._open_turn: tuple[str, int] | None = None  # (role, start) of an unfinished turn

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def turn_open(self) -> bool:
        """Whether an assistant turn has been opened (header appended) and not closed."""
        return self._open_turn is not None

    def _append(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None = None):
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} tokens but {len(logprobs)} log-probs")
        self.tokens.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [math.nan] * len(ids))

    @property
    def num_segments(self) -> int:
        return len(self.segment_starts)

    def segment(self, index: int) -> tuple[list[int], list[int], list[float]]:
        """(tokens, loss_mask, logprobs) of context window ``index``."""
        start = self.segment_starts[index]
        end = self.segment_starts[index + 1] if index + 1 < len(self.segment_starts) else len(self)
        return self.tokens[start:end], self.loss_mask[start:end], self.logprobs[start:end]

    def current_context(self) -> list[int]:
        """Tokens of the last segment: what the sampler is prompted with."""
        return self.tokens[self.segment_starts[-1] :] if self.segment_starts else []

    def to_json_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (NaN log-probs become null) for rollout files."""
        if self._open_turn is not None:
            raise ValueError("cannot serialise a trajectory with an unfinished turn")
        return {
            "tokens": list(self.tokens),
            "loss_mask": list(self.loss_mask),
            "logprobs": [None if math.isnan(x) else x for x in self.logprobs],
            "turns": [[t.role, t.start, t.end, t.segment] for t in self.turns],
            "segment_starts": list(self.segment_starts),
        }

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> Trajectory:
        """Inverse of ``to_json_dict``."""
        traj = cls()
        traj.tokens = list(data["tokens"])
        traj.loss_mask = list(data["loss_mask"])
        traj.logprobs = [math.nan if x is None else float(x) for x in data["logprobs"]]
        traj.turns = [TurnSpan(*t) for t in data["turns"]]
        traj.segment_starts = list(data["segment_starts"])
        return traj


# ---- parsing ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """What an assistant turn says.

    Attributes:
      content: the free text outside calls and summary.
      summary: the self-summary text, if the turn has one.
      calls: in order, a ``ToolCall`` per well-formed call and a ``ToolCallError``
        per malformed one; the harness answers each with one tool turn.
      finished: whether the turn ended with ``<|end|>`` (or ``<|eos|>``).
      problems: format problems outside calls (stray or unexpected special tokens,
        an unterminated summary, truncation), for logging and shaping.
    """

    content: str
    summary: str | None
    calls: tuple[ToolCall | ToolCallError, ...]
    finished: bool
    problems: tuple[str, ...]


def _parse_pieces(pieces: Iterable[tuple[bool, str]], tools: Mapping[str, ToolSpec]) -> ParsedTurn:
    """Parses (is_special, text) pieces of one assistant body (see choice 3)."""
    content: list[str] = []
    summary: list[str] | None = None
    call_text: list[str] | None = None
    in_summary = False
    calls: list[ToolCall | ToolCallError] = []
    problems: list[str] = []
    finished = False

    def cut_call(why: str):
        nonlocal call_text
        calls.append(ToolCallError(f"Error: invalid tool call: {why}", "".join(call_text)))
        call_text = None

    def cut_summary():
        nonlocal in_summary
        problems.append(f"{SUMMARY_OPEN} without {SUMMARY_CLOSE}")
        in_summary = False

    for special, text in pieces:
        if not special:
            if call_text is not None:
                call_text.append(text)
            elif in_summary:
                summary.append(text)
            else:
                content.append(text)
        elif text in (END, EOS):
            finished = True
            break
        elif text == CALL_OPEN:
            if call_text is not None:
                cut_call(f"{CALL_OPEN} inside an unfinished call (missing {CALL_CLOSE})")
            if in_summary:
                cut_summary()
            call_text = []
        elif text == CALL_CLOSE:
            if call_text is None:
                problems.append(f"stray {CALL_CLOSE}")
            else:
                calls.append(validate_call("".join(call_text), tools))
                call_text = None
        elif text == SUMMARY_OPEN and call_text is None and not in_summary:
            if summary is not None:
                problems.append("more than one summary; the last one counts")
            summary, in_summary = [], True
        elif text == SUMMARY_CLOSE and in_summary:
            in_summary = False
        else:
            problems.append(f"unexpected {text} in an assistant turn")
    if call_text is not None:
        cut_call(f"the call was cut off before {CALL_CLOSE}")
    if in_summary:
        cut_summary()
    if not finished:
        problems.append(f"the turn ended without {END} (truncated)")
    return ParsedTurn(
        content="".join(content),
        summary=None if summary is None else "".join(summary),
        calls=tuple(calls),
        finished=finished,
        problems=tuple(problems),
    )


# ---- the format -----------------------------------------------------------------------------


class ChatFormat:
    """Renders messages to token ids and parses model output, for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._id = {tok: tokenizer.special_id(tok) for tok in tokenizer.special_ids}
        missing = {BOS, EOS, END, CALL_OPEN, CALL_CLOSE, SUMMARY_OPEN, SUMMARY_CLOSE} | set(
            ROLE_TOKENS.values()
        )
        missing -= set(self._id)
        if missing:
            raise ValueError(f"tokenizer lacks the chat special tokens {sorted(missing)}")
        self._token_of = {i: tok for tok, i in self._id.items()}
        self._special_re = re.compile("|".join(re.escape(t) for t in self._id))

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Token ids that end an assistant turn (pass them to the sampler)."""
        return (self._id[END], self._id[EOS])

    # ---- rendering ----

    def assistant_body(self, message: Message) -> list[int]:
        """Ids of an assistant turn after its header, ``<|end|>`` included.

        This is exactly what a sampler emits for ``message`` when it writes the
        canonical rendering.
        """
        if message.role != "assistant":
            raise ValueError(f"assistant_body needs an assistant message, not {message.role}")
        ids = self.tokenizer.encode(message.content)
        if message.summary is not None:
            ids += [self._id[SUMMARY_OPEN], *self.tokenizer.encode(message.summary)]
            ids.append(self._id[SUMMARY_CLOSE])
        for call in message.tool_calls:
            ids += [self._id[CALL_OPEN], *self.tokenizer.encode(call.to_json())]
            ids.append(self._id[CALL_CLOSE])
        ids.append(self._id[END])
        return ids

    def start_segment(self, traj: Trajectory) -> None:
        """Begins a new context window (the first, or one after a self-summary)."""
        self._check_closed(traj)
        traj.segment_starts.append(len(traj))
        traj._append([self._id[BOS]], 0)

    def append_message(self, traj: Trajectory, message: Message) -> None:
        """Appends one whole turn (header, body, ``<|end|>``)."""
        if message.role == "assistant":
            self.append_assistant_header(traj)
            body = self.assistant_body(message)
            traj._append(body, 1 if message.trainable else 0)
            self._close_turn(traj)
            return
        self._check_open_segment(traj)
        start = len(traj)
        traj._append([self._id[ROLE_TOKENS[message.role]]], 0)
        traj._append(self.tokenizer.encode(message.content), 0)
        traj._append([self._id[END]], 0)
        traj.turns.append(TurnSpan(message.role, start, len(traj), traj.num_segments - 1))

    def append_assistant_header(self, traj: Trajectory) -> None:
        """Appends ``<|assistant|>``: the generation prompt of a rollout step."""
        self._check_open_segment(traj)
        traj._open_turn = ("assistant", len(traj))
        traj._append([self._id[ROLE_TOKENS["assistant"]]], 0)

    def append_sampled(
        self, traj: Trajectory, tokens: Sequence[int], logprobs: Sequence[float] | None = None
    ) -> None:
        """Appends sampled tokens (mask 1) and closes the assistant turn.

        Tokens after the first stop token are dropped. Without a stop token (the
        sampling budget ran out) a ``<|end|>`` with mask 0 closes the turn (choice 5).

        Args:
          traj: a trajectory whose last piece is an assistant header.
          tokens: the sampler's output for this turn.
          logprobs: the sampler's log-prob of each token (None: unknown, NaN).
        """
        if traj._open_turn is None:
            raise ValueError("append_sampled needs an open assistant turn")
        stops = set(self.stop_token_ids)
        cut = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
        kept = list(tokens[:cut])
        traj._append(kept, 1, None if logprobs is None else list(logprobs[:cut]))
        if not kept or kept[-1] not in stops:
            traj._append([self._id[END]], 0)
        self._close_turn(traj)

    def render(self, messages: Sequence[Message]) -> Trajectory:
        """Renders a whole conversation (SFT): one segment, no generation prompt."""
        traj = Trajectory()
        self.start_segment(traj)
        for message in messages:
            self.append_message(traj, message)
        return traj

    def _check_closed(self, traj: Trajectory):
        if traj._open_turn is not None:
            raise ValueError("the assistant turn is still open; call append_sampled first")

    def _check_open_segment(self, traj: Trajectory):
        self._check_closed(traj)
        if not traj.segment_starts:
            raise ValueError("start_segment must come first")

    def _close_turn(self, traj: Trajectory):
        role, start = traj._open_turn
        traj.turns.append(TurnSpan(role, start, len(traj), traj.num_segments - 1))
        traj._open_turn = None

    # ---- parsing ----

    def parse(self, tokens: Sequence[int], tools: Mapping[str, ToolSpec]) -> ParsedTurn:
        """Parses the sampled tokens of one assistant turn (after its header).

        Args:
          tokens: the sampled ids, usually ending with ``<|end|>``.
          tools: the episode's tools by name.

        Returns:
          The turn's text, summary and calls; never raises on malformed output.
        """

        def pieces():
            run: list[int] = []
            for t in tokens:
                if t in self._token_of:
                    if run:
                        yield False, self.tokenizer.decode(run)
                        run = []
                    yield True, self._token_of[t]
                else:
                    run.append(t)
            if run:
                yield False, self.tokenizer.decode(run)

        return _parse_pieces(pieces(), tools)

    def _markup_pieces(self, text: str):
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                yield False, text[pos : m.start()]
            yield True, m.group()
            pos = m.end()
        if pos < len(text):
            yield False, text[pos:]

    def parse_text(self, text: str, tools: Mapping[str, ToolSpec]) -> ParsedTurn:
        """Parses assistant text in which special tokens appear as their strings."""
        return _parse_pieces(self._markup_pieces(text), tools)

    def encode_markup(self, text: str) -> list[int]:
        """Ids of text in which special tokens are written as their strings.

        For scripted agents and tests only: applied to untrusted text this is exactly
        how text would forge structure (choice 2).
        """
        ids: list[int] = []
        for special, piece in self._markup_pieces(text):
            ids += [self._id[piece]] if special else self.tokenizer.encode(piece)
        return ids
