"""Episode rewards: task success and a difficulty-aware, convex length penalty.

Registered by name (``REWARDS``) so configs choose one (``rl.reward.name``).

``composer`` (the default) — for episode i of a task's group:

    R_i = r_i - lambda * ease^q * u_i^p

* ``r_i``: task reward from the grader (``cursor_rl.chat.episodes.task_reward``): 1
  if every hidden test passes, else 0; with ``partial_credit`` the fraction of
  FAIL_TO_PASS tests passing (only when no PASS_TO_PASS test broke).
* ``u_i = w_tok * tokens_i / token_budget + w_call * calls_i / max_tool_calls``:
  effort, the model's generated tokens and tool calls, each normalised by its
  budget (``w_tok + w_call = 1``, so ``u`` is about 1 at the budget).
* ``ease`` = the group's mean task reward (its pass rate): how easy the task
  proved for the current policy. An easy task (ease near 1) charges for length,
  so the shorter of two correct episodes scores higher; a hard one that nobody
  solved (ease 0) charges nothing, leaving room for long exploration.
* ``p > 1`` makes the penalty convex: small effort is nearly free, running to the
  budget costs ``lambda`` (times ease^q) — the "nonlinear" penalty that balances
  speed against depth. Defaults: lambda 0.2, p 2, q 1, w_tok 0.7, w_call 0.3.

``task``: just ``r_i`` (no length term), for ablations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cursor_rl.chat.episodes import EpisodeOutcome, task_reward


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    name: str = "composer"
    partial_credit: bool = False
    length_penalty: float = 0.2  # lambda
    power: float = 2.0  # p: convexity of the effort term
    ease_power: float = 1.0  # q
    token_weight: float = 0.7  # w_tok; w_call = 1 - w_tok
    token_budget: int = 4096
    max_tool_calls: int = 16

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RewardConfig:
        values = dict(values)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"rl.reward: unknown field(s) {unknown}; known: {sorted(known)}")
        config = cls(**values)
        if config.name not in REWARDS:
            raise ValueError(f"rl.reward.name={config.name!r}: one of {sorted(REWARDS)}")
        if config.power < 1:
            raise ValueError(f"rl.reward.power={config.power}: must be >= 1 (convex)")
        if not 0 <= config.token_weight <= 1:
            raise ValueError(f"rl.reward.token_weight={config.token_weight}: must be in [0, 1]")
        if config.token_budget <= 0 or config.max_tool_calls <= 0:
            raise ValueError("rl.reward.token_budget and max_tool_calls must be > 0")
        return config


def effort(outcome: EpisodeOutcome, config: RewardConfig) -> float:
    return (
        config.token_weight * outcome.generated_tokens / config.token_budget
        + (1 - config.token_weight) * outcome.tool_calls / config.max_tool_calls
    )


GroupReward = Callable[[Sequence[EpisodeOutcome], RewardConfig], list[float]]
REWARDS: dict[str, GroupReward] = {}


def register(name: str) -> Callable[[GroupReward], GroupReward]:
    def wrap(fn: GroupReward) -> GroupReward:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is registered twice")
        REWARDS[name] = fn
        return fn

    return wrap


@register("task")
def _task_only(group: Sequence[EpisodeOutcome], config: RewardConfig) -> list[float]:
    return [task_reward(o, config.partial_credit) for o in group]


@register("composer")
def _composer(group: Sequence[EpisodeOutcome], config: RewardConfig) -> list[float]:
    base = [task_reward(o, config.partial_credit) for o in group]
    ease = sum(base) / len(base) if base else 0.0
    scale = config.length_penalty * ease**config.ease_power
    return [r - scale * effort(o, config) ** config.power for r, o in zip(base, group)]


def group_rewards(group: Sequence[EpisodeOutcome], config: RewardConfig) -> list[float]:
    """Rewards for one task's group of episodes (the group sets the task's ease)."""
    return REWARDS[config.name](group, config)
