"""A micro training config shared by the trainer, checkpoint and multi-host tests."""

import os
import sysconfig

from cursor_rl import config_lib
from cursor_rl.model.config import ModelConfig

MICRO_MODEL = ModelConfig(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_layers=2,
    num_heads=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense=1,
    moe_block_size=16,
    max_position_embeddings=256,
)

# A few hundred KB of real code: quick to tokenize, enough for distinct batches.
SMALL_CORPUS = "files:" + os.path.join(sysconfig.get_paths()["stdlib"], "email", "*.py")


def micro_config(num_steps: int = 6, **train):
    c = config_lib.base_config()
    c.stage = "pretrain"
    c.model = config_lib.model_section(MICRO_MODEL)
    c.tokenizer.vocab_size = MICRO_MODEL.vocab_size
    c.data.sources = (SMALL_CORPUS,)
    c.data.read_threads = 1
    c.train.num_steps = num_steps
    c.train.batch_size = 8
    c.train.seq_len = 32
    c.train.log_every = 1
    c.train.eval_every = 0
    c.optimizer.warmup_steps = 2
    c.checkpoint.every_steps = 2
    c.checkpoint.keep_last = 10
    c.checkpoint.async_save = False
    for key, value in train.items():
        c.train[key] = value
    return c
