"""One agent episode: the token trajectory and the tool calls that grow it.

    episode = AgentEpisode(chat, TOOL_SPECS, tools.execute, system=..., task=...)
    while not episode.done:
        completion = sampler.generate([episode.prompt()], params)[0]
        episode.step(completion.tokens, completion.logprobs)
    episode.trajectory   # tokens, loss mask, log-probs, turns (cursor_rl.chat.protocol)

Design choices:

1. **The executor is a callable** ``(ToolCall | ToolCallError) -> ToolResult``: a local
   ``Tools.execute`` or a ``ToolPool`` episode's ``execute``, so the same loop runs
   in-process (tests, scripted agents) and against a worker pool (RL).
2. **When an episode ends:** the model called ``submit``; or it ended a turn without
   any tool call (its final answer); or ``max_turns`` assistant turns were sampled.
   Malformed calls do not end it: each gets an error turn and the model continues.
3. **Calls after ``submit`` in the same turn are not executed**; each still gets a
   tool turn saying so, keeping one tool turn per call.
4. **The next assistant turn opens lazily** (in ``prompt`` or ``step``), so between
   turns the caller may add a user message (``add_user_message``: a hint, or the
   request for a self-summary), record a turn without running tools (``record``:
   the summary itself) and start a new context window from a summary
   (``restart_from_summary``). The tokens are the same as opening it eagerly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from cursor_rl.chat.protocol import (
    ChatFormat,
    Message,
    ParsedTurn,
    ToolCall,
    ToolCallError,
    ToolSpec,
    Trajectory,
    tools_prompt,
)
from cursor_rl.env.tools import ToolResult

Executor = Callable[[ToolCall | ToolCallError], ToolResult]

# The preamble of the system prompt in SFT demonstrations and RL episodes alike (the
# tool descriptions follow it): the policy sees the same words in both.
DEFAULT_SYSTEM_PROMPT = (
    "You are a coding agent working in a repository at /workspace. Use the tools to read "
    "and search files, edit them and run commands. Check your change before you submit; "
    "call submit when the task is done."
)


def system_message(system: str, tools: Iterable[ToolSpec], style: str = "json") -> str:
    """The system turn's text: the preamble, then the tools in ``style``."""
    return f"{system}\n\n{tools_prompt(tools, style)}"


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one model turn did: the parse, each call's observation, whether the episode ended."""

    parsed: ParsedTurn
    results: tuple[ToolResult, ...]
    done: bool


class AgentEpisode:
    """A conversation with tools, rendered token by token into a ``Trajectory``.

    Args:
      chat: the chat format (tokenizer).
      tools: the tool specs offered (shown in the system prompt, used by the parser).
      execute: runs one parsed call (choice 1).
      system: the system prompt's preamble; the tool descriptions are appended.
      task: the user's task statement.
      max_turns: stop after this many assistant turns (None: no limit).
      tools_style: how the system prompt lists the tools (``protocol.tools_prompt``).
    """

    def __init__(
        self,
        chat: ChatFormat,
        tools: Iterable[ToolSpec],
        execute: Executor,
        *,
        system: str,
        task: str,
        max_turns: int | None = None,
        tools_style: str = "json",
    ):
        self.chat = chat
        self.tools = {spec.name: spec for spec in tools}
        self.execute = execute
        self.max_turns = max_turns
        self.system = system
        self.task = task
        self.tools_style = tools_style
        self.trajectory = Trajectory()
        self.turns = 0
        self.submitted = False
        self.done = False
        self._start_window()

    def _start_window(self) -> None:
        chat, traj = self.chat, self.trajectory
        chat.start_segment(traj)
        prompt = system_message(self.system, self.tools.values(), self.tools_style)
        chat.append_message(traj, Message("system", prompt))
        chat.append_message(traj, Message("user", self.task))

    def _open_turn(self) -> None:
        if not self.trajectory.turn_open:
            self.chat.append_assistant_header(self.trajectory)

    def prompt(self) -> list[int]:
        """Token ids to sample the next assistant turn from (the current segment)."""
        self._open_turn()
        return self.trajectory.current_context()

    def add_user_message(self, text: str) -> None:
        """Inserts a user turn before the next assistant turn (choice 4)."""
        if self.trajectory.turn_open:
            raise ValueError("an assistant turn is open: add user messages between turns")
        self.chat.append_message(self.trajectory, Message("user", text))

    def record(self, tokens: Sequence[int], logprobs: Sequence[float] | None = None) -> str:
        """Records a sampled turn without parsing or running it; returns its text.

        For turns that are not actions, such as a self-summary: they are trained like
        any model output but are not tool calls and do not count toward ``max_turns``.
        """
        self._open_turn()
        stops = set(self.chat.stop_token_ids)
        self.chat.append_sampled(self.trajectory, tokens, logprobs)
        return self.chat.tokenizer.decode([t for t in tokens if t not in stops]).strip()

    def restart_from_summary(self, summary: str) -> None:
        """Starts a new context window: [system, task, the summary as untrained context]."""
        if self.trajectory.turn_open:
            raise ValueError("an assistant turn is open: restart between turns")
        self._start_window()
        self.chat.append_message(
            self.trajectory, Message("assistant", summary=summary, trainable=False)
        )

    def step(self, tokens: Sequence[int], logprobs: Sequence[float] | None = None) -> StepResult:
        """Takes one sampled assistant turn: records it, runs its calls, appends the results.

        Args:
          tokens: the sampler's output for this turn.
          logprobs: the sampler's log-prob per token (None when unknown).

        Returns:
          The parsed turn, the observations in call order and whether the episode ended.
        """
        if self.done:
            raise ValueError("the episode is over")
        self._open_turn()
        self.chat.append_sampled(self.trajectory, tokens, logprobs)
        self.turns += 1
        parsed = self.chat.parse(tokens, self.tools)
        results = []
        for call in parsed.calls:
            if self.submitted:
                result = ToolResult("Not run: the task was already submitted.", ok=False)
            else:
                result = self.execute(call)
                self.submitted = result.submitted
            results.append(result)
            self.chat.append_message(self.trajectory, Message("tool", result.text))
        limit_reached = self.max_turns is not None and self.turns >= self.max_turns
        self.done = self.submitted or not parsed.calls or limit_reached
        return StepResult(parsed, tuple(results), self.done)
