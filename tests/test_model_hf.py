"""Hugging Face interop: parity with transformers' DeepseekV3ForCausalLM, export, loader errors.

Tiny random HF models are built locally (no hub downloads). Parity and export tests
need torch + transformers (``hf`` mark); the round-trip and error tests do not.
"""

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from cursor_rl import model
from cursor_rl.model import hf, hf_mapping
from cursor_rl.model.config import ModelConfig, RopeScaling

forward = jax.jit(model.forward, static_argnums=0)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOL = 1e-4  # float32 logits, max abs error
BATCH, LENGTH = 2, 8
# Positions past the YaRN original contexts (64 and 128 below), so the interpolated
# frequencies and the ramp matter.
POSITION_OFFSET = 300

# Tiny DeepseekV3Config fields shared by the parity configs.
HF_BASE = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=512,
    num_nextn_predict_layers=0,
)
# Each flips several options against the first; together they cover q_lora on/off,
# YaRN off/on (both cos/sin amplitude branches, truncate on/off, legacy and
# transformers-5 config formats), n_group/topk_group > 1, first_k_dense 0 and 1,
# norm_topk_prob on/off, rope_interleave on/off, tied embeddings and a non-default
# rms_norm_eps.
PARITY = {
    "plain": dict(
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        rope_interleave=True,
    ),
    "yarn_groups": dict(
        q_lora_rank=12,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=0,
        norm_topk_prob=False,
        rope_interleave=False,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=5000.0,
            factor=4.0,
            original_max_position_embeddings=128,
            mscale=1.0,
            mscale_all_dim=1.0,
            truncate=False,
        ),
    ),
    # Written back as a published Kimi-K2 config.json: model_type kimi_k2, legacy
    # rope_scaling + top-level rope_theta, no rope_interleave (default True).
    "kimi_legacy": dict(
        q_lora_rank=12,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        rope_interleave=True,
        tie_word_embeddings=True,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=50000.0,
            factor=8.0,
            original_max_position_embeddings=64,
            beta_fast=1.0,
            beta_slow=1.0,
            mscale_all_dim=0.8,
        ),
    ),
    # rms_norm_eps=1e-5 for the layer and final norms; transformers' latent norms
    # (q_a_layernorm, kv_a_layernorm) keep eps 1e-6 whatever the config says.
    "eps_1e5": dict(
        q_lora_rank=12,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        rope_interleave=True,
        rms_norm_eps=1e-5,
    ),
}
# Factor on the latent projections' weights (q_a_proj, and kv_a_proj's latent part):
# latents with a mean square near 1e-5 make the latent norms' eps matter far beyond
# TOL (with unit latents, eps 1e-5 instead of 1e-6 moves the logits by only ~7e-5).
LATENT_SCALE = {"eps_1e5": 3e-3}


def _inputs(vocab_size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, (BATCH, LENGTH)).astype(np.int32)
    positions = np.broadcast_to(np.arange(LENGTH, dtype=np.int32) + POSITION_OFFSET, tokens.shape)
    return tokens, np.ascontiguousarray(positions)


def _max_error(config: ModelConfig, variables, expected: np.ndarray) -> float:
    tokens, positions = _inputs(config.vocab_size)
    logits = np.asarray(forward(config, variables, tokens, positions))
    assert logits.shape == expected.shape
    return float(np.max(np.abs(logits - expected)))


# Our own tiny config, for round trips and error cases.
TINY = ModelConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    moe_intermediate_size=8,
    num_layers=3,
    num_heads=2,
    q_lora_rank=8,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=4,
    n_routed_experts=4,
    n_group=2,
    topk_group=1,
    first_k_dense=1,
    rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=64, mscale_all_dim=1.0),
)


