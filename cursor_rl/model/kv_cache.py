"""The paged MLA latent cache and attention through it (the decode path of the model).

What is cached: MLA (DeepSeek-V2 sec. 2.1) rebuilds every head's key and value from
one normed compressed latent ``kv_latent`` [C] per token, plus one rotated RoPE key
``k_rope`` [R] shared by all heads. The cache holds exactly those two, so a token
costs ``(C + R)`` values per layer instead of ``H * (Dn + R + Dv)`` for per-head keys
and values (``bytes_per_token``). Attention from new tokens runs in the *absorbed*
form: the key half of ``kv_b_proj`` is folded into the query (``q_latent``, [H, C]
per token) and its value half is applied after the weighted sum of latents, so
per-head keys and values are never materialised.

Layout: a pool of fixed-size pages per layer stack, ``[L, P, page_size, C]`` (and
``[..., R]``), allocated once. A row of a batch names its pages in a page table
``[B, W]``: position ``p`` of that row lives in page ``page_table[b, p // page_size]``
at offset ``p % page_size``. Pages are the unit a host-side scheduler hands out and
takes back, so a sequence owns memory in proportion to its length, and a sequence
that is paused (waiting on a tool) keeps its pages without holding a batch row.

Sharding: the page axis is split over the ``cache_batch`` mesh axes like the rows
of the batch (``cache_batch`` and ``act_batch`` name the same axes), and page-table
entries are *local* page ids within the row's shard. The write and the
data-dependent gather run under ``shard_map``, so each device touches only its own
pages: the SPMD partitioner cannot know that arbitrary page ids stay on-shard and
would otherwise gather the whole pool. Heads stay split over their tensor axis.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from cursor_rl import partitioning
from cursor_rl.model.config import ModelConfig

Array = jax.Array

# Logical axes of a pool array [L, P, page_size, C].
POOL_AXES = ("layers", "cache_batch", "cache_length", "cache_latent")


class PagedCache(NamedTuple):
    """Page pools of one layer stack."""

    kv_latent: Array  # [L, P, page_size, C]  normed compressed latents
    k_rope: Array  # [L, P, page_size, R]  rotated shared RoPE keys


class CachedStep(NamedTuple):
    """Where the tokens of one cached forward call go and which logits come back."""

    positions: Array  # [B, T] int32: sequence position of each token
    valid: Array  # [B, T] bool: tokens to write (padding is computed but never stored)
    page_table: Array  # [B, W] int32: local page ids; covers every position read
    last: Array  # [B] int32: index in T whose logits are returned


def stack_sizes(config: ModelConfig) -> dict[str, int]:
    """Layers per stack, for the stacks this model has."""
    sizes = {"dense_layers": config.first_k_dense, "moe_layers": config.num_moe_layers}
    return {name: count for name, count in sizes.items() if count}


def cache_shapes(config: ModelConfig, num_pages: int, page_size: int) -> dict[str, PagedCache]:
    """ShapeDtypeStructs of the pools (dtype: the model's compute dtype)."""
    dtype = config.jnp_dtype

    def pools(layers):
        shape = (layers, num_pages, page_size)
        return PagedCache(
            jax.ShapeDtypeStruct((*shape, config.kv_lora_rank), dtype),
            jax.ShapeDtypeStruct((*shape, config.qk_rope_head_dim), dtype),
        )

    return {name: pools(count) for name, count in stack_sizes(config).items()}


def cache_shardings(
    config: ModelConfig, mesh: jax.sharding.Mesh, rules: partitioning.LogicalRules
) -> dict[str, PagedCache]:
    """NamedShardings of the pools: pages over the ``cache_batch`` axes."""
    sharding = partitioning.logical_sharding(POOL_AXES, mesh, rules)
    return {name: PagedCache(sharding, sharding) for name in stack_sizes(config)}


def init_cache(
    config: ModelConfig,
    num_pages: int,
    page_size: int,
    mesh: jax.sharding.Mesh | None = None,
    rules: partitioning.LogicalRules = partitioning.DEFAULT_RULES,
) -> dict[str, PagedCache]:
    """Zeroed pools, created directly in their shardings when ``mesh`` is given."""
    shapes = cache_shapes(config, num_pages, page_size)
    if mesh is None:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    shardings = cache_shardings(config, mesh, rules)
    return jax.tree.map(lambda s, d: jnp.zeros(s.shape, s.dtype, device=d), shapes, shardings)


def bytes_per_token(config: ModelConfig) -> dict[str, int]:
    """Cache bytes per token over all layers: this latent cache vs per-head K/V.

    The naive cache stores per head a key of ``Dn + R`` and a value of ``Dv``.
    """
    itemsize = jnp.dtype(config.jnp_dtype).itemsize
    latent = config.num_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * itemsize
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    naive = config.num_layers * config.num_heads * per_head * itemsize
    return {"latent": latent, "naive_per_head_kv": naive}


# ---- attention through the pages ----------------------------------------------------


def _attend_local(
    q_latent, q_rope, new_latent, new_rope, pool_latent, pool_rope, layer, step, scale
):
    """Writes this shard's new tokens into its pages, then attends over its rows' pages."""
    num_pages, page_size = pool_latent.shape[1], pool_latent.shape[2]
    batch, width = step.page_table.shape
    # Invalid (padding) tokens get an out-of-range page so the scatter drops them.
    slot = jnp.minimum(step.positions // page_size, width - 1)
    page = jnp.take_along_axis(step.page_table, slot, axis=1)
    page = jnp.where(step.valid, page, num_pages)
    offset = step.positions % page_size
    pool_latent = pool_latent.at[layer, page, offset].set(new_latent, mode="drop")
    pool_rope = pool_rope.at[layer, page, offset].set(new_rope, mode="drop")
    # One gather per pool straight from the layer's pages: [B, W * page_size, C].
    keys_latent = pool_latent[layer, step.page_table].reshape(batch, width * page_size, -1)
    keys_rope = pool_rope[layer, step.page_table].reshape(batch, width * page_size, -1)
    # Queries as [B, T * H, .]: per row, plain matmuls against that row's keys (the
    # [B, H, T, K] layout made XLA:CPU fall back to a slow generic dot).
    _, t, h, c = q_latent.shape
    f32 = jnp.float32
    q_latent = q_latent.reshape(batch, t * h, c)
    q_rope = q_rope.reshape(batch, t * h, -1)
    scores = jnp.einsum("bqc,bkc->bqk", q_latent, keys_latent, preferred_element_type=f32)
    scores += jnp.einsum("bqr,bkr->bqk", q_rope, keys_rope, preferred_element_type=f32)
    scores = scores.reshape(batch, t, h, -1) * scale
    # Causal over positions; stale entries past a row's length sit at later positions.
    key_pos = jnp.arange(width * page_size, dtype=jnp.int32)
    mask = key_pos[None, None, None, :] <= step.positions[:, :, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(f32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(keys_latent.dtype)
    context = jnp.einsum("bqk,bkc->bqc", probs.reshape(batch, t * h, -1), keys_latent)
    return context.reshape(batch, t, h, c), pool_latent, pool_rope


def paged_attention(
    q_latent: Array,
    q_rope: Array,
    new_latent: Array,
    new_rope: Array,
    pools: PagedCache,
    layer: Array,
    step: CachedStep,
    scale: float,
) -> tuple[Array, PagedCache]:
    """Stores new tokens' latents in the pages and attends to each row's cached prefix.

    Args:
      q_latent: absorbed queries [B, T, H, C] (query nope part times the key half
        of ``kv_b_proj``).
      q_rope: rotated query RoPE parts [B, T, H, R].
      new_latent: the new tokens' normed latents [B, T, C].
      new_rope: their rotated RoPE keys [B, T, R].
      pools: the stack's page pools.
      layer: index of this layer in the stack (scalar int32).
      step: positions, write mask and page table of the rows.
      scale: softmax scale.

    Returns:
      The attention-weighted latents [B, T, H, C] (apply the value half of
      ``kv_b_proj`` next) and the updated pools.
    """
    fn = functools.partial(_attend_local, scale=scale)
    mesh = jax.sharding.get_abstract_mesh()
    args = (q_latent, q_rope, new_latent, new_rope, pools.kv_latent, pools.k_rope, layer, step)
    if mesh.empty:
        context, kv_latent, k_rope = fn(*args)
        return context, PagedCache(kv_latent, k_rope)
    rows = partitioning.split_axes(mesh, "cache_batch") or None
    heads = partitioning.split_axes(mesh, "act_heads") or None
    pool = P(None, rows)
    row = P(rows)
    query = P(rows, None, heads)
    context, kv_latent, k_rope = jax.shard_map(
        fn,
        in_specs=(query, query, row, row, pool, pool, P(), CachedStep(row, row, row, row)),
        out_specs=(query, pool, pool),
        check_vma=False,
    )(*args)
    return context, PagedCache(kv_latent, k_rope)
