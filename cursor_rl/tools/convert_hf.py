"""Converts Hugging Face DeepSeek-V3 / Kimi-K2 checkpoints to Orbax checkpoints and back.

    # HF directory -> a variables-only Orbax checkpoint at ORBAX_DIR/0
    python -m cursor_rl.tools.convert_hf --to=orbax --hf_dir=/ckpt/Kimi-K2-Base-bf16 \\
        --orbax_dir=/ckpt/kimi_k2 --param_dtype=bfloat16 [--drop_mtp] [--noscan_layers]

    # Orbax (a step directory, or a checkpoints directory: its latest step) -> HF directory
    python -m cursor_rl.tools.convert_hf --to=hf --orbax_dir=WORKDIR/sft/checkpoints \\
        --hf_dir=/tmp/export [--dtype=bfloat16] [--expert_layout=fused] [--max_shard_gb=5]

The Orbax side is ``cursor_rl.checkpoints``' layout (``save_variables`` /
``restore_variables``). Its metadata holds the model config, the layer layout,
the source ``config.json`` (whose token ids go back into an export) and, when the
HF directory has one, the text of ``tokenizer.json``. The import streams
(``hf_stream.load_hf_checkpoint_sharded``): every array is built shard by shard over
the local devices (an ``fsdp`` mesh of all of them), each shard read from only the
slices of the HF tensors it holds, so no host copy of the model exists; run it on a
TPU VM and the shards sit in HBM. The export holds one host copy plus one shard.
Block-fp8 checkpoints (the DeepSeek-V3 / Kimi-K2 release layout) are dequantised on
import; other quantisations (int4, ...) are refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
from absl import app, flags

from cursor_rl import checkpoints, model, partitioning
from cursor_rl.model import hf, hf_mapping, hf_stream
from cursor_rl.model.config import ModelConfig

TOKENIZER_FILE = "tokenizer.json"
# config.json fields outside the model config that an export should keep.
_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def hf_to_orbax(hf_dir: str, orbax_dir: str, *, drop_mtp: bool = False, **overrides: Any) -> str:
    """Converts an HF checkpoint directory to a variables-only Orbax checkpoint.

    Args:
      hf_dir: directory with ``config.json`` and safetensors.
      orbax_dir: where the checkpoint goes (as step 0).
      drop_mtp: drop multi-token-prediction layers (see ``hf.load_hf_checkpoint``).
      **overrides: ModelConfig fields not in ``config.json`` (``param_dtype``,
        ``scan_layers``, ...).

    Returns:
      The checkpoint's step directory.
    """
    mesh = partitioning.make_mesh({"fsdp": -1})
    config, variables = hf_stream.load_hf_checkpoint_sharded(
        hf_dir, mesh, drop_mtp=drop_mtp, **overrides
    )
    with open(os.path.join(hf_dir, hf.CONFIG_FILE)) as f:
        hf_config = json.load(f)
    tokenizer_json = None
    tokenizer = os.path.join(hf_dir, TOKENIZER_FILE)
    if os.path.exists(tokenizer):
        with open(tokenizer, encoding="utf-8") as f:
            tokenizer_json = f.read()
    metadata = checkpoints.make_metadata(
        config, stage="hf_import", tokenizer_json=tokenizer_json, hf_config=hf_config
    )
    return checkpoints.save_variables(orbax_dir, variables, metadata)


def orbax_to_hf(
    orbax_path: str,
    hf_dir: str,
    *,
    expert_layout: str = "per_expert",
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> ModelConfig:
    """Exports an Orbax checkpoint's variables as an HF checkpoint directory.

    Args:
      orbax_path: a checkpoint step directory, or a checkpoints directory (its latest).
      hf_dir: output directory (must not hold a checkpoint yet).
      expert_layout: ``"per_expert"`` or ``"fused"`` routed-expert tensors.
      dtype: weight dtype on disk (the router stays float32); None: the config's.
      max_shard_bytes: safetensors shard size limit.

    Returns:
      The model config that was exported.
    """
    metadata = checkpoints.read_metadata(orbax_path)
    config = checkpoints.model_config_from_metadata(metadata, orbax_path)
    # Restore onto the host: export reads every tensor there anyway.
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=cpu),
        nn.meta.unbox(model.abstract_variables(config)),
    )
    variables = checkpoints.restore_variables(orbax_path, target)
    source = metadata.get("hf_config", {})
    extra = {key: source[key] for key in _TOKEN_FIELDS if source.get(key) is not None}
    hf.save_hf_checkpoint(
        hf_dir,
        config,
        variables,
        expert_layout=expert_layout,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        extra_config=extra,
    )
    if "tokenizer" in metadata:
        with open(os.path.join(hf_dir, TOKENIZER_FILE), "w", encoding="utf-8") as f:
            f.write(metadata["tokenizer"])
    return config


_TO = flags.DEFINE_enum("to", None, ["orbax", "hf"], "Direction: HF -> orbax, or Orbax -> hf.")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "HF checkpoint directory (input or output).")
_ORBAX_DIR = flags.DEFINE_string(
    "orbax_dir", None, "Orbax checkpoints directory (output), or a step/checkpoints dir (input)."
)
_PARAM_DTYPE = flags.DEFINE_enum(
    "param_dtype", "float32", ["float32", "bfloat16"], "--to=orbax: dtype of the stored params."
)
_SCAN_LAYERS = flags.DEFINE_bool("scan_layers", True, "--to=orbax: stacked (scanned) layers.")
_DROP_MTP = flags.DEFINE_bool("drop_mtp", False, "--to=orbax: drop multi-token-prediction layers.")
_DTYPE = flags.DEFINE_enum(
    "dtype", None, list(hf_mapping.EXPORT_DTYPES), "--to=hf: weight dtype (default: as stored)."
)
_EXPERT_LAYOUT = flags.DEFINE_enum(
    "expert_layout",
    "per_expert",
    list(hf_mapping.EXPERT_LAYOUTS),
    "--to=hf: routed-expert tensors.",
)
_MAX_SHARD_GB = flags.DEFINE_float("max_shard_gb", 5.0, "--to=hf: safetensors shard size limit.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _TO.value == "orbax":
        path = hf_to_orbax(
            _HF_DIR.value,
            _ORBAX_DIR.value,
            drop_mtp=_DROP_MTP.value,
            param_dtype=_PARAM_DTYPE.value,
            scan_layers=_SCAN_LAYERS.value,
        )
        print(f"wrote {path}")
    else:
        config = orbax_to_hf(
            _ORBAX_DIR.value,
            _HF_DIR.value,
            expert_layout=_EXPERT_LAYOUT.value,
            dtype=_DTYPE.value,
            max_shard_bytes=int(_MAX_SHARD_GB.value * 2**30),
        )
        total = config.param_counts()["total"]
        print(f"wrote {_HF_DIR.value} ({total / 1e9:.3f}B parameters)")


if __name__ == "__main__":
    flags.mark_flags_as_required(["to", "hf_dir", "orbax_dir"])
    app.run(main)
