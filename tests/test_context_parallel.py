"""Context-parallel (ring) attention equals full causal attention on the emulated
8-device CPU mesh, in forward and gradients, in the causally load-balanced layout; the
model with its sequence split over a context axis of 2 equals the unsharded model."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cursor_rl import model, partitioning
from cursor_rl.model import context_parallel as cp
from cursor_rl.model import moe
from tests.attention_helpers import ATTN, mla_inputs, reference, vjp_with_max_logit
from tests.train_helpers import MICRO_MODEL

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (emulated) devices")

B, T, H = 2, 32, 4
TOL = 1e-5  # fp32, max abs error

# Context size -> the rest of the mesh: heads over tensor and rows over data where
# devices are left, so the ring runs with both split too.
MESHES = {
    2: {"context": 2, "tensor": 2, "data": 2},
    4: {"context": 4, "data": 2},
    8: {"context": 8},
}


def _inputs(seed=0):
    # Two packed documents and padding (segment 0) in row 0, one document in row 1.
    return mla_inputs(B, T, [[1] * 11 + [2] * 14 + [0] * 7, [3] * T], seed)


def _ring(args, segments, cotangent, **kwargs):
    def fn(*a):
        return cp.ring_attention(
            *a, segments, scale=ATTN.softmax_scale, with_max_logit=True, **kwargs
        )

    return jax.jit(lambda a, c: vjp_with_max_logit(fn, a, c))(args, cotangent)


def _assert_close(got, want, what):
    err = float(jnp.max(jnp.abs(got - want)))
    assert err <= TOL, f"{what}: max abs error {err:.2e} > {TOL}"


def test_load_balance_order_gives_every_shard_the_same_causal_work():
    order = cp.load_balance_order(16, 4)  # 8 chunks of 2: shard i holds chunks i, 7 - i
    np.testing.assert_array_equal(order, [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
    assert sorted(order) == list(range(16))
    # Visible (query, key) pairs per shard: a token at index q sees q + 1 keys.
    work = (order + 1).reshape(4, 4).sum(axis=1)
    assert len(set(work.tolist())) == 1, work
    contiguous = (np.arange(16) + 1).reshape(4, 4).sum(axis=1)
    assert contiguous[-1] > 3 * contiguous[0]  # what the layout avoids
    with pytest.raises(ValueError, match=r"divisible by 2 x 4"):
        cp.load_balance_order(20, 4)


@needs_8
def test_relayout_to_load_balanced_and_back():
    """``to_load_balanced`` (two ppermutes) is ``x[:, order]`` on the split sequence;
    ``from_load_balanced`` undoes it."""
    mesh = partitioning.make_mesh({"context": 4, "data": 2})
    x = jnp.arange(2 * T * 3, dtype=jnp.float32).reshape(2, T, 3)
    with partitioning.use_mesh(mesh, partitioning.rules_preset("long_context")):
        there = jax.jit(cp.to_load_balanced)(x)
        back = jax.jit(cp.from_load_balanced)(there)
    np.testing.assert_array_equal(there, x[:, cp.load_balance_order(T, 4)])
    np.testing.assert_array_equal(back, x)


@needs_8
@pytest.mark.parametrize("shards", [2, 4, 8])
def test_ring_equals_full_attention_in_forward_and_gradients(shards):
    """Inputs in the load-balanced layout (as the model gives them), split over a
    context axis of ``shards``: output, per-head max logit and all five input
    gradients equal full causal attention's, reordered the same way."""
    args, segments, cotangent = _inputs()
    out_ref, max_ref, grads_ref = reference(args, segments, cotangent)
    order = cp.load_balance_order(T, shards)
    balanced = tuple(a[:, order] for a in args)
    mesh = partitioning.make_mesh(MESHES[shards])
    with partitioning.use_mesh(mesh, partitioning.rules_preset("long_context")):
        out, max_logit, grads = _ring(balanced, segments[:, order], cotangent[:, order])
    _assert_close(out, out_ref[:, order], "output")
    _assert_close(max_logit, max_ref, "max logit")
    names = ("q_nope", "q_rope", "k_nope", "k_rope", "v")
    for name, g, ref in zip(names, grads[:5], grads_ref):
        _assert_close(g, ref[:, order], f"d{name}")


@needs_8
def test_ring_in_sequence_order_with_query_chunks():
    """``load_balanced=False`` relays out inputs and output itself (callers in sequence
    order); queries in chunks of 4 inside each block; rows not divisible by the data
    axis (2 rows over 4) are replicated instead. Same results."""
    args, segments, cotangent = _inputs(seed=1)
    out_ref, max_ref, grads_ref = reference(args, segments, cotangent)
    mesh = partitioning.make_mesh({"context": 2, "data": 4})
    with partitioning.use_mesh(mesh, partitioning.rules_preset("long_context")):
        out, max_logit, grads = _ring(args, segments, cotangent, chunk=4, load_balanced=False)
    _assert_close(out, out_ref, "output")
    _assert_close(max_logit, max_ref, "max logit")
    for g, ref in zip(grads[:5], grads_ref):
        _assert_close(g, ref, "gradient")


