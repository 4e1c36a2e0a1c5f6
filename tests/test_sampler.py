"""Sampler correctness against the full forward pass: greedy, log-probs, batching, sessions.

One tiny model and a few shared samplers, so each compiled program is built once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cursor_rl import model, partitioning
from cursor_rl.model import kv_cache, moe
from cursor_rl.model.config import ModelConfig
from cursor_rl.sampler import Sampler, SamplingParams

CONFIG = ModelConfig(
    vocab_size=300,  # room for test_sampler_io's tokenizer (12 special + 256 bytes + merges)
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_layers=2,
    num_heads=4,
    q_lora_rank=12,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense=1,
    routed_scaling_factor=2.0,
    moe_block_size=8,
    max_position_embeddings=64,
)
MAX_LEN = 64  # the reference forward pads every sequence to this length
PROMPTS = [[3, 17, 5, 9, 40, 2, 11], [7], [12, 33, 1, 1, 60, 21, 8, 4, 30, 6, 50, 2, 9, 19], [5, 5]]
TOL = 2e-5  # float32 log-probs: absorbed vs. expanded attention differ by rounding only

reference_forward = jax.jit(model.forward, static_argnums=0)


def random_variables(config, seed=0):
    """Random variables of ``config`` without compiling an init (host NumPy arrays).

    Activations of order one and a random router bias: the logits spread, so float
    rounding cannot flip an argmax, and the bias changes expert choices.
    """
    rng = np.random.default_rng(seed)
    abstract = partitioning.strip_axis_metadata(model.abstract_variables(config))

    def draw(path, x):
        name = jax.tree_util.keystr(path)
        noise = rng.standard_normal(x.shape)
        if "scale" in name:  # RMSNorm gains, away from 1
            return (1 + 0.2 * noise).astype(x.dtype)
        if "bias" in name or "embed" in name:
            return noise.astype(x.dtype)
        # Kernels [layers, in, ...] or [in, out]: std 1/sqrt(in) keeps activations O(1).
        fan_in = x.shape[1] if "layers" in name else x.shape[0]
        return (noise / np.sqrt(fan_in)).astype(x.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)


@pytest.fixture(scope="module")
def variables():
    return random_variables(CONFIG)


# Options of every unsharded sampler in the sampler tests, so each compiled program is
# built once (test_sampler_io uses them too): 2 slots for 4 prompts, so every generate
# call batches continuously; a 16-token prefill chunk splits the longer prompts; 2
# pages of 32 tokens hold one sequence of MAX_LEN, so two running sequences past 32
# tokens force preemptions, and idle sessions are evicted.
SAMPLER_OPTIONS = dict(num_slots=2, page_size=32, num_pages=2, decode_steps=8, prefill_chunk=16)


# 4 slots and 8 pages: one slot and two pages per row shard of the meshes used here.
SHARDED_OPTIONS = {**SAMPLER_OPTIONS, "num_slots": 4, "num_pages": 8}


@pytest.fixture(scope="module")
def sampler(variables):
    return Sampler(CONFIG, variables, tokenizer=_Letters(), **SAMPLER_OPTIONS)


def _log_softmax_rows(variables, sequence, temperature=1.0):
    """Full-forward log_softmax(logits / T) [len(sequence), V] (padded to MAX_LEN)."""
    padded = np.zeros((1, MAX_LEN), np.int32)
    padded[0, : len(sequence)] = sequence
    logits = reference_forward(CONFIG, variables, jnp.asarray(padded))[0, : len(sequence)]
    return np.asarray(jax.nn.log_softmax(logits / temperature))


def _check_against_forward(variables, prompt, completion, temperature=0.0):
    """Every generated token is the argmax (greedy) and carries the forward's log-prob."""
    sequence = list(prompt) + completion.tokens
    logp = _log_softmax_rows(variables, sequence, temperature or 1.0)
    steps = np.arange(len(prompt) - 1, len(sequence) - 1)
    if temperature == 0:
        np.testing.assert_array_equal(completion.tokens, logp[steps].argmax(-1))
    np.testing.assert_allclose(
        completion.logprobs, logp[steps, completion.tokens], atol=TOL, rtol=0
    )


