"""The shipped base: it loads through the HF import path and copies from its context
(a random initialisation does not); a damaged or mismatched base is refused before any
training, naming the file; `init_from` starts the first stage from a base."""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from configs.tiny import MODEL
from cursor_rl import bases, model
from cursor_rl.model import hf
from cursor_rl.train import copy_probe, loop, metrics
from cursor_rl.workdir import Workdir
from tests.train_helpers import MICRO_MODEL, micro_config

# A small sample of the probe the trainer logs (spans of 64-120 repeated at once).
SAMPLE = {**copy_probe.TRAINING_PROBE, "rows": 4}


@pytest.mark.slow
def test_builtin_base_copies_and_a_random_model_does_not():
    path = bases.resolve("tiny")
    bases.verify(path, MODEL)
    config, variables = hf.load_hf_checkpoint(path, scan_layers=MODEL.scan_layers)
    assert config.vocab_size == MODEL.vocab_size
    shipped = copy_probe.copy_score(MODEL, variables, **SAMPLE)
    assert shipped["copy_accuracy"] >= 0.9, shipped
    fresh = model.init(MODEL, jax.random.key(0))
    assert copy_probe.copy_score(MODEL, fresh, **SAMPLE)["copy_accuracy"] < 0.05


def test_base_files_fit_the_size_budget():
    path = bases.resolve("tiny")
    total = sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
    assert total <= 30 * 2**20


def test_none_means_random_weights():
    assert bases.resolve("none") is None
    assert bases.resolve("") is None
    with pytest.raises(bases.BaseModelError, match="built-in bases: tiny"):
        bases.resolve("no-such-base")


@pytest.fixture()
def copy_of_base(tmp_path):
    path = tmp_path / "base"
    shutil.copytree(bases.resolve("tiny"), path)
    return str(path)


def test_truncated_weights_are_refused_naming_the_file(copy_of_base):
    file = os.path.join(copy_of_base, hf.SINGLE_FILE)
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    with pytest.raises(bases.BaseModelError, match=r"model\.safetensors.*truncated or altered"):
        bases.verify(copy_of_base)


def test_altered_tokenizer_and_missing_files_are_refused(copy_of_base):
    with open(os.path.join(copy_of_base, "tokenizer.json"), "a") as f:
        f.write(" ")
    with pytest.raises(bases.BaseModelError, match=r"tokenizer\.json"):
        bases.verify(copy_of_base)
    os.remove(os.path.join(copy_of_base, bases.SUMS_FILE))
    with pytest.raises(bases.BaseModelError, match="SHA256SUMS is missing"):
        bases.verify(copy_of_base)


def test_a_base_that_does_not_fit_the_model_is_refused(copy_of_base):
    wider = dataclasses.replace(MODEL, hidden_size=MODEL.hidden_size * 2)
    with pytest.raises(
        bases.BaseModelError,
        match=r"config\.json does not fit the configured model: parameter .*kv_a_proj",
    ):
        bases.verify(copy_of_base, wider)


def _micro_base(tmp_path):
    """A base of the micro model (random weights), written like the shipped one."""
    variables = jax.tree.map(np.asarray, model.init(MICRO_MODEL, jax.random.key(3)))
    path = str(tmp_path / "micro_base")
    hf.save_hf_checkpoint(path, MICRO_MODEL, variables)
    return path, variables


@pytest.mark.slow
def test_first_stage_starts_from_the_base(tmp_path):
    path, variables = _micro_base(tmp_path)
    cfg = micro_config(num_steps=1)
    cfg.init_from = path
    workdir = str(tmp_path / "run")
    with open(os.path.join(path, "tokenizer.json"), "w") as f:  # the base's tokenizer
        f.write(loop.ensure_tokenizer(micro_config(), str(tmp_path / "tok")).to_json())
    bases.write_sums(path)
    cfg.optimizer.learning_rate = 1e-6  # one AdamW step moves a weight by about 1e-6
    loop.run_stage(cfg, "pretrain", workdir)
    restored = loop.checkpoints.restore_variables(
        loop.checkpoints.latest_checkpoint(Workdir(workdir).checkpoint_dir("pretrain")),
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), variables),
    )
    fresh = model.init(MICRO_MODEL, jax.random.key(cfg.seed))  # what no base would give
    pairs = zip(
        jax.tree.leaves(restored["params"]),
        jax.tree.leaves(variables["params"]),
        jax.tree.leaves(fresh["params"]),
    )
    for got, base, random in pairs:
        np.testing.assert_allclose(np.asarray(got), base, atol=1e-5)
        if base.size > 1 and base.std() > 0:
            assert np.abs(np.asarray(random) - base).max() > 1e-3
    assert any(row["stage"] == "pretrain" for row in metrics.read_metrics(workdir))


@pytest.mark.slow
def test_a_damaged_base_stops_the_run_before_training(tmp_path):
    path, _ = _micro_base(tmp_path)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump({}, f)
    bases.write_sums(path)
    with open(os.path.join(path, hf.SINGLE_FILE), "ab") as f:
        f.write(b"\0")
    cfg = micro_config(num_steps=1)
    cfg.init_from = path
    with pytest.raises(bases.BaseModelError, match=r"model\.safetensors"):
        loop.run_stage(cfg, "pretrain", str(tmp_path / "run"))
    assert not os.path.exists(os.path.join(str(tmp_path / "run"), "pretrain", "checkpoints"))
