"""MuonClip's QK-clip: heads whose attention logits exceed tau are bounded after the
step, every other weight keeps its bits, and with the option off nothing changes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cursor_rl import config_lib, model, partitioning
from cursor_rl.rl import grpo
from cursor_rl.train import optimizer, step
from tests.train_helpers import MICRO_MODEL

# The trainer tests' micro model with four heads and a query latent (MLA's q_a_norm).
CONFIG = MICRO_MODEL.replace(vocab_size=64, intermediate_size=48, num_heads=4, q_lora_rank=16)
TAU = 2.0
# (layer, head) whose query and key weights are blown up: heads of the last layer (the
# MoE layer; ``attn_max_logit`` lists the dense layer first), so the clip changes no
# other layer's inputs and every recomputed logit can be checked exactly. (Clipping
# an earlier layer changes the inputs of later ones: their bound holds for the inputs
# they had.) The dense stack's clip is checked on the pure function below.
BOOSTED = {(1, 0), (1, 2)}
STACKS = (("dense_layers", 0), ("moe_layers", 1))
B, T = 4, 16


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG.vocab_size, (B, T + 1)).astype(np.int32)
    return {
        "tokens": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "loss_mask": jnp.ones((B, T), jnp.int32),
        "segment_ids": jnp.asarray([[1] * 10 + [2] * 6] * B, jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
    }


@functools.cache
def _fresh_variables():
    return model.init(CONFIG, jax.random.key(0))


def _boosted_variables():
    """Fresh variables with the BOOSTED heads' q and k weights scaled by 40 (logits x 1600)."""
    variables = jax.tree.map(lambda x: x, _fresh_variables())
    dn = CONFIG.qk_nope_head_dim
    params = variables["params"]
    for stack, layer in STACKS:
        attn = params[stack]["layer"]["attn"]
        for head in sorted(h for (at, h) in BOOSTED if at == layer):
            attn["q_b_proj"] = attn["q_b_proj"].at[0, :, head, :].multiply(40.0)
            attn["kv_b_proj"] = attn["kv_b_proj"].at[0, :, head, :dn].multiply(40.0)
    return variables


def _tx(tau):
    # AdamW keeps the compile short; QK-clip acts on the weights after any optimizer
    # (Kimi K2 pairs it with Muon, configs/kimi_k2.py).
    opt = config_lib.base_config().optimizer
    opt.schedule = "constant"
    # A real update in the first step, small enough that the recomputed max logit of a
    # clipped head is tau within 1%.
    opt.warmup_steps = 0
    opt.learning_rate = 1e-6
    opt.qk_clip_tau = tau
    return optimizer.make_optimizer(opt, 10), optimizer.make_schedule(opt, 10)


@jax.jit
def _max_logits(params, router, batch):
    config = CONFIG.replace(report_attn_max_logit=True)
    _, aux = model.forward_with_aux(
        config,
        {"params": params, "router": router},
        batch["tokens"],
        batch["positions"],
        batch["segment_ids"],
    )
    return aux["attn_max_logit"]


@functools.cache
def _step_fn(tau):
    """The jitted train step with QK-clip at ``tau`` (0: off), compiled once per tau."""
    tx, schedule = _tx(tau)
    return tx, jax.jit(functools.partial(step.train_step, config=CONFIG, tx=tx, schedule=schedule))


def _run_step(variables, tau):
    tx, fn = _step_fn(tau)
    return fn(step.init_state(variables, tx), _batch())


@pytest.fixture(scope="module")
def boosted():
    variables = _boosted_variables()
    before = np.asarray(_max_logits(variables["params"], variables["router"], _batch()))
    return variables, before


@pytest.fixture(scope="module")
def clipped_step(boosted):
    return _run_step(boosted[0], TAU)


def _attn(params, stack):
    return params[stack]["layer"]["attn"]


@pytest.mark.slow
def test_heads_over_tau_are_bounded_after_the_step(boosted, clipped_step):
    """The blown-up heads (and only they) exceed tau; the step reports the forward
    pass's max logit and clips those heads; recomputed with the new weights (after a
    small AdamW update too) their max logit is tau, within the update's effect."""
    _, before = boosted
    on, metrics = clipped_step
    assert {tuple(int(i) for i in ix) for ix in np.argwhere(before > TAU)} == BOOSTED, before
    assert int(metrics["qk_clipped_heads"]) == len(BOOSTED)
    np.testing.assert_allclose(metrics["attn_max_logit"], before.max(), rtol=1e-5)
    after = np.asarray(_max_logits(on.params, on.router, _batch()))
    for layer, head in BOOSTED:
        assert TAU * 0.99 <= after[layer, head] <= TAU * 1.01, after
    keep = before <= TAU
    np.testing.assert_allclose(after[keep], before[keep], rtol=1e-3)


