"""MLA attention inputs and the full-attention reference shared by the ring and splash
attention tests: both check a fused path against the model's single-device core."""

import jax
import jax.numpy as jnp

from cursor_rl.model.config import ModelConfig
from cursor_rl.model.layers import _attention

# MLA's head dims differ: q/k nope 8 + rope 4, values 6.
ATTN = ModelConfig(num_heads=4, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def mla_inputs(batch, length, segments, seed=0):
    """(q_nope, q_rope, k_nope, k_rope, v), the segment ids given as rows, and an output
    cotangent, for ATTN's head dims."""
    heads = ATTN.num_heads
    keys = jax.random.split(jax.random.key(seed), 6)
    args = (
        jax.random.normal(keys[0], (batch, length, heads, 8)),  # q_nope
        jax.random.normal(keys[1], (batch, length, heads, 4)),  # q_rope
        jax.random.normal(keys[2], (batch, length, heads, 8)),  # k_nope
        jax.random.normal(keys[3], (batch, length, 4)),  # k_rope, shared by the heads
        jax.random.normal(keys[4], (batch, length, heads, 6)),  # v
    )
    cotangent = jax.random.normal(keys[5], (batch, length, heads, 6))
    return args, jnp.asarray(segments, jnp.int32), cotangent


def vjp_with_max_logit(fn, args, cotangent):
    """Output, max-logit report and the five input gradients of <output, cotangent>."""
    (out, max_logit), vjp = jax.vjp(fn, *args)
    return out, max_logit, vjp((cotangent, jnp.zeros_like(max_logit)))


def reference(args, segments, cotangent):
    """Full causal attention (the model's single-device core): output, max logits [B, H]
    and the gradients of <output, cotangent> for the five inputs, in sequence order."""
    config = ATTN.replace(report_attn_max_logit=True)
    positions = jnp.arange(segments.shape[1])
    return vjp_with_max_logit(
        lambda *a: _attention(config, *a, segments, positions), args, cotangent
    )
