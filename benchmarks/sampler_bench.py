"""Sampler vs transformers' generate (KV cache, PyTorch CPU): prefill and decode tokens/s.

    .venv/bin/python -m benchmarks.sampler_bench [--models=tiny,wide] [--batches=1,32]

Both sides run the same weights (ours exported with ``save_hf_checkpoint`` and
loaded by ``DeepseekV3ForCausalLM.from_pretrained``), greedy, on prompts of the same
length (no padding), in one process, one measurement after the other. Prefill
tokens/s is timed with ``max_new_tokens=1``; decode tokens/s is the extra time of a
``--new_tokens`` generation over that, per generated token. Each figure is the best
of ``--repeats`` runs (the machine is shared; the best run is the least disturbed).
Compilation is excluded (a warm-up run first). The load average is printed before
and after: the ratios are the result, the absolute numbers move with the load.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

# ruff: noqa: E402 (the imports below follow host_malloc.configure() on purpose)
from cursor_rl import host_malloc

host_malloc.configure()  # before numpy and XLA start threads (see host_malloc)

import jax
import numpy as np

from configs import tiny
from cursor_rl import model
from cursor_rl.model import hf, kv_cache
from cursor_rl.sampler import Sampler, SamplingParams

TINY = tiny.MODEL
# Twice as wide, still four layers and 8 experts (top-2 + 1 shared).
WIDE = TINY.replace(
    hidden_size=512,
    intermediate_size=1536,
    moe_intermediate_size=512,
    num_heads=8,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
)
MODELS = {"tiny": TINY, "wide": WIDE}


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_ours(config, variables, prompts, new_tokens, repeats):
    batch = len(prompts)
    sampler = Sampler(
        config,
        variables,
        num_slots=batch,
        max_seq_len=len(prompts[0]) + new_tokens,
        page_size=64,
        prefill_chunk=len(prompts[0]),
    )

    def run(n):
        out = sampler.generate(prompts, SamplingParams(max_new_tokens=n))
        assert all(len(c.tokens) == n for c in out)

    run(1), run(new_tokens)  # compile
    prefill = _best_time(lambda: run(1), repeats)
    total = _best_time(lambda: run(new_tokens), repeats)
    return prefill, total


def bench_transformers(hf_dir, prompts, new_tokens, repeats):
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.set_num_threads(os.cpu_count())
    hf_model = DeepseekV3ForCausalLM.from_pretrained(hf_dir).eval()
    hf_model.generation_config.eos_token_id = None  # exactly max_new_tokens
    input_ids = torch.tensor(prompts)
    mask = torch.ones_like(input_ids)  # no padding: nothing for generate to infer

    def run(n):
        with torch.no_grad():
            out = hf_model.generate(
                input_ids, attention_mask=mask, max_new_tokens=n, do_sample=False, use_cache=True
            )
        assert out.shape[1] == input_ids.shape[1] + n

    run(2)  # warm-up
    prefill = _best_time(lambda: run(1), repeats)
    total = _best_time(lambda: run(new_tokens), repeats)
    return prefill, total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,wide")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}; {os.cpu_count()} cores; jax {jax.__version__}")
    rows = []
    for name in args.models.split(","):
        config = MODELS[name]
        variables = jax.tree.map(np.asarray, model.init(config, jax.random.key(0)))
        sizes = kv_cache.bytes_per_token(config)
        print(
            f"{name}: cache bytes/token {sizes['latent']} (latent) vs "
            f"{sizes['naive_per_head_kv']} (per-head K/V), "
            f"{sizes['naive_per_head_kv'] / sizes['latent']:.1f}x smaller"
        )
        with tempfile.TemporaryDirectory() as hf_dir:
            hf.save_hf_checkpoint(hf_dir, config, variables)
            for batch in map(int, args.batches.split(",")):
                rng = np.random.default_rng(batch)
                prompts = rng.integers(0, config.vocab_size, (batch, args.prompt_len)).tolist()
                n = args.new_tokens
                ours = bench_ours(config, variables, prompts, n, args.repeats)
                theirs = bench_transformers(hf_dir, prompts, n, args.repeats)
                rates = []
                for prefill, total in (ours, theirs):
                    prefill_rate = batch * args.prompt_len / prefill
                    decode_rate = batch * (n - 1) / max(total - prefill, 1e-9)
                    rates.append((prefill_rate, decode_rate))
                rows.append((name, batch, *rates[0], *rates[1]))
                print(_format(rows[-1]), flush=True)
    print(f"load average after: {os.getloadavg()}")
    print("\n| model | batch | prefill tok/s: ours / HF | decode tok/s: ours / HF |")
    print("|---|---|---|---|")
    for row in rows:
        print(_format(row))


def _format(row):
    name, batch, prefill, decode, hf_prefill, hf_decode = row
    return (
        f"| {name} | {batch} | {prefill:,.0f} / {hf_prefill:,.0f} = {prefill / hf_prefill:.1f}x "
        f"| {decode:,.0f} / {hf_decode:,.0f} = {decode / hf_decode:.1f}x |"
    )


if __name__ == "__main__":
    main()
