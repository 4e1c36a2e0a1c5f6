"""Sampler weights and front ends: trainer checkpoints across meshes, policy versions,
HF parity with transformers' generate, and the chat command."""

import io
import math
import os
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from cursor_rl import checkpoints, model, partitioning
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.sampler import Sampler, SamplingParams, chat
from cursor_rl.workdir import Workdir
from tests.test_sampler import CONFIG, SAMPLER_OPTIONS, SHARDED_OPTIONS, random_variables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RULES = partitioning.DEFAULT_RULES
GREEDY = SamplingParams(max_new_tokens=6)


@pytest.fixture(scope="module")
def tokenizer():
    text = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 20
    return Tokenizer.train([text], vocab_size=CONFIG.vocab_size)


def _metadata(step, tokenizer=None):
    tokenizer_json = None if tokenizer is None else tokenizer.to_json()
    return checkpoints.make_metadata(CONFIG, stage="rl", step=step, tokenizer_json=tokenizer_json)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (emulated) devices")
def test_restores_trainer_checkpoint_into_its_own_mesh(tmp_path, tokenizer):
    trainer_mesh = partitioning.make_mesh({"fsdp": 4, "tensor": 2})
    shardings = nn.meta.unbox(model.variable_shardings(CONFIG, trainer_mesh, RULES))
    variables = jax.device_put(random_variables(CONFIG), shardings)  # as the trainer holds them
    manager = checkpoints.CheckpointManager(str(tmp_path), async_save=False)
    manager.save(7, variables, {"step": np.int32(7)}, metadata=_metadata(7, tokenizer))
    manager.close()

    sampler_mesh = partitioning.make_mesh({"data": 2, "expert": 2, "tensor": 2})
    sampler = Sampler.from_checkpoint(str(tmp_path), mesh=sampler_mesh, **SHARDED_OPTIONS)
    assert sampler.policy_version == 7
    assert sampler.tokenizer.to_json() == tokenizer.to_json()
    restored = sampler.engine.variables
    # Every array is laid out as the sampler's mesh wants it, not as the trainer wrote it.
    wanted = nn.meta.unbox(model.variable_shardings(sampler.config, sampler_mesh, RULES))
    for array, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(wanted)):
        assert array.sharding == sharding
    expert_w = restored["params"]["moe_layers_0"]["moe"]["gate_proj"]  # unscanned: [E, D, F]
    assert expert_w.sharding.spec[0] == "expert"
    unstacked = {k: model.unstack_layers(v) for k, v in _host(variables).items()}
    for a, b in zip(jax.tree.leaves(_host(restored)), jax.tree.leaves(unstacked)):
        np.testing.assert_array_equal(a, b)


def test_refuses_a_checkpoint_of_another_shape(tmp_path):
    other = CONFIG.replace(kv_lora_rank=8)
    checkpoints.save_variables(
        str(tmp_path), random_variables(other),
        checkpoints.make_metadata(other, stage="sft"),
    )  # fmt: skip
    sampler = Sampler(CONFIG, **SAMPLER_OPTIONS)
    with pytest.raises(ValueError, match="kv_a_"):
        sampler.load_checkpoint(str(tmp_path))


@pytest.mark.slow
def test_policy_versions_swap_between_turns(tmp_path):
    policy_dir = str(tmp_path / "policy")
    v1 = random_variables(CONFIG, seed=1)
    v2 = jax.tree.map(lambda x: -x, v1)
    checkpoints.save_variables(policy_dir, v1, _metadata(1))
    sampler = Sampler(CONFIG, **SAMPLER_OPTIONS)
    sampler.watch(policy_dir, interval_s=0)
    long_turn = SamplingParams(max_new_tokens=12)

    session = sampler.open([5, 6, 7])
    sampler.submit(session, long_turn)
    assert sampler.step() == [] and sampler.policy_version == 1  # loaded before admitting
    checkpoints.save_variables(policy_dir, v2, _metadata(2))
    waiting = sampler.open([8, 9])
    sampler.submit(waiting, GREEDY)  # arrives while version 2 waits for the drain
    with pytest.raises(RuntimeError, match="between turns"):
        sampler.set_params(v2)
    done = {}
    while len(done) < 2:
        done.update((s.id, c) for s, c in sampler.step())
    assert done[session.id].policy_version == 1 and len(done[session.id].tokens) == 12
    assert done[waiting.id].policy_version == 2
    # Each turn is entirely one policy's: v2's tokens, from a prefix recomputed under v2.
    expected = Sampler(CONFIG, v2, **SAMPLER_OPTIONS).generate([[8, 9]], GREEDY)[0]
    assert done[waiting.id].tokens == expected.tokens
    sampler.append(session, [3])
    (after,) = sampler.advance([session], GREEDY)
    fresh = Sampler(CONFIG, v2, **SAMPLER_OPTIONS).generate([list(session.tokens)[:-6]], GREEDY)[0]
    assert after.policy_version == 2 and after.tokens == fresh.tokens


