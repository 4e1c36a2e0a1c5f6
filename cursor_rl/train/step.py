"""Train state, loss and the compiled train / eval steps.

Choices:

1. Loss = masked next-token cross-entropy summed over the global batch and divided
   by its number of loss tokens (so gradient accumulation over micro-batches is
   exact, not a mean of means) + optional z-loss (coef * log(Z)^2, PaLM sec. 5) +
   the MoE sequence-wise balance loss when enabled.
2. Micro-batches run under ``lax.scan`` (one compiled body), gradients summed.
3. A non-finite loss or gradient norm skips the update (params, optimizer state and
   router bias keep their values), counts it in ``skipped`` and reports it; the
   step counter still advances so the data stream and schedule move on.
4. After the optimizer update the router correction bias follows the step's expert
   load (aux-loss-free balancing); it is not touched by the optimizer.
5. With QK-clip on (``optimizer.qk_clip_tau`` > 0, ``optimizer.qk_clip``) the forward
   pass also reports each layer's and head's largest attention logit (the maximum over
   micro-batches), and the updated query/key weights of heads above the threshold are
   rescaled; off, the model computes no such statistic and the step is unchanged.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from cursor_rl import model, partitioning
from cursor_rl.model.config import ModelConfig
from cursor_rl.train import optimizer as optim

log = logging.getLogger(__name__)

Batch = dict[str, jax.Array]
BATCH_KEYS = ("tokens", "targets", "loss_mask", "segment_ids", "positions")


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 []
    params: Any
    router: Any  # the MoE correction bias collection (not optimised)
    opt_state: Any
    skipped: jax.Array  # int32 []: updates skipped for non-finite loss or gradients

    @property
    def variables(self) -> dict[str, Any]:
        return {"params": self.params, "router": self.router}

    def train_items(self) -> dict[str, Any]:
        """What a checkpoint's ``train`` item holds (everything but the variables)."""
        return {"step": self.step, "opt_state": self.opt_state, "skipped": self.skipped}


def abstract_train_state(model_config: ModelConfig, tx, mesh, rules):
    """The train state as ShapeDtypeStructs carrying their shardings, and the shardings.

    Nothing is allocated: used to compile (also ahead of time for another topology)
    and as the restore target of checkpoints.
    """
    boxed = model.abstract_variables(model_config)
    variables = partitioning.strip_axis_metadata(boxed)
    var_sh = partitioning.tree_shardings(boxed, mesh, rules)
    opt_state = jax.eval_shape(tx.init, variables["params"])
    replicated = partitioning.replicated(mesh)
    state_sh = TrainState(
        step=replicated,
        params=var_sh["params"],
        router=var_sh.get("router", {}),
        opt_state=_follow_params(opt_state, variables["params"], var_sh["params"], replicated),
        skipped=replicated,
    )
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        TrainState(
            step=jax.ShapeDtypeStruct((), jnp.int32),
            params=variables["params"],
            router=variables.get("router", {}),
            opt_state=opt_state,
            skipped=jax.ShapeDtypeStruct((), jnp.int32),
        ),
        state_sh,
    )
    return abstract, state_sh


def _follow_params(opt_state, params, param_shardings, default):
    """Shardings for optimizer-state leaves: a moment of a parameter shards like it.

    Optax states mirror the parameter tree, so a state leaf whose key path ends with
    a parameter's key path takes that parameter's sharding: as is when the shapes
    match, with the first two axes swapped when the state holds the parameter with
    its first two axes swapped (``optimizer._experts_first``); everything else (step
    counts, scalars) gets ``default``.
    """
    by_path = {
        jax.tree_util.keystr(path): (leaf.shape, sharding)
        for (path, leaf), sharding in zip(
            jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(param_shardings)
        )
    }

    def one(path, leaf):
        key = jax.tree_util.keystr(path)
        for param_path, (shape, sharding) in by_path.items():
            if not key.endswith(param_path):
                continue
            if leaf.shape == shape:
                return sharding
            if len(shape) >= 2 and leaf.shape == (shape[1], shape[0], *shape[2:]):
                spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
                swapped = jax.sharding.PartitionSpec(spec[1], spec[0], *spec[2:])
                return jax.sharding.NamedSharding(sharding.mesh, swapped)
        return default

    return jax.tree_util.tree_map_with_path(one, opt_state)


