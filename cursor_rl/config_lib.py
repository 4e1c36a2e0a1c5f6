"""Shared pieces of the experiment configs in ``configs/``.

Each ``configs/NAME.py`` builds on ``base_config()`` and returns a ConfigDict. A
config holds every stage's settings; ``stage_overrides.<stage>`` holds what a
stage changes relative to the rest (merged by ``cursor_rl.stages.stage_config``). A
command-line override of a shared field such as ``--config.train.num_steps=2``
applies to every stage of the run, including stages whose ``stage_overrides`` set
that field (``stages.apply_command_line``);
``--config.stage_overrides.sft.train.num_steps=N`` changes one stage only.

The defaults come from the dataclasses of the sections' owners (data, harness, RL),
so this module sits on the top floor, above all of them; nothing in the package
imports it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from cursor_rl.data.pipeline import DataConfig
from cursor_rl.env.harness import DEFAULT_SYSTEM_PROMPT
from cursor_rl.model.config import ModelConfig
from cursor_rl.rl.feedback import FeedbackConfig
from cursor_rl.rl.grpo import GRPOConfig
from cursor_rl.rl.rewards import RewardConfig
from cursor_rl.rl.rollout import RolloutConfig
from cursor_rl.stages import STAGES


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
    """Parses ``"stage=sft,steps=10"`` into a ConfigDict, typed by ``defaults``.

    (The ``configs/NAME.py:ARG`` convention of big_vision.)
    """
    result = ml_collections.ConfigDict(dict(defaults))
    if not arg:
        return result
    for item in arg.split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"config arg {item!r} is not key=value")
        if key not in defaults:
            raise ValueError(f"config arg {key!r} is unknown; known: {sorted(defaults)}")
        kind = type(defaults[key])
        if kind is bool:
            result[key] = value.lower() in ("1", "true", "yes")
        else:
            result[key] = kind(value)
    return result


def model_section(model: ModelConfig) -> ml_collections.ConfigDict:
    values = model.to_dict()
    if values["rope_scaling"] is None:
        # A placeholder keeps the field overridable from the command line; a factor of
        # 1 means "no scaling" (YaRN with factor 1 is plain RoPE).
        values["rope_scaling"] = {
            "factor": 1.0,
            "original_max_position_embeddings": model.max_position_embeddings,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.0,
            "truncate": True,
        }
    section = ml_collections.ConfigDict(values)
    # q_lora_rank may be None or an int: let overrides set either.
    section.q_lora_rank = ml_collections.FieldReference(model.q_lora_rank, field_type=int)
    return section


def _data_defaults() -> dict[str, Any]:
    values = dataclasses.asdict(DataConfig())
    # None = "the benchmark modules"; keep it overridable with a list of names.
    values["exclude_modules"] = ml_collections.FieldReference(None, field_type=tuple)
    return values


def _rl_defaults() -> ml_collections.ConfigDict:
    """The RL stage's section; rollout, reward and GRPO defaults come from their dataclasses."""
    rl = ml_collections.ConfigDict()
    rl.role = "colocated"  # colocated | trainer | sampler (two programs, see rl/loop.py)
    # Many samplers (role sampler): num_samplers processes, each started with its own
    # sampler_id in [0, num_samplers); sampler k writes rollout batches k, k+N, ...
    rl.num_samplers = 1
    rl.sampler_id = 0
    rl.num_steps = 20  # GRPO updates (= policy versions)
    rl.tasks_per_step = 8  # task groups per rollout batch
    # Dynamic sampling (DAPO, Yu et al. 2025): a rollout batch samples further rounds
    # of tasks_per_step new tasks until tasks_per_step of its groups have reward
    # variance (the only groups GRPO learns from), at most this many rounds; 1: off.
    rl.sample_rounds = 1
    rl.updates_per_batch = 1  # optimizer steps per rollout batch (slices of its rows)
    rl.microbatches = 1
    # Rows per forward/backward pass (0: no cap). A rollout batch's row count varies
    # with its episodes' lengths; with a cap, its update accumulates gradients over
    # as many microbatches as keep each at most this many rows (and old log-probs are
    # computed in slices as large), so host/device memory is bounded by the cap, not
    # by the batch (tiny: 32 rows x 1024 in one pass needed ~12 GB of temporaries).
    rl.microbatch_rows = 0
    rl.train_seq_len = 2048  # trainer row length (a segment longer than this is cut)
    rl.max_staleness = 1  # accept rollouts at most this many policy versions old
    rl.tool_workers = 2  # sandbox worker processes (local) or actors (ray)
    # Where episodes' tool calls run (cursor_rl/env/ray_pool.py): "local", the process
    # pool on this machine, or "ray", actors on a Ray cluster (the ray extra).
    rl.tool_backend = "local"
    rl.ray = ml_collections.ConfigDict()
    rl.ray.address = ""  # ray.init(address=...); "": a local Ray
    rl.ray.max_in_flight = 64  # opens/calls/closes/grades queued or running at once
    rl.ray.max_retries = 1  # worker deaths an episode survives (by replay), then lost
    rl.ray.num_cpus_per_worker = 1.0
    rl.ray.ship_workspaces = True  # trees via the object store (no shared filesystem)
    rl.ray.object_store_memory_mb = 0  # a local Ray's object store (0: Ray's default)
    rl.keep_policies = 3  # published policy versions kept on disk
    rollout = dataclasses.asdict(RolloutConfig())
    for shared in ("system_prompt", "tools_style"):  # from the harness section
        rollout.pop(shared)
    rl.rollout = ml_collections.ConfigDict(rollout)
    rl.reward = ml_collections.ConfigDict(dataclasses.asdict(RewardConfig()))
    rl.grpo = ml_collections.ConfigDict(dataclasses.asdict(GRPOConfig()))
    # Textual feedback (rl.feedback): a hint where an episode went wrong makes the
    # policy a teacher of the tokens after it; off by default.
    rl.feedback = ml_collections.ConfigDict(dataclasses.asdict(FeedbackConfig()))
    rl.sampler = ml_collections.ConfigDict()
    rl.sampler.num_slots = 16
    rl.sampler.max_seq_len = 4096
    # Compiled prefill and decode programs kept per kind, one per shape bucket, the
    # least recently used dropped past it (0: keep all). On XLA:CPU each holds ~25 MB
    # of host memory (sampler/engine.py note 6).
    rl.sampler.max_programs = 0
    # Padded tokens (rows x chunk length) per prefill call, more rows split over
    # several calls (vLLM's max_num_batched_tokens); 0: no cap (sampler/engine.py note 5).
    rl.sampler.prefill_tokens = 8192
    rl.sampler.mesh = ml_collections.ConfigDict()  # axis sizes; empty: the default device
    rl.eval = ml_collections.ConfigDict()
    rl.eval.every = 10  # RL steps between held-out evals (0: before and after only; -1: none)
    # Samples per task (pass@k and best-of-k for k up to this): 16, the best-of-16
    # Composer 2 tracks. Budget-bound configs lower it (configs/tiny.py: 4).
    rl.eval.samples = 16
    rl.eval.num_tasks = 0  # 0: every bench task
    rl.eval.temperature = 1.0
    rl.eval.seed = 1234
    rl.eval.bench_name = "tiny_bench"
    # Also keep each eval episode's token trajectory in eval/<bench>/results.jsonl
    # (read them back as text with `python -m cursor_rl.eval.transcripts`).
    rl.eval.save_trajectories = False
    # Also evaluate the long-context checkpoint (the model before SFT) once, before RL,
    # as stage "base": the report's learning table reads base -> SFT -> RL.
    rl.eval.base = True
    # The saturation registry (cursor_rl.eval.registry): empty, the run's own
    # WORKDIR/eval/registry.json; else one registry shared by every run of the
    # experiment (an absolute path or gs:// URL), so a benchmark retired by one run
    # is not evaluated by the next.
    rl.eval.registry = ""
    # A benchmark is retired once an eval's pass@1 reaches this (Composer 2: 90%).
    rl.eval.retire_at = 0.9
    rl.tasks = ml_collections.ConfigDict()
    rl.tasks.train = ""  # a task dataset directory; empty: build the family into WORKDIR/tasks
    rl.tasks.bench = ""
    rl.tasks.family = "tiny"
    rl.tasks.train_count = 256
    # RL draws only from the training tasks SFT has no demonstration of (the first
    # sft_data.demos are demonstrated): GRPO's reward then measures the skill, not
    # recall of demonstrated modules (docs/learning.md section 7).
    rl.tasks.skip_demonstrated = False
    rl.tasks.bench_count = 64
    rl.tasks.build_seed = 0
    rl.tasks.generators = ()  # generator names to build with (empty: all registered)
    rl.tasks.max_per_generator = 2  # tasks per repository and generator
    return rl


