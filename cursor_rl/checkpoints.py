"""Orbax checkpoints: the bridge between stages, the trainer and the sampler.

Layout of one checkpoint (``DIR/<step>/``), one Orbax item per subdirectory:

* ``params``    the model variables ``{"params": ..., "router": ...}`` (router = the
                MoE correction bias). Kept apart so the sampler, eval and the next
                stage restore them alone, straight into their own shardings.
* ``train``     the rest of the train state: step, optimizer state, skipped-step count.
* ``data``      each process's grain iterator state (one JSON file per process).
* ``metadata``  JSON: model config, tokenizer (its tokenizer.json text), stage, step,
                layer layout (``scanned``/``unscanned``) and anything the caller adds.

Choices:

1. Saves are asynchronous (Orbax writes in the background while training goes on);
   a checkpoint becomes visible only once Orbax has finalised it (it writes to a
   temporary directory and renames), so a half-written checkpoint is never used.
2. Retention: the last ``keep_last`` plus every ``keep_every``-th step.
3. Restores take target shardings: arrays are read straight into the caller's
   mesh layout, whatever mesh wrote them (resharding on restore, no host copy of
   the whole model).
4. A latest checkpoint that fails to restore raises an error naming it, or, with
   ``fallback_to_previous``, is skipped for the one before (with a warning).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

from cursor_rl.model.config import ModelConfig
from cursor_rl.workdir import resolve

PARAMS, TRAIN, DATA, METADATA = "params", "train", "data", "metadata"
_COMMIT_MARKER = "commit_success.txt"  # written by Orbax when a step is finalised


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable."""


def _abstract(tree, shardings=None):
    """ShapeDtypeStructs (with target shardings when given) for a restore target."""
    if shardings is None:
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            tree,
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _handlers():
    return {
        PARAMS: ocp.StandardCheckpointHandler(),
        TRAIN: ocp.StandardCheckpointHandler(),
        DATA: grain.checkpoint.CheckpointHandler(),
        METADATA: ocp.JsonCheckpointHandler(),
    }


