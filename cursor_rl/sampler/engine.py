"""The sampler's engine: compiled prefill and decode programs over a paged latent cache.

The engine owns the device side: the weights, the page pools and two jitted
programs. The scheduler (``scheduler.py``) decides which sequence runs where and
hands the engine plain host numbers; the engine returns tokens and log-probs.

Design choices:

1. **One model.** Prefill and decode call the model's own ``forward_cached``
   (``cursor_rl.model.kv_cache``): MLA attention in the absorbed form over the
   compressed latent and the shared RoPE key, through the same parameters and
   layers as training. There is no second copy of the network.
2. **A paged latent cache.** Per layer, a pool of fixed-size pages of
   ``kv_latent`` [C] and ``k_rope`` [R] (``bytes_per_token``: C + R values per
   token and layer, against H * (Dn + R + Dv) for per-head K/V), pre-allocated
   once. A sequence owns pages in proportion to its length, so (a) a paused
   sequence (waiting on a tool) keeps its cache without holding a decode slot,
   (b) no slot reserves memory for the longest possible sequence, (c) memory
   pressure is resolved page by page (evict an idle sequence, recompute later).
   The price is a gather of each row's pages per step, done in pure JAX.
3. **Continuous batching over fixed slots.** Decode runs ``num_slots`` rows at a
   time; a finished or paused sequence frees its slot at the next call, and the
   scheduler fills it from the waiting queue.
4. **The decode loop is compiled.** One call runs up to ``decode_steps`` steps in a
   ``lax.while_loop`` with stop tokens, ``max_new_tokens`` and the context limit
   checked in the loop, and leaves early once every slot is done: on a small model
   per-step Python dispatch would cost more than the step itself. Stop strings need
   the tokenizer and are checked on the host between calls.
5. **Chunked prefill, several sequences per call.** Uncached tokens go through in
   chunks of at most ``prefill_chunk`` tokens; the chunk that ends a sequence's
   input also samples the turn's first token in the same program. ``prefill_tokens``
   caps a call's padded tokens (rows x chunk length, like vLLM's
   ``max_num_batched_tokens``): a call's attention temporaries grow with rows x
   length x cached width, and on the tiny config 32 rows of 256 at a 2,048-token
   width took 1.16 GB for 1.47 s where four calls of 8 rows took 0.29 GB each for
   the same time (2026-12-06).
6. **Bucketed shapes, a bounded set of programs.** Page-table widths, prefill rows
   and chunk lengths are rounded up to powers of two; padding is computed but never
   written to the cache. The buckets still multiply (an RL run on the tiny config
   compiled ~40 prefill and decode programs), and on XLA:CPU each compiled program
   holds ~25 MB of host memory, so ``max_programs`` bounds how many are kept: past
   it the least recently used shape is dropped (and compiled again if it returns).
7. **Sharding on the sampler's own mesh.** Rows (slots, prefill rows) and pages are
   split over the ``cache_batch`` axes; a row only uses pages of its own shard
   (local page ids), so the data-dependent gather stays on-device
   (``shard_map`` in ``paged_attention``). Weights use the model's logical rules
   on this mesh, whatever mesh the trainer used. The cache is donated to every
   call and updated in place.
8. **Sampling in the graph** (``sampling.sample``): per-row temperature, top-p,
   top-k and keys; the host sees only the chosen tokens and their log-probs.
9. **A decode-shaped model.** Weights are held unscanned by default (a scan over
   layers slices each layer's weights out of the stacked arrays every step, a
   copy on XLA:CPU; MaxText decodes unscanned too), and on CPU a decode step's
   few routed rows use the ``padded`` expert path (``decode_variant``), which
   reads expert weights in place instead of gathering them per block.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cursor_rl import model, partitioning
from cursor_rl.model import kv_cache
from cursor_rl.model.config import ModelConfig
from cursor_rl.model.transformer import STACKS
from cursor_rl.sampler import sampling as sampling_lib
from cursor_rl.sampler import weights

# Finish codes of the decode loop, in order of precedence.
_RUNNING, _STOP, _LENGTH, _CONTEXT = 0, 1, 2, 3
FINISH_NAMES = {
    _STOP: sampling_lib.FINISH_STOP,
    _LENGTH: sampling_lib.FINISH_LENGTH,
    _CONTEXT: sampling_lib.FINISH_CONTEXT,
}


class TurnSpec(NamedTuple):
    """How one row samples (host values)."""

    seeds: tuple[int, int]  # (params.seed, session seed)
    temperature: float
    top_p: float
    top_k: int
    stop_ids: tuple[int, ...]


@dataclasses.dataclass
class PrefillRow:
    """One sequence's next chunk of uncached tokens."""

    shard: int
    tokens: Sequence[int]
    start: int  # position of tokens[0]
    pages: Sequence[int]  # the sequence's local page ids, covering start + len(tokens)
    spec: TurnSpec | None  # None: not the last chunk, nothing is sampled