def base_config() -> ml_collections.ConfigDict:
    """Defaults for every section; experiment configs change what they need."""
    c = ml_collections.ConfigDict()
    c.stage = "all"  # pretrain | long_context | sft | all (the three in order)
    c.seed = 0
    # The base model the first stage starts from (cursor_rl.bases): "none" (random
    # weights), a built-in name ("tiny") or an HF directory of the project's export.
    c.init_from = "none"
    c.model = model_section(ModelConfig())

    c.mesh = ml_collections.ConfigDict()
    # Axis sizes within a slice; -1 takes the remaining devices.
    c.mesh.ici = ml_collections.ConfigDict(
        {"data": -1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1}
    )
    # Axis sizes across slices (multi-slice TPU, over DCN): only data may be > 1.
    c.mesh.dcn = ml_collections.ConfigDict({"data": 1})
    c.mesh.rules_preset = "default"
    c.mesh.rules = ml_collections.ConfigDict()  # logical name -> mesh axis override

    c.tokenizer = ml_collections.ConfigDict()
    c.tokenizer.vocab_size = 2048
    c.tokenizer.path = ""  # an existing tokenizer.json (e.g. a real model's) instead of training

    # The fields of cursor_rl.data.pipeline.DataConfig (documented there), plus:
    # process_sharding: "documents" (each process reads its own share: scales) or
    # "rows" (every process reads the global stream and keeps its rows: results are
    # independent of the process count).
    c.data = ml_collections.ConfigDict(_data_defaults())
    c.data.process_sharding = "documents"

    c.train = ml_collections.ConfigDict()
    c.train.num_steps = 100
    c.train.batch_size = 8  # sequences per step (global)
    c.train.seq_len = 256
    c.train.microbatches = 1  # gradient accumulation: batch_size splits into this many
    c.train.z_loss = 0.0  # coefficient of log(Z)^2 (PaLM), 0 = off
    c.train.loss_chunk_size = 0  # project to the vocabulary this many positions at a time
    c.train.log_every = 10
    # Steps dispatched but not finished, at most (0: no limit, JAX's asynchronous
    # dispatch). XLA:CPU allocates a step's temporaries when it is enqueued, so a
    # second step queued behind a running one holds a second set: 1 on the CPU keeps
    # one (tiny pretraining: 2.0 instead of 3.0 GiB); on TPU/GPU queued steps hold
    # none and the queue hides the host's dispatch time.
    c.train.max_steps_in_flight = 0
    c.train.eval_every = 50
    c.train.eval_batches = 4
    c.train.init_from = ""  # checkpoint dir to start from (else the previous stage's)
    c.train.probe_every = 0  # log the copy probe (cursor_rl.train.copy_probe) every N steps
    # Return the host allocator's free pages to the system (hostmem.release_free_memory)
    # after a stage's first logged window (the compiler's scratch is free by then) and
    # before and after each eval, probe or checkpoint; in RL after each rollout batch,
    # update and eval.
    # What runs between two steps lands in the span the step's temporaries freed, so
    # the next step takes a fresh block and a caching allocator (tcmalloc) keeps both
    # resident: the same stage peaked 0.5 GiB higher in one run than in another.
    c.train.release_memory = True

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.name = "adamw"  # adamw | muon
    c.optimizer.learning_rate = 3e-3
    c.optimizer.schedule = "cosine"  # cosine | wsd (warmup-stable-decay) | constant
    c.optimizer.warmup_steps = 10
    c.optimizer.decay_fraction = 0.2  # wsd: final fraction of steps spent decaying
    c.optimizer.min_lr_ratio = 0.1
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.95
    c.optimizer.muon_beta = 0.95  # Muon momentum (AdamW-handled leaves use b1/b2)
    # Muon on routed-expert weights with whole matrices per device (an all-to-all
    # before and after Newton-Schulz; train/optimizer.py `_spread`). It pays where each
    # device holds many experts (Kimi-K2 at expert=8: 111 -> 91 GiB a chip) and costs
    # where it holds few (expert=64: 65.9 -> 70.0 GiB), AOT-measured on v5p-512.
    c.optimizer.muon_spread_experts = False
    c.optimizer.eps = 1e-8
    c.optimizer.weight_decay = 0.1  # not applied to norms, biases or embeddings
    c.optimizer.clip_norm = 1.0
    # MuonClip's QK-clip threshold tau on attention logits (Kimi K2: 100); 0 = off.
    # After each update, heads whose max pre-softmax logit exceeded tau get their
    # query/key weights scaled down to bound it (cursor_rl/train/optimizer.py note 5).
    c.optimizer.qk_clip_tau = 0.0

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 50
    c.checkpoint.keep_last = 2
    c.checkpoint.keep_every = 0  # also keep every K-th step forever (0 = off)
    c.checkpoint.async_save = True
    c.checkpoint.fallback_to_previous = True  # a corrupt latest checkpoint -> use the one before

    # The agent harness, shared by SFT demonstrations and RL episodes.
    c.harness = ml_collections.ConfigDict()
    c.harness.system_prompt = DEFAULT_SYSTEM_PROMPT
    c.harness.tools_style = "json"  # json | compact (protocol.tools_prompt)

    # SFT demonstrations generated for this run: the scripted solver on the run's
    # training tasks (rl.tasks), in the harness; 0 = only data.sft_sources.
    c.sft_data = ml_collections.ConfigDict()
    c.sft_data.demos = 0
    c.sft_data.plan = "full"  # full | short (cursor_rl.tasks.builtin_sft.plan_episode)
    # Share of the demonstrations that follow a mid-episode hint (the ``hinted`` plan:
    # textual feedback's hint for submitting untested, then the check it asks for).
    c.sft_data.hinted_share = 0.0
    c.sft_data.workers = 2

    c.rl = _rl_defaults()

    c.stage_overrides = ml_collections.ConfigDict()
    for stage in STAGES:
        c.stage_overrides[stage] = ml_collections.ConfigDict()
    return c
