"""Every config in configs/ parses, and each of its stages yields a valid model config."""

import glob
import importlib.util
import os

import pytest

from cursor_rl import config_lib, stages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


def _load(path, arg=None):
    spec = importlib.util.spec_from_file_location("cfg", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def test_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"tiny.py", "small.py", "kimi_k2.py"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_parses_and_every_stage_is_valid(path):
    config = _load(path)
    with open(path, encoding="utf-8") as fh:
        source = fh.read()
    assert source.lstrip().startswith('"""'), "configs start with a docstring"
    assert "Command" in source and "Hardware" in source, "docstring gives command and hardware"
    for stage in stages.STAGES:  # the RL stage's model too
        stage_cfg = stages.stage_config(config, stage)
        model = stages.model_config(stage_cfg)
        assert model.validate() is model


def test_tiny_stage_arg_selects_stage():
    path = os.path.join(ROOT, "configs", "tiny.py")
    assert _load(path, "stage=sft").stage == "sft"
    with pytest.raises(ValueError, match="unknown"):
        _load(path, "stag=sft")


def test_kimi_k2_has_the_published_shapes():
    config = stages.model_config(_load(os.path.join(ROOT, "configs", "kimi_k2.py")))
    counts = config.param_counts()
    assert 1.0e12 < counts["total"] < 1.1e12, counts
    assert 30e9 < counts["active"] < 34e9, counts
    assert config.rope_scaling.factor == 64.0


def test_kimi_k2_dropless_and_long_context_variants_are_valid():
    """The ``dropless`` and ``long_context`` args give valid configs with what they say
    (their fit is measured ahead of time: docs/scale.md)."""
    path = os.path.join(ROOT, "configs", "kimi_k2.py")
    config = _load(path, "dropless=1")
    assert config.model.moe_capacity_factor == 0.0 and config.mesh.ici["expert"] == 8
    assert config.train.microbatches == 2 and config.optimizer.muon_spread_experts
    assert config.train.batch_size * config.train.seq_len == 1024 * 4096
    lc = stages.stage_config(_load(path, "long_context=131072"), "long_context")
    assert lc.train.seq_len == 131072 and lc.mesh.ici["context"] == 16
    for cfg in (config, lc):
        assert stages.model_config(cfg).validate()


def test_stage_overrides_reject_unknown_fields():
    config = config_lib.base_config()
    config.stage_overrides.sft.train = {"num_stepz": 3}
    with pytest.raises(ValueError, match="num_stepz"):
        stages.stage_config(config, "sft")


def test_long_context_stage_raises_yarn_factor():
    config = _load(os.path.join(ROOT, "configs", "tiny.py"))
    pre = stages.model_config(stages.stage_config(config, "pretrain"))
    lc_cfg = stages.stage_config(config, "long_context")
    lc = stages.model_config(lc_cfg)
    assert pre.rope_scaling is None and lc.rope_scaling.factor > 1
    assert lc_cfg.train.seq_len > config.train.seq_len
    # SFT and RL continue the long-context weights: they keep its positional encoding
    # (dropping it would move every position the long-context stage trained on).
    for later in ("sft", "rl"):
        model = stages.model_config(stages.stage_config(config, later))
        assert model.rope_scaling == lc.rope_scaling, later
    # ...while their own sections stay their own.
    assert stages.stage_config(config, "sft").optimizer.learning_rate != (
        lc_cfg.optimizer.learning_rate
    )


def test_command_line_overrides_win_over_stage_overrides():
    """`--config.train.num_steps=N` sets every stage's length, including stages whose
    stage_overrides set their own (tiny's SFT stage does); per-stage flags stay per stage.
    """
    config = _load(os.path.join(ROOT, "configs", "tiny.py"))
    assert config.stage_overrides.sft.train.num_steps != 7
    config.train.num_steps = 7  # what the flag parser did with the command line
    config.stage_overrides.long_context.train.seq_len = 512
    stages.apply_command_line(
        config,
        {"train.num_steps": 7, "stage_overrides.long_context.train.seq_len": 512},
    )
    for stage in stages.TRAIN_STAGES:
        assert stages.stage_config(config, stage).train.num_steps == 7, stage
    assert stages.stage_config(config, "long_context").train.seq_len == 512
    assert stages.stage_config(config, "sft").train.seq_len == 1536  # its own, untouched
