"""DeepSeek-V3 (671B params, 37B active) text model shapes, for side-by-side AOT compiles.

What for: the model MaxText ships as ``deepseek3-671b``; benchmarks/maxtext_aot_compare.py
compiles this config's train step and MaxText's for the same TPU topology, batch and
sequence length and compares per-chip memory and compiled FLOPs. Nothing here runs
it on a CPU.

Command:
    python -m cursor_rl.tools.aot_compile --config=configs/deepseek_v3.py \
        --topology=v5p:8x8x8

Shapes from deepseek-ai/DeepSeek-V3's config.json (and MaxText's
configs/models/deepseek3-671b.yml, which agrees): 61 layers of which the first 3 are
dense, hidden 7168, 128 heads, q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v 128,
256 routed experts top-8 + 1 shared, moe_intermediate 2048, intermediate 18432, vocab
129280, sigmoid routing limited to the best 4 of 8 expert groups (noaux_tc),
routed_scaling_factor 2.5, rope_theta 10000 with YaRN factor 40 over 4096 (mscale 1,
mscale_all_dim 1, beta_fast 32, beta_slow 1; 163840 positions), rms_norm_eps 1e-6.
The multi-token-prediction module (num_nextn_predict_layers=1) is not modelled (MaxText
leaves it off too: mtp_num_layers=0).

Hardware: a TPU v5p pod slice; the train step at 1024 x 4096 tokens is sized for
v5p:8x8x8 (512 chips; MaxText calls it v5p-1024). The measured per-chip memory, ours
and MaxText's, is in benchmarks/README.md.
"""

from configs import kimi_k2
from cursor_rl import config_lib
from cursor_rl.model.config import RopeScaling

# Kimi K2 is DeepSeek-V3's architecture scaled (more experts, fewer heads, one dense
# layer, ungrouped routing, a longer YaRN extension): the same model with these fields.
MODEL = kimi_k2.MODEL.replace(
    vocab_size=129280,
    num_heads=128,
    n_routed_experts=256,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    first_k_dense=3,
    rope_theta=10000.0,
    rope_scaling=RopeScaling(
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    max_position_embeddings=163840,
)


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, stage="pretrain")
    # Kimi K2's pod layout, batch and checkpointing (experts over a 64-way axis, 256 =
    # 64 x 4; parameters, optimizer state and the MLA latents over fsdp x expert), with
    # this model and DeepSeek-V3's optimizer.
    c = kimi_k2.get_config(f"stage={arg.stage}")
    c.model = config_lib.model_section(MODEL)
    c.tokenizer.vocab_size = MODEL.vocab_size
    # AdamW with DeepSeek-V3's betas and weight decay (its paper, sec. 4.2), no QK-clip.
    c.optimizer.name = "adamw"
    c.optimizer.qk_clip_tau = 0.0
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.95
    c.optimizer.weight_decay = 0.1
    c.optimizer.learning_rate = 2.2e-4
    c.optimizer.warmup_steps = 2000
    return c
