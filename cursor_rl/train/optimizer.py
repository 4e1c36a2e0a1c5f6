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
"""

from __future__ import annotations

import jax
import optax
from optax.contrib import MuonDimensionNumbers

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


def _experts_first(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Runs ``inner`` on a view where stacked expert weights are [experts, layers, ...].

    Muon flattens a matrix's batch axes into one before orthogonalising. With the
    layer axis first, [layers, experts] -> [layers * experts] has its sharded
    (expert) part minor, which XLA cannot keep sharded: every device would
    orthogonalise all 384 experts. Experts first, the flattened axis stays sharded.
    """

    def init(params):
        return inner.init(_swap_layers_and_experts(params))

    def update(updates, state, params=None):
        view = None if params is None else _swap_layers_and_experts(params)
        new, state = inner.update(_swap_layers_and_experts(updates), state, view)
        return _swap_layers_and_experts(new), state

    return optax.GradientTransformation(init, update)


def make_optimizer(opt, num_steps: int) -> optax.GradientTransformation:
    """The full chain: clip, then AdamW or Muon+AdamW, with the schedule."""
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
            )
        )
    else:
        raise ValueError(f"optimizer.name={opt.name!r}: one of adamw, muon")
    if float(opt.clip_norm) > 0:
        return optax.chain(optax.clip_by_global_norm(float(opt.clip_norm)), core)
    return core