# The trainer tests' micro model with four heads (two per tensor shard), a query
# latent and eight experts.
MODEL = MICRO_MODEL.replace(
    vocab_size=64,
    intermediate_size=48,
    num_heads=4,
    q_lora_rank=16,
    n_routed_experts=8,
    moe_block_size=8,
)


@needs_8
@pytest.mark.slow
def test_model_with_context_axis_2_equals_the_unsharded_model():
    """The whole model with the sequence split over ``context=2`` (the long_context
    rules; tokens laid out load-balanced once, ring attention in every layer, hidden
    states put back in order) gives the unsharded model's logits, packed segments and
    padding included."""
    variables = model.init(MODEL, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, MODEL.vocab_size)
    segments = jnp.asarray([[1] * 6 + [2] * 10, [1] * 16, [1] * 12 + [0] * 4, [3] * 16])

    def forward(v, t, s):
        return model.forward(MODEL, v, t, None, s)

    reference = jax.jit(forward)(variables, tokens, segments)
    mesh = partitioning.make_mesh({"context": 2, "data": 2, "tensor": 2})
    with partitioning.use_mesh(mesh, partitioning.rules_preset("long_context")):
        assert cp.sequence_axes(MODEL.context_parallel) == ("context",)
        sharded = jax.jit(forward)
        assert "collective_permute" in sharded.lower(variables, tokens, segments).as_text()
        logits = sharded(variables, tokens, segments)
    _assert_close(logits, reference, "logits")


@needs_8
@pytest.mark.slow
def test_rematerialised_ring_saves_no_mask_or_constant_per_ring_step():
    """Under full rematerialisation the backward pass recomputes the ring's masks, fills
    and initial state: none is kept per ring step, query chunk or layer. (Computed from
    positions, segment ids and constants alone, JAX counted them as known and saved them
    all: at 131,072 tokens over 16-way context they were ~45 GiB per chip of booleans,
    -inf blocks and zero states; docs/scale.md.)"""
    config = MODEL.replace(remat_policy="full", attention_impl="chunked", attention_chunk_size=8)
    variables = model.init(config, jax.random.key(0))
    b, t, shards = 2, 128, 8
    tokens = jax.random.randint(jax.random.key(1), (b, t), 0, config.vocab_size)
    segments = jnp.ones((b, t), jnp.int32)

    def loss(params):
        logits = model.forward(config, {**variables, "params": params}, tokens, None, segments)
        return logits.astype(jnp.float32).mean()

    mesh = partitioning.make_mesh({"context": shards})
    with partitioning.use_mesh(mesh, partitioning.rules_preset("long_context")):
        text = jax.jit(jax.grad(loss)).lower(variables["params"]).as_text()
    shapes = {
        (tuple(int(d) for d in dims.split("x") if d), dtype)
        for dims, dtype in re.findall(r"tensor<((?:\d+x)+)(i1|f32)>", text)
    }
    # A mask block is [B, 1 or H, chunk, keys]; one more dimension means a stack of them.
    assert not [s for s, dtype in shapes if dtype == "i1" and len(s) > 4]
    # Score-sized float32 blocks [B, H, chunk, keys] stacked over ring steps (times the
    # shards, in the global shapes of the shard_map's results).
    steps = shards - 2
    stacked = [
        s for s, dtype in shapes
        if dtype == "f32" and len(s) == 5 and s[0] in (steps, steps * shards)
        and s[1:3] == (b, config.num_heads)
    ]  # fmt: skip
    assert not stacked, stacked


def test_moe_dispatch_splits_tokens_over_the_context_axis_too():
    """With experts on their own axis and the sequence over ``context``, each device
    dispatches only its own (batch, sequence) share of the tokens (the batch axes, then
    context), and the model still gives the unsharded model's logits."""
    mesh = partitioning.make_mesh({"context": 2, "expert": 2, "fsdp": 2})
    with partitioning.use_mesh(mesh, partitioning.rules_preset("long_context")):
        assert moe.dispatch_token_axes(mesh) == ("fsdp", "expert", "context")
    with partitioning.use_mesh(mesh):
        assert moe.dispatch_token_axes(mesh) == ("fsdp", "expert")
    variables = model.init(MODEL, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (4, 16), 0, MODEL.vocab_size)

    def forward(v, t):
        return model.forward(MODEL, v, t)

    reference = jax.jit(forward)(variables, tokens)
    with partitioning.use_mesh(mesh, partitioning.rules_preset("long_context")):
        logits = jax.jit(forward)(variables, tokens)
    _assert_close(logits, reference, "logits")


def test_bad_input_is_named():
    args, segments, _ = _inputs()
    with pytest.raises(ValueError, match="k_rope"):
        cp.ring_attention(*args[:3], args[2], args[4], scale=1.0)  # a per-head k_rope
    with pytest.raises(ValueError, match="segment_ids"):
        cp.ring_attention(*args, segments[:, :8], scale=1.0)
    with pytest.raises(ValueError, match="context_parallel"):
        MODEL.replace(context_parallel="allgather").validate()
    assert cp.sequence_axes("ring") == ()  # no mesh: nothing to split over
