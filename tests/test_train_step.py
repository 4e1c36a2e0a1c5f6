"""The compiled train step: loss, accumulation, non-finite skips, bias update, optimizers."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from cursor_rl import config_lib, model, partitioning
from cursor_rl.train import optimizer, step
from tests.train_helpers import MICRO_MODEL

B, T = 8, 16


def _batch(seed=0, masked_tail=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, MICRO_MODEL.vocab_size, (B, T + 1)).astype(np.int32)
    mask = np.ones((B, T), np.int32)
    if masked_tail:
        mask[:, -masked_tail:] = 0
    return {
        "tokens": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "loss_mask": jnp.asarray(mask),
        "segment_ids": jnp.ones((B, T), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
    }


def _opt_config(**kw):
    c = config_lib.base_config().optimizer
    for k, v in kw.items():
        c[k] = v
    return c


def _make(opt_name="adamw", microbatches=1, clip=1.0, loss_chunk=0):
    opt = _opt_config(name=opt_name, clip_norm=clip, warmup_steps=1)
    tx = optimizer.make_optimizer(opt, 10)
    schedule = optimizer.make_schedule(opt, 10)
    variables = model.init(MICRO_MODEL, jax.random.key(0))
    state = step.init_state(variables, tx)
    fn = jax.jit(
        functools.partial(
            step.train_step,
            config=MICRO_MODEL,
            tx=tx,
            schedule=schedule,
            microbatches=microbatches,
            loss_chunk=loss_chunk,
        )
    )
    return state, fn


@pytest.mark.slow
def test_loss_is_masked_cross_entropy():
    state, fn = _make()
    batch = _batch(masked_tail=5)
    _, metrics = fn(state, batch)
    logits = model.forward(MICRO_MODEL, state.variables, batch["tokens"])
    logp = jax.nn.log_softmax(logits)
    nll = -np.take_along_axis(np.asarray(logp), np.asarray(batch["targets"])[..., None], -1)[..., 0]
    expected = (nll * np.asarray(batch["loss_mask"])).sum() / np.asarray(batch["loss_mask"]).sum()
    np.testing.assert_allclose(metrics["ce_loss"], expected, rtol=1e-5)
    assert float(metrics["loss_tokens"]) == B * (T - 5)


@pytest.mark.slow
def test_masked_tokens_get_no_gradient_signal():
    """Changing targets where loss_mask is 0 changes nothing."""
    state, fn = _make()
    a = _batch(masked_tail=4)
    b = dict(a)
    b["targets"] = a["targets"].at[:, -4:].set((a["targets"][:, -4:] + 7) % MICRO_MODEL.vocab_size)
    sa, ma = fn(state, a)
    sb, mb = fn(state, b)
    assert float(ma["loss"]) == float(mb["loss"])
    for x, y in zip(jax.tree.leaves(sa.params), jax.tree.leaves(sb.params)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
@pytest.mark.slow
def test_gradient_accumulation_equals_full_batch(opt_name):
    state, full = _make(opt_name)
    _, accum = _make(opt_name, microbatches=4)
    batch = _batch(masked_tail=3)
    s1, m1 = full(state, batch)
    s4, m4 = accum(state, batch)
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-5)
    np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-4)
    for x, y in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-4)
    np.testing.assert_array_equal(jax.tree.leaves(s1.router)[0], jax.tree.leaves(s4.router)[0])


@pytest.mark.slow
def test_chunked_vocabulary_projection_equals_full():
    state, full = _make()
    _, chunked = _make(loss_chunk=4)
    batch = _batch(masked_tail=3)
    s1, m1 = full(state, batch)
    s2, m2 = chunked(state, batch)
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-6)
    np.testing.assert_allclose(m2["grad_norm"], m1["grad_norm"], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(x, y, atol=1e-6)


@pytest.mark.slow
def test_non_finite_update_is_skipped_and_counted():
    state, fn = _make()
    bad = jax.tree.map(lambda x: x, state)
    # A NaN weight makes loss and gradients NaN.
    emb = bad.params["embed"].at[0, 0].set(jnp.nan)
    bad = bad.replace(params={**bad.params, "embed": emb})
    batch = _batch()
    batch["tokens"] = batch["tokens"].at[0, 0].set(0)
    new, metrics = fn(bad, batch)
    assert int(metrics["update_skipped"]) == 1 and int(new.skipped) == 1
    assert int(new.step) == 1
    for x, y in zip(jax.tree.leaves(new.params), jax.tree.leaves(bad.params)):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(bad.opt_state)):
        np.testing.assert_array_equal(x, y)
    # A healthy step afterwards still works.
    good, metrics = fn(state, _batch())
    assert int(metrics["update_skipped"]) == 0 and int(good.skipped) == 0


@pytest.mark.slow
def test_router_bias_follows_expert_load():
    state, fn = _make()
    batch = _batch()
    new, _ = fn(state, batch)
    _, aux = model.forward_with_aux(MICRO_MODEL, state.variables, batch["tokens"])
    expected = model.update_router(MICRO_MODEL, state.router, aux["expert_load"])
    np.testing.assert_allclose(
        jax.tree.leaves(new.router)[0], jax.tree.leaves(expected)[0], atol=1e-7
    )
    assert float(jnp.abs(jax.tree.leaves(new.router)[0]).sum()) > 0


@pytest.mark.slow
def test_weight_decay_mask_and_muon_axes():
    variables = model.init(MICRO_MODEL, jax.random.key(0))
    mask = optimizer.decay_mask(variables["params"])
    assert mask["embed"] is False
    assert mask["final_norm"]["scale"] is False
    moe = mask["moe_layers"]["layer"]["moe"]
    assert moe["router"] is False and moe["gate_proj"] is True
    dims = optimizer.muon_dimension_numbers(variables["params"])
    attn = dims["moe_layers"]["layer"]["attn"]
    # o_proj [layers, heads, v, embed]: contracts heads and v.
    assert attn["o_proj"].reduction_axis == (1, 2) and attn["o_proj"].output_axis == (3,)
    # experts [layers, experts, embed, mlp]: layers and experts are batch axes.
    expert = dims["moe_layers"]["layer"]["moe"]["gate_proj"]
    assert expert.reduction_axis == (2,) and expert.output_axis == (3,)
    assert dims["embed"] is None and dims["lm_head"] is None


@pytest.mark.parametrize("name", ["cosine", "wsd", "constant"])
def test_schedules_warm_up_and_end_where_configured(name):
    opt = _opt_config(schedule=name, learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1)
    schedule = optimizer.make_schedule(opt, 100)
    assert float(schedule(0)) == 0.0
    assert float(schedule(10)) == pytest.approx(1.0)
    end = float(schedule(100))
    assert end == pytest.approx(1.0 if name == "constant" else 0.1, rel=1e-3)
    if name == "wsd":
        assert float(schedule(75)) == pytest.approx(1.0)  # stable until the last 20%


def test_unknown_optimizer_is_an_error():
    with pytest.raises(ValueError, match=r"optimizer\.name"):
        optimizer.make_optimizer(ml_collections.ConfigDict(_opt_config(name="sgdd")), 10)


def test_clipping_bounds_the_update():
    """With eps=1 Adam is not scale-invariant: g and 2g give one update only if clipped."""
    grads = {"w": jnp.full((4, 4), 3.0)}
    params = {"w": jnp.zeros((4, 4))}

    def first_update(clip, g):
        tx = optimizer.make_optimizer(_opt_config(clip_norm=clip, eps=1.0, warmup_steps=0), 10)
        updates, _ = tx.update(g, tx.init(params), params)
        return np.asarray(updates["w"])

    double = jax.tree.map(lambda g: 2 * g, grads)
    np.testing.assert_allclose(first_update(1e-3, grads), first_update(1e-3, double), rtol=1e-6)
    assert not np.allclose(first_update(0.0, grads), first_update(0.0, double))


@pytest.mark.slow
def test_muon_experts_first_view_gives_the_same_updates():
    """Swapping [layers, experts] for Muon's flattening changes layout, not the math."""
    opt = _opt_config(name="muon", warmup_steps=0, clip_norm=0.0)
    variables = model.init(MICRO_MODEL, jax.random.key(0))
    params = variables["params"]
    grads = jax.tree.map(lambda p: jnp.sin(p * 3.0 + 1.0), params)
    wrapped = optimizer.make_optimizer(opt, 10)
    plain = optax.contrib.muon(
        optimizer.make_schedule(opt, 10),
        beta=float(opt.muon_beta),
        weight_decay=float(opt.weight_decay),
        weight_decay_mask=optimizer.decay_mask,
        adam_b1=float(opt.b1),
        adam_b2=float(opt.b2),
        eps=float(opt.eps),
        adam_weight_decay=0.0,
        muon_weight_dimension_numbers=optimizer.muon_dimension_numbers,
        consistent_rms=0.2,
    )
    u1, _ = wrapped.update(grads, wrapped.init(params), params)
    u2, _ = plain.update(grads, plain.init(params), params)
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    opt.muon_spread_experts = True
    wrapped = optimizer.make_optimizer(opt, 10)
    u1, _ = wrapped.update(grads, wrapped.init(params), params)
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    if jax.device_count() < 8:
        return
    # On a mesh the stacked expert matrices are spread whole over the expert and fsdp
    # devices for the orthogonalisation (4 matrices over expert=2 x fsdp=2): same math.
    mesh = partitioning.make_mesh({"expert": 2, "fsdp": 2, "data": 2})
    with partitioning.use_mesh(mesh, partitioning.DEFAULT_RULES):
        plan = optimizer._spread_plan("gate_proj", (4, 1, 32, 16))
        assert plan is not None and plan[3] == ("expert", "fsdp")
        # 3 matrices per expert device do not divide over fsdp=2: left alone.
        assert optimizer._spread_plan("gate_proj", (6, 1, 32, 16)) is None
        state = jax.jit(wrapped.init)(params)
        u3, state = jax.jit(wrapped.update)(grads, state, params)
        u3, _ = jax.jit(wrapped.update)(grads, state, params)
    u4, state = plain.update(grads, plain.init(params), params)
    u4, _ = plain.update(grads, state, params)
    for a, b in zip(jax.tree.leaves(u3), jax.tree.leaves(u4)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
