"""Ahead-of-time compile of a config's sharded train step for a TPU topology, on the CPU.

    JAX_PLATFORMS=cpu TPU_WORKER_HOSTNAMES=localhost \\
    python -m cursor_rl.tools.aot_compile --config=configs/kimi_k2.py --topology=v5p:8x8x4

Needs the ``tpu`` extra (libtpu): ``jax.experimental.topologies`` describes the
target chips and XLA's TPU compiler runs here. Prints per-device memory (arguments,
outputs, temporaries, generated code; donated buffers counted once) against the
chip's HBM and the compiled FLOPs per step, and exits with status 1 when the step
does not fit. ``--topology=cpu`` compiles for the local (emulated) CPU devices
instead, which exercises the same path without libtpu.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
import time

import jax
import ml_collections
import numpy as np
from absl import app, flags
from jax.experimental import topologies
from ml_collections import config_flags

from cursor_rl import partitioning, stages
from cursor_rl.train import optimizer as optim
from cursor_rl.train import step as step_lib
from cursor_rl.train.loop import validate_stage_config

GiB = 2**30

# HBM per chip, bytes (public spec sheets).
_HBM = {
    "TPU v4": 32 * GiB,
    "TPU v5 lite": 16 * GiB,
    "TPU v5e": 16 * GiB,
    "TPU v5": 95 * GiB,  # v5p
    "TPU v5p": 95 * GiB,
    "TPU v6 lite": 32 * GiB,
    "TPU v6e": 32 * GiB,
}


@dataclasses.dataclass
class AotReport:
    """What the compiler says about one train step on one device of the topology."""

    topology: str
    device_kind: str
    num_devices: int
    mesh_shape: dict[str, int]
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    hbm_bytes: int | None
    flops_per_device: float
    model_flops_per_step: float
    tokens_per_step: int
    compile_s: float
    note: str = ""

    @property
    def total_bytes(self) -> int:
        # Donated inputs alias outputs: count those buffers once.
        return (
            self.argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
            + self.code_bytes
        )

    @property
    def fits(self) -> bool:
        return self.hbm_bytes is None or self.total_bytes <= self.hbm_bytes

    def text(self) -> str:
        hbm = "unknown" if self.hbm_bytes is None else f"{self.hbm_bytes / GiB:.1f} GiB"
        rows = [
            f"topology {self.topology}: {self.num_devices} x {self.device_kind}, "
            f"mesh {self.mesh_shape}",
            f"  arguments   {self.argument_bytes / GiB:9.2f} GiB  (params, optimizer state, batch)",
            f"  outputs     {self.output_bytes / GiB:9.2f} GiB",
            f"  aliased    -{self.alias_bytes / GiB:9.2f} GiB  (donated state reused for outputs)",
            f"  temporaries {self.temp_bytes / GiB:9.2f} GiB  (activations, gradients, buffers)",
            f"  code        {self.code_bytes / GiB:9.2f} GiB",
            f"  total       {self.total_bytes / GiB:9.2f} GiB per device, HBM {hbm}: "
            + ("fits" if self.fits else "DOES NOT FIT"),
            f"  compiled FLOPs/step/device {self.flops_per_device:.3e}; model FLOPs/step "
            f"{self.model_flops_per_step:.3e} ({self.tokens_per_step:,} tokens); "
            f"compile {self.compile_s:.0f}s",
        ]
        if self.note:
            rows.append(f"  note: {self.note}")
        return "\n".join(rows)


def topology_devices(topology: str) -> list:
    """Devices of a named TPU topology (compile-only), or the local devices for ``cpu``."""
    if topology == "cpu":
        return list(jax.devices())
    # Compile-only use: several AOT processes (a sweep's pre-submit checks) may load
    # libtpu at once, which its lockfile would otherwise refuse.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return list(topologies.get_topology_desc(topology, "tpu").devices)
    except Exception as e:  # libtpu missing or an unknown topology name
        raise RuntimeError(
            f"cannot describe TPU topology {topology!r} ({e}); install the tpu extra "
            "(libtpu) and run with JAX_PLATFORMS=cpu"
        ) from e


def hbm_bytes(device_kind: str) -> int | None:
    for name, size in sorted(_HBM.items(), key=lambda kv: -len(kv[0])):
        if device_kind.startswith(name):
            return size
    return None


def compile_train_step(
    config: ml_collections.ConfigDict, topology: str, stage: str | None = None
) -> AotReport:
    """Lowers and compiles the full train step of ``config`` for ``topology``.

    Args:
      config: an experiment config (``configs/NAME.py``).
      topology: e.g. ``v5p:8x8x4`` (TPU, needs libtpu) or ``cpu`` (local devices).
      stage: which stage's settings; default the config's stage (``all`` -> pretrain).

    Returns:
      The memory and FLOPs report.
    """
    stage = stage or (config.stage if config.stage in stages.TRAIN_STAGES else "pretrain")
    cfg = stages.stage_config(config, stage)
    devices = topology_devices(topology)
    model_config = validate_stage_config(cfg, len(devices))
    if model_config.moe_impl == "auto" and devices[0].platform != "cpu":
        # "auto" follows the *running* backend (the CPU here); the target is the TPU.
        model_config = model_config.replace(moe_impl="ragged")
    mesh = partitioning.make_mesh(cfg.mesh.ici.to_dict(), cfg.mesh.dcn.to_dict(), devices)
    rules = partitioning.make_rules(cfg.mesh.rules_preset, cfg.mesh.rules.to_dict())
    num_steps = int(cfg.train.num_steps)
    tx = optim.make_optimizer(cfg.optimizer, num_steps)
    abstract_state, state_sh = step_lib.abstract_train_state(model_config, tx, mesh, rules)
    batch_sharding = partitioning.logical_sharding(("act_batch", "act_length"), mesh, rules)
    batch = {
        key: jax.ShapeDtypeStruct(
            (cfg.train.batch_size, cfg.train.seq_len), "int32", sharding=batch_sharding
        )
        for key in step_lib.BATCH_KEYS
    }
    fn = jax.jit(
        functools.partial(
            step_lib.train_step,
            config=model_config,
            tx=tx,
            schedule=optim.make_schedule(cfg.optimizer, num_steps),
            microbatches=int(cfg.train.microbatches),
            z_loss=float(cfg.train.z_loss),
            loss_chunk=int(cfg.train.loss_chunk_size),
        ),
        in_shardings=(state_sh, batch_sharding),
        out_shardings=(state_sh, None),
        donate_argnums=(0,),
    )
    start = time.time()
    tokens = int(cfg.train.batch_size * cfg.train.seq_len)
    kind = getattr(devices[0], "device_kind", devices[0].platform)
    report = AotReport(
        topology=topology,
        device_kind=kind,
        num_devices=len(devices),
        mesh_shape=dict(mesh.shape),
        argument_bytes=0,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=0,
        code_bytes=0,
        hbm_bytes=hbm_bytes(kind) if topology != "cpu" else None,
        flops_per_device=0.0,
        model_flops_per_step=model_config.flops_per_token(int(cfg.train.seq_len)) * tokens,
        tokens_per_step=tokens,
        compile_s=0.0,
    )
    with partitioning.use_mesh(mesh, rules):
        lowered = fn.lower(abstract_state, batch)
        try:
            compiled = lowered.compile()
        except Exception as e:  # the TPU compiler refuses programs that exceed HBM
            match = _OOM.search(str(e))
            if not match:
                raise
            report.temp_bytes = int(float(match.group(1)) * _UNITS[match.group(2)])
            report.argument_bytes = _argument_bytes(abstract_state, batch)
            report.compile_s = time.time() - start
            # The compiler lists the largest live buffers: keep them for the reader.
            detail = str(e).split("\n", 1)[-1].strip()
            report.note = "the compiler stopped: temporaries alone exceed HBM\n" + detail[:6000]
            return report
    report.compile_s = time.time() - start
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older JAX returned one dict per program
        cost = cost[0] if cost else {}
    report.argument_bytes = int(memory.argument_size_in_bytes)
    report.output_bytes = int(memory.output_size_in_bytes)
    report.alias_bytes = int(memory.alias_size_in_bytes)
    report.temp_bytes = int(memory.temp_size_in_bytes)
    report.code_bytes = int(memory.generated_code_size_in_bytes)
    report.flops_per_device = float((cost or {}).get("flops", 0.0))
    return report


# "... the total memory required for HLO temporaries (315.81G) exceeds available HBM ..."
_OOM = re.compile(r"HLO temporaries \(([0-9.]+)([KMGT])\) exceeds available HBM")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _argument_bytes(abstract_state, batch) -> int:
    """Per-device bytes of the step's inputs, from their shardings."""
    total = 0
    for leaf in jax.tree.leaves((abstract_state, batch)):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard)) * np.dtype(leaf.dtype).itemsize
    return total


_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU topology, e.g. v5p:8x8x4, or cpu.")
_STAGE = flags.DEFINE_string("stage", None, "Stage whose settings to compile (default: config).")


def main(argv):
    del argv
    report = compile_train_step(_CONFIG.value, _TOPOLOGY.value, _STAGE.value)
    print(report.text(), flush=True)
    sys.exit(0 if report.fits else 1)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "topology"])
    app.run(main)
