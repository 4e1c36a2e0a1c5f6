"""Ahead-of-time compile of every device program of a config, for a TPU topology, on the CPU.

    JAX_PLATFORMS=cpu TPU_WORKER_HOSTNAMES=localhost TPU_ACCELERATOR_TYPE=v5p-8 \\
    python -m cursor_rl.tools.aot_compile --config=configs/kimi_k2.py --program=all \\
        --topology=v5p:8x8x8 --sampler_topology=v5p:4x4x4 --sampler_mesh=expert=-1

Programs (``--program``, comma-separated or ``all``):

* ``train``: the pretraining/SFT train step (``train/step.py``), as the train loop
  jits it, for ``--stage``'s settings;
* ``grpo``: the RL update (``rl/grpo.py`` ``grpo_step``), as ``RLTrainer._update``
  jits it: ``rl.train_seq_len``-long rows of ``grpo.RL_BATCH_KEYS`` (``--grpo_rows``
  per update), with the textual-feedback teacher rows (``grpo.FEEDBACK_KEYS``) when
  ``--grpo_feedback``;
* ``sampler``: the sampler engine's prefill and decode programs
  (``sampler/engine.py``) with its paged latent KV cache for ``--sampler_slots``
  decode slots of ``--sampler_context`` tokens, on the sampler's own slice
  (``--sampler_topology``) and mesh (``--sampler_mesh``, else ``rl.sampler.mesh``).

The trainer programs compile for ``--topology``. A TPU topology needs the ``tpu``
extra (libtpu): ``jax.experimental.topologies`` describes the target chips and XLA's
TPU compiler runs here. ``cpu`` compiles for the local (emulated) CPU devices
instead, which exercises the same path without libtpu.

Each program prints its memory per chip: the inputs by kind (parameters, optimizer
state, batch; for the sampler weights and KV cache) from the abstract arrays'
shardings, then the compiler's figures (outputs not aliased to donated inputs,
temporaries, generated code) against the chip's HBM, and the compiled FLOPs. The
tool exits with status 1 when a program does not fit; such a program's report names
its largest buffers (from the compiler, when it refused the program) and the
settings that would shrink it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import app, flags
from jax.experimental import topologies
from ml_collections import config_flags

from cursor_rl import partitioning, stages
from cursor_rl.model import kv_cache
from cursor_rl.model.config import ModelConfig
from cursor_rl.rl import feedback as feedback_lib
from cursor_rl.rl import grpo as grpo_lib
from cursor_rl.rl import trainer as rl_trainer
from cursor_rl.sampler import engine as engine_lib
from cursor_rl.sampler import sampling as sampling_lib
from cursor_rl.sampler import weights as weights_lib
from cursor_rl.train import optimizer as optim
from cursor_rl.train import step as step_lib
from cursor_rl.train.loop import validate_stage_config

GiB = 2**30
PROGRAMS = ("train", "grpo", "sampler")

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


def _gib(n: float) -> str:
    """A byte count in GiB, or MiB / KiB when small (fixed width, for the columns)."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20)):
        if abs(n) >= size:
            return f"{n / size:9.2f} {unit}"
    return f"{n / 2**10:9.2f} KiB"


@dataclasses.dataclass
class AotReport:
    """What the compiler says about one program on one device of the topology.

    ``inputs``: per-device bytes of the program's arguments by kind, from their
    shardings (``parameters``, ``optimizer state``, ``batch``, ...); the compiler's
    own ``argument_bytes`` should match their sum up to padding.
    """

    topology: str
    device_kind: str
    num_devices: int
    mesh_shape: dict[str, int]
    hbm_bytes: int | None
    model_flops_per_step: float
    tokens_per_step: int
    # The compiler's figures, filled in once the program compiled.
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    host_temp_bytes: int = 0  # temporaries in host memory (offloaded), not in HBM
    flops_per_device: float = 0.0
    compile_s: float = 0.0
    note: str = ""
    program: str = "train"
    inputs: dict[str, int] = dataclasses.field(default_factory=dict)
    # Settings that shrink this program, with their values (printed when it does not fit).
    knobs: tuple[str, ...] = ()
    refused: bool = False  # the compiler stopped: the program exceeds HBM
    # The largest input arrays per chip with their shardings (printed when it does not fit).
    largest_inputs: tuple[str, ...] = ()

    @property
    def held_argument_bytes(self) -> int:
        """The arguments on the chip: the compiler leaves out inputs the program never
        reads (``ref_logprobs`` when ``rl.grpo.kl_coef`` is 0), but the caller has put
        them there all the same."""
        return max(self.argument_bytes, sum(self.inputs.values()))

    @property
    def total_bytes(self) -> int:
        # Donated inputs alias outputs: count those buffers once.
        return (
            self.held_argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
            + self.code_bytes
        )

    @property
    def fits(self) -> bool:
        if self.refused:
            return False
        return self.hbm_bytes is None or self.total_bytes <= self.hbm_bytes

    def header(self) -> str:
        return (
            f"{self.program} on {self.topology}: {self.num_devices} x {self.device_kind}, "
            f"mesh {_mesh_text(self.mesh_shape)}"
        )

    def memory_rows(self) -> list[str]:
        rows = [f"  {name:<22}{_gib(size)}" for name, size in self.inputs.items()]
        rows += [
            f"  = arguments           {_gib(self.argument_bytes)}  (compiler"
            + (
                f"; {_gib(self.held_argument_bytes - self.argument_bytes).strip()} of inputs "
                "it does not read)"
                if self.held_argument_bytes > self.argument_bytes
                else ")"
            ),
            f"  outputs not aliased   {_gib(self.output_bytes - self.alias_bytes)}",
            f"  temporaries           {_gib(self.temp_bytes)}  (activations, gradients, buffers)",
            f"  generated code        {_gib(self.code_bytes)}",
        ]
        if self.host_temp_bytes:
            host = _gib(self.host_temp_bytes)
            rows.append(f"  (host memory          {host}  offloaded, not in HBM)")
        return rows

    def text(self) -> str:
        rows = [self.header(), *self.memory_rows()]
        rows.append(
            f"  total                 {_gib(self.total_bytes)} per chip, HBM "
            f"{_hbm_text(self.hbm_bytes)}: {_verdict(self)}"
        )
        flops = f"  compiled FLOPs/step/device {self.flops_per_device:.3e}"
        if self.refused:
            flops = "  not compiled"
        elif self.model_flops_per_step:
            flops += (
                f"; model FLOPs/step {self.model_flops_per_step:.3e} "
                f"({self.tokens_per_step:,} tokens)"
            )
        rows.append(f"{flops}; compile {self.compile_s:.1f}s")
        rows += _advice(self)
        return "\n".join(rows)


