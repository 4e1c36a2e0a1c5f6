"""Orbax wrapper: round trips, resharding on restore, corrupt and half-written checkpoints."""

import glob
import os

import jax
import numpy as np
import pytest

from cursor_rl import checkpoints, model, partitioning
from tests.train_helpers import MICRO_MODEL


def _variables():
    return model.init(MICRO_MODEL, jax.random.key(0))


def _target(mesh=None):
    abstract = partitioning.strip_axis_metadata(model.abstract_variables(MICRO_MODEL))
    if mesh is None:
        return abstract
    shardings = model.variable_shardings(MICRO_MODEL, mesh, partitioning.DEFAULT_RULES)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
    )


def _meta(step):
    return checkpoints.make_metadata(MICRO_MODEL, stage="pretrain", step=step)


def _save_steps(directory, steps, **kw):
    manager = checkpoints.CheckpointManager(directory, keep_last=10, async_save=False, **kw)
    variables = _variables()
    for step in steps:
        bumped = jax.tree.map(lambda x, s=step: x + s, variables)
        manager.save(step, bumped, {"step": np.int32(step)}, metadata=_meta(step))
    manager.close()
    return variables


@pytest.mark.slow
def test_round_trip_and_metadata(tmp_path):
    variables = _save_steps(str(tmp_path), [3])
    manager = checkpoints.CheckpointManager(str(tmp_path))
    step, restored, train, meta = manager.restore(_target(), {"step": np.int32(0)})
    assert step == 3 and int(train["step"]) == 3
    assert meta["stage"] == "pretrain" and meta["layer_layout"] == "scanned"
    assert checkpoints.model_config_from_metadata(meta) == MICRO_MODEL
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(variables)):
        np.testing.assert_array_equal(a, np.asarray(b) + 3)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (emulated) devices")
@pytest.mark.slow
def test_params_only_restore_reshards_into_another_mesh(tmp_path):
    variables = _variables()
    mesh_a = partitioning.make_mesh({"data": 8})
    sharded = jax.device_put(variables, jax.tree.map(lambda x: x.sharding, _target(mesh_a)))
    checkpoints.save_variables(str(tmp_path), sharded, _meta(0))
    mesh_b = partitioning.make_mesh({"fsdp": 2, "expert": 2, "tensor": 2})
    target = _target(mesh_b)
    restored = checkpoints.restore_variables(str(tmp_path), target)
    for got, want, tgt in zip(
        jax.tree.leaves(restored), jax.tree.leaves(variables), jax.tree.leaves(target)
    ):
        np.testing.assert_array_equal(got, want)
        assert got.sharding == tgt.sharding
    expert = restored["params"]["moe_layers"]["layer"]["moe"]["gate_proj"]
    assert expert.sharding.spec[1] == "expert"


def _corrupt(step_dir):
    files = [f for f in glob.glob(os.path.join(step_dir, "params", "**", "*"), recursive=True)]
    files = [f for f in files if os.path.isfile(f) and os.path.getsize(f) > 0]
    assert files
    for f in files:
        with open(f, "wb") as fh:
            fh.write(b"\x00garbage")


@pytest.mark.slow
def test_corrupt_latest_falls_back_to_previous(tmp_path):
    variables = _save_steps(str(tmp_path), [2, 4])
    _corrupt(os.path.join(tmp_path, "4"))
    manager = checkpoints.CheckpointManager(str(tmp_path), fallback_to_previous=True)
    step, restored, _, _ = manager.restore(_target())
    assert step == 2
    leaf = jax.tree.leaves(restored)[0]
    np.testing.assert_array_equal(leaf, np.asarray(jax.tree.leaves(variables)[0]) + 2)


@pytest.mark.slow
def test_corrupt_latest_is_a_clear_error_without_fallback(tmp_path):
    _save_steps(str(tmp_path), [2, 4])
    _corrupt(os.path.join(tmp_path, "4"))
    manager = checkpoints.CheckpointManager(str(tmp_path), fallback_to_previous=False)
    with pytest.raises(checkpoints.CheckpointError, match="step 4"):
        manager.restore(_target())


@pytest.mark.slow
def test_half_written_checkpoint_is_never_used(tmp_path):
    _save_steps(str(tmp_path), [2])
    # What an interrupted Orbax save leaves behind: a temporary directory.
    os.makedirs(tmp_path / "6.orbax-checkpoint-tmp-1234" / "params")
    manager = checkpoints.CheckpointManager(str(tmp_path))
    assert manager.latest_step() == 2
    assert checkpoints.latest_checkpoint(str(tmp_path)).endswith("/2")


def test_missing_checkpoint_errors_name_the_path(tmp_path):
    manager = checkpoints.CheckpointManager(str(tmp_path / "none"))
    with pytest.raises(checkpoints.CheckpointError, match="no checkpoint"):
        manager.restore(_target())
    with pytest.raises(checkpoints.CheckpointError, match="neither"):
        checkpoints.restore_variables(str(tmp_path / "none"), _target())
