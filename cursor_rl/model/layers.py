"""Building blocks: RMSNorm, YaRN RoPE, multi-head latent attention (MLA), SwiGLU MLP.

Parameters carry logical axis names (see ``cursor_rl.partitioning``); activations
are constrained with ``act_*`` names. Norms, RoPE tables and the softmax run in
float32 whatever the compute dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from cursor_rl import partitioning
from cursor_rl.model import context_parallel, splash
from cursor_rl.model.config import ModelConfig, yarn_mscale
from cursor_rl.model.kv_cache import CachedStep, PagedCache, paged_attention

Array = jax.Array

BTE = ("act_batch", "act_length", "act_embed")
BTHK = ("act_batch", "act_length", "act_heads", "act_kv")


def kernel(
    module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple, config: ModelConfig
) -> Array:
    """A matmul weight with logical axes, cast to the compute dtype."""
    init = nn.with_logical_partitioning(nn.initializers.normal(config.initializer_range), axes)
    return module.param(name, init, shape, config.jnp_param_dtype).astype(config.jnp_dtype)


def linear(x: Array, w: Array, n_in: int = 1, out_dtype=None) -> Array:
    """x [..., *K] times w [*K, *N] -> [..., *N], contracting x's last ``n_in`` axes.

    The product is one 2-D matmul [M, K] x [K, N], so its gradients are 2-D too.
    Autodiff of the einsum instead leaves the weight gradient as a dot that
    contracts the batch and length axes together, which XLA:CPU runs about half
    as fast (transposed copies, then a slow dot). When the sequence is sharded
    (context parallelism) x keeps its leading axes: merging a sharded length axis
    into M would make the partitioner all-gather the sequence. ``out_dtype`` is
    the product's type (default: x's), e.g. float32 logits.
    """
    lead, k_shape = x.shape[: x.ndim - n_in], w.shape[:n_in]
    if x.shape[x.ndim - n_in :] != k_shape:
        raise ValueError(f"linear: x {x.shape} does not contract with w {w.shape}")
    k = math.prod(k_shape)
    rows = (*lead, k) if partitioning.length_sharded() else (-1, k)
    y = jnp.matmul(x.reshape(rows), w.reshape(k, -1), preferred_element_type=out_dtype)
    return y.reshape(*lead, *w.shape[n_in:])


def constrain(x: Array, axes: tuple) -> Array:
    return nn.with_logical_constraint(x, axes)


class RMSNorm(nn.Module):
    eps: float
    param_dtype: jnp.dtype = jnp.float32
    axis_name: str = "norm"

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
            (x.shape[-1],),
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (scale.astype(jnp.float32) * x32).astype(x.dtype)


# ---- rotary position embeddings -----------------------------------------------------


def rope_frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [R/2] and the cos/sin amplitude ("attention factor").

    Plain RoPE, or YaRN (arXiv:2309.00071 sec. 3.2): frequencies with fewer than
    ``beta_slow`` rotations over the original context are interpolated by
    ``factor``, those with more than ``beta_fast`` kept, and a linear ramp blends
    between. Computed in float32 exactly as transformers' ``_compute_yarn_parameters``.
    """
    dim = config.qk_rope_head_dim
    base = config.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(base), exponents, dtype=np.float32)
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
    rs = config.rope_scaling
    if rs is None:
        return inv_freq, 1.0

    def correction_dim(num_rotations: float) -> float:
        return (
            dim * math.log(rs.original_max_position_embeddings / (num_rotations * 2 * math.pi))
        ) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    inv_interp = (1.0 / (np.float32(rs.factor) * pos_freqs)).astype(np.float32)
    inv_freq = inv_interp * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    if rs.mscale and rs.mscale_all_dim:
        attention_factor = yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(
            rs.factor, rs.mscale_all_dim
        )
    else:
        attention_factor = yarn_mscale(rs.factor)
    return inv_freq.astype(np.float32), float(attention_factor)


class Rope(NamedTuple):
    cos: Array  # [B, T, R/2] float32, already scaled by the attention factor
    sin: Array


def rope_tables(config: ModelConfig, positions: Array) -> Rope:
    inv_freq, attention_factor = rope_frequencies(config)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return Rope(jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor)


def apply_rope(x: Array, rope: Rope, interleave: bool) -> Array:
    """Rotates x [B, T, H, R] by position.

    With ``interleave`` (DeepSeek's published weights) dimension pairs are
    (0,1), (2,3), ...; otherwise (i, i + R/2). Either way the output lays the
    rotated pairs out as [first halves | second halves], like transformers: the
    same permutation hits queries and keys, so scores are unaffected.
    """
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    cos = rope.cos[:, :, None, :]
    sin = rope.sin[:, :, None, :]
    x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ---- attention ----------------------------------------------------------------------


