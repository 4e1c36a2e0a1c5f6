"""pass@k and best-of-k against brute-force enumeration; bootstrap intervals against
known cases; summaries over fake episodes."""

import itertools
import math

import numpy as np
import pytest

from cursor_rl.eval import metrics
from cursor_rl.eval.testing import graded_episode


def _brute_pass_at_k(outcomes, k):
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def _brute_best_of_k(rewards, k):
    subsets = list(itertools.combinations(rewards, k))
    return sum(max(s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                assert metrics.pass_at_k(n, c, k) == pytest.approx(
                    _brute_pass_at_k(outcomes, k), abs=1e-12
                ), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    # C(1000, 500) overflows a float; the product form stays exact to rounding.
    n, c, k = 1000, 3, 500
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert metrics.pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    assert metrics.pass_at_k(200, 0, 100) == 0.0
    assert metrics.pass_at_k(200, 101, 100) == 1.0


def test_best_of_k_matches_enumeration_with_ties():
    rng = np.random.default_rng(0)
    for n in range(1, 8):
        for _ in range(5):
            rewards = list(rng.choice([0.0, 0.25, 0.5, 1.0], size=n))
            for k in range(1, n + 1):
                assert metrics.best_of_k(rewards, k) == pytest.approx(
                    _brute_best_of_k(rewards, k), abs=1e-12
                ), (rewards, k)


def test_best_of_k_equals_pass_at_k_for_binary_rewards():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    for k in range(1, 7):
        assert metrics.best_of_k(rewards, k) == pytest.approx(metrics.pass_at_k(6, 2, k))


@pytest.mark.parametrize("n,k", [(4, 0), (4, 5), (0, 1)])
def test_invalid_k(n, k):
    with pytest.raises(ValueError, match="k="):
        metrics.pass_at_k(n, 0, k)


def test_default_k_values():
    assert metrics.default_k_values(1) == (1,)
    assert metrics.default_k_values(8) == (1, 2, 4, 8)
    assert metrics.default_k_values(6) == (1, 2, 4, 6)


def test_bootstrap_ci_degenerate_cases():
    # Every task passes (or none does): every replicate mean is the same, so is the CI.
    assert metrics.bootstrap_ci([1.0] * 32) == (1.0, 1.0)
    assert metrics.bootstrap_ci([0.0] * 32) == (0.0, 0.0)
    assert metrics.bootstrap_ci([0.25]) == (0.25, 0.25)  # one task: nothing to resample
    assert metrics.bootstrap_ci([]) is None


def test_bootstrap_ci_matches_the_binomial_quantiles():
    """Ten tasks, five passing: a replicate's mean is Binomial(10, 1/2) / 10, whose
    2.5% and 97.5% quantiles are 2/10 and 8/10 (P(X <= 1) = 0.011 < 0.025 < P(X <= 2)
    = 0.055). With 20000 replicates the empirical quantiles land on them."""
    cdf = np.cumsum([math.comb(10, i) / 2**10 for i in range(11)])
    low = int(np.searchsorted(cdf, 0.025)) / 10
    high = int(np.searchsorted(cdf, 0.975)) / 10
    assert (low, high) == (0.2, 0.8)
    values = [1.0] * 5 + [0.0] * 5
    assert metrics.bootstrap_ci(values, resamples=20000, seed=3) == pytest.approx((low, high))


def test_bootstrap_ci_is_seeded_and_nested():
    values = list(np.random.default_rng(0).random(40))
    first = metrics.bootstrap_ci(values, seed=5)
    assert metrics.bootstrap_ci(values, seed=5) == first  # same seed, same interval
    assert metrics.bootstrap_ci(values, seed=6) != first  # the draws depend on the seed
    low, high = first
    assert low < float(np.mean(values)) < high
    narrow = metrics.bootstrap_ci(values, seed=5, level=0.5)
    assert low < narrow[0] < narrow[1] < high  # same draws: the 50% range sits inside


@pytest.mark.parametrize(
    "kwargs,match",
    [({"level": 1.0}, "level"), ({"level": 0.0}, "level"), ({"resamples": 0}, "resamples")],
)
def test_bootstrap_ci_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        metrics.bootstrap_ci([0.5, 1.0], **kwargs)


def _bench():
    """Three tasks, four samples each: per-task outcomes chosen to differ."""
    plan = {
        ("b1", "bug"): [True, False, False, False],
        ("b2", "bug"): [False, False, False, False],
        ("f1", "feature"): [True, True, False, True],
    }
    episodes = []
    for (task_id, category), outcomes in plan.items():
        for i, ok in enumerate(outcomes):
            episodes.append(
                graded_episode(
                    task_id,
                    category,
                    ok,
                    sample=i,
                    fail_to_pass=(2 if ok else i % 2, 2),
                    tokens=100 * (i + 1),
                    calls=i,
                    segments=1 + (i == 3),
                    finish="submitted" if ok else "turn_limit",
                )
            )
    return plan, episodes


def test_summarize_against_enumeration():
    plan, episodes = _bench()
    summary = metrics.summarize(episodes, k_values=(2, 4, 8))
    assert summary["k_values"] == [1, 2, 4]  # 8 > four samples per task: dropped
    assert summary["samples_per_task"] == 4
    overall = summary["overall"]
    for k in (1, 2, 4):
        expected = np.mean([_brute_pass_at_k(o, k) for o in plan.values()])
        assert overall[f"pass@{k}"] == pytest.approx(expected)
        assert overall[f"best_of_{k}"] == pytest.approx(expected)  # no partial credit
    assert overall["pass@1"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    bug = summary["categories"]["bug"]
    assert bug["tasks"] == 2 and bug["episodes"] == 8
    assert bug["pass@4"] == pytest.approx(0.5)
    assert summary["categories"]["feature"]["pass@2"] == pytest.approx(1.0)
    assert overall["generated_tokens"] == pytest.approx(250.0)
    assert overall["tool_calls"] == pytest.approx(1.5)
    assert overall["segments"] == pytest.approx(1.25)
    assert overall["finish_reasons"] == {"submitted": 4, "turn_limit": 8}


def test_summarize_carries_intervals_over_tasks():
    plan, episodes = _bench()
    summary = metrics.summarize(episodes, k_values=(2, 4), ci_seed=11)
    ci = summary["overall"]["ci"]
    assert summary["ci_level"] == 0.95
    assert sorted(ci) == ["best_of_1", "best_of_2", "best_of_4", "pass@1", "pass@2", "pass@4"]
    # pass@1 of a task is the fraction of its samples that passed.
    per_task = [sum(o) / len(o) for o in plan.values()]
    assert ci["pass@1"] == metrics.bootstrap_ci(per_task, seed=11)
    per_task_4 = [float(any(o)) for o in plan.values()]
    assert ci["pass@4"] == metrics.bootstrap_ci(per_task_4, seed=11)
    for key, (low, high) in ci.items():
        assert low <= summary["overall"][key] <= high, key
    assert all("ci" not in group for group in summary["categories"].values())


def test_summarize_partial_credit_best_of_k():
    _, episodes = _bench()
    summary = metrics.summarize(episodes, k_values=(2,), partial_credit=True)
    b2_rewards = [0.0, 0.5, 0.0, 0.5]  # unresolved: f2p passed i % 2 of 2
    b1_rewards = [1.0, 0.5, 0.0, 0.5]
    expected = np.mean(
        [_brute_best_of_k(r, 2) for r in (b1_rewards, b2_rewards, [1.0, 1.0, 0.0, 1.0])]
    )
    assert summary["overall"]["best_of_2"] == pytest.approx(expected)
    # pass@k counts only resolved episodes.
    assert summary["overall"]["pass@2"] == metrics.summarize(episodes, (2,))["overall"]["pass@2"]


def test_lost_episodes_are_not_scored():
    episodes = [graded_episode("t1", "bug", i == 0, sample=i) for i in range(4)]
    episodes += [graded_episode("t2", "bug", True, sample=i) for i in range(3)]
    episodes.append(graded_episode("t2", "bug", False, sample=3, finish="lost"))
    episodes.append(graded_episode("t3", "refactor", False, finish="lost"))
    summary = metrics.summarize(episodes, k_values=(4,))
    overall = summary["overall"]
    assert summary["k_values"] == [1]  # t2 has three scored samples
    assert overall["tasks"] == 2 and overall["episodes"] == 7 and overall["lost"] == 2
    assert overall["pass@1"] == pytest.approx((1 / 4 + 1) / 2)
    assert overall["finish_reasons"]["lost"] == 2
    refactor = summary["categories"]["refactor"]
    assert refactor["tasks"] == 0 and refactor["pass@1"] is None


def test_summarize_empty():
    summary = metrics.summarize([], k_values=(1, 8))
    assert summary["k_values"] == []
    assert summary["overall"]["tasks"] == 0
    assert summary["overall"]["ci"] == {}
    assert summary["categories"] == {}
