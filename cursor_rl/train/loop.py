"""The stage loop: short-context pretraining, long-context extension and SFT.

One trainer runs all three stages; a stage differs only by its config
(``stages.stage_config``) and by where its weights come from:

1. its own latest checkpoint (a restarted or preempted run resumes exactly: weights,
   optimizer, router bias, data-iterator position and step);
2. else ``train.init_from`` or the previous stage's latest checkpoint (weights and
   router bias only: each stage gets a fresh optimizer and schedule);
3. else, for the first stage, the base model ``init_from`` names (``cursor_rl.bases``:
   continued pretraining, as Composer 2 continues from a released base);
4. else a fresh initialisation (pretraining only).

Checkpoints, metrics and the tokenizer live in the workdir (``cursor_rl.workdir``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import logging
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from cursor_rl import bases, checkpoints, hostmem, model, partitioning, stages
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.data import pipeline
from cursor_rl.model.config import ModelConfig
from cursor_rl.ops import heartbeat
from cursor_rl.train import copy_probe
from cursor_rl.train import optimizer as optim
from cursor_rl.train import step as step_lib
from cursor_rl.train.metrics import MetricsWriter, Progress
from cursor_rl.train.peak import peak_flops_per_device
from cursor_rl.workdir import Workdir, write_text_atomic

# Fields of the config's ``data`` section that the trainer consumes itself; the rest
# goes to ``pipeline.DataConfig``.
log = logging.getLogger(__name__)

_TRAINER_DATA_FIELDS = ("process_sharding",)


class Preempted(RuntimeError):
    """SIGTERM arrived; a checkpoint was written and the run should exit cleanly."""


@dataclasses.dataclass
class StageResult:
    stage: str
    steps: int
    tokens: int
    train_loss: float | None
    eval_loss: float | None
    first_eval_loss: float | None
    wall_s: float
    checkpoint: str | None


# ---- validation -----------------------------------------------------------------


def validate_stage_config(cfg: ml_collections.ConfigDict, num_devices: int) -> ModelConfig:
    """Checks a stage config before anything compiles; errors name the field."""

    def need(ok: bool, field: str, why: str) -> None:
        if not ok:
            value = cfg
            for part in field.split("."):
                value = value[part]
            raise ValueError(f"{field}={value!r}: {why}")

    need(cfg.stage in stages.TRAIN_STAGES, "stage", f"one of {stages.TRAIN_STAGES}")
    need(cfg.train.num_steps > 0, "train.num_steps", "must be > 0")
    need(cfg.train.batch_size > 0, "train.batch_size", "must be > 0")
    need(cfg.train.seq_len > 1, "train.seq_len", "must be > 1")
    need(cfg.train.microbatches > 0, "train.microbatches", "must be > 0")
    need(
        cfg.train.batch_size % cfg.train.microbatches == 0,
        "train.batch_size",
        f"must be divisible by train.microbatches={cfg.train.microbatches}",
    )
    need(cfg.train.log_every > 0, "train.log_every", "must be > 0")
    need(cfg.train.eval_every >= 0, "train.eval_every", "must be >= 0")
    need(cfg.checkpoint.every_steps > 0, "checkpoint.every_steps", "must be > 0")
    need(cfg.checkpoint.keep_last >= 0, "checkpoint.keep_last", "must be >= 0")
    need(cfg.optimizer.learning_rate > 0, "optimizer.learning_rate", "must be > 0")
    need(cfg.optimizer.name in ("adamw", "muon"), "optimizer.name", "adamw or muon")
    need(
        cfg.optimizer.schedule in ("cosine", "wsd", "constant"),
        "optimizer.schedule",
        "cosine, wsd or constant",
    )
    need(
        cfg.data.get("process_sharding", "documents") in ("documents", "rows"),
        "data.process_sharding",
        "documents or rows",
    )
    model_config = stages.model_config(cfg)
    need(
        cfg.train.seq_len <= model_config.max_position_embeddings
        or model_config.rope_scaling is not None,
        "train.seq_len",
        f"exceeds model.max_position_embeddings={model_config.max_position_embeddings}",
    )
    sizes = partitioning.resolve_mesh_shape(
        cfg.mesh.ici.to_dict(), num_devices // max(int(np.prod(list(cfg.mesh.dcn.values()))), 1)
    )
    batch_shards = int(np.prod([sizes[a] for a in partitioning.BATCH_AXES]))
    batch_shards *= int(cfg.mesh.dcn.get("data", 1))
    micro = cfg.train.batch_size // cfg.train.microbatches
    need(
        micro % batch_shards == 0,
        "train.batch_size",
        f"each micro-batch ({micro} rows) must split over the {batch_shards} batch shards "
        "of the mesh (data x fsdp x expert)",
    )
    return model_config


# ---- pieces ---------------------------------------------------------------------


def ensure_tokenizer(cfg: ml_collections.ConfigDict, workdir: Workdir | str) -> Tokenizer:
    """The run's tokenizer: ``tokenizer.path``, else the base model's (``init_from``),
    else the workdir's, else trained now.

    Process 0 trains and saves; the others wait for it and load the same file.
    """
    file = Workdir.of(workdir).tokenizer_file  # local or gs://: epath, not Tokenizer.save
    base = bases.resolve(cfg.get("init_from", ""))
    path = cfg.tokenizer.path or (bases.tokenizer_file(base) if base else "")
    if path:
        tokenizer = Tokenizer.load(path)
        if jax.process_index() == 0 and not file.exists():
            write_text_atomic(file, tokenizer.to_json())
        return tokenizer
    if jax.process_index() == 0 and not file.exists():
        data_config = data_config_of(cfg)
        start = time.time()
        tokenizer = pipeline.train_tokenizer(data_config, cfg.tokenizer.vocab_size, seed=cfg.seed)
        write_text_atomic(file, tokenizer.to_json())
        log.info(
            "trained tokenizer (%d tokens) in %.1fs", tokenizer.vocab_size, time.time() - start
        )
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("tokenizer")
    return Tokenizer.from_json(file.read_text(encoding="utf-8"))


def data_config_of(cfg: ml_collections.ConfigDict) -> pipeline.DataConfig:
    values = {k: v for k, v in cfg.data.to_dict().items() if k not in _TRAINER_DATA_FIELDS}
    return pipeline.DataConfig.from_mapping(values)


def make_data(cfg, tokenizer: Tokenizer, split: str, seed: int):
    """The stage's batch dataset for this process (see ``data.process_sharding``)."""
    make = pipeline.make_sft_dataset if cfg.stage == "sft" else pipeline.make_pretrain_dataset
    rows = cfg.data.get("process_sharding", "documents") == "rows"
    return make(
        data_config_of(cfg),
        tokenizer,
        seq_len=cfg.train.seq_len,
        global_batch_size=cfg.train.batch_size,
        seed=seed,
        # "rows": every process reads the same global stream and keeps its own rows,
        # so results do not depend on the process count (used to test multi-host).
        process_index=0 if rows else jax.process_index(),
        process_count=1 if rows else jax.process_count(),
        split=split,
    )


