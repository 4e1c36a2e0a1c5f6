"""Mesh axes, logical-axis rules and mesh construction.

This is the only module that names mesh axes. Layers annotate parameters and
activations with *logical* axis names (``embed``, ``heads``, ``expert``,
``act_batch``, ...); the rules below map each logical name onto zero or more mesh
axes. Configs may override individual rules (``mesh.rules`` in a config) or pick
a named preset.

Mesh axes, outermost (slowest links) first:

* ``data``    pure data parallelism; the only axis that may span slices (DCN).
* ``fsdp``    data parallelism with parameters and optimizer state sharded (ZeRO-3).
* ``context`` sequence sharding for long contexts: the ``long_context`` preset maps
              ``act_length`` onto it (no default rule does); attention then runs as a
              load-balanced ring over it (``cursor_rl.model.context_parallel``).
* ``expert``  expert parallelism: routed experts are split over it; outside the MoE
              layers it acts as extra data parallelism.
* ``tensor``  Megatron-style tensor parallelism (heads, MLP hidden, vocab).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "context", "expert", "tensor")

# Mesh axes that split the batch of activations outside the MoE layers.
BATCH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")

LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Parameters use bare names; activations use ``act_``-prefixed names so the two can be
# sharded differently (e.g. parameter ``embed`` over fsdp, activation ``act_embed``
# replicated). A name may have several rules: the first whose mesh axes the array
# has not used yet applies. So routed-expert weights take ``expert`` for their
# expert dimension and shard ``embed`` over fsdp only, while every other weight
# shards ``embed`` over fsdp and expert together (at pod scale the expert axis is
# large: 64 devices would otherwise each hold a full copy of the dense weights).
DEFAULT_RULES: LogicalRules = (
    # Parameters.
    ("expert", "expert"),
    ("vocab", "tensor"),
    ("embed", ("fsdp", "expert")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("mlp", "tensor"),
    ("router", None),
    ("norm", None),
    ("layers", None),
    # Activations.
    ("act_batch", BATCH_AXES),
    ("act_length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # Cache (sampler): batch of sequences over the batch axes, latent replicated.
    ("cache_batch", BATCH_AXES),
    ("cache_length", None),
    ("cache_latent", None),
)


def _with_context(axes: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """``axes`` with ``context`` added after ``fsdp`` (parameter sharding over context)."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    at = axes.index("fsdp") + 1 if "fsdp" in axes else 0
    return (*axes[:at], "context", *axes[at:])


# Named presets, so configs can say ``mesh.rules_preset = "..."``.
_PRESETS: dict[str, LogicalRules] = {
    "default": DEFAULT_RULES,
    # Dense weights over fsdp only (the layout before expert-axis FSDP; small meshes).
    "fsdp_only": tuple(r for r in DEFAULT_RULES if r != ("embed", ("fsdp", "expert"))),
    # Long context: split the sequence of activations over the context axis, and the
    # parameters over it too (FSDP over context as well: the context devices would
    # otherwise each hold what their fsdp/expert peers hold).
    "long_context": tuple(
        (name, "context")
        if name == "act_length"
        else (name, _with_context(axes) if name == "embed" else axes)
        for name, axes in DEFAULT_RULES
    ),
}


def rules_preset(name: str) -> LogicalRules:
    """Returns the logical-axis rules registered under ``name``."""
    if name not in _PRESETS:
        raise ValueError(f"mesh.rules_preset={name!r} is not one of {sorted(_PRESETS)}")
    return _PRESETS[name]


def make_rules(
    preset: str = "default", overrides: Mapping[str, str | Sequence[str] | None] | None = None
) -> LogicalRules:
    """Builds rules from a preset with per-name overrides (``{"embed": None}``).

    An override replaces every rule of that name, at the place of the first.
    """
    rules = list(rules_preset(preset))
    known = {name for name, _ in rules}
    for name, axes in (overrides or {}).items():
        if name not in known:
            raise ValueError(f"mesh.rules: unknown logical axis {name!r}; known: {sorted(known)}")
        if isinstance(axes, str | type(None)):
            _check_axes([axes] if axes else [])
        else:
            _check_axes(axes)
            axes = tuple(axes)
        first = next(i for i, (n, _) in enumerate(rules) if n == name)
        rules = [r for r in rules if r[0] != name]
        rules.insert(first, (name, axes))
    return tuple(rules)


def _check_axes(axes: Sequence[str]) -> None:
    for axis in axes:
        if axis not in MESH_AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; mesh axes are {MESH_AXES}")


