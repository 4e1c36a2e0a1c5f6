"""Small: a ~1.8B-parameter (0.4B active) MoE for one accelerator host.

What for: real-data experiments on one TPU v5p-8 / v4-8 host or one 8-GPU host,
and the sampler/RL loop at a size where they behave like the large model.

Command (on the host; see launch/README.md):
    python -m cursor_rl.main --config=configs/small.py --workdir=gs://BUCKET/small

Hardware: 8 chips with >= 32 GB each (bf16 compute, fp32 params and Adam state
sharded fsdp=4 x expert=2 comes to ~5 GB per chip before activations).
Expected result: pretraining loss on code falls below 2.0 nats within ~20B tokens
(estimate, not measured here: this machine has no accelerator).
"""

from cursor_rl import config_lib
from cursor_rl.model.config import ModelConfig

MODEL = ModelConfig(
    vocab_size=32768,
    hidden_size=1536,
    intermediate_size=6144,
    moe_intermediate_size=512,
    num_layers=20,
    num_heads=16,
    q_lora_rank=768,
    kv_lora_rank=256,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=32,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    first_k_dense=1,
    routed_scaling_factor=2.5,
    rope_theta=50000.0,
    max_position_embeddings=8192,
    dtype="bfloat16",
    remat_policy="dots_with_no_batch_dims_saveable",
    attention_impl="chunked",
    attention_chunk_size=1024,
)


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, stage="all")
    c = config_lib.base_config()
    c.stage = arg.stage
    c.model = config_lib.model_section(MODEL)
    c.tokenizer.vocab_size = MODEL.vocab_size
    c.mesh.ici = dict(data=1, fsdp=4, context=1, expert=2, tensor=1)
    c.train.num_steps = 50_000
    c.train.batch_size = 256
    c.train.seq_len = 4096
    c.train.microbatches = 8  # 32 rows per micro-batch: 4 per chip
    c.train.loss_chunk_size = 1024
    c.train.log_every = 50
    c.train.eval_every = 1000
    c.optimizer.name = "muon"
    c.optimizer.schedule = "wsd"
    c.optimizer.learning_rate = 2e-3
    c.optimizer.warmup_steps = 1000
    c.checkpoint.every_steps = 1000
    c.checkpoint.keep_every = 10_000

    lc = c.stage_overrides.long_context
    lc.train = dict(seq_len=32768, batch_size=32, num_steps=2000)
    lc.model = dict(
        max_position_embeddings=32768,
        rope_scaling=dict(
            factor=8.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
            truncate=True,
        ),
    )
    lc.mesh = dict(rules_preset="long_context", ici=dict(data=1, fsdp=2, context=2, expert=2))
    sft = c.stage_overrides.sft
    sft.train = dict(seq_len=32768, batch_size=32, num_steps=2000)
    sft.optimizer = dict(learning_rate=2e-4, warmup_steps=50)
    return c
