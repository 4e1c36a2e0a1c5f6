"""The run report: ``WORKDIR/report.md`` and PNG plots from ``WORKDIR/metrics.jsonl``.

    python -m cursor_rl.eval.report --workdir=DIR      # or write_report(workdir)

Choices:

1. **metrics.jsonl is the main input** (plus the saturation registry, the
   held-out evals' episodes for the paired comparisons and the watchdog's event
   log, ``WORKDIR/ops/events.jsonl``), read with
   ``cursor_rl.train.metrics.read_metrics``, so a report can be written at any time,
   for a finished run or one still going, on a machine with no accelerator.
2. **Held-out eval rows are the rows with a ``bench`` key** (``runner.eval_row``);
   every other row is a training row. RL training rows carry ``pass@1`` too (the
   rollouts' success), so the key alone cannot tell them apart.
3. **Before vs after RL** per benchmark: the last eval of stage ``sft`` (the SFT
   checkpoint, evaluated before RL starts) against the last of stage ``rl`` (or
   ``eval``): pass@1, pass@k, best-of-k, each per category, and episode lengths.
   The "Learning" section adds the last eval of stage ``base`` (the long-context
   checkpoint, before SFT; ``rl.eval.base``) and reads the three as base -> SFT ->
   RL, each value with its bootstrap 95% interval over tasks
   (``<metric>_ci_low`` / ``<metric>_ci_high`` of the row, ``runner.eval_row``).
   Next to it: the copy probe of each training stage, first -> last
   (``copy_probe``, ``train.probe_every``), the mean RL reward per step, and the
   self-summarisation totals of the RL rollouts (``summarised_episodes`` of
   ``scored_episodes`` per step, with ``summarised_reward`` and
   ``unsummarised_reward``, from ``rl.loop.score_groups``).
   **Discrimination**: for each pair of those checkpoints (base -> SFT, SFT -> RL,
   base -> RL) the difference of their pass@1 on the tasks both were evaluated on,
   with a paired bootstrap interval over tasks (``metrics.paired_difference``, from
   each eval's episodes in ``WORKDIR/eval/<bench>/results.jsonl``: the lines of
   that eval's stage and step), and a line saying which pairs the benchmark
   separates (the interval excludes 0) and which it does not. A benchmark that
   separates none of a run's checkpoints measures nothing about that run.
4. **A restart may log a step twice**; series keep the last row of each step, in
   step order. Wall time of a stage is the span of its rows' ``time`` (downtime
   between a crash and its resume included).
5. **Whatever is missing is skipped**: a stage, a metric, a plot with no data or an
   unreadable registry leaves a line saying so, never an exception, so a partial run
   still gets its report.
7. **The registry is the run's**: ``--registry`` if given, else the config's
   ``rl.eval.registry`` (read from ``WORKDIR/config.json``; a shared registry holds
   every run of the experiment), else ``WORKDIR/eval/registry.json``; its section
   lists each benchmark's status and its last evals across runs.
6. **Plots use matplotlib's object API on an Agg canvas** (no pyplot): nothing
   global (backend, open-figure registry) changes in the process that calls it.

Plots written (when their data exists): ``loss.png`` (train and eval loss, a panel
per stage), ``rl_reward.png`` (RL reward; train pass@1 and held-out pass@1 /
best-of-k over RL steps, the base and SFT checkpoints' held-out pass@1 as
baselines), ``rl_length.png`` (generated tokens and tool calls per episode over RL
steps), ``learning.png`` (held-out pass@1 and best-of-k of base, SFT and RL with
their intervals), ``copy_probe.png`` (the copy probe over steps, a panel per stage),
``feedback.png`` (the share of episodes each textual-feedback detector fired on, over
RL steps, a panel per detector; with ``--baseline`` the other run's curves too).
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from absl import app, flags
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from cursor_rl.eval import metrics as metrics_lib
from cursor_rl.eval import registry as registry_lib
from cursor_rl.eval.runner import RESULTS_FILE
from cursor_rl.ops import detectors, heartbeat
from cursor_rl.train.metrics import read_metrics
from cursor_rl.workdir import Workdir, write_text_atomic

STAGE_ORDER = ("pretrain", "long_context", "sft", "rl", "eval")
AFTER_STAGES = ("rl", "eval")
BASE_STAGE = "base"  # the eval of the model before SFT (rl.loop.evaluate_base)
# The learning table's rows: label, the eval stages whose last row it shows, and
# what to say when there is none.
CHECKPOINTS = (
    ("base", (BASE_STAGE,), "not evaluated (rl.eval.base off, or no long_context checkpoint)"),
    ("SFT", ("sft",), "not evaluated (no eval before RL)"),
    ("RL", AFTER_STAGES, "not evaluated (no eval after RL yet)"),
)
MAX_STEP_ROWS = 25  # the RL per-step table shows at most this many steps
_HEADLINE = ("pass@1", "pass@k", "best_of_k")
_CATEGORY_KEY = re.compile(r"^(pass@1|pass@k|best_of_k)/(.+)$")


def write_report(
    workdir: Workdir | str,
    *,
    registry_path: str | None = None,
    baseline: Workdir | str | None = None,
) -> str:
    """Writes ``WORKDIR/report.md`` and its PNG plots.

    Args:
      workdir: the run's directory (local or ``gs://``).
      registry_path: the saturation registry (default: the config's
        ``rl.eval.registry``, else ``WORKDIR/eval/registry.json``; choice 7).
      baseline: another run to compare with (e.g. the same seed with textual feedback
        off): its behaviour rates and held-out pass@1 join the feedback section and
        ``feedback.png``.

    Returns:
      The report's path.
    """
    workdir = Workdir.of(workdir)
    workdir.root.mkdir(parents=True, exist_ok=True)
    rows = read_metrics(workdir)
    evals = [r for r in rows if "bench" in r]
    training = [r for r in rows if "bench" not in r]
    stages = _stages(rows)
    plots = {
        "loss.png": _plot_losses(training, stages),
        "rl_reward.png": _plot_rl_reward(training, evals),
        "rl_length.png": _plot_rl_length(training),
        "learning.png": _plot_learning(evals),
        "copy_probe.png": _plot_copy_probe(training, stages),
    }
    base_rows = read_metrics(baseline) if baseline is not None else None
    plots["feedback.png"] = _plot_feedback(rows, base_rows)
    written = []
    for name, figure in plots.items():
        if figure is not None:
            with workdir.plot_file(name).open("wb") as fh:
                figure.savefig(fh, format="png", dpi=110)
            written.append(name)
    registry = _registry(workdir, registry_path)
    sections = [
        f"# Run report: {workdir}",
        f"Written {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')} "
        f"from {len(rows)} rows of metrics.jsonl.",
        "## Stages\n\n" + _stage_table(rows, stages),
        "## Learning\n\n" + _learning(evals, training, stages, workdir),
        "## RL\n\n" + _rl_table(training),
        "## Held-out benchmark: before vs after RL\n\n" + _before_after(evals),
        "## Textual feedback\n\n" + _feedback(rows, base_rows, baseline),
        "## Plots\n\n" + _plot_links(written),
        "## Benchmark registry\n\n" + _registry_status(registry),
        "## Operations (watchdog)\n\n" + _operations(heartbeat.read_events(workdir)),
    ]
    path = workdir.report_file
    write_text_atomic(path, "\n\n".join(sections) + "\n")
    return os.fspath(path)


# ---- rows -----------------------------------------------------------------------


def _stages(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Stages present, in recipe order, then any others in order of appearance (not
    ``base``: it labels an eval of the long-context checkpoint, not a stage that ran)."""
    seen = [s for s in dict.fromkeys(r["stage"] for r in rows if "stage" in r) if s != BASE_STAGE]
    return [s for s in STAGE_ORDER if s in seen] + [s for s in seen if s not in STAGE_ORDER]


