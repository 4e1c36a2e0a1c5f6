"""Tiny: the whole recipe on a 2-core CPU, on the embedded standard-library corpus.

What for: the built-in default. Runs every stage end to end in minutes, so each
change can be checked on a laptop-class CPU; the same code runs `small` and
`kimi_k2` on accelerators.

Command (the README's main command runs this):
    python -m cursor_rl.main --config=configs/tiny.py --workdir=/tmp/tiny
    python -m cursor_rl.main --config=configs/tiny.py:stage=pretrain --workdir=/tmp/tiny \
        --config.train.num_steps=20

Hardware: 2 CPU cores (an 8-device mesh is emulated by the tests; the main job uses
the real CPU device). Model: 7.4M parameters (3.9M active), hidden 256, 4 layers
(1 dense + 3 MoE with 8 routed experts top-2 and 1 shared), MLA with a 64-wide KV
latent, vocabulary 2048 (byte-level BPE trained on the corpus).

Expected result (2 quiet CPU cores, from the shipped base, seed 0, 2026-12-06, run E11
in docs/learning.md section 6): exit 0 in ~32 minutes including the install; pretrain 150
steps (held-out loss 2.674 -> 2.668, copy probe 0.999), long-context 40 steps (2.283 ->
2.220), SFT 300 steps on 256 scripted demonstrations (3.65 -> 0.064, copy probe 0.90),
held-out pass@1 (32 tasks x 4 samples, temperature 0.6) base 0.000, SFT 0.047 [0.000,
0.109], RL 10 steps at lr 2e-5 0.023 [0.000, 0.062]; seed 1: 0.000 / 0.039 / 0.047. Peak
RSS per stage 2.23 / 2.20 / 2.41 / 2.72 GiB. RL raising held-out pass@1 by 10 points is
not shown yet (issue 18).
"""

from cursor_rl import config_lib
from cursor_rl.model.config import ModelConfig

