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
* Streaming: the loader fills preallocated host arrays one HF tensor at a time
  (lazy ``safe_open``); the saver builds one shard at a time. Neither holds two
  copies of the model.
* Latent norms: transformers (like DeepSeek's and Moonshot's own modeling code)
  builds ``q_a_layernorm``/``kv_a_layernorm`` with eps 1e-6 whatever
  ``rms_norm_eps`` says; the import sets ``latent_norm_eps`` to that, and the
  export refuses a model whose latent eps a config.json cannot express.
* Strict: names, shapes and dtypes of every tensor are checked before any data
  is read; a missing, extra, misshapen or quantized tensor, an unsupported
  option, or an unreadable file raises ``HFCheckpointError`` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
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

# Float dtypes a checkpoint may store (safetensors names); anything else (F8_*, I8,
# U8, ...) is a quantized tensor that needs dequantising first.
_FLOAT_DTYPES = ("F32", "BF16", "F16")

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
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise HFCheckpointError(
            f"config.json: quantization_config (quant_method={method!r}) is not supported: "
            "the weights must be dequantised to bf16/fp32 first"
        )
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
    fused = sorted(n for n in names if _FUSED_EXPERTS.search(n))
    per_expert = sorted(n for n in names if ".mlp.experts." in n and not _FUSED_EXPERTS.search(n))
    if fused and per_expert:
        raise HFCheckpointError(
            f"mixed expert layouts: fused {fused[0]!r} and per-expert {per_expert[0]!r}"
        )
    return "fused" if fused else "per_expert"


def load_hf_checkpoint(
    path: str | os.PathLike, *, drop_mtp: bool = False, **overrides: Any
) -> tuple[ModelConfig, dict[str, Any]]:
    """Reads an HF DeepSeek-V3 / Kimi-K2 checkpoint directory.

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
    path = os.fspath(path)
    config = config_from_hf(_read_json(os.path.join(path, CONFIG_FILE)), **overrides)
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
    extra = sorted(set(files) - set(expected))
    if extra:
        raise HFCheckpointError(f"unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all)")

    by_file: dict[str, list[TensorMapping]] = {}
    for mapping in spec:
        by_file.setdefault(files[mapping.name], []).append(mapping)
    # Check names, then every header, before reading any data: bad input fails fast.
    for file, mappings in by_file.items():
        with _open(file) as f:
            for mapping in mappings:
                header = f.get_slice(mapping.name)
                dtype, shape = header.get_dtype(), tuple(header.get_shape())
                if dtype not in _FLOAT_DTYPES:
                    raise HFCheckpointError(
                        f"tensor {mapping.name!r} has dtype {dtype}: quantized weights must be "
                        f"dequantised first (supported: {_FLOAT_DTYPES})"
                    )
                if shape != mapping.shape:
                    raise HFCheckpointError(
                        f"tensor {mapping.name!r} has shape {shape}, expected {mapping.shape} "
                        "from config.json"
                    )

    def read() -> Iterator[tuple[str, np.ndarray]]:
        for file, mappings in by_file.items():
            with _open(file) as f:
                for mapping in mappings:
                    try:
                        yield mapping.name, f.get_tensor(mapping.name)
                    except (OSError, safetensors.SafetensorError) as err:
                        raise HFCheckpointError(f"cannot read {mapping.name!r}: {err}") from err

    return config, variables_from_hf_tensors(config, read(), expert_layout=expert_layout)


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