@pytest.mark.slow
def test_forward_cached_chunks_equal_full_forward(variables):
    """Model level: chunked prefill then decode through the pages == one full forward."""
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 13), 0, CONFIG.vocab_size))
    full = reference_forward(CONFIG, variables, jnp.asarray(tokens))
    cache = kv_cache.init_cache(CONFIG, num_pages=8, page_size=4)
    page_table = np.array([[6, 1, 4, 3], [0, 7, 2, 5]], np.int32)  # scattered pages
    run = jax.jit(model.forward_cached, static_argnums=0)
    start = 0
    for length in (5, 4, 1, 1, 1, 1):  # two prefill chunks of 4 + padding, then decode
        width = 8 if length > 1 else 1
        chunk = np.zeros((2, width), np.int32)
        chunk[:, :length] = tokens[:, start : start + length]
        positions = np.broadcast_to(start + np.arange(width), (2, width)).astype(np.int32)
        valid = np.broadcast_to(np.arange(width) < length, (2, width))
        last = np.full((2,), length - 1, np.int32)
        step = kv_cache.CachedStep(positions, valid, page_table, last)
        logits, cache = run(CONFIG, variables, chunk, cache, step)
        np.testing.assert_allclose(logits, full[:, start + length - 1], atol=1e-4, rtol=1e-5)
        start += length


