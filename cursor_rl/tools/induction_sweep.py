"""When does the model learn to copy? A bare training loop over data recipes.

    python -m cursor_rl.tools.induction_sweep --name=h --repeat_rows=0.25 --batch=32 \\
        --lr=2e-3 --max_seconds=330 --save_hf=/tmp/tiny_base_hf

Trains the tiny model (``configs/tiny.py``'s ``MODEL``) from random weights on a
mix of rows of repeated random spans (``cursor_rl.data.synthetic``) and windows of
the standard-library corpus, and logs as JSON lines, every ``--every`` steps, the
copy probe (``cursor_rl.train.copy_probe``), the held-out code loss and the tokens
seen. It is the instrument that found the tiny base's recipe: it runs many recipes
side by side on one accelerator (one process each) with nothing but the model, the
probe and an optax AdamW, so a recipe's effect is not confused with the trainer's
machinery. ``configs/tiny_base.py`` is the same recipe in the project's trainer.

What differs from the trainer (``cursor_rl.train``), on purpose:

1. **Code rows are contiguous windows** of the tokenized train split (documents
   joined with ``<|eos|>``, no segment ids): a window may cross from one file into
   the next, as in GPT-style pretraining streams. The trainer packs documents with
   segment ids instead.
2. **The router's correction bias is not updated** (the aux-loss-free balancing of
   the trainer is off); routing is learned through the router weights only.
3. **Repeat rows are token streams**: documents are laid end to end as tokens (each
   document's last token stays an input, its target masked), where
   ``data.synthetic.repeat_row`` drops that token; and a span whose document would not
   fit ends the row, so with ``--repeat_max_len`` above ``seq_len / 3`` some rows carry
   nothing. The draws are the same; the tool keeps its own writer so the shipped base's
   run is reproduced as it was.

``--save_hf`` writes the final weights as a base (``cursor_rl.bases``: bf16
safetensors, ``config.json``, the tokenizer, ``SHA256SUMS``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from cursor_rl import bases
from cursor_rl.chat.tokenizer import SPECIAL_TOKENS, Tokenizer
from cursor_rl.data import pipeline, synthetic
from cursor_rl.model import hf
from cursor_rl.model import transformer as model
from cursor_rl.train import copy_probe

_NAME = flags.DEFINE_string("name", "sweep", "Run name (tags each log line).")
_OUT = flags.DEFINE_string("out", "", "Log file (JSON lines); empty: stdout only.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "tokenizer.json; empty: train one (seed 0).")
_REPEAT_ROWS = flags.DEFINE_float("repeat_rows", 0.25, "Share of rows that are repeat rows.")
_LOW = flags.DEFINE_integer(
    "repeat_low", len(SPECIAL_TOKENS), "First id drawn for spans (default: past the specials)."
)
_MIN_LEN = flags.DEFINE_integer("repeat_min_len", 8, "Shortest repeated span.")
_MAX_LEN = flags.DEFINE_integer("repeat_max_len", 100, "Longest repeated span.")
_BATCH = flags.DEFINE_integer("batch", 32, "Rows per step.")
_SEQ = flags.DEFINE_integer("seq_len", 256, "Row length.")
_LR = flags.DEFINE_float("lr", 2e-3, "AdamW learning rate (constant after 100 warmup steps).")
_WD = flags.DEFINE_float("weight_decay", 0.0, "AdamW weight decay.")
_STEPS = flags.DEFINE_integer("steps", 30_000, "Most steps.")
_SECONDS = flags.DEFINE_float("max_seconds", 330.0, "Wall-clock limit of the training loop.")
_EVERY = flags.DEFINE_integer("every", 250, "Steps between probe/eval log lines.")
_SEED = flags.DEFINE_integer("seed", 0, "Initialisation and data seed.")
_TIED = flags.DEFINE_bool("tie_word_embeddings", False, "Tie the input and output embeddings.")
_SAVE_HF = flags.DEFINE_string("save_hf", "", "Write the final weights as a base here.")


def tokenized_split(data_config, tokenizer: Tokenizer, split: str) -> np.ndarray:
    """Every document of ``split`` tokenized and joined by ``<|eos|>`` (uint16 ids)."""
    ids: list[int] = []
    for document in pipeline.iter_documents(data_config, split=split):
        ids.extend(tokenizer.encode(document["text"]))
        ids.append(tokenizer.eos_id)
    return np.asarray(ids, np.uint16)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    sys.path.insert(0, os.getcwd())
    from configs import tiny  # the model and data config of the tiny recipe

    model_config = dataclasses.replace(tiny.MODEL, tie_word_embeddings=_TIED.value)
    data_config = pipeline.DataConfig.from_mapping(
        {k: v for k, v in tiny.get_config().data.to_dict().items() if k != "process_sharding"}
    )
    if _TOKENIZER.value:
        tokenizer = Tokenizer.load(_TOKENIZER.value)
    else:
        tokenizer = pipeline.train_tokenizer(data_config, model_config.vocab_size, seed=0)
    code = tokenized_split(data_config, tokenizer, "train").astype(np.int32)
    held_out = tokenized_split(data_config, tokenizer, "eval").astype(np.int32)
    batch, seq = _BATCH.value, _SEQ.value
    spec = synthetic.RepeatSpec(
        low=_LOW.value,
        high=tokenizer.vocab_size,
        min_len=_MIN_LEN.value,
        max_len=_MAX_LEN.value,
    )
    rng = np.random.default_rng(_SEED.value)
    log_file = open(_OUT.value, "w") if _OUT.value else None  # noqa: SIM115

    def log(**row) -> None:
        line = json.dumps({"name": _NAME.value, **row})
        print(line, flush=True)
        if log_file:
            log_file.write(line + "\n")
            log_file.flush()

    def repeat_row() -> tuple[np.ndarray, ...]:
        tokens = np.zeros(seq + 1, np.int32)
        positions = np.zeros(seq + 1, np.int32)
        segments = np.zeros(seq + 1, np.int32)
        start, segment = 0, 1
        while True:  # choice 3: a document that does not fit ends the row
            n = int(rng.integers(spec.min_len, spec.max_len + 1))
            g = int(rng.integers(0, n + 1))
            length = 2 * n + g
            if start + length > seq + 1:
                break
            span = rng.integers(spec.low, spec.high, n)
            doc = np.concatenate([span, rng.integers(spec.low, spec.high, g), span])
            tokens[start : start + length] = doc
            positions[start : start + length] = np.arange(length)
            segments[start : start + length] = segment
            start, segment = start + length, segment + 1
        return tokens, positions, segments

    def code_row() -> tuple[np.ndarray, ...]:
        i = int(rng.integers(0, len(code) - seq - 2))
        return code[i : i + seq + 1], np.arange(seq + 1), np.ones(seq + 1, np.int32)

    def make_batch():
        rows = [
            repeat_row() if rng.random() < _REPEAT_ROWS.value else code_row() for _ in range(batch)
        ]
        tokens, positions, segments = (np.stack([r[k] for r in rows]) for k in range(3))
        mask = ((segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)).astype(np.float32)
        return tokens[:, :-1], tokens[:, 1:], positions[:, :-1], segments[:, :-1], mask

    variables = model.init(model_config, jax.random.key(_SEED.value))
    params, router = variables["params"], variables["router"]
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, _LR.value, 100), optax.constant_schedule(_LR.value)], [100]
    )
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=_WD.value),
    )
    opt_state = tx.init(params)

    def loss_fn(p, tokens, targets, positions, segments, mask):
        logits = model.forward(
            model_config, {"params": p, "router": router}, tokens, positions, segments
        )
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        return (nll * mask).sum() / mask.sum()

    @jax.jit
    def train_step(p, state, *data):
        loss, grads = jax.value_and_grad(loss_fn)(p, *data)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    eval_loss = jax.jit(loss_fn)

    def code_eval() -> float:
        losses = []
        for k in range(8):  # eight fixed batches of 16 windows of the held-out split
            i = k * (len(held_out) // 8)
            t = held_out[i : i + 16 * (seq + 1)].reshape(16, seq + 1)
            pos = jnp.broadcast_to(jnp.arange(seq), (16, seq))
            ones = jnp.ones((16, seq), jnp.int32)
            losses.append(float(eval_loss(params, t[:, :-1], t[:, 1:], pos, ones, ones)))
        return float(np.mean(losses))

    start, step, formed = time.time(), 0, None
    while step < _STEPS.value and time.time() - start < _SECONDS.value:
        step += 1
        params, opt_state, loss = train_step(params, opt_state, *map(jnp.asarray, make_batch()))
        if step % _EVERY.value == 0:
            current = {"params": params, "router": router}
            probe = copy_probe.copy_score(model_config, current, **copy_probe.TRAINING_PROBE)
            row = dict(step=step, tokens=step * batch * seq, loss=float(loss))
            row.update(copy_probe=probe["copy_accuracy"], code_eval=code_eval())
            log(**row, seconds=round(time.time() - start, 1))
            if formed is None and probe["copy_accuracy"] >= 0.9:
                formed = step
                log(event="copy_probe>=0.9", step=step, tokens=step * batch * seq)
    log(event="end", step=step, seconds=round(time.time() - start, 1))
    if _SAVE_HF.value:
        host = jax.tree.map(np.asarray, {"params": params, "router": router})
        ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
               "pad_token_id": tokenizer.pad_id}  # fmt: skip
        hf.save_hf_checkpoint(
            _SAVE_HF.value, model_config, host, dtype="bfloat16", extra_config=ids
        )
        with open(bases.tokenizer_file(_SAVE_HF.value), "w", encoding="utf-8") as f:
            f.write(tokenizer.to_json())
        bases.write_sums(_SAVE_HF.value)
        log(event="saved", path=_SAVE_HF.value)


if __name__ == "__main__":
    app.run(main)
