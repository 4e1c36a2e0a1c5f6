"""The whole recipe in order: pretrain -> long-context -> SFT -> RL (with eval) -> report.

``main.py`` calls ``run``; ``config.stage`` picks one stage or ``all``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time

import jax
import ml_collections
from jax.experimental import multihost_utils

from cursor_rl import hostmem, stages
from cursor_rl.env import tools as env_tools
from cursor_rl.eval import report
from cursor_rl.rl import hints
from cursor_rl.rl import loop as rl_loop
from cursor_rl.tasks import builtin_sft, records
from cursor_rl.train import loop as train_loop
from cursor_rl.workdir import Workdir


@dataclasses.dataclass
class StageRow:
    """One line of the console summary."""

    stage: str
    steps: int
    tokens: int | None
    train: str  # final train loss, or RL reward
    eval: str  # held-out loss first -> last, or pass@1 before -> after
    wall_s: float
    peak_rss: int = 0  # this process's peak resident bytes during the stage


def _train_row(r: train_loop.StageResult) -> StageRow:
    ev = "-" if r.eval_loss is None else f"{r.eval_loss:.3f}"
    if r.first_eval_loss is not None and r.eval_loss is not None:
        ev = f"loss {r.first_eval_loss:.3f} -> {r.eval_loss:.3f}"
    train = "-" if r.train_loss is None else f"loss {r.train_loss:.3f}"
    return StageRow(r.stage, r.steps, r.tokens, train, ev, r.wall_s)


def _rl_row(r: dict) -> StageRow:
    before, after = r.get("before", {}), r.get("after", {})
    ev = "-"
    if "pass@1" in after:
        first = f"{before['pass@1']:.3f}" if "pass@1" in before else "?"
        ev = f"pass@1 {first} -> {after['pass@1']:.3f}"
    reward = r.get("reward")
    train = "-" if reward is None else f"reward {reward:.3f}"
    return StageRow("rl", int(r.get("steps", 0)), None, train, ev, float(r.get("wall_s", 0.0)))


def prepare_sft_data(
    config: ml_collections.ConfigDict, workdir: Workdir | str
) -> ml_collections.ConfigDict:
    """Generates the run's SFT demonstrations (``sft_data``) if wanted; returns the config
    whose SFT stage reads them.

    The scripted solver runs on the first ``sft_data.demos`` of the run's training tasks
    (``sft_data.hinted_share`` of them with the ``hinted`` plan, builtin_sft choice 5)
    (the RL stage's datasets, built now if needed; ``rl.tasks.skip_demonstrated`` keeps
    RL off them) in the real harness, with the run's system prompt and tool
    listing, so SFT teaches exactly the episode format RL samples in. The data
    pipeline reads the file locally: with a remote workdir it is written to the local
    cache and copied to the workdir (and back, for a job restarted elsewhere).
    """
    n = int(config.sft_data.demos)
    if n <= 0:
        return config
    workdir = Workdir.of(workdir)
    path = workdir.local_path(workdir.sft_demos_file)
    have = workdir.fetch(workdir.sft_demos_file)
    if jax.process_index() == 0 and not have:
        start = time.time()
        train_dir, _ = rl_loop.task_datasets(stages.stage_config(config, "rl"), workdir)
        tasks = records.load_tasks(os.path.join(train_dir, records.TASKS_FILE))[:n]
        share = float(config.sft_data.get("hinted_share", 0.0))
        tool_names = ", ".join(spec.name for spec in env_tools.TOOL_SPECS)
        demos = list(
            builtin_sft.demonstrations(
                tasks,
                dataset_dir=train_dir,
                plans=builtin_sft.hinted_plans(len(tasks), config.sft_data.plan, share),
                hint=hints.HINTS["submitted_without_tests"].format(
                    tools=tool_names, tool="", path=""
                ),
                tools_style=config.harness.tools_style,
                workers=int(config.sft_data.workers),
                log=lambda line: None,
            )
        )
        os.makedirs(os.path.dirname(path), exist_ok=True)
        builtin_sft.write_demonstrations(path + ".tmp", demos)
        os.replace(path + ".tmp", path)
        workdir.publish(workdir.sft_demos_file)
        print(
            f"[sft_data] {len(demos)} demonstrations of {len(tasks)} tasks in "
            f"{time.time() - start:.0f}s -> {workdir.sft_demos_file}",
            flush=True,
        )
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("sft_data")
        if not workdir.fetch(workdir.sft_demos_file):
            raise FileNotFoundError(f"process 0 wrote no SFT demonstrations at {path}")
    config = ml_collections.ConfigDict(config.to_dict())
    config.stage_overrides.sft.data = {
        **config.stage_overrides.sft.get("data", ml_collections.ConfigDict()).to_dict(),
        "sft_sources": (path,),
    }
    return config


def run(config: ml_collections.ConfigDict, workdir: Workdir | str) -> list[StageRow]:
    """Runs ``config.stage`` and writes the report; returns the summary rows.

    ``workdir`` is resolved here once (absolute, ``~`` expanded) and handed to every
    stage as a ``Workdir``.
    """
    if config.stage not in stages.PIPELINE_STAGES:
        raise ValueError(f"stage={config.stage!r} is not one of {stages.PIPELINE_STAGES}")
    workdir = Workdir.of(workdir)
    rows: list[StageRow] = []
    # Every invocation records its config, the RL stage's alone too: readers of a run
    # (cursor_rl.outer) take its task datasets and rollout settings from it.
    train_loop.write_config(config, workdir)
    train_stages = [s for s in stages.TRAIN_STAGES if config.stage in ("all", s)]
    for stage in train_stages:
        if stage == "sft":
            config = prepare_sft_data(config, workdir)
        hostmem.reset_peak()
        rows.append(_train_row(train_loop.run_stage(config, stage, workdir)))
        rows[-1].peak_rss = _stage_done(stage)
    if config.stage in ("all", "rl"):
        hostmem.reset_peak()
        rows.append(_rl_row(rl_loop.run_rl(config, workdir)))
        rows[-1].peak_rss = _stage_done("rl")
    if jax.process_index() == 0:
        report.write_report(workdir)
    return rows


def _stage_done(stage: str) -> int:
    """Logs the stage's peak resident memory (see ``hostmem``) and returns it, then
    hands what the stage freed back to the system: its compiled programs (JAX's
    caches) and the allocator's free pages, so the next stage starts small."""
    peak = hostmem.peak_bytes()
    jax.clear_caches()
    gc.collect()
    hostmem.release_free_memory()
    if jax.process_index() == 0:
        scope = "stage" if hostmem.peak_is_per_stage() else "process lifetime"
        now = hostmem.gib(hostmem.rss_bytes())
        print(f"[{stage}] peak RSS {hostmem.gib(peak)} ({scope}), now {now}", flush=True)
    return peak


def summary_table(rows: list[StageRow]) -> str:
    """The console summary: stage, steps, tokens, train and eval figures, wall time."""
    lines = [
        f"{'stage':<13} {'steps':>6} {'tokens':>11} {'train':>14} {'eval':>26} {'wall':>7}"
        f" {'peak RSS':>9}"
    ]
    for r in rows:
        tokens = "-" if r.tokens is None else f"{r.tokens:,}"
        lines.append(
            f"{r.stage:<13} {r.steps:>6} {tokens:>11} {r.train:>14} {r.eval:>26} {r.wall_s:>6.0f}s"
            f" {r.peak_rss / 2**30:>7.2f}GB"
        )
    return "\n".join(lines)
