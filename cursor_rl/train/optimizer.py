"""Optimizers and learning-rate schedules.

Choices:

1. AdamW, or Muon (Newton-Schulz orthogonalised momentum, as Kimi K2 was trained)
   on the matmul weights with AdamW on everything else (embedding, LM head, norms,
   router), ``consistent_rms=0.2`` so Muon's update RMS matches AdamW's and one
   learning rate serves both (Moonshot's "Muon is Scalable", sec. 2.2).
2. Muon's matrix axes come from each weight's role (the contraction axes vs the
   output axes, e.g. ``o_proj [heads, v, embed]`` contracts heads and v); stacked
   layers and experts are batch axes, orthogonalised independently.
3. Weight decay (decoupled) on matmul weights only: never on norms, the embedding
   or the router.
4. Global-norm clipping before the update; schedules: linear warmup then cosine,
   warmup-stable-decay (WSD: constant, then linear decay over the last
   ``decay_fraction`` of steps), or constant.
5. MuonClip's QK-clip (Kimi K2 report, arXiv:2507.20534 sec. 2.1), on with
   ``optimizer.qk_clip_tau`` = tau > 0: after each update, every attention head whose
   largest pre-softmax logit in that step's forward pass exceeded tau gets its query
   and key weights rescaled by gamma = tau / max_logit, so the same inputs would give
   at most tau. With MLA the factor is split as the report does: the per-head nope
   parts of the query (``q_b_proj`` / ``q_proj``) and key (``kv_b_proj``'s key half)
   by sqrt(gamma), the query's rope part by gamma, the rope key shared by all heads
   untouched; values and other heads are not changed. The bound holds for the inputs
   each layer had in that step: clipping one layer changes the inputs of the layers
   after it, which the next step's logits see. It acts on the weights, not the
   update, so it works with AdamW too; the optimizer state is kept. The train step
   reads tau from the transformation (``qk_clip_tau``) and asks the model for the
   per-head max logits only then: off, the step is the one without it.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

from cursor_rl import partitioning
from cursor_rl.model.config import ModelConfig

# Leaf name -> number of trailing axes that are contracted with the input; the
# remaining trailing axes of the matrix are outputs. Leading axes (layers,
# experts) are batch axes.
_CONTRACTING = {
    "q_proj": 1,  # [embed | heads, qk]
    "q_a_proj": 1,
    "q_b_proj": 1,  # [q_lora | heads, qk]
    "kv_a_proj": 1,
    "kv_b_proj": 1,  # [kv_lora | heads, qk_nope + v]
    "o_proj": 2,  # [heads, v | embed]
    "gate_proj": 1,
    "up_proj": 1,
    "down_proj": 1,
}
_MATRIX_NDIM = {"q_proj": 3, "q_b_proj": 3, "kv_b_proj": 3, "o_proj": 3}
# Leaves that are matrices but stay on AdamW and get no weight decay.
_NO_DECAY = ("embed", "router", "scale")


def make_schedule(opt, num_steps: int) -> optax.Schedule:
    """Learning rate per step for ``opt`` (the config's optimizer section)."""
    lr, warmup = float(opt.learning_rate), int(opt.warmup_steps)
    floor = lr * float(opt.min_lr_ratio)
    warmup = min(warmup, max(num_steps - 1, 0))
    if opt.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup, max(num_steps, warmup + 1), end_value=floor
        )
    if opt.schedule == "wsd":
        decay = max(int(num_steps * float(opt.decay_fraction)), 1)
        stable = max(num_steps - warmup - decay, 0)
        return optax.join_schedules(
            [
                optax.linear_schedule(0.0, lr, max(warmup, 1)),
                optax.constant_schedule(lr),
                optax.linear_schedule(lr, floor, decay),
            ],
            [warmup, warmup + stable],
        )
    if opt.schedule == "constant":
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, max(warmup, 1)), optax.constant_schedule(lr)],
            [warmup],
        )
    raise ValueError(f"optimizer.schedule={opt.schedule!r}: one of cosine, wsd, constant")


def _leaf_name(path) -> str:
    return str(getattr(path[-1], "key", path[-1]))