class _BatchPutter:
    """Host batches (this process's rows) -> global arrays sharded over the batch axes."""

    def __init__(self, cfg, mesh, rules):
        self.sharding = partitioning.logical_sharding(("act_batch", "act_length"), mesh, rules)
        self.rows_mode = cfg.data.get("process_sharding", "documents") == "rows"
        self.global_rows = cfg.train.batch_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        out = {}
        for key in step_lib.BATCH_KEYS:
            local = np.asarray(batch[key], dtype=np.int32)
            if self.rows_mode and jax.process_count() > 1:
                per = self.global_rows // jax.process_count()
                local = local[jax.process_index() * per : (jax.process_index() + 1) * per]
            out[key] = jax.make_array_from_process_local_data(self.sharding, local)
        return out


def _check_compatible(meta: dict[str, Any], model_config: ModelConfig, where: str) -> None:
    """The checkpoint's parameters must have this stage's shapes (names the first that differs)."""
    saved_cfg = checkpoints.model_config_from_metadata(meta, where)
    if saved_cfg.scan_layers != model_config.scan_layers:
        layout = {True: "scanned", False: "unscanned"}
        raise ValueError(
            f"the checkpoint at {where} holds {layout[saved_cfg.scan_layers]} layers and this "
            f"model is {layout[model_config.scan_layers]}: set "
            f"--config.model.scan_layers={saved_cfg.scan_layers} to continue from it"
        )

    differs = model.first_shape_difference(saved_cfg, model_config)
    if differs is not None:
        name, saved, current = differs
        raise ValueError(
            f"the checkpoint at {where} does not fit this model: parameter {name} is "
            f"{saved} there and {current} here (check the model config)"
        )