@dataclasses.dataclass
class SamplerReport:
    """The sampler's two programs on its slice; they share the weights and the cache.

    Per chip the sampler holds the weights and the KV cache once, both programs'
    code, and at any time one program's row inputs, outputs and temporaries.
    """

    prefill: AotReport
    decode: AotReport
    weights_bytes: int  # per chip
    cache_bytes: int  # per chip
    num_slots: int
    context: int
    page_size: int
    num_pages: int  # over all chips
    prefill_shape: tuple[int, int]  # (rows, chunk tokens) of the prefill program
    cache_bytes_per_token: int  # all layers, one token

    program = "sampler"

    @property
    def programs(self) -> tuple[AotReport, AotReport]:
        return self.prefill, self.decode

    @property
    def hbm_bytes(self) -> int | None:
        return self.prefill.hbm_bytes

    @property
    def refused(self) -> bool:
        return any(p.refused for p in self.programs)

    @property
    def knobs(self) -> tuple[str, ...]:
        return self.prefill.knobs

    @property
    def largest_inputs(self) -> tuple[str, ...]:
        return self.prefill.largest_inputs

    @property
    def note(self) -> str:
        return "\n".join(p.note for p in self.programs if p.note)

    @property
    def compile_s(self) -> float:
        return sum(p.compile_s for p in self.programs)

    def _working(self, p: AotReport) -> int:
        # What a call needs beyond the resident weights and cache.
        shared = self.weights_bytes + self.cache_bytes
        inputs = max(0, p.held_argument_bytes - shared)
        return inputs + p.output_bytes - p.alias_bytes + p.temp_bytes

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.cache_bytes
            + max(self._working(p) for p in self.programs)
            + sum(p.code_bytes for p in self.programs)
        )

    @property
    def fits(self) -> bool:
        if self.refused:
            return False
        return self.hbm_bytes is None or self.total_bytes <= self.hbm_bytes

    def text(self) -> str:
        d = self.decode
        sequences = self.num_pages * self.page_size / self.context
        rows = [
            f"sampler on {d.topology}: {d.num_devices} x {d.device_kind}, "
            f"mesh {_mesh_text(d.mesh_shape)}",
            f"  {self.num_slots} decode slots, context {self.context:,}, cache {self.num_pages:,} "
            f"pages of {self.page_size} tokens ({sequences:g} full-context sequences, "
            f"{self.cache_bytes_per_token:,} bytes/token); prefill calls of "
            f"{self.prefill_shape[0]} rows x {self.prefill_shape[1]} tokens",
            f"  weights               {_gib(self.weights_bytes)}",
            f"  KV cache              {_gib(self.cache_bytes)}",
        ]
        for p in self.programs:
            name = p.program.split()[-1]
            rows.append(
                f"  {name:<8}temporaries {_gib(p.temp_bytes)}, row inputs/outputs "
                f"{_gib(self._working(p) - p.temp_bytes)}, code {_gib(p.code_bytes)}, "
                f"{p.flops_per_device:.3e} FLOPs/device, compile {p.compile_s:.1f}s"
            )
        rows.append(
            f"  total                 {_gib(self.total_bytes)} per chip (weights + cache + the "
            f"larger call + both programs' code), HBM {_hbm_text(self.hbm_bytes)}: "
            f"{_verdict(self)}"
        )
        rows += _advice(self)
        return "\n".join(rows)


def _mesh_text(shape: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items() if v > 1) or "1 device"


def _hbm_text(hbm: int | None) -> str:
    return "unknown" if hbm is None else _gib(hbm).strip()


