"""Context-parallel causal attention: the sequence split over the ``context`` mesh axis.

When the logical rules split the sequence of activations (``act_length``, the
``long_context`` preset) over mesh axes of size > 1, every token-wise part of a layer
(projections, norms, MoE) runs on each device's share of the sequence as it is; only
attention needs keys from the other shares. ``ring_attention`` computes it with the
same inputs and output as the model's attention core (``layers._attention``): MLA's
queries and keys after projection and RoPE (a nope part per head, a rope part, one
rope key shared by the heads) and values of their own head dim.

Choices:

1. Ring attention (Liu, Zaharia & Abbeel, arXiv:2310.01889), not all-gathered keys and
   values (MaxText's context parallelism). With MLA each head has its own key and value,
   rebuilt from the latent: all T keys and values on every device is T x (H x (Dn +
   Dv) + R) values per layer (Kimi K2 at 131,072 tokens: 4.3 GB a sequence in bf16,
   with no tensor split of the heads), the memory that splitting the sequence is
   meant to save. In the ring a device holds its own block and the one in flight
   (T/n tokens each); in the forward pass it sends a block on to the next device
   (``jax.lax.ppermute``) while it attends to it, so the transfer can hide behind the
   block's matmuls. The shared rope key travels once per token, not once per head.
2. Causal load balance: the sequence is cut into 2n chunks of c = T/2n tokens and
   device i holds chunks i and 2n-1-i (``load_balance_order``). At ring step s > 0,
   device i holds the block of device j = (i - s) mod n; if j < i every query of i
   sees j's first chunk and nothing of its second, if j > i only i's second chunk sees
   anything, all of j's block. Either way the step is c x 2c scores, the masked half
   skipped (``lax.cond``), so every device does the same work at every step, where the
   contiguous split would leave device 0 idle while device n-1 does n blocks.
3. The model lays out its whole sequence load-balanced once, at its input
   (``to_load_balanced`` on tokens, positions and segment ids; ``from_load_balanced``
   on the final hidden states): every other op is per token, so attention needs no
   reordering per layer. Each relayout is two ``ppermute``s.
4. Online softmax in float32 over the blocks (running max, sum and weighted values);
   the backward pass is a second ring under ``jax.custom_vjp`` (FlashAttention-2's
   backward): it keeps only the output and each query's log-sum-exp from the forward
   pass, recomputes a block's scores, and sends each block's key and value gradients
   along with the block, so they arrive home after n steps.
5. Inside a block, queries go ``chunk`` rows at a time (the model's
   ``attention_chunk_size`` under ``attention_impl="chunked"``), so a block's scores are
   [B, H, chunk, 2c] at most.
6. Heads stay split over their tensor axes and rows over the batch axes (where they
   divide); only the sequence axes communicate. The per-head maximum logit (for
   QK-clip) is the softmax's running maximum, so it costs a reduction over queries.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from cursor_rl import partitioning

Array = jax.Array


def sequence_axes(context_parallel: str) -> tuple[str, ...]:
    """The mesh axes (size > 1) the current rules split the sequence over, when the
    model's ``context_parallel`` setting is ``"ring"``; empty otherwise (no mesh, an
    unsplit sequence, or ``"none"``: the split sequence left to XLA's partitioner)."""
    if context_parallel != "ring":
        return ()
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return partitioning.split_axes(mesh, "act_length")


def _check_length(seq_len: int, shards: int) -> None:
    if seq_len % (2 * shards):
        raise ValueError(
            f"context-parallel attention: the sequence length {seq_len} must be divisible "
            f"by 2 x {shards} (twice the devices the sequence is split over: each holds "
            "two chunks, for causal load balance); change train.seq_len or mesh.ici.context"
        )


def load_balance_order(seq_len: int, shards: int) -> np.ndarray:
    """The natural index of the token at each position of the load-balanced layout.

    The sequence is cut into 2 x ``shards`` chunks; shard i holds chunks i and
    2 x shards - 1 - i, in that order. ``x[:, order]`` lays x out load-balanced and
    ``x[:, np.argsort(order)]`` restores it.
    """
    _check_length(seq_len, shards)
    c = seq_len // (2 * shards)
    chunks = np.asarray([k for i in range(shards) for k in (i, 2 * shards - 1 - i)])
    return (chunks[:, None] * c + np.arange(c)[None, :]).reshape(-1)


