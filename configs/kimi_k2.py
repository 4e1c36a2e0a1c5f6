"""Kimi K2 / K2.5 text model shapes (DeepSeek-V3 architecture): 1.04T params, 32B active.

What for: the scale Composer 2 trained at. Nothing here runs it on a CPU; the
ahead-of-time tool compiles its sharded train step for a TPU topology to check
memory fit and FLOPs.

Command:
    python -m cursor_rl.tools.aot_compile --config=configs/kimi_k2.py \
        --topology=v5p:8x8x8

and on a pod the same config trains from an HF checkpoint converted with
`python -m cursor_rl.tools.convert_hf`.

Shapes from moonshotai/Kimi-K2-Instruct-0905's config.json: 61 layers, hidden 7168,
64 heads, q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v 128, 384 routed
experts top-8 + 1 shared, first_k_dense 1, moe_intermediate 2048, intermediate
18432, vocab 163840, rope_theta 50000, YaRN factor 64 over 4096 (256K context),
routed_scaling_factor 2.827, a single expert group.

Hardware: a TPU v5p pod slice (see docs/scale.md for the smallest topology that fits
and the per-chip memory breakdown measured by the AOT tool).
"""

from cursor_rl import config_lib
from cursor_rl.model.config import ModelConfig, RopeScaling

MODEL = ModelConfig(
    vocab_size=163840,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_layers=61,
    num_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=384,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.827,
    first_k_dense=1,
    rope_theta=50000.0,
    rope_scaling=RopeScaling(
        factor=64.0,
        original_max_position_embeddings=4096,
        beta_fast=1.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    rope_interleave=True,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    dtype="bfloat16",
    param_dtype="float32",
    remat_policy="full",
    # Expert-parallel buffers at 2x the balanced share (dropless would be 64x).
    moe_capacity_factor=2.0,
    attention_impl="chunked",
    attention_chunk_size=1024,
)


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, stage="pretrain", long_context=0, dropless=0)
    c = config_lib.base_config()
    c.stage = arg.stage
    c.model = config_lib.model_section(MODEL)
    c.tokenizer.vocab_size = MODEL.vocab_size
    # Experts over a 64-way axis (384 = 64 x 6), parameters/optimizer state over fsdp.
    c.mesh.ici = dict(data=1, fsdp=-1, context=1, expert=64, tensor=1)
    # The MLA up-projections' latent dimension over fsdp x expert too: with tensor=1 and
    # the default rules (q_lora, kv_lora replicated) q_b_proj and kv_b_proj were a full
    # copy on every chip, 6.2 GiB of the 13.66 GiB of parameters per chip on v5p-512
    # (AOT-measured: the Muon step went from 92.2 to 65.9 GiB per chip with these).
    c.mesh.rules = dict(q_lora=("fsdp", "expert"), kv_lora=("fsdp", "expert"))
    c.train.batch_size = 1024
    c.train.seq_len = 4096
    c.train.loss_chunk_size = 512  # a 163840-wide vocabulary: project in chunks
    c.train.num_steps = 100_000
    c.optimizer.name = "muon"
    c.optimizer.qk_clip_tau = 100.0  # MuonClip, as Kimi K2 trains (tau = 100)
    c.optimizer.schedule = "wsd"
    c.optimizer.learning_rate = 2e-4
    c.optimizer.warmup_steps = 500
    c.checkpoint.every_steps = 500
    c.checkpoint.keep_every = 5000

    # `configs/kimi_k2.py:dropless=1`: no token is ever dropped. Experts over 8 chips
    # (48 per chip, send buffers sized for every token landing on one peer), the step
    # in two microbatches of 512 x 4096 (the same 4.2M-token update; the dispatch
    # buffers follow the microbatch), Muon on whole expert matrices per chip. AOT on
    # v5p-512 (docs/scale.md): 71.45 GiB a chip; at one microbatch 81.33; AdamW 87.23.
    # Before the dispatch stopped copying its assignments in sorted order: 83.76 (90.82
    # at one microbatch); before Muon spread its expert matrices, refused at 111.15.
    if arg.dropless:
        c.mesh.ici = dict(data=1, fsdp=-1, context=1, expert=8, tensor=1)
        c.model.moe_capacity_factor = 0.0
        c.train.microbatches = 2
        c.optimizer.muon_spread_experts = True

    # `configs/kimi_k2.py:long_context=131072`: the long-context stage at that length
    # (Kimi K2's YaRN factor 64 over 4,096 reaches 262,144; by default the stage keeps the
    # pretraining shapes). The sequence goes over a 16-way context axis (ring attention,
    # causally load-balanced, model/context_parallel.py) and the experts over 32, so each
    # chip holds 8,192 tokens as in pretraining, the same 4.2M tokens a step; parameters
    # shard over context x expert. It fits v5p-512 at 70.41 GiB a chip (AOT, docs/scale.md).
    if arg.long_context:
        lc = c.stage_overrides.long_context
        lc.mesh = dict(
            ici=dict(data=1, fsdp=1, context=16, expert=32, tensor=1),
            rules_preset="long_context",
            rules=dict(q_lora=("fsdp", "context", "expert"), kv_lora=("fsdp", "context", "expert")),
        )
        lc.train = dict(seq_len=int(arg.long_context), batch_size=32, microbatches=1)
        lc.model = dict(attention_chunk_size=256)
    return c
