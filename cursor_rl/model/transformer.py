"""The decoder stack and the model's public functions (``init``, ``forward``, ...).

Layout of the variables (``scan_layers=True``; every leaf of a stack has a leading
``layers`` axis)::

    params:
      embed/embedding            [V, D]
      dense_layers/...           first_k_dense layers (attention + SwiGLU MLP)
      moe_layers/...             the rest (attention + MoE)
      final_norm/scale           [D]
      lm_head                    [D, V]   (absent when tie_word_embeddings)
    router:
      moe_layers/moe/bias        [L_moe, E]   the correction bias, not trained by the optimizer

With ``scan_layers=False`` the stacks become ``dense_layers_0``, ``moe_layers_0``,
...; ``stack_layers``/``unstack_layers`` convert between the two.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from cursor_rl import partitioning
from cursor_rl.model import context_parallel
from cursor_rl.model.config import ModelConfig
from cursor_rl.model.kv_cache import CachedStep, PagedCache
from cursor_rl.model.layers import BTE, MLA, MLP, RMSNorm, Rope, constrain, linear, rope_tables
from cursor_rl.model.moe import MoE, update_router_bias

Array = jax.Array
Variables = dict[str, Any]

STACKS = ("dense_layers", "moe_layers")
LAYER_INPUT = "decoder_layer_input"  # the name remat policies save or offload it by

_REMAT_POLICIES = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Full recomputation, and the one residual it keeps per layer, the layer's input,
    # moved to host memory after the forward pass and back for the backward pass (the
    # decoder-layer-input offload of MaxText's v5p recipes). On TPU the compiler
    # overlaps the copies with the neighbouring layers' compute.
    "offload_layer_inputs": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[LAYER_INPUT],
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x)); ffn is MoE or dense."""

    config: ModelConfig
    moe: bool

    @nn.compact
    def __call__(
        self,
        x: Array,
        rope: Rope,
        segment_ids: Array | None,
        valid: Array,
        cache: tuple[PagedCache, Array, CachedStep] | None = None,
    ):
        """Returns (x, aux); with ``cache`` (the stack's pools, this layer's index in
        the stack, the step), attention goes through the paged cache and the second
        output is the updated pools instead."""
        c = self.config
        x = checkpoint_name(x, LAYER_INPUT)
        h = RMSNorm(c.rms_norm_eps, c.jnp_param_dtype, name="input_norm")(x)
        attn = MLA(c, name="attn")
        max_logit = None
        if cache is None:
            attended = attn(h, rope, segment_ids)
            if c.report_attn_max_logit:
                attended, max_logit = attended
            x = x + attended
        else:
            pools, layer, step = cache
            attended, pools = attn.attend_cache(h, rope, pools, layer, step)
            x = x + attended
        x = constrain(x, BTE)
        h = RMSNorm(c.rms_norm_eps, c.jnp_param_dtype, name="post_attn_norm")(x)
        if self.moe:
            y, aux = MoE(c, name="moe")(h, valid)
        else:
            y = MLP(c, c.intermediate_size, name="mlp")(h)
            aux = {
                "expert_load": jnp.zeros((max(c.n_routed_experts, 1),), jnp.float32),
                "balance_loss": jnp.zeros((), jnp.float32),
                "dropped": jnp.zeros((), jnp.float32),
            }
        x = constrain(x + y, BTE)
        if cache is not None:
            return x, pools
        if max_logit is not None:
            aux = {**aux, "attn_max_logit": max_logit}
        return x, aux


class _ScanBody(nn.Module):
    """DecoderLayer in nn.scan's (carry, xs) -> (carry, ys) form."""

    config: ModelConfig
    moe: bool

    @nn.compact
    def __call__(self, x, rope, segment_ids, valid):
        layer_cls = _maybe_remat(DecoderLayer, self.config)
        return layer_cls(self.config, self.moe, name="layer")(x, rope, segment_ids, valid)


class _CachedScanBody(nn.Module):
    """DecoderLayer through the paged cache; the carry holds the stack's pools."""

    config: ModelConfig
    moe: bool

    @nn.compact
    def __call__(self, carry, rope, step):
        x, pools, layer = carry
        layer_cache = (pools, layer, step)
        x, pools = DecoderLayer(self.config, self.moe, name="layer")(
            x, rope, None, step.valid, layer_cache
        )
        return (x, pools, layer + 1), None


