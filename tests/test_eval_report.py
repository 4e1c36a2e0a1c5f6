"""The run report from a synthetic metrics.jsonl: tables, before/after, the learning
section (base -> SFT -> RL with intervals, copy probe, RL reward per step,
self-summarisation), plots, partial runs."""

import json
import os
import pathlib
import subprocess
import sys

from cursor_rl.eval import metrics, registry, report, runner
from cursor_rl.eval.testing import graded_episode
from cursor_rl.workdir import Workdir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _eval_row(solved_bug, solved_feature, *, stage, step, tokens, time=0.0):
    """A real eval row: four samples of one bug and one feature task, summarized."""
    episodes = [
        graded_episode("bug-1", "bug", g < solved_bug, sample=g, tokens=tokens) for g in range(4)
    ] + [
        graded_episode("feat-1", "feature", g < solved_feature, sample=g, tokens=tokens)
        for g in range(4)
    ]
    summary = metrics.summarize(episodes, k_values=(1, 4))
    summary.update(bench="tiny_bench", stage=stage, step=step)
    return summary, {"stage": stage, "step": step, "time": time, **runner.eval_row(summary)}


def _report_text(workdir):
    return pathlib.Path(report.write_report(workdir)).read_text()


def _write_rows(workdir, rows, torn_tail=False):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
        if torn_tail:
            fh.write('{"stage": "rl", "st')


def _training_rows():
    rows = [{"stage": "pretrain", "step": 0, "time": 1000.0, "eval_loss": 6.0}]
    for step in (10, 20, 30):
        rows.append(
            {
                "stage": "pretrain",
                "step": step,
                "time": 1000.0 + step,
                "ce_loss": 6.0 - step / 10,
                "tokens": step * 512,
                "tokens_per_s": 900.0,
                "copy_probe": 0.3 + step / 50,  # 0.5, 0.7, 0.9
            }
        )
    rows.append({"stage": "pretrain", "step": 30, "time": 1031.0, "eval_loss": 3.5})
    for step in (5, 10):
        rows.append({"stage": "long_context", "step": step, "time": 1100.0 + step, "ce_loss": 2.9})
    rows[-1]["copy_probe"] = 0.85
    for step in (4, 8):
        rows.append({"stage": "sft", "step": step, "time": 1200.0 + step, "ce_loss": 1.5})
    return rows


def _rl_rows():
    return [
        {
            "stage": "rl",
            "step": step,
            "time": 1300.0 + 10 * step,
            "reward": 0.1 * step,
            "pass@1": 0.1 * step,
            "best_of_k": 0.2 * step,
            "generated_tokens": 300.0 - 20 * step,
            "tool_calls": 3.0,
            "segments": 1.0,
            # Step s: s - 1 of 8 episodes summarised (reward 0.5), the rest 0.1 * s.
            "scored_episodes": 8,
            "summarised_episodes": step - 1,
            **({"summarised_reward": 0.5} if step > 1 else {}),
            "unsummarised_reward": 0.1 * step,
        }
        for step in range(1, 5)
    ]


def _full_run(workdir):
    base_summary, base_eval = _eval_row(0, 0, stage="base", step=10, tokens=400, time=1209.0)
    sft_summary, sft_eval = _eval_row(1, 2, stage="sft", step=8, tokens=300, time=1210.0)
    mid_summary, mid_eval = _eval_row(2, 3, stage="rl", step=2, tokens=250, time=1325.0)
    last_summary, last_eval = _eval_row(3, 4, stage="rl", step=4, tokens=200, time=1345.0)
    rl = _rl_rows()
    rows = [*_training_rows(), base_eval, sft_eval, *rl[:2], mid_eval, *rl[2:], last_eval]
    _write_rows(workdir, rows, torn_tail=True)
    reg = registry.Registry(Workdir(workdir).registry_file)
    for summary in (base_summary, sft_summary, mid_summary, last_summary):
        reg.record(summary)