def _is_matrix(path, leaf) -> bool:
    name = _leaf_name(path)
    if name in _NO_DECAY or any(getattr(p, "key", None) in _NO_DECAY for p in path):
        return False
    return name in _CONTRACTING and leaf.ndim >= _MATRIX_NDIM.get(name, 2)


def decay_mask(params):
    """True on matmul weights (which get weight decay), False elsewhere."""
    return jax.tree_util.tree_map_with_path(_is_matrix, params)


def muon_dimension_numbers(params):
    """MuonDimensionNumbers for matmul weights, None (-> AdamW) elsewhere."""

    def spec(path, leaf):
        if not _is_matrix(path, leaf):
            return None
        name = _leaf_name(path)
        matrix_ndim = _MATRIX_NDIM.get(name, 2)
        first = leaf.ndim - matrix_ndim  # leading batch axes (layers, experts)
        contracting = _CONTRACTING[name]
        reduction = tuple(range(first, first + contracting))
        output = tuple(range(first + contracting, leaf.ndim))
        return MuonDimensionNumbers(reduction_axis=reduction, output_axis=output)

    return jax.tree_util.tree_map_with_path(spec, params)


def _is_stacked_expert(path, leaf) -> bool:
    keys = [str(getattr(p, "key", p)) for p in path]
    return "moe" in keys and keys[-1] in ("gate_proj", "up_proj", "down_proj") and leaf.ndim == 4


def _swap_layers_and_experts(tree):
    """[layers, experts, ...] <-> [experts, layers, ...] on scanned expert weights."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.swapaxes(0, 1) if _is_stacked_expert(path, x) else x, tree
    )


def _experts_first(
    inner: optax.GradientTransformation, spread: bool = False
) -> optax.GradientTransformation:
    """Runs ``inner`` on a view where stacked expert weights are [experts, layers, ...].

    Muon flattens a matrix's batch axes into one before orthogonalising. With the
    layer axis first, [layers, experts] -> [layers * experts] has its sharded
    (expert) part minor, which XLA cannot keep sharded: every device would
    orthogonalise all 384 experts. Experts first, the flattened axis stays sharded.
    """

    def init(params):
        return inner.init(_swap_layers_and_experts(params))

    into = _spread if spread else (lambda tree: tree)
    back = _unspread if spread else (lambda tree, like: tree)

    def update(updates, state, params=None):
        swapped = _swap_layers_and_experts(updates)
        view = None if params is None else into(_swap_layers_and_experts(params))
        new, new_state = inner.update(into(swapped), into(state), view)
        return _swap_layers_and_experts(back(new, swapped)), back(new_state, state)

    return optax.GradientTransformation(init, update)


def _expert_layout(name: str):
    """The logical axes of a stacked expert weight viewed experts first."""
    if name == "down_proj":
        return ("expert", "layers", "mlp", "embed")
    return ("expert", "layers", "embed", "mlp")


def _spread_plan(name: str, shape: tuple[int, ...]):
    """How ``_spread`` moves a stacked expert weight [experts, layers, m, n] under the
    current mesh and rules: its PartitionSpec, the mesh axes (size > 1) splitting m and
    n, and the axes the flattened [experts * layers] dimension ends up over; None when
    there is no mesh, nothing to move, or the matrices do not divide over the devices."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    spec = partitioning.logical_to_spec(_expert_layout(name), nn.get_logical_axis_rules())
    spec = tuple(spec) + (None,) * (4 - len(spec))
    if spec[1] is not None:
        return None  # the layer axis split: not a layout this knows
    experts, m_axes, n_axes = (partitioning.live_axes(mesh, spec[i]) for i in (0, 2, 3))
    if not m_axes and not n_axes:
        return None
    local = shape[0] // partitioning.mesh_axis_size(mesh, experts) * shape[1]
    if local % partitioning.mesh_axis_size(mesh, m_axes + n_axes):
        return None
    return spec, m_axes, n_axes, experts + m_axes + n_axes