def _verdict(report) -> str:
    if report.refused:
        return "DOES NOT FIT (the compiler refused it)"
    if report.hbm_bytes is None:
        return "no HBM limit known"
    return "fits" if report.fits else "DOES NOT FIT"


def _advice(report) -> list[str]:
    rows = []
    if report.note:
        rows += ["  " + line for line in report.note.splitlines()]
    if not report.fits:
        if report.largest_inputs:
            rows.append("  largest inputs per chip (a replicated one may want a mesh.rules entry):")
            rows += [f"    {line}" for line in report.largest_inputs]
        rows.append("  to shrink it, try:")
        rows += [f"    - {knob}" for knob in report.knobs]
    return rows


# ---- devices, meshes, per-chip bytes ------------------------------------------------


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


def _target_model(model_config: ModelConfig, devices: Sequence) -> ModelConfig:
    if model_config.moe_impl == "auto" and devices[0].platform != "cpu":
        # "auto" follows the *running* backend (the CPU here); the target is the TPU.
        return model_config.replace(moe_impl="ragged")
    return model_config


def _device_fields(topology: str, devices: Sequence, hbm: int | None) -> dict[str, Any]:
    kind = getattr(devices[0], "device_kind", devices[0].platform)
    if hbm is None and topology != "cpu":
        hbm = hbm_bytes(kind)
    return dict(topology=topology, device_kind=kind, num_devices=len(devices), hbm_bytes=hbm)


def per_device_bytes(tree) -> int:
    """Bytes one device holds of the arrays of ``tree`` (ShapeDtypeStructs with shardings)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def _with_sharding(shapes, shardings):
    return jax.tree.map(
        lambda s, d: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=d), shapes, shardings
    )


class CompilerError(RuntimeError):
    """The compiler failed on a program for a reason other than memory (e.g. a libtpu
    bug): the program, the topology and the compiler's own first line."""

    def __init__(self, program: str, topology: str, error: Exception):
        first = next((line for line in str(error).splitlines() if line.strip()), repr(error))
        super().__init__(
            f"{program} on {topology}: the compiler failed (not a memory refusal): {first[:600]}"
        )


def _compile(fn, args: Sequence, mesh, rules, report: AotReport) -> AotReport:
    """Lowers and compiles ``fn(*args)`` under ``mesh``; fills ``report`` in place."""
    start = time.time()
    with partitioning.use_mesh(mesh, rules):
        lowered = fn.lower(*args)
        try:
            compiled = lowered.compile()
        except Exception as e:  # the TPU compiler refuses programs that exceed HBM
            report.compile_s = time.time() - start
            if not _refusal(str(e), report):
                raise CompilerError(report.program, report.topology, e) from e
            arrays = largest_arrays(lowered.as_text())
            if arrays:
                report.note += (
                    "\nthe program's largest arrays (global shapes: the compiler splits them "
                    "over the mesh as their shardings allow):\n"
                    + "\n".join(f"  {text}" for text in arrays)
                )
            report.argument_bytes = sum(report.inputs.values())
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
    report.host_temp_bytes = int(getattr(memory, "host_temp_size_in_bytes", 0) or 0)
    report.flops_per_device = float((cost or {}).get("flops", 0.0))
    return report


# "... the total memory required for HLO temporaries (315.81G) exceeds available HBM ..."
_OOM = re.compile(r"HLO temporaries \(([0-9.]+)([KMGT])\) exceeds available HBM")
# "Ran out of memory in memory space hbm. Used 105.10G of 95.74G hbm. ..."
_OOM_USED = re.compile(r"Used ([0-9.]+)([KMGT]) of ([0-9.]+)([KMGT]) hbm")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# Lines of the compiler's buffer listing worth keeping ("Size: 12.00G", shapes, ops).
_BUFFER_LINE = re.compile(r"^\s*(\d+\.\s|Size:|Operator:|Shape:|Allocation type:|XLA label:)")
_MAX_BUFFER_LINES = 40


_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]+\d*(?:E\d+M\d+\w*)?)>")
_ITEMSIZE = {"f64": 8, "i64": 8, "ui64": 8, "f32": 4, "i32": 4, "ui32": 4, "bf16": 2, "f16": 2}
_OP = re.compile(r"= (?:\"?)([a-z_]+\.[a-z_]+)")


def largest_arrays(stablehlo: str, count: int = 6) -> list[str]:
    """The ``count`` largest distinct results in a lowered program's text, as
    ``"f32[64,2,256,256] 32.0 MiB (stablehlo.dot_general)"``."""
    found: dict[tuple[str, str], tuple[int, str]] = {}
    for line in stablehlo.splitlines():
        op = _OP.search(line)
        if not op:
            continue
        results = line.rsplit("->", 1)[1] if "->" in line else line.rsplit(" : ", 1)[-1]
        for dims, dtype in _TENSOR.findall(results):
            shape = [int(d) for d in dims.split("x") if d]
            size = math.prod(shape) * _ITEMSIZE.get(dtype, 1)
            key = (dtype, ",".join(map(str, shape)))
            if size > found.get(key, (0, ""))[0]:
                found[key] = (size, op.group(1))
    ranked = sorted(found.items(), key=lambda kv: -kv[1][0])[:count]
    return [
        f"{dtype}[{shape}] {_gib(size).strip()} ({op})" for (dtype, shape), (size, op) in ranked
    ]


