"""Sampling parameters, completions, the in-graph token sampler and stop strings.

Which log-probability a completion carries: that of the sampled token under the
distribution it was actually drawn from, i.e. ``softmax(logits / temperature)``
renormalised over the top-k / top-p set. The RL importance ratio compares this
behaviour log-prob with the trainer's log-prob of the same token; the trainer must
therefore score with the same temperature (``log_softmax(logits / T)``), and RL
rollouts should use ``top_p=1, top_k=0`` so no truncation is left out of the
trainer's side. Greedy decoding (``temperature=0``) is not a distribution; it
reports the untempered model log-prob ``log_softmax(logits)`` of the argmax token.

Randomness: the token at sequence position ``p`` of a session is drawn with the key
``fold_in(fold_in(key(params.seed), session_seed), p)`` and Gumbel noise laid out in
vocabulary order, so it depends on neither the batch it runs in, the slot, how the
decode loop is chunked, nor whether the sequence was preempted and recomputed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

FINISH_STOP = "stop"  # a stop token or stop string was produced (and is included)
FINISH_LENGTH = "length"  # max_new_tokens reached
FINISH_CONTEXT = "context"  # the sequence reached the sampler's max_seq_len


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion (one assistant turn).

    Attributes:
      max_new_tokens: at most this many tokens are generated.
      temperature: 0 is greedy; otherwise logits are divided by it.
      top_p: nucleus sampling: keep the fewest most-likely tokens whose probability
        reaches ``top_p`` (1 keeps all).
      top_k: keep the ``top_k`` most likely tokens (0 keeps all).
      stop_token_ids: generation ends after any of these (it is included).
      stop_strings: generation ends after the token that completes any of these
        in the decoded text (needs the sampler's tokenizer; checked on the host
        after each decode call, so a few tokens past it are computed and dropped).
      seed: with the session seed and the position, fixes every random draw.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 keeps all)")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must be non-empty strings")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))


@dataclasses.dataclass(frozen=True)
class Completion:
    """One generated turn.

    Attributes:
      tokens: the generated tokens only (a final stop token included).
      logprobs: the sampler's log-prob of each token (see the module docstring).
      finish_reason: ``"stop"``, ``"length"`` (max_new_tokens) or ``"context"``
        (the sequence filled the sampler's ``max_seq_len``).
      policy_version: version of the weights that generated every token.
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int | None = None


class RowSampling(NamedTuple):
    """Per-row sampling settings, as device arrays."""

    seeds: Array  # uint32[B, 2]: (params.seed, session seed)
    temperature: Array  # float32[B]; 0 = greedy
    top_p: Array  # float32[B]
    top_k: Array  # int32[B]; 0 = no limit


def sample(logits: Array, sampling: RowSampling, positions: Array) -> tuple[Array, Array]:
    """Draws one token per row and its log-prob (see the module docstring).

    Args:
      logits: float32[B, V].
      sampling: per-row settings.
      positions: int32[B], the sequence position each drawn token will take.

    Returns:
      tokens int32[B] and their log-probs float32[B].
    """
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    greedy_logprobs = _pick(jax.nn.log_softmax(logits), greedy_tokens)

    def draw(_):
        temperature = jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)
        scaled = logits / temperature[:, None]
        keys = jax.vmap(_token_key)(sampling.seeds, positions)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[-1:]))(keys)
        needs_cut = jnp.any((sampling.top_k > 0) | (sampling.top_p < 1))
        tokens, logprobs = jax.lax.cond(
            needs_cut, _draw_truncated, _draw_full, scaled, gumbel, sampling
        )
        greedy = sampling.temperature <= 0
        return (
            jnp.where(greedy, greedy_tokens, tokens),
            jnp.where(greedy, greedy_logprobs, logprobs),
        )

    all_greedy = jnp.all(sampling.temperature <= 0)
    return jax.lax.cond(all_greedy, lambda _: (greedy_tokens, greedy_logprobs), draw, None)


def _token_key(seeds: Array, position: Array) -> Array:
    key = jax.random.fold_in(jax.random.key(seeds[0]), seeds[1])
    return jax.random.fold_in(key, position)


def _pick(values: Array, tokens: Array) -> Array:
    return jnp.take_along_axis(values, tokens[:, None], axis=-1)[:, 0]


def _draw_full(scaled, gumbel, sampling):
    """Gumbel-max over the whole vocabulary (no top-k / top-p row in the batch)."""
    del sampling
    tokens = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
    return tokens, _pick(jax.nn.log_softmax(scaled), tokens)


def _draw_truncated(scaled, gumbel, sampling):
    """Gumbel-max over each row's top-k / top-p set, in descending-probability order.

    The noise is permuted along with the logits, so a row without a cut draws the
    same token here as in ``_draw_full``.
    """
    vocab = scaled.shape[-1]
    order = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), scaled.shape)
    neg_sorted, order = jax.lax.sort((-scaled, order), num_keys=1)
    sorted_logits = -neg_sorted
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    rank = jnp.arange(vocab)[None, :]
    keep = mass_before < sampling.top_p[:, None]
    keep &= (sampling.top_k[:, None] <= 0) | (rank < sampling.top_k[:, None])
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    noise = jnp.take_along_axis(gumbel, order, axis=-1)
    choice = jnp.argmax(sorted_logits + noise, axis=-1).astype(jnp.int32)
    logprobs = _pick(jax.nn.log_softmax(sorted_logits), choice)
    return _pick(order, choice), logprobs


# ---- stop strings (host side) -------------------------------------------------------


def stop_string_cut(decode, tokens: Sequence[int], stop_strings: Sequence[str]) -> int | None:
    """Number of tokens to keep so the text ends with the first stop string, or None.

    Args:
      decode: token ids -> text (the tokenizer's ``decode``).
      tokens: the turn's generated tokens so far.
      stop_strings: the strings to stop at.

    Returns:
      The length of the shortest prefix of ``tokens`` whose text contains a stop
      string, or None when no stop string occurs.
    """
    if not stop_strings or not tokens:
        return None
    text = decode(tokens)
    if not any(s in text for s in stop_strings):
        return None
    low, high = 1, len(tokens)  # the shortest prefix containing one: binary search
    while low < high:
        mid = (low + high) // 2
        prefix = decode(tokens[:mid])
        if any(s in prefix for s in stop_strings):
            high = mid
        else:
            low = mid + 1
    return low