def test_full_report(tmp_path):
    workdir = str(tmp_path / "run")
    _full_run(workdir)
    path = report.write_report(workdir)
    assert path == os.path.join(workdir, "report.md")
    text = pathlib.Path(path).read_text()
    for name in ("loss.png", "rl_reward.png", "rl_length.png", "learning.png", "copy_probe.png"):
        with open(os.path.join(workdir, name), "rb") as fh:
            assert fh.read(8) == PNG_MAGIC, name
        assert f"({name})" in text

    # Stage table: steps, tokens, first -> last losses, wall time from the rows' time.
    assert "| pretrain | 30 | 15,360 | 5.000 → 3.000 | 6.000 → 3.500 | 31 s |" in text
    assert "| long_context | 10 | - | 2.900 → 2.900 | - | 5 s |" in text
    assert "| sft | 8 | - | 1.500 → 1.500 | - | 6 s |" in text  # the SFT eval row included
    assert "| rl | 4 | - | - | - | 35 s |" in text
    assert "| base | 10 | - |" not in text  # the base eval is not a stage that ran
    # RL training rows, first -> last.
    assert "| reward | 0.100 → 0.400 |" in text
    assert "| generated_tokens | 280.0 → 220.0 |" in text
    # Before (SFT eval) vs after (last RL eval), overall and per category.
    assert "| metric | before RL (sft step 8) | after RL (rl step 4) | Δ |" in text
    assert "| pass@1 | 0.375 | 0.875 | +0.500 |" in text
    assert "| pass@4 | 1.000 | 1.000 | +0.000 |" in text
    assert "| best_of_4 | 1.000 | 1.000 | +0.000 |" in text
    assert "| pass@1/bug | 0.250 | 0.750 | +0.500 |" in text
    assert "| pass@1/feature | 0.500 | 1.000 | +0.500 |" in text
    assert "| generated_tokens | 300.0 | 200.0 | -100.0 |" in text
    # Every eval is listed; the registry keeps the bench active (0.875 < 0.9).
    assert text.count("| rl | 2 | 0.625 |") == 1
    assert "| tiny_bench | active | 4 | 0.875 | 0.875 | - |" in text


def test_learning_section(tmp_path):
    workdir = str(tmp_path / "run")
    _full_run(workdir)
    text = _report_text(workdir)
    learning = text.split("## Learning")[1].split("\n## ")[0]
    # base -> SFT -> RL, each with its bootstrap interval over the two tasks: per-task
    # pass@1 of (0, 0), (1/4, 2/4) and (3/4, 4/4); pass@4 and best-of-4 are per-task 0 or 1.
    header = "| checkpoint | eval | pass@1 [95% CI] | pass@4 [95% CI] | best-of-4 [95% CI] |"
    assert header + " tasks × samples |" in learning
    zero = "0.000 [0.000, 0.000]"
    one = "1.000 [1.000, 1.000]"
    assert f"| base | base step 10 | {zero} | {zero} | {zero} | 2 × 4 |" in learning
    assert f"| SFT | sft step 8 | 0.375 [0.250, 0.500] | {one} | {one} | 2 × 4 |" in learning
    assert f"| RL | rl step 4 | 0.875 [0.750, 1.000] | {one} | {one} | 2 × 4 |" in learning
    assert "not evaluated" not in learning
    # The copy probe, first -> last per training stage that logged it.
    assert "| pretrain | 0.500 (step 10) | 0.900 (step 30) | 3 |" in learning
    assert "| long_context | 0.850 (step 10) | 0.850 (step 10) | 1 |" in learning
    assert "| sft |" not in learning.split("### Copy probe")[1].split("###")[0]
    # Reward per RL step, with the summarisation split.
    assert (
        "| step | mean reward | train pass@1 | episodes | summarised | reward (summarised) "
        "| reward (not summarised) |"
    ) in learning
    assert "| 1 | 0.100 | 0.100 | 8 | 0 | - | 0.100 |" in learning
    assert "| 4 | 0.400 | 0.400 | 8 | 3 | 0.500 | 0.400 |" in learning
    # Totals: 0 + 1 + 2 + 3 of 4 x 8 episodes; the rest's reward weighted by its counts.
    assert "6 of 32 scored episodes (18.8%) over 4 RL steps wrote" in learning
    assert "Mean reward of the 6 episodes that summarised: 0.500." in learning
    rest = (8 * 0.1 + 7 * 0.2 + 6 * 0.3 + 5 * 0.4) / 26
    assert f"Mean reward of the 26 episodes that did not: {rest:.3f}." in learning
    # The base checkpoint is a baseline in the RL plot's legend too (not read here).