def _spread_leaf(name: str, x):
    """[experts, layers, m, n] -> [experts * layers, m, n]; on a mesh, whole matrices
    spread over the devices (see ``_spread``)."""
    plan = _spread_plan(name, x.shape)
    if plan is None:
        return x.reshape(-1, *x.shape[2:])
    spec, m_axes, n_axes, flat_axes = plan

    def local(block):  # [experts/e, layers, m/f, n/t] -> [.../(f t), m, n]
        block = block.reshape(-1, *block.shape[2:])
        if m_axes:
            block = jax.lax.all_to_all(block, m_axes, 0, 1, tiled=True)
        if n_axes:
            block = jax.lax.all_to_all(block, n_axes, 0, 2, tiled=True)
        return block

    return jax.shard_map(
        local, in_specs=P(*spec), out_specs=P(flat_axes, None, None), check_vma=False
    )(x)


def _unspread_leaf(name: str, x, shape: tuple[int, ...]):
    """``_spread_leaf``'s inverse, back to ``shape`` in the weight's own layout."""
    plan = _spread_plan(name, shape)
    if plan is None:
        return x.reshape(shape)
    spec, m_axes, n_axes, flat_axes = plan

    def local(block):
        if n_axes:
            block = jax.lax.all_to_all(block, n_axes, 2, 0, tiled=True)
        if m_axes:
            block = jax.lax.all_to_all(block, m_axes, 1, 0, tiled=True)
        return block.reshape(-1, shape[1], *block.shape[1:])

    return jax.shard_map(
        local, in_specs=P(flat_axes, None, None), out_specs=P(*spec), check_vma=False
    )(x)


def _spread(tree):
    """Stacked expert weights [experts, layers, m, n] (and their moments) as
    [experts * layers, m, n], each device holding whole matrices: an all-to-all over
    the axes that split m and n (fsdp, tensor) trades pieces of many matrices for all
    of fewer. Each device then orthogonalises its own share of the 23,040 Kimi-K2 expert
    matrices; before, every device formed the [n, n] Gram matrix of each of its experts'
    matrices at once, all-reduced over fsdp (at fsdp=64 x expert=8: 45 GiB per chip,
    AOT-measured). Without a mesh, or when the matrices do not divide over the devices,
    the leaves are only reshaped."""

    def one(path, x):
        if not (_is_stacked_expert(path, x) and hasattr(x, "reshape")):
            return x
        return _spread_leaf(_leaf_name(path), x)

    return jax.tree_util.tree_map_with_path(one, tree)


def _unspread(tree, like):
    """``_spread``'s inverse: each spread leaf back to the shape and layout of its
    ``like``."""

    def one(path, x, ref):
        if not (_is_stacked_expert(path, ref) and hasattr(x, "shape")) or x.shape == ref.shape:
            return x
        return _unspread_leaf(_leaf_name(path), x, ref.shape)

    return jax.tree_util.tree_map_with_path(one, tree, like)


class _QKClipped(optax.GradientTransformationExtraArgs):
    """optax's (init, update) pair carrying the QK-clip threshold ``qk_clip_tau`` that
    the train step reads (a NamedTuple subclass without ``__slots__``, so an instance
    takes the attribute; optax and JAX see the plain pair)."""


def qk_clip_tau(tx: optax.GradientTransformation) -> float:
    """The QK-clip threshold ``make_optimizer`` gave ``tx`` (0: no QK-clip)."""
    return float(getattr(tx, "qk_clip_tau", 0.0))


