"""GRPO-style policy gradient on multi-turn agent episodes, compiled with XLA.

Choices, in the order they act:

1. **Group-normalised advantages.** A task's G episodes form a group;
   ``A_i = r_i - mean(r)`` (Dr.GRPO, arXiv:2503.20783: no std division, so easy
   and hard tasks weigh alike) or, with ``std_normalize``, ``(r_i - mean) / (std +
   eps)`` (the original GRPO). Every segment and every model token of an episode
   carries the episode's advantage: one final reward shared by all segments of a
   self-summarised episode.
2. **Zero-variance groups are dropped**: all-equal rewards give zero advantage,
   hence no gradient, but would still dilute token-mean normalisation (DAPO's
   dynamic sampling, arXiv:2503.14476 sec. 3.2). Counted in the metrics.
3. **Aggregation**: ``token_mean`` (DAPO: every model token of the batch weighs
   the same, so long episodes are not down-weighted) or ``sequence_mean`` (mean
   over each training sequence's tokens, then over sequences). Expressed as a
   per-token weight computed on the host, so micro-batching stays exact.
4. **Asymmetric clipping** of the ratio ``pi_theta / pi_old`` to
   ``[1 - eps_low, 1 + eps_high]`` (DAPO clip-higher: 0.2 / 0.28), PPO's
   pessimistic minimum. ``pi_old`` is the trainer's own log-probability under
   the weights the batch's update starts from (computed once per batch), so the
   ratio is exactly 1 on the first update and clipping acts on later ones.
5. **Truncated importance sampling** (TIS, Yao et al. 2025) corrects the
   mismatch between the sampler that generated the tokens and the trainer:
   weight ``min(exp(logp_old - logp_sampler), C)``, no gradient through it. It
   covers numerical differences between the two programs and policy staleness
   (rollouts up to ``max_staleness`` versions old are accepted).
6. **KL to a reference policy**: optional, off by default (``kl_coef=0``, as in
   DAPO and Dr.GRPO); when on, the k3 estimator against the reference log-probs
   supplied with the batch.
7. **Masked tokens** (system, user, tool-result tokens and padding) have weight
   0, so they contribute exactly zero gradient.
8. **The sampling temperature is part of the policy.** Rollouts drawn at
   temperature T carry log-probs of ``softmax(logits / T)``; the trainer scores
   (``old_logprobs`` and the loss) with the same T, so the ratio and TIS compare like
   with like (veRL divides the actor's logits by the rollout temperature the same way).

9. **Textual feedback** (``cursor_rl.rl.feedback``), when a batch carries teacher
   rows: the same parameters score the hinted sequences (no gradient), in the same
   program, before the micro-batch loop. Objective ``advantage``: each student token
   in a feedback window gets ``A_t + coef * clip(logp_teacher - old_logprobs, -clip,
   clip)`` as its advantage. Objective ``kl``: the loss gains ``coef * sum_t w_t *
   KL(pi_teacher(.|hinted x_<t) || pi_theta(.|x_<t))`` over the window's positions
   (whole vocabulary; ``w_t = 1 / #window tokens in the batch``), whose gradient on the
   student's logits is ``coef * w_t * (p_theta - p_teacher)``: it raises the tokens the
   teacher prefers, not only lowers the sampled one.

The update itself (optimizer, clipping, non-finite skip, router-bias update)
is the trainer's (``cursor_rl.train.step``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cursor_rl import model
from cursor_rl.model.config import ModelConfig
from cursor_rl.train import optimizer as optim
from cursor_rl.train import step as step_lib

RL_BATCH_KEYS = (
    *step_lib.BATCH_KEYS,
    "advantages",  # float32 [B, T]: the episode's advantage on each of its tokens
    "token_weight",  # float32 [B, T]: aggregation weight (0 on masked tokens)
    "sampler_logprobs",  # float32 [B, T]: the sampler's log p of each target token
    "old_logprobs",  # float32 [B, T]: the trainer's log p before this batch's updates
    "ref_logprobs",  # float32 [B, T]: a reference policy's (zeros when kl_coef = 0)
)
AGGREGATIONS = ("token_mean", "sequence_mean")
# Textual feedback (``cursor_rl.rl.feedback``, choice 9): the hinted sequences as rows of
# their own, and for each student token the flat index of the same token among them.
TEACHER_KEYS = tuple(f"teacher_{k}" for k in step_lib.BATCH_KEYS)
FEEDBACK_KEYS = ("feedback_index", *TEACHER_KEYS)
FEEDBACK_OBJECTIVES = ("advantage", "kl")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    std_normalize: bool = False
    drop_zero_variance: bool = True
    aggregation: str = "token_mean"
    eps_low: float = 0.2
    eps_high: float = 0.28
    tis_cap: float = 2.0
    kl_coef: float = 0.0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> GRPOConfig:
        values = dict(values)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"rl.grpo: unknown field(s) {unknown}; known: {sorted(known)}")
        config = cls(**values)
        if config.aggregation not in AGGREGATIONS:
            raise ValueError(f"rl.grpo.aggregation={config.aggregation!r}: one of {AGGREGATIONS}")
        if config.eps_low < 0 or config.eps_high < 0 or config.tis_cap <= 0:
            raise ValueError("rl.grpo: eps_low, eps_high must be >= 0 and tis_cap > 0")
        return config


# ---- host side ------------------------------------------------------------------


def group_advantages(rewards: Sequence[float], std_normalize: bool, eps: float = 1e-6):
    """Advantages of one group's episodes (choice 1)."""
    r = np.asarray(rewards, np.float64)
    centred = r - r.mean()
    if std_normalize:
        centred = centred / (r.std() + eps)
    return centred


