"""Model behaviour on one device: routing, dispatch paths, packing, bias rule, layouts."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cursor_rl import model
from cursor_rl.model import moe
from cursor_rl.model.config import ModelConfig, RopeScaling

# Jitted once per config (ModelConfig is hashable): eager Flax apply is slow.
forward = jax.jit(model.forward, static_argnums=0)
forward_with_aux = jax.jit(model.forward_with_aux, static_argnums=0)

TINY = ModelConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_layers=3,
    num_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense=1,
    routed_scaling_factor=2.5,
    moe_block_size=8,
)


@pytest.fixture(scope="module")
def variables():
    v = model.init(TINY, jax.random.key(0))
    # A non-zero correction bias so the biased choice differs from the plain top-k.
    bias = v["router"]["moe_layers"]["layer"]["moe"]["bias"]
    v["router"]["moe_layers"]["layer"]["moe"]["bias"] = (
        jax.random.normal(jax.random.key(1), bias.shape) * 0.1
    )
    return v


def _tokens(b=2, t=12, seed=3):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, TINY.vocab_size)


def _route_numpy(config, x, kernel, bias):
    """Straightforward NumPy version of DeepSeek-V3 group-limited routing."""
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ kernel.astype(np.float64))))
    biased = scores + bias
    n, e = scores.shape
    per = e // config.n_group
    idx = np.zeros((n, config.num_experts_per_tok), np.int64)
    w = np.zeros((n, config.num_experts_per_tok))
    for i in range(n):
        groups = biased[i].reshape(config.n_group, per)
        gscore = np.sort(groups, axis=1)[:, -2:].sum(1)
        keep = np.argsort(-gscore)[: config.topk_group]
        masked = np.full(e, -np.inf)
        for g in keep:
            masked[g * per : (g + 1) * per] = biased[i, g * per : (g + 1) * per]
        top = np.argsort(-masked)[: config.num_experts_per_tok]
        weights = scores[i, top]
        if config.norm_topk_prob:
            weights = weights / weights.sum()
        idx[i], w[i] = top, weights * config.routed_scaling_factor
    return idx, w


@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_numpy_reference(norm):
    config = TINY.replace(norm_topk_prob=norm, n_group=4, topk_group=2, num_experts_per_tok=3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 64)).astype(np.float32)
    kernel = rng.normal(size=(64, 8)).astype(np.float32) * 0.3
    bias = rng.normal(size=(8,)).astype(np.float32) * 0.2
    idx, w, _ = moe.route(config, jnp.asarray(x), jnp.asarray(kernel), jnp.asarray(bias))
    ref_idx, ref_w = _route_numpy(config, x, kernel, bias)
    # Compare as sets per token (top-k order is not part of the contract).
    order = np.argsort(np.asarray(idx), axis=1)
    ref_order = np.argsort(ref_idx, axis=1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(idx), order, 1), np.take_along_axis(ref_idx, ref_order, 1)
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(w), order, 1),
        np.take_along_axis(ref_w, ref_order, 1),
        rtol=1e-5,
        atol=1e-6,
    )


def test_bias_only_changes_choice_not_weights():
    """A huge bias on expert 0 forces its choice, but its weight is the unbiased score."""
    config = TINY.replace(n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    x = jax.random.normal(jax.random.key(0), (16, 64))
    kernel = jax.random.normal(jax.random.key(1), (64, 8)) * 0.1
    bias = jnp.zeros(8).at[0].set(100.0)
    idx, w, scores = moe.route(config, x, kernel, bias)
    assert bool((idx == 0).any(axis=1).all())
    chosen0 = jnp.where(idx == 0, w, 0).sum(1)
    np.testing.assert_allclose(chosen0, scores[:, 0], rtol=1e-6)


@pytest.mark.parametrize("impl", ["ragged", "blocked"])
@pytest.mark.slow
def test_dropless_dispatch_equals_dense(variables, impl):
    tokens = _tokens()
    dense = forward(TINY.replace(moe_impl="dense"), variables, tokens)
    other = forward(TINY.replace(moe_impl=impl), variables, tokens)
    np.testing.assert_allclose(other, dense, atol=2e-5, rtol=1e-5)
    g_dense = jax.grad(
        lambda p: forward(TINY.replace(moe_impl="dense"), {**variables, "params": p}, tokens).sum()
    )(variables["params"])
    g_other = jax.grad(
        lambda p: forward(TINY.replace(moe_impl=impl), {**variables, "params": p}, tokens).sum()
    )(variables["params"])
    for a, b in zip(jax.tree.leaves(g_dense), jax.tree.leaves(g_other)):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4)


def test_blocked_dispatch_handles_empty_and_uneven_groups():
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(21, 6)), jnp.float32)
    wg, wu = (jnp.asarray(rng.normal(size=(4, 6, 5)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(4, 5, 6)), jnp.float32)
    sizes = jnp.asarray([7, 0, 11, 1], jnp.int32)  # 19 rows in groups, 2 trailing rows
    ragged = moe._swiglu_ragged(xs, sizes, wg, wu, wd)
    blocked = moe._swiglu_blocked(xs, sizes, wg, wu, wd, block=4)
    np.testing.assert_allclose(blocked, ragged, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(blocked[19:]), 0)


@pytest.mark.slow
def test_packed_segments_equal_separate_sequences(variables):
    a, b = _tokens(1, 7, seed=4), _tokens(1, 5, seed=5)
    packed = jnp.concatenate([a, b], axis=1)
    segment_ids = jnp.asarray([[1] * 7 + [2] * 5])
    positions = jnp.asarray([list(range(7)) + list(range(5))])
    logits = forward(TINY, variables, packed, positions, segment_ids)
    np.testing.assert_allclose(logits[:, :7], forward(TINY, variables, a), atol=1e-5)
    np.testing.assert_allclose(logits[:, 7:], forward(TINY, variables, b), atol=1e-5)


def test_expert_load_counts_valid_assignments(variables):
    tokens = _tokens(2, 10)
    segment_ids = jnp.asarray([[1] * 10, [1] * 6 + [0] * 4])  # 4 padding tokens
    _, aux = forward_with_aux(TINY, variables, tokens, segment_ids=segment_ids)
    load = np.asarray(aux["expert_load"])
    assert load.shape == (TINY.num_moe_layers, TINY.n_routed_experts)
    np.testing.assert_array_equal(load.sum(1), 16 * TINY.num_experts_per_tok)


def test_router_bias_update_rule():
    bias = jnp.zeros((2, 4))
    load = jnp.asarray([[10.0, 2.0, 4.0, 4.0], [5.0, 5.0, 5.0, 5.0]])
    new = model.update_router_bias(bias, load, rate=0.01)
    # Mean load is 5: overloaded experts go down, underloaded up, balanced untouched.
    np.testing.assert_allclose(new, [[-0.01, 0.01, 0.01, 0.01], [0, 0, 0, 0]])


def test_balance_loss_is_minimal_for_uniform_routing():
    config = TINY.replace(n_routed_experts=4, num_experts_per_tok=1, n_group=1, topk_group=1)
    valid = jnp.ones((1, 4), bool)
    uniform_scores = jnp.full((1, 4, 4), 0.5)
    balanced = moe.sequence_balance_loss(
        config, uniform_scores, jnp.arange(4).reshape(1, 4, 1), valid
    )
    collapsed = moe.sequence_balance_loss(
        config, uniform_scores, jnp.zeros((1, 4, 1), jnp.int32), valid
    )
    # f_i = E/K * share; P_i = 1/E: balanced -> sum f_i P_i = 1, collapsed -> 1 too for
    # uniform scores, so use peaked scores to see the penalty.
    peaked = jnp.asarray([[[0.9, 0.1, 0.1, 0.1]] * 4])
    collapsed_peaked = moe.sequence_balance_loss(
        config, peaked, jnp.zeros((1, 4, 1), jnp.int32), valid
    )
    assert float(balanced) == pytest.approx(1.0)
    assert float(collapsed) == pytest.approx(1.0)
    assert float(collapsed_peaked) > 2.0


@pytest.mark.slow
def test_aux_loss_coef_enables_balance_loss(variables):
    tokens = _tokens()
    _, off = forward_with_aux(TINY, variables, tokens)
    _, on = forward_with_aux(TINY.replace(aux_loss_coef=0.01), variables, tokens)
    assert float(off["balance_loss"]) == 0.0
    assert float(on["balance_loss"]) > 0.0


@pytest.mark.slow
def test_scanned_and_unscanned_layouts_agree(variables):
    tokens = _tokens()
    unscanned = {k: model.unstack_layers(v) for k, v in variables.items()}
    assert "moe_layers_1" in unscanned["params"] and "moe_layers_1" in unscanned["router"]
    logits = forward(TINY.replace(scan_layers=False), unscanned, tokens)
    np.testing.assert_allclose(logits, forward(TINY, variables, tokens), atol=1e-5)
    restacked = {k: model.stack_layers(v) for k, v in unscanned.items()}
    for a, b in zip(jax.tree.leaves(restacked), jax.tree.leaves(variables)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_remat_does_not_change_values_or_grads(variables):
    tokens = _tokens()

    def loss(config, params):
        return forward(config, {**variables, "params": params}, tokens).mean()

    g0 = jax.grad(lambda p: loss(TINY, p))(variables["params"])
    for policy in ("full", "offload_layer_inputs"):
        config = TINY.replace(remat_policy=policy)
        g1 = jax.grad(lambda p, c=config: loss(c, p))(variables["params"])
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
            np.testing.assert_allclose(a, b, atol=1e-6, err_msg=policy)


def test_offload_policy_moves_each_layer_input_to_host_memory_on_tpu(variables):
    """Lowered for TPU (no TPU or libtpu needed), the gradient under
    ``offload_layer_inputs`` places the scanned layers' saved inputs in ``pinned_host``
    memory; under ``full`` nothing goes to the host."""
    tokens = _tokens()

    def lowered(policy):
        config = TINY.replace(remat_policy=policy)
        fn = jax.grad(lambda p: forward(config, {**variables, "params": p}, tokens).mean())
        grad = jax.jit(fn)
        return grad.trace(variables["params"]).lower(lowering_platforms=("tpu",)).as_text()

    offloaded = lowered("offload_layer_inputs")
    placements = re.findall(r"annotate_device_placement.*pinned_host", offloaded)
    assert placements, "no value placed in host memory"
    assert "pinned_host" not in lowered("full")


@pytest.mark.slow
def test_param_count_matches_variables():
    for config in (TINY, TINY.replace(q_lora_rank=24, first_k_dense=0, tie_word_embeddings=True)):
        v = model.init(config, jax.random.key(0))
        assert sum(a.size for a in jax.tree.leaves(v["params"])) == config.param_counts()["total"]


def test_yarn_changes_long_range_frequencies_only():
    from cursor_rl.model.layers import rope_frequencies

    base = TINY.replace(qk_rope_head_dim=32, rope_theta=10000.0)
    yarn = base.replace(rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=64))
    f0, a0 = rope_frequencies(base)
    f1, a1 = rope_frequencies(yarn)
    assert a0 == 1.0 and a1 == pytest.approx(0.1 * np.log(8.0) + 1.0)
    np.testing.assert_allclose(f1[0], f0[0])  # fast-rotating dims are kept
    np.testing.assert_allclose(f1[-1], f0[-1] / 8.0, rtol=1e-6)  # slow ones interpolated


@pytest.mark.parametrize(
    "field,value",
    [("n_group", 3), ("topk_group", 5), ("qk_rope_head_dim", 7), ("moe_impl", "magic")],
)
def test_invalid_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TINY.replace(**{field: value}).validate()


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="hidden_sise"):
        ModelConfig.from_dict({"hidden_sise": 3})


@pytest.mark.slow
def test_chunked_attention_equals_dot(variables):
    tokens = _tokens(2, 16)
    segment_ids = jnp.asarray([[1] * 10 + [2] * 6, [1] * 16])
    chunked = TINY.replace(attention_impl="chunked", attention_chunk_size=4)

    def loss(config, params):
        return forward(config, {**variables, "params": params}, tokens, None, segment_ids).sum()

    np.testing.assert_allclose(
        forward(chunked, variables, tokens, None, segment_ids),
        forward(TINY, variables, tokens, None, segment_ids),
        atol=1e-5,
    )
    g0 = jax.grad(lambda p: loss(TINY, p))(variables["params"])
    g1 = jax.grad(lambda p: loss(chunked, p))(variables["params"])
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_linear_equals_einsum_in_value_and_gradients():
    """``linear`` flattens to one 2-D matmul; values and both gradients must equal the
    einsum it replaces, for a multi-axis contraction (the o_proj form) too."""
    from cursor_rl.model.layers import linear

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 4, 5)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 5, 6)), jnp.float32)

    def ours(x, w):
        return jnp.sum(jnp.sin(linear(x, w, n_in=2)))

    def reference(x, w):
        return jnp.sum(jnp.sin(jnp.einsum("abhv,hvd->abd", x, w)))

    np.testing.assert_allclose(
        linear(x, w, n_in=2), jnp.einsum("abhv,hvd->abd", x, w), rtol=1e-5, atol=1e-5
    )
    for a, b in zip(jax.grad(ours, (0, 1))(x, w), jax.grad(reference, (0, 1))(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # The multi-axis output of a (d, h, k) kernel keeps its axes.
    assert linear(x[..., 0, :], w[0].reshape(5, 2, 3)).shape == (2, 3, 2, 3)
    assert linear(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), 2, jnp.float32).dtype == (
        jnp.float32
    )
    with pytest.raises(ValueError, match="does not contract"):
        linear(x, w)  # x's last axis (5) against w's first (4)


def test_attention_equals_two_part_score_reference():
    """The fused score product (rope key broadcast over heads and joined to the nope
    key, head-major layout) equals the textbook MLA form: separate nope and rope
    score products, causal and segment masks, softmax, weighted values."""
    from cursor_rl.model.layers import _attention

    rng = np.random.default_rng(1)
    b, t, h, dn, r, dv = 2, 12, 3, 8, 4, 5
    q_nope, k_nope = (jnp.asarray(rng.standard_normal((b, t, h, dn)), jnp.float32) for _ in "qk")
    q_rope = jnp.asarray(rng.standard_normal((b, t, h, r)), jnp.float32)
    k_rope = jnp.asarray(rng.standard_normal((b, t, r)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32)
    segment_ids = jnp.asarray([[1] * 7 + [2] * 5, [1] * 12])
    config = TINY.replace(qk_nope_head_dim=dn, qk_rope_head_dim=r, v_head_dim=dv)

    def reference(q_nope, q_rope, k_nope, k_rope, v):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q_nope, k_nope)
        scores += jnp.einsum("bqhr,bkr->bhqk", q_rope, k_rope)
        scores *= config.softmax_scale
        mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
        mask &= segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
        return jnp.einsum("bhqk,bkhv->bqhv", probs, v)

    def ours(q_nope, q_rope, k_nope, k_rope, v):
        return _attention(config, q_nope, q_rope, k_nope, k_rope, v, segment_ids, jnp.arange(t))

    args = (q_nope, q_rope, k_nope, k_rope, v)
    np.testing.assert_allclose(ours(*args), reference(*args), rtol=1e-5, atol=1e-5)
    cotangent = jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32)
    g_ours = jax.vjp(ours, *args)[1](cotangent)
    g_ref = jax.vjp(reference, *args)[1](cotangent)
    for a, ref in zip(g_ours, g_ref):
        np.testing.assert_allclose(a, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_bf16_attention_sums_the_shared_rope_key_gradient_in_float32():
    """Under bf16 compute the rope key's gradient is a sum over all heads of the
    broadcast key's gradient; summed in bf16 its error roughly doubles (RMS 8.4e-3
    against float32 at 128 heads), summed in float32 it stays at the other
    gradients' level (4.5e-3). Logits stay float32 under bf16 compute."""
    from cursor_rl.model.layers import _attention

    b, t, h, dn, r, dv = 1, 16, 128, 16, 8, 16
    rng = np.random.default_rng(0)
    shapes = [(b, t, h, dn), (b, t, h, r), (b, t, h, dn), (b, t, r), (b, t, h, dv)]
    args = [rng.standard_normal(s) for s in shapes]
    cotangent = rng.standard_normal((b, t, h, dv))
    config = TINY.replace(num_heads=h, qk_nope_head_dim=dn, qk_rope_head_dim=r, v_head_dim=dv)

    def k_rope_grad(dtype):
        c = config.replace(dtype=dtype)

        def fn(*a):
            return _attention(c, *a, None, jnp.arange(t))

        _, vjp = jax.vjp(fn, *(jnp.asarray(a, dtype) for a in args))
        return np.asarray(vjp(jnp.asarray(cotangent, dtype))[3], np.float32)

    ref, got = k_rope_grad("float32"), k_rope_grad("bfloat16")
    rms_error = np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2))
    assert rms_error < 6e-3, rms_error

    bf16 = TINY.replace(dtype="bfloat16")
    logits = forward(bf16, model.init(bf16, jax.random.key(0)), _tokens(1, 8))
    assert logits.dtype == jnp.float32
