"""The one mapping between our variables and Hugging Face DeepSeek-V3 tensor names.

MaxText's ``param_mapping.py`` idea: a single spec serves HF import, HF export and
any weight transfer keyed by HF names (e.g. trainer -> a sampler with another
layout, or -> an engine that loads HF-named tensors). ``weight_spec(config)`` lists
every HF tensor with the region(s) of our variables it holds; a region is read or
written by one reshape and one transpose, so the two directions cannot drift apart.
``check_spec`` proves the spec tiles every model variable exactly once.

Streaming pair: ``iter_hf_tensors(config_a, variables)`` yields ``(name, tensor)``
one at a time and ``variables_from_hf_tensors(config_b, stream)`` fills
preallocated host arrays from such a stream, so

    variables_from_hf_tensors(sampler_config, iter_hf_tensors(trainer_config, variables))

moves weights between the scanned and unscanned layouts or param dtypes without a
second full copy. ``hf_stream`` reads the same regions the other way round: for a
shard of a model array, the box of each HF tensor that lands in it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from cursor_rl.model.config import ModelConfig
from cursor_rl.model.transformer import abstract_variables

EXPERT_LAYOUTS = ("per_expert", "fused")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint we cannot convert faithfully; the message names why."""


@dataclasses.dataclass(frozen=True)
class Region:
    """``variables[collection][path][index]``: a block of one model variable.

    The HF segment it corresponds to is ``region.reshape(hf_view).transpose(perm)``;
    the inverse takes a segment back.

    Attributes:
      collection: ``"params"`` or ``"router"``.
      path: keys from the collection down to the leaf array.
      index: leading indices into the leaf (layer of a scanned stack, expert).
      shape: the region's shape, ``leaf.shape[len(index):]``.
      hf_view: the region reshaped before the transpose.
      perm: the transpose from ``hf_view`` to the HF segment's axes.
    """

    collection: str
    path: tuple[str, ...]
    index: tuple[int, ...]
    shape: tuple[int, ...]
    hf_view: tuple[int, ...]
    perm: tuple[int, ...]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(self.hf_view[p] for p in self.perm)

    @property
    def key(self) -> str:
        return "/".join((self.collection, *self.path))

    def to_hf(self, region: np.ndarray) -> np.ndarray:
        return np.reshape(region, self.hf_view).transpose(self.perm)

    def from_hf(self, segment: np.ndarray) -> np.ndarray:
        return segment.transpose(np.argsort(self.perm)).reshape(self.shape)


@dataclasses.dataclass(frozen=True)
class TensorMapping:
    """One HF tensor and the regions of our variables it holds.

    Attributes:
      name: the HF tensor name, e.g. ``model.layers.3.self_attn.q_proj.weight``.
      shape: its shape.
      regions: what it holds; several (fused ``gate_up_proj``) are concatenated
        along ``concat_axis``; none for the zero-size shared experts HF keeps
        when ``n_shared_experts == 0``.
      concat_axis: the HF axis the regions are concatenated on.
      keep_fp32: stays float32 whatever the export dtype (routing decisions; HF
        keeps the router in float32 too).
      quantizable: a linear projection weight of a decoder layer, which a block-fp8
        checkpoint (DeepSeek-V3 / Kimi-K2 release) may store as float8 with per-block
        ``weight_scale_inv``; embeddings, norms, the router and ``lm_head`` never.
    """

    name: str
    shape: tuple[int, ...]
    regions: tuple[Region, ...]
    concat_axis: int = 0
    keep_fp32: bool = False
    quantizable: bool = False

    def gather(self, variables: Mapping[str, Any]) -> np.ndarray:
        """The HF tensor, built from ``variables`` (numpy or jax arrays)."""
        if not self.regions:
            return np.zeros(self.shape, np.float32)
        segments = [r.to_hf(np.asarray(_leaf(variables, r)[r.index])) for r in self.regions]
        tensor = segments[0] if len(segments) == 1 else np.concatenate(segments, self.concat_axis)
        return np.ascontiguousarray(tensor)

    def scatter(self, tensor: np.ndarray, variables: Mapping[str, Any]) -> None:
        """Writes the HF ``tensor`` into the preallocated numpy arrays of ``variables``."""
        bounds = np.cumsum([r.hf_shape[self.concat_axis] for r in self.regions])[:-1]
        for region, segment in zip(self.regions, np.split(tensor, bounds, self.concat_axis)):
            _leaf(variables, region)[region.index] = region.from_hf(segment)