class MLA(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 sec. 2.1).

    Keys and values are rebuilt per head from a compressed latent ``kv_latent``
    (kv_lora_rank wide, RMS-normed) plus one RoPE key shared by all heads; queries
    optionally pass through their own low-rank bottleneck.
    """

    config: ModelConfig

    def setup(self):
        c = self.config
        d, h = c.hidden_size, c.num_heads
        if c.q_lora_rank is None:
            self.q_proj = kernel(self, "q_proj", (d, h, c.qk_head_dim), ("embed", "heads", "kv"), c)
        else:
            self.q_a_proj = kernel(self, "q_a_proj", (d, c.q_lora_rank), ("embed", "q_lora"), c)
            self.q_a_norm = RMSNorm(c.latent_norm_eps, c.jnp_param_dtype)
            self.q_b_proj = kernel(
                self, "q_b_proj", (c.q_lora_rank, h, c.qk_head_dim), ("q_lora", "heads", "kv"), c
            )
        self.kv_a_proj = kernel(
            self, "kv_a_proj", (d, c.kv_lora_rank + c.qk_rope_head_dim), ("embed", "kv_lora"), c
        )
        self.kv_a_norm = RMSNorm(c.latent_norm_eps, c.jnp_param_dtype)
        self.kv_b_proj = kernel(
            self,
            "kv_b_proj",
            (c.kv_lora_rank, h, c.qk_nope_head_dim + c.v_head_dim),
            ("kv_lora", "heads", "kv"),
            c,
        )
        self.o_proj = kernel(self, "o_proj", (h, c.v_head_dim, d), ("heads", "kv", "embed"), c)

    def queries(self, x: Array, rope: Rope) -> tuple[Array, Array]:
        """Per-head query parts: nope [B, T, H, Dn] and rotated rope [B, T, H, R]."""
        c = self.config
        if c.q_lora_rank is None:
            q = linear(x, self.q_proj)
        else:
            q_latent = self.q_a_norm(linear(x, self.q_a_proj))
            q = linear(q_latent, self.q_b_proj)
        q = constrain(q, BTHK)
        q_nope, q_rope = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        return q_nope, apply_rope(q_rope, rope, c.rope_interleave)

    def latents(self, x: Array, rope: Rope) -> tuple[Array, Array]:
        """What the KV cache stores: normed kv_latent [B, T, C] and rotated k_rope [B, T, R]."""
        c = self.config
        kv = linear(x, self.kv_a_proj)
        kv_latent = self.kv_a_norm(kv[..., : c.kv_lora_rank])
        k_rope = apply_rope(kv[..., None, c.kv_lora_rank :], rope, c.rope_interleave)[:, :, 0]
        return kv_latent, k_rope

    def __call__(
        self, x: Array, rope: Rope, segment_ids: Array | None
    ) -> Array | tuple[Array, Array]:
        """Output [B, T, D]; with ``report_attn_max_logit`` also each head's largest
        pre-softmax logit [H] (no gradient). When the sequence is split over devices
        (``context_parallel="ring"``) x is in the load-balanced layout the Transformer
        gives it, and attention runs as a ring (``context_parallel.ring_attention``)."""
        c = self.config
        t = x.shape[1]
        q_nope, q_rope = self.queries(x, rope)
        kv_latent, k_rope = self.latents(x, rope)
        kv = linear(kv_latent, self.kv_b_proj)
        kv = constrain(kv, BTHK)
        k_nope, v = kv[..., : c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim :]
        chunk = c.attention_chunk_size
        ring_axes = context_parallel.sequence_axes(c.context_parallel)
        if ring_axes:
            out = context_parallel.ring_attention(
                q_nope, q_rope, k_nope, k_rope, v, segment_ids,
                scale=c.softmax_scale, axes=ring_axes,
                chunk=chunk if c.attention_impl in ("chunked", "splash") else 0,
                with_max_logit=c.report_attn_max_logit,
            )  # fmt: skip
        elif c.attention_impl == "splash" and t >= splash.LANES:
            out = splash.attention(
                q_nope, q_rope, k_nope, k_rope, v, segment_ids,
                scale=c.softmax_scale, block=chunk, with_max_logit=c.report_attn_max_logit,
            )  # fmt: skip
        elif c.attention_impl == "chunked" and t > chunk and t % chunk == 0:
            out = _chunked_attention(c, q_nope, q_rope, k_nope, k_rope, v, segment_ids, chunk)
        else:
            out = _attention(c, q_nope, q_rope, k_nope, k_rope, v, segment_ids, jnp.arange(t))
        if not c.report_attn_max_logit:
            return linear(constrain(out, BTHK), self.o_proj, n_in=2)
        out, max_logit = out  # [B, H]
        y = linear(constrain(out, BTHK), self.o_proj, n_in=2)
        return y, jax.lax.stop_gradient(max_logit.max(axis=0))

    def attend_cache(
        self, x: Array, rope: Rope, pools: PagedCache, layer: Array, step: CachedStep
    ) -> tuple[Array, PagedCache]:
        """Attention of new tokens x [B, T, D] to their rows' paged cache, absorbed form.

        The new tokens' latents are written first, so a token sees itself and the
        tokens before it in its chunk. The key half of ``kv_b_proj`` is folded into
        the query and the value half applied after the sum over cached latents
        (DeepSeek-V2 appendix C): scores read C + R values per cached token.
        """
        c = self.config
        q_nope, q_rope = self.queries(x, rope)
        kv_latent, k_rope = self.latents(x, rope)
        w_key = self.kv_b_proj[..., : c.qk_nope_head_dim]  # [C, H, Dn]
        w_value = self.kv_b_proj[..., c.qk_nope_head_dim :]  # [C, H, Dv]
        q_latent = jnp.einsum("bthd,chd->bthc", q_nope, w_key)
        context, pools = paged_attention(
            q_latent, q_rope, kv_latent, k_rope, pools, layer, step, c.softmax_scale
        )
        out = constrain(jnp.einsum("bthc,chv->bthv", context, w_value), BTHK)
        return linear(out, self.o_proj, n_in=2), pools


def _head_major_keys(k_nope: Array, k_rope: Array, v: Array) -> tuple[Array, Array]:
    """Keys [B, H, Tk, Dn + R] and values [B, H, Tk, Dv] for ``_attend``.

    The rope key [B, Tk, R] is shared by all heads: it is broadcast and joined to
    the nope key, so one product gives both parts of the scores. The broadcast
    runs in float32, so its gradient (a sum over heads) accumulates in float32
    under bf16 compute too.
    """
    h = k_nope.shape[2]
    k_rope = jnp.broadcast_to(
        k_rope.astype(jnp.float32)[:, :, None, :], (*k_rope.shape[:2], h, k_rope.shape[-1])
    )
    k = jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1)
    return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)


def _attend(c: ModelConfig, q_nope, q_rope, kh, vh, segment_ids, q_index):
    """Causal attention of queries at ``q_index`` [Tq] to every key [Tk], masked by segment.

    Head-major inside ([B, H, T, D]): every product has its batch axes first, so
    XLA:CPU runs it, and its gradients, without transposing the scores. With
    ``report_attn_max_logit`` returns (out, each row's and head's largest visible
    logit [B, H]); every query sees at least itself.
    """
    q = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)
    qh = jnp.swapaxes(q, 1, 2)
    scores = jnp.einsum("bhqd,bhkd->bhqk", qh, kh, preferred_element_type=jnp.float32)
    scores *= c.softmax_scale
    mask = q_index[:, None] >= jnp.arange(kh.shape[2])[None, :]
    mask = mask[None, None]
    if segment_ids is not None:
        q_seg = jnp.take(segment_ids, q_index, axis=1)
        mask = mask & (q_seg[:, None, :, None] == segment_ids[:, None, None, :])
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(c.jnp_dtype)
    out = jnp.swapaxes(jnp.einsum("bhqk,bhkv->bhqv", probs, vh), 1, 2)
    if c.report_attn_max_logit:
        return out, scores.max(axis=(2, 3))
    return out


def _attention(c: ModelConfig, q_nope, q_rope, k_nope, k_rope, v, segment_ids, q_index):
    """Attention of queries at ``q_index`` to keys and values [B, Tk, ...] -> [B, Tq, H, Dv]."""
    kh, vh = _head_major_keys(k_nope, k_rope, v)
    return _attend(c, q_nope, q_rope, kh, vh, segment_ids, q_index)


def _chunked_attention(c: ModelConfig, q_nope, q_rope, k_nope, k_rope, v, segment_ids, chunk):
    """Memory-efficient attention: one query chunk at a time, recomputed in backward.

    Peak memory holds one chunk's scores [B, H, chunk, T] instead of [B, H, T, T]
    (Rabe & Staats, arXiv:2112.05682, with query chunking only); each chunk is
    ``jax.checkpoint``-ed so the backward pass does not keep every chunk's scores.
    The head-major keys are built once, outside the chunks.
    """
    b, t, h, _ = q_nope.shape
    n = t // chunk
    kh, vh = _head_major_keys(k_nope, k_rope, v)

    def split(x):  # [B, T, ...] -> [n, B, chunk, ...]
        return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def one(args):
        qn, qr, index = args
        return _attend(c, qn, qr, kh, vh, segment_ids, index)

    indices = jnp.arange(t).reshape(n, chunk)
    out = jax.lax.map(one, (split(q_nope), split(q_rope), indices))  # [n, B, chunk, H, Dv]
    if c.report_attn_max_logit:
        out, max_logit = out
        return jnp.moveaxis(out, 0, 1).reshape(b, t, h, -1), max_logit.max(axis=0)
    return jnp.moveaxis(out, 0, 1).reshape(b, t, h, -1)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    config: ModelConfig
    hidden: int

    @nn.compact
    def __call__(self, x: Array) -> Array:
        c = self.config
        d = x.shape[-1]
        gate = kernel(self, "gate_proj", (d, self.hidden), ("embed", "mlp"), c)
        up = kernel(self, "up_proj", (d, self.hidden), ("embed", "mlp"), c)
        down = kernel(self, "down_proj", (self.hidden, d), ("mlp", "embed"), c)
        h = jax.nn.silu(linear(x, gate)) * linear(x, up)
        h = constrain(h, ("act_batch", "act_length", "act_mlp"))
        return linear(h, down)
