"""The benchmark runner: sample a benchmark, keep every episode, summarize.

    summary = evaluate(runner, bench_tasks, samples=8, seed=0, bench_name="tiny_bench",
                       out_dir=Workdir(workdir).eval_dir, stage="rl", step=step)
    writer.write("rl", step, eval_row(summary))         # -> WORKDIR/metrics.jsonl
    registry.record(summary)           # -> WORKDIR/eval/registry.records/ (or rl.eval.registry)

Choices:

1. **The RL rollout path is the eval path.** ``evaluate`` calls the same
   ``RolloutRunner.run`` (same harness, sandbox, grader, sampling settings) with
   ``group_size=samples``, so eval and training episodes cannot drift apart.
2. **Every episode is kept** as one JSON line in ``OUT_DIR/<bench>/results.jsonl``,
   appended across evals (a run's whole history in one file), tagged with stage,
   step, seed and policy version: the raw material to recompute any metric later.
   A line carries the reward's inputs (grade counts, generated tokens, tool calls)
   and lengths, not the trajectory (large) unless ``save_trajectories``.
3. **Two policy-version fields**: ``policy_version`` is what the caller says it
   evaluated (a checkpoint step); ``policy_versions`` is what the sampler reported
   for the episode's turns, so a policy swap in the middle of an eval shows.
4. **One flat row per eval** (``eval_row``) for ``metrics.jsonl``: ``bench``
   marks it as a held-out eval (RL training rows carry ``pass@1`` too, without
   ``bench``); ``k`` is the largest kept ``k`` and ``pass@k`` / ``best_of_k`` its
   values; per-category keys are suffixed ``/<category>``. The row carries the
   bootstrap 95% interval over tasks (``metrics.bootstrap_ci``) of the three
   headline values as ``<metric>_ci_low`` / ``<metric>_ci_high``, and
   ``samples_per_task``, so a report can print "pass@1 [CI], tasks x samples" from
   the row alone.
5. Object-store paths (``gs://``) cannot append, so there the file is rewritten
   whole (``cursor_rl.workdir.append_text``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

from etils import epath

from cursor_rl.chat.episodes import task_reward
from cursor_rl.eval import metrics
from cursor_rl.workdir import append_text

RESULTS_FILE = "results.jsonl"


def evaluate(
    runner: Any,
    tasks: Sequence[Any],
    *,
    samples: int,
    seed: int,
    bench_name: str,
    out_dir: str | os.PathLike,
    stage: str,
    step: int,
    k_values: Sequence[int] | None = None,
    partial_credit: bool = False,
    policy_version: int | None = None,
    save_trajectories: bool = False,
) -> dict[str, Any]:
    """Samples ``samples`` episodes per benchmark task, records them and summarizes.

    Args:
      runner: a ``cursor_rl.rl.rollout.RolloutRunner`` (anything with its ``run``).
      tasks: the benchmark's ``TaskRecord``s.
      samples: episodes per task (the ``n`` of pass@k).
      seed: the rollout seed (fixed across evals, so successive evals of a run
        differ only by the policy).
      bench_name: the benchmark's name: the results subdirectory, the registry key.
      out_dir: the eval directory (``WORKDIR/eval``).
      stage: the stage whose policy is evaluated (``sft`` or ``rl``).
      step: that stage's step.
      k_values: the ``k`` of pass@k / best-of-k (default ``default_k_values``).
      partial_credit: task reward with partial credit (for best-of-k).
      policy_version: the policy version evaluated, recorded with every episode.
      save_trajectories: also write each episode's token-level trajectory.

    Returns:
      ``metrics.summarize``'s dict plus ``bench``, ``stage``, ``step``, ``seed``,
      ``samples``, ``policy_version`` and ``seconds`` (the eval's wall time).
    """
    start = time.time()
    episodes = runner.run(list(tasks), seed=seed, group_size=samples)
    seconds = time.time() - start
    context = {
        "bench": bench_name,
        "stage": stage,
        "step": int(step),
        "seed": int(seed),
        "policy_version": policy_version,
    }
    lines = [
        json.dumps(_episode_record(e, context, partial_credit, save_trajectories)) for e in episodes
    ]
    append_text(epath.Path(out_dir) / bench_name / RESULTS_FILE, "".join(f"{x}\n" for x in lines))
    summary = metrics.summarize(
        episodes, k_values or metrics.default_k_values(samples), partial_credit=partial_credit
    )
    summary.update(context, samples=int(samples), seconds=seconds)
    return summary


def _episode_record(
    episode: Any, context: dict[str, Any], partial_credit: bool, save_trajectories: bool
) -> dict[str, Any]:
    outcome = episode.outcome()
    record = {
        **context,
        "time": time.time(),
        "policy_versions": sorted(set(episode.turn_versions)),
        "task_id": episode.task_id,
        "category": episode.category,
        "task_index": episode.task_index,
        "sample": episode.sample,
        "finish_reason": episode.finish_reason,
        "resolved": outcome.resolved,
        "task_reward": task_reward(outcome, partial_credit),
        "fail_to_pass_passed": outcome.fail_to_pass_passed,
        "fail_to_pass_total": outcome.fail_to_pass_total,
        "pass_to_pass_broken": outcome.pass_to_pass_broken,
        "flags": list(episode.grade.get("flags", [])),
        "generated_tokens": outcome.generated_tokens,
        "tool_calls": outcome.tool_calls,
        "segments": episode.segments,
        "summary_tokens": list(episode.summary_tokens),
        "seconds": dict(episode.seconds),
    }
    if save_trajectories:
        record["trajectory"] = episode.trajectory.to_json_dict()
    return record


def eval_row(summary: dict[str, Any]) -> dict[str, Any]:
    """The flat ``metrics.jsonl`` row of one eval (without ``stage``/``step``, which
    ``MetricsWriter.write(stage, step, row)`` adds).

    Args:
      summary: what ``evaluate`` returned.

    Returns:
      ``bench``, ``pass@1``, ``k``, ``pass@k``, ``best_of_k``, ``pass@K`` and
      ``best_of_K`` for every kept ``K``, the interval bounds ``pass@1_ci_low``,
      ``pass@1_ci_high``, ``pass@k_ci_low``, ``pass@k_ci_high``,
      ``best_of_k_ci_low``, ``best_of_k_ci_high`` and their ``ci_level``, the counts
      (``tasks``, ``samples_per_task``, ``episodes``, ``lost``), ``task_reward``,
      mean ``generated_tokens``, ``tool_calls`` and ``segments``, ``finish/<reason>``
      fractions of episodes, and ``pass@1/<cat>``, ``pass@k/<cat>``,
      ``best_of_k/<cat>`` per category.
    """
    ks = summary["k_values"]
    overall = summary["overall"]
    row: dict[str, Any] = {"bench": summary.get("bench")}
    row.update(_headline(overall, ks))
    for k in ks:
        row[f"pass@{k}"] = overall[f"pass@{k}"]
        row[f"best_of_{k}"] = overall[f"best_of_{k}"]
    intervals = overall.get("ci", {})
    if ks:
        for name, key in (
            ("pass@1", "pass@1"),
            ("pass@k", f"pass@{ks[-1]}"),
            ("best_of_k", f"best_of_{ks[-1]}"),
        ):
            if intervals.get(key) is not None:
                row[f"{name}_ci_low"], row[f"{name}_ci_high"] = intervals[key]
        row["ci_level"] = summary.get("ci_level")
    row["samples_per_task"] = summary.get("samples_per_task")
    for key in (
        "tasks",
        "episodes",
        "lost",
        "task_reward",
        "generated_tokens",
        "tool_calls",
        "segments",
    ):
        row[key] = overall[key]
    total = sum(overall["finish_reasons"].values())
    for reason, count in overall["finish_reasons"].items():
        row[f"finish/{reason}"] = count / total
    for category, group in summary["categories"].items():
        for key, value in _headline(group, ks).items():
            if key != "k":
                row[f"{key}/{category}"] = value
    return row


def _headline(group: dict[str, Any], ks: Sequence[int]) -> dict[str, Any]:
    """pass@1, and pass@k / best_of_k at the largest kept k (empty with no scored task)."""
    if not ks:
        return {}
    k = ks[-1]
    return {
        "pass@1": group["pass@1"],
        "k": k,
        "pass@k": group[f"pass@{k}"],
        "best_of_k": group[f"best_of_{k}"],
    }