def init_state(variables: dict[str, Any], tx: optax.GradientTransformation) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=variables["params"],
        router=variables.get("router", {}),
        opt_state=tx.init(variables["params"]),
        skipped=jnp.zeros((), jnp.int32),
    )


def token_stats(
    config: ModelConfig,
    params,
    router,
    batch: Batch,
    loss_chunk: int = 0,
    with_entropy: bool = False,
    temperature: float = 1.0,
    teacher_hidden: jax.Array | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Per-position statistics of the next-token distribution, and the model's aux outputs.

    Returns ``{"logp": log p(target) [B, T], "log_z": [B, T]}`` (+ ``"entropy"``), all
    float32. With ``teacher_hidden`` [B, T, D] (a teacher's final hidden states, one
    per position; no gradient flows into them or, through them, into the head) also
    ``"kl_teacher"``: ``KL(p_teacher || p)`` over the whole vocabulary at each position,
    the teacher's logits projected with the same head, and ``"teacher_logp"``, the
    teacher's log p(target).

    With ``loss_chunk`` the vocabulary projection runs over chunks of that
    many positions, each recomputed in backward, so float32 [B, T, V] logits never
    exist at once (vocabularies of 160K make them the largest activation). With a
    ``temperature`` the distribution is ``softmax(logits / temperature)``: the one an
    RL sampler drew from at that temperature (``cursor_rl.sampler.sampling``).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy is no distribution)")
    hidden, head, aux = model.hidden_with_aux(
        config,
        {"params": params, "router": router},
        batch["tokens"],
        batch["positions"],
        batch["segment_ids"],
    )

    def stats(h, targets, th=None):
        logits = model.project_logits(h, head)
        if temperature != 1.0:
            logits = logits / temperature
        log_z = jax.nn.logsumexp(logits, axis=-1)
        target_logit = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
        out = {"logp": target_logit - log_z, "log_z": log_z}
        if with_entropy:
            probs = jax.nn.softmax(logits, axis=-1)
            out["entropy"] = log_z - jnp.sum(probs * logits, axis=-1)
        if th is not None:
            teacher = model.project_logits(th, jax.lax.stop_gradient(head)) / temperature
            teacher_logp = jax.nn.log_softmax(jax.lax.stop_gradient(teacher), axis=-1)
            out["kl_teacher"] = jnp.sum(
                jnp.exp(teacher_logp) * (teacher_logp - (logits - log_z[..., None])), axis=-1
            )
            out["teacher_logp"] = jnp.take_along_axis(teacher_logp, targets[..., None], -1)[..., 0]
        return out

    b, t = batch["targets"].shape
    if loss_chunk and t > loss_chunk and t % loss_chunk == 0:
        n = t // loss_chunk

        def split(x):  # [B, T, ...] -> [n, B, chunk, ...]
            return jnp.moveaxis(x.reshape(b, n, loss_chunk, *x.shape[2:]), 1, 0)

        inputs = (split(hidden), split(batch["targets"]))
        if teacher_hidden is not None:
            inputs = (*inputs, split(teacher_hidden))
        out = jax.lax.map(jax.checkpoint(lambda a: stats(*a)), inputs)
        out = jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1).reshape(b, t), out)
    else:
        out = stats(hidden, batch["targets"], teacher_hidden)
    return out, aux