def _refusal(message: str, report: AotReport) -> bool:
    """Recognises the TPU compiler's out-of-memory refusal; keeps its largest buffers."""
    temporaries = _OOM.search(message)
    used = _OOM_USED.search(message)
    if not temporaries and not used:
        return False
    report.refused = True
    if temporaries:
        report.temp_bytes = int(float(temporaries.group(1)) * _UNITS[temporaries.group(2)])
        summary = (
            f"the compiler refused it: temporaries alone need "
            f"{temporaries.group(1)}{temporaries.group(2)}B per chip"
        )
    else:
        summary = (
            f"the compiler refused it: {used.group(1)}{used.group(2)}B needed per chip, "
            f"{used.group(3)}{used.group(4)}B available"
        )
    kept = [line.rstrip() for line in message.splitlines() if _BUFFER_LINE.match(line)]
    if kept:
        summary += "; its largest buffers:\n" + "\n".join(
            "  " + line.strip()[:200] for line in kept[:_MAX_BUFFER_LINES]
        )
        if len(kept) > _MAX_BUFFER_LINES:
            summary += f"\n  ... ({len(kept) - _MAX_BUFFER_LINES} more lines)"
    report.note = summary
    return True


def _state_inputs(abstract_state: step_lib.TrainState) -> dict[str, int]:
    return {
        "parameters": per_device_bytes(abstract_state.params),
        "optimizer state": per_device_bytes(abstract_state.opt_state),
        "router bias, counters": per_device_bytes(
            (abstract_state.router, abstract_state.step, abstract_state.skipped)
        ),
    }


def largest_inputs(tree, count: int = 5) -> tuple[str, ...]:
    """The ``count`` largest arrays of ``tree`` per device, layers of a stack summed
    (``moe_layers/attn/q_b_proj 4.22 GiB, P(None, None, 'tensor')``)."""
    sizes: dict[str, list] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        name = "/".join(k for k in keys if not k.startswith("layers_"))
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        size = math.prod(shard) * np.dtype(leaf.dtype).itemsize
        entry = sizes.setdefault(name, [0, getattr(leaf.sharding, "spec", None)])
        entry[0] += size
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1][0])[:count]
    return tuple(f"{name} {_gib(size).strip()}, {spec}" for name, (size, spec) in ranked)


def _trainer_knobs(cfg, model_config: ModelConfig, extra: Sequence[str]) -> tuple[str, ...]:
    ici = cfg.mesh.ici.to_dict()
    knobs = [
        f"more chips or a larger fsdp axis (mesh.ici={ici}): parameters and optimizer state "
        "shard over fsdp (and expert) devices",
        *extra,
    ]
    if model_config.remat_policy not in ("full", "offload_layer_inputs"):
        knobs.append(
            f"model.remat_policy={model_config.remat_policy!r} -> 'full' (or one that saves "
            "less): activations recomputed in the backward pass"
        )
    if model_config.remat_policy != "offload_layer_inputs":
        knobs.append(
            "model.remat_policy='offload_layer_inputs' (full recomputation, each layer's "
            "saved input in host memory)"
        )
    if model_config.attention_impl != "splash":
        knobs.append(
            "model.attention_impl='splash' (the TPU flash-attention kernel: no score "
            "matrix in either pass)"
        )
    if model_config.attention_impl == "dot":
        knobs.append("model.attention_impl='chunked' (one query chunk's scores at a time)")
    elif model_config.attention_impl == "chunked":
        knobs.append(f"a smaller model.attention_chunk_size={model_config.attention_chunk_size}")
    if not cfg.train.loss_chunk_size:
        knobs.append("train.loss_chunk_size (project the vocabulary in chunks)")
    knobs.append(f"optimizer.name={cfg.optimizer.name!r} (Muon keeps one moment, AdamW two)")
    return tuple(knobs)


# ---- the train step -----------------------------------------------------------------


def compile_train_step(
    config: ml_collections.ConfigDict,
    topology: str,
    stage: str | None = None,
    *,
    hbm: int | None = None,
) -> AotReport:
    """Lowers and compiles the full train step of ``config`` for ``topology``.

    Args:
      config: an experiment config (``configs/NAME.py``).
      topology: e.g. ``v5p:8x8x4`` (TPU, needs libtpu) or ``cpu`` (local devices).
      stage: which stage's settings; default the config's stage (``all`` -> pretrain).
      hbm: bytes per chip to check against (default: the chip's; none for ``cpu``).

    Returns:
      The memory and FLOPs report.
    """
    stage = stage or (config.stage if config.stage in stages.TRAIN_STAGES else "pretrain")
    cfg = stages.stage_config(config, stage)
    devices = topology_devices(topology)
    model_config = _target_model(validate_stage_config(cfg, len(devices)), devices)
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
    schedule = optim.make_schedule(cfg.optimizer, num_steps)
    fn = step_lib.jit_train_step(cfg.train, model_config, tx, schedule, state_sh, batch_sharding)
    tokens = int(cfg.train.batch_size * cfg.train.seq_len)
    report = AotReport(
        **_device_fields(topology, devices, hbm),
        mesh_shape=dict(mesh.shape),
        model_flops_per_step=model_config.flops_per_token(int(cfg.train.seq_len)) * tokens,
        tokens_per_step=tokens,
        program=f"train ({stage})",
        inputs={**_state_inputs(abstract_state), "batch": per_device_bytes(batch)},
        largest_inputs=largest_inputs(
            {"params": abstract_state.params, "opt": abstract_state.opt_state}
        ),
        knobs=_trainer_knobs(
            cfg,
            model_config,
            [
                f"train.microbatches={cfg.train.microbatches} (more: smaller activations, "
                "same update)",
                f"train.batch_size={cfg.train.batch_size}, train.seq_len={cfg.train.seq_len}",
            ],
        ),
    )
    return _compile(fn, (abstract_state, batch), mesh, rules, report)