def _home(chunk: int, shards: int) -> int:
    """The shard that holds ``chunk`` in the load-balanced layout."""
    return chunk if chunk < shards else 2 * shards - 1 - chunk


def _to_balanced_local(x: Array, axes: tuple[str, ...], shards: int) -> Array:
    # Shard d holds natural chunks 2d and 2d+1. The even chunks go to distinct shards
    # (one ppermute), so do the odd ones; a shard gets its own chunk i from the first
    # when i is even, from the second when i is odd, and chunk 2n-1-i from the other.
    c = x.shape[1] // 2
    even = jax.lax.ppermute(x[:, :c], axes, [(d, _home(2 * d, shards)) for d in range(shards)])
    odd = jax.lax.ppermute(x[:, c:], axes, [(d, _home(2 * d + 1, shards)) for d in range(shards)])
    flip = jax.lax.axis_index(axes) % 2 == 1
    return jnp.concatenate([jnp.where(flip, odd, even), jnp.where(flip, even, odd)], axis=1)


def _from_balanced_local(x: Array, axes: tuple[str, ...], shards: int) -> Array:
    c = x.shape[1] // 2
    flip = jax.lax.axis_index(axes) % 2 == 1
    first, second = x[:, :c], x[:, c:]
    even_chunk, odd_chunk = jnp.where(flip, second, first), jnp.where(flip, first, second)
    even = jax.lax.ppermute(even_chunk, axes, [(_home(2 * d, shards), d) for d in range(shards)])
    odd = jax.lax.ppermute(odd_chunk, axes, [(_home(2 * d + 1, shards), d) for d in range(shards)])
    return jnp.concatenate([even, odd], axis=1)


def _resolve_axes(axes: Sequence[str] | None) -> tuple[jax.sharding.AbstractMesh, tuple, int]:
    mesh = jax.sharding.get_abstract_mesh()
    if axes is None:
        axes = () if mesh.empty else partitioning.split_axes(mesh, "act_length")
    axes = tuple(axes)
    if axes and mesh.empty:
        raise ValueError(f"context parallelism over {axes} needs a mesh (partitioning.use_mesh)")
    return mesh, axes, (partitioning.mesh_axis_size(mesh, axes) if axes else 1)


def _relayout(x: Array, axes, inverse: bool, trailing: tuple) -> Array:
    mesh, axes, shards = _resolve_axes(axes)
    _check_length(x.shape[1], shards)
    if shards == 1:
        return x
    batch = partitioning.dividing_axes(mesh, "act_batch", partitioning.BATCH_AXES, x.shape[0], axes)
    trailing = tuple(trailing) + (None,) * (x.ndim - 2 - len(trailing))
    spec = P(batch or None, axes, *trailing)
    local = _from_balanced_local if inverse else _to_balanced_local
    fn = functools.partial(local, axes=axes, shards=shards)
    return jax.shard_map(fn, in_specs=(spec,), out_specs=spec, check_vma=False)(x)


def to_load_balanced(x: Array, axes: Sequence[str] | None = None, trailing: tuple = ()) -> Array:
    """x [B, T, ...] in sequence order -> the load-balanced layout, split over ``axes``
    (default: the axes the current rules split ``act_length`` over); ``trailing`` is
    the PartitionSpec of the dimensions after T (default: replicated)."""
    return _relayout(x, axes, False, trailing)


def from_load_balanced(x: Array, axes: Sequence[str] | None = None, trailing: tuple = ()) -> Array:
    """The inverse of ``to_load_balanced``."""
    return _relayout(x, axes, True, trailing)


# ---- ring attention --------------------------------------------------------------------


class _Ring(NamedTuple):
    axes: tuple[str, ...]
    shards: int
    scale: float
    chunk: int  # query rows per inner step (0: the whole block)
    max_logit: bool


# Row (query) axis of each array a block computation splits into chunks.
_FWD_ROWS = (2, 2, 0, 1)  # q_nope, q_rope [B, H, T, D], positions [T], segment ids [B, T]
_STATE_ROWS = (2, 2, 2)  # running max, sum [B, H, T], values [B, H, T, Dv]
_BWD_ROWS = (2, 2, 0, 1, 2, 2, 2)  # + output gradient, log-sum-exp, delta