def _random_variables(config: ModelConfig, seed: int = 0, latent_scale: float = 1.0):
    """Random numpy variables for ``config``, scaled like ``_hf_model``'s weights."""
    rng = np.random.default_rng(seed)
    flat = {}
    for key, (shape, dtype) in hf_mapping.model_shapes(config).items():
        if key.endswith("scale"):
            value = 1 + 0.3 * rng.standard_normal(shape)
        elif key.startswith("router/"):
            value = 0.3 * rng.standard_normal(shape)
        else:
            std = 1 if key == "params/embed" else config.hidden_size**-0.5
            value = std * rng.standard_normal(shape)
        if key.endswith("/q_a_proj"):  # see LATENT_SCALE
            value *= latent_scale
        elif key.endswith("/kv_a_proj"):
            value[..., : config.kv_lora_rank] *= latent_scale
        flat[key] = value.astype(dtype)
    return hf_mapping.unflatten_variables(flat)


def _assert_same(a, b):
    flat_a, flat_b = dict(hf_mapping.flatten_variables(a)), dict(hf_mapping.flatten_variables(b))
    assert flat_a.keys() == flat_b.keys()
    for key in flat_a:
        np.testing.assert_array_equal(flat_a[key], flat_b[key], err_msg=key)


# ---- transformers side ----------------------------------------------------------------


def _hf_model(name: str):
    """A random DeepseekV3ForCausalLM whose weights make every sublayer count."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(sum(map(ord, name)))
    config = DeepseekV3Config(**HF_BASE, **PARITY[name])
    config._attn_implementation = "eager"
    hf_model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for param_name, p in hf_model.named_parameters():
            if p.ndim == 1:  # RMSNorm scales: away from 1 so a swapped norm shows
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:  # unit-variance activations: std 1/sqrt(fan_in), embeddings std 1
                fan_in = 1 if "embed_tokens" in param_name else p.shape[-1]
                p.copy_(torch.randn_like(p) / math.sqrt(fan_in))
        for module in hf_model.modules():
            # Random init leaves the correction bias at zero; make it change choices.
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(
                    0.3 * torch.randn_like(module.e_score_correction_bias)
                )
            if hasattr(module, "kv_a_proj_with_mqa"):  # the attention: see LATENT_SCALE
                scale = LATENT_SCALE.get(name, 1.0)
                if module.q_lora_rank is not None:
                    module.q_a_proj.weight.mul_(scale)
                module.kv_a_proj_with_mqa.weight[: config.kv_lora_rank].mul_(scale)
    return hf_model


def _hf_logits(hf_model, vocab_size: int) -> np.ndarray:
    import torch

    tokens, positions = _inputs(vocab_size)
    with torch.no_grad():
        out = hf_model(
            input_ids=torch.from_numpy(tokens).long(),
            position_ids=torch.from_numpy(positions).long(),
        )
    return out.logits.float().numpy()


def _to_published_kimi(directory: str) -> None:
    """Rewrites a transformers-5 config.json the way Kimi-K2's published one reads."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config.update(rope_scaling=rope, model_type="kimi_k2", scoring_func="sigmoid")
    config.update(topk_method="noaux_tc", moe_layer_freq=1)
    for key in ("rope_interleave", "head_dim", "qk_head_dim"):
        config.pop(key, None)
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def hf_models():
    """name -> (HF model, its logits), built once per name."""
    cache = {}

    def get(name):
        if name not in cache:
            hf_model = _hf_model(name)
            cache[name] = hf_model, _hf_logits(hf_model, HF_BASE["vocab_size"])
        return cache[name]

    return get


@pytest.mark.hf
@pytest.mark.parametrize("name", list(PARITY))
def test_import_parity(name, hf_models, tmp_path):
    hf_model, expected = hf_models(name)
    hf_model.save_pretrained(tmp_path)  # per-expert layout
    if name == "kimi_legacy":
        _to_published_kimi(tmp_path)
    config, variables = hf.load_hf_checkpoint(str(tmp_path))
    error = _max_error(config, variables, expected)
    print(f"\nimport parity {name}: max abs logits error {error:.2e}")
    assert error <= TOL