@pytest.mark.parametrize("sizes", [[7, 0, 11, 1], [1, 0, 1, 0], [30, 2, 0, 30]])
def test_padded_experts_equal_ragged(sizes):
    """The decode-step expert path (each expert padded to one capacity) is exact."""
    rng = np.random.default_rng(0)
    rows = sum(sizes) + 2  # two trailing rows outside every group
    xs = jnp.asarray(rng.normal(size=(rows, 6)), jnp.float32)
    wg, wu = (jnp.asarray(rng.normal(size=(4, 6, 5)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(4, 5, 6)), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    padded = jax.jit(moe._swiglu_padded)(xs, group_sizes, wg, wu, wd)
    np.testing.assert_allclose(
        padded, moe._swiglu_ragged(xs, group_sizes, wg, wu, wd), atol=1e-5, rtol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(padded[-2:]), 0)


def test_cache_bytes_per_token():
    sizes = kv_cache.bytes_per_token(CONFIG)
    assert sizes["latent"] == 2 * (16 + 4) * 4
    assert sizes["naive_per_head_kv"] == 2 * 4 * (8 + 4 + 8) * 4


@pytest.mark.slow
def test_greedy_equals_full_forward(sampler, variables):
    completions = sampler.generate(PROMPTS, SamplingParams(max_new_tokens=20))
    for prompt, completion in zip(PROMPTS, completions):
        assert completion.finish_reason == "length" and len(completion.tokens) == 20
        assert completion.policy_version == 0
        _check_against_forward(variables, prompt, completion)


@pytest.mark.slow
def test_prefill_token_cap_splits_calls_and_keeps_tokens(variables):
    """prefill_tokens=16 admits one row of a 16-token chunk (the tests' prefill_chunk)
    per call: prefills that would batch both slots are split, and the tokens are still
    greedy decoding against the full forward."""
    capped = Sampler(CONFIG, variables, prefill_tokens=16, **SAMPLER_OPTIONS)
    calls = []
    engine_call = capped.engine._prefill_call
    capped.engine._prefill_call = lambda rows: calls.append(len(rows)) or engine_call(rows)
    completions = capped.generate(PROMPTS, SamplingParams(max_new_tokens=20))
    for prompt, completion in zip(PROMPTS, completions):
        _check_against_forward(variables, prompt, completion)
    assert calls and max(calls) == 1
    # Uncapped, the same prompts prefill two rows in one call.
    uncapped = Sampler(CONFIG, variables, **SAMPLER_OPTIONS)
    calls.clear()
    engine_call = uncapped.engine._prefill_call
    uncapped.engine._prefill_call = lambda rows: calls.append(len(rows)) or engine_call(rows)
    uncapped.generate(PROMPTS, SamplingParams(max_new_tokens=20))
    assert max(calls) == 2


@pytest.mark.slow
def test_bounded_programs_drop_and_rebuild_shapes(variables):
    """With max_programs=1 each kind keeps one compiled shape: generating needs several
    (prefill rows and lengths, decode widths), so the older ones are dropped, and the
    tokens are still greedy decoding against the full forward."""
    bounded = Sampler(CONFIG, variables, max_programs=1, **SAMPLER_OPTIONS)
    completions = bounded.generate(PROMPTS, SamplingParams(max_new_tokens=20))
    for prompt, completion in zip(PROMPTS, completions):
        _check_against_forward(variables, prompt, completion)
    prefill, decode = bounded.engine._prefill, bounded.engine._decode
    assert (len(prefill), len(decode)) == (1, 1)
    assert prefill.compiles > 1 and decode.compiles > 1  # several shapes were built


@pytest.mark.slow
def test_mixed_lengths_equal_rows_alone(sampler):
    params = SamplingParams(max_new_tokens=9, temperature=0.8, seed=4)
    together = [sampler.open(p, seed=10 + i) for i, p in enumerate(PROMPTS)]
    batch = sampler.advance(together, params)
    for i, prompt in enumerate(PROMPTS):
        alone = sampler.open(prompt, seed=10 + i)
        (single,) = sampler.advance([alone], params)
        assert single.tokens == batch[i].tokens
        np.testing.assert_allclose(single.logprobs, batch[i].logprobs, atol=TOL)
        sampler.close(alone)
    for session in together:
        sampler.close(session)


@pytest.mark.slow
def test_temperature_logprobs_are_the_sampled_distribution(sampler, variables):
    """At temperature T the log-prob is log_softmax(logits / T) at the drawn token."""
    completions = sampler.generate(PROMPTS[:2], SamplingParams(12, temperature=0.7, seed=1))
    for prompt, completion in zip(PROMPTS, completions):
        _check_against_forward(variables, prompt, completion, temperature=0.7)


def test_seeded_sampling_is_reproducible(sampler):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=20, seed=7)
    first = sampler.generate(PROMPTS, params)
    again = sampler.generate(PROMPTS, params)
    other = sampler.generate(PROMPTS, SamplingParams(10, temperature=1.0, top_p=0.9, seed=8))
    assert [c.tokens for c in first] == [c.tokens for c in again]
    assert [c.logprobs for c in first] == [c.logprobs for c in again]
    assert [c.tokens for c in first] != [c.tokens for c in other]
    # Truncation renormalises: each sampled token's probability is at least its
    # untruncated one, so the log-probs are <= 0 and finite.
    assert all(np.isfinite(c.logprobs).all() and max(c.logprobs) <= 0 for c in first)


def test_top_k_one_and_tiny_top_p_are_greedy(sampler):
    greedy = sampler.generate(PROMPTS[:2], SamplingParams(max_new_tokens=6))
    for params in (
        SamplingParams(6, temperature=1.5, top_k=1, seed=3),
        SamplingParams(6, temperature=1.5, top_p=1e-6, seed=3),
    ):
        cut = sampler.generate(PROMPTS[:2], params)
        assert [c.tokens for c in cut] == [c.tokens for c in greedy]
        # The kept set is one token: probability 1 under the sampled distribution.
        np.testing.assert_allclose([c.logprobs for c in cut], 0.0, atol=1e-6)


def test_continuation_equals_fresh_prefill(sampler):
    params = SamplingParams(max_new_tokens=6)
    session = sampler.open(PROMPTS[0])
    (first,) = sampler.advance([session], params)
    tool_result = [44, 45, 46, 47, 48]
    sampler.append(session, tool_result)
    cached_before = session.num_cached
    (second,) = sampler.advance([session], params)
    # The prefix stayed cached: only the uncached tail was prefilled.
    assert cached_before == len(PROMPTS[0]) + len(first.tokens) - 1
    fresh = sampler.open(PROMPTS[0] + first.tokens + tool_result)
    (expected,) = sampler.advance([fresh], params)
    assert second.tokens == expected.tokens
    np.testing.assert_allclose(second.logprobs, expected.logprobs, atol=TOL)
    for s in (session, fresh):
        sampler.close(s)


def test_stop_ids_strings_and_budgets(sampler):
    greedy = sampler
    (free,) = greedy.generate(PROMPTS[:1], SamplingParams(max_new_tokens=12))
    stops = (free.tokens[4], 63)
    cut = min(i for i, t in enumerate(free.tokens) if t in stops) + 1
    (stopped,) = greedy.generate(PROMPTS[:1], SamplingParams(12, stop_token_ids=stops))
    assert stopped.tokens == free.tokens[:cut] and stopped.finish_reason == "stop"
    assert stopped.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-6)
    # A stop string that ends inside the 6th token's text: keep through that token.
    text = _Letters().decode(free.tokens)
    (by_string,) = greedy.generate(PROMPTS[:1], SamplingParams(12, stop_strings=(text[4:6],)))
    assert by_string.finish_reason == "stop"
    assert by_string.tokens == free.tokens[: text.index(text[4:6]) + 2]
    # The first token (sampled by the prefill) already hits the budget or a stop.
    (one,) = greedy.generate(PROMPTS[:1], SamplingParams(1))
    assert one.tokens == free.tokens[:1] and one.finish_reason == "length"
    (first_stop,) = greedy.generate(PROMPTS[:1], SamplingParams(5, stop_token_ids=free.tokens[:1]))
    assert first_stop.tokens == free.tokens[:1] and first_stop.finish_reason == "stop"