def _leaf(variables: Mapping[str, Any], region: Region):
    node = variables[region.collection]
    for key in region.path:
        node = node[key]
    return node


def _same(path, index, shape, collection="params") -> Region:
    return Region(collection, path, index, shape, shape, tuple(range(len(shape))))


def _linear(path, index, shape, in_dims) -> Region:
    """A kernel [in..., out...] stored as torch's ``nn.Linear.weight`` [out, in]."""
    view = (math.prod(shape[:in_dims]), math.prod(shape[in_dims:]))
    return Region("params", path, index, shape, view, (1, 0))


def _experts(path, index, shape) -> Region:
    """Stacked expert kernels [E, in, out] in the fused [E, out, in] layout."""
    return Region("params", path, index, shape, shape, (0, 2, 1))


def _one(
    name: str, region: Region, keep_fp32: bool = False, quantizable: bool = False
) -> TensorMapping:
    return TensorMapping(
        name, region.hf_shape, (region,), keep_fp32=keep_fp32, quantizable=quantizable
    )


def weight_spec(
    config: ModelConfig, expert_layout: str = "per_expert"
) -> tuple[TensorMapping, ...]:
    """The mapping between our variables and HF tensor names, in checkpoint order.

    It covers every variable of ``config``'s model exactly once (in the scanned or
    unscanned layout, per ``config.scan_layers``).

    Args:
      config: the model config.
      expert_layout: ``"per_expert"`` or ``"fused"`` routed-expert tensors.

    Returns:
      One ``TensorMapping`` per HF tensor.
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout={expert_layout!r}: must be one of {EXPERT_LAYOUTS}")
    c = config
    d = c.hidden_size
    spec = [_one("model.embed_tokens.weight", _same(("embed",), (), (c.vocab_size, d)))]
    for i in range(c.num_layers):
        spec += _layer_spec(c, i, expert_layout)
    spec.append(_one("model.norm.weight", _same(("final_norm", "scale"), (), (d,))))
    if not c.tie_word_embeddings:
        spec.append(_one("lm_head.weight", _linear(("lm_head",), (), (d, c.vocab_size), 1)))
    return tuple(spec)


def _layer_spec(c: ModelConfig, i: int, expert_layout: str) -> list[TensorMapping]:
    """The tensors of HF decoder layer ``i``."""
    d, h, e, f = c.hidden_size, c.num_heads, c.n_routed_experts, c.moe_intermediate_size
    moe = i >= c.first_k_dense
    stack, local = ("moe_layers", i - c.first_k_dense) if moe else ("dense_layers", i)
    prefix, index = ((stack, "layer"), (local,)) if c.scan_layers else ((f"{stack}_{local}",), ())
    hf = f"model.layers.{i}."

    def norm(name: str, path: tuple[str, ...], size: int) -> TensorMapping:
        return _one(hf + name, _same((*prefix, *path, "scale"), index, (size,)))

    def linear(name: str, path: tuple[str, ...], shape, in_dims: int = 1) -> TensorMapping:
        return _one(hf + name, _linear((*prefix, *path), index, shape, in_dims), quantizable=True)

    spec = [
        norm("input_layernorm.weight", ("input_norm",), d),
        norm("post_attention_layernorm.weight", ("post_attn_norm",), d),
    ]
    if c.q_lora_rank is None:
        spec.append(linear("self_attn.q_proj.weight", ("attn", "q_proj"), (d, h, c.qk_head_dim)))
    else:
        r = c.q_lora_rank
        spec += [
            linear("self_attn.q_a_proj.weight", ("attn", "q_a_proj"), (d, r)),
            norm("self_attn.q_a_layernorm.weight", ("attn", "q_a_norm"), r),
            linear("self_attn.q_b_proj.weight", ("attn", "q_b_proj"), (r, h, c.qk_head_dim)),
        ]
    kv_a = (d, c.kv_lora_rank + c.qk_rope_head_dim)
    kv_b = (c.kv_lora_rank, h, c.qk_nope_head_dim + c.v_head_dim)
    spec += [
        linear("self_attn.kv_a_proj_with_mqa.weight", ("attn", "kv_a_proj"), kv_a),
        norm("self_attn.kv_a_layernorm.weight", ("attn", "kv_a_norm"), c.kv_lora_rank),
        linear("self_attn.kv_b_proj.weight", ("attn", "kv_b_proj"), kv_b),
        linear("self_attn.o_proj.weight", ("attn", "o_proj"), (h, c.v_head_dim, d), in_dims=2),
    ]
    if not moe:
        return spec + _swiglu(hf + "mlp.", (*prefix, "mlp"), index, d, c.intermediate_size)
    block = (*prefix, "moe")
    bias = _same((*block, "bias"), index, (e,), collection="router")
    spec += [
        _one(hf + "mlp.gate.weight", _linear((*block, "router"), index, (d, e), 1), True),
        _one(hf + "mlp.gate.e_score_correction_bias", bias, True),
    ]
    if c.n_shared_experts:
        spec += _swiglu(
            hf + "mlp.shared_experts.", (*block, "shared"), index, d, f * c.n_shared_experts
        )
    else:
        # HF keeps zero-size shared-expert weights; we have no such variables.
        spec += [
            TensorMapping(hf + f"mlp.shared_experts.{name}.weight", shape, (), quantizable=True)
            for name, shape in (("gate_proj", (0, d)), ("up_proj", (0, d)), ("down_proj", (d, 0)))
        ]
    if expert_layout == "per_expert":
        for j in range(e):
            spec += _swiglu(hf + f"mlp.experts.{j}.", block, (*index, j), d, f)
        return spec
    gate_up = (
        _experts((*block, "gate_proj"), index, (e, d, f)),
        _experts((*block, "up_proj"), index, (e, d, f)),
    )
    down = _experts((*block, "down_proj"), index, (e, f, d))
    spec += [
        TensorMapping(
            hf + "mlp.experts.gate_up_proj", (e, 2 * f, d), gate_up, concat_axis=1, quantizable=True
        ),
        _one(hf + "mlp.experts.down_proj", down, quantizable=True),
    ]
    return spec


def _swiglu(hf: str, path: tuple[str, ...], index, d: int, f: int) -> list[TensorMapping]:
    return [
        _one(hf + f"{name}.weight", _linear((*path, name), index, shape, 1), quantizable=True)
        for name, shape in (("gate_proj", (d, f)), ("up_proj", (d, f)), ("down_proj", (f, d)))
    ]


def model_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of every model variable, keyed ``collection/path/...``."""
    return dict(_model_shapes(config))