@pytest.mark.hf
def test_import_keeps_transformers_latent_norm_eps(hf_models, tmp_path):
    """rms_norm_eps=1e-5 is imported for the layer norms only; the latent norms keep
    transformers' 1e-6, and using rms_norm_eps there (the old behaviour) would miss."""
    hf_model, expected = hf_models("eps_1e5")
    hf_model.save_pretrained(tmp_path)
    config, variables = hf.load_hf_checkpoint(str(tmp_path))
    assert (config.rms_norm_eps, config.latent_norm_eps) == (1e-5, 1e-6)
    assert _max_error(config, variables, expected) <= TOL
    old_semantics = config.replace(latent_norm_eps=config.rms_norm_eps)
    assert _max_error(old_semantics, variables, expected) > 100 * TOL


@pytest.mark.hf
def test_import_fused_experts_unscanned(hf_models, tmp_path):
    """transformers' in-memory (fused) layout, loaded into the unscanned layout."""
    import safetensors.torch

    hf_model, expected = hf_models("yarn_groups")
    hf_model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    safetensors.torch.save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config, variables = hf.load_hf_checkpoint(str(tmp_path), scan_layers=False)
    assert "moe_layers_1" in variables["params"]
    error = _max_error(config, variables, expected)
    print(f"\nimport parity yarn_groups (fused, unscanned): max abs logits error {error:.2e}")
    assert error <= TOL


@pytest.mark.hf
@pytest.mark.parametrize(
    "name, layout, shard_bytes",
    [
        ("plain", "per_expert", 2**30),
        ("yarn_groups", "fused", 20_000),
        ("kimi_legacy", "per_expert", 20_000),
        ("eps_1e5", "per_expert", 2**30),
    ],
)
def test_export_parity(name, layout, shard_bytes, tmp_path):
    """Our random variables -> save_hf_checkpoint -> from_pretrained gives our logits."""
    from transformers import DeepseekV3ForCausalLM

    config = hf.config_from_hf({"model_type": "deepseek_v3", **HF_BASE, **PARITY[name]})
    variables = _random_variables(config, seed=len(name), latent_scale=LATENT_SCALE.get(name, 1))
    hf.save_hf_checkpoint(
        str(tmp_path), config, variables, expert_layout=layout, max_shard_bytes=shard_bytes
    )
    sharded = os.path.exists(tmp_path / hf.INDEX_FILE)
    assert sharded == (shard_bytes < 2**30)
    hf_model, info = DeepseekV3ForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    hf_model.eval()
    error = _max_error(config, variables, _hf_logits(hf_model, config.vocab_size))
    print(f"\nexport parity {name} ({layout}, sharded={sharded}): max abs logits error {error:.2e}")
    assert error <= TOL


# ---- our side: the spec and round trips (no torch needed) ------------------------------


