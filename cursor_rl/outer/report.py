"""The outer loop's report: ``outer_summary.json`` and ``outer_report.md``.

    summary = make_summary(feedback=..., judge="rules", classified=..., results=...,
                           areas=..., selected=..., builds=..., ...)
    write(summary, out_dir)      # both files; the Markdown is rendered from the JSON

Choices:

1. **The JSON is the record, the Markdown a view of it**: ``render_markdown`` reads
   only the summary dict, so a report can be re-rendered (or diffed) from the JSON
   alone.
2. **Every count that could hide a loss is printed**: bad rows with their lines,
   unresolved snapshot tasks, detector and judge errors, unreadable eval lines,
   unmapped episodes, dropped generators, build rejections, and the problems that
   make the command exit 1.

Pure Python, no JAX.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from cursor_rl.outer import rank
from cursor_rl.outer.classify import Classified
from cursor_rl.outer.factory import AreaBuild
from cursor_rl.outer.ingest import FeedbackSet

SUMMARY_FILE = "outer_summary.json"
REPORT_FILE = "outer_report.md"
SUMMARY_FORMAT = 1


def make_summary(
    *,
    feedback: FeedbackSet,
    judge: str,
    classified: Classified,
    results: rank.CheckpointResults | None,
    areas: Sequence[rank.WeakArea],
    selected: Sequence[rank.WeakArea],
    builds: Sequence[AreaBuild],
    registry: str | None,
    inputs: Mapping[str, Any],
    problems: Sequence[str],
    seconds: Mapping[str, float],
) -> dict[str, Any]:
    """The JSON summary of one outer-loop run (see ``docs/outer_loop.md``)."""
    events = {e.event_id: e for e in feedback.events}
    rows = []
    for c in classified.classifications:
        event = events[c.event_id]
        rows.append(
            {
                **c.to_json(),
                "line": event.line,
                "rating": event.rating,
                "reverted": event.reverted,
                "comment": event.comment,
            }
        )
    return {
        "format": SUMMARY_FORMAT,
        "inputs": dict(inputs),
        "feedback": {
            "path": feedback.path,
            "sha256": feedback.sha256,
            "rows": feedback.rows,
            "events": len(feedback.events),
            "negative": len(feedback.negative),
            "positive": len(feedback.events) - len(feedback.negative),
            "bad_rows": [
                {"line": b.line, "event_id": b.event_id, "problem": b.problem}
                for b in feedback.bad_rows
            ],
        },
        "judge": judge,
        "classification": classified.stats(),
        "events": rows,
        "eval": results.summary() if results is not None else None,
        "areas": [{"rank": i + 1, **a.to_json()} for i, a in enumerate(areas)],
        "areas_by_pass@1": [a.name for a in rank.by_pass_at_1(areas)],
        "selected": [a.name for a in selected],
        "builds": [b.to_json() for b in builds],
        "registry": registry,
        "problems": list(problems),
        "status": "problems" if problems else "ok",
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
    }


def write(summary: Mapping[str, Any], out_dir: str) -> tuple[str, str]:
    """Writes both files into ``out_dir``; returns their paths (JSON, Markdown)."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, SUMMARY_FILE)
    md_path = os.path.join(out_dir, REPORT_FILE)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(render_markdown(summary))
    return json_path, md_path


def num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ci(ci: Sequence[float] | None) -> str:
    return "" if not ci else f" [{ci[0]:.2f}, {ci[1]:.2f}]"


def cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def render_markdown(summary: Mapping[str, Any]) -> str:
    """The Markdown report of a summary (choice 1)."""
    fb = summary["feedback"]
    cls = summary["classification"]
    ev = summary["eval"]
    out = ["# Outer loop report", ""]
    out.append(
        f"Feedback `{fb['path']}` (sha256 `{fb['sha256'][:12]}`): {fb['rows']} rows, "
        f"{fb['events']} valid events ({fb['negative']} negative, {fb['positive']} "
        f"positive), **{len(fb['bad_rows'])} bad rows**. Judge: {summary['judge']} "
        f"({cls['judged']} decided by it, {cls['judge_abstained']} abstained, "
        f"{len(cls['judge_errors'])} errors)."
    )
    out.append("")
    if ev is None:
        out.append("No eval results were given (`--eval_workdir`): areas are ranked by count.")
    elif not ev["checkpoint"]:
        out.append(f"No readable eval results in `{ev['eval_dir']}`.")
    else:
        out.append(
            f"Current checkpoint **{ev['checkpoint']}** (of {', '.join(ev['checkpoints_found'])}) "
            f"from `{ev['eval_dir']}`: pass@1 {num(ev['pass@1'])}{_ci(ev['pass@1_ci'])} over "
            f"{ev['tasks']} bench tasks ({', '.join(ev['benches'])}); "
            f"{ev['unmapped_episodes']} episodes of tasks no dataset holds, "
            f"{ev['lost_episodes']} lost, {len(ev['bad_lines'])} unreadable lines."
        )
    if summary["problems"]:
        out += ["", "**Problems** (the command exits 1):", ""]
        out += [f"- {cell(p)}" for p in summary["problems"]]
    if fb["bad_rows"]:
        out += ["", "## Bad rows", "", "| line | event | problem |", "|---:|---|---|"]
        for b in fb["bad_rows"]:
            out.append(f"| {b['line']} | {cell(b['event_id'] or '-')} | {cell(b['problem'])} |")
    counted = [
        ("snapshot task ids no dataset holds", cls["unresolved_tasks"]),
        ("snapshots whose tree hash differs from their task's", cls["snapshot_mismatches"]),
        ("detector errors", cls["detector_errors"]),
        ("judge errors", cls["judge_errors"]),
    ]
    notes = [
        f"- {what}: {len(items)} ({', '.join(map(str, items))})" for what, items in counted if items
    ]
    if ev is not None and ev["bad_lines"]:
        notes.append(f"- unreadable eval lines: {'; '.join(ev['bad_lines'][:5])}")
    if notes:
        out += ["", "Counted along the way:", "", *notes]

    out += ["", "## Weak areas", ""]
    if not summary["areas"]:
        out.append("No negative event: no weak area.")
    else:
        out.append(
            "Ranked by negative events (ties: lower pass@1 first). pass@1: the current "
            "checkpoint's, on the bench tasks of the area's generators, with its bootstrap "
            "95% interval and the number of such tasks."
        )
        out += [
            "",
            "| rank | area | events | difficulty | task kinds | pass@1 (tasks) | selected |",
            "|---:|---|---:|---|---|---|---|",
        ]
        for a in summary["areas"]:
            score = (
                "-"
                if a["pass_at_1"] is None
                else f"{a['pass_at_1']:.3f}{_ci(a['pass_at_1_ci'])} ({a['bench_tasks']})"
            )
            chosen = "yes" if a["name"] in summary["selected"] else ""
            out.append(
                f"| {a['rank']} | {a['name']} | {a['count']} | {_counts(a['difficulty'])} | "
                f"{_counts(a['task_kinds'])} | {score} | {chosen} |"
            )
        if summary["areas_by_pass@1"]:
            out += ["", "By pass@1, lowest first: " + ", ".join(summary["areas_by_pass@1"]) + "."]

    out += ["", "## New tasks", ""]
    if not summary["builds"]:
        out.append("No task was built (no area selected, or `--nobuild`).")
    else:
        out += [
            "| area | new bench | train tasks | bench tasks | generators | rejections |",
            "|---|---|---:|---:|---|---|",
        ]
        for b in summary["builds"]:
            rejections: dict[str, int] = {}
            for stats in (b["train_stats"], b["bench_stats"]):
                for reason, n in (stats or {}).get("rejections", {}).items():
                    rejections[reason] = rejections.get(reason, 0) + n
            registered = " (registered)" if b["registered"] else ""
            out.append(
                f"| {b['area']} | `{b['bench_name']}`{registered} | {b['train_tasks']} | "
                f"{b['bench_tasks']} | {', '.join(b['generators']) or '-'} | "
                f"{_counts(rejections) or '-'} |"
            )
        out.append("")
        for b in summary["builds"]:
            line = (
                f"- {b['area']}: `{b['train_dir']}`, `{b['bench_dir']}` (provenance.json in each)"
            )
            if b["dropped_generators"]:
                dropped = "; ".join(f"{k}: {v}" for k, v in b["dropped_generators"].items())
                line += f"; generators dropped: {dropped}"
            out.append(line)
        if summary["registry"]:
            out += ["", f"Registry: `{summary['registry']}`."]

    out += ["", "## Negative events", ""]
    if summary["events"]:
        out += [
            "| line | event | category | difficulty | kind | why |",
            "|---:|---|---|---|---|---|",
        ]
        for e in summary["events"]:
            out.append(
                f"| {e['line']} | {cell(e['event_id'])} | {e['category']} | {e['difficulty']} | "
                f"{e['task_kind'] or '-'} | {cell('; '.join(e['evidence']))} |"
            )
    else:
        out.append("None.")
    seconds = summary["seconds"]
    out += ["", "Seconds: " + ", ".join(f"{k} {v}" for k, v in seconds.items()) + "."]
    return "\n".join(out) + "\n"
