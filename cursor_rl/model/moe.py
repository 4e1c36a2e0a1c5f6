"""DeepSeek-V3 mixture of experts: sigmoid group-limited routing, dropless dispatch.

Steps, each in its own ``jax.named_scope`` so profiles read like this list:

1. ``route``: sigmoid scores; a per-expert correction bias (non-trainable, in the
   ``router`` collection) is added *only* to choose experts: pick the ``topk_group``
   best groups (group score = sum of its two best biased scores), then the top-k
   experts inside them. Combine weights come from the un-biased scores, optionally
   normalised, times ``routed_scaling_factor`` (DeepSeek-V3 eqs. 12-16).
2. ``permute``: sort (token, slot) assignments by expert; with expert parallelism,
   send each expert's rows to the device holding it (``all_to_all``). The send
   buffer is gathered straight from the tokens and each assignment's output read
   straight back from the returned buffer, so no [assignments, D] copy in sorted order
   is kept, nor its gradient (one layer of DeepSeek-V3 at 2x capacity over 64 chips:
   temporaries 14.9 -> 5.8 GiB a chip; ``benchmarks/moe_dispatch_aot.py``).
3. ``experts``: SwiGLU per expert over its contiguous rows (``ragged_dot``, or
   fixed-size row blocks with a batched matmul, which XLA:CPU runs faster, or,
   for the few rows of a decode step, every expert padded to one capacity).
4. ``unpermute``: the inverse, then the weighted sum over each token's k slots.

Nothing is dropped by default: buffers are sized for the worst case, so results
equal the dense reference (every expert on every token) up to float rounding.
With expert parallelism the worst case is every assignment landing on one device,
a buffer ``expert_shards`` times the local assignments — too much at pod scale
(384 experts over 64 devices). ``moe_capacity_factor > 0`` bounds each device's
send buffer per peer to ``factor x`` the balanced share; assignments past it are
dropped (their combine weight lost, the token keeps its other experts and the
shared expert) and counted in ``dropped_fraction``. Aux-loss-free balancing keeps
loads near the mean, so a factor of ~2 drops almost nothing.

Balance: ``update_router_bias`` is the aux-loss-free sign rule (DeepSeek-V3
sec. 2.1.2) that the trainer applies after each optimizer step with the load this
layer reports; an optional sequence-wise balance loss (eq. 17-20) is returned too.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from cursor_rl import partitioning
from cursor_rl.model.config import ModelConfig
from cursor_rl.model.layers import MLP, kernel

Array = jax.Array


# ---- routing ------------------------------------------------------------------------


def route(
    config: ModelConfig, x: Array, router_kernel: Array, router_bias: Array
) -> tuple[Array, Array, Array]:
    """Chooses experts for each token.

    Args:
      config: model config.
      x: tokens [N, D].
      router_kernel: [D, E].
      router_bias: correction bias [E], used only for the choice.

    Returns:
      topk_idx [N, K] int32, topk_weight [N, K] float32 and the sigmoid scores [N, E].
    """
    c = config
    logits = jnp.dot(x.astype(jnp.float32), router_kernel.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    biased = scores + router_bias.astype(jnp.float32)
    if c.n_group > 1:
        n = biased.shape[0]
        grouped = biased.reshape(n, c.n_group, c.n_routed_experts // c.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, group_idx = jax.lax.top_k(group_scores, c.topk_group)
        group_mask = (
            jnp.zeros((n, c.n_group), jnp.bool_).at[jnp.arange(n)[:, None], group_idx].set(True)
        )
        expert_mask = jnp.repeat(group_mask, c.n_routed_experts // c.n_group, axis=1)
        biased = jnp.where(expert_mask, biased, -jnp.inf)
    _, topk_idx = jax.lax.top_k(biased, c.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, topk_idx, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return topk_idx.astype(jnp.int32), weights * c.routed_scaling_factor, scores


def expert_load(topk_idx: Array, num_experts: int, valid: Array | None = None) -> Array:
    """Assignments per expert [E] (float32), counting only ``valid`` tokens."""
    ones = jnp.ones(topk_idx.shape, jnp.float32)
    if valid is not None:
        ones = ones * valid[:, None].astype(jnp.float32)
    return jnp.zeros((num_experts,), jnp.float32).at[topk_idx.reshape(-1)].add(ones.reshape(-1))


def sequence_balance_loss(
    config: ModelConfig, scores: Array, topk_idx: Array, valid: Array
) -> Array:
    """DeepSeek-V3 eq. 17-20, averaged over the rows of the batch (unscaled by alpha).

    Args:
      scores: sigmoid scores [B, T, E]; topk_idx: [B, T, K]; valid: [B, T] bool.
    """
    e, k = config.n_routed_experts, config.num_experts_per_tok
    validf = valid.astype(jnp.float32)
    count = jnp.maximum(validf.sum(-1), 1.0)  # [B]
    chosen = jax.nn.one_hot(topk_idx, e, dtype=jnp.float32).sum(-2)  # [B, T, E]
    f = (e / k) * (chosen * validf[..., None]).sum(1) / count[:, None]
    normed = scores / (scores.sum(-1, keepdims=True) + 1e-20)
    p = (normed * validf[..., None]).sum(1) / count[:, None]
    return jnp.mean((f * p).sum(-1))


def update_router_bias(router_bias: Array, load: Array, rate: float) -> Array:
    """Aux-loss-free balancing: b_i += rate * sign(mean load - load_i).

    Overloaded experts become less likely to be chosen, underloaded ones more.
    Works on one layer [E] or stacked layers [L, E] (mean over the last axis).
    """
    load = load.astype(jnp.float32)
    error = jnp.mean(load, axis=-1, keepdims=True) - load
    return (router_bias + rate * jnp.sign(error)).astype(router_bias.dtype)


# ---- expert computation over sorted rows -------------------------------------------


def _swiglu_ragged(xs: Array, group_sizes: Array, wg: Array, wu: Array, wd: Array) -> Array:
    """Rows of xs [M, D] grouped by expert (sizes [G]); rows past the groups give 0."""
    h = jax.nn.silu(jax.lax.ragged_dot(xs, wg, group_sizes)) * jax.lax.ragged_dot(
        xs, wu, group_sizes
    )
    return jax.lax.ragged_dot(h, wd, group_sizes)


def _swiglu_blocked(
    xs: Array, group_sizes: Array, wg: Array, wu: Array, wd: Array, block: int
) -> Array:
    """Same contract as ``_swiglu_ragged``, as a batched matmul over fixed-size blocks.

    Each expert's rows are padded to a multiple of ``block``; every block then has
    one expert, whose weights are gathered per block. The block count is a static
    upper bound (M / block + G), so shapes stay fixed while nothing is dropped.
    """
    m, d = xs.shape
    g = group_sizes.shape[0]
    num_blocks = -(-m // block) + g
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    padded = (group_sizes + block - 1) // block * block
    padded_ends = jnp.cumsum(padded)
    padded_starts = padded_ends - padded
    row_group = jnp.searchsorted(ends, jnp.arange(m), side="right")  # G for trailing rows
    in_group = row_group < g
    safe_group = jnp.minimum(row_group, g - 1)
    dest = jnp.where(
        in_group, padded_starts[safe_group] + jnp.arange(m) - starts[safe_group], num_blocks * block
    )
    xb = jnp.zeros((num_blocks * block, d), xs.dtype).at[dest].set(xs, mode="drop")
    xb = xb.reshape(num_blocks, block, d)
    block_group = jnp.minimum(
        jnp.searchsorted(padded_ends, jnp.arange(num_blocks) * block, side="right"), g - 1
    )
    h = jax.nn.silu(jnp.einsum("nbd,ndf->nbf", xb, wg[block_group])) * jnp.einsum(
        "nbd,ndf->nbf", xb, wu[block_group]
    )
    yb = jnp.einsum("nbf,nfd->nbd", h, wd[block_group]).reshape(num_blocks * block, -1)
    return jnp.take(yb, dest, axis=0, mode="fill", fill_value=0)


def _swiglu_padded(xs: Array, group_sizes: Array, wg: Array, wu: Array, wd: Array) -> Array:
    """Same contract as ``_swiglu_ragged``: every expert's rows padded to one capacity.

    For few rows (decoding): rows go to [G, C, D] at (expert, rank) and one batched
    matmul runs over experts, reading each expert's weights in place (``blocked``
    copies them per block, which dominates when blocks are few rows). C is the
    smallest power of four >= the largest group, picked at run time among static
    branches, so nothing is dropped and at most 4x the rows are computed.
    """
    m, d = xs.shape
    g = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    row_group = jnp.searchsorted(ends, jnp.arange(m), side="right")  # G for trailing rows
    in_group = row_group < g
    group = jnp.minimum(row_group, g - 1)
    rank = jnp.arange(m) - (ends - group_sizes)[group]
    capacities = [1]
    while capacities[-1] < m:
        capacities.append(min(4 * capacities[-1], m))

    def padded(capacity):
        def run(xs):
            slot = jnp.where(in_group, rank, capacity)  # trailing rows: dropped
            xb = jnp.zeros((g, capacity, d), xs.dtype).at[group, slot].set(xs, mode="drop")
            h = jax.nn.silu(jnp.einsum("gcd,gdf->gcf", xb, wg)) * jnp.einsum("gcd,gdf->gcf", xb, wu)
            yb = jnp.einsum("gcf,gfd->gcd", h, wd)
            return jnp.where(in_group[:, None], yb[group, jnp.minimum(rank, capacity - 1)], 0)

        return run

    branch = jnp.searchsorted(jnp.asarray(capacities), jnp.max(group_sizes))
    return jax.lax.switch(branch, [padded(c) for c in capacities], xs)


def _expert_ffn(impl: str, block: int):
    if impl == "ragged":
        return _swiglu_ragged
    if impl == "padded":
        return _swiglu_padded
    return functools.partial(_swiglu_blocked, block=block)


def _sorted_counts(ids: Array, n: int) -> Array:
    """How many of the sorted ``ids`` equal 0, 1, ..., n-1 (ids >= n are not counted).

    Found by binary search over ids that are sorted anyway, rather than a scatter-add.
    (It was tried against libtpu 0.0.42.1's failure on 384 experts at fsdp=512, "Bitcast
    cannot have different shape sizes": the failure moved to this op's result as
    ``ragged_dot`` reads it, so that layout stays out of reach; docs/scale.md.)"""
    edges = jnp.searchsorted(ids, jnp.arange(n + 1, dtype=ids.dtype), side="left")
    return jnp.diff(edges).astype(jnp.int32)


def _dispatch_local(
    x: Array,
    topk_idx: Array,
    topk_weight: Array,
    wg: Array,
    wu: Array,
    wd: Array,
    *,
    num_experts: int,
    impl: str,
    block: int,
    expert_axis: str | None,
    expert_shards: int,
    tensor_axis: str | None,
    capacity_factor: float = 0.0,
    token_axes: tuple[str, ...] = (),
    gather_axes: tuple[str, ...] = (),
) -> tuple[Array, Array]:
    """Routed-expert output for this device's tokens x [N, D], and assignments dropped.

    ``wg/wu/wd`` hold this device's experts ([E/expert_shards, ...]) and, under
    tensor parallelism, its slice of the expert hidden size; partial sums over
    that slice are reduced over ``tensor_axis`` at the end. The dropped count is
    summed over ``token_axes`` (0 unless ``capacity_factor`` bounds the buffers).
    Under FSDP the weights arrive split over ``gather_axes`` along the model
    dimension and are gathered here, so the gradient leaves reduce-scattered.
    """
    if gather_axes:
        with jax.named_scope("gather_weights"):
            wg = jax.lax.all_gather(wg, gather_axes, axis=1, tiled=True)
            wu = jax.lax.all_gather(wu, gather_axes, axis=1, tiled=True)
            wd = jax.lax.all_gather(wd, gather_axes, axis=2, tiled=True)
    dropped = jnp.zeros((), jnp.float32)
    n, k = topk_idx.shape
    num_assign = n * k
    ffn = _expert_ffn(impl, block)
    with jax.named_scope("permute"):
        flat_expert = topk_idx.reshape(-1)
        order = jnp.argsort(flat_expert, stable=True)
        sorted_expert = flat_expert[order]
    if expert_shards == 1:
        with jax.named_scope("permute"):
            rows = x[order // k]  # [A, D] grouped by expert
        with jax.named_scope("experts"):
            group_sizes = _sorted_counts(sorted_expert, num_experts)
            out_sorted = ffn(rows, group_sizes, wg, wu, wd)
        with jax.named_scope("unpermute"):
            out = jnp.zeros((num_assign, out_sorted.shape[-1]), out_sorted.dtype)
            out = out.at[order].set(out_sorted)
    else:
        local_experts = num_experts // expert_shards
        capacity = num_assign
        if capacity_factor > 0:
            capacity = min(num_assign, -(-int(capacity_factor * num_assign) // expert_shards))
        with jax.named_scope("permute"):
            # Assignments for device p are contiguous in sorted order, from start[p];
            # send slot (p, s) holds sorted assignment start[p] + s when s < the
            # count for p and the capacity, else a zero row. The send buffer is
            # gathered straight from the tokens: no [A, D] copy in sorted order, and
            # its gradient scatters straight back into the tokens'.
            dest = sorted_expert // local_experts
            per_dest = _sorted_counts(dest, expert_shards)
            start = jnp.cumsum(per_dest) - per_dest
            slot = jnp.arange(num_assign) - start[dest]
            dropped = (slot >= capacity).sum().astype(jnp.float32)
            sent = jnp.arange(capacity)[None, :] < jnp.minimum(per_dest, capacity)[:, None]
            src = jnp.minimum(start[:, None] + jnp.arange(capacity)[None, :], num_assign - 1)
            src_token = jnp.where(sent, order[src] // k, n)  # n: out of range -> zeros
            send_x = x.at[src_token].get(mode="fill", fill_value=0)  # [S, C, D]
            local_id = sorted_expert[src] - jnp.arange(expert_shards)[:, None] * local_experts
            send_e = jnp.where(sent, local_id, local_experts)
            recv_x = jax.lax.all_to_all(send_x, expert_axis, 0, 0, tiled=False)
            recv_e = jax.lax.all_to_all(send_e, expert_axis, 0, 0, tiled=False)
            recv_e = recv_e.reshape(-1)  # padding rows carry id local_experts
            order2 = jnp.argsort(recv_e, stable=True)
            group_sizes = _sorted_counts(recv_e[order2], local_experts)
            recv_rows = recv_x.reshape(-1, x.shape[-1])[order2]
        with jax.named_scope("experts"):
            out_rows = ffn(recv_rows, group_sizes, wg, wu, wd)
        with jax.named_scope("unpermute"):
            # Undo the receive-side sort with a gather by the inverse permutation.
            rows_back = expert_shards * capacity
            inverse2 = (
                jnp.zeros((rows_back,), jnp.int32)
                .at[order2]
                .set(jnp.arange(rows_back, dtype=jnp.int32))
            )
            back = jax.lax.all_to_all(
                out_rows[inverse2].reshape(expert_shards, capacity, -1),
                expert_axis, 0, 0, tiled=False,
            )  # fmt: skip
            # Each assignment reads its row straight from the returned buffer (dropped
            # ones read past its end: zeros), in token order.
            where_sorted = jnp.where(slot < capacity, dest * capacity + slot, rows_back)
            where = jnp.zeros((num_assign,), jnp.int32).at[order].set(where_sorted)
            out = back.reshape(rows_back, -1).at[where].get(mode="fill", fill_value=0)
    with jax.named_scope("unpermute"):
        out = out.reshape(n, k, -1)
        y = jnp.einsum("nkd,nk->nd", out, topk_weight.astype(out.dtype))
        if tensor_axis is not None:
            y = jax.lax.psum(y, tensor_axis)
    if token_axes:
        dropped = jax.lax.psum(dropped, token_axes)
    return y, dropped


def _dense_reference(x: Array, topk_idx: Array, topk_weight: Array, wg, wu, wd) -> Array:
    """Every expert on every token, combined with the routing weights (for tests)."""
    h = jax.nn.silu(jnp.einsum("nd,edf->enf", x, wg)) * jnp.einsum("nd,edf->enf", x, wu)
    y = jnp.einsum("enf,efd->end", h, wd)
    combine = jnp.einsum(
        "nke,nk->ne", jax.nn.one_hot(topk_idx, wg.shape[0], dtype=y.dtype), topk_weight
    )
    return jnp.einsum("end,ne->nd", y, combine.astype(y.dtype))


def resolve_impl(impl: str) -> str:
    if impl == "auto":
        return "blocked" if jax.default_backend() == "cpu" else "ragged"
    return impl


def dispatch_token_axes(mesh) -> tuple[str, ...]:
    """The mesh axes the flattened tokens [B*T] are split over for dispatch: the batch
    axes, then (under context parallelism) the sequence's. Tokens flatten from [B over
    the batch axes, T over the length axes], so each device dispatches only its own
    (batch, sequence) share instead of gathering the whole sequence first."""
    token_axes = partitioning.split_axes(mesh, "act_batch", partitioning.BATCH_AXES)
    length_axes = partitioning.split_axes(mesh, "act_length")
    return (*token_axes, *(a for a in length_axes if a not in token_axes))


def _weight_gather_axes(mesh, taken: tuple[str | None, ...]) -> tuple[str, ...]:
    """The mesh axes (size > 1) that the current rules split a routed-expert weight's
    model dimension (``embed``) over, leaving out the axes its other dimensions use."""
    spec = partitioning.logical_to_spec(("expert", "embed", "mlp"), nn.get_logical_axis_rules())
    axes = partitioning.live_axes(mesh, spec[1] if len(spec) > 1 else None)
    return tuple(a for a in axes if a not in taken)


def routed_experts(
    config: ModelConfig, x: Array, topk_idx: Array, topk_weight: Array, wg, wu, wd
) -> tuple[Array, Array]:
    """Routed-expert output for tokens x [N, D] on whatever mesh is current, and the
    number of (token, expert) assignments dropped for capacity (0 when dropless)."""
    impl = resolve_impl(config.moe_impl)
    if impl == "dense":
        return _dense_reference(x, topk_idx, topk_weight, wg, wu, wd), jnp.zeros(())
    mesh = jax.sharding.get_abstract_mesh()
    kwargs = dict(num_experts=config.n_routed_experts, impl=impl, block=config.moe_block_size)
    if mesh.empty:
        return _dispatch_local(
            x, topk_idx, topk_weight, wg, wu, wd,
            expert_axis=None, expert_shards=1, tensor_axis=None, **kwargs,
        )  # fmt: skip
    token_axes = dispatch_token_axes(mesh)
    expert_axes = partitioning.split_axes(mesh, "expert")
    mlp_axes = partitioning.split_axes(mesh, "mlp")
    if len(expert_axes) > 1 or len(mlp_axes) > 1:
        raise ValueError("expert and mlp must each map to at most one mesh axis for MoE dispatch")
    expert_axis = expert_axes[0] if expert_axes else None
    tensor_axis = mlp_axes[0] if mlp_axes else None
    expert_shards = partitioning.mesh_axis_size(mesh, expert_axes)
    if config.n_routed_experts % expert_shards:
        raise ValueError(
            f"n_routed_experts={config.n_routed_experts} must divide over {expert_shards} devices"
        )
    # Token count must split evenly over the token axes: pad with zero-weight rows.
    shards = partitioning.mesh_axis_size(mesh, token_axes)
    n = x.shape[0]
    pad = (-n) % shards
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        topk_idx = jnp.pad(topk_idx, ((0, pad), (0, 0)))
        topk_weight = jnp.pad(topk_weight, ((0, pad), (0, 0)))
    # The weights enter split as they are stored (the model dimension over the FSDP
    # axes) and are gathered inside: gathered outside, by the partitioner, the
    # backward pass all-reduced each layer's full expert gradient (7 GiB a weight
    # for DeepSeek-V3 at fsdp=512) before slicing its shard; gathered inside, its
    # transpose is a reduce-scatter.
    gather_axes = _weight_gather_axes(mesh, (expert_axis, tensor_axis))
    tok = P(token_axes or None)
    model_dim = gather_axes or None
    w_in = P(expert_axis, model_dim, tensor_axis)
    w_out = P(expert_axis, tensor_axis, model_dim)
    fn = functools.partial(
        _dispatch_local,
        expert_axis=expert_axis,
        expert_shards=expert_shards,
        tensor_axis=tensor_axis,
        capacity_factor=config.moe_capacity_factor,
        token_axes=token_axes,
        gather_axes=gather_axes,
        **kwargs,
    )
    y, dropped = jax.shard_map(
        fn,
        in_specs=(tok, tok, tok, w_in, w_in, w_out),
        out_specs=(tok, P()),
        check_vma=False,
    )(x, topk_idx, topk_weight, wg, wu, wd)
    return y[:n], dropped


class MoE(nn.Module):
    """Routed experts plus shared experts.

    Returns y and aux: ``expert_load`` [E], ``balance_loss`` and ``dropped`` (the
    assignments dropped for capacity).
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, valid: Array) -> tuple[Array, Array, Array]:
        c = self.config
        b, t, d = x.shape
        e, f = c.n_routed_experts, c.moe_intermediate_size
        router_kernel = self.param(
            "router",
            nn.with_logical_partitioning(
                nn.initializers.normal(c.initializer_range), ("embed", "router")
            ),
            (d, e),
            jnp.float32,  # routing decisions stay fp32, as in DeepSeek-V3
        )
        router_bias = self.variable("router", "bias", lambda: jnp.zeros((e,), jnp.float32)).value
        wg = kernel(self, "gate_proj", (e, d, f), ("expert", "embed", "mlp"), c)
        wu = kernel(self, "up_proj", (e, d, f), ("expert", "embed", "mlp"), c)
        wd = kernel(self, "down_proj", (e, f, d), ("expert", "mlp", "embed"), c)

        tokens = x.reshape(b * t, d)
        with jax.named_scope("route"):
            topk_idx, topk_weight, scores = route(c, tokens, router_kernel, router_bias)
            load = expert_load(topk_idx, e, valid.reshape(-1))
            if c.aux_loss_coef > 0:
                balance = sequence_balance_loss(
                    c,
                    scores.reshape(b, t, e),
                    topk_idx.reshape(b, t, -1),
                    valid,
                )
            else:
                balance = jnp.zeros((), jnp.float32)
        y, dropped = routed_experts(c, tokens, topk_idx, topk_weight, wg, wu, wd)
        y = y.reshape(b, t, d)
        if c.n_shared_experts:
            y = y + MLP(c, f * c.n_shared_experts, name="shared")(x)
        return y, {"expert_load": load, "balance_loss": balance, "dropped": dropped}