@pytest.mark.slow
def test_only_the_clipped_heads_q_and_k_weights_change(boosted, clipped_step):
    """Against the same step with QK-clip off: every other weight, the router bias and
    the optimizer state keep their bits; the clipped heads' nope query and key parts
    are scaled by sqrt(gamma), the query's rope part by gamma, values not at all, so
    each of their logits is gamma times the unclipped one."""
    variables, before = boosted
    on, _ = clipped_step
    off, off_metrics = _run_step(variables, 0.0)
    assert "attn_max_logit" not in off_metrics and "qk_clipped_heads" not in off_metrics
    for path, a in jax.tree_util.tree_leaves_with_path(on.params):
        name = jax.tree_util.keystr(path)
        if "q_b_proj" not in name and "kv_b_proj" not in name:
            np.testing.assert_array_equal(a, _leaf(off.params, path), err_msg=name)
    dn = CONFIG.qk_nope_head_dim
    for stack, layer in STACKS:
        q_on, kv_on = _attn(on.params, stack)["q_b_proj"], _attn(on.params, stack)["kv_b_proj"]
        q_off, kv_off = _attn(off.params, stack)["q_b_proj"], _attn(off.params, stack)["kv_b_proj"]
        for head in range(CONFIG.num_heads):
            if (layer, head) not in BOOSTED:
                np.testing.assert_array_equal(q_on[0, :, head], q_off[0, :, head])
                np.testing.assert_array_equal(kv_on[0, :, head], kv_off[0, :, head])
                continue
            gamma = TAU / before[layer, head]
            np.testing.assert_allclose(
                q_on[0, :, head, :dn], q_off[0, :, head, :dn] * gamma**0.5, rtol=1e-5
            )
            np.testing.assert_allclose(
                q_on[0, :, head, dn:], q_off[0, :, head, dn:] * gamma, rtol=1e-5
            )
            np.testing.assert_allclose(
                kv_on[0, :, head, :dn], kv_off[0, :, head, :dn] * gamma**0.5, rtol=1e-5
            )
            np.testing.assert_array_equal(kv_on[0, :, head, dn:], kv_off[0, :, head, dn:])
    for a, b in zip(
        jax.tree.leaves((on.router, on.opt_state)), jax.tree.leaves((off.router, off.opt_state))
    ):
        np.testing.assert_array_equal(a, b)
    after_on = np.asarray(_max_logits(on.params, on.router, _batch()))
    after_off = np.asarray(_max_logits(off.params, off.router, _batch()))
    gamma = np.where(before > TAU, TAU / before, 1.0)
    np.testing.assert_allclose(after_on, gamma * after_off, rtol=1e-5)


