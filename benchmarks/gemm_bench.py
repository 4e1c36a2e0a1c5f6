"""The model's matmul shapes alone: XLA:CPU (jax.jit) vs PyTorch (MKL) vs NumPy (OpenBLAS).

    python benchmarks/gemm_bench.py [--threads=2]

Where `model_bench.py` says how far the whole step is behind PyTorch, this says how
much of that the matrix products alone explain: each shape the tiny config's
forward+backward runs (batch 8 x 256 = 2,048 tokens), timed side by side in one
process, median of 20 calls, as GFLOP/s and the JAX/PyTorch ratio. Run it under
``taskset -c 0 ... --threads=1`` for one core. Needs the hf extra (torch).
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# ruff: noqa: E402 (the imports below follow host_malloc.configure() on purpose)
from cursor_rl import host_malloc

host_malloc.configure()  # before numpy and XLA start threads (see host_malloc)

import jax
import jax.numpy as jnp
import numpy as np
import torch
from absl import app, flags

_THREADS = flags.DEFINE_integer("threads", os.cpu_count() or 1, "PyTorch intra-op threads.")
_CALLS = flags.DEFINE_integer("calls", 20, "Timed calls per shape (median reported).")

# (what, einsum, lhs shape, rhs shape): the tiny config's products at 2,048 tokens.
SHAPES = [
    ("MLP up / MoE shared", "nd,df->nf", (2048, 256), (256, 768)),
    ("MLP down", "nf,fd->nd", (2048, 768), (768, 256)),
    ("weight gradient", "nd,nf->df", (2048, 256), (2048, 768)),
    ("input gradient", "nf,df->nd", (2048, 768), (256, 768)),
    ("LM head", "nd,dv->nv", (2048, 256), (256, 2048)),
    ("one expert, 512 rows", "nd,df->nf", (512, 256), (256, 256)),
    ("expert blocks (batched)", "nbd,ndf->nbf", (40, 128, 256), (40, 256, 256)),
    ("expert blocks, weight grad", "nbd,nbf->ndf", (40, 128, 256), (40, 128, 256)),
    ("attention scores", "bhtd,bhsd->bhts", (8, 4, 256, 48), (8, 4, 256, 48)),
]


def _median_seconds(fn, calls):
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _flops(equation, lhs_shape, rhs_shape):
    inputs = equation.split("->")[0].split(",")
    sizes = {}
    for letters, shape in zip(inputs, (lhs_shape, rhs_shape)):
        sizes.update(zip(letters, shape))
    return 2 * float(np.prod(list(sizes.values())))


def _row(equation, lhs_shape, rhs_shape, rng, calls):
    """GFLOP/s of one product in each framework, after checking they agree."""
    a = rng.standard_normal(lhs_shape, dtype=np.float32)
    b = rng.standard_normal(rhs_shape, dtype=np.float32)
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    jitted = jax.jit(lambda x, y: jnp.einsum(equation, x, y))
    np.testing.assert_allclose(
        np.asarray(jitted(ja, jb)), torch.einsum(equation, ta, tb).numpy(), rtol=1e-3, atol=1e-3
    )
    flops = _flops(equation, lhs_shape, rhs_shape)
    seconds = {
        "jax": _median_seconds(lambda: jitted(ja, jb).block_until_ready(), calls),
        "torch": _median_seconds(lambda: torch.einsum(equation, ta, tb), calls),
        "numpy": _median_seconds(lambda: np.einsum(equation, a, b, optimize=True), calls),
    }
    return {k: flops / v / 1e9 for k, v in seconds.items()}


def main(argv):
    del argv
    torch.set_num_threads(_THREADS.value)
    rng = np.random.default_rng(0)
    print(
        f"{'product':<28} {'shape':<34} {'JAX':>6} {'PyTorch':>8} {'NumPy':>6}  "
        f"(GFLOP/s; PyTorch threads {_THREADS.value})  JAX/PyTorch"
    )
    for what, equation, lhs_shape, rhs_shape in SHAPES:
        row = _row(equation, lhs_shape, rhs_shape, rng, _CALLS.value)
        shape = f"{list(lhs_shape)} x {list(rhs_shape)}"
        print(
            f"{what:<28} {shape:<34} {row['jax']:>6.0f} {row['torch']:>8.0f} "
            f"{row['numpy']:>6.0f}  {row['jax'] / row['torch']:>33.2f}"
        )


if __name__ == "__main__":
    app.run(main)