MODEL = ModelConfig(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=256,
    num_layers=4,
    num_heads=4,
    q_lora_rank=None,  # small models skip the query bottleneck (DeepSeek-V2-Lite does too)
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense=1,
    routed_scaling_factor=1.0,
    router_bias_update_rate=1e-3,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    # Four layers: unrolled, they compile faster than a scan and run ~20% faster
    # on XLA:CPU (no per-iteration slicing of the stacked weights and activations).
    scan_layers=False,
)


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, stage="all")
    c = config_lib.base_config()
    c.stage = arg.stage
    c.model = config_lib.model_section(MODEL)
    c.tokenizer.vocab_size = MODEL.vocab_size

    # (a) Continued pretraining on code from the shipped base (cursor_rl/bases/tiny,
    # made by configs/tiny_base.py's recipe), as Composer 2 continues from a released
    # base; `--config.init_from=none` trains from random weights instead. One row in
    # four stays a row of repeated random spans, the base's own mix, so the copying
    # it learned is kept while the code loss improves; the copy probe is logged.
    c.init_from = "tiny"
    c.train.num_steps = 150
    c.train.batch_size = 16
    # Two passes of 8 rows, gradients accumulated: the step's XLA temporaries 0.98 ->
    # 0.55 GiB and the stage's peak 2.96 -> 2.16 GiB, for 8% of its speed (4,981 ->
    # 4,576 tok/s; benchmarks/memory_bench.py, 2026-12-04).
    c.train.microbatches = 2
    c.train.seq_len = 256
    c.train.log_every = 10
    # One step in flight: XLA:CPU holds a queued step's temporaries too (config_lib).
    c.train.max_steps_in_flight = 1
    c.train.eval_every = 50
    c.train.probe_every = 50
    c.data.repeat_rows = 0.25
    c.data.repeat_max_len = 80
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 20
    c.checkpoint.every_steps = 50

    # (b) Long context: 4x the sequence length, YaRN factor 4 over the pretraining
    # length (DeepSeek-V3 sec. 4.3 extends the same way), lower learning rate.
    lc = c.stage_overrides.long_context
    # Two microbatches of 2 rows (the same update): the stage peaked at 2.7-3.1 GiB
    # resident in one pass (2026-12-05).
    lc.train = dict(seq_len=1024, batch_size=4, num_steps=40, probe_every=20, microbatches=2)
    lc.model = dict(
        # Query chunks of 256 (recomputed in backward) instead of [B, H, T, T] scores:
        # the step's temporaries fall from 1.54 to 0.82 GiB and the process peak from
        # 4.1 to 2.7 GiB, at ~12% of the stage's speed (benchmarks/memory_bench.py,
        # 2026-12-04). SFT and RL inherit it.
        attention_impl="chunked",
        attention_chunk_size=256,
        rope_scaling=dict(
            factor=4.0,
            original_max_position_embeddings=256,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=0.0,
            truncate=True,
        ),
    )
    # It continues at the pretraining's final learning rate (1e-4 = min_lr_ratio x 1e-3):
    # a fresh optimizer at a higher rate first undoes progress (held-out loss measured
    # 4.68 -> 4.90 in 20 steps at 2e-3 from a 3e-3 pretraining).
    lc.optimizer = dict(learning_rate=1e-4, warmup_steps=5)

    # (c) SFT on agent trajectories in the harness's chat/tool format.
    sft = c.stage_overrides.sft
    # seq_len 1536: a read-edit-submit demonstration is ~850-1,350 tokens (median
    # ~1,040; a module's read alone ~450), so at 1024 half of them were cut in two
    # and the cut-off halves trained without their task in view (2026-12-05).
    # Two microbatches of 2 rows (the same update): the step's XLA temporaries are
    # 0.66 GiB instead of 1.21 (aot_compile --topology=cpu --stage=sft); the stage
    # peaked at 4.65 GiB resident in one pass (2026-12-05).
    sft.train = dict(seq_len=1536, batch_size=4, num_steps=300, microbatches=2)
    # lr 3e-4: at 1e-3 SFT's ~6 epochs over 96 demonstrations took the copy probe from
    # 0.999 to 0.52; at 3e-4 it kept 0.90 but solved no held-out task either (32 x 4,
    # 2026-12-04). 256 demonstrations (every training task, ~30 templates x 8 bug,
    # feature and refactor generators) over 300 steps: ~4.7 epochs.
    sft.optimizer = dict(learning_rate=3e-4, warmup_steps=5)
    # The harness lists its tools compactly (a short system prompt leaves the context
    # to the episode), and SFT learns from the scripted solver's shortest plan (read,
    # edit, submit) on the run's own training tasks.
    c.harness.tools_style = "compact"
    c.sft_data.demos = 256
    c.sft_data.plan = "short"

    # (d) RL on the tiny task family: groups of 8 episodes on 4 tasks per step, the
    # held-out benchmark evaluated on the long-context checkpoint (rl.eval.base, the
    # baseline), before RL (the SFT checkpoint) and after.
    rl = c.rl
    # RL on the SFT demonstrations' own tasks. RL on tasks SFT never saw
    # (rl.tasks.skip_demonstrated with train_count 384, 20 steps) was tried in the
    # pipeline (run E12, 2026-12-06): held-out pass@1 0.047 -> 0.023, as here, with
    # more tasks to build and twice the RL steps (docs/learning.md section 7).
    rl.num_steps = 10
    rl.tasks_per_step = 4
    rl.train_seq_len = 2048
    # A rollout batch packs into up to 32 rows; one pass over all of them needed ~12 GB
    # of temporaries at 1024. Passes of 1 row of 2048, gradients accumulated: the
    # update's XLA temporaries are 487 MiB instead of 865 at 2 rows, for ~18% of the
    # update's time (106 s instead of 90 in 10 steps, 2026-12-06).
    rl.microbatch_rows = 1
    rl.tasks.train_count = 256
    rl.tasks.bench_count = 32
    rl.rollout.group_size = 8
    # Rollouts and evals sample at temperature 0.6 (DeepSeek-R1's and Qwen's
    # recommended setting; GRPO scores the tempered distribution, rl/grpo.py note 8).
    # At 1.0 the SFT model's openers loop on copied spans and its edits are mostly
    # noise: on the same SFT checkpoint held-out pass@1 was 0.008 at 1.0 and 0.039 at
    # 0.6, with 88% of episodes submitting (2026-12-05, docs/learning.md section 5).
    rl.rollout.temperature = 0.6
    # Long-horizon: room to read, edit, run the tests and retry; a context past
    # 1536 tokens is summarised by the model itself and the episode goes on from
    # [system, task, summary] (rl/rollout.py), as Composer's long episodes do.
    # The threshold must clear a successful read-edit-submit episode (up to ~1,350
    # tokens here): at 640 nearly every episode summarised right after its read
    # (2026-12-04); at 900, in a 1024 context, 53 of 128 held-out SFT episodes and
    # 41 of 64 training rollouts were cut off by the summary prompt right after a
    # successful edit, before submitting (2026-12-05). An episode that runs the tests
    # and retries crosses 1536.
    rl.rollout.max_turns = 8
    rl.rollout.max_new_tokens = 192
    rl.rollout.token_budget = 1024
    rl.rollout.summary_threshold = 1536
    rl.rollout.max_summaries = 1
    rl.rollout.summary_max_tokens = 128
    rl.reward.token_budget = 1024
    rl.reward.max_tool_calls = 8
    rl.sampler.num_slots = 32
    rl.sampler.max_seq_len = 2048
    # Prefill calls of at most 1,024 padded tokens (4 chunks of 256). When all 32 slots
    # prefilled a tool output in one call, it grew the process by 1.19 GiB and the
    # stage peaked at 3.81 GiB; split in calls of 1,024 the same burst grows it by 0.15
    # GiB and runs faster, 7,720 tok/s instead of 6,277
    # (benchmarks/prefill_memory_bench.py, 2026-12-06).
    rl.sampler.prefill_tokens = 1024
    rl.eval.every = 0
    rl.eval.num_tasks = 32  # every bench task: 32 tasks x 4 samples for the intervals
    rl.eval.samples = 4
    rl.eval.temperature = 0.6
    # Eval episodes keep their tokens (~2 MB a run): read them with
    # `python -m cursor_rl.eval.transcripts --workdir=... --stage=sft`.
    rl.eval.save_trajectories = True
    # lr 2e-5, a tenth of SFT's (RL recipes run far below their SFT rate). At 2e-4 the
    # policy collapsed within 10 steps: held-out episodes ended in repeated garbage
    # (`"id(\"id(\"id(...`), 4% of them submitted and reward on the training tasks fell to
    # 0. From the same SFT checkpoint (seed 0, 2026-12-05): lr 2e-4 / 5e-5 / 2e-5 gave
    # held-out pass@1 0.031 / 0.031 / 0.062 (SFT 0.039) with 4% / 69% / 86% submitting
    # (docs/learning.md section 5).
    c.stage_overrides.rl.optimizer = dict(
        learning_rate=2e-5, schedule="constant", warmup_steps=0, weight_decay=0.0
    )
    return c


def get_sweep():
    """Learning rates for `launch/xm_launch.py` (one work unit per dict of overrides):

    .venv-xm/bin/python launch/xm_launch.py --config=configs/tiny.py:stage=pretrain \\
        --workdir=/tmp/tiny_sweep
    """
    return [{"optimizer.learning_rate": lr} for lr in (3e-3, 1e-3)]
