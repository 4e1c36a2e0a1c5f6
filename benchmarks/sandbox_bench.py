"""Harness throughput: sandbox overhead vs a bare subprocess, per-tool latency, pool calls/s.

    sudo .venv/bin/python benchmarks/sandbox_bench.py [--calls=200] [--workers=2] [--episodes=8]

Needs root and the system tools (launch/install_system_deps.sh). Prints one
markdown table per measurement; every figure in a table comes from the same run, so
compare within a table (the absolute numbers depend on the machine and its load).

1. Command overhead: the same command through ``subprocess.run`` and ``Sandbox.run``
   (p50/p99 latency and the p50 ratio).
2. Tool latency: each tool through ``Tools.execute`` in one process.
3. Pool throughput: ``--episodes`` scripted agents, one thread each, issuing a mix of
   tool calls through a ``ToolPool`` of ``--workers`` processes: calls/s and
   end-to-end p50/p99 latency.
4. Sandbox lifecycle: entering and leaving a sandbox for a small repository.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags

from cursor_rl.chat.protocol import ToolCall
from cursor_rl.env import sandbox, testing
from cursor_rl.env.pool import ToolPool
from cursor_rl.env.sandbox import Sandbox
from cursor_rl.env.tools import ToolConfig, Tools

_CALLS = flags.DEFINE_integer("calls", 200, "Repetitions per latency measurement.")
_WORKERS = flags.DEFINE_integer("workers", 2, "Worker processes of the pool.")
_EPISODES = flags.DEFINE_integer("episodes", 8, "Concurrent episodes in the pool benchmark.")
_POOL_CALLS = flags.DEFINE_integer("pool_calls", 40, "Tool calls per episode in the pool run.")

# What an agent does most: read, search, edit, run something small.
_MIX = (
    ToolCall("read_file", {"path": "calc/ops.py"}),
    ToolCall("search", {"pattern": "def ", "glob": "*.py"}),
    ToolCall("list_dir", {"path": "calc"}),
    ToolCall("run_terminal", {"command": "python3 -c 'import calc.ops'"}),
    ToolCall("edit_file", {"path": "scratch.txt", "old_str": "", "new_str": "x"}),
    ToolCall("run_terminal", {"command": "rm -f scratch.txt && git status --short"}),
)


def _percentiles(seconds: list[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.median(ordered) * 1e3, p99 * 1e3


def _timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _command_overhead(sb: Sandbox, n: int):
    print("\n### Command overhead (same command, bare subprocess vs sandbox)\n")
    print("| command | bare p50 ms | bare p99 ms | sandbox p50 ms | sandbox p99 ms | p50 ratio |")
    print("|---|---|---|---|---|---|")
    # Absolute paths: the host's PATH may hold slower wrappers (pyenv shims).
    for cmd in ("/bin/true", "/usr/bin/python3 -c pass", "/bin/ls -R . >/dev/null"):
        bare = _timed(lambda c=cmd: subprocess.run(["/bin/sh", "-c", c], cwd=sb.live_root), n)
        boxed = _timed(lambda c=cmd: sb.run(c, timeout_s=30), n)
        (b50, b99), (s50, s99) = _percentiles(bare), _percentiles(boxed)
        print(f"| `{cmd}` | {b50:.1f} | {b99:.1f} | {s50:.1f} | {s99:.1f} | {s50 / b50:.1f}x |")


def _tool_latency(sb: Sandbox, n: int):
    print("\n### Tool latency (in process, one sandbox)\n")
    print("| tool call | p50 ms | p99 ms | calls/s |")
    print("|---|---|---|---|")
    tools, python_search = Tools(sb), Tools(sb, ToolConfig(use_ripgrep=False))
    edits = [
        ToolCall("edit_file", {"path": "calc/ops.py", "old_str": "a + b", "new_str": "b + a"}),
        ToolCall("edit_file", {"path": "calc/ops.py", "old_str": "b + a", "new_str": "a + b"}),
    ]
    cases = [
        ("read_file", lambda i: tools.execute(_MIX[0])),
        ("list_dir", lambda i: tools.execute(_MIX[2])),
        ("edit_file", lambda i: tools.execute(edits[i % 2])),
        ("search (ripgrep, in the sandbox)", lambda i: tools.execute(_MIX[1])),
        ("search (pure Python)", lambda i: python_search.execute(_MIX[1])),
        (
            "run_terminal true",
            lambda i: tools.execute(ToolCall("run_terminal", {"command": "true"})),
        ),
        ("lint calc", lambda i: tools.execute(ToolCall("lint", {"path": "calc"}))),
    ]
    for label, fn in cases:
        count = iter(range(n))
        seconds = _timed(lambda f=fn, c=count: f(next(c)), n)
        p50, p99 = _percentiles(seconds)
        print(f"| {label} | {p50:.2f} | {p99:.2f} | {len(seconds) / sum(seconds):.0f} |")


def _pool_throughput(repo: str, root: str, workers: int, episodes: int, calls: int):
    print(f"\n### Pool throughput ({workers} workers, {episodes} episodes, tool mix)\n")
    latencies: list[float] = []
    lock = threading.Lock()
    with ToolPool(workers, max_pending=2 * workers) as pool:
        handles = []
        for i in range(episodes):
            ws = os.path.join(root, f"pool{i}")
            shutil.copytree(repo, ws, symlinks=True)
            handles.append(pool.open_episode(ws))

        def agent(handle):
            mine = []
            for i in range(calls):
                start = time.perf_counter()
                handle.execute(_MIX[i % len(_MIX)])
                mine.append(time.perf_counter() - start)
            with lock:
                latencies.extend(mine)

        threads = [threading.Thread(target=agent, args=(h,)) for h in handles]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        for handle in handles:
            handle.close()
    p50, p99 = _percentiles(latencies)
    print("| tool calls | wall s | calls/s | p50 ms | p99 ms |")
    print("|---|---|---|---|---|")
    print(
        f"| {len(latencies)} | {wall:.1f} | {len(latencies) / wall:.0f} | {p50:.1f} | {p99:.1f} |"
    )


def _lifecycle(repo: str, n: int):
    print("\n### Sandbox lifecycle (enter + leave, toy repository with git history)\n")
    seconds = _timed(lambda: Sandbox(repo).__enter__().__exit__(None, None, None), n)
    p50, p99 = _percentiles(seconds)
    print("| p50 ms | p99 ms |\n|---|---|")
    print(f"| {p50:.0f} | {p99:.0f} |")


def main(argv):
    del argv
    reason = sandbox.unavailable_reason()
    if reason is not None:
        sys.exit(f"cannot benchmark sandboxes here: {reason}")
    print(f"cpus: {os.cpu_count()}; load average: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="sandbox_bench_") as root:
        task = testing.make_toy_task(root)
        with Sandbox(task.repo) as sb:
            _command_overhead(sb, _CALLS.value)
            _tool_latency(sb, _CALLS.value)
        _pool_throughput(task.repo, root, _WORKERS.value, _EPISODES.value, _POOL_CALLS.value)
        _lifecycle(task.repo, max(_CALLS.value // 10, 5))


if __name__ == "__main__":
    app.run(main)