def checkpoint_metadata(cfg, model_config: ModelConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    return checkpoints.make_metadata(
        model_config,
        stage=cfg.stage,
        tokenizer_json=tokenizer.to_json(),
        config=json.loads(cfg.to_json_best_effort()),
    )


def _previous_stage(stage: str) -> str | None:
    index = stages.STAGES.index(stage)
    return stages.STAGES[index - 1] if index > 0 else None


# ---- the loop -------------------------------------------------------------------


def run_stage(config: ml_collections.ConfigDict, stage: str, workdir: Workdir | str) -> StageResult:
    """Trains one stage to ``train.num_steps`` (resuming if it has checkpoints)."""
    wall_start = time.time()
    workdir = Workdir.of(workdir)
    cfg = stages.stage_config(config, stage)
    model_config = validate_stage_config(cfg, jax.device_count())
    mesh = partitioning.make_mesh(cfg.mesh.ici.to_dict(), cfg.mesh.dcn.to_dict())
    rules = partitioning.make_rules(cfg.mesh.rules_preset, cfg.mesh.rules.to_dict())
    is_main = jax.process_index() == 0
    base = bases.resolve(cfg.get("init_from", "")) if _previous_stage(stage) is None else None
    if base is not None:  # a damaged base fails here, before anything is trained
        bases.verify(base, model_config)
    tokenizer = ensure_tokenizer(cfg, workdir)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(
            f"model.vocab_size={model_config.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} tokens"
        )
    num_steps = int(cfg.train.num_steps)
    tx = optim.make_optimizer(cfg.optimizer, num_steps)
    schedule = optim.make_schedule(cfg.optimizer, num_steps)
    abstract, state_sh = step_lib.abstract_train_state(model_config, tx, mesh, rules)

    train_iter = iter(make_data(cfg, tokenizer, "train", seed=cfg.seed))
    manager = checkpoints.CheckpointManager(
        workdir.checkpoint_dir(stage),
        keep_last=cfg.checkpoint.keep_last,
        keep_every=cfg.checkpoint.keep_every,
        async_save=cfg.checkpoint.async_save,
        fallback_to_previous=cfg.checkpoint.fallback_to_previous,
        on_error=heartbeat.checkpoint_failure_recorder(workdir, "main", enabled=is_main),
    )
    metadata = checkpoint_metadata(cfg, model_config, tokenizer)
    variables_target = {"params": abstract.params, "router": abstract.router}

    base_variables = None  # host arrays of the base model, when this stage starts from it
    if base is not None and manager.latest_step() is None and not cfg.train.init_from:
        # Read outside the mesh context: the reader traces the model.
        base_variables = bases.load_variables(base, model_config, verified=True)
        log.info("[%s] initialising from the base model %s", stage, base)

    with partitioning.use_mesh(mesh, rules):
        if manager.latest_step() is not None:
            step, variables, train_items, meta = manager.restore(
                variables_target, abstract.train_items(), train_iter
            )
            _check_compatible(meta, model_config, manager.directory)
            state = step_lib.TrainState(
                step=train_items["step"],
                params=variables["params"],
                router=variables["router"],
                opt_state=train_items["opt_state"],
                skipped=train_items["skipped"],
            )
            log.info("[%s] resumed from step %d", stage, step)
        else:
            source = cfg.train.init_from
            previous = _previous_stage(stage)
            if not source and previous is not None:
                previous_dir = workdir.checkpoint_dir(previous)
                source = checkpoints.latest_checkpoint(previous_dir)
                if source is None:
                    raise FileNotFoundError(
                        f"stage {stage} starts from the {previous} stage, but "
                        f"{previous_dir} has no checkpoint; "
                        "run that stage first or set train.init_from"
                    )
            if source:
                _check_compatible(checkpoints.read_metadata(source), model_config, source)
                variables = checkpoints.restore_variables(source, variables_target)
                log.info("[%s] initialised from %s", stage, source)
            elif base_variables is not None:
                shardings = {"params": state_sh.params, "router": state_sh.router}
                variables = jax.device_put(base_variables, shardings)
            else:
                variables = model.init(model_config, jax.random.key(cfg.seed), mesh, rules)
            init_opt = jax.jit(tx.init, out_shardings=state_sh.opt_state)
            state = step_lib.TrainState(
                step=jax.device_put(jnp.zeros((), jnp.int32), state_sh.step),
                params=variables["params"],
                router=variables["router"],
                opt_state=init_opt(variables["params"]),
                skipped=jax.device_put(jnp.zeros((), jnp.int32), state_sh.skipped),
            )

        put = _BatchPutter(cfg, mesh, rules)
        train_fn = step_lib.jit_train_step(
            cfg.train, model_config, tx, schedule, state_sh, put.sharding
        )
        eval_fn = jax.jit(
            functools.partial(step_lib.eval_step, config=model_config),
            in_shardings=({"params": state_sh.params, "router": state_sh.router}, put.sharding),
        )
        eval_data = (
            make_data(cfg, tokenizer, "eval", seed=cfg.seed) if cfg.train.eval_every else None
        )

        def evaluate() -> float:
            it = iter(eval_data)
            ce, tokens = 0.0, 0.0
            for _ in range(int(cfg.train.eval_batches)):
                out = jax.device_get(eval_fn(state.variables, put(next(it))))
                ce, tokens = ce + float(out["ce_sum"]), tokens + float(out["tokens"])
            return ce / max(tokens, 1.0)

        probe_every = int(cfg.train.get("probe_every", 0))
        last_probe = None

        def probe() -> float:
            # Tokens past the tokenizer's (a padded vocabulary) are never drawn.
            high = min(tokenizer.vocab_size, model_config.vocab_size)
            settings = {**copy_probe.TRAINING_PROBE, "high": high}
            return copy_probe.copy_score(model_config, state.variables, **settings)["copy_accuracy"]

        writer = MetricsWriter(workdir, enabled=is_main)
        progress = Progress(stage, num_steps, enabled=is_main)
        beat = heartbeat.for_role(workdir, "main", enabled=is_main)
        flops_per_token = model_config.flops_per_token(int(cfg.train.seq_len))
        peak = peak_flops_per_device() * jax.device_count()
        preempted, restore_sigterm = _install_sigterm_handler()
        start_step = int(jax.device_get(state.step))
        first_eval = last_eval = None
        last_loss = None
        tokens_seen = start_step * cfg.train.batch_size * cfg.train.seq_len
        if eval_data is not None and start_step == 0:
            first_eval = last_eval = evaluate()
            writer.write(stage, 0, {"eval_loss": last_eval})
        window_start, window_tokens = time.perf_counter(), 0
        pending = []  # metrics dicts (device arrays) since the last log
        in_flight = collections.deque()  # a result of each step not yet waited for
        max_in_flight = int(cfg.train.get("max_steps_in_flight", 0))
        step = start_step
        try:
            while step < num_steps:
                batch = put(next(train_iter))
                while max_in_flight and len(in_flight) >= max_in_flight:
                    jax.block_until_ready(in_flight.popleft())
                state, metrics = train_fn(state, batch)
                if max_in_flight:
                    in_flight.append(metrics["loss"])
                step += 1
                beat.progress(stage, step)
                window_tokens += cfg.train.batch_size * cfg.train.seq_len
                tokens_seen += cfg.train.batch_size * cfg.train.seq_len
                pending.append(metrics)
                last = step == num_steps
                log_due = step % cfg.train.log_every == 0 or last
                eval_due = bool(cfg.train.eval_every) and (step % cfg.train.eval_every == 0 or last)
                probe_due = log_due and bool(probe_every) and (step % probe_every == 0 or last)
                # config_lib: train.release_memory. Before an eval, probe or checkpoint
                # (they then grow from the floor, not on top of the step's free block)
                # and after it (what they left inside that block).
                release_now = cfg.train.release_memory and (
                    step - start_step == cfg.train.log_every  # compiled, first window done
                    or eval_due
                    or probe_due
                    or step % cfg.checkpoint.every_steps == 0
                    or last
                )
                if release_now:
                    jax.block_until_ready(metrics["loss"])
                    hostmem.release_free_memory()
                if log_due:
                    host = jax.device_get(pending)
                    elapsed = time.perf_counter() - window_start
                    row = {k: float(np.mean([m[k] for m in host])) for k in host[-1]}
                    for key in ("skipped_steps", "learning_rate"):
                        row[key] = float(host[-1][key])
                    row["update_skipped"] = float(sum(m["update_skipped"] for m in host))
                    row["tokens_per_s"] = window_tokens / elapsed
                    row["mfu"] = flops_per_token * row["tokens_per_s"] / peak
                    row["tokens"] = tokens_seen
                    last_loss = row["ce_loss"]
                    if eval_due:
                        row["eval_loss"] = last_eval = evaluate()
                    if probe_due:
                        row["copy_probe"] = last_probe = probe()
                    writer.write(stage, step, row)
                    progress.update(
                        step,
                        {
                            "loss": row["ce_loss"],
                            "eval": last_eval,
                            "copy": last_probe,
                            "tok/s": row["tokens_per_s"],
                            "mfu": row["mfu"],
                        },
                    )
                    pending = []
                    window_start, window_tokens = time.perf_counter(), 0
                elif eval_due:
                    last_eval = evaluate()
                    writer.write(stage, step, {"eval_loss": last_eval})
                stop = _agree(preempted())
                if step % cfg.checkpoint.every_steps == 0 or last or stop:
                    manager.save(
                        step,
                        state.variables,
                        state.train_items(),
                        train_iter,
                        {**metadata, "step": step},
                    )
                if release_now:
                    hostmem.release_free_memory()
                if stop:
                    manager.wait()
                    raise Preempted(f"[{stage}] SIGTERM: checkpoint {step} written")
        finally:
            restore_sigterm()
            progress.finish()
            manager.close()
            writer.close()
    latest = checkpoints.latest_checkpoint(manager.directory)
    return StageResult(
        stage=stage,
        steps=num_steps,
        tokens=tokens_seen,
        train_loss=last_loss,
        eval_loss=last_eval,
        first_eval_loss=first_eval,
        wall_s=time.time() - wall_start,
        checkpoint=latest,
    )


def _agree(flag: bool) -> bool:
    """True on every process if it is true on any (processes stop at the same step)."""
    if jax.process_count() == 1:
        return flag
    flags = multihost_utils.process_allgather(np.asarray(flag, np.int32))
    return bool(np.max(flags))


def _install_sigterm_handler():
    """Turns SIGTERM into a flag the loop polls (checkpoint, then a clean exit).

    Returns the poll and a function restoring the previous handler: outside the
    training loop (task builds, demonstrations, RL) SIGTERM keeps its usual effect
    instead of being swallowed by a flag nobody reads.
    """
    received = {"flag": False}

    def handler(signum, frame):
        del signum, frame
        received["flag"] = True

    previous = None
    # Outside the main thread (e.g. under a test harness) no handler can be set.
    with contextlib.suppress(ValueError):
        previous = signal.signal(signal.SIGTERM, handler)

    def restore():
        if previous is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, previous)

    return (lambda: received["flag"]), restore


def write_config(config: ml_collections.ConfigDict, workdir: Workdir | str) -> None:
    """Writes ``WORKDIR/config.json`` (process 0), creating the workdir."""
    workdir = Workdir.of(workdir)
    workdir.root.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        write_text_atomic(workdir.config_file, config.to_json_best_effort(indent=2))


def run(config: ml_collections.ConfigDict, workdir: Workdir | str) -> list[StageResult]:
    """Runs ``config.stage``: one next-token stage, or (``all``) the three in order."""
    to_run = stages.TRAIN_STAGES if config.stage == "all" else (config.stage,)
    if config.stage != "all" and config.stage not in stages.TRAIN_STAGES:
        raise ValueError(f"stage={config.stage!r} is not one of {stages.TRAIN_STAGES}")
    workdir = Workdir.of(workdir)
    write_config(config, workdir)
    return [run_stage(config, stage, workdir) for stage in to_run]