@pytest.mark.slow
def test_chat_streams_replies_in_the_chat_format(tmp_path, tokenizer):
    variables = random_variables(CONFIG, seed=2)
    path = checkpoints.save_variables(str(tmp_path / "sft"), variables, _metadata(3, tokenizer))
    sampler = chat.load_sampler(path, **SAMPLER_OPTIONS)
    out = io.StringIO()
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=0)
    traj = chat.chat(sampler, ["hello", "print(add(1, 2))"], out, params, system="Be brief.")
    # The trajectory holds system, user, assistant, user, assistant turns; replies were
    # sampled (mask 1, finite log-probs) and cut-off ones closed by the format.
    assert [t.role for t in traj.turns] == ["system", "user", "assistant", "user", "assistant"]
    sampled = [lp for lp, m in zip(traj.logprobs, traj.loss_mask) if m]
    assert sampled and all(math.isfinite(lp) for lp in sampled)
    replies = [
        tokenizer.decode(traj.tokens[turn.start + 1 : turn.end], skip_special=True)
        for turn in traj.turns
        if turn.role == "assistant"
    ]
    assert out.getvalue() == "".join(reply + "\n" for reply in replies)


@pytest.mark.slow
def test_chat_command_has_a_pulse(tmp_path, tokenizer):
    variables = random_variables(CONFIG, seed=3)
    workdir = tmp_path / "run"
    checkpoints.save_variables(
        Workdir(workdir).checkpoint_dir("sft"), variables, _metadata(5, tokenizer)
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "cursor_rl.sampler.chat", f"--workdir={workdir}",
         "--max_new_tokens=3", "--max_seq_len=64"],
        input="hi\n", capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "sft/checkpoints/5" in result.stdout and "policy version 5" in result.stdout


@pytest.mark.hf
@pytest.mark.slow
def test_greedy_equals_transformers_generate(tmp_path):
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    hf_config = DeepseekV3Config(
        vocab_size=61, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        max_position_embeddings=512, num_nextn_predict_layers=0, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=5000.0, factor=4.0,
                             original_max_position_embeddings=16, mscale_all_dim=1.0),
    )  # fmt: skip
    hf_config._attn_implementation = "eager"
    hf_model = DeepseekV3ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if p.ndim == 1:  # RMSNorm scales, away from 1
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:  # unit-variance activations, so every sublayer counts
                fan_in = 1 if "embed_tokens" in name else p.shape[-1]
                p.copy_(torch.randn_like(p) / math.sqrt(fan_in))
        for module in hf_model.modules():
            if hasattr(module, "e_score_correction_bias"):  # make the bias change choices
                bias = module.e_score_correction_bias
                bias.copy_(0.3 * torch.randn_like(bias))
    hf_model.save_pretrained(tmp_path)
    hf_model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    prompts = [[3, 14, 15, 9, 26, 5, 35, 8, 9, 7], [27, 18, 28]]
    sampler = Sampler.from_hf(str(tmp_path), num_slots=2, page_size=8, max_seq_len=48)
    ours = sampler.generate(prompts, SamplingParams(max_new_tokens=24))
    for prompt, completion in zip(prompts, ours):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, use_cache=True
            )
        assert completion.tokens == out[0, len(prompt) :].tolist()