def test_long_rl_tables_are_thinned(tmp_path):
    workdir = str(tmp_path / "run")
    rows = [{"stage": "rl", "step": s, "time": float(s), "reward": s / 100} for s in range(1, 61)]
    _write_rows(workdir, rows)
    text = _report_text(workdir)
    table = text.split("### RL reward per step")[1].split("###")[0]
    steps = [
        int(line.split("|")[1]) for line in table.splitlines() if line[:3].strip("| ").isdigit()
    ]
    assert len(steps) == report.MAX_STEP_ROWS
    assert steps[0] == 1 and steps[-1] == 60 and steps == sorted(set(steps))
    assert "25 of 60 steps, evenly spaced" in table
    assert "No summarisation counts in the RL rows" in text


def test_partial_run_gets_a_report(tmp_path):
    workdir = str(tmp_path / "run")
    _write_rows(workdir, _training_rows()[:3], torn_tail=True)
    text = _report_text(workdir)
    assert "| pretrain | 20 |" in text
    assert "No RL training rows." in text
    assert "No held-out evaluation recorded." in text
    assert "No benchmark recorded" in text
    assert "| pretrain | 0.500 (step 10) | 0.700 (step 20) | 2 |" in text  # copy probe so far
    assert "No summarisation counts in the RL rows" in text
    assert os.path.exists(os.path.join(workdir, "loss.png"))
    assert not os.path.exists(os.path.join(workdir, "rl_reward.png"))


def test_sft_eval_only_and_empty_workdir(tmp_path):
    workdir = str(tmp_path / "run")
    _, sft_eval = _eval_row(1, 2, stage="sft", step=8, tokens=300)
    _write_rows(workdir, [sft_eval])
    text = _report_text(workdir)
    assert "| pass@1 | 0.375 | - | - |" in text
    assert "| metric | before RL (sft step 8) | - | Δ |" in text
    # The learning table: the missing rows are dashes, each with a line saying why.
    assert "| base | - | - | - | - | - |" in text
    assert "| RL | - | - | - | - | - |" in text
    assert "- base: not evaluated (rl.eval.base off, or no long_context checkpoint)." in text
    assert "- RL: not evaluated (no eval after RL yet)." in text
    assert "No copy probe logged" in text

    # A row written before the intervals existed: the values alone.
    old = {k: v for k, v in sft_eval.items() if "_ci_" not in k and k != "samples_per_task"}
    _write_rows(workdir, [old])
    text = _report_text(workdir)
    assert "| SFT | sft step 8 | 0.375 | 1.000 | 1.000 | 2 × - |" in text

    empty = str(tmp_path / "empty")
    text = _report_text(empty)
    assert "No metrics rows yet." in text and "No plots" in text


def test_corrupt_registry_does_not_stop_the_report(tmp_path):
    workdir = str(tmp_path / "run")
    _write_rows(workdir, _training_rows())
    os.makedirs(os.path.join(workdir, "eval"))
    with open(Workdir(workdir).registry_file, "w") as fh:
        fh.write("{")
    text = _report_text(workdir)
    assert "Unreadable: eval registry" in text


