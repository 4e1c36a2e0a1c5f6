"""Forward+backward and full train-step throughput: cursor_rl (JAX) vs transformers (PyTorch).

    python benchmarks/model_bench.py [--configs=tiny,wide] [--batch=8] [--seq=256]

Side by side in one process, on the same model config, weights, batch and sequence
length; the two frameworks alternate rounds (each starting with one untimed step) and
the median round is reported, so load from other processes hits both alike. Prints
tokens/s, the JAX/PyTorch ratio and model FLOP/s as a fraction of a float32 2048^2
matmul peak measured in the same run (the ceiling on this CPU). Needs the hf extra
(torch + transformers).

* fwd+bwd: loss (mean next-token cross-entropy) and gradients.
* train step: cursor_rl's compiled step (AdamW, clipping, router-bias update,
  metrics) vs a PyTorch loop doing forward, backward, clipping and AdamW.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# ruff: noqa: E402 (the imports below follow host_malloc.configure() on purpose)
from cursor_rl import host_malloc

# First, before numpy, torch or XLA start threads: glibc malloc set up so XLA reuses
# its scratch memory instead of page-faulting it every step (cursor_rl/host_malloc.py).
# It leaves PyTorch's speed unchanged (measured).
host_malloc.configure()

import jax
import jax.numpy as jnp
import numpy as np
import torch
from absl import app, flags

from cursor_rl import config_lib, model
from cursor_rl.model import hf, hf_mapping
from cursor_rl.model.config import ModelConfig
from cursor_rl.train import optimizer, step
from cursor_rl.train.peak import matmul_flops


def _load_config_module(name: str):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_config = _load_config_module("tiny")
CONFIGS = {
    "tiny": tiny_config.MODEL,
    # A wider CPU config (hidden >= 512), same depth and expert layout.
    "wide": tiny_config.MODEL.replace(
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=512,
        num_heads=8,
        kv_lora_rank=128,
    ),
}

_CONFIGS = flags.DEFINE_list("configs", ["tiny", "wide"], "Which configs.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step.")
_SEQ = flags.DEFINE_integer("seq", 256, "Sequence length.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Alternating rounds (median reported).")
_STEPS = flags.DEFINE_integer("steps", 3, "Steps per round.")


def _torch_model(config: ModelConfig, variables):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    hf_cfg = hf.config_to_hf(config)
    hf_cfg.pop("architectures", None)
    hf_cfg.pop("model_type", None)
    net = DeepseekV3ForCausalLM(DeepseekV3Config(**hf_cfg))
    state = {
        name: torch.from_numpy(np.array(t, dtype=np.float32))
        for name, t in hf_mapping.iter_hf_tensors(
            config, jax.device_get(variables), expert_layout="fused"
        )
    }
    missing, unexpected = net.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"weights did not map: missing {missing}, unexpected {unexpected}")
    return net


def _timed(fn, steps):
    # One untimed step first: the other framework's round just ran in this process
    # and left the heap laid out for its own buffers.
    fn()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def bench(name: str, config: ModelConfig, batch: int, seq: int, rounds: int, steps: int):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (batch, seq + 1)).astype(np.int32)
    jbatch = {
        "tokens": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "loss_mask": jnp.ones((batch, seq), jnp.int32),
        "segment_ids": jnp.ones((batch, seq), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)),
    }
    config = config.replace(moe_impl="auto")
    variables = model.init(config, jax.random.key(0))
    opt_cfg = config_lib.base_config().optimizer
    tx = optimizer.make_optimizer(opt_cfg, 1000)
    schedule = optimizer.make_schedule(opt_cfg, 1000)

    def loss_fn(params):
        ce, _, _ = step.token_losses(config, params, variables["router"], jbatch, 0.0)
        return ce / (batch * seq)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    train_fn = jax.jit(
        functools.partial(step.train_step, config=config, tx=tx, schedule=schedule),
        donate_argnums=(0,),
    )
    # The train step donates its state: give it its own copy of the weights.
    state = {"s": step.init_state(jax.tree.map(jnp.copy, variables), tx)}

    def jax_fwd_bwd():
        jax.block_until_ready(grad_fn(variables["params"]))

    def jax_train():
        state["s"], metrics = train_fn(state["s"], jbatch)
        jax.block_until_ready(metrics["loss"])

    net = _torch_model(config, variables)
    input_ids = torch.from_numpy(tokens[:, :-1].astype(np.int64))
    labels = torch.from_numpy(tokens[:, 1:].astype(np.int64))
    torch_opt = torch.optim.AdamW(net.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def torch_loss():
        logits = net(input_ids=input_ids).logits
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        )

    def torch_fwd_bwd():
        net.zero_grad(set_to_none=True)
        torch_loss().backward()

    def torch_train():
        torch_opt.zero_grad(set_to_none=True)
        torch_loss().backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        torch_opt.step()

    # Same weights, same loss: a check that the comparison is apples to apples.
    with torch.no_grad():
        torch_value = float(torch_loss())
    jax_value = float(grad_fn(variables["params"])[0])
    for fn in (jax_fwd_bwd, jax_train, torch_fwd_bwd, torch_train):
        fn()  # compile / warm up
    times = {k: [] for k in ("jax_fwd_bwd", "torch_fwd_bwd", "jax_train", "torch_train")}
    for _ in range(rounds):
        times["jax_fwd_bwd"].append(_timed(jax_fwd_bwd, steps))
        times["torch_fwd_bwd"].append(_timed(torch_fwd_bwd, steps))
        times["jax_train"].append(_timed(jax_train, steps))
        times["torch_train"].append(_timed(torch_train, steps))
    median = {k: statistics.median(v) for k, v in times.items()}
    tok = batch * seq
    flops = config.flops_per_token(seq) * tok
    return {
        "name": name,
        "loss_jax": jax_value,
        "loss_torch": torch_value,
        "tok_s": {k: tok / v for k, v in median.items()},
        "model_flops_s": {k: flops / v for k, v in median.items()},
        "params": config.param_counts(),
    }


def main(argv):
    del argv
    torch.set_num_threads(os.cpu_count() or 1)
    peak_jax = matmul_flops()
    a = torch.randn(2048, 2048)
    b = torch.randn(2048, 2048)
    torch.mm(a, b)
    peak_torch = max(2 * 2048**3 / _timed(lambda: torch.mm(a, b), 1) for _ in range(10))
    load = os.getloadavg()[0]
    print(
        f"matmul peak (fp32 2048^2): JAX {peak_jax / 1e9:.0f} GFLOP/s, "
        f"PyTorch {peak_torch / 1e9:.0f} GFLOP/s; load average {load:.1f}; "
        f"{os.cpu_count()} cores; glibc malloc settings (cursor_rl/host_malloc.py) "
        f"{'on' if host_malloc.applied else 'off'}"
    )
    peak = max(peak_jax, peak_torch)
    print(
        f"{'config':<6} {'what':<12} {'JAX tok/s':>10} {'torch tok/s':>12} {'ratio':>6} "
        f"{'JAX MFU':>8} {'torch MFU':>9}"
    )
    for name in _CONFIGS.value:
        r = bench(name, CONFIGS[name], _BATCH.value, _SEQ.value, _ROUNDS.value, _STEPS.value)
        for what in ("fwd_bwd", "train"):
            j, t = r["tok_s"][f"jax_{what}"], r["tok_s"][f"torch_{what}"]
            print(
                f"{name:<6} {what:<12} {j:>10,.0f} {t:>12,.0f} {j / t:>6.2f} "
                f"{r['model_flops_s'][f'jax_{what}'] / peak:>8.1%} "
                f"{r['model_flops_s'][f'torch_{what}'] / peak:>9.1%}"
            )
        print(
            f"       ({r['params']['total'] / 1e6:.1f}M params, {r['params']['active'] / 1e6:.1f}M "
            f"active; initial loss JAX {r['loss_jax']:.4f} vs torch {r['loss_torch']:.4f})"
        )


if __name__ == "__main__":
    app.run(main)
