"""Streaming HF import: each process reads only its shards' slices, straight into jax.Arrays.

``load_hf_checkpoint_sharded(path, mesh, rules)`` gives the same variables as
``hf.load_hf_checkpoint`` followed by a ``device_put`` into ``variable_shardings``,
without ever holding the model on the host: a released Kimi-K2 checkpoint (about
1 TB of block-fp8 safetensors) is read by every process of a pod at once, each
reading its share.

Choices:

1. One ``jax.make_array_from_callback`` per *model* array, with its target
   ``NamedSharding``; the callback builds one shard from the slices of the HF tensors
   that land in it. Model arrays are not HF tensors (``hf_mapping``: layers and
   experts stacked on leading axes, heads split out of a projection, fused
   ``gate_up_proj`` split in two), so a shard of a stacked array covers a range of
   layers/experts and reads, from each of those HF tensors, the one box its
   region of the shard needs. Going per HF tensor instead would need a host copy
   of the stacked array to scatter into.
2. The geometry comes from the spec alone: a ``Region``'s ``hf_view`` merges runs of
   consecutive model axes (never splits one) and a transpose takes it to the HF
   axes. A shard's box over the region is therefore one box of the HF tensor: per
   merged run, the range from its first to its last element, which is exactly the
   shard's elements when the inner axes of the run are whole (every rule in
   ``partitioning`` splits the outer one: heads, not head dims). Otherwise the
   covering range is read and the shard's elements taken from it: correct,
   over-reading only there. Fused tensors add the region's offset on the concat axis.
3. Dequantisation on the box (``hf.TensorReader``): a box may start or end inside a
   128 x 128 block (a shard boundary at 64, a dimension of 200 split in two), so each
   element takes the scale of its own block (``row // 128``, ``col // 128``) from
   the box of ``weight_scale_inv`` covering the blocks touched, in float32, then
   rounds once to the model's dtype: the same numbers as the host import.
4. Shards that several local devices share (axes a weight is replicated over) are
   read once per array: the callback caches by index until the array is built.
5. All checks first: ``hf.plan_hf_import`` checks names, shapes, dtypes and scales
   from the headers before any data is read or any device memory is allocated.
6. Memory: peak host memory is one model array's distinct local shards (what
   ``make_array_from_callback`` holds before its transfer) plus one box in float32
   while it is dequantised; every read maps only its span of the file and unmaps
   it at once (``hf.TensorReader.read_raw``).
"""

from __future__ import annotations

import itertools
import math
import os
from typing import Any

import jax
import numpy as np

from cursor_rl import partitioning
from cursor_rl.model import hf, hf_mapping
from cursor_rl.model.config import ModelConfig
from cursor_rl.model.hf_mapping import Region, TensorMapping
from cursor_rl.model.transformer import variable_shardings

Box = tuple[tuple[int, int], ...]


def load_hf_checkpoint_sharded(
    path: str | os.PathLike,
    mesh: jax.sharding.Mesh,
    rules: partitioning.LogicalRules = partitioning.DEFAULT_RULES,
    *,
    drop_mtp: bool = False,
    reads: list[tuple[str, Box]] | None = None,
    **overrides: Any,
) -> tuple[ModelConfig, dict[str, Any]]:
    """Reads an HF checkpoint (bf16/fp32 or block-fp8) into sharded jax.Arrays.

    Every process calls it with the same arguments (as it would ``device_put``);
    each reads only the boxes of the HF tensors its addressable shards need.

    Args:
      path: directory with ``config.json`` and the safetensors file(s).
      mesh: the device mesh (may span processes).
      rules: logical-axis rules; the arrays get ``variable_shardings(config, mesh, rules)``.
      drop_mtp: see ``hf.load_hf_checkpoint``.
      reads: when a list, every box read is appended as ``(tensor name, box)``.
      **overrides: ModelConfig fields not defined by ``config.json`` (``param_dtype``,
        ``scan_layers``, ...).

    Returns:
      ``(config, variables)``, ``variables = {"params": ..., "router": ...}`` as
      jax.Arrays in ``config.param_dtype`` (the router in float32).

    Raises:
      HFCheckpointError: the checkpoint does not match its config (before any read).
    """
    plan = hf.plan_hf_import(path, drop_mtp=drop_mtp, **overrides)
    config = plan.config
    shapes = hf_mapping.model_shapes(config)
    hf_mapping.check_spec(plan.spec, shapes)
    shardings = dict(hf_mapping.flatten_variables(variable_shardings(config, mesh, rules)))
    sources = _sources(plan.spec)
    reader = plan.reader(reads)
    arrays = {}
    for key, (shape, dtype) in shapes.items():
        build = _ShardBuilder(reader, sources[key], shape, dtype)
        arrays[key] = jax.make_array_from_callback(shape, shardings[key], build, dtype=dtype)
    return config, hf_mapping.unflatten_variables(arrays)


