"""A micro RL config for the RL tests: a 2-layer model, tiny tasks, 2 short steps.

    python -m cursor_rl.main --config=tests/rl_micro_config.py --workdir=W [--config.rl.role=...]

The workdir must already hold a tokenizer (``tokenizer/tokenizer.json``) and an SFT
checkpoint (``sft/checkpoints/<step>``); ``tests/test_rl_loop.py`` writes both.
The task datasets (2 train, 2 bench tiny tasks) are built into the workdir on first use.
"""

from train_helpers import MICRO_MODEL

from cursor_rl import config_lib

# The trainer tests' micro model, with room for a chat vocabulary and whole episodes.
MODEL = MICRO_MODEL.replace(vocab_size=512, max_position_embeddings=2048)


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, stage="rl")
    c = config_lib.base_config()
    c.stage = arg.stage
    c.model = config_lib.model_section(MODEL)
    c.tokenizer.vocab_size = MODEL.vocab_size
    c.checkpoint.async_save = False
    c.harness.system_prompt = "Fix the code in /workspace, then call submit."
    c.harness.tools_style = "compact"
    rl = c.rl
    rl.num_steps = 2
    rl.tasks_per_step = 2
    rl.train_seq_len = 2048
    rl.tool_workers = 1
    rl.tasks.train_count = 2
    rl.tasks.bench_count = 2
    rl.rollout.group_size = 2
    rl.rollout.max_turns = 2
    rl.rollout.max_new_tokens = 24
    rl.rollout.token_budget = 48
    rl.rollout.grade_workers = 1
    rl.sampler.num_slots = 4
    rl.sampler.max_seq_len = 2048
    rl.eval.every = 0  # before and after only
    rl.eval.samples = 2
    # An untrained policy solves nothing: keep zero-variance groups so that every
    # rollout batch still takes a (zero-advantage) optimizer step and a new version.
    rl.grpo.drop_zero_variance = False
    c.stage_overrides.rl.optimizer = dict(learning_rate=1e-3, schedule="constant", warmup_steps=0)
    return c
