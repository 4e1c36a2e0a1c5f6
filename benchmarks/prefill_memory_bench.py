"""Prefill token cap: the sampler's peak host memory and prefill speed, side by side.

    .venv/bin/python -m benchmarks.prefill_memory_bench [--caps=0,4096,2048,1024] \
        [--rows=32] [--start=1700] [--repeats=3]

One engine of the tiny config (``configs/tiny.py``, chunked attention as in its RL
stage; random weights: memory and speed do not depend on them) and ``--rows``
sequences that each prefill a full chunk (256 tokens) at position ``--start``, the
burst an RL step or eval makes when every slot's tool output comes back at once. For
each cap (``prefill_tokens``, 0: none) the engine splits the rows into calls
(``Engine.prefill_calls``); printed per cap: calls, the growth of
resident memory during the burst over the steady state before it (the process's
high-water mark, ``cursor_rl/hostmem.py``), and prefill tokens/s (best of
``--repeats``, compilation excluded). One process, caps one after another, each
warmed up first, so the compiled programs of all caps stay resident: the figure is
the burst's own growth.
"""

from __future__ import annotations

import argparse
import gc
import time

# The imports below follow the allocator's choice on purpose.
from cursor_rl import host_malloc

# The main command's host allocator (tcmalloc when installed, by re-executing), before
# numpy and XLA start threads.
if host_malloc.preload() is None:
    host_malloc.configure()

import jax

from configs import tiny
from cursor_rl import hostmem
from cursor_rl.model import transformer
from cursor_rl.sampler import engine as engine_lib


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--caps", default="0,4096,2048,1024")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--start", type=int, default=1700)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = tiny.MODEL.replace(attention_impl="chunked", attention_chunk_size=256)
    engine = engine_lib.Engine(config, num_slots=args.rows, max_seq_len=2048)
    engine.set_variables(transformer.init(config, jax.random.key(0)))
    spec = engine_lib.TurnSpec((1, 2), 0.6, 1.0, 0, (5,))
    pages = engine.max_pages
    rows = [
        engine_lib.PrefillRow(
            0, list(range(1, 257)), args.start, list(range(i * pages, (i + 1) * pages)), spec
        )
        for i in range(args.rows)
    ]

    def burst():
        engine.prefill(rows)
        return len(engine.prefill_calls(rows))

    print(
        f"jax {jax.__version__}, allocator {host_malloc.preloaded() or 'glibc'}, "
        f"{args.rows} rows x 256 tokens at position {args.start}"
    )
    print(f"{'cap':>6} {'calls':>6} {'burst MiB':>10} {'tok/s':>8}")
    for cap in (int(c) for c in args.caps.split(",")):
        engine.prefill_tokens = cap
        burst()  # compiles this cap's shapes
        best = float("inf")
        growth = 0.0
        for _ in range(args.repeats):
            gc.collect()
            hostmem.release_free_memory()
            steady = hostmem.rss_bytes()
            hostmem.reset_peak()
            start = time.perf_counter()
            calls = burst()
            best = min(best, time.perf_counter() - start)
            growth = max(growth, (hostmem.peak_bytes() - steady) / 2**20)
        tokens = args.rows * 256
        print(f"{cap:>6} {calls:>6} {growth:>10.0f} {tokens / best:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
