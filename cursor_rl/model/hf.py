"""Hugging Face interop: DeepSeek-V3 / Kimi-K2 checkpoint directories <-> our variables.

The tensor-name mapping lives in ``hf_mapping`` (one spec for import, export and
weight transfer); this module handles ``config.json`` and the safetensors files.

* Config: ``model_type`` ``deepseek_v3`` or ``kimi_k2`` (Kimi K2's text model is
  the DeepSeek-V3 architecture). RoPE comes either as the transformers-5
  ``rope_parameters`` or as the published configs' legacy ``rope_scaling`` plus
  top-level ``rope_theta``; anything that changes the maths and that our model
  does not implement is refused by name.
* Tensors: one ``model.safetensors`` or shards listed in
  ``model.safetensors.index.json``. Routed experts come either per expert
  (``mlp.experts.{j}.gate_proj.weight``: the published checkpoints, and what
  transformers' ``save_pretrained`` writes) or fused
  (``mlp.experts.gate_up_proj`` [E, 2F, D], ``mlp.experts.down_proj`` [E, D, F]:
  transformers' in-memory ``state_dict``).
* FP8: the released DeepSeek-V3 / Kimi-K2 weights are block-wise fp8
  (``quantization_config`` ``quant_method: fp8``, ``fmt: e4m3``,
  ``weight_block_size: [128, 128]``): each decoder-layer projection ``X.weight`` is
  float8_e4m3fn with a float32 ``X.weight_scale_inv`` holding one factor per
  128 x 128 block (the last block of a dimension that is no multiple of 128 is
  partial), and the weight is ``fp8 value x scale_inv`` of its block. The reader
  dequantises to float32 on whatever slice it reads, indexing the scales by block,
  so a slice may cut a block; the caller rounds once to the model dtype.
  Embeddings, norms, the router and ``lm_head`` stay bf16/fp32.
* Reading: tensors are read straight from the safetensors layout (header, then a
  box of one tensor; ``TensorReader``), because safetensors' numpy reader cannot
  return float8. ``load_hf_checkpoint`` fills preallocated host arrays one tensor
  at a time; ``hf_stream.load_hf_checkpoint_sharded`` reads only the slices of
  each process's shards straight into sharded device arrays. The saver builds one
  shard at a time. None holds two copies of the model.
* Latent norms: transformers (like DeepSeek's and Moonshot's own modeling code)
  builds ``q_a_layernorm``/``kv_a_layernorm`` with eps 1e-6 whatever
  ``rms_norm_eps`` says; the import sets ``latent_norm_eps`` to that, and the
  export refuses a model whose latent eps a config.json cannot express.
* Strict: names, shapes and dtypes of every tensor, and of every fp8 weight's
  scales, are checked before any data is read (``plan_hf_import``); a missing,
  extra, misshapen or wrongly quantized tensor, an unsupported option, or an
  unreadable file raises ``HFCheckpointError`` naming it. Export writes bf16/fp32
  (no fp8).
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
from safetensors import safe_open

from cursor_rl.model.config import ModelConfig, RopeScaling
from cursor_rl.model.hf_mapping import (
    HFCheckpointError,
    TensorMapping,
    iter_hf_tensors,
    variables_from_hf_tensors,
    weight_spec,
)

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Float dtypes a checkpoint may store (safetensors names); F8_E4M3 only for the
# projection weights of a block-fp8 checkpoint; anything else (I8, U8, F8_E5M2, ...)
# is a quantized tensor that needs dequantising first.
_FLOAT_DTYPES = ("F32", "BF16", "F16")
FP8_DTYPE = "F8_E4M3"
# The per-block scales of ``X.weight`` are ``X.weight_scale_inv``.
SCALE_SUFFIX = "_scale_inv"
# safetensors dtype -> numpy dtype (little-endian), for the dtypes we read.
_NUMPY_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(jnp.bfloat16),
    FP8_DTYPE: np.dtype(jnp.float8_e4m3fn),
}
# Bytes per element of every safetensors dtype, to check a header's offsets.
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
    "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip

_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


# ---- config.json --------------------------------------------------------------------

# HF field -> ModelConfig field, for fields without a universal default: a missing
# one would make transformers fall back to DeepSeek-V3-671B values, so we refuse.
_REQUIRED_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "moe_intermediate_size": "moe_intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "n_routed_experts": "n_routed_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "n_shared_experts": "n_shared_experts",
    "n_group": "n_group",
    "topk_group": "topk_group",
    "first_k_dense_replace": "first_k_dense",
    "routed_scaling_factor": "routed_scaling_factor",
}
# Fields with transformers' DeepseekV3Config defaults.
_OPTIONAL_FIELDS = {
    "norm_topk_prob": True,
    "rope_interleave": True,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
}
# Options our model implements only with one value (absent = that value).
_FIXED_OPTIONS = {
    "hidden_act": "silu",
    "attention_bias": False,
    "scoring_func": "sigmoid",  # published DeepSeek-V3 / Kimi-K2 configs
    "topk_method": "noaux_tc",
    "moe_layer_freq": 1,
}
# The eps of the MLA latent norms in transformers' DeepseekV3Attention: the RMSNorm
# default, not config.rms_norm_eps (no config.json field changes it).
HF_LATENT_NORM_EPS = 1e-6
_ROPE_KEYS = {
    "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
    "attention_factor", "partial_rotary_factor",
}  # fmt: skip

# ModelConfig fields that come from config.json (the rest, e.g. dtypes or the
# layer layout, may be chosen by the caller).
HF_DERIVED_FIELDS = frozenset(
    {
        *_REQUIRED_FIELDS.values(),
        *_OPTIONAL_FIELDS,
        "q_lora_rank",
        "rope_theta",
        "rope_scaling",
        "latent_norm_eps",
    }
)


def config_from_hf(hf_config: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """Our ``ModelConfig`` from an HF ``config.json`` dict.

    Args:
      hf_config: the parsed ``config.json``.
      **overrides: ModelConfig fields not defined by ``config.json`` (``param_dtype``,
        ``dtype``, ``scan_layers``, ``moe_impl``, ...).

    Returns:
      The validated config.

    Raises:
      HFCheckpointError: naming the unsupported or inconsistent field.
    """
    hf = dict(hf_config)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFCheckpointError(
            f"config.json: model_type={model_type!r} is not supported; "
            f"expected one of {SUPPORTED_MODEL_TYPES} (text models)"
        )
    weight_quantization(hf)  # refuses all but DeepSeek-V3's block-wise fp8
    for field, value in _FIXED_OPTIONS.items():
        if hf.get(field, value) != value:
            raise HFCheckpointError(
                f"config.json: {field}={hf[field]!r} is not supported (only {value!r})"
            )
    heads = hf.get("num_attention_heads")
    if hf.get("num_key_value_heads") not in (None, heads):
        raise HFCheckpointError(
            f"config.json: num_key_value_heads={hf['num_key_value_heads']!r} must equal "
            f"num_attention_heads={heads!r} (MLA shares the latent, not grouped heads)"
        )
    bad = sorted(set(overrides) & HF_DERIVED_FIELDS)
    if bad:
        raise HFCheckpointError(f"overrides {bad} conflict with config.json, which defines them")

    values: dict[str, Any] = {}
    for hf_name, name in _REQUIRED_FIELDS.items():
        if hf.get(hf_name) is None:
            raise HFCheckpointError(f"config.json: required field {hf_name!r} is missing")
        values[name] = hf[hf_name]
    if "q_lora_rank" not in hf:
        raise HFCheckpointError(
            "config.json: required field 'q_lora_rank' is missing (may be null)"
        )
    values["q_lora_rank"] = hf["q_lora_rank"]
    for name, default in _OPTIONAL_FIELDS.items():
        values[name] = default if hf.get(name) is None else hf[name]
    values["latent_norm_eps"] = HF_LATENT_NORM_EPS
    values["rope_theta"], values["rope_scaling"] = _rope_from_hf(hf, values)
    try:
        return ModelConfig.from_dict({**values, **overrides})
    except (TypeError, ValueError) as err:
        raise HFCheckpointError(f"config.json: {err}") from err


def _rope_from_hf(hf: dict[str, Any], values: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE base and YaRN parameters, resolved the way transformers resolves them."""
    # transformers: a legacy ``rope_scaling`` wins over ``rope_parameters``; the top-level
    # ``rope_theta`` only fills a gap.
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    unknown = sorted(set(rope) - _ROPE_KEYS)
    if unknown:
        raise HFCheckpointError(f"config.json: {field} key(s) {unknown} are not supported")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFCheckpointError(f"config.json: {field}.partial_rotary_factor must be 1.0")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise HFCheckpointError(
            f"config.json: {field} type {rope_type!r} is not supported (only 'default' and 'yarn')"
        )
    if rope.get("attention_factor") is not None:
        raise HFCheckpointError(f"config.json: {field}.attention_factor is not supported")
    original = hf.get("original_max_position_embeddings") or rope.get(
        "original_max_position_embeddings", values["max_position_embeddings"]
    )
    factor = rope.get("factor")
    if factor is None:
        factor = values["max_position_embeddings"] / original
    scaling = RopeScaling(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        # transformers reads these with ``or``: absent, null and 0 all mean the default.
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        # Absent mscale is 0 here: transformers then uses mscale(factor) for the cos/sin
        # amplitude, exactly what our ``mscale and mscale_all_dim`` test falls back to.
        mscale=float(rope.get("mscale") or 0.0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        truncate=bool(rope.get("truncate", True)),
    )
    return theta, scaling


@dataclasses.dataclass(frozen=True)
class Fp8Blocks:
    """``config.json``'s block-wise fp8 ``quantization_config`` (DeepSeek-V3, Kimi-K2).

    Attributes:
      block: rows and columns of the weight that share one ``weight_scale_inv`` entry.
    """

    block: tuple[int, int] = (128, 128)

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The ``weight_scale_inv`` shape of a weight: one entry per block of its last
        two axes (a partial last block counts), leading axes (fused experts) kept."""
        rows, cols = self.block
        return (*shape[:-2], -(-shape[-2] // rows), -(-shape[-1] // cols))


def weight_quantization(hf_config: Mapping[str, Any]) -> Fp8Blocks | None:
    """The weight quantization ``config.json`` declares: None, or block-wise fp8.

    Accepted as DeepSeek-V3's and Kimi-K2's released configs write it (absent keys
    take transformers' ``FineGrainedFP8Config`` defaults): ``quant_method: fp8``,
    ``fmt: e4m3``, ``activation_scheme: dynamic``, ``weight_block_size: [128, 128]``
    (another block size is read as given).

    Raises:
      HFCheckpointError: another method, format or activation scheme, or a malformed
        block size, named.
    """
    q = hf_config.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, Mapping):
        raise HFCheckpointError(f"config.json: quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise HFCheckpointError(
            f"config.json: quantization_config (quant_method={method!r}) is not supported: "
            "only DeepSeek-V3's block-wise 'fp8'; dequantise the weights to bf16/fp32 first"
        )
    for field, value in (("fmt", "e4m3"), ("activation_scheme", "dynamic")):
        if q.get(field, value) != value:
            raise HFCheckpointError(
                f"config.json: quantization_config.{field}={q[field]!r} is not supported "
                f"(only {value!r})"
            )
    block = q.get("weight_block_size", (128, 128))
    if (
        not isinstance(block, Sequence)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise HFCheckpointError(
            f"config.json: quantization_config.weight_block_size={block!r} must be two "
            "positive integers (DeepSeek-V3: [128, 128])"
        )
    return Fp8Blocks(block=(block[0], block[1]))


def config_to_hf(config: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """A transformers-5 ``config.json`` dict (model_type ``deepseek_v3``) for ``config``.

    Args:
      config: the model config.
      dtype: the dtype recorded for the checkpoint's weights.

    Raises:
      HFCheckpointError: ``latent_norm_eps`` is not transformers' fixed 1e-6.
    """
    c = config
    if c.latent_norm_eps != HF_LATENT_NORM_EPS:
        raise HFCheckpointError(
            f"model.latent_norm_eps={c.latent_norm_eps} cannot be exported: transformers' "
            f"DeepSeek-V3 always builds the latent norms with eps {HF_LATENT_NORM_EPS}"
        )
    rope: dict[str, Any] = {"rope_theta": c.rope_theta, "rope_type": "default"}
    if c.rope_scaling is not None:
        rope = {**rope, "rope_type": "yarn", **dataclasses.asdict(c.rope_scaling)}
    hf = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    hf.update({hf_name: getattr(c, name) for hf_name, name in _REQUIRED_FIELDS.items()})
    hf.update({name: getattr(c, name) for name in _OPTIONAL_FIELDS})
    hf.update(
        q_lora_rank=c.q_lora_rank,
        num_key_value_heads=c.num_heads,
        head_dim=c.qk_rope_head_dim,  # transformers' RoPE width for this model
        hidden_act="silu",
        attention_bias=False,
        rope_parameters=rope,
        num_nextn_predict_layers=0,
        dtype=dtype,
    )
    return hf


# ---- reading ------------------------------------------------------------------------


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            value = json.load(f)
    except FileNotFoundError as err:
        raise HFCheckpointError(f"{path} does not exist") from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFCheckpointError(f"cannot read {path}: {err}") from err
    if not isinstance(value, dict):
        raise HFCheckpointError(f"{path}: expected a JSON object")
    return value


def _open(path: str):
    try:
        return safe_open(path, framework="numpy")
    except (OSError, safetensors.SafetensorError) as err:
        raise HFCheckpointError(f"cannot read {path}: {err}") from err


def _tensor_files(directory: str) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it, cross-checked with the files."""
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFCheckpointError(f"{index_path}: no 'weight_map' of tensor names to files")
        located = {name: os.path.join(directory, file) for name, file in weight_map.items()}
    elif os.path.exists(os.path.join(directory, SINGLE_FILE)):
        located = None
    else:
        raise HFCheckpointError(
            f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors "
            "checkpoints are supported)"
        )
    files = sorted(set(located.values())) if located else [os.path.join(directory, SINGLE_FILE)]
    found: dict[str, str] = {}
    for file in files:
        if not os.path.isfile(file):
            raise HFCheckpointError(f"{index_path} lists shard {file}, which does not exist")
        with _open(file) as f:
            found.update(dict.fromkeys(f.keys(), file))
    if located is not None and found != located:
        name = sorted(set(found.items()) ^ set(located.items()))[0][0]
        raise HFCheckpointError(
            f"tensor {name!r}: {INDEX_FILE} says {located.get(name)}, the shards say "
            f"{found.get(name)}"
        )
    return found


def _detect_expert_layout(names) -> str:
    names = {n.removesuffix(SCALE_SUFFIX) for n in names}  # fp8 scales go with their weight
    fused = sorted(n for n in names if _FUSED_EXPERTS.search(n))
    per_expert = sorted(n for n in names if ".mlp.experts." in n and not _FUSED_EXPERTS.search(n))
    if fused and per_expert:
        raise HFCheckpointError(
            f"mixed expert layouts: fused {fused[0]!r} and per-expert {per_expert[0]!r}"
        )
    return "fused" if fused else "per_expert"


@dataclasses.dataclass(frozen=True)
class TensorHeader:
    """Where one tensor lies in a safetensors file.

    Attributes:
      file: the file's path.
      dtype: the safetensors dtype name (``F32``, ``BF16``, ``F8_E4M3``, ...).
      shape: the tensor's shape.
      offset: the absolute byte offset of its first element in the file.
    """

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int


def read_safetensors_header(path: str) -> dict[str, TensorHeader]:
    """Every tensor's header in the safetensors file ``path``, checked against its size.

    The format: 8 bytes little-endian header length N, N bytes of JSON
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": ...}``,
    then the data (offsets relative to its start).

    Raises:
      HFCheckpointError: naming the file and what is wrong with it.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or length > size - 8:
                raise HFCheckpointError(
                    f"cannot read {path}: a header of {length} bytes in a {size}-byte file"
                )
            header = json.loads(f.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFCheckpointError(f"cannot read {path}: {err}") from err
    if not isinstance(header, dict):
        raise HFCheckpointError(f"cannot read {path}: the header is not a JSON object")
    data_start, data_size = 8 + length, size - 8 - length
    headers = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (TypeError, KeyError, ValueError) as err:
            raise HFCheckpointError(f"{path}: malformed header of tensor {name!r}") from err
        itemsize = _ITEMSIZE.get(dtype)
        expected = None if itemsize is None else math.prod(shape) * itemsize
        if not 0 <= begin <= end <= data_size or expected not in (None, end - begin):
            raise HFCheckpointError(
                f"{path}: tensor {name!r} ({dtype} {shape}) has data_offsets [{begin}, {end}] "
                f"in a data section of {data_size} bytes"
            )
        headers[name] = TensorHeader(path, dtype, shape, data_start + begin)
    return headers


Ranges = tuple[tuple[int, int], ...]
# The most of a file one read maps at a time.
_MAX_SPAN = 64 * 2**20


class TensorReader:
    """Reads boxes of checkpoint tensors, fp8 weights dequantised to float32.

    A box is ``((start, stop), ...)`` per axis. Each read maps the file span from the
    box's first to its last element (at most 64 MiB at a time), copies the box out and
    unmaps it again, so the file's pages do not stay in the process's resident memory.

    Attributes:
      headers: name -> header of every tensor that may be read.
      scales: fp8 weight name -> the name of its ``weight_scale_inv``.
      quantization: the block layout of the scales (None: no fp8 weights).
      reads: when a list, every box read is appended to it as ``(name, box)``
        (weights and scales; for audits and tests).
    """

    def __init__(
        self,
        headers: Mapping[str, TensorHeader],
        scales: Mapping[str, str],
        quantization: Fp8Blocks | None,
        reads: list[tuple[str, Ranges]] | None = None,
    ):
        self.headers = headers
        self.scales = scales
        self.quantization = quantization
        self.reads = reads

    def shape(self, name: str) -> tuple[int, ...]:
        return self.headers[name].shape

    def read(self, name: str, box: Sequence[tuple[int, int]] | None = None) -> np.ndarray:
        """The box of tensor ``name`` (None: all of it): as stored, or for an fp8
        weight, float32 ``value x scale_inv`` with each element's own block's scale."""
        box = tuple((0, n) for n in self.shape(name)) if box is None else tuple(box)
        values = self.read_raw(name, box)
        if name not in self.scales:
            return values
        return dequantize_fp8_box(
            values, box, self.read_raw(self.scales[name], self._scale_box(box)), self.quantization
        )

    def _scale_box(self, box: Ranges) -> Ranges:
        rows, cols = self.quantization.block
        (r0, r1), (c0, c1) = box[-2:]
        return (*box[:-2], (r0 // rows, -(-r1 // rows)), (c0 // cols, -(-c1 // cols)))

    def read_raw(self, name: str, box: Sequence[tuple[int, int]]) -> np.ndarray:
        """The box of tensor ``name`` exactly as stored."""
        header = self.headers[name]
        dtype = _NUMPY_DTYPES[header.dtype]
        box = tuple((int(a), int(b)) for a, b in box)
        if len(box) != len(header.shape) or not all(
            0 <= a <= b <= n for (a, b), n in zip(box, header.shape)
        ):
            raise ValueError(f"box {box} out of tensor {name!r} {header.shape}")
        if self.reads is not None:
            self.reads.append((name, box))
        lengths = tuple(b - a for a, b in box)
        out = np.empty(lengths, dtype)
        if out.size == 0 or not box:  # empty, or a scalar
            if out.size:
                self._copy(name, header, dtype, box, out)
            return out
        # Map at most _MAX_SPAN bytes at a time (whole steps of the first axis): a thin
        # column slice of a large tensor spans nearly all of it.
        plane = math.prod(header.shape[1:]) * dtype.itemsize
        step = max(1, _MAX_SPAN // max(plane, 1))
        (a0, b0), rest = box[0], box[1:]
        for start in range(a0, b0, step):
            stop = min(start + step, b0)
            self._copy(name, header, dtype, ((start, stop), *rest), out[start - a0 : stop - a0])
        return out

    def _copy(self, name, header, dtype, box, out) -> None:
        """Copies ``box`` of the tensor into ``out``, mapping only the span it covers."""
        strides = [math.prod(header.shape[i + 1 :]) for i in range(len(box))]
        first = sum(a * s for (a, _), s in zip(box, strides))
        last = sum((b - 1) * s for (_, b), s in zip(box, strides))
        begin = header.offset + first * dtype.itemsize
        mapped = begin - begin % mmap.ALLOCATIONGRANULARITY
        length = header.offset + (last + 1) * dtype.itemsize - mapped
        try:
            with open(header.file, "rb") as f:
                span = mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ, offset=mapped)
        except (OSError, ValueError) as err:
            raise HFCheckpointError(f"cannot read {name!r} from {header.file}: {err}") from err
        try:
            flat = np.frombuffer(span, dtype, count=last - first + 1, offset=begin - mapped)
            view = np.lib.stride_tricks.as_strided(
                flat, out.shape, [s * dtype.itemsize for s in strides], writeable=False
            )
            out[...] = view
            del flat, view  # release the buffer before unmapping
        finally:
            span.close()


def dequantize_fp8_box(
    values: np.ndarray, box: Sequence[tuple[int, int]], scales: np.ndarray, quantization: Fp8Blocks
) -> np.ndarray:
    """float32 ``values x scale_inv`` of a box of an fp8 weight.

    Args:
      values: the box of the fp8 weight, ``[..., rows, cols]``.
      box: its ``(start, stop)`` per axis in the whole weight: a box may start or end
        inside a block.
      scales: the box of ``weight_scale_inv`` covering the blocks ``values`` touches
        (same leading axes; block rows ``r0 // b0 .. ceil(r1 / b0)``, likewise columns).
      quantization: the block size.
    """
    rows, cols = quantization.block
    (r0, r1), (c0, c1) = box[-2:]
    # Each row's scales over the column blocks: [..., rows, column blocks] (small).
    row_scales = np.take(scales.astype(np.float32), np.arange(r0, r1) // rows - r0 // rows, axis=-2)
    out = values.astype(np.float32)
    for j, block in enumerate(range(c0 // cols, -(-c1 // cols))):
        lo, hi = max(block * cols, c0) - c0, min((block + 1) * cols, c1) - c0
        out[..., lo:hi] *= row_scales[..., j : j + 1]
    return out


@dataclasses.dataclass(frozen=True)
class HFImportPlan:
    """A checked HF checkpoint directory: what to read and how, nothing read yet.

    Attributes:
      config: the model config (``config.json`` plus the caller's overrides).
      expert_layout: ``"per_expert"`` or ``"fused"``.
      spec: ``weight_spec(config, expert_layout)``.
      headers: every tensor to read (the spec's and the fp8 weights' scales).
      quantization: config.json's block-fp8 declaration, or None.
      scales: fp8 weight name -> its ``weight_scale_inv`` name.
    """

    config: ModelConfig
    expert_layout: str
    spec: tuple[TensorMapping, ...]
    headers: Mapping[str, TensorHeader]
    quantization: Fp8Blocks | None
    scales: Mapping[str, str]

    def reader(self, reads: list[tuple[str, Ranges]] | None = None) -> TensorReader:
        """A reader of this checkpoint (``reads``: see ``TensorReader``)."""
        return TensorReader(self.headers, self.scales, self.quantization, reads)


def plan_hf_import(
    path: str | os.PathLike, *, drop_mtp: bool = False, **overrides: Any
) -> HFImportPlan:
    """Checks an HF checkpoint directory against its config, reading headers only.

    Names, shapes and dtypes of every tensor, and of each fp8 weight's
    ``weight_scale_inv``, are checked before any tensor data is read.

    Args:
      path: see ``load_hf_checkpoint``.
      drop_mtp: see ``load_hf_checkpoint``.
      **overrides: ModelConfig fields not defined by ``config.json``.

    Raises:
      HFCheckpointError: naming the file, field or tensor that is wrong.
    """
    path = os.fspath(path)
    hf_config = _read_json(os.path.join(path, CONFIG_FILE))
    config = config_from_hf(hf_config, **overrides)
    quantization = weight_quantization(hf_config)
    files = _tensor_files(path)
    mtp = sorted(
        name
        for name in files
        if (m := _LAYER_NAME.match(name)) and int(m.group(1)) >= config.num_layers
    )
    if mtp and not drop_mtp:
        raise HFCheckpointError(
            f"tensor {mtp[0]!r} (and {len(mtp) - 1} more) belongs to a multi-token-prediction "
            f"layer beyond num_hidden_layers={config.num_layers}; pass drop_mtp=True to drop them"
        )
    for name in mtp:
        del files[name]
    expert_layout = _detect_expert_layout(files)
    spec = weight_spec(config, expert_layout)
    expected = {m.name: m for m in spec}
    missing = sorted(set(expected) - set(files))
    if missing:
        raise HFCheckpointError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    # A scale may sit beside a projection weight; whether it must is the dtype's say.
    scale_names = {m.name + SCALE_SUFFIX for m in spec if m.quantizable}
    extra = sorted(set(files) - set(expected) - scale_names)
    if extra:
        raise HFCheckpointError(f"unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all)")

    # Check every header before reading any data: bad input fails fast.
    in_file: dict[str, dict[str, TensorHeader]] = {}
    for file in sorted(set(files.values())):
        in_file[file] = read_safetensors_header(file)
    headers = {name: in_file[file][name] for name, file in files.items()}
    scales: dict[str, str] = {}
    for mapping in spec:
        name, header = mapping.name, headers[mapping.name]
        scale = name + SCALE_SUFFIX
        if header.dtype == FP8_DTYPE:
            _check_fp8(mapping, header, headers.get(scale), quantization)
            scales[name] = scale
        elif header.dtype not in _FLOAT_DTYPES:
            raise HFCheckpointError(
                f"tensor {name!r} has dtype {header.dtype}: quantized weights must be "
                f"dequantised first (supported: {_FLOAT_DTYPES}, and {FP8_DTYPE} projection "
                "weights with block scales)"
            )
        elif scale in headers:
            raise HFCheckpointError(
                f"unexpected tensor {scale!r}: {name!r} is {header.dtype}, not {FP8_DTYPE}"
            )
        if header.shape != mapping.shape:
            raise HFCheckpointError(
                f"tensor {name!r} has shape {header.shape}, expected {mapping.shape} "
                "from config.json"
            )
    if quantization is not None and not scales:
        example = next(m.name for m in spec if m.quantizable)
        raise HFCheckpointError(
            "config.json: quantization_config (quant_method='fp8') declares fp8 weights, but "
            f"no tensor is {FP8_DTYPE} (e.g. {example!r} is {headers[example].dtype}); "
            "drop quantization_config from a dequantised checkpoint"
        )
    needed = {**{m.name: headers[m.name] for m in spec}, **{s: headers[s] for s in scales.values()}}
    return HFImportPlan(config, expert_layout, spec, needed, quantization, scales)


def _check_fp8(
    mapping: TensorMapping,
    header: TensorHeader,
    scale: TensorHeader | None,
    quantization: Fp8Blocks | None,
) -> None:
    name = mapping.name
    if not mapping.quantizable:
        raise HFCheckpointError(
            f"tensor {name!r} has dtype {FP8_DTYPE}, but only decoder-layer projection weights "
            f"may be fp8: embeddings, norms, the router and lm_head must be {_FLOAT_DTYPES}"
        )
    if quantization is None:
        raise HFCheckpointError(
            f"tensor {name!r} has dtype {FP8_DTYPE}, but config.json has no "
            "quantization_config (DeepSeek-V3's: quant_method 'fp8', weight_block_size "
            "[128, 128]) to say how to dequantise it"
        )
    if header.shape != mapping.shape:  # before the scale, whose shape follows from it
        raise HFCheckpointError(
            f"tensor {name!r} has shape {header.shape}, expected {mapping.shape} from config.json"
        )
    expected = quantization.scale_shape(header.shape)
    rows, cols = quantization.block
    if scale is None:
        raise HFCheckpointError(
            f"missing tensor {name + SCALE_SUFFIX!r}: the {expected} per-block scales of "
            f"{FP8_DTYPE} tensor {name!r} {header.shape}"
        )
    if scale.dtype not in _FLOAT_DTYPES:
        raise HFCheckpointError(
            f"tensor {name + SCALE_SUFFIX!r} has dtype {scale.dtype}, expected F32"
        )
    if scale.shape != expected:
        raise HFCheckpointError(
            f"tensor {name + SCALE_SUFFIX!r} has shape {scale.shape}, expected {expected}: one "
            f"scale per {rows}x{cols} block of {name!r} {header.shape}"
        )


def load_hf_checkpoint(
    path: str | os.PathLike, *, drop_mtp: bool = False, **overrides: Any
) -> tuple[ModelConfig, dict[str, Any]]:
    """Reads an HF DeepSeek-V3 / Kimi-K2 checkpoint directory into host arrays.

    bf16/fp32 checkpoints and block-fp8 ones (dequantised to ``param_dtype``, one
    whole tensor at a time). For a sharded model, ``hf_stream.load_hf_checkpoint_sharded``
    reads only each process's slices instead.

    Args:
      path: directory with ``config.json`` and the safetensors file(s).
      drop_mtp: drop the multi-token-prediction layers (``model.layers.{L}.*`` for
        ``L >= num_hidden_layers``) that published DeepSeek-V3 checkpoints carry;
        without it their presence is an error.
      **overrides: ModelConfig fields not defined by ``config.json``, e.g.
        ``param_dtype="bfloat16"`` or ``scan_layers=False``.

    Returns:
      ``(config, variables)``: ``variables = {"params": ..., "router": ...}`` as
      host numpy arrays in ``config.param_dtype`` (the router in float32), laid out
      per ``config.scan_layers``.

    Raises:
      HFCheckpointError: naming the file, field or tensor that is wrong.
    """
    plan = plan_hf_import(path, drop_mtp=drop_mtp, **overrides)
    reader = plan.reader()
    # File by file, in each file's order: sequential reads.
    order = sorted(
        plan.spec, key=lambda m: (plan.headers[m.name].file, plan.headers[m.name].offset)
    )
    tensors = ((m.name, reader.read(m.name)) for m in order)
    return plan.config, variables_from_hf_tensors(
        plan.config, tensors, expert_layout=plan.expert_layout
    )


# ---- writing ------------------------------------------------------------------------


def save_hf_checkpoint(
    path: str | os.PathLike,
    config: ModelConfig,
    variables: Mapping[str, Any],
    *,
    expert_layout: str = "per_expert",
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    extra_config: Mapping[str, Any] | None = None,
) -> None:
    """Writes a directory that ``DeepseekV3ForCausalLM.from_pretrained`` loads.

    Shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own)
    with ``model.safetensors.index.json``, or one ``model.safetensors`` when all fits;
    ``config.json`` is written last, so an interrupted export is not loadable.

    Args:
      path: output directory; must not already hold a checkpoint.
      config: the model config.
      variables: ``{"params": ..., "router": ...}`` (numpy or jax arrays).
      expert_layout: ``"per_expert"`` (published checkpoints, transformers'
        ``save_pretrained``) or ``"fused"`` routed-expert tensors.
      dtype: weight dtype on disk, ``float32``, ``bfloat16`` or ``float16`` (the
        router stays float32); None: ``config.param_dtype``.
      max_shard_bytes: shard size limit.
      extra_config: further config.json fields our config does not define (token
        ids, ...); a field that contradicts ``config`` is an error.
    """
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, CONFIG_FILE)) or any(
        name.endswith(".safetensors") for name in (os.listdir(path) if os.path.isdir(path) else ())
    ):
        raise HFCheckpointError(f"{path} already holds a checkpoint; choose an empty directory")
    # Cast everything to one dtype, so config.json's "dtype" tells the truth.
    dtype = dtype or config.param_dtype
    tensors = iter_hf_tensors(config, variables, expert_layout=expert_layout, dtype=dtype)
    hf_config = config_to_hf(config, dtype)
    for key, value in (extra_config or {}).items():
        if key in hf_config and hf_config[key] != value:
            raise HFCheckpointError(
                f"extra_config[{key!r}]={value!r} contradicts {hf_config[key]!r}"
            )
        hf_config[key] = value

    spec = weight_spec(config, expert_layout)
    itemsize = jnp.dtype(dtype).itemsize
    nbytes = [math.prod(m.shape) * (4 if m.keep_fp32 else itemsize) for m in spec]
    shards: list[list[str]] = [[]]
    filled = 0
    for mapping, n in zip(spec, nbytes):
        if shards[-1] and filled + n > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(mapping.name)
        filled += n
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    shard_of = {tensor: file for file, shard in zip(names, shards) for tensor in shard}

    os.makedirs(path, exist_ok=True)
    for file, shard in zip(names, shards):
        # One shard in memory at a time; the generator yields in spec order.
        block = dict(next(tensors) for _ in shard)
        safetensors.numpy.save_file(block, os.path.join(path, file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes)}, "weight_map": shard_of}
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