def _sources(
    spec: tuple[TensorMapping, ...],
) -> dict[str, dict[tuple[int, ...], tuple[TensorMapping, Region, int]]]:
    """Model array key -> {region index: (its HF tensor, the region, its offset on the
    tensor's concat axis)}."""
    sources: dict[str, dict[tuple[int, ...], tuple[TensorMapping, Region, int]]] = {}
    for mapping in spec:
        offset = 0
        for region in mapping.regions:
            sources.setdefault(region.key, {})[region.index] = (mapping, region, offset)
            offset += region.hf_shape[mapping.concat_axis]
    return sources


class _ShardBuilder:
    """The ``make_array_from_callback`` callback of one model array."""

    def __init__(self, reader: hf.TensorReader, sources, shape, dtype):
        self.reader, self.sources, self.shape, self.dtype = reader, sources, shape, dtype
        self.depth = len(next(iter(sources)))
        self.cache: dict[Box, np.ndarray] = {}

    def __call__(self, index: tuple[slice, ...]) -> np.ndarray:
        box = _box(index, self.shape)
        if box not in self.cache:
            self.cache[box] = self._build(box)
        return self.cache[box]

    def _build(self, box: Box) -> np.ndarray:
        out = np.empty([b - a for a, b in box], self.dtype)
        lead, rest = box[: self.depth], box[self.depth :]
        for index in itertools.product(*(range(a, b) for a, b in lead)):
            mapping, region, offset = self.sources[index]
            at = tuple(i - a for i, (a, _) in zip(index, lead))
            out[at] = read_region_box(self.reader, mapping, region, offset, rest)
        return out


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    box = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"shard index {index} of an array {shape} has a step")
        box.append((start, stop))
    return tuple(box)


def read_region_box(
    reader: hf.TensorReader, mapping: TensorMapping, region: Region, offset: int, box: Box
) -> np.ndarray:
    """The box ``box`` of ``region`` (in the model's axes), read from HF tensor ``mapping``.

    Returns float32 for an fp8 tensor, else the stored dtype; shape ``box``'s lengths.
    """
    groups = _merged_axes(region.shape, region.hf_view)
    view_box, gathers = [], []
    for axes in groups:
        sizes = [region.shape[a] for a in axes]
        ranges = [box[a] for a in axes]
        strides = [math.prod(sizes[k + 1 :]) for k in range(len(axes))]
        first = sum(a * s for (a, _), s in zip(ranges, strides))
        last = sum((b - 1) * s for (_, b), s in zip(ranges, strides))
        view_box.append((first, last + 1))
        count = math.prod(b - a for a, b in ranges)
        if last + 1 - first == count:
            gathers.append(None)
        else:  # inner axes of the run are split: take the shard's elements from the range
            grid = np.ix_(*(np.arange(a, b) for a, b in ranges))
            gathers.append(np.ravel_multi_index(grid, sizes).reshape(-1) - first)
    hf_box = [view_box[p] for p in region.perm]
    axis = mapping.concat_axis
    hf_box[axis] = (hf_box[axis][0] + offset, hf_box[axis][1] + offset)
    segment = reader.read(mapping.name, hf_box).transpose(np.argsort(region.perm))
    for v, gather in enumerate(gathers):
        if gather is not None:
            segment = np.take(segment, gather, axis=v)
    return segment.reshape([b - a for a, b in box])


def _merged_axes(shape: tuple[int, ...], view: tuple[int, ...]) -> list[list[int]]:
    """For each axis of ``view``, the run of consecutive ``shape`` axes merged into it."""
    groups: list[list[int]] = []
    axis = 0
    if not view:
        return groups
    for size in view:
        group, product = [], 1
        while axis < len(shape) and product < size:
            group.append(axis)
            product *= shape[axis]
            axis += 1
        groups.append(group)
        if product != size:
            raise ValueError(f"view {view} is not a merge of consecutive axes of {shape}")
    if any(shape[a] != 1 for a in range(axis, len(shape))):
        raise ValueError(f"view {view} is not a merge of consecutive axes of {shape}")
    groups[-1].extend(range(axis, len(shape)))  # trailing size-1 axes
    return groups