def _positions(owner, shards: int, c: int) -> Array:
    """Sequence indices of the 2c tokens a shard holds in the load-balanced layout."""
    base = jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([owner * c + base, (2 * shards - 1 - owner) * c + base])


def _masked(x: Array, q_pos, k_pos, q_seg, k_seg, fill: float) -> Array:
    """``x`` [B, H, Q, K] where query q may see key k (causal, same segment), else ``fill``.

    The mask's inputs and the fill value pass through an optimization barrier with
    ``x``: computed from positions, segment ids and a constant alone they would count
    as known to JAX's rematerialisation, which then saves every query chunk's mask and
    fill block of every ring step for the backward pass instead of recomputing them
    (at 131,072 tokens over 16-way context: ~30 GiB of booleans and ~10 GiB of -inf
    blocks per chip, AOT-measured)."""
    q_pos, k_pos, q_seg, k_seg, fill, x = jax.lax.optimization_barrier(
        (q_pos, k_pos, q_seg, k_seg, jnp.asarray(fill, x.dtype), x)
    )
    mask = (q_pos[:, None] >= k_pos[None, :])[None, None]
    if q_seg is not None:
        mask = mask & (q_seg[:, None, :, None] == k_seg[:, None, None, :])
    return jnp.where(mask, x, fill)  # the fill broadcast after the barrier, not saved


def _tied_full(shape: tuple[int, ...], value: float, tie: Array) -> Array:
    """float32 ``shape`` filled with ``value``, through a barrier with ``tie`` (see
    ``_masked``): a plain constant would be saved per layer for the backward pass
    (the initial output state alone, [B, H, 2c, Dv] float32, in every layer)."""
    value, _ = jax.lax.optimization_barrier((jnp.asarray(value, jnp.float32), tie))
    return jnp.broadcast_to(value, shape)


def _scores(qn, qr, kn, kr, scale: float) -> Array:
    """float32 [B, H, Q, K]: the nope part per head plus the rope part against the key
    shared by every head."""
    s = jnp.einsum("bhqd,bhkd->bhqk", qn, kn, preferred_element_type=jnp.float32)
    s += jnp.einsum("bhqr,bkr->bhqk", qr, kr, preferred_element_type=jnp.float32)
    return s * scale


