"""Benchmark metrics over graded episodes: pass@1, unbiased pass@k, best-of-k, lengths.

    summary = summarize(episodes, k_values=(1, 4, 8))
    summary["overall"]["pass@8"], summary["categories"]["bug"]["best_of_8"]

Choices:

1. **pass@k is the unbiased estimator** of Chen et al. 2021 (eq. 1): with ``n``
   samples of a task of which ``c`` are resolved, ``1 - C(n-c, k) / C(n, k)``, the
   chance that a random ``k``-subset holds a success. It is computed as the product
   ``prod_{i=n-c+1}^{n} (1 - k/i)`` (their NumPy form), never as a ratio of huge
   binomials, so it stays exact in floating point for any ``n``.
2. **best_of_k is the same expectation for a real-valued reward**: the mean over
   ``k``-subsets of the largest task reward (``episodes.task_reward``, so partial
   credit counts when enabled). With the rewards sorted ascending, the ``i``-th
   smallest (1-based) is a subset's maximum in ``C(i-1, k-1)`` of the ``C(n, k)``
   subsets, so ``best_of_k = sum_i r_(i) C(i-1, k-1) / C(n, k)``: unbiased, no
   sampling noise, and equal to pass@k when rewards are 0/1. Ties do not change the
   value (tied rewards are interchangeable in the sum).
3. **Tasks weigh equally.** A metric is computed per task and then averaged over
   tasks (overall, and within each ``Episode.category``); pass@1 is then the mean
   success over samples, per task first.
4. **Lost episodes are not scored.** A ``lost`` episode (its sandbox worker died)
   says nothing about the policy, so it is left out of every metric and counted in
   ``lost``; a task left with no scored sample is dropped from the metrics.
5. **k is bounded by the data.** A ``k`` larger than the fewest scored samples of
   any task is dropped from the summary (``k_values`` lists the ones kept) rather
   than averaged over the subset of tasks that happen to have enough samples.
6. **Lengths are means per scored episode**: generated tokens, tool calls,
   segments (context windows, > 1 after self-summarisation); finish reasons are
   counts over all episodes, lost ones included.

Pure Python and NumPy; no JAX. Episodes are read by attribute only (``task_id``,
``category``, ``finish_reason``, ``outcome()``, ``generated_tokens``,
``tool_calls``, ``segments``), so ``cursor_rl.chat.episodes.Episode`` is not imported.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from cursor_rl.chat.episodes import task_reward

LOST = "lost"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task: ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021).

    Args:
      n: samples drawn for the task.
      c: how many of them resolved it.
      k: the budget of attempts, ``1 <= k <= n``.

    Returns:
      The probability that ``k`` samples drawn without replacement from the ``n``
      include a success.
    """
    _check_counts(n, k)
    if not 0 <= c <= n:
        raise ValueError(f"c={c} successes out of n={n} samples")
    if n - c < k:  # every k-subset holds a success
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def best_of_k(rewards: Sequence[float], k: int) -> float:
    """Expected maximum reward over a uniformly random ``k``-subset of ``rewards``.

    Args:
      rewards: one task's rewards, one per sample (``n = len(rewards)``).
      k: subset size, ``1 <= k <= n``.

    Returns:
      ``sum_i r_(i) C(i-1, k-1) / C(n, k)`` over the ascending order statistics
      ``r_(i)`` (choice 2 of the module docstring).
    """
    n = len(rewards)
    _check_counts(n, k)
    ordered = sorted(float(r) for r in rewards)
    total = math.comb(n, k)
    # Python's int / int is correctly rounded however large the binomials get.
    return sum(r * (math.comb(i - 1, k - 1) / total) for i, r in enumerate(ordered, 1) if i >= k)


def _check_counts(n: int, k: int) -> None:
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, n={n}]")


def default_k_values(samples: int) -> tuple[int, ...]:
    """1, the powers of two below ``samples``, and ``samples`` itself."""
    ks = {1, samples}
    k = 2
    while k < samples:
        ks.add(k)
        k *= 2
    return tuple(sorted(ks))


def summarize(
    episodes: Iterable[Any], k_values: Sequence[int], *, partial_credit: bool = False
) -> dict[str, Any]:
    """Benchmark metrics over graded episodes, several samples per task.

    Args:
      episodes: graded ``Episode``s (``cursor_rl.rl.rollout``); samples of a task
        share its ``task_id``.
      k_values: the ``k`` of pass@k and best-of-k (1 is always added); those above
        the fewest scored samples of any task are dropped (choice 5).
      partial_credit: passed to ``episodes.task_reward`` for best-of-k.

    Returns:
      ``{"k_values": [...], "samples_per_task": n_min, "overall": group,
      "categories": {category: group}}``, where a group is ``{"tasks", "episodes",
      "lost", "pass@1", "pass@K"..., "best_of_K"..., "task_reward",
      "generated_tokens", "tool_calls", "segments", "finish_reasons": {reason:
      count}}`` with one ``pass@K`` and ``best_of_K`` per kept ``K``.
    """
    by_task: dict[str, list[Any]] = collections.defaultdict(list)
    for episode in episodes:
        by_task[episode.task_id].append(episode)
    scored_counts = [sum(e.finish_reason != LOST for e in group) for group in by_task.values()]
    fewest = min((n for n in scored_counts if n), default=0)
    kept = sorted({int(k) for k in (1, *k_values) if 1 <= int(k) <= fewest})
    categories: dict[str, list[list[Any]]] = collections.defaultdict(list)
    for group in by_task.values():
        categories[group[0].category].append(group)
    return {
        "k_values": kept,
        "samples_per_task": fewest,
        "overall": _group_metrics(list(by_task.values()), kept, partial_credit),
        "categories": {
            name: _group_metrics(groups, kept, partial_credit)
            for name, groups in sorted(categories.items())
        },
    }


def _group_metrics(
    tasks: list[list[Any]], k_values: list[int], partial_credit: bool
) -> dict[str, Any]:
    """The metrics of one set of tasks (choice 3: per task, then the mean over tasks)."""
    every = [e for group in tasks for e in group]
    scored_tasks = [[e for e in group if e.finish_reason != LOST] for group in tasks]
    scored_tasks = [group for group in scored_tasks if group]
    scored = [e for group in scored_tasks for e in group]
    out: dict[str, Any] = {
        "tasks": len(scored_tasks),
        "episodes": len(scored),
        "lost": len(every) - len(scored),
    }
    per_task_rewards = [
        [task_reward(e.outcome(), partial_credit) for e in group] for group in scored_tasks
    ]
    for k in k_values:
        out[f"pass@{k}"] = _mean(
            pass_at_k(len(group), sum(e.resolved for e in group), k) for group in scored_tasks
        )
        out[f"best_of_{k}"] = _mean(best_of_k(rewards, k) for rewards in per_task_rewards)
    out["task_reward"] = _mean(float(np.mean(rewards)) for rewards in per_task_rewards)
    for key in ("generated_tokens", "tool_calls", "segments"):
        out[key] = _mean(float(getattr(e, key)) for e in scored)
    out["finish_reasons"] = dict(
        sorted(collections.Counter(e.finish_reason for e in every).items())
    )
    return out


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return float(np.mean(values)) if values else None
