"""One routed-expert layer's forward + backward under expert parallelism, compiled ahead
of time for a TPU topology on the CPU: the compiler's temporaries per chip.

    JAX_PLATFORMS=cpu TPU_WORKER_HOSTNAMES=localhost TPU_ACCELERATOR_TYPE=v5p-8 \
        /tmp/venv-tpu/bin/python -m benchmarks.moe_dispatch_aot \
        [--topology=v5p:4x4x4] [--factors=1,2] [--tokens=8192]

DeepSeek-V3's expert shapes (7,168 model, 2,048 expert hidden, 256 experts, 8 a token)
by default, bf16, ``--tokens`` per chip, the experts over every chip of the topology
(``moe._dispatch_local`` in ``shard_map``, as the model calls it under the
``expert`` axis), one row per capacity factor. Beside the temporaries it prints them in
units of one assignment buffer (tokens x experts a token x model dim, bf16), so a
change to the dispatch reads as buffers added or removed. Needs libtpu (the ``tpu``
extra); ``--topology=cpu`` compiles for the local devices instead.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cursor_rl.model import moe
from cursor_rl.tools.aot_compile import topology_devices


def compile_layer(devices, factor: float, tokens: int, dim: int, hidden: int, experts: int, k: int):
    mesh = jax.sharding.Mesh(np.asarray(devices).reshape(-1), ("expert",))
    shards = len(devices)
    dispatch = functools.partial(
        moe._dispatch_local, num_experts=experts, impl="ragged", block=128,
        expert_axis="expert", expert_shards=shards, tensor_axis=None,
        capacity_factor=factor, token_axes=("expert",),
    )  # fmt: skip
    specs = dict(in_specs=(P("expert"),) * 6, out_specs=(P("expert"), P()))
    layer = jax.shard_map(dispatch, mesh=mesh, check_vma=False, **specs)

    def loss(x, idx, w, wg, wu, wd, cotangent):
        y, dropped = layer(x, idx, w, wg, wu, wd)
        return jnp.sum(y.astype(jnp.float32) * cotangent) + dropped

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("expert")))

    n, bf16 = tokens * shards, jnp.bfloat16
    args = (
        arg((n, dim), bf16), arg((n, k), jnp.int32), arg((n, k), jnp.float32),
        arg((experts, dim, hidden), bf16), arg((experts, dim, hidden), bf16),
        arg((experts, hidden, dim), bf16), arg((n, dim), jnp.float32),
    )  # fmt: skip
    step = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4, 5)))
    start = time.perf_counter()
    compiled = step.lower(*args).compile()
    return compiled.memory_analysis(), time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="v5p:4x4x4")
    parser.add_argument("--factors", default="1,2")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per chip")
    parser.add_argument("--dim", type=int, default=7168)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()
    devices = topology_devices(args.topology)
    unit = args.tokens * args.k * args.dim * 2
    print(
        f"{args.topology}: {len(devices)} chips, {args.tokens} tokens a chip, "
        f"one assignment buffer {unit / 2**30:.3f} GiB"
    )
    print("capacity factor | temporaries per chip | in assignment buffers | compile")
    for factor in (float(f) for f in args.factors.split(",")):
        memory, seconds = compile_layer(
            devices, factor, args.tokens, args.dim, args.hidden, args.experts, args.k
        )
        temp = memory.temp_size_in_bytes
        print(f"{factor:g} | {temp / 2**30:.3f} GiB | {temp / unit:.1f} | {seconds:.0f} s")


if __name__ == "__main__":
    main()