def qk_clip(
    config: ModelConfig, params, max_logit: jax.Array, tau: float
) -> tuple[dict, jax.Array]:
    """Rescales the query/key weights of the heads whose max logit exceeded ``tau``.

    Args:
      config: the model config (head dims, layer counts, the query projection's name).
      params: the model parameters after the update (scanned or unscanned layout).
      max_logit: float32 [L, H], each layer's (dense layers first) and head's largest
        pre-softmax logit in the step's forward pass (``attn_max_logit``).
      tau: the threshold.

    Returns:
      The parameters, and how many heads were clipped. Weights of other heads are
      multiplied by exactly 1, so they keep their bits.
    """
    layers = config.first_k_dense + config.num_moe_layers
    if max_logit.shape != (layers, config.num_heads):
        raise ValueError(
            f"qk_clip: max_logit {max_logit.shape} is not [layers, heads] = "
            f"{(layers, config.num_heads)}"
        )
    max_logit = max_logit.astype(jnp.float32)
    over = max_logit > tau
    gamma = jnp.where(over, tau / jnp.where(over, max_logit, 1.0), 1.0)  # [L, H]
    root = jnp.sqrt(gamma)
    dn, r, dv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim

    def columns(parts):  # [(factor [..., H], width)] -> [..., H, sum(widths)]
        return jnp.concatenate(
            [jnp.broadcast_to(f[..., None], (*f.shape, w)) for f, w in parts], axis=-1
        )

    q_name = "q_proj" if config.q_lora_rank is None else "q_b_proj"

    def clip_attn(attn, g, rg):  # g, rg: [..., H] for the weights' leading axes
        q_scale = columns([(rg, dn), (g, r)])  # nope by sqrt(gamma), rope by gamma
        k_scale = columns([(rg, dn), (jnp.ones_like(g), dv)])  # the value half kept
        q, kv = attn[q_name], attn["kv_b_proj"]
        # [..., in, H, D] weights: the factors broadcast over the contraction axis.
        q = q * jnp.expand_dims(q_scale, -3).astype(q.dtype)
        kv = kv * jnp.expand_dims(k_scale, -3).astype(kv.dtype)
        return {**attn, q_name: q, "kv_b_proj": kv}

    out = dict(params)
    start = 0
    for stack, count in (
        ("dense_layers", config.first_k_dense),
        ("moe_layers", config.num_moe_layers),
    ):
        g, rg = gamma[start : start + count], root[start : start + count]
        if stack in params:  # scanned: [count, in, H, D]
            layer = params[stack]["layer"]
            out[stack] = {
                **params[stack],
                "layer": {**layer, "attn": clip_attn(layer["attn"], g, rg)},
            }
        else:
            for i in range(count):
                name = f"{stack}_{i}"
                out[name] = {**params[name], "attn": clip_attn(params[name]["attn"], g[i], rg[i])}
        start += count
    return out, over.sum()


def make_optimizer(opt, num_steps: int) -> optax.GradientTransformation:
    """The full chain: clip, then AdamW or Muon+AdamW, with the schedule; marked with
    ``optimizer.qk_clip_tau`` when QK-clip is on (``qk_clip_tau``)."""
    tau = float(opt.get("qk_clip_tau", 0.0))
    if not tau >= 0:
        raise ValueError(f"optimizer.qk_clip_tau={tau}: must be >= 0 (0 = off; Kimi K2: 100)")
    tx = _make_chain(opt, num_steps)
    if tau == 0:
        return tx
    marked = _QKClipped(tx.init, tx.update)
    marked.qk_clip_tau = tau
    return marked


def _make_chain(opt, num_steps: int) -> optax.GradientTransformation:
    schedule = make_schedule(opt, num_steps)
    if opt.name == "adamw":
        core = optax.adamw(
            schedule,
            b1=float(opt.b1),
            b2=float(opt.b2),
            eps=float(opt.eps),
            weight_decay=float(opt.weight_decay),
            mask=decay_mask,
        )
    elif opt.name == "muon":
        core = _experts_first(
            optax.contrib.muon(
                schedule,
                beta=float(opt.muon_beta),
                weight_decay=float(opt.weight_decay),
                weight_decay_mask=decay_mask,
                adam_b1=float(opt.b1),
                adam_b2=float(opt.b2),
                eps=float(opt.eps),
                adam_weight_decay=0.0,
                muon_weight_dimension_numbers=muon_dimension_numbers,
                consistent_rms=0.2,
            ),
            spread=bool(opt.get("muon_spread_experts", False)),
        )
    else:
        raise ValueError(f"optimizer.name={opt.name!r}: one of adamw, muon")
    if float(opt.clip_norm) > 0:
        return optax.chain(optax.clip_by_global_norm(float(opt.clip_norm)), core)
    return core
