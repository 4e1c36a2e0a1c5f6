"""Textual feedback: a hint at the point where an episode went wrong makes a teacher.

    config = FeedbackConfig.from_mapping(cfg.rl.feedback.to_dict())
    found = find_points(episodes, chat, config)      # one Point (or None) per episode
    hint_ids = hint_tokens(chat, point.hint)         # the hint as a user turn's tokens

Credit assignment in long agent episodes by words instead of rewards (Cursor's
Composer 2 recipe): find the point where an episode went wrong, insert a hint there
("these are the tools you can use"), and let the same policy, conditioned on the
hint, be the teacher of what the episode sampled from that point on. Tokens the
teacher likes more than the student get more probability, tokens it likes less get
less — a per-token signal where the reward gives one number per episode.

Choices:

1. **Detectors are small named functions** of a finished episode's turns
   (``EpisodeView``), each returning the token position of the assistant turn that
   went wrong and the hint's facts, or None: ``malformed_tool_call`` (a call the
   parser rejected: bad JSON or an unknown tool), ``repeated_edit`` (the same
   ``edit_file`` call made again), ``submitted_without_tests`` (``submit`` with no
   test run, or Python run on the code, before it), ``edited_tests`` (an edit of a
   test file), ``gave_up_early`` (the episode stopped calling tools, without
   submitting, with turns left). An
   episode's point is the earliest any enabled detector found. Hints come from one
   editable file, ``cursor_rl.rl.hints``, templated with the episode's facts.
2. **The teacher scores the episode's own tokens** (no second decode): the hinted
   sequence is the segment's tokens with the hint's user turn inserted before the
   point's assistant turn; the same parameters score it, and for each model token
   ``t`` in the ``window`` tokens after the point the signal is
   ``d_t = log pi(y_t | x_<p, hint, y_p..t-1) - log pi(y_t | x_<t)``, both under the
   weights the update starts from (the student's is ``old_logprobs``).
3. **Added to the GRPO advantage**: ``A_t <- A + coef * clip(d_t, -clip, clip)`` on the
   window's model tokens (tool output, prompts and padding stay masked). This is
   on-policy distillation's reverse-KL advantage (the student is pushed toward the
   teacher on the tokens it sampled) riding on the policy-gradient estimator, so PPO
   clipping and TIS apply to it unchanged; ``coef = 0`` is plain GRPO, bitwise.
   ``objective="kl"`` instead distils the teacher's whole next-token distribution:
   ``coef * mean_t KL(pi_teacher(.|x_<p, hint, y_p..t-1) || pi(.|x_<t))`` over the
   window is added to the loss. The sampled-token signal can only push the sampled
   token down and leaves where the freed probability goes to the student; the KL names
   the teacher's preferred tokens (on-policy distillation with the hinted policy as
   teacher; docs/learning.md section 10 measures both).
4. **One program**: the hinted sequences are packed into ``teacher_*`` rows of the
   same batch, and the GRPO step scores them (no gradient) before its micro-batch
   loop, in the same XLA program as the policy loss; a batch with no point has no
   teacher rows and runs the plain program (no extra cost).
5. **Episodes of zero-variance groups are kept when they have a point**: there the
   reward gives no signal (every sample failed alike) and the hint is the only
   teacher; they train with advantage 0 plus the feedback term.
6. **Failures never stop training**: a detector that raises, or a hinted segment
   that does not fit ``rl.train_seq_len``, leaves the episode without feedback and is
   counted in the metrics (``feedback/detector_errors``, ``feedback/too_long``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cursor_rl.chat import protocol
from cursor_rl.chat.episodes import Episode
from cursor_rl.chat.protocol import ChatFormat, Message, ToolCall, ToolCallError
from cursor_rl.env import tools as env_tools
from cursor_rl.rl import hints as hint_library

log = logging.getLogger(__name__)

TEST_FILE = re.compile(r"(^|/)(tests?/|test_[^/]*\.py$|[^/]*_test\.py$)")
# A terminal command that checks the work: a test runner, or Python run on the code.
TEST_COMMAND = re.compile(r"pytest|unittest|\btest|\bpython")


@dataclasses.dataclass(frozen=True)
class FeedbackConfig:
    enabled: bool = False
    coef: float = 0.5  # lambda: weight of the teacher signal (advantage term or KL)
    # How the teacher teaches (``grpo`` choice 9): "kl" adds the whole-vocabulary
    # KL(teacher || student) at each window position to the loss; "advantage" adds the
    # clipped log-ratio of the sampled token to its advantage (docs/learning.md
    # sections 9-10: only "kl" raised the behaviour the hint asks for).
    objective: str = "kl"
    window: int = 256  # model tokens after the point that get the signal
    clip: float = 2.0  # |log pi_teacher - log pi_student| cap per token
    detectors: tuple[str, ...] = (
        "malformed_tool_call",
        "repeated_edit",
        "submitted_without_tests",
        "edited_tests",
        "gave_up_early",
    )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> FeedbackConfig:
        values = dict(values)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"rl.feedback: unknown field(s) {unknown}; known: {sorted(known)}")
        if "detectors" in values:
            values["detectors"] = tuple(values["detectors"])
        config = cls(**values)
        bad = sorted(set(config.detectors) - set(DETECTORS))
        if bad:
            raise ValueError(f"rl.feedback.detectors: unknown {bad}; known: {sorted(DETECTORS)}")
        missing = sorted(set(config.detectors) - set(hint_library.HINTS))
        if missing:
            raise ValueError(f"rl.hints.HINTS has no hint for {missing}")
        if config.objective not in ("advantage", "kl"):
            raise ValueError(
                f"rl.feedback.objective={config.objective!r}: one of ('advantage', 'kl')"
            )
        if config.coef < 0 or config.window <= 0 or config.clip <= 0:
            raise ValueError("rl.feedback: coef must be >= 0, window and clip > 0")
        return config


@dataclasses.dataclass(frozen=True)
class Point:
    """Where an episode went wrong: the hint goes before the assistant turn that
    starts at trajectory token ``position``."""

    detector: str
    position: int
    hint: str


# ---- reading an episode --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Turn:
    """One assistant turn: where it starts (its header) and what it said."""

    start: int
    calls: tuple[ToolCall | ToolCallError, ...]
    results: tuple[str, ...]  # the tool turns that answered it, as text


@dataclasses.dataclass
class EpisodeView:
    """A finished episode as detectors read it."""

    episode: Episode
    turns: list[Turn]
    tool_names: tuple[str, ...]
    max_turns: int | None = None


def view(
    episode: Episode, chat: ChatFormat, tool_specs=env_tools.TOOL_SPECS, max_turns=None
) -> EpisodeView:
    """Re-parses the trajectory's assistant turns (and the tool turns after each)."""
    traj = episode.trajectory
    specs = {s.name: s for s in tool_specs}
    specials = set(chat.tokenizer.special_ids.values())
    turns: list[Turn] = []
    for span in traj.turns:
        if span.role == "assistant":
            sampled = [traj.tokens[i] for i in range(span.start, span.end) if traj.loss_mask[i]]
            if not sampled:  # a summary given as context, not sampled
                continue
            parsed = chat.parse(sampled, specs)
            turns.append(Turn(span.start, parsed.calls, ()))
        elif span.role == "tool" and turns:
            body = [t for t in traj.tokens[span.start + 1 : span.end] if t not in specials]
            last = turns[-1]
            text = chat.tokenizer.decode(body)
            turns[-1] = dataclasses.replace(last, results=(*last.results, text))
    return EpisodeView(episode, turns, tuple(specs), max_turns)