# ---- the GRPO step ------------------------------------------------------------------


def grpo_microbatches(rl: ml_collections.ConfigDict, rows: int) -> int:
    """Microbatches of an update of ``rows`` rows, as the RL trainer counts them."""
    return rl_trainer.microbatch_count(
        int(rl.microbatches), int(rl.get("microbatch_rows", 0)), rows
    )


def default_grpo_rows(rl: ml_collections.ConfigDict, rows_multiple: int) -> int:
    """Rows of one update when every episode of a rollout batch fills one row:
    ``tasks_per_step * group_size`` rounded as the trainer's packer rounds them (a power
    of two times the batch shards x microbatches x updates), then one update's slice."""
    slices = int(rl.updates_per_batch)
    multiple = rows_multiple * slices
    episodes = int(rl.tasks_per_step) * int(rl.rollout.group_size)
    rows = multiple * 2 ** math.ceil(math.log2(max(episodes / multiple, 1)))
    return rows // slices


def compile_grpo_step(
    config: ml_collections.ConfigDict,
    topology: str,
    *,
    rows: int = 0,
    with_feedback: bool = False,
    teacher_rows: int = 0,
    hbm: int | None = None,
) -> AotReport:
    """Lowers and compiles the RL stage's GRPO update (``RLTrainer._update``) for ``topology``.

    Args:
      config: an experiment config; its ``rl`` stage settings are used.
      topology: as ``compile_train_step``.
      rows: rows of ``rl.train_seq_len`` tokens per update (0: ``default_grpo_rows``).
      with_feedback: also pass textual-feedback teacher rows (``grpo.FEEDBACK_KEYS``),
        scored with ``rl.feedback``'s objective.
      teacher_rows: teacher rows (0: the batch shards x microbatches, the packer's least).
      hbm: bytes per chip to check against (default: the chip's; none for ``cpu``).
    """
    cfg = stages.stage_config(config, "rl")
    rl = cfg.rl
    devices = topology_devices(topology)
    model_config = _target_model(stages.model_config(cfg).validate(), devices)
    mesh = partitioning.make_mesh(cfg.mesh.ici.to_dict(), cfg.mesh.dcn.to_dict(), devices)
    rules = partitioning.make_rules(cfg.mesh.rules_preset, cfg.mesh.rules.to_dict())
    batch_devices = partitioning.mesh_axis_size(mesh, partitioning.BATCH_AXES)
    rows_multiple = batch_devices * int(rl.microbatches)
    rows = rows or default_grpo_rows(rl, rows_multiple)
    if rows % rows_multiple:
        raise ValueError(
            f"--grpo_rows={rows}: must be a multiple of the batch axes' {batch_devices} devices "
            f"x rl.microbatches={rl.microbatches}"
        )
    microbatch_rows = int(rl.get("microbatch_rows", 0))
    if microbatch_rows % batch_devices:
        raise ValueError(
            f"rl.microbatch_rows={microbatch_rows}: must be 0 or a multiple of the batch axes' "
            f"{batch_devices} devices"
        )
    microbatches = grpo_microbatches(rl, rows)
    seq_len = int(rl.train_seq_len)
    updates = int(rl.num_steps) * int(rl.updates_per_batch)
    tx = optim.make_optimizer(cfg.optimizer, updates)
    abstract_state, state_sh = step_lib.abstract_train_state(model_config, tx, mesh, rules)
    batch_sharding = partitioning.logical_sharding(("act_batch", "act_length"), mesh, rules)
    grpo_config = grpo_lib.GRPOConfig.from_mapping(rl.grpo.to_dict())
    fb = feedback_lib.FeedbackConfig.from_mapping(rl.feedback.to_dict())

    def array(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding)

    batch = {
        k: array((rows, seq_len), "int32" if k in step_lib.BATCH_KEYS else "float32")
        for k in grpo_lib.RL_BATCH_KEYS
    }
    inputs = {**_state_inputs(abstract_state), "batch": per_device_bytes(batch)}
    if with_feedback:
        teacher_rows = teacher_rows or rows_multiple
        if teacher_rows % batch_devices:
            raise ValueError(
                f"--grpo_teacher_rows={teacher_rows}: must be a multiple of the batch axes' "
                f"{batch_devices} devices"
            )
        teacher = {k: array((teacher_rows, seq_len), "int32") for k in grpo_lib.TEACHER_KEYS}
        teacher["feedback_index"] = array((rows, seq_len), "int32")
        batch.update(teacher)
        inputs["feedback teacher rows"] = per_device_bytes(teacher)
    fn = grpo_lib.jit_grpo_step(
        model_config,
        grpo_config,
        tx,
        optim.make_schedule(cfg.optimizer, updates),
        state_sh,
        {k: batch_sharding for k in batch},
        microbatches=microbatches,
        loss_chunk=int(cfg.train.loss_chunk_size),
        temperature=float(rl.rollout.temperature),
        feedback=fb,
    )
    tokens = rows * seq_len
    name = f"grpo ({rows} rows x {seq_len}, {microbatches} microbatches"
    name += f", feedback {fb.objective} with {teacher_rows} teacher rows)" if with_feedback else ")"
    report = AotReport(
        **_device_fields(topology, devices, hbm),
        mesh_shape=dict(mesh.shape),
        model_flops_per_step=model_config.flops_per_token(seq_len) * tokens,
        tokens_per_step=tokens,
        program=name,
        inputs=inputs,
        largest_inputs=largest_inputs(
            {"params": abstract_state.params, "opt": abstract_state.opt_state}
        ),
        knobs=_trainer_knobs(
            cfg,
            model_config,
            [
                f"rl.microbatch_rows={microbatch_rows}, rl.microbatches={rl.microbatches} "
                f"(passes of fewer rows, gradients accumulated; now {microbatches})",
                f"rows per update ({rows}, --grpo_rows) via rl.updates_per_batch="
                f"{rl.updates_per_batch} or rl.tasks_per_step x rl.rollout.group_size; "
                f"rl.train_seq_len={seq_len}",
            ],
        ),
    )
    return _compile(fn, (abstract_state, batch), mesh, rules, report)