def _of_stage(rows: Iterable[dict[str, Any]], stage: str) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("stage") == stage]


def _by_step(rows: Iterable[dict[str, Any]], key: str) -> dict[int, dict[str, Any]]:
    """The last row of each step that has a number under ``key``, in step order
    (choice 4)."""
    last = {int(r["step"]): r for r in rows if _number(r.get(key)) and "step" in r}
    return dict(sorted(last.items()))


def _series(rows: Iterable[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key``: the last row of each step, in step order (choice 4)."""
    by_step = _by_step(rows, key)
    return list(by_step), [float(r[key]) for r in by_step.values()]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _first_last(rows: Sequence[dict[str, Any]], key: str) -> str:
    _, values = _series(rows, key)
    if not values:
        return "-"
    if len(values) == 1:
        return _fmt(values[0])
    return f"{_fmt(values[0])} → {_fmt(values[-1])}"


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        # Lengths run to thousands of tokens; rates and losses need the decimals.
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.{digits}f}"
    return str(value)


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


# ---- markdown sections -------------------------------------------------------------


def _stage_table(rows: Sequence[dict[str, Any]], stages: Sequence[str]) -> str:
    if not stages:
        return "No metrics rows yet."
    body = []
    for stage in stages:
        mine = _of_stage(rows, stage)
        steps = max((int(r["step"]) for r in mine if "step" in r), default=0)
        _, tokens = _series(mine, "tokens")
        times = [float(r["time"]) for r in mine if _number(r.get("time"))]
        wall = f"{max(times) - min(times):.0f} s" if len(times) > 1 else "-"
        body.append(
            [
                stage,
                str(steps),
                f"{int(tokens[-1]):,}" if tokens else "-",
                _first_last([r for r in mine if "bench" not in r], "ce_loss"),
                _first_last(mine, "eval_loss"),
                wall,
            ]
        )
    header = ["stage", "steps", "tokens", "train loss", "eval loss", "wall time"]
    return _table(header, body)


def _rl_table(training: Sequence[dict[str, Any]]) -> str:
    rl = _of_stage(training, "rl")
    keys = ("reward", "pass@1", "best_of_k", "generated_tokens", "tool_calls", "segments")
    body = [[key, _first_last(rl, key)] for key in keys if _series(rl, key)[0]]
    if not body:
        return "No RL training rows."
    return "Training rollouts, first → last logged step.\n\n" + _table(
        ["metric", "first → last"], body
    )


def _learning(
    evals: Sequence[dict[str, Any]],
    training: Sequence[dict[str, Any]],
    stages: Sequence[str],
    workdir: Workdir,
) -> str:
    return "\n\n".join(
        [
            "### Held-out benchmark: base → SFT → RL\n\n" + _checkpoint_tables(evals),
            "### Discrimination between checkpoints\n\n" + _discrimination(workdir, evals),
            "### Copy probe\n\n" + _copy_probe_table(training, stages),
            "### RL reward per step\n\n" + _reward_steps(training),
            "### Self-summarisation in RL rollouts\n\n" + _summarisation(training),
        ]
    )


def _checkpoint_tables(evals: Sequence[dict[str, Any]]) -> str:
    if not evals:
        return "No held-out evaluation recorded."
    parts = []
    for bench in dict.fromkeys(r["bench"] for r in evals):
        picked = _checkpoint_evals([r for r in evals if r["bench"] == bench])
        present = [row for _, row, _ in picked if row is not None]
        ks = {row.get("k") for row in present}
        k = ks.pop() if len(ks) == 1 else None
        level = next((r["ci_level"] for r in present if _number(r.get("ci_level"))), 0.95)
        ci = f"[{level:.0%} CI]"
        header = [
            "checkpoint",
            "eval",
            f"pass@1 {ci}",
            f"pass@{k or 'k'} {ci}",
            f"best-of-{k or 'k'} {ci}",
            "tasks × samples",
        ]
        body, missing = [], []
        for label, row, why in picked:
            if row is None:
                body.append([label, "-", "-", "-", "-", "-"])
                missing.append(f"{label}: {why}.")
                continue
            suffix = "" if k is not None else f" (k={row.get('k', '-')})"
            body.append(
                [
                    label,
                    f"{row.get('stage')} step {row.get('step')}",
                    _with_ci(row, "pass@1"),
                    _with_ci(row, "pass@k") + suffix,
                    _with_ci(row, "best_of_k") + suffix,
                    f"{_fmt(row.get('tasks'))} × {_fmt(row.get('samples_per_task'))}",
                ]
            )
        text = f"#### {bench}\n\n" + _table(header, body)
        if missing:
            text += "\n\n" + "\n".join(f"- {line}" for line in missing)
        parts.append(text)
    note = (
        "Intervals: percentile bootstrap over tasks (cursor_rl.eval.metrics.bootstrap_ci: "
        "tasks resampled with replacement, seeded; a task's pass@1 is the fraction of its "
        "samples that passed)."
    )
    return "\n\n".join([note, *parts])


def _discrimination(workdir: Workdir, evals: Sequence[dict[str, Any]]) -> str:
    """Choice 3's discrimination: paired pass@1 differences between checkpoints."""
    if not evals:
        return "No held-out evaluation recorded."
    parts = [
        "Δ pass@1 = later − earlier checkpoint on the tasks both were evaluated on; "
        f"paired bootstrap {metrics_lib.CI_LEVEL:.0%} interval over tasks "
        "(cursor_rl.eval.metrics.paired_difference). A pair is separated when its "
        "interval excludes 0."
    ]
    for bench in dict.fromkeys(r["bench"] for r in evals):
        picked = _checkpoint_evals([r for r in evals if r["bench"] == bench])
        present = [(label, row) for label, row, _ in picked if row is not None]
        head = f"#### {bench}\n\n"
        if len(present) < 2:
            parts.append(head + "Fewer than two checkpoints evaluated: nothing to compare.")
            continue
        episodes, unreadable = _result_lines(workdir, bench)
        if not episodes:
            parts.append(
                head + f"No per-episode results in `eval/{bench}/{RESULTS_FILE}`: the paired "
                "comparison needs each task's samples."
            )
            continue
        rates = {
            label: metrics_lib.task_pass_rates(
                e
                for e in episodes
                if e.get("stage") == row.get("stage") and _same_step(e.get("step"), row)
            )
            for label, row in present
        }
        body, separated, not_separated = [], [], []
        labels = [label for label, _ in present]
        pairs = list(itertools.pairwise(labels))  # each step of the recipe, then its span
        if len(labels) > 2:
            pairs.append((labels[0], labels[-1]))
        for first, second in pairs:
            pair = f"{first} → {second}"
            diff = metrics_lib.paired_difference(rates[first], rates[second])
            if diff is None:
                body.append([pair, "0", "-", "-", "no shared task"])
                not_separated.append(pair)
                continue
            low, high = diff["ci"]
            sign = "+" if diff["difference"] >= 0 else ""
            body.append(
                [
                    pair,
                    str(diff["tasks"]),
                    f"{_fmt(diff['before'])} → {_fmt(diff['after'])}",
                    f"{sign}{_fmt(diff['difference'])} [{_fmt(low)}, {_fmt(high)}]",
                    "yes" if diff["separated"] else "no",
                ]
            )
            (separated if diff["separated"] else not_separated).append(pair)
        header = ["checkpoints", "tasks", "pass@1", "Δ pass@1 [95% CI]", "separated"]
        lines = [head + _table(header, body)]
        if separated and not not_separated:
            verdict = f"{bench} separates every pair of checkpoints ({', '.join(separated)})."
        elif separated:
            verdict = (
                f"{bench} separates {', '.join(separated)}; it does not separate "
                f"{', '.join(not_separated)} (intervals include 0)."
            )
        else:
            verdict = (
                f"{bench} does not separate these checkpoints: every interval includes 0 "
                "(more tasks or samples, or a harder benchmark, are needed to tell them apart)."
            )
        lines.append(verdict)
        if unreadable:
            lines.append(
                f"{unreadable} unreadable line(s) of `eval/{bench}/{RESULTS_FILE}` skipped."
            )
        parts.append("\n\n".join(lines))
    return "\n\n".join(parts)


def _same_step(step: Any, row: dict[str, Any]) -> bool:
    return _number(step) and _number(row.get("step")) and int(step) == int(row["step"])


def _result_lines(workdir: Workdir, bench: str) -> tuple[list[dict[str, Any]], int]:
    """The episode lines of ``eval/<bench>/results.jsonl`` (without trajectories) and
    how many lines could not be read (a torn last line after a crash)."""
    path = workdir.eval_dir / bench / RESULTS_FILE
    if not path.exists():
        return [], 0
    lines, unreadable = [], 0
    with path.open("r", encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                unreadable += 1
                continue
            if not isinstance(record, dict):
                unreadable += 1
                continue
            record.pop("trajectory", None)
            lines.append(record)
    return lines, unreadable


def _checkpoint_evals(
    evals: Sequence[dict[str, Any]],
) -> list[tuple[str, dict[str, Any] | None, str]]:
    """(label, the last eval of its stages or None, why it may be missing) per
    ``CHECKPOINTS`` entry, for one benchmark's eval rows."""
    return [
        (label, next((r for r in reversed(evals) if r.get("stage") in wanted), None), why)
        for label, wanted, why in CHECKPOINTS
    ]


def _with_ci(row: dict[str, Any], key: str) -> str:
    """``value [low, high]``, or the value alone when the row has no interval."""
    low, high = row.get(f"{key}_ci_low"), row.get(f"{key}_ci_high")
    text = _fmt(row.get(key))
    if _number(low) and _number(high):
        text += f" [{_fmt(low)}, {_fmt(high)}]"
    return text


def _copy_probe_table(training: Sequence[dict[str, Any]], stages: Sequence[str]) -> str:
    body = []
    for stage in stages:
        steps, values = _series(_of_stage(training, stage), "copy_probe")
        if steps:
            body.append(
                [
                    stage,
                    f"{_fmt(values[0])} (step {steps[0]})",
                    f"{_fmt(values[-1])} (step {steps[-1]})",
                    str(len(steps)),
                ]
            )
    if not body:
        return "No copy probe logged (train.probe_every is 0, or no training stage ran)."
    return "Copy accuracy on repeated random spans (cursor_rl.train.copy_probe).\n\n" + _table(
        ["stage", "first", "last", "probes"], body
    )


def _reward_steps(training: Sequence[dict[str, Any]]) -> str:
    rl = _of_stage(training, "rl")
    by_step = _by_step(rl, "reward")
    if not by_step:
        return "No RL training rows."
    columns = [
        (key, name)
        for key, name in (
            ("reward", "mean reward"),
            ("pass@1", "train pass@1"),
            ("scored_episodes", "episodes"),
            ("summarised_episodes", "summarised"),
            ("summarised_reward", "reward (summarised)"),
            ("unsummarised_reward", "reward (not summarised)"),
        )
        if any(key in r for r in by_step.values())
    ]
    steps = list(by_step)
    note = ""
    if len(steps) > MAX_STEP_ROWS:
        picks = {round(i * (len(steps) - 1) / (MAX_STEP_ROWS - 1)) for i in range(MAX_STEP_ROWS)}
        steps = [steps[i] for i in sorted(picks)]
        note = (
            f" ({len(steps)} of {len(by_step)} steps, evenly spaced; every step in rl_reward.png)"
        )
    body = [[str(step)] + [_fmt(by_step[step].get(key)) for key, _ in columns] for step in steps]
    return f"Training rollouts, one row per RL step{note}.\n\n" + _table(
        ["step", *(name for _, name in columns)], body
    )


def _summarisation(training: Sequence[dict[str, Any]]) -> str:
    by_step = _by_step(_of_stage(training, "rl"), "summarised_episodes")
    if not by_step:
        return "No summarisation counts in the RL rows (summarised_episodes not logged)."
    rows = list(by_step.values())
    summarised = sum(int(r["summarised_episodes"]) for r in rows)
    scored = sum(int(r.get("scored_episodes", 0)) for r in rows)
    share = f" ({summarised / scored:.1%})" if scored else ""
    lines = [
        f"{summarised} of {scored} scored episodes{share} over {len(rows)} RL steps "
        "wrote at least one self-summary."
    ]
    if not summarised:
        lines.append("No episode reached rl.rollout.summary_threshold (or it is 0).")
    for key, count_of, label in (
        ("summarised_reward", lambda r: int(r["summarised_episodes"]), "that summarised"),
        (
            "unsummarised_reward",
            lambda r: max(0, int(r.get("scored_episodes", 0)) - int(r["summarised_episodes"])),
            "that did not",
        ),
    ):
        weighted = [(count_of(r), float(r[key])) for r in rows if _number(r.get(key))]
        total = sum(n for n, _ in weighted)
        if total:
            mean = sum(n * v for n, v in weighted) / total
            lines.append(f"Mean reward of the {total} episodes {label}: {_fmt(mean)}.")
    return "\n\n".join(lines)


def _before_after(evals: Sequence[dict[str, Any]]) -> str:
    if not evals:
        return "No held-out evaluation recorded."
    parts = []
    for bench in dict.fromkeys(r["bench"] for r in evals):
        mine = [r for r in evals if r["bench"] == bench]
        before = next((r for r in reversed(mine) if r.get("stage") == "sft"), None)
        after = next((r for r in reversed(mine) if r.get("stage") in AFTER_STAGES), None)
        parts.append(f"### {bench}\n\n" + _comparison(before, after) + "\n\n" + _history(mine))
    return "\n\n".join(parts)


def _comparison(before: dict[str, Any] | None, after: dict[str, Any] | None) -> str:
    def label(row, name):
        return "-" if row is None else f"{name} ({row.get('stage')} step {row.get('step')})"

    present = [r for r in (before, after) if r is not None]
    k = next((r["k"] for r in reversed(present) if "k" in r), None)
    keys = [key for key in _HEADLINE if any(key in r for r in present)]
    categories = sorted(
        {m.group(2) for r in present for key in r if (m := _CATEGORY_KEY.match(key))}
    )
    keys += [
        f"{key}/{c}"
        for c in categories
        for key in _HEADLINE
        if any(f"{key}/{c}" in r for r in present)
    ]
    keys += [key for key in ("generated_tokens", "tool_calls") if any(key in r for r in present)]
    body = []
    for key in keys:
        old = None if before is None else before.get(key)
        new = None if after is None else after.get(key)
        delta = _fmt(new - old) if _number(old) and _number(new) else "-"
        if delta[0].isdigit():
            delta = "+" + delta
        name = key.replace("pass@k", f"pass@{k}").replace("best_of_k", f"best_of_{k}")
        body.append([name, _fmt(old), _fmt(new), delta])
    header = ["metric", label(before, "before RL"), label(after, "after RL"), "Δ"]
    return _table(header, body)


def _history(rows: Sequence[dict[str, Any]]) -> str:
    body = [
        [
            str(r.get("stage")),
            str(r.get("step")),
            _fmt(r.get("pass@1")),
            f"{_fmt(r.get('pass@k'))} (k={r.get('k', '-')})",
            _fmt(r.get("best_of_k")),
            _fmt(r.get("episodes")),
        ]
        for r in rows
    ]
    return "Every eval:\n\n" + _table(
        ["stage", "step", "pass@1", "pass@k", "best_of_k", "episodes"], body
    )


def _operations(events: Sequence[dict[str, Any]]) -> str:
    """What the watchdog saw and did (``WORKDIR/ops/events.jsonl``): counts by kind of
    finding, then each finding with the action taken and the alert's delivery."""
    detected = [e for e in events if e.get("event") == "detected"]
    if not any(e.get("event") in ("detected", "watch_started") for e in events):
        return "No watchdog ran (`python -m cursor_rl.ops.watch`) and nothing was detected."
    actions = {e.get("key"): e.get("action", "") for e in events if e.get("event") == "action"}
    delivery = {e.get("key"): e.get("delivery", "") for e in events if e.get("event") == "alert"}
    counts: dict[str, int] = {}
    for e in detected:
        counts[str(e.get("kind"))] = counts.get(str(e.get("kind")), 0) + 1
    lines = [
        "Findings by kind: "
        + (", ".join(f"{k} {n}" for k, n in sorted(counts.items())) or "none")
        + "."
    ]
    stopped = [e for e in events if e.get("event") == "watch_stopped"]
    if stopped:
        last = stopped[-1]
        lines.append(
            f"Last watch: restarts {last.get('restarts') or {}}, alerts "
            f"{last.get('alerts') or {}}, malformed metric lines "
            f"{last.get('malformed_metric_lines', 0)}."
        )
    if detected:
        body = []
        for e in detected:
            when = datetime.datetime.fromtimestamp(float(e.get("time") or 0), datetime.UTC)
            body.append(
                [
                    when.strftime("%H:%M:%S"),
                    str(e.get("kind")),
                    str(e.get("message", "")).replace("|", "/"),
                    str(actions.get(e.get("key"), "-")).replace("|", "/"),
                    str(delivery.get(e.get("key"), "-")),
                ]
            )
        lines.append(_table(["time (UTC)", "kind", "finding", "action", "alert"], body))
    return "\n\n".join(lines)


FEEDBACK_PREFIX = "feedback/"
# Counts, not behaviour rates, among the feedback metrics.
FEEDBACK_COUNTS = ("points", "detector_errors", "zero_advantage_episodes", "trained_points",
                   "too_long", "teacher_rows")  # fmt: skip


def _behaviours(rows: Sequence[dict[str, Any]]) -> list[str]:
    names = {
        k[len(FEEDBACK_PREFIX) :]
        for r in detectors.rl_train_rows(rows)
        for k in r
        if k.startswith(FEEDBACK_PREFIX)
    }
    return sorted(names - set(FEEDBACK_COUNTS))


def _final_pass(rows: Sequence[dict[str, Any]]) -> str:
    evals = [r for r in rows if "bench" in r and r.get("stage") in AFTER_STAGES]
    return _with_ci(evals[-1], "pass@1") if evals else "-"


def _feedback(rows, base_rows, baseline) -> str:
    """Per RL step, how often each textual-feedback detector fired (the share of
    episodes showing the behaviour), the points trained and the mean teacher signal;
    with a baseline run, both runs' first -> last rates and final held-out pass@1."""
    steps = detectors.rl_train_rows(rows)
    names = _behaviours(rows)
    if not names:
        return "No textual-feedback metrics in the RL rows."
    with_kl = any("feedback_kl" in r for r in steps)
    kl_note = "; KL: mean KL(π_teacher ‖ π_student) per window token (objective kl)"
    lines = [
        "Share of scored episodes on which each detector fired, per RL step; signal: mean "
        "log π_teacher − log π_student of the sampled window tokens"
        + (kl_note if with_kl else "")
        + "."
    ]
    header = ["step", *names, "points trained", "signal", *(["KL"] if with_kl else [])]
    body = [
        [str(r["step"])]
        + [_fmt(r.get(FEEDBACK_PREFIX + n)) for n in names]
        + [_fmt(r.get(FEEDBACK_PREFIX + "trained_points"), 0), _fmt(r.get("feedback_signal"))]
        + ([_fmt(r.get("feedback_kl"))] if with_kl else [])
        for r in steps
    ]
    lines.append(_table(header, body))
    if base_rows is not None:
        base = detectors.rl_train_rows(base_rows)
        cmp = [
            [n, _first_last(steps, FEEDBACK_PREFIX + n), _first_last(base, FEEDBACK_PREFIX + n)]
            for n in names
        ]
        cmp.append(["held-out pass@1 (last)", _final_pass(rows), _final_pass(base_rows)])
        lines.append(f"Against the baseline run `{baseline}` (first → last step):")
        lines.append(_table(["behaviour", "this run", "baseline"], cmp))
    return "\n\n".join(lines)


def _plot_feedback(rows, base_rows):
    steps = detectors.rl_train_rows(rows)
    names = _behaviours(rows)
    if not names:
        return None
    figure, axes = _figure(len(names))
    for ax, name in zip(axes, names):
        key = FEEDBACK_PREFIX + name
        ax.plot(*_series(steps, key), "o-", label="this run")
        if base_rows is not None:
            ax.plot(*_series(detectors.rl_train_rows(base_rows), key), "s--", label="baseline")
            ax.legend(fontsize="small")
        ax.set(title=name, xlabel="RL step", ylabel="share of episodes")
        ax.set_ylim(-0.02, 1.02)
    return figure


def _plot_links(written: Sequence[str]) -> str:
    if not written:
        return "No plots (no data to plot yet)."
    return "\n\n".join(f"![{name[:-4]}]({name})" for name in written)


REGISTRY_HISTORY = 10  # the registry section shows each benchmark's last evals


def _registry(workdir: Workdir, registry_path: str | None) -> registry_lib.Registry | str:
    """The run's registry (choice 7), or why it cannot be opened."""
    shared = ""
    if registry_path:
        shared = registry_path
    elif workdir.config_file.exists():
        try:
            config = json.loads(workdir.config_file.read_text(encoding="utf-8"))
            shared = str(config.get("rl", {}).get("eval", {}).get("registry") or "")
        except (ValueError, AttributeError):
            shared = ""  # an unreadable config: the run's own registry
    try:
        return registry_lib.Registry.for_run(workdir, shared)
    except ValueError as err:  # a path that names no usable place (WorkdirError)
        return f"Unreadable: {err}"


def _registry_status(registry: registry_lib.Registry | str) -> str:
    if isinstance(registry, str):
        return registry
    try:
        return registry.markdown(history=REGISTRY_HISTORY)
    except registry_lib.RegistryError as err:
        return f"Unreadable: {err}"


# ---- plots ---------------------------------------------------------------------


def _figure(panels: int):
    figure = Figure(figsize=(4.5 * panels, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, panels, squeeze=False)[0]
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    return figure, list(axes)


def _plot_losses(training: Sequence[dict[str, Any]], stages: Sequence[str]):
    with_loss = [
        s
        for s in stages
        if any(_series(_of_stage(training, s), k)[0] for k in ("ce_loss", "eval_loss"))
    ]
    if not with_loss:
        return None
    figure, axes = _figure(len(with_loss))
    for ax, stage in zip(axes, with_loss):
        rows = _of_stage(training, stage)
        for key, style in (("ce_loss", "-"), ("eval_loss", "o--")):
            steps, values = _series(rows, key)
            if steps:
                ax.plot(steps, values, style, label="train" if key == "ce_loss" else "eval")
        ax.set(title=stage, xlabel="step", ylabel="cross-entropy")
        ax.legend()
    return figure


def _plot_rl_reward(training: Sequence[dict[str, Any]], evals: Sequence[dict[str, Any]]):
    rl = _of_stage(training, "rl")
    reward = _series(rl, "reward")
    train_pass = _series(rl, "pass@1")
    benches = list(dict.fromkeys(r["bench"] for r in evals))
    rl_evals = {
        b: [r for r in evals if r["bench"] == b and r.get("stage") in AFTER_STAGES] for b in benches
    }
    if not (reward[0] or train_pass[0] or any(rl_evals.values())):
        return None
    figure, (ax_reward, ax_pass) = _figure(2)
    if reward[0]:
        ax_reward.plot(*reward, "-", label="train reward")
    ax_reward.set(title="RL reward", xlabel="RL step", ylabel="mean episode reward")
    if train_pass[0]:
        ax_pass.plot(*train_pass, "-", alpha=0.6, label="train pass@1")
    for bench in benches:
        steps, values = _series(rl_evals[bench], "pass@1")
        if steps:
            ax_pass.plot(steps, values, "o-", label=f"{bench} pass@1")
        steps, values = _series(rl_evals[bench], "best_of_k")
        if steps:
            k = rl_evals[bench][-1].get("k", "k")
            ax_pass.plot(steps, values, "s:", label=f"{bench} best-of-{k}")
        for stage, name, color in ((BASE_STAGE, "base", "silver"), ("sft", "SFT", "gray")):
            done = [r for r in evals if r["bench"] == bench and r.get("stage") == stage]
            if done and _number(done[-1].get("pass@1")):
                ax_pass.axhline(
                    done[-1]["pass@1"], linestyle="--", color=color, label=f"{bench} {name}"
                )
    ax_pass.set(title="pass@1", xlabel="RL step", ylabel="fraction solved", ylim=(-0.02, 1.02))
    for ax in (ax_reward, ax_pass):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    return figure


def _plot_learning(evals: Sequence[dict[str, Any]]):
    """Held-out pass@1 and best-of-k of base, SFT and RL, with their intervals."""
    benches = list(dict.fromkeys(r["bench"] for r in evals))
    points = []  # (bench, [(x, row)]): x is the checkpoint's place on the axis
    for bench in benches:
        picked = _checkpoint_evals([r for r in evals if r["bench"] == bench])
        present = [(x, row) for x, (_, row, _) in enumerate(picked) if row is not None]
        if present:
            points.append((bench, present))
    if not points:
        return None
    figure, (ax,) = _figure(1)
    width = 0.8 / (2 * len(points))
    for b, (bench, present) in enumerate(points):
        for m, (key, marker) in enumerate((("pass@1", "o"), ("best_of_k", "s"))):
            shown = [(x, row) for x, row in present if _number(row.get(key))]
            if not shown:
                continue
            offset = (2 * b + m + 0.5) * width - 0.4
            xs = [x + offset for x, _ in shown]
            ys = [float(row[key]) for _, row in shown]
            errors = [
                [y - float(row.get(f"{key}_ci_low", y)) for y, (_, row) in zip(ys, shown)],
                [float(row.get(f"{key}_ci_high", y)) - y for y, (_, row) in zip(ys, shown)],
            ]
            k = shown[-1][1].get("k", "k")
            name = "pass@1" if key == "pass@1" else f"best-of-{k}"
            ax.errorbar(xs, ys, yerr=errors, fmt=marker, capsize=4, label=f"{bench} {name}")
    ax.set_xticks(range(len(CHECKPOINTS)), [label for label, _, _ in CHECKPOINTS])
    ax.set(title="held-out benchmark (95% CI)", ylabel="fraction solved", ylim=(-0.02, 1.02))
    ax.legend(fontsize="small")
    return figure


def _plot_copy_probe(training: Sequence[dict[str, Any]], stages: Sequence[str]):
    probed = [s for s in stages if _series(_of_stage(training, s), "copy_probe")[0]]
    if not probed:
        return None
    figure, axes = _figure(len(probed))
    for ax, stage in zip(axes, probed):
        ax.plot(*_series(_of_stage(training, stage), "copy_probe"), "o-")
        ax.set(title=f"copy probe: {stage}", xlabel="step", ylabel="copy accuracy")
        ax.set_ylim(-0.02, 1.02)
    return figure


def _plot_rl_length(training: Sequence[dict[str, Any]]):
    rl = _of_stage(training, "rl")
    panels = [
        (key, label)
        for key, label in (("generated_tokens", "generated tokens"), ("tool_calls", "tool calls"))
        if _series(rl, key)[0]
    ]
    if not panels:
        return None
    figure, axes = _figure(len(panels))
    for ax, (key, label) in zip(axes, panels):
        ax.plot(*_series(rl, key), "-")
        ax.set(title=f"{label} per episode", xlabel="RL step", ylabel=label)
    return figure


# ---- command line ----------------------------------------------------------------


def main(argv: Sequence[str]) -> None:
    del argv
    print(
        write_report(
            flags.FLAGS.workdir,
            registry_path=flags.FLAGS.registry,
            baseline=flags.FLAGS.baseline or None,
        )
    )


if __name__ == "__main__":
    # Defined here, not at import: the RL loop imports this module inside
    # cursor_rl.main, which owns --workdir already.
    flags.DEFINE_string("workdir", None, "The run's directory (holds metrics.jsonl).")
    flags.DEFINE_string(
        "registry",
        None,
        "Saturation registry (default: the config's rl.eval.registry, else "
        "WORKDIR/eval/registry.json).",
    )
    flags.DEFINE_string("baseline", None, "Another run to compare with (textual feedback).")
    flags.mark_flags_as_required(["workdir"])
    app.run(main)