def _calls(v: EpisodeView):
    for turn in v.turns:
        for call in turn.calls:
            yield turn, call


# ---- detectors: (view) -> (position, facts) or None ------------------------------------


def malformed_tool_call(v: EpisodeView):
    for turn, call in _calls(v):
        if isinstance(call, ToolCallError):
            return turn.start, {"tool": call.raw[:40]}
    return None


def repeated_edit(v: EpisodeView):
    seen = set()
    for turn, call in _calls(v):
        if isinstance(call, ToolCall) and call.name == "edit_file":
            key = call.to_json()
            if key in seen:
                return turn.start, {"path": call.arguments.get("path", "")}
            seen.add(key)
    return None


def _runs_tests(call) -> bool:
    return (
        isinstance(call, ToolCall)
        and call.name == "run_terminal"
        and bool(TEST_COMMAND.search(str(call.arguments.get("command", ""))))
    )


def submitted_without_tests(v: EpisodeView):
    tested = False
    for turn, call in _calls(v):
        tested = tested or _runs_tests(call)
        if isinstance(call, ToolCall) and call.name == "submit":
            return None if tested else (turn.start, {})
    return None


def edited_tests(v: EpisodeView):
    for turn, call in _calls(v):
        if isinstance(call, ToolCall) and call.name == "edit_file":
            path = str(call.arguments.get("path", ""))
            if TEST_FILE.search(path):
                return turn.start, {"path": path}
    return None


