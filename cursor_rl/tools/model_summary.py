"""A config's model at a glance: shapes, parameter counts, one sharded step, speed vs PyTorch.

    python -m cursor_rl.tools.model_summary --config=configs/tiny.py [--devices=8]

Prints the variable shapes and parameter counts, builds the model on an emulated
``--devices``-device CPU mesh (expert and fsdp axes in use), runs one
forward/backward there and compares it with the single-device result. (Speed
against transformers + PyTorch: ``benchmarks/model_bench.py``.)
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from cursor_rl import model, partitioning, stages

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Emulated CPU devices for the sharded check.")


def _emulate_devices(count: int) -> None:
    """Must run before jax initialises its backends (at the first computation); jax is
    imported by then (the config file imports it), so the platform goes through its
    config, which read JAX_PLATFORMS at import."""
    flag = f"--xla_force_host_platform_device_count={count}"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")


def main(argv):
    del argv
    _emulate_devices(_DEVICES.value)
    config = stages.model_config(stages.stage_config(_CONFIG.value, "pretrain"))
    counts = config.param_counts()
    print(
        f"model: {counts['total'] / 1e6:.2f}M parameters, {counts['active'] / 1e6:.2f}M active "
        f"per token ({config.num_layers} layers: {config.first_k_dense} dense + "
        f"{config.num_moe_layers} MoE with {config.n_routed_experts} experts top-"
        f"{config.num_experts_per_tok} + {config.n_shared_experts} shared)"
    )
    shapes = jax.tree_util.tree_leaves_with_path(
        partitioning.strip_axis_metadata(model.abstract_variables(config))
    )
    for path, leaf in shapes:
        print(f"  {jax.tree_util.keystr(path):<70} {leaf.shape!s:<22} {leaf.dtype}")

    devices = _DEVICES.value
    expert = max(d for d in (4, 2, 1) if config.n_routed_experts % d == 0 and devices % d == 0)
    fsdp = 2 if devices % (2 * expert) == 0 else 1
    mesh = partitioning.make_mesh({"expert": expert, "fsdp": fsdp, "data": -1})
    variables = model.init(config, jax.random.key(0), mesh)
    tokens = jax.random.randint(jax.random.key(1), (_DEVICES.value, 64), 0, config.vocab_size)

    def loss(params, tokens):
        logits = model.forward(config, {**variables, "params": params}, tokens)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

    with partitioning.use_mesh(mesh):
        value, grads = jax.jit(jax.value_and_grad(loss))(variables["params"], tokens)
    host = jax.device_get(variables)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(loss))(host["params"], tokens)
    grad_err = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))
    )
    print(
        f"forward/backward on mesh {dict(mesh.shape)}: loss {float(value):.4f} "
        f"(single device {float(ref_value):.4f}), max |grad difference| {grad_err:.2e}"
    )


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
