"""The RL trainer: GRPO updates on the trainer's mesh; policy versions go out as Orbax checkpoints.

Episodes become training rows here (host side), in three steps:

1. each self-summarised episode contributes one sequence per context window
   (segment), all with the episode's advantage;
2. sequences are packed into rows of ``seq_len`` by the pretraining packer
   (``data.packing``), first-fit, longest first (``segment_ids`` keep them apart,
   ``positions`` restart); a longer sequence is cut at ``seq_len`` (counted);
3. the row count is rounded up to a power of two times ``rows_multiple`` (the
   batch shards times micro-batches), so few distinct shapes are ever compiled.

``old_logprobs`` (the trainer's own log-probs before this batch's updates) are
computed once per batch; the batch then takes ``updates_per_batch`` optimizer
steps over as many equal slices of its rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from cursor_rl import checkpoints, partitioning
from cursor_rl.chat.episodes import Episode
from cursor_rl.data import packing
from cursor_rl.model.config import ModelConfig
from cursor_rl.rl import feedback, grpo
from cursor_rl.train import optimizer as optim
from cursor_rl.train import step as step_lib


@dataclasses.dataclass
class BatchStats:
    sequences: int = 0
    rows: int = 0
    tokens: int = 0  # real tokens (all roles)
    model_tokens: int = 0  # tokens with loss
    truncated: int = 0  # sequences cut at seq_len
    feedback_points: int = 0  # episodes whose hinted segment became a teacher row
    feedback_too_long: int = 0  # points whose hinted segment exceeds seq_len (dropped)
    teacher_rows: int = 0


def _pack(sequences: list[dict[str, np.ndarray]], seq_len: int, rows_multiple: int):
    """First-fit decreasing (the shared packer, fed the sequences longest first); the
    row count rounded up to a power of two times ``rows_multiple``."""
    order = sorted(range(len(sequences)), key=lambda i: -sequences[i]["tokens"].shape[0])
    rows = packing.pack_examples([sequences[i] for i in order], seq_len=seq_len)
    num_rows = max(len(rows), 1)
    num_rows = rows_multiple * 2 ** math.ceil(math.log2(max(num_rows / rows_multiple, 1)))
    return rows, num_rows


def microbatch_count(microbatches: int, microbatch_rows: int, rows: int) -> int:
    """Microbatches for an update of ``rows`` rows: ``rl.microbatches``, or more so that
    none exceeds ``rl.microbatch_rows`` (0: no bound); the count always divides ``rows``."""
    count = microbatches
    if microbatch_rows:
        count = max(count, -(-rows // microbatch_rows))
        while rows % count:
            count += 1
    return count


def _feedback_uids(mask: Sequence[int], start: int, window: int, first_uid: int) -> np.ndarray:
    """-1, except a fresh id on each of the first ``window`` model tokens from ``start``."""
    uids = np.full(len(mask), -1, np.int64)
    uid = first_uid
    for j in range(start, len(mask)):
        if uid - first_uid >= window:
            break
        if mask[j]:
            uids[j] = uid
            uid += 1
    return uids


def build_batch(
    episodes: Sequence[Episode],
    advantages: Sequence[float],
    *,
    seq_len: int,
    rows_multiple: int,
    aggregation: str,
    points: Sequence[feedback.Point | None] | None = None,
    hint_ids: Callable[[str], Sequence[int]] | None = None,
    window: int = 0,
) -> tuple[dict[str, np.ndarray], BatchStats]:
    """Training rows (``grpo.RL_BATCH_KEYS`` except ``old_logprobs``) from episodes.

    Args:
      episodes: graded episodes to train on (zero-advantage ones may be left out).
      advantages: one per episode.
      seq_len: row length.
      rows_multiple: the row count is a multiple of this.
      aggregation: ``token_mean`` or ``sequence_mean`` (see ``grpo``).
      points: textual feedback (``rl.feedback``): per episode, where its hint goes, or
        None. Each point's segment, with the hint (``hint_ids(point.hint)``) inserted,
        becomes a teacher sequence; the ``window`` model tokens from the point are
        linked to their copies there (``grpo.FEEDBACK_KEYS``). Without any point
        that fits, the batch has no feedback keys.
    """
    stats = BatchStats()
    sequences, teachers = [], []
    next_uid = 0
    for i, (episode, advantage) in enumerate(zip(episodes, advantages)):
        traj = episode.trajectory
        point = points[i] if points is not None else None
        for s in range(len(traj.segment_starts)):
            tokens, mask, logprobs = traj.segment(s)
            lp = np.asarray(logprobs, np.float64)
            fields = {
                "advantages": np.full(len(tokens), advantage, np.float32),
                # NaN marks tokens the sampler did not produce (never trained).
                "sampler_logprobs": np.where(np.isnan(lp), 0.0, lp).astype(np.float32),
                "sequence_ids": np.full(len(tokens), len(sequences) + 1, np.int64),
            }
            if points is not None:
                fields["feedback_uid"] = np.zeros(len(tokens), np.int64)
                start = traj.segment_starts[s]
                if point is not None and start <= point.position < start + len(tokens):
                    at = point.position - start
                    hint = list(hint_ids(point.hint))
                    if len(tokens) + len(hint) - 1 > seq_len:
                        stats.feedback_too_long += 1
                    else:
                        uids = _feedback_uids(mask, at, window, next_uid)
                        next_uid = int(uids.max(initial=next_uid - 1)) + 1
                        # Stored +1: the packer pads fields with 0, which must mean "none".
                        fields["feedback_uid"] = uids + 1
                        teacher_ids = [*tokens[:at], *hint, *tokens[at:]]
                        teacher_uid = np.concatenate([uids[:at], np.full(len(hint), -1), uids[at:]])
                        teachers.append(
                            packing.example_from_ids(
                                teacher_ids,
                                np.zeros(len(teacher_ids), np.int32),
                                {"feedback_uid": teacher_uid + 1},
                                require_loss=False,
                            )
                        )
                        stats.feedback_points += 1
            example = packing.example_from_ids(tokens, mask, fields, require_loss=False)
            if example is None:
                continue
            if example["tokens"].shape[0] > seq_len:
                stats.truncated += 1
                example = {k: v[:seq_len] for k, v in example.items()}
            sequences.append(example)
            stats.tokens += example["tokens"].shape[0]
            stats.model_tokens += int(example["loss_mask"].sum())
    rows, num_rows = _pack(sequences, seq_len, rows_multiple)
    shape = (num_rows, seq_len)
    out = {
        "tokens": np.zeros(shape, np.int32),
        "targets": np.zeros(shape, np.int32),
        "loss_mask": np.zeros(shape, np.int32),
        "segment_ids": np.zeros(shape, np.int32),
        "positions": np.zeros(shape, np.int32),
        "advantages": np.zeros(shape, np.float32),
        "sampler_logprobs": np.zeros(shape, np.float32),
        "ref_logprobs": np.zeros(shape, np.float32),
    }
    sequence_ids = np.zeros(shape, np.int64)
    student_uid = np.full(shape, -1, np.int64)
    for r, row in enumerate(rows):
        sequence_ids[r] = row.pop("sequence_ids")
        if "feedback_uid" in row:
            student_uid[r] = row.pop("feedback_uid") - 1
        for k, v in row.items():
            out[k][r] = v
    out["token_weight"] = grpo.token_weights(out["loss_mask"], sequence_ids, aggregation)
    stats.sequences, stats.rows = len(sequences), num_rows
    if teachers:
        out.update(_teacher_rows(teachers, student_uid, seq_len, rows_multiple))
        stats.teacher_rows = out["teacher_tokens"].shape[0]
    return out, stats


def _teacher_rows(teachers, student_uid, seq_len, rows_multiple) -> dict[str, np.ndarray]:
    """The hinted sequences packed into ``teacher_*`` rows, and ``feedback_index``: for
    each student target in a window, the flat index of its copy among them (else -1)."""
    rows, num_rows = _pack(teachers, seq_len, rows_multiple)
    shape = (num_rows, seq_len)
    out = {f"teacher_{k}": np.zeros(shape, np.int32) for k in step_lib.BATCH_KEYS}
    teacher_uid = np.full(shape, -1, np.int64)
    for r, row in enumerate(rows):
        teacher_uid[r] = row.pop("feedback_uid") - 1
        for k, v in row.items():
            out[f"teacher_{k}"][r] = v
    flat = teacher_uid.reshape(-1)
    where = np.full(int(flat.max(initial=-1)) + 1, -1, np.int64)
    where[flat[flat >= 0]] = np.nonzero(flat >= 0)[0]
    index = np.where(student_uid >= 0, where[np.maximum(student_uid, 0)], -1)
    out["feedback_index"] = index.astype(np.int32)
    return out


class RLTrainer:
    """GRPO on the trainer mesh, starting from a stage checkpoint (weights only).

    Args:
      model_config: the policy's model config.
      cfg: the run's config (``rl``, ``optimizer`` and ``mesh`` sections).
      init_from: checkpoint to start from (the SFT stage's) when ``state_dir`` is empty.
      state_dir: the RL trainer's own checkpoints (resume).
      policy_dir: where policy versions are published for the sampler.
      metadata: extra checkpoint metadata (tokenizer, ...).
    """

    def __init__(
        self, model_config: ModelConfig, cfg, *, init_from, state_dir, policy_dir, metadata
    ):
        self.model_config = model_config
        self.cfg = cfg
        rl = cfg.rl
        self.mesh = partitioning.make_mesh(cfg.mesh.ici.to_dict(), cfg.mesh.dcn.to_dict())
        self.rules = partitioning.make_rules(cfg.mesh.rules_preset, cfg.mesh.rules.to_dict())
        self.grpo = grpo.GRPOConfig.from_mapping(rl.grpo.to_dict())
        self.feedback = feedback.FeedbackConfig.from_mapping(rl.feedback.to_dict())
        # The rollouts' temperature: the trainer scores the distribution they drew from.
        self.temperature = float(rl.rollout.temperature)
        if self.temperature <= 0:
            raise ValueError(
                f"rl.rollout.temperature={self.temperature}: RL rollouts need a temperature > 0"
            )
        updates = int(rl.num_steps) * int(rl.updates_per_batch)
        self.tx = optim.make_optimizer(cfg.optimizer, updates)
        self.schedule = optim.make_schedule(cfg.optimizer, updates)
        self.abstract, self.shardings = step_lib.abstract_train_state(
            model_config, self.tx, self.mesh, self.rules
        )
        self.batch_sharding = partitioning.logical_sharding(
            ("act_batch", "act_length"), self.mesh, self.rules
        )
        sizes = dict(self.mesh.shape)
        batch_devices = int(np.prod([sizes[a] for a in partitioning.BATCH_AXES]))
        self.rows_multiple = batch_devices * int(rl.microbatches)
        self.microbatch_rows = int(rl.get("microbatch_rows", 0))
        if self.microbatch_rows < 0 or self.microbatch_rows % batch_devices:
            raise ValueError(
                f"rl.microbatch_rows={self.microbatch_rows}: must be 0 or a positive multiple "
                f"of the batch axes' {batch_devices} devices"
            )
        self.metadata = dict(metadata)
        self.manager = checkpoints.CheckpointManager(
            state_dir, keep_last=2, async_save=False, fallback_to_previous=True
        )
        self.policies = checkpoints.CheckpointManager(
            policy_dir, keep_last=int(rl.keep_policies), async_save=False
        )
        self.extra: dict[str, Any] = {}
        variables_target = {"params": self.abstract.params, "router": self.abstract.router}
        with partitioning.use_mesh(self.mesh, self.rules):
            if self.manager.latest_step() is not None:
                _, variables, train, meta = self.manager.restore(
                    variables_target, self.abstract.train_items()
                )
                self.state = step_lib.TrainState(
                    step=train["step"],
                    params=variables["params"],
                    router=variables["router"],
                    opt_state=train["opt_state"],
                    skipped=train["skipped"],
                )
                self.extra = dict(meta.get("rl", {}))
            else:
                variables = checkpoints.restore_variables(init_from, variables_target)
                init_opt = jax.jit(self.tx.init, out_shardings=self.shardings.opt_state)
                replicated = partitioning.replicated(self.mesh)
                self.state = step_lib.TrainState(
                    step=jax.device_put(np.int32(0), replicated),
                    params=variables["params"],
                    router=variables["router"],
                    opt_state=init_opt(variables["params"]),
                    skipped=jax.device_put(np.int32(0), replicated),
                )
            self._updates: dict[int, Any] = {}  # microbatch count -> compiled update
            variables_sh = {"params": self.shardings.params, "router": self.shardings.router}
            self._logprobs = jax.jit(
                functools.partial(
                    grpo.logprobs_step,
                    config=model_config,
                    loss_chunk=int(cfg.train.loss_chunk_size),
                    temperature=self.temperature,
                ),
                in_shardings=(variables_sh, {k: self.batch_sharding for k in step_lib.BATCH_KEYS}),
                out_shardings=self.batch_sharding,
            )

    def microbatches(self, rows: int) -> int:
        return microbatch_count(int(self.cfg.rl.microbatches), self.microbatch_rows, rows)

    def _update(self, state, batch):
        count = self.microbatches(int(batch["tokens"].shape[0]))
        with_feedback = "feedback_index" in batch
        key = (count, with_feedback)
        if key not in self._updates:
            keys = grpo.RL_BATCH_KEYS + (grpo.FEEDBACK_KEYS if with_feedback else ())
            batch_sh = {k: self.batch_sharding for k in keys}
            self._updates[key] = grpo.jit_grpo_step(
                self.model_config,
                self.grpo,
                self.tx,
                self.schedule,
                self.shardings,
                batch_sh,
                microbatches=count,
                loss_chunk=int(self.cfg.train.loss_chunk_size),
                temperature=self.temperature,
                feedback=self.feedback,
            )
        return self._updates[key](state, batch)

    def _old_logprobs(self, host: dict[str, np.ndarray]) -> np.ndarray:
        """The current policy's log-probs of ``host``'s rows, in slices of at most
        ``rl.microbatch_rows`` rows."""
        rows = host["tokens"].shape[0]
        size = rows // self.microbatches(rows) if self.microbatch_rows else rows
        put = lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x)
        parts = []
        for start in range(0, rows, size):
            batch = {k: put(host[k][start : start + size]) for k in step_lib.BATCH_KEYS}
            parts.append(np.asarray(jax.device_get(self._logprobs(self.state.variables, batch))))
        return np.concatenate(parts).astype(np.float32)

    @property
    def version(self) -> int:
        """The policy version: optimizer updates so far."""
        return int(jax.device_get(self.state.step))

    def publish(self) -> str:
        """Writes the current weights as policy ``version`` for the sampler(s)."""
        version = self.version
        if version not in self.policies.all_steps():
            self.policies.save(
                version, self.state.variables, metadata={**self.metadata, "step": version}
            )
            self.policies.wait()
        return f"{self.policies.directory}/{version}"

    def train(
        self,
        episodes: Sequence[Episode],
        advantages: Sequence[float],
        *,
        points: Sequence[feedback.Point | None] | None = None,
        hint_ids: Callable[[str], Sequence[int]] | None = None,
    ) -> dict[str, float]:
        """GRPO updates on ``episodes`` (their advantages given); returns averaged metrics.
        ``points`` and ``hint_ids``: textual feedback (``build_batch``)."""
        rl = self.cfg.rl
        slices = int(rl.updates_per_batch)
        host, stats = build_batch(
            episodes,
            advantages,
            seq_len=int(rl.train_seq_len),
            rows_multiple=self.rows_multiple * slices,
            aggregation=self.grpo.aggregation,
            points=points,
            hint_ids=hint_ids,
            window=self.feedback.window,
        )
        with partitioning.use_mesh(self.mesh, self.rules):
            put = lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x)
            host["old_logprobs"] = self._old_logprobs(host)
            rows = host["tokens"].shape[0] // slices
            collected = []
            for i in range(slices):
                # Teacher rows are indexed as a whole (feedback_index): every slice has them.
                part = {
                    k: v if k in grpo.TEACHER_KEYS else v[i * rows : (i + 1) * rows]
                    for k, v in host.items()
                }
                # Each slice's weights sum to its share, so slices weigh as in one update.
                part["token_weight"] = part["token_weight"] * slices
                part = {k: put(v) for k, v in part.items()}
                self.state, metrics = self._update(self.state, part)
                collected.append(metrics)
        host_metrics = jax.device_get(collected)
        out = {k: float(np.mean([m[k] for m in host_metrics])) for k in host_metrics[0]}
        out.update(
            {
                "train_sequences": stats.sequences,
                "train_rows": stats.rows,
                "train_tokens": stats.tokens,
                "train_model_tokens": stats.model_tokens,
                "train_truncated": stats.truncated,
                "feedback/trained_points": stats.feedback_points,
                "feedback/too_long": stats.feedback_too_long,
                "feedback/teacher_rows": stats.teacher_rows,
            }
        )
        return out

    @property
    def batches_done(self) -> int:
        """Rollout batches consumed so far (the RL step; some may not have updated)."""
        return int(self.extra.get("next_rollout", 0))

    def save(self, extra: dict[str, Any]) -> None:
        """Checkpoints the trainer (weights, optimizer, version) with the loop's cursor.

        Checkpoints are numbered by rollout batches consumed (``extra["next_rollout"]``):
        a batch without signal consumes a step without changing the policy version.
        """
        self.extra = dict(extra)
        self.manager.save(
            self.batches_done,
            self.state.variables,
            self.state.train_items(),
            metadata={**self.metadata, "step": self.version, "rl": self.extra},
        )
        self.manager.wait()

    def close(self) -> None:
        """Closes the checkpoint managers and lets go of the state and the compiled
        update programs (the loop closes the trainer before its last eval, which needs
        only the sampler); idempotent."""
        if self.state is None:
            return
        self.manager.close()
        self.policies.close()
        self.state = None
        self._updates.clear()
        self._logprobs = None
