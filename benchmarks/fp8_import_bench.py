"""Peak resident memory of the streaming FP8 import vs the full-host-copy import.

    python benchmarks/fp8_import_bench.py [--dir=/tmp/fp8_import_bench] [--rounds=1] \
        [--hidden=1024] [--layers=8] [--experts=16] [--scan_layers]

Writes (once, kept in ``--dir``) a block-fp8 checkpoint in the DeepSeek-V3 / Kimi-K2
release layout for a MoE config of a few hundred MB (projections float8_e4m3fn with
float32 ``weight_scale_inv`` per 128 x 128 block, embeddings and ``lm_head`` bf16), then
imports it into a bf16 model sharded over an emulated 8-device CPU mesh (fsdp 2 x
expert 2 x tensor 2), each way in a fresh child process:

* ``host``: ``hf.load_hf_checkpoint`` (the whole model dequantised into host arrays,
  one tensor at a time) then ``jax.device_put`` into the model's shardings;
* ``stream``: ``hf_stream.load_hf_checkpoint_sharded`` (each shard built from the
  slices that land in it, straight into ``jax.make_array_from_callback``).

Each child reports its resident-memory peak above what it held before the import
(``VmHWM`` reset through ``/proc/self/clear_refs``, ``cursor_rl/hostmem.py``), the bytes
of the model's arrays, and the wall time. On a CPU the "devices" are host memory, so
both peaks include the model itself once; what differs is what the import holds
beside it. glibc's malloc defaults (no ``host_malloc`` settings: they keep freed memory
and would count every temporary).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cursor_rl import hostmem, model, partitioning  # after the path is set
from cursor_rl.model import hf, hf_mapping, hf_stream
from cursor_rl.model.config import ModelConfig

_DIR = flags.DEFINE_string("dir", "/tmp/fp8_import_bench", "Where the checkpoint is written.")
_ROUNDS = flags.DEFINE_integer("rounds", 1, "Rounds over the two imports (alternating).")
_HIDDEN = flags.DEFINE_integer("hidden", 1024, "hidden_size.")
_LAYERS = flags.DEFINE_integer("layers", 8, "num_hidden_layers (the first dense).")
_EXPERTS = flags.DEFINE_integer("experts", 16, "n_routed_experts.")
_SCAN = flags.DEFINE_bool("scan_layers", True, "Import into the scanned (stacked) layout.")
_CHILD = flags.DEFINE_enum("child", None, ["host", "stream"], "Internal: run one import.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 128
MESH = {"fsdp": 2, "expert": 2, "tensor": 2}
SHARD_BYTES = 200 * 2**20


def bench_config():
    h = _HIDDEN.value
    return ModelConfig(
        vocab_size=32000,
        hidden_size=h,
        intermediate_size=11 * h // 4,
        moe_intermediate_size=h // 2,
        num_layers=_LAYERS.value,
        num_heads=8,
        q_lora_rank=3 * h // 8,
        kv_lora_rank=h // 4,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=_EXPERTS.value,
        num_experts_per_tok=4,
        first_k_dense=1,
        param_dtype="bfloat16",
        scan_layers=_SCAN.value,
    )


def _quantize(w):
    """fp8 values and float32 per-128x128-block scales (scale = block amax / 448)."""
    rows, cols = w.shape
    nr, nc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = np.zeros((nr * BLOCK, nc * BLOCK), np.float32)
    padded[:rows, :cols] = w
    blocks = padded.reshape(nr, BLOCK, nc, BLOCK)
    scale = np.abs(blocks).max(axis=(1, 3)) / 448.0
    scale[scale == 0] = 1.0
    q = (blocks / scale[:, None, :, None]).astype(jnp.float8_e4m3fn)
    q = np.ascontiguousarray(q.reshape(nr * BLOCK, nc * BLOCK)[:rows, :cols])
    return q, scale.astype(np.float32)


def write_checkpoint(directory: str) -> int:
    """Writes the fp8 checkpoint one ~200 MB file at a time; returns its bytes."""

    config = bench_config()
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    files, block, filled, weight_map = [], {}, 0, {}

    def flush():
        nonlocal block, filled
        name = f"model-{len(files) + 1:05d}.safetensors"
        safetensors.numpy.save_file(block, os.path.join(directory, name), {"format": "pt"})
        weight_map.update(dict.fromkeys(block, name))
        files.append(name)
        block, filled = {}, 0

    total = 0
    for mapping in hf_mapping.weight_spec(config):
        shape = mapping.shape
        if len(shape) == 1:
            value = {mapping.name: (1 + 0.1 * rng.standard_normal(shape, np.float32))}
        else:
            w = rng.standard_normal(shape, np.float32) * shape[-1] ** -0.5
            if mapping.quantizable:
                q, scale = _quantize(w)
                value = {mapping.name: q, mapping.name + hf.SCALE_SUFFIX: scale}
            elif mapping.keep_fp32:
                value = {mapping.name: w}
            else:
                value = {mapping.name: w.astype(jnp.bfloat16)}
        nbytes = sum(v.nbytes for v in value.values())
        if block and filled + nbytes > SHARD_BYTES:
            flush()
        block.update(value)
        filled += nbytes
        total += nbytes
    flush()
    with open(os.path.join(directory, hf.INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    hf_config = hf.config_to_hf(config, "bfloat16")
    hf_config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    }
    with open(os.path.join(directory, hf.CONFIG_FILE), "w") as f:
        json.dump(hf_config, f)  # last: its presence marks a complete checkpoint
    return total


def run_child(mode: str, directory: str) -> None:
    """One import in this process; prints one JSON line."""

    mesh = partitioning.make_mesh(MESH)
    overrides = {"param_dtype": "bfloat16", "scan_layers": _SCAN.value}
    hf.plan_hf_import(directory, **overrides)  # headers read, model shapes traced (cached)
    before = hostmem.rss_bytes()
    per_import = hostmem.reset_peak()
    start = time.perf_counter()
    if mode == "host":
        config, host = hf.load_hf_checkpoint(directory, **overrides)
        shardings = model.variable_shardings(config, mesh, partitioning.DEFAULT_RULES)
        variables = jax.block_until_ready(jax.device_put(host, shardings))
        del host
    else:
        config, variables = hf_stream.load_hf_checkpoint_sharded(directory, mesh, **overrides)
        variables = jax.block_until_ready(variables)
    seconds = time.perf_counter() - start
    leaves = jax.tree.leaves(variables)
    row = {
        "mode": mode,
        "peak_above_start": hostmem.peak_bytes() - before,
        "model_bytes": sum(x.nbytes for x in leaves),
        "largest_array": max(x.nbytes for x in leaves),
        "seconds": seconds,
        "per_import_peak": per_import,
    }
    print(json.dumps(row), flush=True)


def main(argv):
    del argv
    if _CHILD.value:
        run_child(_CHILD.value, _DIR.value)
        return
    directory = os.path.join(_DIR.value, f"h{_HIDDEN.value}_l{_LAYERS.value}_e{_EXPERTS.value}")
    if not os.path.exists(os.path.join(directory, "config.json")):
        start = time.perf_counter()
        size = write_checkpoint(directory)
        print(f"wrote {directory}: {size / 2**20:.0f} MiB in {time.perf_counter() - start:.0f} s")
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8"
    )
    rows: dict[str, list[dict]] = {"host": [], "stream": []}
    for _ in range(_ROUNDS.value):
        for mode in ("host", "stream"):
            command = [sys.executable, os.path.abspath(__file__), f"--child={mode}"]
            command += [f"--dir={directory}", f"--scan_layers={_SCAN.value}"]
            command += [f"--hidden={_HIDDEN.value}", f"--layers={_LAYERS.value}"]
            command += [f"--experts={_EXPERTS.value}"]
            out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"{mode} import failed:\n{out.stderr[-4000:]}")
            rows[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(mode, rows[mode][-1], flush=True)
    mib = lambda n: f"{n / 2**20:,.0f} MiB"
    model_bytes = rows["stream"][0]["model_bytes"]
    largest = rows["stream"][0]["largest_array"]
    print(
        f"\n{os.cpu_count()} cores; checkpoint {directory}; model {mib(model_bytes)} bf16 "
        f"on 8 CPU devices (largest array {mib(largest)}); scan_layers={_SCAN.value}; "
        f"best of {_ROUNDS.value} round(s)"
    )
    print(f"{'import':<8} {'peak RSS growth':>16} {'beyond the model':>17} {'wall':>8}")
    for mode, runs in rows.items():
        peak = min(r["peak_above_start"] for r in runs)
        wall = min(r["seconds"] for r in runs)
        print(f"{mode:<8} {mib(peak):>16} {mib(peak - model_bytes):>17} {wall:>7.1f}s")


if __name__ == "__main__":
    app.run(main)