@pytest.mark.slow
def test_off_is_the_plain_step_and_a_clip_with_nothing_over_tau_changes_no_bit():
    """Off, the transformation is the plain optax chain and the model computes no max
    logit (its aux is what it was before QK-clip). On, with every logit under tau
    (fresh weights: ~0.02), the step, which now computes the max logits and runs the
    clip, gives bitwise the state and loss of the step with QK-clip off."""
    tx_off, _ = _step_fn(0.0)
    assert optimizer.qk_clip_tau(tx_off) == 0.0 and not hasattr(tx_off, "qk_clip_tau")
    assert optimizer.qk_clip_tau(_step_fn(TAU)[0]) == TAU
    variables = _fresh_variables()
    _, aux = jax.eval_shape(
        functools.partial(model.forward_with_aux, CONFIG), variables, _batch()["tokens"]
    )
    assert set(aux) == {"expert_load", "balance_loss", "dropped"}
    on, on_metrics = _run_step(variables, TAU)
    off, off_metrics = _run_step(variables, 0.0)
    assert int(on_metrics["qk_clipped_heads"]) == 0
    for a, b in zip(jax.tree.leaves(on), jax.tree.leaves(off)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(on_metrics["loss"], off_metrics["loss"])


@pytest.mark.slow
def test_the_grpo_step_clips_too(boosted):
    """The RL trainer's update (``grpo_step``, two micro-batches) reports the forward
    pass's max logit and clips the same heads as the train step: their recomputed max
    logit is tau within 1%, the other heads' logits keep their values."""
    variables, before = boosted
    tx, schedule = _tx(TAU)
    batch = _batch()
    fn = jax.jit(
        functools.partial(
            grpo.grpo_step, config=CONFIG, grpo=grpo.GRPOConfig(), tx=tx, schedule=schedule,
            microbatches=2,
        )
    )  # fmt: skip
    old = grpo.logprobs_step(variables, batch, config=CONFIG)
    weight = batch["loss_mask"].astype(jnp.float32) / batch["loss_mask"].sum()
    rl_batch = {
        **batch,
        "advantages": jnp.ones((B, T), jnp.float32),
        "token_weight": weight,
        "old_logprobs": old,
        "sampler_logprobs": old,
        "ref_logprobs": jnp.zeros((B, T), jnp.float32),
    }
    state, metrics = fn(step.init_state(variables, tx), rl_batch)
    assert int(metrics["qk_clipped_heads"]) == len(BOOSTED)
    np.testing.assert_allclose(metrics["attn_max_logit"], before.max(), rtol=1e-5)
    after = np.asarray(_max_logits(state.params, state.router, batch))
    for layer, head in BOOSTED:
        assert TAU * 0.99 <= after[layer, head] <= TAU * 1.01, after
    keep = before <= TAU
    np.testing.assert_allclose(after[keep], before[keep], rtol=1e-3)


def test_micro_batches_take_the_max_of_the_max_logits():
    """``accumulate_gradients(max_aux=True)``: the second aux part is a maximum over
    micro-batches, the first a sum, as are the loss and the gradients."""

    def loss_fn(w, micro):
        loss = jnp.sum(w * micro["x"])
        return loss, (micro["x"].sum(), micro["x"].max(axis=0))

    x = jnp.asarray([[1.0, -5.0], [4.0, -7.0], [2.0, -6.0], [0.0, -9.0]])
    w = jnp.ones((2,))
    loss, (total, maxed), grads = step.accumulate_gradients(
        loss_fn, w, {"x": x}, microbatches=2, max_aux=True
    )
    np.testing.assert_allclose(loss, x.sum())
    np.testing.assert_allclose(total, x.sum())
    np.testing.assert_allclose(maxed, [4.0, -5.0])  # not a sum, and not floored at 0
    np.testing.assert_allclose(grads, x.sum(axis=0))


def _leaf(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_qk_clip_on_unscanned_layers_and_bad_input():
    """The pure clip on the unscanned layout equals the scanned one; a max-logit array
    of the wrong shape and a negative tau are errors that name what is wrong."""
    rng = np.random.default_rng(0)
    shapes = partitioning.strip_axis_metadata(model.abstract_variables(CONFIG))["params"]
    scanned = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), shapes)
    max_logit = jnp.asarray([[0.5, 3.0, 1.0, 8.0], [2.5, 0.1, 0.2, 0.3]])
    clipped, count = optimizer.qk_clip(CONFIG, scanned, max_logit, TAU)
    assert int(count) == 3
    unscanned_config = CONFIG.replace(scan_layers=False)
    clipped_u, _ = optimizer.qk_clip(
        unscanned_config, model.unstack_layers(scanned), max_logit, TAU
    )
    for a, b in zip(jax.tree.leaves(model.unstack_layers(clipped)), jax.tree.leaves(clipped_u)):
        np.testing.assert_array_equal(a, b)
    # Layer 0 head 3: gamma = 2/8 -> the rope part of the query by 1/4.
    q0 = clipped["dense_layers"]["layer"]["attn"]["q_b_proj"][0, :, 3, CONFIG.qk_nope_head_dim :]
    ref = scanned["dense_layers"]["layer"]["attn"]["q_b_proj"][0, :, 3, CONFIG.qk_nope_head_dim :]
    np.testing.assert_allclose(q0, ref * 0.25, rtol=1e-6)
    with pytest.raises(ValueError, match=r"\[layers, heads\]"):
        optimizer.qk_clip(CONFIG, scanned, max_logit[:1], TAU)
    opt = config_lib.base_config().optimizer
    opt.qk_clip_tau = -1.0
    with pytest.raises(ValueError, match="qk_clip_tau"):
        optimizer.make_optimizer(opt, 10)