def _assert_bf16_rounded(loaded, original):
    """fp32 ``loaded`` holds ``original`` rounded to bf16, except the exact fp32 router."""
    original = dict(hf_mapping.flatten_variables(original))
    for key, value in hf_mapping.flatten_variables(loaded):
        router = key.startswith("router/") or key.endswith("moe/router")
        rounded = original[key].astype(jnp.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(value, original[key] if router else rounded, key)


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("layout", hf_mapping.EXPERT_LAYOUTS)
def test_spec_tiles_every_variable(scan_layers, layout):
    config = TINY.replace(scan_layers=scan_layers)
    spec = hf_mapping.weight_spec(config, layout)
    hf_mapping.check_spec(spec, hf_mapping.model_shapes(config))
    assert len({m.name for m in spec}) == len(spec)


@pytest.mark.parametrize(
    "config, layout, shard_bytes",
    [
        (TINY, "per_expert", 2**30),
        (TINY.replace(scan_layers=False, tie_word_embeddings=True), "fused", 3000),
        (TINY.replace(n_shared_experts=0, first_k_dense=0, param_dtype="bfloat16"), "fused", 2**30),
    ],
)
def test_save_load_round_trip(config, layout, shard_bytes, tmp_path):
    variables = _random_variables(config)
    hf.save_hf_checkpoint(
        str(tmp_path), config, variables, expert_layout=layout, max_shard_bytes=shard_bytes
    )
    loaded_config, loaded = hf.load_hf_checkpoint(
        str(tmp_path), scan_layers=config.scan_layers, param_dtype=config.param_dtype
    )
    assert loaded_config == config
    _assert_same(loaded, variables)


def test_export_dtype_and_load_upcast(tmp_path):
    """bf16 on disk (router kept fp32), read back as fp32: exactly the rounded values."""
    variables = _random_variables(TINY)
    hf.save_hf_checkpoint(str(tmp_path), TINY, variables, dtype="bfloat16")
    with safetensors.safe_open(tmp_path / "model.safetensors", "numpy") as f:
        assert f.get_slice("model.layers.1.mlp.gate.weight").get_dtype() == "F32"
        assert f.get_slice("model.layers.1.mlp.gate.e_score_correction_bias").get_dtype() == "F32"
        assert f.get_slice("model.layers.1.mlp.experts.0.up_proj.weight").get_dtype() == "BF16"
    _, loaded = hf.load_hf_checkpoint(str(tmp_path))
    _assert_bf16_rounded(loaded, variables)


def test_layouts_convert_through_the_spec():
    """Scanned fp32 -> HF tensors -> unscanned bf16 equals unstack_layers, rounded."""
    scanned = _random_variables(TINY)
    target = TINY.replace(scan_layers=False, param_dtype="bfloat16")
    out = hf_mapping.variables_from_hf_tensors(target, hf_mapping.iter_hf_tensors(TINY, scanned))
    unstacked = {c: model.unstack_layers(tree) for c, tree in scanned.items()}
    dtypes = {key: dtype for key, (_, dtype) in hf_mapping.model_shapes(target).items()}
    flat_out = dict(hf_mapping.flatten_variables(out))
    assert flat_out.keys() == dtypes.keys()
    for key, value in hf_mapping.flatten_variables(unstacked):
        assert flat_out[key].dtype == dtypes[key]
        np.testing.assert_array_equal(flat_out[key], np.asarray(value).astype(dtypes[key]), key)


def test_config_round_trip():
    for config in (
        TINY,
        TINY.replace(rope_scaling=None, q_lora_rank=None),
        TINY.replace(rms_norm_eps=1e-5),
    ):
        assert hf.config_from_hf(hf.config_to_hf(config)) == config


def test_latent_norm_eps_is_transformers_fixed_value(tmp_path):
    """Import sets latent_norm_eps to 1e-6 whatever rms_norm_eps is and refuses it as
    an override; export refuses another value (config.json cannot carry it)."""
    hf_config = hf.config_to_hf(TINY.replace(rms_norm_eps=1e-5))
    assert hf.config_from_hf(hf_config).latent_norm_eps == 1e-6
    with pytest.raises(hf.HFCheckpointError, match=r"overrides \['latent_norm_eps'\]"):
        hf.config_from_hf(hf_config, latent_norm_eps=1e-5)
    config = TINY.replace(latent_norm_eps=1e-5)
    with pytest.raises(hf.HFCheckpointError, match=r"latent_norm_eps=1e-05 cannot be exported"):
        hf.save_hf_checkpoint(str(tmp_path), config, _random_variables(config))
    assert not os.listdir(tmp_path)


def test_published_kimi_k2_config():
    """Kimi-K2-Instruct-0905's config.json (fp8 quantization left out) gives configs/kimi_k2.py."""
    published = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 384,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    path = os.path.join(ROOT, "configs", "kimi_k2.py")
    module_spec = importlib.util.spec_from_file_location("kimi_k2_config", path)
    kimi_k2 = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(kimi_k2)
    config = hf.config_from_hf(published)
    for field in sorted(hf.HF_DERIVED_FIELDS):
        assert getattr(config, field) == getattr(kimi_k2.MODEL, field), field


@pytest.mark.hf
def test_rope_frequencies_match_transformers():
    """layers.rope_frequencies and the softmax scale against transformers' YaRN code."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from cursor_rl.model.layers import rope_frequencies

    deepseek_v3 = dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    mscale_only = dict(
        rope_type="yarn", factor=2.0, original_max_position_embeddings=256, mscale=0.7
    )
    for rope in (
        PARITY["yarn_groups"]["rope_parameters"],
        PARITY["kimi_legacy"]["rope_parameters"],
        deepseek_v3,
        mscale_only,
    ):
        hf_config = DeepseekV3Config(
            **{**HF_BASE, "qk_rope_head_dim": 64}, rope_parameters=dict(rope)
        )
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
        config = hf.config_from_hf(hf_config.to_dict())
        ours, our_factor = rope_frequencies(config)
        # float32 pow differs by an ulp between NumPy and torch, nothing more.
        np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6, atol=0)
        assert our_factor == pytest.approx(attention_factor, rel=1e-12)
        expected_scale = yarn_apply_mscale(hf_config.rope_parameters, config.qk_head_dim**-0.5)
        assert config.softmax_scale == pytest.approx(expected_scale, rel=1e-12)


# ---- loader errors ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pristine")
    hf.save_hf_checkpoint(str(directory), TINY, _random_variables(TINY))
    return directory


@pytest.fixture
def checkpoint(pristine_checkpoint, tmp_path):
    """A fresh copy of a valid tiny checkpoint: (directory, its config.json dict)."""
    directory = tmp_path / "checkpoint"
    shutil.copytree(pristine_checkpoint, directory)
    with open(directory / "config.json") as f:
        return directory, json.load(f)


def _write_config(directory, config):
    with open(directory / "config.json", "w") as f:
        json.dump(config, f)


def _edit_tensors(directory, edit):
    path = directory / "model.safetensors"
    tensors = safetensors.numpy.load_file(path)
    edit(tensors)
    safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})


def _raises(directory, match, **kwargs):
    with pytest.raises(hf.HFCheckpointError, match=match):
        hf.load_hf_checkpoint(str(directory), **kwargs)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "llama"}, "model_type='llama' is not supported"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config.*'fp8'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"num_key_value_heads": 1}, "num_key_value_heads=1"),
        ({"hidden_size": None}, "required field 'hidden_size'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "type 'linear'"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.0}},
            "attention_factor",
        ),
        (
            {"rope_scaling": {"type": "yarn", "factor": 2.0, "low_freq_factor": 1}},
            "low_freq_factor",
        ),
        ({"n_group": 3}, "n_group=3"),  # ModelConfig.validate, reported as config.json's
    ],
    ids=[
        "model_type",
        "fp8",
        "hidden_act",
        "attention_bias",
        "kv_heads",
        "missing_field",
        "rope_linear",
        "attention_factor",
        "unknown_rope_key",
        "n_group",
    ],
)
def test_config_errors(checkpoint, change, match):
    directory, config = checkpoint
    _write_config(directory, {**config, **change})
    _raises(directory, match)


EXPERT_UP = "model.layers.1.mlp.experts.3.up_proj.weight"  # [F, D] = [8, 16] in TINY


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop(EXPERT_UP), f"missing tensor '{EXPERT_UP}'"),
        (lambda t: t.update(extra=np.zeros(1, np.float32)), "unexpected tensor 'extra'"),
        (
            lambda t: t.update({"model.layers.2.mlp.experts.down_proj": np.zeros((4, 16, 8))}),
            "mixed expert layouts: fused 'model.layers.2.mlp.experts.down_proj'",
        ),
        (
            lambda t: t.update({EXPERT_UP: np.zeros((16, 8), np.float32)}),
            rf"'{EXPERT_UP}' has shape \(16, 8\), expected \(8, 16\)",
        ),
        (
            lambda t: t.update({EXPERT_UP: np.zeros((8, 16), np.int8)}),
            f"'{EXPERT_UP}' has dtype I8",
        ),
    ],
    ids=["missing", "unexpected", "mixed_layouts", "shape", "quantized"],
)
def test_tensor_errors(checkpoint, edit, match):
    directory, _ = checkpoint
    _edit_tensors(directory, edit)
    _raises(directory, match)


def test_mtp_layers_need_opt_in(checkpoint):
    directory, config = checkpoint
    mtp = f"model.layers.{config['num_hidden_layers']}.eh_proj.weight"
    _edit_tensors(directory, lambda t: t.update({mtp: np.zeros((16, 32), np.float32)}))
    _raises(directory, f"'{mtp}'.*drop_mtp=True")
    loaded_config, _ = hf.load_hf_checkpoint(str(directory), drop_mtp=True)
    assert loaded_config.num_layers == TINY.num_layers


def test_file_errors(checkpoint):
    directory, _ = checkpoint
    _raises(directory, "overrides .*hidden_size.* conflict", hidden_size=8)
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _raises(directory, "cannot read .*model.safetensors")
    path.unlink()
    _raises(directory, "neither model.safetensors nor")
    (directory / hf.INDEX_FILE).write_text(
        json.dumps({"weight_map": {"a": "model-00001.safetensors"}})
    )
    _raises(directory, "lists shard .*model-00001.safetensors")
    (directory / "config.json").write_text("{not json")
    _raises(directory, "cannot read .*config.json")
    (directory / "config.json").unlink()
    _raises(directory, "config.json does not exist")


def test_index_must_match_shards(tmp_path):
    hf.save_hf_checkpoint(str(tmp_path), TINY, _random_variables(TINY), max_shard_bytes=3000)
    index_path = tmp_path / hf.INDEX_FILE
    index = json.loads(index_path.read_text())
    name = "model.norm.weight"
    index["weight_map"][name] = "model-00001-of-" + index["weight_map"][name].split("-of-")[1]
    index_path.write_text(json.dumps(index))
    _raises(tmp_path, f"tensor '{name}'")


def test_save_errors(tmp_path):
    variables = _random_variables(TINY)
    with pytest.raises(hf.HFCheckpointError, match="variables lack params/dense_layers_0/"):
        hf.save_hf_checkpoint(str(tmp_path / "a"), TINY.replace(scan_layers=False), variables)
    variables["params"]["final_norm"]["scale"] = np.ones(3, np.float32)
    with pytest.raises(hf.HFCheckpointError, match=r"final_norm/scale has shape \(3,\)"):
        hf.save_hf_checkpoint(str(tmp_path / "b"), TINY, variables)
    hf.save_hf_checkpoint(str(tmp_path / "c"), TINY, _random_variables(TINY))
    with pytest.raises(hf.HFCheckpointError, match="already holds a checkpoint"):
        hf.save_hf_checkpoint(str(tmp_path / "c"), TINY, _random_variables(TINY))


# ---- the conversion tool ----------------------------------------------------------------


def test_convert_hf_tool_round_trip(tmp_path):
    """HF -> Orbax (bf16, unscanned) -> HF through the command line; ids and tokenizer kept."""
    from cursor_rl.tools import convert_hf

    variables = _random_variables(TINY)
    source = tmp_path / "source"
    hf.save_hf_checkpoint(str(source), TINY, variables, extra_config={"bos_token_id": 5})
    (source / "tokenizer.json").write_text('{"model": "stand-in"}')
    step_dir = convert_hf.hf_to_orbax(
        str(source), str(tmp_path / "orbax"), param_dtype="bfloat16", scan_layers=False
    )
    assert os.path.basename(step_dir) == "0"
    command = [sys.executable, "-m", "cursor_rl.tools.convert_hf", "--to=hf"]
    command += [f"--orbax_dir={tmp_path / 'orbax'}", f"--hf_dir={tmp_path / 'export'}"]
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    config, exported = hf.load_hf_checkpoint(str(tmp_path / "export"))
    assert config == TINY
    with open(tmp_path / "export" / "config.json") as f:
        assert json.load(f)["bos_token_id"] == 5
    assert (tmp_path / "export" / "tokenizer.json").read_text() == '{"model": "stand-in"}'
    _assert_bf16_rounded(exported, variables)