def test_command_line(tmp_path):
    workdir = str(tmp_path / "run")
    _full_run(workdir)
    done = subprocess.run(
        [sys.executable, "-m", "cursor_rl.eval.report", f"--workdir={workdir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == os.path.join(workdir, "report.md")
    assert os.path.exists(os.path.join(workdir, "rl_length.png"))


def test_operations_section_lists_what_the_watchdog_saw_and_did(tmp_path):
    """The watchdog's events (ops/events.jsonl) become the report's Operations
    section: counts by kind, then each finding with its action and alert delivery;
    a run nobody watched says so."""
    from cursor_rl.ops import heartbeat

    workdir = str(tmp_path / "run")
    _write_rows(workdir, _training_rows()[:3])
    assert "No watchdog ran" in _report_text(workdir)
    heartbeat.record_event(workdir, "watch_started", roles=["main"])
    for key, kind, message, action in [
        ("crash:main:7", "crash", "main (pid 7) exited with code -9", "restarted main (1/3)"),
        ("nonfinite:rl:3@0", "nonfinite", "non-finite policy_loss at rl step 3", "rewound rl"),
    ]:
        heartbeat.record_event(workdir, "detected", key=key, kind=kind, message=message)
        heartbeat.record_event(workdir, "action", key=key, action=action)
        heartbeat.record_event(workdir, "alert", key=key, delivery="queued")
    heartbeat.record_event(
        workdir, "watch_stopped", restarts={"main": 1}, alerts={"sent": 2}, malformed_metric_lines=1
    )
    text = _report_text(workdir).split("## Operations (watchdog)")[1]
    assert "Findings by kind: crash 1, nonfinite 1." in text
    assert "malformed metric lines 1" in text
    assert "| crash | main (pid 7) exited with code -9 | restarted main (1/3) | queued |" in text
    assert "| nonfinite | non-finite policy_loss at rl step 3 | rewound rl | queued |" in text


def test_feedback_section_and_plot_compare_behaviour_rates_with_a_baseline(tmp_path):
    """Textual feedback: per RL step each detector's rate (the behaviour) and the
    points trained; with a baseline run both runs' first -> last rates side by side,
    and feedback.png drawn. A run without feedback metrics says so."""

    def rl_rows(rates, trained):
        return [
            {"stage": "rl", "step": i + 1, "time": 10.0 * i, "scored_episodes": 8,
             "feedback/gave_up_early": rate, "feedback/points": 8 * rate,
             "feedback/trained_points": n, "feedback_signal": 0.5}
            for i, (rate, n) in enumerate(zip(rates, trained))
        ]  # fmt: skip

    on, off = str(tmp_path / "on"), str(tmp_path / "off")
    _write_rows(on, rl_rows([0.5, 0.25, 0.125], [4, 2, 1]))
    _write_rows(off, rl_rows([0.5, 0.5, 0.375], [0, 0, 0]))
    text = pathlib.Path(report.write_report(on, baseline=off)).read_text()
    section = text.split("## Textual feedback")[1].split("##")[0]
    assert "| step | gave_up_early | points trained | signal |" in section
    assert "| 2 | 0.250 | 2 | 0.500 |" in section
    assert "| gave_up_early | 0.500 → 0.125 | 0.500 → 0.375 |" in section
    assert pathlib.Path(on, "feedback.png").read_bytes().startswith(PNG_MAGIC)
    kl = str(tmp_path / "kl")  # objective "kl": its KL per window token has a column
    _write_rows(kl, [dict(r, feedback_kl=0.75) for r in rl_rows([0.5, 0.25], [4, 2])])
    section = _report_text(kl).split("## Textual feedback")[1].split("##")[0]
    assert "| step | gave_up_early | points trained | signal | KL |" in section
    assert "| 2 | 0.250 | 2 | 0.500 | 0.750 |" in section
    empty = str(tmp_path / "none")
    _write_rows(empty, _training_rows()[:3])
    assert "No textual-feedback metrics" in _report_text(empty)
