"""Eval episodes as text: read what the model did on the benchmark.

    python -m cursor_rl.eval.transcripts --workdir=/tmp/tiny --stage=sft --limit=3
    python -m cursor_rl.eval.transcripts --workdir=/tmp/tiny --stage=rl --resolved=true

Reads ``WORKDIR/eval/<bench>/results.jsonl`` (one line per episode, written by
``cursor_rl.eval.runner``) and prints each episode's turns decoded with the run's
tokenizer. Only episodes recorded with their trajectory (``rl.eval.save_trajectories``)
have turns to print; the others show their outcome line only. A line that is not
JSON is skipped and counted, never fatal.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from absl import app, flags
from etils import epath

from cursor_rl.chat.protocol import Trajectory
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.eval.runner import RESULTS_FILE
from cursor_rl.workdir import Workdir


def read_records(path: Any) -> tuple[list[dict[str, Any]], int]:
    """The episode records of one results file, and how many lines were unreadable."""
    records, bad = [], 0
    for line in epath.Path(path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            bad += 1
    return records, bad


def select(
    records: list[dict[str, Any]],
    *,
    stage: str | None = None,
    resolved: bool | None = None,
    task_id: str | None = None,
) -> Iterator[dict[str, Any]]:
    for r in records:
        if stage and r.get("stage") != stage:
            continue
        if resolved is not None and bool(r.get("resolved")) != resolved:
            continue
        if task_id and r.get("task_id") != task_id:
            continue
        yield r


def render(record: dict[str, Any], tokenizer: Tokenizer | None) -> str:
    """One episode: its outcome line, then each turn's role and decoded text."""
    head = (
        f"### {record.get('task_id')} sample {record.get('sample')} (stage {record.get('stage')}"
        f" step {record.get('step')}): {record.get('finish_reason')},"
        f" resolved={record.get('resolved')},"
        f" tests {record.get('fail_to_pass_passed')}/{record.get('fail_to_pass_total')},"
        f" tool calls {record.get('tool_calls')}"
    )
    data = record.get("trajectory")
    if not data or tokenizer is None:
        return head + "\n(no trajectory recorded: set rl.eval.save_trajectories)\n"
    traj = Trajectory.from_json_dict(data)
    parts = [head]
    for turn in traj.turns:
        text = tokenizer.decode(traj.tokens[turn.start : turn.end])
        parts.append(f"--- {turn.role} (segment {turn.segment}) ---\n{text}")
    return "\n".join(parts) + "\n"


_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir.", required=True)
_BENCH = flags.DEFINE_string("bench", "tiny_bench", "The benchmark's name.")
_STAGE = flags.DEFINE_string("stage", None, "Only this eval stage (base, sft, rl).")
_RESOLVED = flags.DEFINE_enum("resolved", None, ["true", "false"], "Only (un)resolved episodes.")
_TASK = flags.DEFINE_string("task", None, "Only this task id.")
_LIMIT = flags.DEFINE_integer("limit", 5, "Episodes to print (0: all).")


def main(argv: list[str]) -> None:
    del argv
    wd = Workdir.of(_WORKDIR.value)
    records, bad = read_records(wd.eval_dir / _BENCH.value / RESULTS_FILE)
    tokenizer = Tokenizer.load(wd.tokenizer_file) if wd.tokenizer_file.exists() else None
    resolved = None if _RESOLVED.value is None else _RESOLVED.value == "true"
    chosen = list(select(records, stage=_STAGE.value, resolved=resolved, task_id=_TASK.value))
    shown = chosen[: _LIMIT.value] if _LIMIT.value else chosen
    for record in shown:
        print(render(record, tokenizer))
    print(f"{len(shown)} of {len(chosen)} matching episodes shown ({bad} unreadable lines)")


if __name__ == "__main__":
    app.run(main)
