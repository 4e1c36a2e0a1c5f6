"""``cursor_rl.pipeline.run``: what every invocation leaves in the workdir."""

import json

from cursor_rl import config_lib, pipeline
from cursor_rl.eval import report
from cursor_rl.rl import loop as rl_loop


def test_an_rl_only_run_records_its_own_config(tmp_path, monkeypatch):
    """`--config.stage=rl` writes WORKDIR/config.json with its overrides: the outer loop
    and the judge read the run's task datasets from it, so a stale config from an
    earlier train stage would point them at the wrong tasks."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(json.dumps({"rl": {"tasks": {"train": "/old"}}}))
    ran = []
    monkeypatch.setattr(rl_loop, "run_rl", lambda config, wd: ran.append(config.stage) or {})
    monkeypatch.setattr(report, "write_report", lambda wd: None)
    config = config_lib.base_config()
    config.stage = "rl"
    config.rl.tasks.train = "/new/train_tasks"
    config.rl.num_steps = 7

    rows = pipeline.run(config, workdir)

    assert ran == ["rl"] and [r.stage for r in rows] == ["rl"]
    written = json.loads((workdir / "config.json").read_text())
    assert written["stage"] == "rl"
    assert written["rl"]["tasks"]["train"] == "/new/train_tasks"
    assert written["rl"]["num_steps"] == 7