class CheckpointManager:
    """Saves and restores train state, data-iterator state and metadata for one stage."""

    def __init__(
        self,
        directory: str,
        *,
        keep_last: int = 2,
        keep_every: int = 0,
        async_save: bool = True,
        fallback_to_previous: bool = True,
        on_error: Callable[[str, int | None, BaseException], None] | None = None,
    ):
        # Orbax refuses relative paths and knows no `~`: every caller gets them resolved.
        self.directory = os.fspath(resolve(directory, "checkpoint directory"))
        self.fallback_to_previous = fallback_to_previous
        # Told (directory, step, error) when a save fails, before the error is raised
        # (the run's event log: cursor_rl.ops.heartbeat.checkpoint_failure_recorder).
        self.on_error = on_error
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep_last or None,
            keep_period=keep_every or None,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=_handlers()
        )

    # ---- saving -------------------------------------------------------------------

    def save(
        self,
        step: int,
        variables: Mapping[str, Any],
        train_state: Mapping[str, Any] | None = None,
        data_iterator=None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Starts saving checkpoint ``step`` (returns before the write ends when async)."""
        items = {PARAMS: ocp.args.StandardSave(dict(variables))}
        if train_state is not None:
            items[TRAIN] = ocp.args.StandardSave(dict(train_state))
        if data_iterator is not None:
            items[DATA] = grain.checkpoint.CheckpointSave(data_iterator)
        items[METADATA] = ocp.args.JsonSave({**(metadata or {}), "step": int(step)})
        try:
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            self._failed(int(step), e)
            raise

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are on disk."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            self._failed(None, e)
            raise

    def _failed(self, step: int | None, error: BaseException) -> None:
        if self.on_error is not None:
            try:
                self.on_error(self.directory, step, error)
            except Exception:  # reporting must not hide the error itself
                logging.exception("checkpoint failure at %s not reported", self.directory)

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    # ---- restoring ----------------------------------------------------------------

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(
        self,
        variables_target,
        train_target=None,
        data_iterator=None,
        step: int | None = None,
    ) -> tuple[int, dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
        """Restores the latest (or given) checkpoint into the targets' shardings.

        Args:
          variables_target: pytree of arrays or ShapeDtypeStructs with shardings.
          train_target: the same for the optimizer part of the state, or None to skip it.
          data_iterator: a grain iterator whose state is set in place, or None.
          step: a specific step; default the latest, falling back to earlier ones
            when ``fallback_to_previous`` and the latest is unreadable.

        Returns:
          (step, variables, train_state or None, metadata).
        """
        candidates = [step] if step is not None else list(reversed(self.all_steps()))
        if not candidates:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        errors = []
        for candidate in candidates:
            try:
                return self._restore_step(candidate, variables_target, train_target, data_iterator)
            except Exception as e:  # Orbax/tensorstore raise many types for bad files
                errors.append(f"step {candidate}: {type(e).__name__}: {e}")
                if step is not None or not self.fallback_to_previous:
                    break
                logging.warning(
                    "checkpoint %s/%s is unreadable (%s); trying the previous one",
                    self.directory,
                    candidate,
                    e,
                )
        raise CheckpointError(
            f"could not restore a checkpoint from {self.directory}:\n  " + "\n  ".join(errors)
        )

    def _restore_step(self, step, variables_target, train_target, data_iterator):
        items = {
            PARAMS: ocp.args.StandardRestore(_abstract(variables_target)),
            METADATA: ocp.args.JsonRestore(),
        }
        if train_target is not None:
            items[TRAIN] = ocp.args.StandardRestore(_abstract(train_target))
        if data_iterator is not None:
            items[DATA] = grain.checkpoint.CheckpointRestore(data_iterator)
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        train = restored[TRAIN] if train_target is not None else None
        return step, restored[PARAMS], train, restored[METADATA]


def make_metadata(
    model_config,
    *,
    stage: str,
    step: int = 0,
    tokenizer_json: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The metadata every checkpoint carries (the one place its keys are named)."""
    metadata = {
        "stage": stage,
        "step": int(step),
        "model_config": model_config.to_dict(),
        "layer_layout": "scanned" if model_config.scan_layers else "unscanned",
        **extra,
    }
    if tokenizer_json is not None:
        metadata["tokenizer"] = tokenizer_json
    return metadata


def model_config_from_metadata(
    metadata: Mapping[str, Any], where: str = "checkpoint"
) -> ModelConfig:
    """The ModelConfig a checkpoint was written with."""
    if "model_config" not in metadata:
        raise CheckpointError(f"{where}: metadata has no model_config")
    return ModelConfig.from_dict(metadata["model_config"])


def finalised_steps(directory: str) -> list[int]:
    """The finalised checkpoint steps under ``directory``, ascending (none: empty).

    A finalised step is a directory named by its step number holding Orbax's commit
    marker (on local disks the rename from ``*.orbax-checkpoint-tmp-*`` is atomic too;
    on GCS the marker is what tells a finished step).
    """
    path = resolve(directory, "checkpoint directory")
    if not path.is_dir():
        return []
    return sorted(
        int(child.name)
        for child in path.iterdir()
        if child.name.isdigit() and (child / _COMMIT_MARKER).exists()
    )


def latest_checkpoint(directory: str) -> str | None:
    """Path of the newest finalised checkpoint step under ``directory``, or None."""
    steps = finalised_steps(directory)
    if not steps:
        return None
    return os.fspath(resolve(directory, "checkpoint directory") / str(steps[-1]))


def _step_path(path: str) -> str:
    """Accepts a step directory or a checkpoints directory (-> its latest step)."""
    path = os.fspath(resolve(path, "checkpoint"))
    if (epath.Path(path) / PARAMS).is_dir():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path} is neither a checkpoint step nor holds any")
    return latest


def read_metadata(path: str) -> dict[str, Any]:
    """The metadata of a checkpoint (step directory or checkpoints directory)."""
    step_path = _step_path(path)
    file = epath.Path(step_path) / METADATA / "metadata"
    if not file.exists():
        candidates = sorted((epath.Path(step_path) / METADATA).iterdir())
        if not candidates:
            raise CheckpointError(f"{step_path} has no metadata")
        file = candidates[0]
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"unreadable checkpoint metadata {file}: {e}") from e


def restore_variables(path: str, target) -> dict[str, Any]:
    """Params-only restore: the model variables of a checkpoint, into ``target``'s shardings.

    Args:
      path: a checkpoint step directory, or a checkpoints directory (its latest step).
      target: pytree of ShapeDtypeStructs with shardings (e.g. from
        ``model.abstract_variables`` + the caller's mesh), or of arrays.
    """
    step_path = _step_path(path)
    try:
        return ocp.StandardCheckpointer().restore(epath.Path(step_path) / PARAMS, _abstract(target))
    except Exception as e:
        raise CheckpointError(f"cannot restore variables from {step_path}: {e}") from e


def save_variables(path: str, variables: Mapping[str, Any], metadata: Mapping[str, Any]) -> str:
    """Writes a standalone variables-only checkpoint at ``path/<step>`` (e.g. from HF)."""
    step = int(metadata.get("step", 0))
    manager = CheckpointManager(path, keep_last=0, async_save=False)
    manager.save(step, variables, metadata=metadata)
    manager.close()
    return os.fspath(epath.Path(manager.directory) / str(step))