@functools.lru_cache(maxsize=16)
def _model_shapes(config: ModelConfig) -> tuple[tuple[str, tuple[tuple[int, ...], np.dtype]], ...]:
    # Tracing the model's init takes a noticeable fraction of a second; configs repeat.
    tree = nn.meta.unbox(abstract_variables(config))
    return tuple(
        (key, (tuple(leaf.shape), np.dtype(leaf.dtype))) for key, leaf in flatten_variables(tree)
    )


def flatten_variables(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``("collection/path/to/leaf", leaf)`` for every leaf of nested mappings."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from flatten_variables(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value


def unflatten_variables(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of ``flatten_variables``."""
    tree: dict[str, Any] = {}
    for key, leaf in flat.items():
        *parents, last = key.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[last] = leaf
    return tree


def check_spec(spec: tuple[TensorMapping, ...], shapes: Mapping[str, tuple]) -> None:
    """Raises if the spec does not tile every variable in ``shapes`` exactly once.

    Guards against a model change (a new parameter, a renamed module) that the
    spec has not followed: that would otherwise be a silent partial load.
    """
    regions: dict[str, set[tuple[int, ...]]] = {}
    for mapping in spec:
        for r in mapping.regions:
            if r.key not in shapes:
                raise HFCheckpointError(f"{mapping.name} maps to {r.key}, which the model lacks")
            shape = shapes[r.key][0]
            if shape[len(r.index) :] != r.shape:
                raise HFCheckpointError(
                    f"{mapping.name}: region {r.shape} does not fit {r.key} {shape}"
                )
            regions.setdefault(r.key, set()).add(r.index)
    for key, (shape, _) in shapes.items():
        indices = regions.get(key, set())
        depth = {len(i) for i in indices}
        full = len(depth) == 1 and len(indices) == math.prod(shape[: depth.pop()])
        if not full:
            raise HFCheckpointError(f"model variable {key} {shape} has no complete HF counterpart")


# ---- streaming ----------------------------------------------------------------------


def iter_hf_tensors(
    config: ModelConfig,
    variables: Mapping[str, Any],
    *,
    expert_layout: str = "per_expert",
    dtype: str | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """``(hf_name, tensor)`` one at a time: to export, or to push to an HF-named engine.

    The variables are checked against the model when called; tensors are built
    only as the iterator is consumed.

    Args:
      config: the model config (its ``scan_layers`` must match ``variables``).
      variables: ``{"params": ..., "router": ...}`` (numpy or jax arrays).
      expert_layout: ``"per_expert"`` or ``"fused"`` routed-expert tensors.
      dtype: cast to this (``float32``/``bfloat16``/``float16``); the router stays
        float32. None keeps each variable's dtype.
    """
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {EXPORT_DTYPES}")
    variables = nn.meta.unbox(variables)
    shapes = model_shapes(config)
    given = {key: tuple(np.shape(leaf)) for key, leaf in flatten_variables(variables)}
    for key, (shape, _) in shapes.items():
        if key not in given:
            raise HFCheckpointError(f"variables lack {key} (scan_layers={config.scan_layers})")
        if given[key] != shape:
            raise HFCheckpointError(f"variable {key} has shape {given[key]}, expected {shape}")
    extra = sorted(set(given) - set(shapes))
    if extra:
        raise HFCheckpointError(f"variables hold {extra[0]}, which the model lacks")
    spec = weight_spec(config, expert_layout)
    check_spec(spec, shapes)
    return _gather_all(spec, variables, None if dtype is None else jnp.dtype(dtype))


def _gather_all(spec, variables, dtype) -> Iterator[tuple[str, np.ndarray]]:
    # A generator apart from iter_hf_tensors, so that bad input fails at the call.
    for mapping in spec:
        tensor = mapping.gather(variables)
        if mapping.keep_fp32:
            tensor = tensor.astype(np.float32)
        elif dtype is not None:
            tensor = tensor.astype(dtype)
        yield mapping.name, tensor


def variables_from_hf_tensors(
    config: ModelConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    expert_layout: str = "per_expert",
) -> dict[str, Any]:
    """Builds variables from a stream of ``(hf_name, tensor)``, one tensor at a time.

    The receiving end of ``iter_hf_tensors``: together they move weights between
    any two layouts (scanned or not, any param dtype) without a full second copy.

    Args:
      config: the model config of the variables to build.
      tensors: every tensor of ``weight_spec(config, expert_layout)`` once, any order.
      expert_layout: ``"per_expert"`` or ``"fused"`` routed-expert tensors.

    Returns:
      ``{"params": ..., "router": ...}`` as host numpy arrays.
    """
    spec = weight_spec(config, expert_layout)
    shapes = model_shapes(config)
    check_spec(spec, shapes)
    variables = unflatten_variables({k: np.empty(s, d) for k, (s, d) in shapes.items()})
    pending = {m.name: m for m in spec}
    for name, tensor in tensors:
        mapping = pending.pop(name, None)
        if mapping is None:
            raise HFCheckpointError(f"unexpected or repeated tensor {name!r}")
        if tuple(tensor.shape) != mapping.shape:
            raise HFCheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {mapping.shape}"
            )
        mapping.scatter(tensor, variables)
    if pending:
        raise HFCheckpointError(f"missing tensor {min(pending)!r} ({len(pending)} missing in all)")
    return variables
