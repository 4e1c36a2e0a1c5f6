"""The RL stage: rollouts and GRPO updates, as programs bridged by files on disk.

Roles (``rl.role``):

* ``sampler``: loads the newest published policy, runs a batch of task groups
  through the harness, writes them to ``rl/rollouts/<index>.json`` (tagged with
  the policy versions that produced them and the sampler that wrote them) and
  moves on to its next index; the lead sampler (id 0) runs the held-out
  evaluations too.
* ``trainer``: takes the rollout files in index order, drops those older than
  ``max_staleness`` policy versions (``stale_batches_dropped`` in its metrics
  row), takes GRPO steps, publishes each new policy as an Orbax checkpoint
  (``rl/policy/<version>``) and checkpoints itself with the index of the next
  rollout file. An RL step is one rollout batch; a batch whose groups all have
  zero reward variance changes nothing, so the policy version (optimizer updates)
  can trail the step.
* ``colocated`` (tests and the tiny pipeline): both in one process, taking turns,
  through the same files and checkpoints.

Many samplers: start ``rl.num_samplers`` = N sampler processes, each with its own
``rl.sampler_id`` k in [0, N) (the trainer is told N too, for its logs). The rollout
indices are dealt round-robin: sampler k writes only indices k, k+N, k+2N, ..., so
no two samplers ever write the same file, and the trainer takes them in index
order: one batch from each sampler in turn, the same order on every run and every
restart. Every batch records its ``sampler`` and ``policy_version``; the trainer's
metrics row for it does too (with ``rollout_index``, ``episodes`` and
``staleness``). A sampler stays at most ``max_staleness`` batches ahead of the
trainer, so N samplers all sample at once when ``max_staleness`` >= N - 1. The
trainer waits for the next index in order: a dead sampler holds it up until it is
restarted (by hand or by ``cursor_rl.ops.watch``). With N = 1 (the default) this is
the single sampler as before.

Any process may crash and restart: the trainer resumes from its checkpoint
(weights, optimizer, next rollout index), a sampler from the newest policy and its
own cursor, the first of its indices with no file. A batch is published whole
(``write_text_atomic``) and never written again: a sampler killed mid-batch samples
that index afresh (same tasks, same seed), one killed after publishing goes on to
its next index. The trainer writes ``rl/DONE`` when it has taken ``rl.num_steps``
steps; the samplers stop then.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath

from cursor_rl import checkpoints, hostmem, partitioning, stages
from cursor_rl.chat import protocol
from cursor_rl.chat.episodes import Episode
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.env import ray_pool
from cursor_rl.eval import registry as eval_registry
from cursor_rl.eval import runner as eval_runner
from cursor_rl.ops import faults, heartbeat
from cursor_rl.rl import feedback, grpo, rewards
from cursor_rl.rl.rollout import RolloutConfig, RolloutRunner
from cursor_rl.rl.trainer import RLTrainer
from cursor_rl.sampler import Sampler, weights
from cursor_rl.tasks import records
from cursor_rl.tasks import workdir as workdir_tasks
from cursor_rl.train.metrics import MetricsWriter, Progress, read_metrics
from cursor_rl.workdir import Workdir, write_text_atomic

log = logging.getLogger(__name__)

ROLES = ("colocated", "trainer", "sampler")
# The checkpoint evaluated as the "base" row (rl.eval.base): the model as it stands
# before SFT, i.e. the long-context stage's last checkpoint. It is loaded into the
# sampler as version -1, which no published policy has, so the next ``load_newest``
# swaps the run's policy back in.
BASE_STAGE = "long_context"
BASE_VERSION = -1


# ---- the bridge ---------------------------------------------------------------------


class RolloutStore:
    """Rollout files and the sampler's cursor under ``WORKDIR/rl/rollouts``.

    The trainer and the sampler may run on different machines: every file goes
    through the workdir (local or ``gs://``), written whole (``write_text_atomic``),
    so a reader never sees half of one.
    """

    def __init__(self, workdir: Workdir | str):
        workdir = Workdir.of(workdir)
        self.directory = workdir.rollouts_dir
        self.done_marker = workdir.rl_done_file
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, index: int) -> epath.Path:
        return self.directory / f"{index:06d}.json"

    def write(
        self,
        index: int,
        episodes: Sequence[Episode],
        info: dict[str, Any],
        *,
        exclusive: bool = False,
    ) -> None:
        """Publishes batch ``index``. ``exclusive`` (the sampler role): a batch already
        published is never written again; finding one is an error (two samplers with
        the same ``rl.sampler_id``)."""
        if exclusive and self.exists(index):
            raise FileExistsError(
                f"rollout {index} is already published at {self.path(index)}: is another "
                "sampler running with the same rl.sampler_id?"
            )
        payload = {"index": index, **info, "episodes": [e.to_json() for e in episodes]}
        write_text_atomic(self.path(index), json.dumps(payload))

    def read(self, index: int) -> tuple[list[Episode], dict[str, Any]]:
        payload = json.loads(self.path(index).read_text(encoding="utf-8"))
        episodes = [Episode.from_json(e) for e in payload.pop("episodes")]
        return episodes, payload

    def exists(self, index: int) -> bool:
        return self.path(index).exists()

    def cursor(self, sampler_id: int = 0, num_samplers: int = 1) -> int:
        """The next rollout index sampler ``sampler_id`` of ``num_samplers`` will write:
        the first of its indices (``sampler_id`` + a multiple of ``num_samplers``) with
        no file. With one sampler, the first index with no file."""
        index = sampler_id
        while self.exists(index):
            index += num_samplers
        return index

    def trained(self) -> int:
        """Rollout files the trainer has consumed (trained on or dropped)."""
        try:
            return int((self.directory / "TRAINED").read_text(encoding="utf-8").strip() or 0)
        except FileNotFoundError:
            return 0

    def mark_trained(self, count: int) -> None:
        write_text_atomic(self.directory / "TRAINED", str(count))

    @property
    def done(self) -> bool:
        return self.done_marker.exists()

    def mark_done(self) -> None:
        write_text_atomic(self.done_marker, str(time.time()))


def owner_of(index: int, num_samplers: int) -> int:
    """The sampler that writes rollout ``index``."""
    return index % max(1, num_samplers)


def sampler_slot(cfg) -> tuple[int, int]:
    """(``rl.sampler_id``, ``rl.num_samplers``), checked."""
    k, n = int(cfg.rl.get("sampler_id", 0)), int(cfg.rl.get("num_samplers", 1))
    if n < 1 or not 0 <= k < n:
        raise ValueError(f"rl.sampler_id={k}, rl.num_samplers={n}: need 0 <= sampler_id < N")
    return k, n


# ---- rewards and advantages ----------------------------------------------------------


def score_groups(
    episodes: Sequence[Episode], reward_config: rewards.RewardConfig, grpo_config: grpo.GRPOConfig
) -> tuple[list[Episode], list[float], dict[str, float]]:
    """Rewards per episode (by group), advantages, and the episodes worth training on.

    Lost episodes are dropped; zero-variance groups too when configured (choice 2
    of ``grpo``). Returns (episodes, advantages, metrics). The metrics split the
    scored episodes by self-summarisation: ``summarised_episodes`` of
    ``scored_episodes`` wrote at least one summary; ``summarised_reward`` and
    ``unsummarised_reward`` are the mean rewards of the two parts (absent when a
    part is empty).
    """
    groups = _groups(episodes)
    kept, advantages, all_rewards = [], [], []
    by_summary: dict[bool, list[float]] = {True: [], False: []}
    dropped_groups = 0
    for group in groups.values():
        group_rewards = rewards.group_rewards([e.outcome() for e in group], reward_config)
        for e, r in zip(group, group_rewards):
            e.grade["reward"] = r
            by_summary[bool(e.summary_tokens)].append(r)
        all_rewards += group_rewards
        if grpo_config.drop_zero_variance and not grpo.has_signal(group_rewards):
            dropped_groups += 1
            continue
        kept += group
        advantages += list(grpo.group_advantages(group_rewards, grpo_config.std_normalize))
    metrics = {
        "reward": float(np.mean(all_rewards)) if all_rewards else 0.0,
        "zero_variance_groups": dropped_groups,
        "groups": len(groups),
        "scored_episodes": len(all_rewards),
        "summarised_episodes": len(by_summary[True]),
    }
    for summarised, name in ((True, "summarised_reward"), (False, "unsummarised_reward")):
        if by_summary[summarised]:
            metrics[name] = float(np.mean(by_summary[summarised]))
    return kept, advantages, metrics


def _groups(episodes: Sequence[Episode]) -> dict[int, list[Episode]]:
    """Episodes by task (their GRPO group), lost episodes left out."""
    groups: dict[int, list[Episode]] = {}
    for e in episodes:
        if e.finish_reason != "lost":
            groups.setdefault(e.task_index, []).append(e)
    return groups


def signal_groups(episodes: Sequence[Episode], reward_config: rewards.RewardConfig) -> int:
    """Groups whose rewards vary: the ones a GRPO step learns from."""
    return sum(
        grpo.has_signal(rewards.group_rewards([e.outcome() for e in g], reward_config))
        for g in _groups(episodes).values()
    )


def rollout_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Per-batch episode statistics for metrics.jsonl (stage ``rl``)."""
    if not episodes:
        return {}
    by_task: dict[int, list[bool]] = {}
    for e in episodes:
        by_task.setdefault(e.task_index, []).append(e.resolved)
    out = {
        "pass@1": float(np.mean([e.resolved for e in episodes])),
        f"best_of_{max(len(v) for v in by_task.values())}": float(
            np.mean([any(v) for v in by_task.values()])
        ),
        "generated_tokens": float(np.mean([e.generated_tokens for e in episodes])),
        "tool_calls": float(np.mean([e.tool_calls for e in episodes])),
        "segments": float(np.mean([e.segments for e in episodes])),
        "summaries": float(np.mean([len(e.summary_tokens) for e in episodes])),
        "summary_tokens": float(np.mean([t for e in episodes for t in e.summary_tokens] or [0.0])),
        "episodes_lost": float(sum(e.finish_reason == "lost" for e in episodes)),
        "episode_seconds": float(np.mean([e.seconds.get("episode", 0.0) for e in episodes])),
    }
    for reason in ("submitted", "answered", "turn_limit", "token_budget", "context"):
        out[f"finish/{reason}"] = float(np.mean([e.finish_reason == reason for e in episodes]))
    return out


# ---- setup shared by the roles ------------------------------------------------------


@dataclasses.dataclass
class _Context:
    cfg: ml_collections.ConfigDict
    workdir: Workdir
    tokenizer: Tokenizer
    chat: protocol.ChatFormat
    model_config: Any
    train_tasks: list[records.TaskRecord]
    bench_tasks: list[records.TaskRecord]
    train_dir: str
    bench_dir: str
    beat: heartbeat.Heartbeat  # this process's role (ops.heartbeat)


def _context(config: ml_collections.ConfigDict, workdir: Workdir) -> _Context:
    cfg = stages.stage_config(config, "rl")
    # Colocated RL is the pipeline's own process: one role, "main", with the stages.
    role = "main" if cfg.rl.role == "colocated" else cfg.rl.role
    sampler_id, num_samplers = sampler_slot(cfg)
    if role == "sampler" and num_samplers > 1:
        role = f"sampler-{sampler_id}"  # one heartbeat per sampler
    beat = heartbeat.for_role(workdir, role, enabled=jax.process_index() == 0)
    beat.progress("rl_setup", 0)
    tokenizer = Tokenizer.load(cfg.tokenizer.path or workdir.tokenizer_file)
    model_config = stages.model_config(cfg)
    train_dir, bench_dir = task_datasets(cfg, workdir)
    return _Context(
        cfg=cfg,
        workdir=workdir,
        tokenizer=tokenizer,
        chat=protocol.ChatFormat(tokenizer),
        model_config=model_config,
        train_tasks=rl_train_tasks(cfg, train_dir),
        bench_tasks=records.load_tasks(os.path.join(bench_dir, records.TASKS_FILE)),
        train_dir=train_dir,
        bench_dir=bench_dir,
        beat=beat,
    )


def task_datasets(cfg, workdir: Workdir | str) -> tuple[str, str]:
    """The run's train and bench task datasets (``rl.tasks``), built if needed."""
    t = cfg.rl.tasks
    return workdir_tasks.ensure_datasets(
        workdir,
        family=t.family,
        train=t.train,
        bench=t.bench,
        train_count=int(t.train_count),
        bench_count=int(t.bench_count),
        seed=int(t.build_seed),
        generators=tuple(t.generators),
        max_per_generator=int(t.max_per_generator),
        decontaminate_corpus=workdir_tasks.family_corpus(tuple(cfg.data.sources), t.family),
        log=lambda line: log.info("[rl] %s", line),
    )


def rl_train_tasks(cfg, train_dir: str) -> list[records.TaskRecord]:
    """The training tasks RL samples from: all of them, or with
    ``rl.tasks.skip_demonstrated`` those after the first ``sft_data.demos`` (the tasks
    the SFT demonstrations were made from, ``pipeline.prepare_sft_data``)."""
    tasks = records.load_tasks(os.path.join(train_dir, records.TASKS_FILE))
    if not cfg.rl.tasks.skip_demonstrated:
        return tasks
    demos = max(0, int(cfg.sft_data.demos))
    if demos >= len(tasks):
        raise ValueError(
            f"rl.tasks.skip_demonstrated: all {len(tasks)} training tasks in {train_dir} "
            f"have SFT demonstrations (sft_data.demos={demos}); raise rl.tasks.train_count"
        )
    return tasks[demos:]


def _rollout_config(cfg) -> RolloutConfig:
    return RolloutConfig(
        **cfg.rl.rollout.to_dict(),
        system_prompt=cfg.harness.system_prompt,
        tools_style=cfg.harness.tools_style,
    )


def _sampler(ctx: _Context):
    s = ctx.cfg.rl.sampler
    mesh = partitioning.make_mesh(s.mesh.to_dict()) if s.mesh.to_dict() else None
    return Sampler(
        ctx.model_config,
        mesh=mesh,
        num_slots=int(s.num_slots),
        max_seq_len=int(s.max_seq_len),
        max_programs=int(s.max_programs),
        prefill_tokens=int(s.prefill_tokens),
        tokenizer=ctx.tokenizer,
    )


def _init_checkpoint(ctx: _Context) -> str:
    sft_dir = ctx.workdir.checkpoint_dir("sft")
    source = ctx.cfg.train.init_from or checkpoints.latest_checkpoint(sft_dir)
    if not source:
        raise FileNotFoundError(
            f"RL starts from the SFT stage, but {sft_dir} "
            "has no checkpoint; run it first or set train.init_from"
        )
    return source


def _task_batch(ctx: _Context, index: int) -> list[records.TaskRecord]:
    """Batch ``index`` of training tasks: a seeded pass over the set, then the next."""
    n = int(ctx.cfg.rl.tasks_per_step)
    tasks = ctx.train_tasks
    epoch, offset = divmod(index * n, len(tasks))
    order = np.random.default_rng(ctx.cfg.seed + epoch).permutation(len(tasks))
    picked = [tasks[order[(offset + i) % len(tasks)]] for i in range(n)]
    return picked


class _SamplerSide:
    """What the sampler role holds: sampler, tool pool, runner."""

    def __init__(self, ctx: _Context):
        self.ctx = ctx
        self.sampler = _sampler(ctx)
        rl = ctx.cfg.rl  # rl.tool_backend: the local process pool, or Ray actors
        self.pool = ray_pool.tool_pool(
            str(rl.get("tool_backend", "local")), int(rl.tool_workers), rl.get("ray")
        )
        self.runner = RolloutRunner(
            self.sampler, ctx.chat, self.pool, _rollout_config(ctx.cfg), dataset_dir=ctx.train_dir
        )
        self.policy_dir = ctx.workdir.policy_dir

    def load_newest(self, at_least: int = 0, timeout_s: float = 3600.0) -> int:
        deadline = time.time() + timeout_s
        while True:
            latest = weights.latest_policy(self.policy_dir)
            if latest is not None and latest[0] >= at_least:
                if self.sampler.policy_version != latest[0]:
                    self.sampler.load_checkpoint(latest[1], latest[0])
                return latest[0]
            if time.time() > deadline:
                raise TimeoutError(f"no policy >= {at_least} in {self.policy_dir}")
            self.ctx.beat.waiting(f"policy {at_least}")
            time.sleep(1.0)

    def rollouts(self, index: int) -> tuple[list[Episode], dict[str, Any]]:
        """Rollout batch ``index``: one round of ``tasks_per_step`` task groups, or with
        ``rl.sample_rounds`` > 1 (dynamic sampling) further rounds of new tasks until
        ``tasks_per_step`` groups have reward variance or the rounds run out.

        Every episode sampled is kept (the step's reward and pass@1 are over all of
        them, not only the groups with signal); round ``r``'s groups carry task indices
        offset by ``r * tasks_per_step`` so they stay distinct groups.
        """
        cfg = self.ctx.cfg
        rounds = max(1, int(cfg.rl.sample_rounds))
        want = int(cfg.rl.tasks_per_step)
        reward_config = rewards.RewardConfig.from_mapping(cfg.rl.reward.to_dict())
        start = time.time()
        episodes: list[Episode] = []
        used = 0
        for r in range(rounds):
            batch = index * rounds + r  # with one round: batch == index, as before
            got = self.runner.run(_task_batch(self.ctx, batch), seed=cfg.seed * 1_000_003 + batch)
            for e in got:
                e.task_index += r * want
            episodes += got
            used = r + 1
            if rounds > 1 and signal_groups(episodes, reward_config) >= want:
                break
        versions = [v for e in episodes for v in e.turn_versions]
        info = {
            "policy_version": min(versions) if versions else self.sampler.policy_version,
            "rollout_seconds": time.time() - start,
            "sample_rounds": used,
        }
        return episodes, info

    def evaluate(self, stage: str, step: int, writer: MetricsWriter) -> dict[str, Any]:
        """Held-out eval (skipped once the benchmark is retired as saturated)."""
        e = self.ctx.cfg.rl.eval
        self.ctx.beat.progress(f"eval_{stage}", step)
        registry = eval_registry.Registry.for_run(
            self.ctx.workdir, str(e.get("registry", "")), threshold=float(e.get("retire_at", 0.9))
        )
        if not registry.is_active(str(e.bench_name)):
            log.info("benchmark %s is retired (saturated): not evaluated", e.bench_name)
            return {}
        tasks = self.ctx.bench_tasks[: int(e.num_tasks)] if e.num_tasks else self.ctx.bench_tasks
        bench_runner = RolloutRunner(
            self.sampler,
            self.ctx.chat,
            self.pool,
            dataclasses.replace(_rollout_config(self.ctx.cfg), temperature=float(e.temperature)),
            dataset_dir=self.ctx.bench_dir,
        )
        summary = eval_runner.evaluate(
            bench_runner,
            tasks,
            samples=int(e.samples),
            seed=int(e.seed),
            bench_name=str(e.bench_name),
            out_dir=self.ctx.workdir.eval_dir,
            stage=stage,
            step=step,
            policy_version=self.sampler.policy_version,
            partial_credit=bool(self.ctx.cfg.rl.reward.partial_credit),
            save_trajectories=bool(e.save_trajectories),
        )
        row = eval_runner.eval_row(summary)
        writer.write(stage, step, row)
        registry.record(summary)
        return row

    def evaluate_base(self, writer: MetricsWriter) -> dict[str, Any]:
        """Held-out eval of the model before SFT (``BASE_STAGE``'s checkpoint), stage
        ``base``, at that checkpoint's step: the baseline the SFT and RL evals are read
        against. Skipped with a log line when the run has no such checkpoint."""
        path = checkpoints.latest_checkpoint(self.ctx.workdir.checkpoint_dir(BASE_STAGE))
        if path is None:
            log.info(
                "no %s checkpoint in %s: the base model is not evaluated",
                BASE_STAGE,
                self.ctx.workdir,
            )
            return {}
        self.sampler.load_checkpoint(path, BASE_VERSION)
        return self.evaluate("base", int(os.path.basename(path)), writer)

    def close(self) -> None:
        self.pool.shutdown()


def _trainer(ctx: _Context) -> RLTrainer:
    metadata = checkpoints.make_metadata(
        ctx.model_config, stage="rl", tokenizer_json=ctx.tokenizer.to_json()
    )
    trainer = RLTrainer(
        ctx.model_config,
        ctx.cfg,
        init_from=_init_checkpoint(ctx),
        state_dir=ctx.workdir.checkpoint_dir("rl"),
        policy_dir=ctx.workdir.policy_dir,
        metadata=metadata,
    )
    record = heartbeat.checkpoint_failure_recorder(
        ctx.workdir, ctx.beat.role, enabled=jax.process_index() == 0
    )
    trainer.manager.on_error = trainer.policies.on_error = record
    return trainer


def _feedback_points(ctx: _Context, config: feedback.FeedbackConfig, episodes, kept, advantages):
    """Textual feedback's points (``rl.feedback``): the detectors run on every scored
    episode, feedback on or off, so their rates (the behaviours) are in the metrics of
    every run; with feedback on, an episode of a zero-variance group that has a point
    is trained too, at advantage 0 (``feedback`` choice 5). Returns (episodes,
    advantages, points or None, metrics)."""
    scored = [e for e in episodes if e.finish_reason != "lost"]
    found, metrics = feedback.find_points(
        scored, ctx.chat, config, max_turns=int(ctx.cfg.rl.rollout.max_turns) or None
    )
    if not config.enabled:
        return kept, advantages, None, metrics
    point_of = {id(e): p for e, p in zip(scored, found)}
    taken = {id(e) for e in kept}
    extra = [e for e in scored if id(e) not in taken and point_of[id(e)] is not None]
    kept, advantages = [*kept, *extra], [*advantages, *([0.0] * len(extra))]
    metrics["feedback/zero_advantage_episodes"] = float(len(extra))
    return kept, advantages, [point_of[id(e)] for e in kept], metrics


def _train_on(trainer: RLTrainer, ctx: _Context, store: RolloutStore, index: int, writer):
    """One trainer step on rollout file ``index`` (or a skip if it is too stale)."""
    episodes, info = store.read(index)
    reward_config = rewards.RewardConfig.from_mapping(ctx.cfg.rl.reward.to_dict())
    kept, advantages, reward_metrics = score_groups(episodes, reward_config, trainer.grpo)
    kept, advantages, points, feedback_metrics = _feedback_points(
        ctx, trainer.feedback, episodes, kept, advantages
    )
    if faults.inject_nan(ctx.workdir, "rl", index + 1):  # drills only (ops.faults)
        log.warning("RL step %d: injecting NaN advantages ($%s)", index + 1, faults.NAN_ENV)
        advantages = [float("nan")] * len(advantages)
    staleness = trainer.version - int(info.get("policy_version") or 0)
    row = {**reward_metrics, **rollout_metrics(episodes), "staleness": staleness}
    # Which batch this was and who sampled it (many samplers: count episodes per sampler).
    row.update(rollout_index=index, sampler=int(info.get("sampler", 0)), episodes=len(episodes))
    row["stale_batches_dropped"] = 0
    row.update(feedback_metrics)
    row["rollout_seconds"] = float(info.get("rollout_seconds", 0.0))
    row["sample_rounds"] = int(info.get("sample_rounds", 1))
    if staleness > int(ctx.cfg.rl.max_staleness):
        row["stale_batches_dropped"] = 1
        log.warning("rollout %d is %d versions old: dropped", index, staleness)
    elif kept:
        start = time.time()
        hint_ids = functools.partial(feedback.hint_tokens, ctx.chat)
        row.update(trainer.train(kept, advantages, points=points, hint_ids=hint_ids))
        row["train_seconds"] = time.time() - start
    trainer.publish()
    row["policy_version"] = trainer.version
    writer.write("rl", index + 1, row)
    trainer.save({"next_rollout": index + 1})
    store.mark_trained(index + 1)
    ctx.beat.progress("rl", index + 1)
    return row


# ---- the roles ----------------------------------------------------------------------


def run_rl(config: ml_collections.ConfigDict, workdir: Workdir | str) -> dict[str, Any]:
    """Runs the RL stage in the configured role; returns a summary for the console."""
    role = config.rl.role
    if role not in ROLES:
        raise ValueError(f"rl.role={role!r}: one of {ROLES}")
    sampler_slot(config)
    workdir = Workdir.of(workdir)
    ctx = _context(config, workdir)
    writer = MetricsWriter(workdir, enabled=jax.process_index() == 0)
    store = RolloutStore(workdir)
    try:
        if role == "trainer":
            return _run_trainer(ctx, store, writer)
        if role == "sampler":
            return _run_sampler(ctx, store, writer)
        return _run_colocated(ctx, store, writer)
    finally:
        writer.close()


def _run_colocated(ctx: _Context, store: RolloutStore, writer) -> dict[str, Any]:
    start = time.time()
    rl = ctx.cfg.rl
    trainer = _trainer(ctx)
    sampler_side = _SamplerSide(ctx)
    progress = Progress("rl", int(rl.num_steps))
    evals = {}
    try:
        trainer.publish()
        steps = int(rl.num_steps)
        if trainer.batches_done == 0 and int(rl.eval.every) >= 0:
            evals.update(_evaluate_before_rl(ctx, sampler_side, writer))
            _release_memory(ctx)
        row: dict[str, Any] = {}
        while trainer.batches_done < steps:
            index = trainer.batches_done
            sampler_side.load_newest(trainer.version)
            if not store.exists(index):
                episodes, info = sampler_side.rollouts(index)
                store.write(index, episodes, info)
                _release_memory(ctx)
            row = _train_on(trainer, ctx, store, index, writer)
            _release_memory(ctx)
            progress.update(
                trainer.batches_done,
                {k: row.get(k) for k in ("reward", "pass@1", "generated_tokens", "policy_loss")},
            )
            every = int(rl.eval.every)
            if every > 0 and trainer.batches_done % every == 0 and trainer.batches_done < steps:
                sampler_side.load_newest(trainer.version)
                sampler_side.evaluate("rl", trainer.batches_done, writer)
                _release_memory(ctx)
        done, version = trainer.batches_done, trainer.version
        sampler_side.load_newest(version)
        # The last eval needs only the sampler: the trainer's state and compiled
        # programs go first (the stage's peak was in this eval, 2026-12-06).
        trainer.close()
        _release_memory(ctx)
        if int(rl.eval.every) >= 0:
            evals["after"] = sampler_side.evaluate("rl", done, writer)
        store.mark_done()
    finally:
        progress.finish()
        sampler_side.close()
        trainer.close()
    return {
        "steps": done,
        "policy_version": version,
        "reward": row.get("reward"),
        "wall_s": time.time() - start,
        **evals,
    }


def _release_memory(ctx: _Context) -> None:
    """Between the sampler's and the trainer's phases (config_lib: train.release_memory)."""
    if ctx.cfg.train.release_memory:
        hostmem.release_free_memory()


def _evaluate_before_rl(ctx: _Context, side: _SamplerSide, writer) -> dict[str, Any]:
    """The held-out evals before the first RL step, each once per run: the base model
    (``rl.eval.base``), then the SFT checkpoint (policy version 0)."""
    evals = {}
    if bool(ctx.cfg.rl.eval.base) and not _evaluated(ctx, "base"):
        evals["base"] = side.evaluate_base(writer)
    if not _evaluated(ctx, "sft"):
        side.load_newest(0)  # also swaps the policy back in after the base eval
        evals["before"] = side.evaluate("sft", 0, writer)
    return evals


def _evaluated(ctx: _Context, stage: str) -> bool:
    return any(r.get("stage") == stage and "pass@1" in r for r in read_metrics(ctx.workdir))


def _run_trainer(ctx: _Context, store: RolloutStore, writer) -> dict[str, Any]:
    start = time.time()
    trainer = _trainer(ctx)
    try:
        trainer.publish()
        _, num_samplers = sampler_slot(ctx.cfg)
        while trainer.batches_done < int(ctx.cfg.rl.num_steps):
            index = trainer.batches_done
            while not store.exists(index):
                owner = f" (sampler {owner_of(index, num_samplers)})" if num_samplers > 1 else ""
                ctx.beat.waiting(f"rollout {index}{owner}")
                time.sleep(0.5)
            _train_on(trainer, ctx, store, trainer.batches_done, writer)
        store.mark_done()
    finally:
        trainer.close()
    return {"steps": trainer.batches_done, "wall_s": time.time() - start}


def _run_sampler(ctx: _Context, store: RolloutStore, writer) -> dict[str, Any]:
    """Sampler ``rl.sampler_id`` of ``rl.num_samplers``: writes its own rollout indices
    (``sampler_id``, ``sampler_id + N``, ...) from its cursor on; sampler 0 evaluates."""
    start = time.time()
    rl = ctx.cfg.rl
    sampler_id, num_samplers = sampler_slot(ctx.cfg)
    lead = sampler_id == 0
    side = _SamplerSide(ctx)
    produced = 0
    try:
        version = side.load_newest(0)
        if lead and version == 0 and int(rl.eval.every) >= 0:
            _evaluate_before_rl(ctx, side, writer)
        last_eval = version
        index = store.cursor(sampler_id, num_samplers)
        log.info("sampler %d of %d: next rollout %d", sampler_id, num_samplers, index)
        while not store.done:
            # Stay at most max_staleness rollout batches ahead of the trainer. (The
            # policy version can trail the batches trained: a batch without signal
            # takes no optimizer step.)
            while store.trained() < index - int(rl.max_staleness) and not store.done:
                ctx.beat.waiting(f"the trainer (rollout {index} is {rl.max_staleness} ahead)")
                time.sleep(0.5)
            if store.done:
                break
            version = side.load_newest(0)
            ctx.beat.progress("rl_rollouts", index)
            episodes, info = side.rollouts(index)
            info["sampler"] = sampler_id
            store.write(index, episodes, info, exclusive=True)
            produced += 1
            index += num_samplers
            ctx.beat.progress("rl_rollouts", index)
            every = int(rl.eval.every)
            if lead and every > 0 and version - last_eval >= every:
                side.evaluate("rl", version, writer)
                last_eval = version
        if lead:
            side.load_newest(0)  # the final policy (published before DONE)
            if int(rl.eval.every) >= 0:
                side.evaluate("rl", int(rl.num_steps), writer)
    finally:
        side.close()
    return {"rollout_batches": produced, "wall_s": time.time() - start}
