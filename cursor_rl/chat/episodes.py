"""Graded episodes: what a rollout returns, and what rewards, metrics and reports read.

``Episode`` is one agent episode after grading: its token trajectory, how it ended,
its lengths and the JSON-friendly part of the grade. ``EpisodeOutcome`` is the part
a reward needs, and ``task_reward`` the task's own score, which the RL reward
(``cursor_rl.rl.rewards``) builds on and evaluation (``cursor_rl.eval``) reports.

They live here, below both ``rl`` (which produces episodes) and ``eval`` (which
scores them), so that neither has to import the other for a record type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cursor_rl.chat import protocol


@dataclasses.dataclass(frozen=True)
class EpisodeOutcome:
    """What the reward needs from one graded episode."""

    resolved: bool  # every FAIL_TO_PASS and PASS_TO_PASS test passes
    fail_to_pass_passed: int = 0
    fail_to_pass_total: int = 0
    pass_to_pass_broken: int = 0
    generated_tokens: int = 0
    tool_calls: int = 0


def task_reward(outcome: EpisodeOutcome, partial_credit: bool) -> float:
    """1 if the task is resolved; with ``partial_credit`` the fraction of FAIL_TO_PASS
    tests passing (only when no PASS_TO_PASS test broke); else 0."""
    if outcome.resolved:
        return 1.0
    if partial_credit and outcome.fail_to_pass_total and not outcome.pass_to_pass_broken:
        return outcome.fail_to_pass_passed / outcome.fail_to_pass_total
    return 0.0


@dataclasses.dataclass
class Episode:
    """One graded episode: its trajectory and everything the reward and metrics need."""

    task_id: str
    category: str
    task_index: int  # the task's position in the batch (its group)
    sample: int  # index within the group
    trajectory: protocol.Trajectory
    finish_reason: str  # submitted | answered | turn_limit | token_budget | context | lost
    tool_calls: int = 0
    generated_tokens: int = 0
    turn_versions: list[int] = dataclasses.field(default_factory=list)
    summary_tokens: list[int] = dataclasses.field(default_factory=list)
    grade: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def segments(self) -> int:
        return len(self.trajectory.segment_starts)

    @property
    def resolved(self) -> bool:
        return bool(self.grade.get("resolved", False))

    def outcome(self) -> EpisodeOutcome:
        return EpisodeOutcome(
            resolved=self.resolved,
            fail_to_pass_passed=int(self.grade.get("fail_to_pass_passed", 0)),
            fail_to_pass_total=int(self.grade.get("fail_to_pass_total", 0)),
            pass_to_pass_broken=int(self.grade.get("pass_to_pass_broken", 0)),
            generated_tokens=self.generated_tokens,
            tool_calls=self.tool_calls,
        )

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["trajectory"] = self.trajectory.to_json_dict()
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Episode:
        data = dict(data)
        data["trajectory"] = protocol.Trajectory.from_json_dict(data["trajectory"])
        return cls(**data)