def has_signal(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """False for a zero-variance group (choice 2)."""
    return float(np.ptp(np.asarray(rewards, np.float64))) > tol


def token_weights(loss_mask: np.ndarray, sequence_ids: np.ndarray, aggregation: str) -> np.ndarray:
    """Per-token aggregation weights for a whole batch (choice 3).

    Args:
      loss_mask: [B, T] 1 on the model's own tokens.
      sequence_ids: [B, T] an id per training sequence, unique over the batch
        (packed rows hold several); ignored where the mask is 0.
      aggregation: ``token_mean`` or ``sequence_mean``.

    Returns:
      float32 [B, T] summing to 1 over the batch (0 on masked tokens).
    """
    mask = loss_mask.astype(np.float64)
    total = mask.sum()
    if total == 0:
        return np.zeros_like(mask, np.float32)
    if aggregation == "token_mean":
        return (mask / total).astype(np.float32)
    ids = np.where(mask > 0, sequence_ids, -1)
    unique, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    counts = counts.reshape(-1)
    real = unique >= 0
    num_sequences = int(real.sum())
    per_token = np.where(ids.reshape(-1) >= 0, 1.0 / counts[inverse.reshape(-1)], 0.0)
    return (per_token.reshape(mask.shape) / num_sequences).astype(np.float32)


# ---- device side ----------------------------------------------------------------


def policy_loss(
    logp: jax.Array, batch: Mapping[str, jax.Array], config: GRPOConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO objective (to minimise) for per-token log-probs ``logp`` [B, T].

    Returns the weighted loss sum and per-token diagnostics' weighted sums.
    """
    weight = batch["token_weight"]
    adv = batch["advantages"]
    log_ratio = logp - batch["old_logprobs"]
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
    surrogate = jnp.minimum(ratio * adv, clipped * adv)
    tis = jax.lax.stop_gradient(
        jnp.minimum(jnp.exp(batch["old_logprobs"] - batch["sampler_logprobs"]), config.tis_cap)
    )
    per_token = -tis * surrogate
    if config.kl_coef:
        delta = batch["ref_logprobs"] - logp
        per_token = per_token + config.kl_coef * (jnp.exp(delta) - delta - 1.0)
    is_clipped = (ratio < 1.0 - config.eps_low) | (ratio > 1.0 + config.eps_high)
    diagnostics = {
        "clip_fraction": (is_clipped.astype(jnp.float32) * weight).sum(),
        "ratio_mean": (ratio * weight).sum(),
        "ratio_sq_mean": (jnp.square(ratio) * weight).sum(),
        "tis_weight_mean": (tis * weight).sum(),
        "tis_truncated_fraction": (
            (jnp.exp(batch["old_logprobs"] - batch["sampler_logprobs"]) > config.tis_cap).astype(
                jnp.float32
            )
            * weight
        ).sum(),
        "sampler_logprob_gap": (
            jnp.abs(batch["old_logprobs"] - batch["sampler_logprobs"]) * weight
        ).sum(),
    }
    return (per_token * weight).sum(), diagnostics


def logprobs_step(
    variables: dict[str, Any],
    batch: Mapping[str, jax.Array],
    *,
    config: ModelConfig,
    loss_chunk=0,
    temperature: float = 1.0,
) -> jax.Array:
    """The trainer's log p of every target token [B, T] (for ``old_logprobs``), at the
    rollouts' sampling temperature."""
    stats, _ = step_lib.token_stats(
        config, variables["params"], variables["router"], batch, loss_chunk,
        temperature=temperature,
    )  # fmt: skip
    return stats["logp"]


def teacher_logprobs(
    variables: dict[str, Any],
    batch: Mapping[str, jax.Array],
    *,
    config: ModelConfig,
    loss_chunk: int = 0,
    temperature: float = 1.0,
    chunk_rows: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """The teacher's log p of each student token in a feedback window (choice 9).

    Scores the ``teacher_*`` rows (``chunk_rows`` at a time, 0: all at once) and
    gathers, through ``feedback_index`` [B, T], the log-prob of the same token in its
    hinted sequence. Returns (log-probs [B, T], 0 outside windows; the window mask).
    """
    teacher = {k: batch[f"teacher_{k}"] for k in step_lib.BATCH_KEYS}
    rows = int(teacher["tokens"].shape[0])
    chunk = _chunk(rows, chunk_rows)

    def score(rows_batch):
        stats, _ = step_lib.token_stats(
            config, variables["params"], variables["router"], rows_batch, loss_chunk,
            temperature=temperature,
        )  # fmt: skip
        return stats["logp"]

    chunks = jax.tree.map(lambda x: x.reshape(rows // chunk, chunk, *x.shape[1:]), teacher)
    logp = jax.lax.stop_gradient(jax.lax.map(score, chunks)).reshape(-1)
    index = batch["feedback_index"]
    on = index >= 0
    return jnp.where(on, logp[jnp.maximum(index, 0)], 0.0), on


def teacher_hidden(
    variables: dict[str, Any],
    batch: Mapping[str, jax.Array],
    *,
    config: ModelConfig,
    chunk_rows: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """The teacher's final hidden state at each student position of a feedback window
    (objective ``kl``, choice 9): the ``teacher_*`` rows' hidden states (``chunk_rows``
    rows at a time, no gradient) gathered through ``feedback_index``. Returns (hidden
    [B, T, D], zeros outside windows; the window mask [B, T])."""
    teacher = {k: batch[f"teacher_{k}"] for k in step_lib.BATCH_KEYS}
    rows = int(teacher["tokens"].shape[0])
    chunk = _chunk(rows, chunk_rows)

    def hidden(rows_batch):
        h, _, _ = model.hidden_with_aux(
            config, variables, rows_batch["tokens"], rows_batch["positions"],
            rows_batch["segment_ids"],
        )  # fmt: skip
        return h

    chunks = jax.tree.map(lambda x: x.reshape(rows // chunk, chunk, *x.shape[1:]), teacher)
    h = jax.lax.stop_gradient(jax.lax.map(hidden, chunks))
    h = h.reshape(-1, h.shape[-1])
    index = batch["feedback_index"]
    on = index >= 0
    return jnp.where(on[..., None], h[jnp.maximum(index, 0)], 0).astype(h.dtype), on


def _chunk(rows: int, chunk_rows: int) -> int:
    """The largest divisor of ``rows`` not above ``chunk_rows`` (0: all rows)."""
    if chunk_rows <= 0:
        return rows
    return max(d for d in range(1, rows + 1) if rows % d == 0 and d <= chunk_rows)


def grpo_step(
    state: step_lib.TrainState,
    batch: Mapping[str, jax.Array],
    *,
    config: ModelConfig,
    grpo: GRPOConfig,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    microbatches: int = 1,
    loss_chunk: int = 0,
    temperature: float = 1.0,
    feedback_coef: float = 0.0,
    feedback_clip: float = 2.0,
    feedback_objective: str = "advantage",
) -> tuple[step_lib.TrainState, dict[str, jax.Array]]:
    """One optimizer step of the GRPO objective on a batch of RL_BATCH_KEYS arrays
    (and FEEDBACK_KEYS when textual feedback found points in it, choice 9).

    ``temperature`` is the rollouts' sampling temperature: the policy being improved is
    ``softmax(logits / temperature)``, the distribution the tokens were drawn from
    (choice 8). ``feedback_objective``: ``advantage`` or ``kl`` (choice 9).
    """
    if feedback_objective not in FEEDBACK_OBJECTIVES:
        raise ValueError(f"feedback_objective={feedback_objective!r}: one of {FEEDBACK_OBJECTIVES}")
    batch = dict(batch)
    feedback_metrics = {}
    distill = "feedback_index" in batch and feedback_objective == "kl" and feedback_coef > 0
    if distill:
        fb = {k: batch.pop(k) for k in FEEDBACK_KEYS}
        rows = int(batch["tokens"].shape[0])
        batch["teacher_hidden"], on = teacher_hidden(
            {"params": state.params, "router": state.router}, fb, config=config,
            chunk_rows=rows // microbatches,
        )  # fmt: skip
        tokens = on.astype(jnp.float32).sum()
        batch["distill_weight"] = on.astype(jnp.float32) / jnp.maximum(tokens, 1.0)
        feedback_metrics = {"feedback_tokens": tokens}
    elif "feedback_index" in batch:
        fb = {k: batch.pop(k) for k in FEEDBACK_KEYS}
        rows = int(batch["tokens"].shape[0])
        teacher_lp, on = teacher_logprobs(
            {"params": state.params, "router": state.router}, fb, config=config,
            loss_chunk=loss_chunk, temperature=temperature, chunk_rows=rows // microbatches,
        )  # fmt: skip
        signal = jnp.where(
            on, jnp.clip(teacher_lp - batch["old_logprobs"], -feedback_clip, feedback_clip), 0.0
        )
        batch["advantages"] = batch["advantages"] + feedback_coef * signal
        tokens = on.astype(jnp.float32).sum()
        feedback_metrics = {
            "feedback_tokens": tokens,
            "feedback_signal": signal.sum() / jnp.maximum(tokens, 1.0),
        }

    # The attention max logits, for QK-clip (as train_step; optimizer.qk_clip_tau).
    with_logits = optim.qk_clip_tau(tx) > 0 or config.report_attn_max_logit
    forward_config = config.replace(report_attn_max_logit=True) if with_logits else config

    def loss_fn(params, micro):
        micro = dict(micro)
        teacher = micro.pop("teacher_hidden", None)
        stats, aux = step_lib.token_stats(
            forward_config, params, state.router, micro, loss_chunk, with_entropy=True,
            temperature=temperature, teacher_hidden=teacher,
        )  # fmt: skip
        loss, diagnostics = policy_loss(stats["logp"], micro, grpo)
        diagnostics["entropy"] = (
            jax.lax.stop_gradient(stats["entropy"]) * micro["token_weight"]
        ).sum()
        if teacher is not None:
            weight = micro["distill_weight"]
            kl = (stats["kl_teacher"] * weight).sum()
            loss = loss + feedback_coef * kl
            diagnostics["feedback_kl"] = jax.lax.stop_gradient(kl)
            diagnostics["feedback_signal"] = jax.lax.stop_gradient(
                ((stats["teacher_logp"] - stats["logp"]) * weight).sum()
            )
        sums = (diagnostics, (aux["expert_load"], aux["dropped"]))
        return loss, ((sums, aux["attn_max_logit"]) if with_logits else sums)

    loss, aux, grads = step_lib.accumulate_gradients(
        loss_fn, state.params, dict(batch), microbatches, max_aux=with_logits
    )
    (diagnostics, (load, dropped)), max_logit = aux if with_logits else (aux, None)
    new_state, metrics = step_lib.apply_update(
        state, grads, loss, load, config=config, tx=tx, moe_dropped=dropped,
        attn_max_logit=max_logit,
    )  # fmt: skip
    metrics.update(diagnostics)
    metrics["ratio_std"] = jnp.sqrt(
        jnp.maximum(diagnostics["ratio_sq_mean"] - jnp.square(diagnostics["ratio_mean"]), 0.0)
    )
    metrics.update({"policy_loss": loss, "learning_rate": schedule(state.step)})
    metrics.update(feedback_metrics)
    return new_state, metrics


def jit_grpo_step(
    model_config: ModelConfig,
    grpo: GRPOConfig,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    state_sharding: Any,
    batch_shardings: Any,
    *,
    microbatches: int,
    loss_chunk: int,
    temperature: float,
    feedback: Any,
):
    """``grpo_step`` jitted as the RL trainer runs it (the state donated); ``feedback``
    is the ``rl.feedback`` settings (``coef``, ``clip``, ``objective``). The AOT tool
    compiles this same function."""
    return jax.jit(
        functools.partial(
            grpo_step,
            config=model_config,
            grpo=grpo,
            tx=tx,
            schedule=schedule,
            microbatches=microbatches,
            loss_chunk=loss_chunk,
            temperature=temperature,
            feedback_coef=feedback.coef,
            feedback_clip=feedback.clip,
            feedback_objective=feedback.objective,
        ),
        in_shardings=(state_sharding, batch_shardings),
        out_shardings=(state_sharding, None),
        donate_argnums=(0,),
    )
