"""Per-chip memory and compiled FLOPs of DeepSeek-V3-671B's train step: ours vs MaxText.

    python benchmarks/maxtext_aot_compare.py \
        --maxtext_dir=/tmp/maxtext --maxtext_python=/tmp/venv-maxtext/bin/python \
        --ours_python=/tmp/venv-tpu/bin/python [--out_dir=/tmp/aotcmp] [--reuse]

Both sides compile ahead of time, on this CPU, for the same TPU topology (v5p:8x8x8,
512 chips; MaxText's name for it is ``v5p-1024``), the same global batch and sequence
length (``--batch`` sequences of ``--seq`` tokens: MaxText's ``per_device_batch_size``
is ``batch / chips``):

* MaxText with its own AOT tool, ``python -m maxtext.trainers.pre_train.train_compile``
  on ``model_name=deepseek3-671b`` (a checkout's ``src/`` on the path; its requirements
  and libtpu in ``--maxtext_python``'s venv). It prints the compiled program's
  ``memory_analysis()`` and ``cost_analysis()``, which this script reads from its log.
  ``--maxtext_args`` are extra ``key=value`` settings of its config (the defaults below
  are its v5p recipe for this model: ``ici_fsdp_parallelism=-1``, megablox dropless
  experts, scanned layers, fp32 weights, bf16 activations, AdamW).
* ours with ``configs/deepseek_v3.py`` through ``cursor_rl.tools.aot_compile``'s
  ``compile_train_step`` (in a child process on ``--ours_python``, which needs the tpu
  extra). ``--ours_overrides`` are ``dotted.key=value`` changes of that config; the
  defaults mirror MaxText's layout: every chip on the fsdp axis, no expert axis.

The two compiles run one after the other (each takes minutes and several GiB of host
memory). Their logs and figures stay in ``--out_dir``; ``--reuse`` reads those instead
of compiling again. The table gives, per chip, the compiler's arguments, outputs not
aliased to donated inputs, temporaries, generated code and their total (the HBM a step
needs), and the compiled FLOPs per token (FLOPs per device x chips / tokens per step),
each as ours / MaxText.

The FLOPs are XLA's ``cost_analysis()``, which prices a loop body once whatever its
trip count: with scanned layers (both sides scan) they are roughly the embedding,
head and one layer of each scanned stack, not the step's FLOPs. Compare them with
each other, not with the model FLOPs printed beside them.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30

_MAXTEXT_DIR = flags.DEFINE_string("maxtext_dir", "/tmp/maxtext", "A MaxText checkout.")
_MAXTEXT_PY = flags.DEFINE_string(
    "maxtext_python", "/tmp/venv-maxtext/bin/python", "Python with MaxText's requirements."
)
_OURS_PY = flags.DEFINE_string(
    "ours_python", os.path.join(ROOT, ".venv-tpu/bin/python"), "Python with our tpu extra."
)
_TOPOLOGY = flags.DEFINE_string("tpu_topology", "v5p:8x8x8", "Our name of the TPU topology.")
_BATCH = flags.DEFINE_integer("batch", 1024, "Global batch, sequences.")
_SEQ = flags.DEFINE_integer("seq", 4096, "Sequence length, tokens.")
_MAXTEXT_ARGS = flags.DEFINE_list(
    "maxtext_args",
    [
        "model_name=deepseek3-671b",
        # DeepSeek-V3's device-limited routing (the model file says to set these).
        "n_routing_groups=8",
        "topk_routing_group=4",
        "ici_fsdp_parallelism=-1",
        "ici_tensor_parallelism=1",
        "dtype=bfloat16",
        "weight_dtype=float32",
        "megablox=true",
        "sparse_matmul=true",
        "scan_layers=true",
        "remat_policy=full",
        "opt_type=adamw",
    ],
    "MaxText config settings (key=value).",
)
_OURS_CONFIG = flags.DEFINE_string(
    "ours_config", os.path.join(ROOT, "configs/deepseek_v3.py"), "Our config file."
)
_OURS_OVERRIDES = flags.DEFINE_list(
    "ours_overrides",
    ["mesh.ici.fsdp=-1", "mesh.ici.expert=1"],
    "Changes of our config (dotted.key=value), after batch and seq.",
)
_OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/aotcmp", "Logs and figures.")
_TAG = flags.DEFINE_string("tag", "", "Suffix of the log/figure files (several variants).")
_REUSE = flags.DEFINE_bool("reuse", False, "Read the figures of earlier runs in --out_dir.")
_SIDE = flags.DEFINE_enum(
    "side", "both", ["both", "maxtext", "ours", "_ours_child"], "Which compiles to run."
)

# MaxText topology names count TensorCores (two per v5p chip).
_MAXTEXT_TOPOLOGY = {"v5p:8x8x8": "v5p-1024", "v5p:4x8x8": "v5p-512", "v5p:4x4x4": "v5p-128"}
_TPU_ENV = {"JAX_PLATFORMS": "cpu", "TPU_WORKER_HOSTNAMES": "localhost"}


def _chips(topology: str) -> int:
    return math.prod(int(n) for n in topology.split(":")[1].split("x"))


# ---- MaxText ------------------------------------------------------------------------


def parse_maxtext_log(text: str) -> dict:
    """The figures MaxText's train_compile prints after compiling."""
    memory = re.search(r"Memory analysis: CompiledMemoryStats\(([^)]*)\)", text)
    if not memory:
        tail = "\n".join(text.strip().splitlines()[-15:])
        raise RuntimeError(f"no memory analysis in MaxText's log; its end:\n{tail}")
    stats = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", memory.group(1))}
    cost_line = re.search(r"^Cost analysis: (.*)$", text, re.M)
    cost = ast.literal_eval(cost_line.group(1)) if cost_line else {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    return {
        "arguments": stats["argument_size_in_bytes"],
        "outputs": stats["output_size_in_bytes"],
        "aliased": stats["alias_size_in_bytes"],
        "temporaries": stats["temp_size_in_bytes"],
        "code": stats["generated_code_size_in_bytes"],
        "host_temporaries": stats.get("host_temp_size_in_bytes", 0),
        "host_arguments": stats.get("host_argument_size_in_bytes", 0),
        "flops_per_device": float(cost.get("flops", 0.0)),
    }


def run_maxtext(log_path: str) -> dict:
    chips = _chips(_TOPOLOGY.value)
    if _BATCH.value % chips:
        raise ValueError(f"--batch={_BATCH.value} is not a multiple of {chips} chips")
    src = os.path.join(_MAXTEXT_DIR.value, "src")
    cmd = [
        "nice",
        "-n",
        "10",
        _MAXTEXT_PY.value,
        "-m",
        "maxtext.trainers.pre_train.train_compile",
        os.path.join(src, "maxtext/configs/base.yml"),
        f"compile_topology={_MAXTEXT_TOPOLOGY[_TOPOLOGY.value]}",
        "compile_topology_num_slices=1",
        f"per_device_batch_size={_BATCH.value // chips}",
        f"max_target_length={_SEQ.value}",
        "dataset_type=synthetic",
        "enable_checkpointing=false",
        "run_name=aot_compare",
        f"base_output_directory={os.path.join(_OUT_DIR.value, 'maxtext_out')}",
        *_MAXTEXT_ARGS.value,
    ]
    # DECOUPLE_GCLOUD: MaxText's mode without the Google Cloud packages (stubs them).
    env = dict(os.environ, **_TPU_ENV, TPU_ACCELERATOR_TYPE="v5p-8", DECOUPLE_GCLOUD="TRUE")
    figures = _run(cmd, env, src, log_path)
    figures.update(parse_maxtext_log(figures.pop("log")))
    return figures


# ---- ours ---------------------------------------------------------------------------


def _set(config, dotted: str, value: str) -> None:
    *path, key = dotted.split(".")
    node = config
    for name in path:
        node = node[name]
    old = node.get(key)
    if isinstance(old, bool):
        node[key] = value.lower() in ("1", "true", "yes")
        return
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value  # a bare string
    node[key] = type(old)(parsed) if old is not None else parsed


def ours_child() -> None:
    """Runs in ``--ours_python``: compiles our train step, prints its figures as JSON."""
    sys.path.insert(0, ROOT)
    import importlib.util

    from cursor_rl.tools import aot_compile

    spec = importlib.util.spec_from_file_location("config", _OURS_CONFIG.value)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.train.batch_size = _BATCH.value
    config.train.seq_len = _SEQ.value
    for item in _OURS_OVERRIDES.value:
        key, _, value = item.partition("=")
        _set(config, key, value)
    report = aot_compile.compile_train_step(config, _TOPOLOGY.value)
    print(report.text(), flush=True)
    figures = {
        "arguments": report.argument_bytes,
        "outputs": report.output_bytes,
        "aliased": report.alias_bytes,
        "temporaries": report.temp_bytes,
        "code": report.code_bytes,
        "flops_per_device": report.flops_per_device,
        "model_flops_per_token": report.model_flops_per_step / report.tokens_per_step,
        "mesh": report.mesh_shape,
        "refused": report.refused,
    }
    print("FIGURES " + json.dumps(figures), flush=True)


def run_ours(log_path: str) -> dict:
    cmd = ["nice", "-n", "10", _OURS_PY.value, os.path.abspath(__file__), "--side=_ours_child"]
    for name in ("ours_config", "tpu_topology", "batch", "seq"):
        cmd.append(f"--{name}={flags.FLAGS[name].value}")
    cmd.append("--ours_overrides=" + ",".join(_OURS_OVERRIDES.value))
    env = dict(os.environ, **_TPU_ENV, TPU_ACCELERATOR_TYPE="v5p-8")
    figures = _run(cmd, env, ROOT, log_path)
    found = re.search(r"^FIGURES (.*)$", figures.pop("log"), re.M)
    if not found:
        raise RuntimeError(f"our compile printed no figures; see {log_path}")
    figures.update(json.loads(found.group(1)))
    return figures


# ---- both ---------------------------------------------------------------------------


def _run(cmd: list[str], env: dict, cwd: str, log_path: str) -> dict:
    print("$ " + " ".join(cmd), flush=True)
    start = time.time()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - start
    with open(log_path, encoding="utf-8") as fh:
        text = fh.read()
    if proc.returncode:
        tail = "\n".join(text.strip().splitlines()[-20:])
        raise RuntimeError(f"exit {proc.returncode} after {wall:.0f}s ({log_path}):\n{tail}")
    return {"compile_wall_s": wall, "log": text, "command": " ".join(cmd)}


def total_bytes(f: dict) -> int:
    # Donated inputs alias outputs: those buffers count once.
    return f["arguments"] + f["outputs"] - f["aliased"] + f["temporaries"] + f["code"]


def table(maxtext: dict, ours: dict, chips: int, tokens: int) -> str:
    def gib(n):
        return f"{n / GiB:8.2f} GiB"

    rows = [
        ("arguments (params, opt state, batch)", "arguments"),
        ("outputs not aliased", None),
        ("temporaries", "temporaries"),
        ("generated code", "code"),
        ("total per chip", "total"),
    ]
    width = 38
    lines = [f"{'per chip':<{width}} {'MaxText':>12} {'ours':>12}   ours/MaxText"]
    for label, key in rows:
        if key is None:
            a, b = maxtext["outputs"] - maxtext["aliased"], ours["outputs"] - ours["aliased"]
        elif key == "total":
            a, b = total_bytes(maxtext), total_bytes(ours)
        else:
            a, b = maxtext[key], ours[key]
        ratio = f"{b / a:6.3f}" if a >= 2**20 else "     -"  # no ratios of a few KiB
        lines.append(f"{label:<{width}} {gib(a)} {gib(b)}   {ratio}")
    fa, fb = (f["flops_per_device"] * chips / tokens for f in (maxtext, ours))
    ratio = f"{fb / fa:6.3f}" if fa else "     -"
    lines.append(f"{'compiled FLOPs per token':<{width}} {fa:12.4e} {fb:12.4e}   {ratio}")
    if ours.get("model_flops_per_token"):
        lines.append(
            f"{'  (model FLOPs/token, 6N + attention)':<{width}} {'':>12} "
            f"{ours['model_flops_per_token']:12.4e}"
        )
    host = maxtext.get("host_temporaries", 0) + maxtext.get("host_arguments", 0)
    if host:
        lines.append(f"{'MaxText host (offloaded) memory':<{width}} {gib(host)}")
    lines.append(
        f"{'compile wall time':<{width}} {maxtext['compile_wall_s']:10.0f} s "
        f"{ours['compile_wall_s']:10.0f} s"
    )
    return "\n".join(lines)


def main(argv):
    del argv
    if _SIDE.value == "_ours_child":
        ours_child()
        return
    os.makedirs(_OUT_DIR.value, exist_ok=True)
    results = {}
    for side, runner in (("maxtext", run_maxtext), ("ours", run_ours)):
        stem = os.path.join(_OUT_DIR.value, f"{side}{_TAG.value}")
        if _REUSE.value and os.path.exists(stem + ".json"):
            with open(stem + ".json", encoding="utf-8") as fh:
                results[side] = json.load(fh)
            continue
        if _SIDE.value not in ("both", side):
            continue
        results[side] = runner(stem + ".log")
        with open(stem + ".json", "w", encoding="utf-8") as fh:
            json.dump(results[side], fh, indent=1)
    chips, tokens = _chips(_TOPOLOGY.value), _BATCH.value * _SEQ.value
    print(
        f"DeepSeek-V3-671B train step, {_TOPOLOGY.value} ({chips} chips), "
        f"{_BATCH.value} x {_SEQ.value} tokens per step"
    )
    for side, figures in results.items():
        print(f"{side}: {figures['command']}")
    if len(results) == 2:
        print(table(results["maxtext"], results["ours"], chips, tokens))


if __name__ == "__main__":
    app.run(main)
