"""GRPO math against NumPy references, zero gradient on masked tokens, and the rewards."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cursor_rl import config_lib, model
from cursor_rl.chat import episodes
from cursor_rl.rl import grpo, rewards
from cursor_rl.train import optimizer, step
from tests.train_helpers import MICRO_MODEL


def test_group_advantages_match_formulas():
    r = [1.0, 0.0, 0.0, 1.0, 1.0]
    mean = np.mean(r)
    np.testing.assert_allclose(grpo.group_advantages(r, False), np.array(r) - mean)
    np.testing.assert_allclose(
        grpo.group_advantages(r, True), (np.array(r) - mean) / (np.std(r) + 1e-6)
    )
    assert grpo.has_signal(r) and not grpo.has_signal([0.5, 0.5, 0.5])


def test_token_weights_aggregate_as_documented():
    mask = np.array([[0, 1, 1, 1, 0, 1], [1, 1, 0, 0, 0, 0]])
    ids = np.array([[1, 1, 1, 1, 2, 2], [3, 3, 3, 3, 3, 3]])
    w = grpo.token_weights(mask, ids, "token_mean")
    np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(w[mask == 1], 1 / 6, rtol=1e-6)
    w = grpo.token_weights(mask, ids, "sequence_mean")
    # Three sequences with 3, 1 and 2 model tokens: each sums to 1/3.
    np.testing.assert_allclose(w[0, 1:4].sum(), 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(w[0, 5], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(w[1, :2].sum(), 1 / 3, rtol=1e-6)
    assert (w[mask == 0] == 0).all()


def _random_batch(rng, b=4, t=9):
    old = rng.normal(-2.0, 0.5, (b, t)).astype(np.float32)
    mask = (rng.random((b, t)) > 0.3).astype(np.int32)
    return {
        "advantages": np.repeat(rng.normal(0, 1, (b, 1)), t, axis=1).astype(np.float32),
        "token_weight": grpo.token_weights(mask, np.arange(b)[:, None] + 0 * mask, "token_mean"),
        "old_logprobs": old,
        "sampler_logprobs": (old + rng.normal(0, 0.3, (b, t))).astype(np.float32),
        "ref_logprobs": (old + rng.normal(0, 0.2, (b, t))).astype(np.float32),
    }


def _numpy_loss(logp, batch, cfg):
    ratio = np.exp(logp - batch["old_logprobs"])
    adv = batch["advantages"]
    surrogate = np.minimum(ratio * adv, np.clip(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    tis = np.minimum(np.exp(batch["old_logprobs"] - batch["sampler_logprobs"]), cfg.tis_cap)
    delta = batch["ref_logprobs"] - logp
    kl = np.exp(delta) - delta - 1
    return float((batch["token_weight"] * (-tis * surrogate + cfg.kl_coef * kl)).sum())


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_policy_loss_matches_numpy_reference(kl_coef):
    rng = np.random.default_rng(0)
    batch = _random_batch(rng)
    # Current log-probs far enough from old ones that both clip bounds bite.
    logp = batch["old_logprobs"] + rng.normal(0, 0.4, batch["old_logprobs"].shape)
    cfg = grpo.GRPOConfig(kl_coef=kl_coef)
    loss, diag = grpo.policy_loss(jnp.asarray(logp, jnp.float32), batch, cfg)
    np.testing.assert_allclose(float(loss), _numpy_loss(logp, batch, cfg), rtol=1e-5)
    ratio = np.exp(logp - batch["old_logprobs"])
    clipped = (ratio < 0.8) | (ratio > 1.28)
    np.testing.assert_allclose(
        float(diag["clip_fraction"]), (clipped * batch["token_weight"]).sum(), rtol=1e-5
    )
    assert 0 < float(diag["clip_fraction"]) < 1
    # The gradient w.r.t. log-probs equals the NumPy finite difference.
    grad = jax.grad(lambda x: grpo.policy_loss(x, batch, cfg)[0])(jnp.asarray(logp, jnp.float32))
    i, j = np.argwhere(batch["token_weight"] > 0)[0]
    bumped = logp.copy()
    bumped[i, j] += 1e-3
    numeric = (_numpy_loss(bumped, batch, cfg) - _numpy_loss(logp, batch, cfg)) / 1e-3
    np.testing.assert_allclose(float(grad[i, j]), numeric, rtol=2e-2, atol=1e-5)
    # Masked tokens: exactly zero gradient.
    assert (np.asarray(grad)[batch["token_weight"] == 0] == 0).all()


def _rl_batch(b=8, t=12, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, MICRO_MODEL.vocab_size, (b, t + 1)).astype(np.int32)
    mask = np.zeros((b, t), np.int32)
    mask[:, t // 2 :] = 1  # the second half are "model tokens"
    batch = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "loss_mask": mask,
        "segment_ids": np.ones((b, t), np.int32),
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        "advantages": np.repeat(rng.normal(0, 1, (b, 1)), t, axis=1).astype(np.float32),
        "token_weight": grpo.token_weights(
            mask, np.arange(b)[:, None] * np.ones((1, t)), "token_mean"
        ),
        "ref_logprobs": np.zeros((b, t), np.float32),
    }
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _setup(microbatches=1, **optimizer_overrides):
    opt = config_lib.base_config().optimizer
    opt.warmup_steps = 0
    for key, value in optimizer_overrides.items():
        opt[key] = value
    tx = optimizer.make_optimizer(opt, 10)
    variables = model.init(MICRO_MODEL, jax.random.key(0))
    state = step.init_state(variables, tx)
    logprobs = jax.jit(functools.partial(grpo.logprobs_step, config=MICRO_MODEL))
    fn = jax.jit(
        functools.partial(
            grpo.grpo_step,
            config=MICRO_MODEL,
            grpo=grpo.GRPOConfig(),
            tx=tx,
            schedule=optimizer.make_schedule(opt, 10),
            microbatches=microbatches,
        )
    )
    return state, logprobs, fn


@pytest.mark.slow
def test_grpo_step_on_policy_and_masked_tokens_have_no_effect():
    state, logprobs, fn = _setup()
    batch = _rl_batch()
    old = logprobs(state.variables, batch)
    batch = {**batch, "old_logprobs": old, "sampler_logprobs": old}
    new, metrics = fn(state, batch)
    # On-policy: ratio 1, nothing clipped, sampler and trainer agree.
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0, abs=1e-6)
    assert float(metrics["clip_fraction"]) == 0.0
    assert float(metrics["sampler_logprob_gap"]) == 0.0
    assert float(metrics["entropy"]) > 0
    # Changing everything the mask hides (targets and advantages of masked tokens,
    # sampler log-probs there) leaves the update bit-identical.
    hidden = batch["loss_mask"] == 0
    other = dict(batch)
    other["targets"] = jnp.where(
        hidden, (batch["targets"] + 5) % MICRO_MODEL.vocab_size, batch["targets"]
    )
    other["advantages"] = jnp.where(hidden, 100.0, batch["advantages"])
    other["sampler_logprobs"] = jnp.where(hidden, -50.0, batch["sampler_logprobs"])
    new2, _ = fn(state, other)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(new2.params)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_grpo_microbatches_equal_one_batch():
    # Adam's eps at 1 keeps its update about linear in the gradient: with the default
    # 1e-8, a weight whose gradient is rounding noise gets an update of about +-lr
    # whatever its size, so a 1e-10 difference in the summed gradient moved one weight
    # by 1.7e-5 of the 3e-3 rate. The claim here is the gradient accumulation.
    state, logprobs, one = _setup(eps=1.0)
    _, _, four = _setup(microbatches=4, eps=1.0)
    batch = _rl_batch(seed=3)
    old = logprobs(state.variables, batch)
    batch = {**batch, "old_logprobs": old, "sampler_logprobs": old - 0.1}
    s1, m1 = one(state, batch)
    s4, m4 = four(state, batch)
    np.testing.assert_allclose(m4["policy_loss"], m1["policy_loss"], rtol=1e-5, atol=1e-7)
    moved = 0.0
    for a, b, start in zip(
        jax.tree.leaves(s1.params), jax.tree.leaves(s4.params), jax.tree.leaves(state.params)
    ):
        np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5)
        moved = max(moved, float(np.abs(np.asarray(a) - np.asarray(start)).max()))
    assert moved > 1e-5  # the step did move the weights (the comparison is not vacuous)


@pytest.mark.slow
def test_positive_advantage_raises_the_episode_likelihood():
    state, logprobs, fn = _setup()
    batch = _rl_batch(seed=5)
    batch["advantages"] = jnp.ones_like(batch["advantages"])
    old = logprobs(state.variables, batch)
    batch = {**batch, "old_logprobs": old, "sampler_logprobs": old}
    new, _ = fn(state, batch)
    after = logprobs(new.variables, batch)
    mask = np.asarray(batch["loss_mask"]) > 0
    assert float(np.asarray(after)[mask].mean()) > float(np.asarray(old)[mask].mean())


# ---- rewards ----------------------------------------------------------------------


def _outcome(resolved, tokens, calls=2):
    return episodes.EpisodeOutcome(resolved=resolved, generated_tokens=tokens, tool_calls=calls)


def test_easy_task_prefers_the_shorter_correct_episode():
    config = rewards.RewardConfig()
    group = [_outcome(True, 300), _outcome(True, 2500), _outcome(True, 1000), _outcome(False, 900)]
    r = rewards.group_rewards(group, config)
    assert r[0] > r[2] > r[1] > r[3]
    assert r[0] <= 1.0


def test_hard_unsolved_task_does_not_punish_length():
    config = rewards.RewardConfig()
    r = rewards.group_rewards([_outcome(False, 200), _outcome(False, 4000, 16)], config)
    assert r == [0.0, 0.0]


def test_penalty_is_convex_in_effort():
    config = rewards.RewardConfig(token_weight=1.0)
    r = [rewards.group_rewards([_outcome(True, n)], config)[0] for n in (0, 1024, 2048, 3072)]
    drops = np.diff(r)
    assert (drops < 0).all() and drops[1] < drops[0] and drops[2] < drops[1]


def test_partial_credit_and_registry():
    outcome = episodes.EpisodeOutcome(resolved=False, fail_to_pass_passed=1, fail_to_pass_total=4)
    assert episodes.task_reward(outcome, partial_credit=True) == 0.25
    assert episodes.task_reward(outcome, partial_credit=False) == 0.0
    assert {"composer", "task"} <= set(rewards.REWARDS)
    assert rewards.group_rewards([_outcome(True, 4000)], rewards.RewardConfig(name="task")) == [1.0]
    with pytest.raises(ValueError, match=r"rl\.reward\.name"):
        rewards.RewardConfig.from_mapping({"name": "nope"})
    with pytest.raises(ValueError, match="unknown"):
        rewards.RewardConfig.from_mapping({"lenght_penalty": 1.0})


@pytest.mark.parametrize("temperature", [pytest.param(1.0, marks=pytest.mark.slow), 0.5])
def test_logprobs_score_the_tempered_distribution(temperature):
    # What a sampler at this temperature reports: log softmax(logits / T) of the target.
    variables = model.init(MICRO_MODEL, jax.random.key(0))
    batch = _rl_batch()
    logits = model.forward(
        MICRO_MODEL,
        variables,
        batch["tokens"],
        positions=batch["positions"],
        segment_ids=batch["segment_ids"],
    )
    expected = jnp.take_along_axis(
        jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, -1),
        batch["targets"][..., None],
        -1,
    )[..., 0]
    got = grpo.logprobs_step(variables, batch, config=MICRO_MODEL, temperature=temperature)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    if temperature != 1.0:  # and it is not the untempered one
        untempered = grpo.logprobs_step(variables, batch, config=MICRO_MODEL)
        assert float(jnp.abs(untempered - got).max()) > 1e-2


def test_greedy_is_not_a_trainable_temperature():
    variables = model.init(MICRO_MODEL, jax.random.key(0))
    with pytest.raises(ValueError, match="temperature=0"):
        grpo.logprobs_step(variables, _rl_batch(), config=MICRO_MODEL, temperature=0.0)