@dataclasses.dataclass
class DecodeSlot:
    """A running sequence in a decode slot."""

    token: int  # the last sampled token, not yet in the cache
    position: int  # its position
    pages: Sequence[int]  # local page ids covering position + the call's steps
    budget: int  # tokens it may still generate
    spec: TurnSpec


@dataclasses.dataclass
class SlotResult:
    tokens: list[int]
    logprobs: list[float]
    finish: str | None  # None: still running


class _SlotState(NamedTuple):
    token: jax.Array  # int32[S]
    position: jax.Array  # int32[S]
    active: jax.Array  # bool[S]
    budget: jax.Array  # int32[S]
    finish: jax.Array  # int32[S]


def _bucket(n: int, low: int, high: int) -> int:
    """The power of two >= n, clipped to [low, high]."""
    return min(high, max(low, 1 << max(0, math.ceil(math.log2(max(n, 1))))))


class Engine:
    """Weights, page pools and the compiled prefill/decode programs (see module doc)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        mesh: jax.sharding.Mesh | None = None,
        rules: partitioning.LogicalRules = partitioning.DEFAULT_RULES,
        num_slots: int = 8,
        max_seq_len: int | None = None,
        page_size: int = 32,
        num_pages: int | None = None,
        decode_steps: int = 32,
        prefill_chunk: int = 256,
        prefill_tokens: int = 0,
        max_programs: int = 0,
    ):
        self.config = config.validate()
        self.mesh, self.rules = mesh, rules
        self.max_seq_len = max_seq_len or config.max_position_embeddings
        self.page_size = page_size
        self.decode_steps = decode_steps
        self.prefill_chunk = prefill_chunk
        self.prefill_tokens = prefill_tokens  # per compiled call, padded (0: no cap)
        self.row_shards = 1
        if mesh is not None:
            spec = partitioning.logical_to_spec(("cache_batch",), rules)[0]
            self.row_shards = partitioning.mesh_axis_size(mesh, spec or ())
        self.max_pages = -(-self.max_seq_len // page_size)  # per sequence
        if num_pages is None:  # room for every slot at full length, plus as much for idle ones
            num_pages = 2 * num_slots * self.max_pages
        for name, value in (("num_slots", num_slots), ("num_pages", num_pages)):
            if value % self.row_shards:
                raise ValueError(
                    f"sampler.{name}={value} must divide over the {self.row_shards} row shards"
                )
        self.num_slots = num_slots
        self.pages_per_shard = num_pages // self.row_shards
        if self.pages_per_shard < self.max_pages:
            raise ValueError(
                f"sampler.num_pages={num_pages} leaves {self.pages_per_shard} pages per shard; "
                f"one sequence of max_seq_len={self.max_seq_len} needs {self.max_pages}"
            )
        self.cache = kv_cache.init_cache(config, num_pages, page_size, mesh, rules)
        self.variables: dict[str, Any] | None = None
        # Prefill and decode each keep up to max_programs compiled shapes (0: all).
        limits = (self.max_seq_len, decode_steps, max_programs)
        self._prefill = _programs(config, mesh, rules, "prefill", *limits)
        self._decode = _programs(decode_variant(config), mesh, rules, "decode", *limits)

    # ---- weights ----------------------------------------------------------------

    def variable_shardings(self):
        """NamedShardings of the variables on this mesh (None without a mesh)."""
        if self.mesh is None:
            return None
        return weights.variable_shardings(self.config, self.mesh, self.rules)

    def set_variables(self, variables: Mapping[str, Any]) -> None:
        """Places variables in this engine's layout and shardings (no-op if already so)."""
        variables = {k: variables[k] for k in ("params", "router") if k in variables}
        scanned = any(stack in variables["params"] for stack in STACKS)
        if scanned != self.config.scan_layers:
            convert = model.stack_layers if self.config.scan_layers else model.unstack_layers
            variables = {k: convert(v) for k, v in variables.items()}
        shardings = self.variable_shardings()
        if shardings is None:
            self.variables = jax.device_put(variables)
        else:
            self.variables = jax.device_put(variables, {k: shardings[k] for k in variables})

    # ---- programs ---------------------------------------------------------------

    def _run(self, fn, *args):
        if self.variables is None:
            raise RuntimeError("the sampler has no weights: call set_params or load_checkpoint")
        if self.mesh is None:
            return fn(self.variables, self.cache, *args)
        with partitioning.use_mesh(self.mesh, self.rules):
            return fn(self.variables, self.cache, *args)

    def _width(self, needed_positions: int) -> int:
        pages = -(-needed_positions // self.page_size)
        return _bucket(pages, 1, self.max_pages)

    def chunk_length(self, tokens: int) -> int:
        """The padded length of a prefill call whose longest chunk has ``tokens``."""
        # Chunks shorter than 32 tokens share one program: their cost is dispatch, not FLOPs.
        return _bucket(tokens, 32, self.prefill_chunk)

    def prefill(self, rows: Sequence[PrefillRow]) -> list[tuple[int, float] | None]:
        """Writes one chunk per row into the cache; samples where ``spec`` is given.
        The rows go through in the calls of ``prefill_calls``.

        Returns:
          Per row, (token, log-prob) of the sampled token, or None.
        """
        results = []
        for call in self.prefill_calls(rows):
            results += self._prefill_call(call)
        return results

    def prefill_calls(self, rows: Sequence[PrefillRow]) -> list[list[PrefillRow]]:
        """``rows`` in order, split into calls of at most ``prefill_tokens`` padded
        tokens (rows x the call's chunk length; note 5); a row alone may exceed it."""
        calls: list[list[PrefillRow]] = []
        call: list[PrefillRow] = []
        longest = 0
        for row in rows:
            length = self.chunk_length(max(longest, len(row.tokens)))
            if call and self.prefill_tokens and (len(call) + 1) * length > self.prefill_tokens:
                calls.append(call)
                call, longest = [], 0
            call.append(row)
            longest = max(longest, len(row.tokens))
        return [*calls, call] if call else calls

    def _prefill_call(self, rows: Sequence[PrefillRow]) -> list[tuple[int, float] | None]:
        per_shard = [0] * self.row_shards
        for r in rows:
            per_shard[r.shard] += 1
        rows_per_shard = _bucket(max(per_shard), 1, self.num_slots // self.row_shards)
        length = self.chunk_length(max(len(r.tokens) for r in rows))
        width = self._width(max(r.start + len(r.tokens) for r in rows))
        b = rows_per_shard * self.row_shards
        tokens = np.zeros((b, length), np.int32)
        positions = np.zeros((b, length), np.int32)
        valid = np.zeros((b, length), bool)
        page_table = np.zeros((b, width), np.int32)
        last = np.zeros((b,), np.int32)
        specs = [None] * b
        ranks = [0] * self.row_shards
        index = []
        for r in rows:
            i = r.shard * rows_per_shard + ranks[r.shard]
            ranks[r.shard] += 1
            n = len(r.tokens)
            tokens[i, :n] = r.tokens
            positions[i] = r.start + np.arange(length)
            valid[i, :n] = True
            pages = r.pages[:width]
            page_table[i, : len(pages)] = pages
            last[i] = n - 1
            specs[i] = r.spec
            index.append(i)
        step = kv_cache.CachedStep(positions, valid, page_table, last)
        program = self._prefill.get((b, length, width))
        self.cache, (token, logprob) = self._run(program, tokens, step, _row_sampling(specs))
        token, logprob = np.asarray(token), np.asarray(logprob)
        return [
            None if r.spec is None else (int(token[i]), float(logprob[i]))
            for r, i in zip(rows, index)
        ]

    def decode(self, slots: Mapping[int, DecodeSlot], num_steps: int) -> dict[int, SlotResult]:
        """Runs up to ``num_steps`` decode steps for the occupied slots (slot -> state)."""
        num_steps = min(num_steps, self.decode_steps)
        s = self.num_slots
        width = self._width(max(d.position + num_steps for d in slots.values()))
        state = _SlotState(
            np.zeros(s, np.int32),
            np.zeros(s, np.int32),
            np.zeros(s, bool),
            np.zeros(s, np.int32),
            np.zeros(s, np.int32),
        )
        page_table = np.zeros((s, width), np.int32)
        specs: list[TurnSpec | None] = [None] * s
        for i, d in slots.items():
            state.token[i], state.position[i], state.budget[i] = d.token, d.position, d.budget
            state.active[i] = True
            pages = d.pages[:width]  # entries past a row's pages are never read (causal mask)
            page_table[i, : len(pages)] = pages
            specs[i] = d.spec
        num_stops = _bucket(max(len(d.spec.stop_ids) for d in slots.values()), 4, 1 << 20)
        stop_ids = np.full((s, num_stops), -1, np.int32)
        for i, d in slots.items():
            stop_ids[i, : len(d.spec.stop_ids)] = d.spec.stop_ids
        self.cache, (final, out_tokens, out_logprobs) = self._run(
            self._decode.get((width, num_stops)),
            state,
            page_table,
            _row_sampling(specs),
            stop_ids,
            np.int32(num_steps),
        )
        finish = np.asarray(final.finish)
        out_tokens, out_logprobs = np.asarray(out_tokens), np.asarray(out_logprobs)
        results = {}
        for i in slots:
            made = out_tokens[i] >= 0
            results[i] = SlotResult(
                out_tokens[i][made].tolist(),
                out_logprobs[i][made].tolist(),
                FINISH_NAMES.get(int(finish[i])),
            )
        return results


def _row_sampling(specs: Sequence[TurnSpec | None]) -> sampling_lib.RowSampling:
    """Host arrays of per-row settings; rows without a spec are greedy."""
    b = len(specs)
    out = sampling_lib.RowSampling(
        np.zeros((b, 2), np.uint32),
        np.zeros(b, np.float32),
        np.ones(b, np.float32),
        np.zeros(b, np.int32),
    )
    for i, spec in enumerate(specs):
        if spec is not None:
            out.seeds[i] = [s % 2**32 for s in spec.seeds]
            out.temperature[i], out.top_p[i], out.top_k[i] = (
                spec.temperature,
                spec.top_p,
                spec.top_k,
            )
    return out


# ---- the compiled programs ----------------------------------------------------------


def decode_variant(config: ModelConfig) -> ModelConfig:
    """The config decode steps run with: ``padded`` experts on CPU unless chosen.

    A decode step routes only ``num_slots * k`` rows; ``blocked`` would copy expert
    weights per block of a few rows, ``padded`` reads them in place (moe.py).
    Prefill chunks have many rows and keep the configured implementation.
    """
    if config.moe_impl == "auto" and jax.default_backend() == "cpu":
        return config.replace(moe_impl="padded")
    return config


class _Programs:
    """One kind's compiled programs by argument-shape bucket, the least recently used
    dropped past ``limit`` (0: none dropped). Each bucket gets its own ``jax.jit`` of a
    fresh closure, so dropping it drops its executable from JAX's caches too (a shape of
    one shared jitted function would stay cached for the life of the function)."""

    def __init__(self, make: Callable[[], Callable], limit: int):
        self._make = make
        self._by_shape: collections.OrderedDict[tuple, Callable] = collections.OrderedDict()
        self.limit = limit
        self.compiles = 0  # programs built, a dropped shape counted again when rebuilt

    def get(self, shape: tuple) -> Callable:
        program = self._by_shape.pop(shape, None)
        if program is None:
            program = self._make()
            self.compiles += 1
            while self.limit and len(self._by_shape) >= self.limit:
                self._by_shape.popitem(last=False)
        self._by_shape[shape] = program
        return program

    def __len__(self) -> int:
        return len(self._by_shape)


@functools.cache
def _programs(
    config, mesh, rules, kind: str, max_seq_len: int, decode_steps: int, max_programs: int
) -> _Programs:
    """The jitted programs, shared by engines of the same model, mesh and limits.

    Arguments are (variables, cache, *row_args[, num_steps]); each row argument is a
    pytree whose leaves all lead with the row axis. The cache is donated.
    """

    def make():
        if kind == "prefill":
            program, row_args, scalar_args = _prefill_program(config), 3, 0
        else:
            program = _decode_program(config, max_seq_len, decode_steps)
            row_args, scalar_args = 4, 1
        if mesh is None:
            return jax.jit(program, donate_argnums=(1,))
        row = partitioning.logical_sharding(("cache_batch",), mesh, rules)
        cache = kv_cache.cache_shardings(config, mesh, rules)
        variables = weights.variable_shardings(config, mesh, rules)
        replicated = partitioning.replicated(mesh)
        in_shardings = (variables, cache) + (row,) * row_args + (replicated,) * scalar_args
        return jax.jit(
            program, in_shardings=in_shardings, out_shardings=(cache, row), donate_argnums=(1,)
        )

    return _Programs(make, max_programs)


def _prefill_program(config: ModelConfig):
    def run(variables, cache, tokens, step, row_sampling):
        logits, cache = model.forward_cached(config, variables, tokens, cache, step)
        position = jnp.take_along_axis(step.positions, step.last[:, None], axis=1)[:, 0] + 1
        return cache, sampling_lib.sample(logits, row_sampling, position)

    return run


def _decode_program(config: ModelConfig, max_seq_len: int, max_steps: int):
    def run(variables, cache, state, page_table, row_sampling, stop_ids, num_steps):
        num_slots = state.token.shape[0]
        out_tokens = jnp.full((num_slots, max_steps), -1, jnp.int32)
        out_logprobs = jnp.zeros((num_slots, max_steps), jnp.float32)
        first = jnp.zeros((num_slots,), jnp.int32)

        def cond(carry):
            i, state, *_ = carry
            return (i < num_steps) & jnp.any(state.active)

        def body(carry):
            i, state, cache, out_tokens, out_logprobs = carry
            active = state.active
            step = kv_cache.CachedStep(state.position[:, None], active[:, None], page_table, first)
            logits, cache = model.forward_cached(
                config, variables, state.token[:, None], cache, step
            )
            token, logprob = sampling_lib.sample(logits, row_sampling, state.position + 1)
            out_tokens = out_tokens.at[:, i].set(jnp.where(active, token, -1))
            out_logprobs = out_logprobs.at[:, i].set(jnp.where(active, logprob, 0.0))
            budget = state.budget - active
            # The sequence now holds position + 2 tokens; the new one is not cached.
            reason = jnp.select(
                [
                    jnp.any(token[:, None] == stop_ids, axis=-1),
                    budget <= 0,
                    state.position + 2 >= max_seq_len,
                ],
                [_STOP, _LENGTH, _CONTEXT],
                _RUNNING,
            )
            finish = jnp.where(active, reason, state.finish)
            state = _SlotState(
                jnp.where(active, token, state.token),
                jnp.where(active, state.position + 1, state.position),
                active & (reason == _RUNNING),
                budget,
                finish,
            )
            return i + 1, state, cache, out_tokens, out_logprobs

        carry = (jnp.int32(0), state, cache, out_tokens, out_logprobs)
        _, state, cache, out_tokens, out_logprobs = jax.lax.while_loop(cond, body, carry)
        return cache, (state, out_tokens, out_logprobs)

    return run