def _fwd_rows(scale: float, rows, keys, state):
    """One online-softmax update of queries ``rows`` with the key block ``keys``."""
    qn, qr, q_pos, q_seg = rows
    kn, kr, v, k_pos, k_seg = keys
    m, total, o = state
    s = _masked(_scores(qn, qr, kn, kr, scale), q_pos, k_pos, q_seg, k_seg, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    m_ref = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing visible yet
    p = jnp.exp(s - m_ref[..., None])
    alpha = jnp.exp(m - m_ref)
    total = alpha * total + p.sum(-1)
    pv = jnp.einsum("bhqk,bhkv->bhqv", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, total, alpha[..., None] * o + pv


def _bwd_rows(scale: float, rows, keys, dk):
    """Gradients of queries ``rows`` and (accumulated) of the key block ``keys``."""
    qn, qr, q_pos, q_seg, do, lse, delta = rows
    kn, kr, v, k_pos, k_seg = keys
    dkn, dkr, dv = dk
    s = _scores(qn, qr, kn, kr, scale)
    p = _masked(jnp.exp(s - lse[..., None]), q_pos, k_pos, q_seg, k_seg, 0.0)
    f32 = jnp.float32
    dv = dv + jnp.einsum("bhqk,bhqv->bhkv", p.astype(do.dtype), do, preferred_element_type=f32)
    dp = jnp.einsum("bhqv,bhkv->bhqk", do, v, preferred_element_type=f32)
    ds = (p * (dp - delta[..., None]) * scale).astype(qn.dtype)
    dqn = jnp.einsum("bhqk,bhkd->bhqd", ds, kn, preferred_element_type=f32)
    dqr = jnp.einsum("bhqk,bkr->bhqr", ds, kr, preferred_element_type=f32)
    dkn = dkn + jnp.einsum("bhqk,bhqd->bhkd", ds, qn, preferred_element_type=f32)
    dkr = dkr + jnp.einsum("bhqk,bhqr->bkr", ds, qr, preferred_element_type=f32)
    return (dqn, dqr), (dkn, dkr, dv)


def _split_rows(xs, axes, size: int):
    """Each array's row axis -> [rows / size, ..., size, ...], the chunk index first."""

    def one(x, axis):
        if x is None:
            return None
        x = x.reshape(*x.shape[:axis], x.shape[axis] // size, size, *x.shape[axis + 1 :])
        return jnp.moveaxis(x, axis, 0)

    return tuple(one(x, a) for x, a in zip(xs, axes))


def _merge_rows(xs, axes):
    def one(x, axis):
        x = jnp.moveaxis(x, 0, axis)
        return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])

    return tuple(one(x, a) for x, a in zip(xs, axes))


def _chunk_size(chunk: int, rows: int) -> int:
    return chunk if 0 < chunk < rows and rows % chunk == 0 else rows


def _fwd_block(ring: _Ring, rows, keys, state):
    size = _chunk_size(ring.chunk, rows[0].shape[2])
    if size == rows[0].shape[2]:
        return _fwd_rows(ring.scale, rows, keys, state)
    chunks = (_split_rows(rows, _FWD_ROWS, size), _split_rows(state, _STATE_ROWS, size))
    new = jax.lax.map(lambda a: _fwd_rows(ring.scale, a[0], keys, a[1]), chunks)
    return _merge_rows(new, _STATE_ROWS)


def _bwd_block(ring: _Ring, rows, keys, dk):
    size = _chunk_size(ring.chunk, rows[0].shape[2])
    if size == rows[0].shape[2]:
        return _bwd_rows(ring.scale, rows, keys, dk)

    def body(dk, chunk_rows):
        dq, dk = _bwd_rows(ring.scale, chunk_rows, keys, dk)
        return dk, dq

    dk, dq = jax.lax.scan(body, dk, _split_rows(rows, _BWD_ROWS, size))
    return _merge_rows(dq, (2, 2)), dk


def _slice(xs, axes, start: int, stop: int):
    return tuple(
        None if x is None else jax.lax.slice_in_dim(x, start, stop, axis=a)
        for x, a in zip(xs, axes)
    )


def _ppermute_next(tree, ring: _Ring):
    perm = [(d, (d + 1) % ring.shards) for d in range(ring.shards)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, ring.axes, perm), tree)


def _head_major(x: Array) -> Array:
    return jnp.swapaxes(x, 1, 2)


_KEY_ROWS = (2, 1, 2, 0, 1)  # k_nope [B, H, T, Dn], k_rope [B, T, R], v, positions, seg


def _ring_forward(ring: _Ring, qn, qr, kn, kr, v, seg):
    """Per shard: output [B, H, 2c, Dv] float32, log-sum-exp and running max [B, H, 2c]."""
    n, (b, t, h, _) = ring.shards, qn.shape
    c = t // 2
    me = jax.lax.axis_index(ring.axes) if n > 1 else 0
    rows = (_head_major(qn), _head_major(qr), _positions(me, n, c), seg)
    block = (_head_major(kn), kr, _head_major(v), seg)
    state = (
        _tied_full((b, h, t), -jnp.inf, qn),
        _tied_full((b, h, t), 0.0, qn),
        _tied_full((b, h, t, v.shape[-1]), 0.0, qn),
    )

    def keys_of(block, owner):
        kn, kr, v, seg = block
        return (kn, kr, v, _positions(owner, n, c), seg)

    # Step 0: the shard's own block (both chunks, causal inside).
    state = _fwd_block(ring, rows, keys_of(block, me), state)

    def earlier(state, keys):  # the block's owner j < me: every query, j's first chunk
        return _fwd_block(ring, rows, _slice(keys, _KEY_ROWS, 0, c), state)

    def later(state, keys):  # j > me: the second chunk's queries, all of j's block
        late = _fwd_block(
            ring, _slice(rows, _FWD_ROWS, c, t), keys, _slice(state, _STATE_ROWS, c, t)
        )
        return tuple(x.at[:, :, c:].set(y) for x, y in zip(state, late))

    def step(state, block, s):
        owner = (me - s) % n
        return jax.lax.cond(owner < me, earlier, later, state, keys_of(block, owner))

    if n > 1:
        block = _ppermute_next(block, ring)

        def body(carry, s):  # attend to the block held while sending it on
            state, block = carry
            return (step(state, block, s), _ppermute_next(block, ring)), None

        (state, block), _ = jax.lax.scan(body, (state, block), jnp.arange(1, n - 1))
        state = step(state, block, n - 1)
    m, total, o = state
    return o / total[..., None], m + jnp.log(total), m


