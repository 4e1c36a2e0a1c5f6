"""The splash-attention path (``attention_impl="splash"``, cursor_rl/model/splash.py): the
TPU Pallas kernel, run here by Pallas's interpreter, equals the XLA attention in forward
and gradients, alone, under a mesh and inside the whole model; its QK-clip bound brackets
the true largest logit; and lowered for TPU it is the Mosaic kernel (a TPU custom call),
forward and backward, which needs no TPU and no libtpu to check."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cursor_rl import model, partitioning
from cursor_rl.model import splash
from cursor_rl.model.config import ModelConfig
from tests.attention_helpers import ATTN, mla_inputs, reference, vjp_with_max_logit
from tests.train_helpers import MICRO_MODEL

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (emulated) devices")

B, T, H, BLOCK = 2, 256, 4, 128  # tiles are multiples of 128 lanes, interpreted too
TOL = 1e-5  # fp32, max abs error


def _inputs(seed=0):
    # Two packed documents and padding (segment 0) in row 0, one document in row 1.
    return mla_inputs(B, T, [[1] * 90 + [2] * 130 + [0] * 36, [3] * T], seed)


def _splash(args, segments, cotangent):
    def fn(*a):
        return splash.attention(
            *a, segments, scale=ATTN.softmax_scale, block=BLOCK, with_max_logit=True
        )

    return jax.jit(lambda a, c: vjp_with_max_logit(fn, a, c))(args, cotangent)


def _assert_close(got, want, what):
    err = float(jnp.abs(jnp.asarray(got) - jnp.asarray(want)).max())
    assert err <= TOL, f"{what}: max |splash - reference| = {err:.2e} > {TOL}"


def _check_against_reference(out, bound, grads, args, segments, cotangent):
    out_ref, max_ref, grads_ref = reference(args, segments, cotangent)
    _assert_close(out, out_ref, "output")
    for name, g, ref in zip(("q_nope", "q_rope", "k_nope", "k_rope", "v"), grads, grads_ref):
        _assert_close(g, ref, f"d{name}")
    # The kernel reports each row's log-sum-exp: max <= lse <= max + ln(visible keys).
    assert bound.shape == max_ref.shape == (B, H)
    assert bool((bound >= max_ref - TOL).all()), (bound, max_ref)
    assert bool((bound <= max_ref + math.log(T) + TOL).all()), (bound, max_ref)


@pytest.mark.slow
def test_splash_equals_full_attention_in_forward_and_gradients():
    """One device, tiles of 128 over 256 tokens (diagonal, full and skipped tiles),
    packed segments and padding: output and all five gradients within 1e-5."""
    args, segments, cotangent = _inputs()
    out, bound, grads = _splash(args, segments, cotangent)
    _check_against_reference(out, bound, grads, args, segments, cotangent)


@needs_8
@pytest.mark.slow
def test_splash_under_a_mesh_runs_per_device_and_equals_full_attention():
    """Rows over fsdp and heads over tensor: the kernel runs inside shard_map on each
    device's own rows and heads (lowered for TPU: one row and head shard per kernel
    call, nothing gathered), with the same results."""
    args, segments, cotangent = _inputs(seed=1)
    mesh = partitioning.make_mesh({"data": 1, "fsdp": 2, "tensor": 4, "expert": 1})
    with partitioning.use_mesh(mesh):
        out, bound, grads = _splash(args, segments, cotangent)
        forward = jax.jit(
            lambda a: splash.attention(*a, segments, scale=ATTN.softmax_scale, block=BLOCK)
        )
        tpu = forward.trace(args).lower(lowering_platforms=("tpu",)).as_text()
    _check_against_reference(out, bound, grads, args, segments, cotangent)
    (manual,) = [line for line in tpu.splitlines() if "sdy.manual_computation" in line]
    assert '<@mesh, [{"fsdp"}, {"tensor"}, {}, {}]>' in manual, manual[:600]
    assert f"tensor<1x1x{T}x12xf32>" in manual  # one row, one head: q_nope 8 + q_rope 4


def test_lowered_for_tpu_it_is_the_mosaic_kernel_forward_and_backward():
    """Lowered for the TPU platform (no TPU or libtpu needed), the train direction holds
    the forward kernel and the two backward kernels (dq, dkv) as TPU custom calls; the
    same function lowered for the CPU holds none (it runs the interpreter there)."""
    args, segments, _ = _inputs()

    def loss(a):
        out = splash.attention(*a, segments, scale=ATTN.softmax_scale, block=BLOCK)
        return (out.astype(jnp.float32) ** 2).sum()

    traced = jax.jit(jax.grad(loss)).trace(args)
    tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert tpu.count("tpu_custom_call") >= 3, tpu.count("tpu_custom_call")
    assert "tpu_custom_call" not in traced.lower(lowering_platforms=("cpu",)).as_text()


# The trainer tests' micro model with four heads and a query latent.
MODEL = MICRO_MODEL.replace(vocab_size=64, num_heads=4, q_lora_rank=16)


@pytest.mark.slow
def test_model_with_splash_equals_the_model_with_dot_attention():
    """The whole model (every layer's attention by the kernel, tiles of 128 over 256
    tokens, packed segments): logits and parameter gradients equal the dot path's."""
    variables = model.init(MODEL, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, T), 0, MODEL.vocab_size)
    segments = jnp.asarray([[1] * 100 + [2] * 156, [1] * T])
    spl = MODEL.replace(attention_impl="splash", attention_chunk_size=BLOCK)

    def loss(config, params):
        logits = model.forward(config, {**variables, "params": params}, tokens, None, segments)
        return (logits.astype(jnp.float32) ** 2).mean()

    want, want_grads = jax.jit(jax.value_and_grad(lambda p: loss(MODEL, p)))(variables["params"])
    got, got_grads = jax.jit(jax.value_and_grad(lambda p: loss(spl, p)))(variables["params"])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_a_sequence_the_tiles_do_not_divide_is_named():
    args, segments, _ = _inputs()
    with pytest.raises(ValueError, match=r"multiple of the block size 96.*of 128"):
        splash.attention(*args, segments, scale=1.0, block=96)
    with pytest.raises(ValueError, match=r"attention_chunk_size.*multiple of 128"):
        ModelConfig(attention_impl="splash", attention_chunk_size=96).validate()
