"""Peak FLOP/s of the local devices, the denominator of MFU.

Accelerators: the vendor's dense bf16 figure for the device kind. CPU: measured
once per process with a float32 matmul (the same check the benchmarks use), since
there is no meaningful spec-sheet number for a shared CPU.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

# Dense bf16 FLOP/s per device (per chip; per GPU).
_PEAKS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5": 459e12,  # v5p
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
}


def matmul_flops(n: int = 2048, repeats: int = 10, dtype=jnp.float32) -> float:
    """Measured FLOP/s of an n x n matmul on the default device (best of ``repeats``)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(jnp.matmul)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


@functools.cache
def peak_flops_per_device() -> float:
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        # All emulated CPU devices share the same cores: divide the host's rate.
        return matmul_flops(repeats=5) / max(jax.local_device_count(), 1)
    kind = getattr(device, "device_kind", "")
    for name, peak in sorted(_PEAKS.items(), key=lambda kv: -len(kv[0])):
        if kind.startswith(name):
            return peak
    return 0.0