def _ring_backward(ring: _Ring, qn, qr, kn, kr, v, seg, out, lse, dout):
    n, t = ring.shards, qn.shape[1]
    c = t // 2
    me = jax.lax.axis_index(ring.axes) if n > 1 else 0
    do = _head_major(dout)
    # FlashAttention-2's D = rowsum(dO * O), from the output as returned [B, 2c, H, Dv].
    delta = jnp.sum(do.astype(jnp.float32) * _head_major(out).astype(jnp.float32), axis=-1)
    rows = (_head_major(qn), _head_major(qr), _positions(me, n, c), seg, do, lse, delta)
    block = (_head_major(kn), kr, _head_major(v), seg)
    f32 = jnp.float32
    dq = (jnp.zeros(rows[0].shape, f32), jnp.zeros(rows[1].shape, f32))
    dk = (jnp.zeros(block[0].shape, f32), jnp.zeros(kr.shape, f32), jnp.zeros(block[2].shape, f32))

    def keys_of(block, owner):
        kn, kr, v, seg = block
        return (kn, kr, v, _positions(owner, n, c), seg)

    dq, dk = _bwd_block(ring, rows, keys_of(block, me), dk)

    def earlier(dq, dk, keys):
        part, first = _bwd_block(
            ring, rows, _slice(keys, _KEY_ROWS, 0, c), _slice(dk, (2, 1, 2), 0, c)
        )
        dk = (
            dk[0].at[:, :, :c].set(first[0]),
            dk[1].at[:, :c].set(first[1]),
            dk[2].at[:, :, :c].set(first[2]),
        )
        return tuple(x + y for x, y in zip(dq, part)), dk

    def later(dq, dk, keys):
        part, dk = _bwd_block(ring, _slice(rows, _BWD_ROWS, c, t), keys, dk)
        return tuple(x.at[:, :, c:].add(y) for x, y in zip(dq, part)), dk

    if n > 1:

        def body(carry, s):  # the block travels with its gradients, which come home at the end
            dq, block, dk = carry
            block, dk = _ppermute_next((block, dk), ring)
            owner = (me - s) % n
            dq, dk = jax.lax.cond(owner < me, earlier, later, dq, dk, keys_of(block, owner))
            return (dq, block, dk), None

        (dq, _, dk), _ = jax.lax.scan(body, (dq, block, dk), jnp.arange(1, n))
        dk = _ppermute_next(dk, ring)
    dqn, dqr = (_head_major(x) for x in dq)
    dkn, dkr, dv = dk
    return (
        dqn.astype(qn.dtype),
        dqr.astype(qr.dtype),
        _head_major(dkn).astype(kn.dtype),
        dkr.astype(kr.dtype),
        _head_major(dv).astype(v.dtype),
        None,
    )


def _finish(ring: _Ring, out, m, dtype):
    out = _head_major(out).astype(dtype)
    if not ring.max_logit:
        return out
    max_logit = m.max(-1)  # [B, H]
    if ring.shards > 1:
        max_logit = jax.lax.pmax(max_logit, ring.axes)
    return out, max_logit


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, qn, qr, kn, kr, v, seg):
    out, _, m = _ring_forward(ring, qn, qr, kn, kr, v, seg)
    return _finish(ring, out, m, v.dtype)


def _ring_fwd(ring: _Ring, qn, qr, kn, kr, v, seg):
    out, lse, m = _ring_forward(ring, qn, qr, kn, kr, v, seg)
    result = _finish(ring, out, m, v.dtype)
    # Kept for the backward pass: the inputs, the output as returned and the
    # log-sum-exp per query, no scores.
    returned = result[0] if ring.max_logit else result
    return result, (qn, qr, kn, kr, v, seg, returned, lse)


