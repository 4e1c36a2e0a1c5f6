"""Checks that a pipeline run went through every stage: what CI runs after the smoke run.

    python -m launch.check_run WORKDIR        # from the repository root

Looks at the workdir only (its layout from ``cursor_rl.workdir``): the config and the
tokenizer; for pretrain, long-context and SFT a finalised checkpoint at the stage's
last step (``train.num_steps`` of the config the run wrote); for RL the trainer's
checkpoint at ``rl.num_steps``, a published policy and the DONE marker; metrics rows
of every stage and a held-out eval before and after RL; and ``report.md`` naming
every stage. Prints one line per check; exits 1 if any failed, 2 on a bad argument.
"""

from __future__ import annotations

import json
import sys

import ml_collections


def check(workdir) -> list[tuple[bool, str]]:
    """(passed, what) for every check of the run in ``workdir`` (a path or Workdir)."""
    from cursor_rl import checkpoints, stages
    from cursor_rl.train.metrics import read_metrics
    from cursor_rl.workdir import Workdir

    wd = Workdir.of(workdir)
    results: list[tuple[bool, str]] = []

    def expect(ok: bool, what: str) -> None:
        results.append((bool(ok), what))

    expect(wd.config_file.exists(), f"config {wd.config_file}")
    expect(wd.tokenizer_file.exists(), f"tokenizer {wd.tokenizer_file}")
    config = None
    if wd.config_file.exists():
        config = ml_collections.ConfigDict(json.loads(wd.config_file.read_text()))

    def last_step(stage: str) -> int | None:
        if config is None:
            return None
        stage_cfg = stages.stage_config(config, stage)
        return int(stage_cfg.rl.num_steps if stage == "rl" else stage_cfg.train.num_steps)

    for stage in (*stages.TRAIN_STAGES, "rl"):
        directory = wd.checkpoint_dir(stage)
        steps = checkpoints.finalised_steps(directory)
        want = last_step(stage)
        ok = bool(steps) and (want is None or steps[-1] == want)
        got = f"steps {steps}" if steps else "none"
        expect(ok, f"{stage} checkpoint at step {want} in {directory} ({got})")
    policies = checkpoints.finalised_steps(wd.policy_dir)
    expect(bool(policies), f"published RL policy in {wd.policy_dir} ({policies or 'none'})")
    expect(wd.rl_done_file.exists(), f"RL finished ({wd.rl_done_file})")

    rows = read_metrics(wd)
    for stage in (*stages.TRAIN_STAGES, "rl"):
        n = sum(r.get("stage") == stage and "bench" not in r for r in rows)
        expect(n > 0, f"{stage} metrics rows in {wd.metrics_file} ({n})")
    for stage, when in (("sft", "before"), ("rl", "after")):
        n = sum(r.get("stage") == stage and "bench" in r for r in rows)
        expect(n > 0, f"held-out eval {when} RL (stage {stage} rows with a bench: {n})")

    report = wd.report_file.read_text() if wd.report_file.exists() else ""
    expect(bool(report), f"report {wd.report_file}")
    missing = [s for s in (*stages.TRAIN_STAGES, "rl") if f"| {s} |" not in report]
    expect(not missing, f"report names every stage (missing: {missing or 'none'})")
    return results


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m launch.check_run WORKDIR", file=sys.stderr)
        return 2
    from cursor_rl.workdir import Workdir, WorkdirError

    try:
        workdir = Workdir(argv[1])
    except WorkdirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not workdir.root.is_dir():
        print(f"error: workdir {workdir} does not exist", file=sys.stderr)
        return 2
    results = check(workdir)
    for ok, what in results:
        print(f"[check] {'ok  ' if ok else 'FAIL'} {what}")
    failed = sum(not ok for ok, _ in results)
    print(f"[check] {workdir}: " + (f"{failed} check(s) failed" if failed else "every stage ran"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