# ---- the sampler --------------------------------------------------------------------


def parse_mesh(text: str) -> dict[str, int]:
    """``"expert=-1,tensor=2"`` -> ``{"expert": -1, "tensor": 2}``."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, size = part.partition("=")
        if not size:
            raise ValueError(f"mesh {text!r}: expected axis=size pairs, got {part!r}")
        out[name.strip()] = int(size)
    return out


def compile_sampler(
    config: ml_collections.ConfigDict,
    topology: str,
    *,
    mesh_shape: Mapping[str, int] | None = None,
    num_slots: int = 0,
    context: int = 0,
    cache_sequences: int = 0,
    prefill_rows: int = 0,
    param_dtype: str = "",
    scan_layers: bool = False,
    hbm: int | None = None,
) -> SamplerReport:
    """Lowers and compiles the sampler engine's prefill and decode programs for ``topology``.

    Args:
      config: an experiment config; its ``rl`` stage model and ``rl.sampler`` settings.
      topology: the sampler's slice (``cpu``: the local devices).
      mesh_shape: the sampler's mesh axis sizes (default ``rl.sampler.mesh``, else all
        devices on ``fsdp``).
      num_slots: decode slots (0: ``rl.sampler.num_slots``).
      context: longest sequence (0: ``rl.sampler.max_seq_len``).
      cache_sequences: full-context sequences the page pool holds (0: the engine's
        default, twice the slots: room for paused sequences).
      prefill_rows: rows of the prefill program (0: the most a call of
        ``rl.sampler.prefill_tokens`` padded tokens takes).
      param_dtype: the sampler's weight dtype (default: the model's).
      scan_layers: weights stacked over layers (the RL sampler keeps them unstacked).
      hbm: bytes per chip to check against (default: the chip's; none for ``cpu``).
    """
    cfg = stages.stage_config(config, "rl")
    s = cfg.rl.sampler
    devices = topology_devices(topology)
    model_config = stages.model_config(cfg).replace(scan_layers=scan_layers)
    if param_dtype:
        model_config = model_config.replace(param_dtype=param_dtype)
    model_config = _target_model(model_config.validate(), devices)
    shape = dict(mesh_shape or s.mesh.to_dict() or {"fsdp": -1})
    mesh = partitioning.make_mesh(shape, None, devices)
    rules = partitioning.DEFAULT_RULES  # as the RL loop builds its sampler
    row_shards = partitioning.mesh_axis_size(
        mesh, partitioning.logical_to_spec(("cache_batch",), rules)[0] or ()
    )
    num_slots = num_slots or int(s.num_slots)
    context = context or int(s.max_seq_len)
    page_size = int(s.get("page_size", 32))
    # A chunk never exceeds the context (the engine pads short chunks to a power of two).
    chunk = engine_lib._bucket(context, 32, int(s.get("prefill_chunk", 256)))
    decode_steps = int(s.get("decode_steps", 32))
    pages_per_sequence = -(-context // page_size)
    num_pages = (cache_sequences or 2 * num_slots) * pages_per_sequence
    for name, value in (("slots", num_slots), ("cache pages", num_pages)):
        if value % row_shards:
            raise ValueError(
                f"sampler {name}={value} must divide over the {row_shards} row shards of mesh "
                f"{_mesh_text(dict(mesh.shape))}"
            )
    if num_pages // row_shards < pages_per_sequence:
        raise ValueError(
            f"sampler cache of {num_pages} pages leaves fewer than one sequence of {context} "
            f"tokens per row shard ({row_shards} shards): cache more sequences"
        )
    # The engine's buckets: rows per shard a power of two, chunks up to prefill_chunk.
    if not prefill_rows:
        budget = int(s.prefill_tokens)
        prefill_rows = min(num_slots, budget // chunk) if budget else num_slots
    per_shard = engine_lib._bucket(-(-prefill_rows // row_shards), 1, num_slots // row_shards)
    prefill_rows = per_shard * row_shards

    variables = weights_lib.abstract_target(model_config, mesh, rules)
    cache = _with_sharding(
        kv_cache.cache_shapes(model_config, num_pages, page_size),
        kv_cache.cache_shardings(model_config, mesh, rules),
    )
    row = partitioning.logical_sharding(("cache_batch",), mesh, rules)
    replicated = partitioning.replicated(mesh)

    def rows(b, *tail, dtype="int32"):
        return jax.ShapeDtypeStruct((b, *tail), dtype, sharding=row)

    def row_sampling(b):
        return sampling_lib.RowSampling(
            rows(b, 2, dtype="uint32"),
            rows(b, dtype="float32"),
            rows(b, dtype="float32"),
            rows(b),
        )

    shared = {"weights": per_device_bytes(variables), "KV cache": per_device_bytes(cache)}
    device_fields = _device_fields(topology, devices, hbm)
    knobs = (
        f"fewer slots (--sampler_slots={num_slots}, rl.sampler.num_slots) or a shorter "
        f"context (--sampler_context={context}, rl.sampler.max_seq_len): the KV cache is "
        "slots x context",
        "fewer cached sequences (--sampler_cache_sequences; default twice the slots, room for "
        "paused ones)",
        f"rl.sampler.prefill_tokens={s.prefill_tokens} (or --sampler_prefill_rows): smaller "
        "prefill calls",
        f"bfloat16 weights (--sampler_param_dtype; now {model_config.param_dtype})",
        f"a larger --sampler_topology or a mesh splitting the weights over more chips "
        f"(--sampler_mesh / rl.sampler.mesh; now {_mesh_text(dict(mesh.shape))})",
    )

    largest = largest_inputs({"weights": variables, "cache": cache})

    def report(name, inputs, tokens):
        return AotReport(
            **device_fields,
            mesh_shape=dict(mesh.shape),
            model_flops_per_step=0.0,
            tokens_per_step=tokens,
            program=f"sampler {name}",
            inputs={**shared, **inputs},
            knobs=knobs,
            largest_inputs=largest,
        )

    # Prefill: the largest call, full chunks reading a full-context page table.
    prefill_args = (
        rows(prefill_rows, chunk),
        kv_cache.CachedStep(
            rows(prefill_rows, chunk),
            rows(prefill_rows, chunk, dtype="bool"),
            rows(prefill_rows, pages_per_sequence),
            rows(prefill_rows),
        ),
        row_sampling(prefill_rows),
    )
    limits = (context, decode_steps, 0)
    prefill_fn = engine_lib._programs(model_config, mesh, rules, "prefill", *limits).get(
        ("aot", prefill_rows, chunk, pages_per_sequence)
    )
    prefill = _compile(
        prefill_fn,
        (variables, cache, *prefill_args),
        mesh,
        rules,
        report("prefill", {"row inputs": per_device_bytes(prefill_args)}, prefill_rows * chunk),
    )

    # Decode: every slot, a full-context page table, up to decode_steps per call.
    num_stops = 4  # the engine's smallest stop-id bucket
    slot_state = engine_lib._SlotState(*(rows(num_slots) for _ in range(5)))
    slot_state = slot_state._replace(active=rows(num_slots, dtype="bool"))
    decode_args = (
        slot_state,
        rows(num_slots, pages_per_sequence),
        row_sampling(num_slots),
        rows(num_slots, num_stops),
        jax.ShapeDtypeStruct((), "int32", sharding=replicated),
    )
    decode_model = engine_lib.decode_variant(model_config)
    decode_fn = engine_lib._programs(decode_model, mesh, rules, "decode", *limits).get(
        ("aot", pages_per_sequence, num_stops)
    )
    decode = _compile(
        decode_fn,
        (variables, cache, *decode_args),
        mesh,
        rules,
        report("decode", {"row inputs": per_device_bytes(decode_args)}, num_slots),
    )
    return SamplerReport(
        prefill=prefill,
        decode=decode,
        weights_bytes=shared["weights"],
        cache_bytes=shared["KV cache"],
        num_slots=num_slots,
        context=context,
        page_size=page_size,
        num_pages=num_pages,
        prefill_shape=(prefill_rows, chunk),
        cache_bytes_per_token=kv_cache.bytes_per_token(model_config)["latent"],
    )


# ---- command line -------------------------------------------------------------------


def parse_programs(text: str) -> tuple[str, ...]:
    names = PROGRAMS if text.strip() == "all" else tuple(p.strip() for p in text.split(","))
    unknown = sorted(set(names) - set(PROGRAMS))
    if unknown or not names:
        raise ValueError(f"--program={text!r}: a comma-separated list of {PROGRAMS}, or all")
    return names


def compile_programs(
    config: ml_collections.ConfigDict,
    programs: Sequence[str],
    *,
    topology: str,
    sampler_topology: str | None = None,
    stage: str | None = None,
    grpo: Mapping[str, Any] | None = None,
    sampler: Mapping[str, Any] | None = None,
    hbm: int | None = None,
    emit: Callable[[str], None] | None = None,
) -> list:
    """Compiles ``programs`` (names from ``PROGRAMS``); ``emit`` gets each report's text."""
    reports = []
    for name in programs:
        if name == "train":
            report = compile_train_step(config, topology, stage, hbm=hbm)
        elif name == "grpo":
            report = compile_grpo_step(config, topology, hbm=hbm, **(grpo or {}))
        else:
            report = compile_sampler(
                config, sampler_topology or topology, hbm=hbm, **(sampler or {})
            )
        reports.append(report)
        if emit is not None:
            emit(report.text())
    return reports


def define_flags() -> types.SimpleNamespace:
    """Defines the command's flags in absl's global ``FLAGS`` and returns their holders.

    Only the command itself and ``launch/presubmit.py`` call it: importing this module
    defines no flags, so it can share a process with other commands' modules (the eval
    transcripts' ``--stage``, the main CLI's ``--config``) without a clash.
    """
    return types.SimpleNamespace(
        config=config_flags.DEFINE_config_file("config", None, "Experiment config file."),
        topology=flags.DEFINE_string(
            "topology", None, "Trainer programs' TPU topology, e.g. v5p:8x8x4, or cpu."
        ),
        stage=flags.DEFINE_string(
            "stage", None, "Stage whose settings the train step uses (default: config)."
        ),
        program=flags.DEFINE_string(
            "program", "train", f"Comma-separated programs out of {PROGRAMS}, or all."
        ),
        sampler_topology=flags.DEFINE_string(
            "sampler_topology", None, "The sampler's TPU topology, or cpu (default: --topology)."
        ),
        sampler_mesh=flags.DEFINE_string(
            "sampler_mesh",
            "",
            "Sampler mesh axis sizes, e.g. expert=-1 (default: rl.sampler.mesh, else fsdp=-1).",
        ),
        sampler_slots=flags.DEFINE_integer("sampler_slots", 0, "Decode slots (0: rl.sampler)."),
        sampler_context=flags.DEFINE_integer(
            "sampler_context", 0, "Longest sequence in tokens (0: rl.sampler.max_seq_len)."
        ),
        sampler_cache_sequences=flags.DEFINE_integer(
            "sampler_cache_sequences",
            0,
            "Full-context sequences the KV cache holds (0: 2 x slots).",
        ),
        sampler_prefill_rows=flags.DEFINE_integer(
            "sampler_prefill_rows",
            0,
            "Rows of the prefill program (0: from rl.sampler.prefill_tokens).",
        ),
        sampler_param_dtype=flags.DEFINE_string(
            "sampler_param_dtype",
            "",
            "The sampler's weight dtype, e.g. bfloat16 (default: model's).",
        ),
        sampler_scan_layers=flags.DEFINE_bool(
            "sampler_scan_layers",
            False,
            "Sampler weights stacked over layers (the RL loop: unstacked).",
        ),
        grpo_rows=flags.DEFINE_integer(
            "grpo_rows", 0, "Rows per GRPO update (0: one per episode of a rollout batch)."
        ),
        grpo_feedback=flags.DEFINE_bool(
            "grpo_feedback", False, "Compile the GRPO update with textual-feedback teacher rows."
        ),
        grpo_teacher_rows=flags.DEFINE_integer(
            "grpo_teacher_rows", 0, "Teacher rows with --grpo_feedback (0: the packer's least)."
        ),
        hbm_gib=flags.DEFINE_float(
            "hbm_gib",
            0.0,
            "Check against this many GiB per chip (0: the chip's HBM; none on cpu).",
        ),
    )


def main(argv, f: types.SimpleNamespace):
    del argv
    try:
        reports = compile_programs(
            f.config.value,
            parse_programs(f.program.value),
            topology=f.topology.value,
            sampler_topology=f.sampler_topology.value,
            stage=f.stage.value,
            grpo=dict(
                rows=f.grpo_rows.value,
                with_feedback=f.grpo_feedback.value,
                teacher_rows=f.grpo_teacher_rows.value,
            ),
            sampler=dict(
                mesh_shape=parse_mesh(f.sampler_mesh.value) or None,
                num_slots=f.sampler_slots.value,
                context=f.sampler_context.value,
                cache_sequences=f.sampler_cache_sequences.value,
                prefill_rows=f.sampler_prefill_rows.value,
                param_dtype=f.sampler_param_dtype.value,
                scan_layers=f.sampler_scan_layers.value,
            ),
            hbm=int(f.hbm_gib.value * GiB) or None,
            emit=lambda text: print(text, flush=True),
        )
    except CompilerError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    failed = [r.program for r in reports if not r.fits]
    if failed:
        print(f"does not fit: {', '.join(failed)}", file=sys.stderr, flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    _flags = define_flags()
    flags.mark_flags_as_required(["config", "topology"])
    app.run(functools.partial(main, f=_flags))
