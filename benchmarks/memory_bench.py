"""Peak resident memory and training speed per stage, for each host memory allocator.

    python benchmarks/memory_bench.py [--allocators=glibc,glibc-tuned,tcmalloc] \
        [--stages=pretrain,long_context] [--steps=40] [--rounds=1]

Runs the main command's training stages on the tiny config (``configs/tiny.py``, from
the shipped base) in a child process per allocator, the stages one after another in
one workdir (long-context starts from the pretraining checkpoint, as in the main
command), and prints for each stage its peak resident memory (the pipeline's own
figure, ``cursor_rl/hostmem.py``) beside its training speed (median tokens/s of the
logged windows after the first, eval and probes off). With ``--rounds`` > 1 the
allocators alternate, so load from other processes hits them alike.

Allocators (the process's malloc is chosen at its start, hence one child each):

* ``glibc``: glibc's defaults (``CURSOR_RL_HOST_MALLOC=off``).
* ``glibc-tuned``: glibc with ``host_malloc``'s retain-everything settings
  (``CURSOR_RL_HOST_MALLOC=on``), the main command's choice before tcmalloc.
* ``tcmalloc`` / ``jemalloc``: preloaded by ``cursor_rl/main.py``
  (``host_malloc.preload``), when the library is installed
  (``launch/install_system_deps.sh`` installs tcmalloc; the main command's choice).
  ``jemalloc:KEY:VALUE;...`` passes ``MALLOC_CONF``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cursor_rl import host_malloc  # after the path is set

_ALLOCATORS = flags.DEFINE_list(
    "allocators", "glibc,glibc-tuned,tcmalloc", "Allocators to compare."
)
_STAGES = flags.DEFINE_list("stages", "pretrain,long_context", "Training stages, in order.")
_STEPS = flags.DEFINE_integer("steps", 40, "Steps per stage.")
_ROUNDS = flags.DEFINE_integer("rounds", 1, "Rounds over the allocators.")
_FLAGS = flags.DEFINE_list("config_flags", [], "Extra --config.x=y flags for every run.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK = re.compile(r"^\[(\w+)\] peak RSS ([0-9.]+) GiB", re.M)


def allocator_env(name: str) -> dict[str, str] | None:
    """The environment that selects ``name``; None when its library is missing."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("LD_PRELOAD", None)
    if name == "glibc":
        env[host_malloc.ENV] = "off"
    elif name == "glibc-tuned":
        env[host_malloc.ENV] = "on"
    elif name.split(":")[0] in host_malloc.PRELOAD_LIBRARIES:
        name, _, conf = name.partition(":")
        if host_malloc.find_library(name) is None:
            return None
        env[host_malloc.ENV] = name  # cursor_rl/main.py preloads it (host_malloc.preload)
        if conf:  # e.g. jemalloc:oversize_threshold:0 (MALLOC_CONF, commas as ';')
            env["MALLOC_CONF"] = conf.replace(";", ",")
    else:
        raise ValueError(f"unknown allocator {name!r}")
    return env


def run_allocator(name: str, stages: list[str], steps: int) -> dict[str, dict] | None:
    env = allocator_env(name)
    if env is None:
        print(f"{name}: library not installed, skipped", flush=True)
        return None
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="memory_bench_") as workdir:
        for stage in stages:
            cmd = [
                sys.executable, "-m", "cursor_rl.main",
                f"--config=configs/tiny.py:stage={stage}",
                f"--workdir={workdir}",
                f"--config.train.num_steps={steps}",
                f"--config.train.eval_every={10 * steps}",
                "--config.train.probe_every=0",
                f"--config.checkpoint.every_steps={steps}",
                "--config.train.log_every=5",
                *_FLAGS.value,
            ]  # fmt: skip
            out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(
                    f"{name} {stage} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
                )
            peaks = {m.group(1): float(m.group(2)) for m in PEAK.finditer(out.stdout)}
            speeds = []
            with open(os.path.join(workdir, "metrics.jsonl")) as f:
                for line in f:
                    row = json.loads(line)
                    if row.get("stage") == stage and "tokens_per_s" in row:
                        speeds.append(row["tokens_per_s"])
            rows[stage] = {
                "peak_gib": peaks[stage],
                "tok_s": statistics.median(speeds[1:] or speeds),
            }
    return rows


def main(argv):
    del argv
    results: dict[str, list[dict]] = {}
    for _ in range(_ROUNDS.value):
        for name in _ALLOCATORS.value:
            rows = run_allocator(name, _STAGES.value, _STEPS.value)
            if rows is not None:
                results.setdefault(name, []).append(rows)
                print(name, json.dumps(rows), flush=True)
    steps, rounds = _STEPS.value, _ROUNDS.value
    print(f"\n{os.cpu_count()} cores; {steps} steps per stage; median over {rounds} round(s)")
    print(f"{'allocator':<12} {'stage':<13} {'peak RSS GiB':>12} {'tokens/s':>9}")
    for name, runs in results.items():
        for stage in _STAGES.value:
            peak = statistics.median(r[stage]["peak_gib"] for r in runs)
            speed = statistics.median(r[stage]["tok_s"] for r in runs)
            print(f"{name:<12} {stage:<13} {peak:>12.2f} {speed:>9.0f}")


if __name__ == "__main__":
    app.run(main)
