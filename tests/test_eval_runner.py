"""evaluate(): one JSON line per episode, appended; the summary; the flat metrics row."""

import json
import types

import pytest

from cursor_rl.eval import metrics, runner
from cursor_rl.eval.testing import graded_episode


class FakeRunner:
    """Stands in for RolloutRunner: task i resolves in its first ``solved[i]`` samples."""

    def __init__(self, solved):
        self.solved = solved
        self.calls = []

    def run(self, tasks, seed=0, group_size=None):
        self.calls.append((len(tasks), seed, group_size))
        return [
            graded_episode(
                task.task_id,
                task.category,
                g < self.solved[i],
                sample=g,
                tokens=50 + g,
                calls=g,
                versions=(3, 3, 4),
                finish="submitted" if g < self.solved[i] else "token_budget",
            )
            for i, task in enumerate(tasks)
            for g in range(group_size)
        ]


TASKS = [
    types.SimpleNamespace(task_id="bug-1", category="bug"),
    types.SimpleNamespace(task_id="feat-1", category="feature"),
]


def _evaluate(tmp_path, stage="rl", step=10, solved=(1, 4), **kwargs):
    fake = FakeRunner(solved=list(solved))
    summary = runner.evaluate(
        fake,
        TASKS,
        samples=4,
        seed=7,
        bench_name="tiny_bench",
        out_dir=str(tmp_path / "eval"),
        stage=stage,
        step=step,
        policy_version=step,
        **kwargs,
    )
    return fake, summary


def _lines(tmp_path):
    path = tmp_path / "eval" / "tiny_bench" / runner.RESULTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_evaluate_runs_groups_and_summarizes(tmp_path):
    fake, summary = _evaluate(tmp_path)
    assert fake.calls == [(2, 7, 4)]
    assert summary["bench"] == "tiny_bench" and summary["stage"] == "rl"
    assert summary["step"] == 10 and summary["samples"] == 4 and summary["seed"] == 7
    assert summary["k_values"] == [1, 2, 4]
    assert summary["overall"]["pass@1"] == pytest.approx((1 / 4 + 1) / 2)
    assert summary["categories"]["bug"]["pass@4"] == pytest.approx(1.0)
    assert summary["categories"]["bug"]["pass@2"] == pytest.approx(metrics.pass_at_k(4, 1, 2))


def test_results_lines_are_appended(tmp_path):
    _evaluate(tmp_path, stage="sft", step=100)
    _evaluate(tmp_path, stage="rl", step=5)
    lines = _lines(tmp_path)
    assert len(lines) == 16
    assert [line["stage"] for line in lines] == ["sft"] * 8 + ["rl"] * 8
    first = lines[0]
    assert first["task_id"] == "bug-1" and first["category"] == "bug"
    assert first["resolved"] is True and first["task_reward"] == 1.0
    assert first["policy_version"] == 100 and first["policy_versions"] == [3, 4]
    assert first["generated_tokens"] == 50 and first["segments"] == 1
    for key in ("fail_to_pass_passed", "fail_to_pass_total", "pass_to_pass_broken", "tool_calls"):
        assert key in first
    assert "trajectory" not in first
    assert lines[1]["resolved"] is False and lines[1]["finish_reason"] == "token_budget"


def test_trajectories_only_on_request(tmp_path):
    _evaluate(tmp_path, save_trajectories=True)
    assert "segment_starts" in _lines(tmp_path)[0]["trajectory"]


def test_eval_row(tmp_path):
    _, summary = _evaluate(tmp_path)
    row = runner.eval_row(summary)
    assert row["bench"] == "tiny_bench"
    assert row["k"] == 4
    assert row["pass@1"] == summary["overall"]["pass@1"]
    assert row["pass@k"] == row["pass@4"] == summary["overall"]["pass@4"]
    assert row["best_of_k"] == row["best_of_4"]
    assert row["pass@2"] == summary["overall"]["pass@2"]
    assert row["pass@1/bug"] == pytest.approx(0.25)
    assert row["pass@k/feature"] == pytest.approx(1.0)
    assert row["best_of_k/bug"] == pytest.approx(1.0)
    assert row["finish/submitted"] == pytest.approx(5 / 8)
    assert row["tasks"] == 2 and row["episodes"] == 8
    assert "stage" not in row and "step" not in row  # MetricsWriter.write adds them
    json.dumps(row)


def test_eval_row_carries_the_intervals(tmp_path):
    _, summary = _evaluate(tmp_path)
    row = runner.eval_row(summary)
    assert row["samples_per_task"] == 4 and row["ci_level"] == 0.95
    # Per-task pass@1 is 1/4 and 4/4; the interval is the bootstrap of those two.
    assert (row["pass@1_ci_low"], row["pass@1_ci_high"]) == metrics.bootstrap_ci([0.25, 1.0])
    assert (row["pass@1_ci_low"], row["pass@1_ci_high"]) == (0.25, 1.0)
    assert (row["pass@k_ci_low"], row["pass@k_ci_high"]) == summary["overall"]["ci"]["pass@4"]
    assert (row["best_of_k_ci_low"], row["best_of_k_ci_high"]) == (1.0, 1.0)

    _, solved_all = _evaluate(tmp_path, solved=(4, 4))
    row = runner.eval_row(solved_all)
    for key in ("pass@1", "pass@k", "best_of_k"):
        assert (row[f"{key}_ci_low"], row[f"{key}_ci_high"]) == (1.0, 1.0), key


class _DigitTokenizer:
    """Decodes token ids as their numbers, for reading transcripts back in tests."""

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def test_transcripts_print_recorded_turns_and_skip_bad_lines(tmp_path):
    from cursor_rl.eval import transcripts

    _evaluate(tmp_path, stage="sft", step=1, save_trajectories=True)
    _evaluate(tmp_path, stage="rl", step=2)  # no trajectories: outcome lines only
    path = tmp_path / "eval" / "tiny_bench" / runner.RESULTS_FILE
    with open(path, "a") as f:
        f.write("{not json\n")
    records, bad = transcripts.read_records(path)
    assert len(records) == 16 and bad == 1
    solved = list(transcripts.select(records, stage="sft", resolved=True))
    assert [r["task_id"] for r in solved] == ["bug-1"] + ["feat-1"] * 4
    assert "turns" in solved[0]["trajectory"]
    # graded_episode's trajectories hold no tokens: give one episode two turns.
    solved[0]["trajectory"] = {
        "tokens": [5, 6, 7, 8, 9],
        "loss_mask": [0, 0, 1, 1, 1],
        "logprobs": [None, None, -0.1, -0.2, -0.3],
        "turns": [["user", 0, 2, 0], ["assistant", 2, 5, 0]],
        "segment_starts": [0],
    }
    text = transcripts.render(solved[0], _DigitTokenizer())
    assert text.startswith("### bug-1 sample 0 (stage sft step 1): submitted, resolved=True")
    assert "--- user (segment 0) ---\n5 6\n--- assistant (segment 0) ---\n7 8 9" in text
    rl = next(transcripts.select(records, stage="rl"))
    assert "no trajectory recorded" in transcripts.render(rl, _DigitTokenizer())
