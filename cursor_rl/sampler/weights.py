"""Getting weights into the sampler: trainer checkpoints (Orbax), HF directories, policy dirs.

A trainer checkpoint is restored straight into the sampler's own shardings: the
restore target is the model's abstract variables with NamedShardings on the
sampler's mesh, so each device reads only its shards from disk, whatever mesh
wrote them. No full host copy and no cross-mesh ``device_put``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import flax.linen as nn
import jax

from cursor_rl import checkpoints, model, partitioning
from cursor_rl.model.config import ModelConfig


@functools.cache
def _boxed(config: ModelConfig):
    """The variables' shapes with logical axes (tracing the model's init takes seconds)."""
    return model.abstract_variables(config)


def _abstract(config: ModelConfig):
    return partitioning.strip_axis_metadata(_boxed(config))


def variable_shardings(config: ModelConfig, mesh: jax.sharding.Mesh, rules) -> Any:
    """NamedShardings of the variables on ``mesh`` (``model.variable_shardings``, cached)."""
    return nn.meta.unbox(partitioning.tree_shardings(_boxed(config), mesh, rules))


def _shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    abstract = _abstract(config)
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): leaf.shape
        for path, leaf in jax.tree_util.tree_leaves_with_path(abstract)
    }


def check_compatible(saved: ModelConfig, config: ModelConfig, where: str) -> None:
    """Raises ValueError naming the first variable whose shape differs (dtype may differ)."""
    ours = _shapes(config)
    theirs = _shapes(saved.replace(scan_layers=config.scan_layers))
    for name in sorted(ours.keys() | theirs.keys()):
        if ours.get(name) != theirs.get(name):
            raise ValueError(
                f"the checkpoint at {where} does not fit the sampler's model: {name} is "
                f"{theirs.get(name)} there and {ours.get(name)} here"
            )


def abstract_target(config: ModelConfig, mesh: jax.sharding.Mesh | None, rules) -> Any:
    """ShapeDtypeStructs of the variables, each with its sharding on ``mesh``."""
    abstract = _abstract(config)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract)
    else:
        shardings = variable_shardings(config, mesh, rules)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
    )


def restore_checkpoint(
    path: str,
    config: ModelConfig,
    mesh: jax.sharding.Mesh | None,
    rules: partitioning.LogicalRules = partitioning.DEFAULT_RULES,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Variables of a trainer checkpoint in ``config``'s layout and ``mesh``'s shardings.

    Args:
      path: a checkpoint step directory, or a checkpoints directory (its latest).
      config: the sampler's model config (its ``param_dtype`` is the restore dtype).
      mesh: the sampler's mesh; None for the default device.
      rules: logical-axis rules for the sampler's shardings.

    Returns:
      (variables, checkpoint metadata).
    """
    metadata = checkpoints.read_metadata(path)
    saved = checkpoints.model_config_from_metadata(metadata, path)
    check_compatible(saved, config, path)
    # Read in the layout the trainer wrote (scanned or not), in our shardings.
    layout = config.replace(scan_layers=saved.scan_layers)
    variables = checkpoints.restore_variables(path, abstract_target(layout, mesh, rules))
    if saved.scan_layers != config.scan_layers:
        convert = model.stack_layers if config.scan_layers else model.unstack_layers
        target = abstract_target(config, mesh, rules)
        variables = jax.jit(
            lambda v: {k: convert(c) for k, c in v.items()},
            out_shardings=jax.tree.map(lambda x: x.sharding, target),
        )(variables)
    return variables, metadata


def latest_policy(directory: str) -> tuple[int, str] | None:
    """(version, path) of the newest finalised checkpoint in a policy directory."""
    path = checkpoints.latest_checkpoint(directory)
    if path is None:
        return None
    return int(os.path.basename(path)), path
