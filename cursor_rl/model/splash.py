"""MLA attention through the TPU splash-attention kernel (Pallas, ``attention_impl="splash"``).

The kernel is JAX's block-sparse flash attention for TPU
(``jax.experimental.pallas.ops.tpu.splash_attention``): queries and keys are tiled in
blocks of ``block`` rows, blocks above the causal diagonal are skipped, and neither the
forward nor the backward pass holds a [T, T] score matrix. It is the attention MaxText
trains DeepSeek-V3 with on TPU.

MLA's shapes map onto it as follows: the query and key of a head are its non-rotary
part joined to its rotary part (the rotary key is shared by all heads and broadcast),
D = Dn + R, and the value keeps its own width Dv; the softmax scale is folded into the
queries (the kernel applies none). Packed rows keep to their segment
(``segment_ids``), as in the XLA paths.

Where it runs: a Pallas TPU kernel lowers to Mosaic only for TPU, so the call goes
through ``jax.lax.platform_dependent``: on TPU (and in an ahead-of-time compile for a TPU
topology) the Mosaic kernel, on any other platform the same kernel run by Pallas's
interpreter (slow; the CPU tests use it to check the kernel's numbers against the XLA
attention). Under a mesh the kernel runs per device inside ``shard_map``, over the
batch and head axes the rules split; the sequence is whole on each device (a sequence
split over ``context`` goes to the ring instead, ``context_parallel.py``).

QK-clip (``report_attn_max_logit``) needs each head's largest logit, which the kernel
does not report. What it reports is each row's log-sum-exp, and
``max logit <= log-sum-exp <= max logit + ln(visible keys)``: with the splash kernel a
head's reported "max logit" is its largest row log-sum-exp, an upper bound that is at
most ln(T) (8.3 at 4,096 tokens) above the true one, so QK-clip may act slightly
earlier than with the XLA paths, never later. Getting it costs one more forward pass of
the kernel in the backward (the kernel cannot differentiate its residual output).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
from jax.sharding import PartitionSpec as P

from cursor_rl import partitioning

Array = jax.Array


LANES = 128  # the kernel's tiles are multiples of the TPU's 128 lanes


def check_block(seq_len: int, block: int) -> None:
    """A clear error when the kernel cannot tile the sequence."""
    tile = min(block, seq_len)
    if block <= 0 or tile % LANES or seq_len % tile:
        raise ValueError(
            f"splash attention: the sequence length {seq_len} must be a multiple of the "
            f"block size {block} (model.attention_chunk_size), and both of {LANES}"
        )


def _kernel(seq_len: int, heads: int, block: int, interpret: bool, residuals: bool):
    """The kernel for one device's heads: causal mask over ``seq_len``, square tiles.

    Built at trace time (the mask's block structure is computed in numpy); not cached
    across traces, since the kernel holds arrays made under the current trace."""
    mask = sm.MultiHeadMask([sm.CausalMask((seq_len, seq_len)) for _ in range(heads)])
    b = min(block, seq_len)
    sizes = sk.BlockSizes(
        block_q=b, block_kv=b, block_kv_compute=b,
        block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b,
        block_q_dq=b, block_kv_dq=b,
    )  # fmt: skip
    return sk.make_splash_mha(
        mask,
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        save_residuals=residuals,
        interpret=interpret,
    )


def _local(
    q: Array,
    k: Array,
    v: Array,
    seg: Array,
    *,
    block: int,
    interpret: bool,
    residuals: bool = False,
):
    """One device's attention, the kernel vmapped over the batch: q, k [B, H, T, D],
    v [B, H, T, Dv], seg [B, T] -> [B, H, T, Dv]; with ``residuals``, (out, (lse,))."""
    kernel = _kernel(q.shape[2], q.shape[1], block, interpret, residuals)
    one = lambda q, k, v, s: kernel(q, k, v, segment_ids=sk.SegmentIds(s, s))
    return jax.vmap(one)(q, k, v, seg)


def _local_lse(q: Array, k: Array, v: Array, seg: Array, *, block: int, interpret: bool):
    """``_local`` and each row's log-sum-exp [B, H, T] (no gradient through it)."""

    @jax.custom_vjp
    def run(q, k, v, seg):
        return fwd(q, k, v, seg)[0]

    def fwd(q, k, v, seg):
        out, (lse,) = _local(q, k, v, seg, block=block, interpret=interpret, residuals=True)
        return (out, lse), (q, k, v, seg)

    def bwd(res, cotangents):
        q, k, v, seg = res
        d_out, _ = cotangents  # the log-sum-exp is reported, not trained through
        local = lambda q, k, v: _local(q, k, v, seg, block=block, interpret=interpret)
        _, vjp = jax.vjp(local, q, k, v)
        return (*vjp(d_out), None)

    run.defvjp(fwd, bwd)
    return run(q, k, v, seg)


def attention(
    q_nope: Array,
    q_rope: Array,
    k_nope: Array,
    k_rope: Array,
    v: Array,
    segment_ids: Array | None,
    *,
    scale: float,
    block: int,
    with_max_logit: bool = False,
) -> Array | tuple[Array, Array]:
    """Causal MLA attention by the splash kernel.

    Args:
      q_nope, q_rope: [B, T, H, Dn], [B, T, H, R] the query parts.
      k_nope: [B, T, H, Dn]; k_rope: [B, T, R] the rotary key shared by all heads.
      v: [B, T, H, Dv].
      segment_ids: optional int [B, T]; tokens attend within their segment only.
      scale: the softmax scale.
      block: the kernel's query and key tile (rows); T must be a multiple of it.
      with_max_logit: also return [B, H]: each head's largest row log-sum-exp, an
        upper bound on its largest logit (module docstring).

    Returns:
      [B, T, H, Dv] in v's dtype (and the bound).
    """
    b, t, h, _ = q_nope.shape
    check_block(t, block)
    dtype = q_nope.dtype
    q = jnp.concatenate([q_nope, q_rope.astype(dtype)], axis=-1) * jnp.asarray(scale, dtype)
    k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (b, t, h, k_rope.shape[-1]))
    k = jnp.concatenate([k_nope, k_rope.astype(dtype)], axis=-1)
    q, k, vh = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [B, H, T, ...]
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    local = _local_lse if with_max_logit else _local
    mesh = jax.sharding.get_abstract_mesh()

    def run(interpret: bool, q, k, vh, seg):
        fn = functools.partial(local, block=block, interpret=interpret)
        if mesh.empty:
            return fn(q, k, vh, seg)
        batch = partitioning.dividing_axes(mesh, "act_batch", partitioning.BATCH_AXES, b, ())
        heads = partitioning.dividing_axes(mesh, "act_heads", None, h, batch)
        bhtd, bt = P(batch or None, heads or None), P(batch or None)
        out_specs = (bhtd, bhtd) if with_max_logit else bhtd
        return jax.shard_map(
            fn, in_specs=(bhtd, bhtd, bhtd, bt), out_specs=out_specs, check_vma=False
        )(q, k, vh, seg)

    result = jax.lax.platform_dependent(
        q, k, vh, seg,
        tpu=functools.partial(run, False),
        default=functools.partial(run, True),
    )  # fmt: skip
    if not with_max_logit:
        return jnp.swapaxes(result, 1, 2)
    out, lse = result
    return jnp.swapaxes(out, 1, 2), jax.lax.stop_gradient(lse.max(axis=-1))