def token_losses(
    config: ModelConfig, params, router, batch: Batch, z_loss: float, loss_chunk: int = 0
):
    """Batch sums of masked cross-entropy and z-loss, plus the model's aux outputs."""
    stats, aux = token_stats(config, params, router, batch, loss_chunk)
    mask = batch["loss_mask"].astype(jnp.float32)
    ce_sum = -(stats["logp"] * mask).sum()
    z_sum = (jnp.square(stats["log_z"]) * mask).sum() * z_loss
    return ce_sum, z_sum, aux


def accumulate_gradients(loss_fn, params, batch: Batch, microbatches: int, max_aux: bool = False):
    """Sums ``value_and_grad(loss_fn, has_aux=True)`` over micro-batches of ``batch``.

    ``loss_fn(params, micro) -> (loss, aux)`` must return sums (or terms already
    divided by whole-batch totals), so the sum over micro-batches is exact. The
    aux pytree is summed too; with ``max_aux`` the aux is a pair whose second part
    is combined by maximum instead (the attention max logits of QK-clip). One
    compiled body runs under ``lax.scan``.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if microbatches == 1:
        (loss, aux), grads = grad_fn(params, batch)
        return loss, aux, grads
    micro_batches = jax.tree.map(
        lambda x: x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:]), batch
    )
    first = jax.tree.map(lambda x: x[0], micro_batches)
    shapes = jax.eval_shape(grad_fn, params, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    if max_aux:
        (loss0, (sums0, maxed)), grads0 = zeros
        lowest = jax.tree.map(lambda x: jnp.full(x.shape, -jnp.inf, x.dtype), maxed)
        zeros = ((loss0, (sums0, lowest)), grads0)

    def body(carry, micro):
        new = grad_fn(params, micro)
        if not max_aux:
            return jax.tree.map(jnp.add, carry, new), None
        ((loss_a, (sums_a, max_a)), grads_a), ((loss_b, (sums_b, max_b)), grads_b) = carry, new
        sums = jax.tree.map(jnp.add, sums_a, sums_b)
        maxed = jax.tree.map(jnp.maximum, max_a, max_b)
        return ((loss_a + loss_b, (sums, maxed)), jax.tree.map(jnp.add, grads_a, grads_b)), None

    ((loss, aux), grads), _ = jax.lax.scan(body, zeros, micro_batches)
    return loss, aux, grads


def apply_update(
    state: TrainState,
    grads,
    loss: jax.Array,
    expert_load: jax.Array,
    *,
    config: ModelConfig,
    tx: optax.GradientTransformation,
    moe_dropped: jax.Array | None = None,
    attn_max_logit: jax.Array | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """Optimizer update + router-bias update, skipped entirely if loss or grads are not finite.

    ``moe_dropped`` [L_moe] (assignments dropped for expert capacity) is reported as
    a fraction of all assignments. ``attn_max_logit`` [L, H] (the forward pass's
    ``attn_max_logit``) is reported, and with QK-clip on (``optim.qk_clip_tau(tx)``)
    bounds the updated query/key weights (``optim.qk_clip``).
    """
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    clip_metrics = {}
    tau = optim.qk_clip_tau(tx)
    if tau > 0 and attn_max_logit is None:
        log.warning(
            "optimizer.qk_clip_tau=%s but this step passes no attention max logits: "
            "no QK-clip in it",
            tau,
        )
    elif tau > 0:
        new_params, clipped = optim.qk_clip(config, new_params, attn_max_logit, tau)
        clip_metrics["qk_clipped_heads"] = clipped
    if attn_max_logit is not None:
        clip_metrics["attn_max_logit"] = attn_max_logit.max()
    new_router = model.update_router(config, state.router, expert_load)

    def keep_if_finite(new, old):
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

    new_state = TrainState(
        step=state.step + 1,
        params=keep_if_finite(new_params, state.params),
        router=keep_if_finite(new_router, state.router),
        opt_state=keep_if_finite(new_opt_state, state.opt_state),
        skipped=state.skipped + jnp.where(finite, 0, 1).astype(jnp.int32),
    )
    metrics = {
        "grad_norm": grad_norm,
        "skipped_steps": new_state.skipped,
        "update_skipped": jnp.logical_not(finite).astype(jnp.int32),
    }
    metrics.update(load_metrics(expert_load))
    metrics.update(clip_metrics)
    if moe_dropped is not None and expert_load.size:
        metrics["moe_dropped_fraction"] = moe_dropped.sum() / jnp.maximum(expert_load.sum(), 1.0)
    return new_state, metrics


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    config: ModelConfig,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    microbatches: int = 1,
    z_loss: float = 0.0,
    loss_chunk: int = 0,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a global batch [B, T] split into ``microbatches``."""
    num_tokens = jnp.maximum(batch["loss_mask"].astype(jnp.float32).sum(), 1.0)
    # The attention max logits, for QK-clip (or when the model config asks for them).
    with_logits = optim.qk_clip_tau(tx) > 0 or config.report_attn_max_logit
    forward_config = config.replace(report_attn_max_logit=True) if with_logits else config

    def loss_fn(params, micro):
        ce_sum, z_sum, aux = token_losses(
            forward_config, params, state.router, micro, z_loss, loss_chunk
        )
        loss = (ce_sum + z_sum) / num_tokens + aux["balance_loss"] / microbatches
        moe = (aux["expert_load"], aux["dropped"])
        sums = (ce_sum, z_sum, moe, aux["balance_loss"] / microbatches)
        return loss, ((sums, aux["attn_max_logit"]) if with_logits else sums)

    loss, aux, grads = accumulate_gradients(
        loss_fn, state.params, batch, microbatches, max_aux=with_logits
    )
    sums, max_logit = aux if with_logits else (aux, None)
    ce_sum, z_sum, (load, dropped), balance = sums
    new_state, metrics = apply_update(
        state, grads, loss, load, config=config, tx=tx, moe_dropped=dropped,
        attn_max_logit=max_logit,
    )  # fmt: skip
    metrics.update(
        {
            "loss": loss,
            "ce_loss": ce_sum / num_tokens,
            "z_loss": z_sum / num_tokens,
            "balance_loss": balance,
            "learning_rate": schedule(state.step),
            "loss_tokens": num_tokens,
        }
    )
    return new_state, metrics