@pytest.mark.slow
def test_context_limit(sampler):
    prompt = list(range(1, 61))  # 60 of the 64 positions
    (c,) = sampler.generate([prompt], SamplingParams(max_new_tokens=20))
    assert c.finish_reason == "context" and len(prompt) + len(c.tokens) == MAX_LEN
    (full,) = sampler.generate([list(range(64))], SamplingParams(max_new_tokens=3))
    assert full.tokens == [] and full.finish_reason == "context"


def test_continuous_batching_with_preemption_equals_one_by_one(sampler):
    """More requests than slots and too few pages: evictions and preemptions happen."""
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=5)
    before = sampler.stats
    squeezed = sampler.generate(PROMPTS, params)
    after = sampler.stats
    assert after["preemptions"] > before["preemptions"]
    assert after["evictions"] > before["evictions"]
    for i, prompt in enumerate(PROMPTS):
        alone = sampler.open(prompt, seed=i)
        (expected,) = sampler.advance([alone], params)
        sampler.close(alone)
        assert squeezed[i].tokens == expected.tokens
        np.testing.assert_allclose(squeezed[i].logprobs, expected.logprobs, atol=TOL)


def test_paused_sessions_keep_cache_without_a_slot(sampler):
    sessions = [sampler.open(p) for p in PROMPTS[:2]]
    sampler.advance(sessions, SamplingParams(max_new_tokens=3))
    # Both wait for their tools: no slot held, the whole prefix but the last token cached.
    assert sampler._scheduler.num_running == 0
    assert all(s.state == "idle" and s.num_cached == len(s.tokens) - 1 for s in sessions)
    for s in sessions:
        sampler.close(s)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (emulated) devices")
@pytest.mark.slow
def test_sharded_sampler_equals_unsharded(sampler, variables):
    mesh = partitioning.make_mesh({"data": 2, "expert": 2, "tensor": 2})
    sharded = Sampler(CONFIG, variables, mesh=mesh, **SHARDED_OPTIONS)
    layer = sharded.engine.variables["params"]["moe_layers_0"]
    assert layer["moe"]["gate_proj"].sharding.spec[0] == "expert"
    pool = sharded.engine.cache["moe_layers"].kv_latent  # [L, P, page, C]: pages over 4 shards
    assert pool.addressable_shards[0].data.shape[1] == pool.shape[1] // 4
    for params in (SamplingParams(15), SamplingParams(15, temperature=1.0, top_k=8, seed=2)):
        expected = sampler.generate(PROMPTS, params)
        got = sharded.generate(PROMPTS, params)
        for e, g in zip(expected, got):
            assert g.tokens == e.tokens
            # Tensor-parallel partial sums and the expert all-to-all reorder float32
            # accumulations: agreement to float32 rounding of the logits.
            np.testing.assert_allclose(g.logprobs, e.logprobs, rtol=1e-4, atol=TOL)


class _Letters:
    """A stand-in tokenizer: token i is the letter i mod 26."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)