def _maybe_remat(cls, config: ModelConfig):
    if config.remat_policy == "none":
        return cls
    return nn.remat(cls, policy=_REMAT_POLICIES[config.remat_policy], prevent_cse=False)


class Transformer(nn.Module):
    config: ModelConfig

    def _stack(self, name: str, moe: bool, count: int, x, rope, segment_ids, valid):
        c = self.config
        if count == 0:
            return x, None
        if c.scan_layers:
            scanned = nn.scan(
                _ScanBody,
                variable_axes={"params": 0, "router": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                length=count,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            return scanned(c, moe, name=name)(x, rope, segment_ids, valid)
        layer_cls = _maybe_remat(DecoderLayer, c)
        outs = []
        for i in range(count):
            x, aux = layer_cls(c, moe, name=f"{name}_{i}")(x, rope, segment_ids, valid)
            outs.append(aux)
        return x, jax.tree.map(lambda *a: jnp.stack(a), *outs)

    def _cached_stack(self, name: str, moe: bool, x, rope, pools: PagedCache, step):
        c = self.config
        count = pools.kv_latent.shape[0]
        layer = jnp.zeros((), jnp.int32)
        if c.scan_layers:
            scanned = nn.scan(
                _CachedScanBody,
                variable_axes={"params": 0, "router": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast),
                length=count,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            (x, pools, _), _ = scanned(c, moe, name=name)((x, pools, layer), rope, step)
            return x, pools
        for i in range(count):
            layer_cache = (pools, layer + i, step)
            x, pools = DecoderLayer(c, moe, name=f"{name}_{i}")(
                x, rope, None, step.valid, layer_cache
            )
        return x, pools

    @nn.compact
    def __call__(
        self,
        tokens: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        return_hidden: bool = False,
        cache: tuple[dict[str, PagedCache], CachedStep] | None = None,
    ):
        """Logits [B, T, V] and aux; with ``cache`` (see ``forward_cached``), the
        logits [B, V] at ``step.last`` and the updated pools."""
        c = self.config
        b, t = tokens.shape
        if cache is not None:
            pools, step = cache
            positions, segment_ids = step.positions, None
        elif positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        # A sequence split over devices is laid out causally load-balanced for ring
        # attention (context_parallel.py), here once for every layer; every other op
        # is per token. The final hidden states are put back in order.
        ring_axes = () if cache is not None else context_parallel.sequence_axes(c.context_parallel)
        if ring_axes:
            tokens, positions = (context_parallel.to_load_balanced(a) for a in (tokens, positions))
            if segment_ids is not None:
                segment_ids = context_parallel.to_load_balanced(segment_ids)
        # Segment id 0 marks padding: it attends only to itself and counts in no statistic.
        valid = jnp.ones((b, t), jnp.bool_) if segment_ids is None else segment_ids != 0
        embedding = self.param(
            "embed",
            nn.with_logical_partitioning(
                nn.initializers.normal(c.initializer_range), ("vocab", "embed")
            ),
            (c.vocab_size, c.hidden_size),
            c.jnp_param_dtype,
        )
        x = jnp.take(embedding, tokens, axis=0).astype(c.jnp_dtype)
        x = constrain(x, BTE)
        rope = rope_tables(c, positions)
        if cache is None:
            x, dense_aux = self._stack(
                "dense_layers", False, c.first_k_dense, x, rope, segment_ids, valid
            )
            x, moe_aux = self._stack(
                "moe_layers", True, c.num_moe_layers, x, rope, segment_ids, valid
            )
            if ring_axes:
                x = context_parallel.from_load_balanced(x)
        else:
            pools = dict(pools)
            for name, moe in (("dense_layers", False), ("moe_layers", True)):
                if name in pools:
                    x, pools[name] = self._cached_stack(name, moe, x, rope, pools[name], step)
            # Only the requested position of each row reaches the LM head.
            x = jnp.take_along_axis(x, step.last[:, None, None], axis=1)[:, 0]
        x = RMSNorm(c.rms_norm_eps, c.jnp_param_dtype, name="final_norm")(x)
        if c.tie_word_embeddings:
            head = embedding.T
        else:
            head = self.param(
                "lm_head",
                nn.with_logical_partitioning(
                    nn.initializers.normal(c.initializer_range), ("embed", "vocab")
                ),
                (c.hidden_size, c.vocab_size),
                c.jnp_param_dtype,
            )
        if cache is not None:
            return project_logits(x, head.astype(c.jnp_dtype)), pools
        if moe_aux is None:
            aux = {
                "expert_load": jnp.zeros((0, c.n_routed_experts), jnp.float32),
                "balance_loss": jnp.zeros((), jnp.float32),
                "dropped": jnp.zeros((0,), jnp.float32),
            }
        else:
            aux = {
                "expert_load": moe_aux["expert_load"],  # [L_moe, E]
                "balance_loss": moe_aux["balance_loss"].sum() * c.aux_loss_coef,
                "dropped": moe_aux["dropped"],  # [L_moe] assignments dropped for capacity
            }
        if c.report_attn_max_logit:  # [L, H], dense layers first
            stacks = [a["attn_max_logit"] for a in (dense_aux, moe_aux) if a is not None]
            aux["attn_max_logit"] = jnp.concatenate(stacks, axis=0)
        if return_hidden:
            return x, head.astype(c.jnp_dtype), aux
        return project_logits(x, head.astype(c.jnp_dtype)), aux


def project_logits(hidden: Array, head: Array) -> Array:
    """Logits float32 [..., V] from final hidden states [..., D] and the head [D, V]."""
    logits = linear(hidden, head, out_dtype=jnp.float32)
    if logits.ndim == 3:
        logits = constrain(logits, ("act_batch", "act_length", "act_vocab"))
    return logits


# ---- public functions -------------------------------------------------------------


def _dummy_tokens() -> Array:
    return jnp.zeros((1, 1), jnp.int32)


def abstract_variables(config: ModelConfig) -> Variables:
    """Shapes/dtypes of the variables, still boxed with their logical axis names."""
    return jax.eval_shape(lambda: Transformer(config).init(jax.random.key(0), _dummy_tokens()))


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every variable's shape by its path (``jax.tree_util.keystr``), for fit checks."""
    tree = partitioning.strip_axis_metadata(abstract_variables(config))
    return {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def first_shape_difference(
    a: ModelConfig, b: ModelConfig
) -> tuple[str, tuple[int, ...] | None, tuple[int, ...] | None] | None:
    """``(path, shape in a, shape in b)`` of the first variable whose shapes differ
    (None where a config lacks it), or None when the two have the same variables."""
    have, want = parameter_shapes(a), parameter_shapes(b)
    for name in sorted(set(have) | set(want)):
        if have.get(name) != want.get(name):
            return name, have.get(name), want.get(name)
    return None


def variable_shardings(
    config: ModelConfig, mesh: jax.sharding.Mesh, rules: partitioning.LogicalRules
) -> Variables:
    """NamedShardings for ``init``'s output on ``mesh`` under ``rules``."""
    return partitioning.tree_shardings(abstract_variables(config), mesh, rules)


def init(
    config: ModelConfig,
    rng: Array,
    mesh: jax.sharding.Mesh | None = None,
    rules: partitioning.LogicalRules = partitioning.DEFAULT_RULES,
) -> Variables:
    """Fresh variables ``{"params": ..., "router": ...}`` as plain arrays.

    With ``mesh``, each array is created directly in its sharding (no host copy).
    """
    config.validate()

    def _init(key):
        return nn.meta.unbox(Transformer(config).init(key, _dummy_tokens()))

    if mesh is None:
        return jax.jit(_init)(rng)
    shardings = variable_shardings(config, mesh, rules)
    with partitioning.use_mesh(mesh, rules):
        return jax.jit(_init, out_shardings=shardings)(rng)


def forward_with_aux(
    config: ModelConfig,
    variables: Variables,
    tokens: Array,
    positions: Array | None = None,
    segment_ids: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Logits float32[B, T, V] and aux outputs.

    Aux: ``expert_load`` [L_moe, E] (assignments per expert, padding excluded),
    ``balance_loss`` (the sequence-wise balance loss times ``aux_loss_coef``) and
    ``dropped`` [L_moe] (assignments dropped for expert capacity; 0 when dropless);
    with ``report_attn_max_logit``, ``attn_max_logit`` [L, H] (each layer's and head's
    largest pre-softmax attention logit, dense layers first).
    """
    return Transformer(config).apply(variables, tokens, positions, segment_ids)


def hidden_with_aux(
    config: ModelConfig,
    variables: Variables,
    tokens: Array,
    positions: Array | None = None,
    segment_ids: Array | None = None,
) -> tuple[Array, Array, dict[str, Array]]:
    """Final (normed) hidden states [B, T, D], the LM head [D, V] and aux outputs.

    For losses that project to the vocabulary in chunks (``project_logits``) instead
    of materialising float32 [B, T, V] logits at once.
    """
    return Transformer(config).apply(variables, tokens, positions, segment_ids, True)


def forward(
    config: ModelConfig,
    variables: Variables,
    tokens: Array,
    positions: Array | None = None,
    segment_ids: Array | None = None,
) -> Array:
    """Logits float32[B, T, V] for tokens [B, T] (positions and segment ids optional)."""
    return forward_with_aux(config, variables, tokens, positions, segment_ids)[0]


def forward_cached(
    config: ModelConfig,
    variables: Variables,
    tokens: Array,
    cache: dict[str, PagedCache],
    step: CachedStep,
) -> tuple[Array, dict[str, PagedCache]]:
    """Runs new tokens through the paged latent cache (prefill chunks and decode steps).

    Each row's tokens sit at ``step.positions``; the positions before them must
    already be in the row's pages (``step.page_table``), and the tokens themselves
    are written there (where ``step.valid``) before attending. See ``kv_cache``.

    Args:
      config: model config.
      variables: the model variables (scanned or unscanned layout, per config).
      tokens: int32[B, T].
      cache: the page pools per stack, as ``kv_cache.init_cache`` makes them.
      step: positions, write mask, page table and the index of the logits to return.

    Returns:
      Logits float32[B, V] of the token at ``step.last`` in each row, and the pools.
    """
    return Transformer(config).apply(variables, tokens, cache=(cache, step))


# ---- layouts ----------------------------------------------------------------------


def unstack_layers(tree: dict[str, Any]) -> dict[str, Any]:
    """One collection, scanned layout -> a subtree per layer (``moe_layers_0``, ...)."""
    out = {}
    for key, value in tree.items():
        if key in STACKS:
            count = jax.tree.leaves(value)[0].shape[0]
            for i in range(count):
                out[f"{key}_{i}"] = jax.tree.map(lambda a, i=i: a[i], value["layer"])
        else:
            out[key] = value
    return out


def stack_layers(tree: dict[str, Any]) -> dict[str, Any]:
    """Inverse of ``unstack_layers``."""
    out: dict[str, Any] = {}
    per_stack: dict[str, dict[int, Any]] = {}
    for key, value in tree.items():
        stack, _, index = key.rpartition("_")
        if stack in STACKS and index.isdigit():
            per_stack.setdefault(stack, {})[int(index)] = value
        else:
            out[key] = value
    for stack, layers in per_stack.items():
        ordered = [layers[i] for i in range(len(layers))]
        out[stack] = {"layer": jax.tree.map(lambda *a: jnp.stack(a), *ordered)}
    return out


def update_router(config: ModelConfig, router: dict[str, Any], expert_load: Array) -> dict:
    """Applies the aux-loss-free bias rule to every MoE layer of a ``router`` collection.

    Args:
      config: model config (``router_bias_update_rate`` is the step size).
      router: the ``router`` variable collection (scanned or unscanned layout).
      expert_load: [L_moe, E] assignments per expert, as ``forward_with_aux`` returns.
    """
    rate = config.router_bias_update_rate
    if config.num_moe_layers == 0:
        return router
    if "moe_layers" in router:
        bias = router["moe_layers"]["layer"]["moe"]["bias"]
        new = update_router_bias(bias, expert_load, rate)
        return {**router, "moe_layers": {"layer": {"moe": {"bias": new}}}}
    out = dict(router)
    for i in range(config.num_moe_layers):
        bias = router[f"moe_layers_{i}"]["moe"]["bias"]
        out[f"moe_layers_{i}"] = {"moe": {"bias": update_router_bias(bias, expert_load[i], rate)}}
    return out