def jit_train_step(
    train_config: Any,
    model_config: ModelConfig,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    state_sharding: Any,
    batch_sharding: Any,
):
    """``train_step`` jitted as the training loop runs it: the state donated, the
    batch split as ``batch_sharding`` says, microbatches, z-loss and the vocabulary
    chunk from ``train_config`` (a stage's ``train`` block). The AOT tool compiles this
    same function, so what it measures is what the loop runs."""
    return jax.jit(
        functools.partial(
            train_step,
            config=model_config,
            tx=tx,
            schedule=schedule,
            microbatches=int(train_config.microbatches),
            z_loss=float(train_config.z_loss),
            loss_chunk=int(train_config.loss_chunk_size),
        ),
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, None),
        donate_argnums=(0,),
    )


def load_metrics(load: jax.Array) -> dict[str, jax.Array]:
    """Expert-load imbalance (max/mean assignments per layer): worst and average layer."""
    if load.size == 0:
        return {}
    per_layer = load.max(-1) / jnp.maximum(load.mean(-1), 1e-9)
    return {"expert_imbalance_max": per_layer.max(), "expert_imbalance_mean": per_layer.mean()}


def eval_step(
    variables: dict[str, Any], batch: Batch, *, config: ModelConfig
) -> dict[str, jax.Array]:
    """Sums for the held-out loss: cross-entropy and loss-token count."""
    ce_sum, _, _ = token_losses(config, variables["params"], variables["router"], batch, 0.0)
    return {"ce_sum": ce_sum, "tokens": batch["loss_mask"].astype(jnp.float32).sum()}