def gave_up_early(v: EpisodeView):
    if v.episode.finish_reason != "answered" or not v.turns:
        return None
    if v.max_turns is not None and len(v.turns) >= v.max_turns:
        return None
    return v.turns[-1].start, {}


DETECTORS: dict[str, Callable[[EpisodeView], Any]] = {
    "malformed_tool_call": malformed_tool_call,
    "repeated_edit": repeated_edit,
    "submitted_without_tests": submitted_without_tests,
    "edited_tests": edited_tests,
    "gave_up_early": gave_up_early,
}


def find_points(
    episodes: Sequence[Episode],
    chat: ChatFormat,
    config: FeedbackConfig,
    *,
    max_turns: int | None = None,
    tool_specs=env_tools.TOOL_SPECS,
) -> tuple[list[Point | None], dict[str, float]]:
    """Each episode's point (the earliest any enabled detector found, or None) and
    metrics: per detector the fraction of episodes it fired on (the behaviour's rate,
    ``feedback/<name>``), ``feedback/points`` and ``feedback/detector_errors``."""
    points: list[Point | None] = []
    fired = dict.fromkeys(config.detectors, 0)
    errors = 0
    for episode in episodes:
        found: list[Point] = []
        try:
            v = view(episode, chat, tool_specs, max_turns)
        except Exception:  # choice 6
            log.exception("feedback: episode %s could not be read", episode.task_id)
            errors += 1
            points.append(None)
            continue
        facts_common = {"tools": ", ".join(v.tool_names)}
        for name in config.detectors:
            try:
                hit = DETECTORS[name](v)
                if hit is None:
                    continue
                position, facts = hit
                fill = {"tool": "", "path": "", **facts_common, **facts}
                hint = hint_library.HINTS[name].format(**fill)
            except Exception:  # choice 6
                log.exception("feedback: detector %s failed on %s", name, episode.task_id)
                errors += 1
                continue
            fired[name] += 1
            found.append(Point(name, int(position), hint))
        points.append(min(found, key=lambda p: p.position) if found else None)
    n = max(len(episodes), 1)
    metrics = {f"feedback/{name}": count / n for name, count in fired.items()}
    metrics["feedback/points"] = float(sum(p is not None for p in points))
    metrics["feedback/detector_errors"] = float(errors)
    return points, metrics


def hint_tokens(chat: ChatFormat, hint: str) -> list[int]:
    """The hint as a user turn's tokens (header, text, ``<|end|>``)."""
    scratch = protocol.Trajectory()
    chat.start_segment(scratch)
    chat.append_message(scratch, Message("user", hint))
    return scratch.tokens[1:]