def _ring_bwd(ring: _Ring, residuals, cotangent):
    dout = cotangent[0] if ring.max_logit else cotangent  # the max logit has no gradient
    return _ring_backward(ring, *residuals, dout.astype(residuals[4].dtype))


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q_nope: Array,
    q_rope: Array,
    k_nope: Array,
    k_rope: Array,
    v: Array,
    segment_ids: Array | None = None,
    *,
    scale: float,
    axes: Sequence[str] | None = None,
    chunk: int = 0,
    load_balanced: bool = True,
    with_max_logit: bool = False,
) -> Array | tuple[Array, Array]:
    """Causal attention over a sequence split across ``axes``, by ring.

    Args:
      q_nope: [B, T, H, Dn] query parts without position.
      q_rope: [B, T, H, R] rotated query parts.
      k_nope: [B, T, H, Dn].
      k_rope: [B, T, R] the rotated key shared by all heads.
      v: [B, T, H, Dv].
      segment_ids: optional int [B, T]; tokens attend within their segment only.
      scale: the softmax scale (``ModelConfig.softmax_scale``).
      axes: the mesh axes the sequence is split over (default: those the current
        rules split ``act_length`` over; none: one device, the same computation).
      chunk: query rows per inner step inside a block (0: all of them).
      load_balanced: the inputs are in the load-balanced layout
        (``to_load_balanced``) and so is the output, as inside the model; False: the
        inputs are in sequence order, relaid out here and the output restored.
      with_max_logit: also return each head's largest pre-softmax logit over the
        rows and visible keys, float32 [B, H] (no gradient flows through it).

    Returns:
      The output [B, T, H, Dv] in v's dtype (and the max logits).
    """
    mesh, axes, shards = _resolve_axes(axes)
    b, t, h, dn = q_nope.shape
    want = {
        "q_rope": (b, t, h),
        "k_nope": (b, t, h, dn),
        "k_rope": (b, t, q_rope.shape[-1]),
        "v": (b, t, h),
    }
    for name, x in (("q_rope", q_rope), ("k_nope", k_nope), ("k_rope", k_rope), ("v", v)):
        if x.shape[: len(want[name])] != want[name] or x.ndim != q_nope.ndim - (name == "k_rope"):
            raise ValueError(
                f"ring_attention: {name} {x.shape} does not fit q_nope {q_nope.shape} "
                "(want q/k nope [B, T, H, Dn], q_rope [B, T, H, R], k_rope [B, T, R], "
                "v [B, T, H, Dv])"
            )
    if segment_ids is not None and segment_ids.shape != (b, t):
        raise ValueError(
            f"ring_attention: segment_ids {segment_ids.shape} is not [B, T] = {(b, t)}"
        )
    _check_length(t, shards)
    ring = _Ring(axes, shards, float(scale), int(chunk), bool(with_max_logit))
    if shards == 1:
        return _ring(ring, q_nope, q_rope, k_nope, k_rope, v, segment_ids)
    batch = partitioning.dividing_axes(mesh, "act_batch", partitioning.BATCH_AXES, b, axes) or None
    heads = partitioning.dividing_axes(mesh, "act_heads", None, h, axes + (batch or ())) or None
    bthk, btr, bt = P(batch, axes, heads, None), P(batch, axes, None), P(batch, axes)
    args = [q_nope, q_rope, k_nope, k_rope, v, segment_ids]
    if not load_balanced:
        args = [
            None if x is None else to_load_balanced(x, axes, (heads,) if x.ndim == 4 else ())
            for x in args
        ]
    out_specs = (bthk, P(batch, heads)) if with_max_logit else bthk
    if segment_ids is None:
        fn = lambda *a: _ring(ring, *a, None)
        in_specs = (bthk, bthk, bthk, btr, bthk)
        args = args[:5]
    else:
        fn = functools.partial(_ring, ring)
        in_specs = (bthk, bthk, bthk, btr, bthk, bt)
    result = jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
    if load_balanced:
        return result
    if with_max_logit:
        return from_load_balanced(result[0], axes, (heads,)), result[1]
    return from_load_balanced(result, axes, (heads,))
