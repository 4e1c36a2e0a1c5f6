"""The pipeline's stages, and the config each one runs with.

A config (``configs/NAME.py``, built on ``config_lib.base_config``) holds every
stage's settings; ``stage_overrides.<stage>`` holds what a stage changes relative to
the rest. ``stage_config`` merges them for one stage; ``apply_command_line`` makes a
command-line override of a shared field (``--config.train.num_steps=2``) apply to
every stage, including stages whose overrides set that field; ``model_config``
reads a config's model section.

The stage loops (``cursor_rl.train``, ``cursor_rl.rl``) read their configs through
this module; ``config_lib``, which knows every section's defaults, sits above them.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from cursor_rl.model.config import ModelConfig

# Stages the next-token trainer runs, then the RL stage; "all" runs every one in order.
TRAIN_STAGES = ("pretrain", "long_context", "sft")
STAGES = (*TRAIN_STAGES, "rl")
PIPELINE_STAGES = ("all", *STAGES)


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """The ModelConfig of a (stage) config; a rope_scaling factor <= 1 means none."""
    values = config.model.to_dict()
    rs = values.get("rope_scaling")
    if rs is not None and float(rs["factor"]) <= 1.0:
        values["rope_scaling"] = None
    return ModelConfig.from_dict(values)


def _merge(base: ml_collections.ConfigDict, overrides: ml_collections.ConfigDict, where: str):
    for key, value in overrides.items():
        if key not in base:
            raise ValueError(f"stage_overrides.{where}{key}: no such field in the config")
        if isinstance(value, ml_collections.ConfigDict) and isinstance(
            base[key], ml_collections.ConfigDict
        ):
            _merge(base[key], value, f"{where}{key}.")
        else:
            base[key] = value


def apply_command_line(
    config: ml_collections.ConfigDict, overrides: dict[str, Any]
) -> ml_collections.ConfigDict:
    """Makes command-line overrides of shared fields win over the config's stage overrides.

    ``--config.train.num_steps=20`` sets ``config.train.num_steps``, but a stage whose
    ``stage_overrides`` also sets ``train.num_steps`` would silently keep its own value.
    Here every such stage override takes the command-line value too, so the flag means
    what it says for whichever stage runs. Overrides under ``stage_overrides.`` are
    left as given (they already target one stage).

    Args:
      config: the loaded config, command-line values already applied (changed in place).
      overrides: the command line's ``{dotted.path: value}``
        (``ml_collections.config_flags.get_override_values``).

    Returns:
      ``config``.
    """
    for path, value in overrides.items():
        if path.startswith("stage_overrides."):
            continue
        *sections, field = path.split(".")
        for stage in STAGES:
            node = config.stage_overrides[stage]
            for section in sections:
                node = node.get(section) if isinstance(node, ml_collections.ConfigDict) else None
            if isinstance(node, ml_collections.ConfigDict) and field in node:
                node[field] = value
    return config


def stage_config(config: ml_collections.ConfigDict, stage: str) -> ml_collections.ConfigDict:
    """The config one stage runs with: ``config`` + ``config.stage_overrides[stage]``.

    The *model* overrides of earlier stages carry forward: a stage continues its
    predecessor's checkpoint, so the architecture it was trained with (e.g. the
    long-context stage's YaRN scaling) stays with the weights in SFT and RL. Every
    other section (train, optimizer, data) is the stage's own.
    """
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not one of {STAGES}")
    result = ml_collections.ConfigDict(config.to_dict())
    result.stage = stage
    for earlier in STAGES[: STAGES.index(stage)]:
        model = config.stage_overrides[earlier].get("model")
        if model:
            _merge(result.model, model, f"{earlier}.model.")
    _merge(result, config.stage_overrides[stage], f"{stage}.")
    return result
