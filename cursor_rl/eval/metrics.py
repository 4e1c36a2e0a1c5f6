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
7. **Confidence intervals resample tasks** (``bootstrap_ci``): the benchmark's tasks
   are the sample the uncertainty comes from, so each bootstrap replicate draws as
   many tasks as there are, with replacement, and averages their per-task values
   (pass@1 of a task: the fraction of its samples that passed); the interval is the
   replicates' central ``level`` percentile range. Every metric of a summary is
   resampled with the same seed, hence the same task draws, and the generator is
   seeded, so a summary is a pure function of its episodes. Only the ``overall``
   group carries intervals (``"ci"``); categories hold too few tasks for them.
8. **Checkpoints are compared on the same tasks** (``paired_difference``): the
   difference of two checkpoints' pass@1 is the mean over the tasks both scored of
   the per-task differences, and its interval resamples those tasks (one draw picks
   a task for both checkpoints), so the variation between tasks, which both share,
   cancels: a paired interval is much narrower than two overlapping unpaired ones.
   The two checkpoints *separate* when the interval excludes 0. Per-task pass@1
   comes from the evals' kept episodes (``task_pass_rates``: the fraction of a
   task's scored samples that resolved it, lost ones left out as in choice 4).

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
CI_LEVEL = 0.95
CI_RESAMPLES = 1000
CI_SEED = 0


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


def bootstrap_ci(
    values: Sequence[float],
    *,
    resamples: int = CI_RESAMPLES,
    level: float = CI_LEVEL,
    seed: int = CI_SEED,
) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of the mean of per-task values (choice 7).

    Args:
      values: one value per task (e.g. its pass@1).
      resamples: bootstrap replicates; each draws ``len(values)`` tasks with
        replacement.
      level: the interval's coverage, in (0, 1).
      seed: the NumPy generator's seed (equal seeds give equal intervals).

    Returns:
      ``(low, high)``, the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of
      the replicate means; None when there are no values.
    """
    if not 0 < level < 1:
        raise ValueError(f"confidence level {level} must be in (0, 1)")
    if resamples < 1:
        raise ValueError(f"resamples={resamples} must be at least 1")
    data = np.asarray(list(values), dtype=np.float64)
    if data.size == 0:
        return None
    draws = np.random.default_rng(seed).integers(0, data.size, size=(resamples, data.size))
    means = data[draws].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def task_pass_rates(episodes: Iterable[Any]) -> dict[str, float]:
    """Per-task pass@1: the fraction of each task's scored samples that resolved it.

    Args:
      episodes: ``Episode``s, or the episode lines of ``eval/<bench>/results.jsonl``
        as dicts (``task_id``, ``finish_reason``, ``resolved``).

    Returns:
      ``{task_id: pass@1}`` for every task with at least one scored sample.
    """
    counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for episode in episodes:
        if isinstance(episode, dict):
            task, reason, resolved = (
                episode.get("task_id"),
                episode.get("finish_reason"),
                episode.get("resolved"),
            )
        else:
            task, reason, resolved = episode.task_id, episode.finish_reason, episode.resolved
        if reason == LOST:
            continue
        tally = counts[str(task)]
        tally[0] += bool(resolved)
        tally[1] += 1
    return {task: solved / total for task, (solved, total) in counts.items()}


def paired_difference(
    before: dict[str, float],
    after: dict[str, float],
    *,
    resamples: int = CI_RESAMPLES,
    level: float = CI_LEVEL,
    seed: int = CI_SEED,
) -> dict[str, Any] | None:
    """``after - before`` of a per-task metric over the tasks both have (choice 8).

    Args:
      before, after: ``{task_id: value}`` of two checkpoints (``task_pass_rates``).
      resamples, level, seed: as for ``bootstrap_ci`` (the paired bootstrap is the
        bootstrap of the per-task differences).

    Returns:
      ``{"tasks": n, "before": mean, "after": mean, "difference": mean of the
      per-task differences, "ci": (low, high), "separated": the interval excludes
      0}``, the means over the shared tasks; None when no task is shared.
    """
    shared = sorted(set(before) & set(after))
    if not shared:
        return None
    diffs = [after[t] - before[t] for t in shared]
    low, high = bootstrap_ci(diffs, resamples=resamples, level=level, seed=seed)
    return {
        "tasks": len(shared),
        "before": float(np.mean([before[t] for t in shared])),
        "after": float(np.mean([after[t] for t in shared])),
        "difference": float(np.mean(diffs)),
        "ci": (low, high),
        "separated": low > 0 or high < 0,
    }


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
    episodes: Iterable[Any],
    k_values: Sequence[int],
    *,
    partial_credit: bool = False,
    ci_level: float = CI_LEVEL,
    ci_resamples: int = CI_RESAMPLES,
    ci_seed: int = CI_SEED,
) -> dict[str, Any]:
    """Benchmark metrics over graded episodes, several samples per task.

    Args:
      episodes: graded ``Episode``s (``cursor_rl.rl.rollout``); samples of a task
        share its ``task_id``.
      k_values: the ``k`` of pass@k and best-of-k (1 is always added); those above
        the fewest scored samples of any task are dropped (choice 5).
      partial_credit: passed to ``episodes.task_reward`` for best-of-k.
      ci_level, ci_resamples, ci_seed: the bootstrap intervals' settings
        (``bootstrap_ci``).

    Returns:
      ``{"k_values": [...], "samples_per_task": n_min, "ci_level": level,
      "overall": group, "categories": {category: group}}``, where a group is
      ``{"tasks", "episodes", "lost", "pass@1", "pass@K"..., "best_of_K"...,
      "task_reward", "generated_tokens", "tool_calls", "segments",
      "finish_reasons": {reason: count}}`` with one ``pass@K`` and ``best_of_K``
      per kept ``K``; ``overall`` also holds ``"ci": {metric: (low, high)}`` for
      ``pass@1`` and every ``pass@K`` and ``best_of_K`` (empty with no scored task).
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
    overall, per_task = _group_metrics(list(by_task.values()), kept, partial_credit)
    overall["ci"] = {
        key: bootstrap_ci(values, resamples=ci_resamples, level=ci_level, seed=ci_seed)
        for key, values in per_task.items()
        if values
    }
    return {
        "k_values": kept,
        "samples_per_task": fewest,
        "ci_level": ci_level,
        "overall": overall,
        "categories": {
            name: _group_metrics(groups, kept, partial_credit)[0]
            for name, groups in sorted(categories.items())
        },
    }


def _group_metrics(
    tasks: list[list[Any]], k_values: list[int], partial_credit: bool
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """The metrics of one set of tasks (choice 3: per task, then the mean over tasks),
    and the per-task values they average (``{"pass@K" | "best_of_K": [...]}``)."""
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
    per_task: dict[str, list[float]] = {}
    for k in k_values:
        per_task[f"pass@{k}"] = [
            pass_at_k(len(group), sum(e.resolved for e in group), k) for group in scored_tasks
        ]
        per_task[f"best_of_{k}"] = [best_of_k(rewards, k) for rewards in per_task_rewards]
    for key, values in per_task.items():
        out[key] = _mean(values)
    out["task_reward"] = _mean(float(np.mean(rewards)) for rewards in per_task_rewards)
    for key in ("generated_tokens", "tool_calls", "segments"):
        out[key] = _mean(float(getattr(e, key)) for e in scored)
    out["finish_reasons"] = dict(
        sorted(collections.Counter(e.finish_reason for e in every).items())
    )
    return out, per_task


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return float(np.mean(values)) if values else None