def resolve_mesh_shape(shape: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Fills the one ``-1`` entry of ``shape`` so the product equals ``num_devices``.

    Axes missing from ``shape`` get size 1. Raises ValueError naming the axis when
    the shape cannot be satisfied.
    """
    for axis in shape:
        _check_axes([axis])
    sizes = {axis: int(shape.get(axis, 1)) for axis in MESH_AXES}
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {free}")
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ValueError(f"mesh.{axis}={size} must be positive or -1")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"mesh: {num_devices} devices are not divisible by the fixed axes' product {fixed}"
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(f"mesh: axes multiply to {fixed} but there are {num_devices} devices")
    return sizes


def make_mesh(
    ici: Mapping[str, int] | None = None,
    dcn: Mapping[str, int] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds a device mesh over ``MESH_AXES``.

    Args:
      ici: axis sizes within a slice (``-1`` once to take the remaining devices);
        defaults to pure data parallelism.
      dcn: axis sizes across slices (multi-slice TPU); only ``data`` may be > 1.
      devices: defaults to ``jax.devices()``.

    Returns:
      A mesh with auto-sharded axes, named ``MESH_AXES``.
    """
    devices = list(jax.devices() if devices is None else devices)
    dcn_sizes = {axis: 1 for axis in MESH_AXES}
    for axis, size in (dcn or {}).items():
        _check_axes([axis])
        if size != 1 and axis != "data":
            raise ValueError(f"mesh.dcn.{axis}={size}: only 'data' may span slices")
        dcn_sizes[axis] = int(size)
    num_slices = math.prod(dcn_sizes.values())
    if len(devices) % num_slices:
        raise ValueError(f"{len(devices)} devices do not split into {num_slices} slices")
    ici_sizes = resolve_mesh_shape(ici or {"data": -1}, len(devices) // num_slices)
    ici_shape = [ici_sizes[a] for a in MESH_AXES]
    if num_slices > 1:
        device_array = mesh_utils.create_hybrid_device_mesh(
            ici_shape, [dcn_sizes[a] for a in MESH_AXES], devices=devices
        )
    elif devices[0].platform in ("tpu", "gpu") and len(devices) == len(jax.devices()):
        device_array = mesh_utils.create_device_mesh(ici_shape, devices=devices)
    else:
        device_array = np.asarray(devices, dtype=object).reshape(ici_shape)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_axis_size(mesh: Mesh | jax.sharding.AbstractMesh, axes: str | Sequence[str]) -> int:
    """Product of the sizes of ``axes`` in ``mesh`` (1 for axes it lacks)."""
    axes = (axes,) if isinstance(axes, str) else axes
    shape = dict(mesh.shape)
    return math.prod(shape.get(axis, 1) for axis in axes)


def split_axes(
    mesh: Mesh | jax.sharding.AbstractMesh, logical: str, default: str | Sequence[str] | None = None
) -> tuple[str, ...]:
    """The mesh axes of size > 1 that the current rules map ``logical`` onto (or ``default``
    when the rules do not name it); empty when it is not split over devices."""
    return live_axes(mesh, dict(nn.get_logical_axis_rules()).get(logical, default))


def dividing_axes(
    mesh: Mesh | jax.sharding.AbstractMesh,
    logical: str,
    default: str | Sequence[str] | None,
    size: int,
    taken: Sequence[str] = (),
) -> tuple[str, ...]:
    """The mesh axes ``logical``'s rule splits a dimension of ``size`` over, less those
    already ``taken`` by another dimension, if together they divide ``size``; empty
    otherwise (the dimension stays whole). For ``shard_map`` specs built from the rules."""
    axes = tuple(a for a in split_axes(mesh, logical, default) if a not in taken)
    if not axes or size % mesh_axis_size(mesh, axes):
        return ()
    return axes


def live_axes(
    mesh: Mesh | jax.sharding.AbstractMesh, entry: str | Sequence[str] | None
) -> tuple[str, ...]:
    """The mesh axes of size > 1 named by a rule's value or a PartitionSpec entry (one
    axis name, several, or None)."""
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    shape = dict(mesh.shape)
    return tuple(a for a in names if shape.get(a, 1) > 1)


def length_sharded() -> bool:
    """Whether the mesh and rules current for tracing shard the sequence (``act_length``)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and bool(split_axes(mesh, "act_length"))


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> Iterator[Mesh]:
    """Makes ``mesh`` and ``rules`` current for tracing (jit, logical constraints, shard_map)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield mesh


def logical_to_spec(logical_axes: Sequence[str | None], rules: LogicalRules) -> PartitionSpec:
    """Maps a tuple of logical axis names to a PartitionSpec."""
    return nn.logical_to_mesh_axes(tuple(logical_axes), rules)


def logical_sharding(
    logical_axes: Sequence[str | None], mesh: Mesh, rules: LogicalRules
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules))


def tree_shardings(abstract_tree, mesh: Mesh, rules: LogicalRules):
    """NamedShardings for a pytree whose leaves may be logically annotated.

    Boxed leaves (``nn.LogicallyPartitioned``) map through ``rules``; other leaves
    are replicated. The result has the boxes removed (same structure as
    ``strip_axis_metadata(abstract_tree)``).
    """
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)

    def one(leaf):
        if is_box(leaf):
            inner = leaf.unbox(apply_constraint=False)
            if not hasattr(inner, "shape"):  # a box around an empty node (optax MaskedNode)
                return inner
            return NamedSharding(mesh, logical_to_spec(leaf.get_partition_spec(), rules))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, abstract_tree, is_leaf=is_box)


def strip_axis_metadata(tree):
    """Removes the logical-axis boxes (``nn.LogicallyPartitioned``) from a pytree.

    Unlike ``nn.meta.unbox`` this applies no sharding constraint, so it is safe on
    abstract values and inside a mesh context.
    """
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
    return jax.tree.map(
        lambda x: x.unbox(apply_constraint=False) if is_box(x) else x, tree, is_leaf=is_box
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
