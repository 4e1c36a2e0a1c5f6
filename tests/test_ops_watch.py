"""The watchdog (cursor_rl.ops): detectors on recorded metric streams, heartbeats,
alerts to a local webhook, rewinds, and supervision of real processes."""

import collections
import http.server
import json
import math
import os
import sys
import threading
import time
from typing import ClassVar

import numpy as np
import pytest

from cursor_rl.ops import alerts, detectors, faults, heartbeat, watch
from cursor_rl.train.metrics import MetricsWriter, read_metrics
from cursor_rl.workdir import Workdir

# ---- detectors on metric streams ------------------------------------------------------


def _train_rows(losses, stage="pretrain"):
    return [{"stage": stage, "step": i + 1, "ce_loss": v} for i, v in enumerate(losses)]


def test_metrics_writer_names_nonfinite_values_and_the_detector_finds_them(tmp_path):
    """A NaN loss is written as null with its key listed under ``nonfinite``; the
    detector reports it once per row, with its stage and step; finite rows pass."""
    writer = MetricsWriter(tmp_path)
    writer.write("pretrain", 1, {"loss": 2.0, "grad_norm": 1.0})
    writer.write("pretrain", 2, {"loss": float("nan"), "grad_norm": math.inf})
    writer.write("rl", 3, {"policy_loss": 0.1, "update_skipped": 1})
    writer.close()
    rows = read_metrics(tmp_path)
    assert rows[1]["loss"] is None and rows[1]["nonfinite"] == ["loss", "grad_norm"]
    assert "nonfinite" not in rows[0]
    found = detectors.nonfinite(rows)
    assert [(f.stage, f.step) for f in found] == [("pretrain", 2), ("rl", 3)]
    assert found[0].evidence["keys"] == ["grad_norm", "loss"]
    assert "update skipped" in found[1].message


def test_loss_spike_is_judged_against_the_median_before_it():
    """A loss 4x the median of the rows before it is a spike; the early fall of a
    stage (fewer than min_rows before) and a gentle rise are not."""
    losses = [9.0, 6.0, 4.0, 3.0, 2.9, 2.8, 2.7, 2.75, 11.0, 2.7, 2.9]
    found = detectors.loss_spikes(_train_rows(losses), factor=3.0, window=20, min_rows=5)
    assert [f.step for f in found] == [9]
    assert found[0].evidence["value"] == 11.0
    assert detectors.loss_spikes(_train_rows([9.0, 1.0, 5.0]), min_rows=5) == []
    calm = _train_rows([3.0, 3.1, 3.0, 3.2, 3.3, 3.4, 3.6])
    assert detectors.loss_spikes(calm) == []


def _rl_rows(rewards, lost=None, scored=8):
    lost = lost or [0] * len(rewards)
    return [
        {"stage": "rl", "step": i + 1, "reward": r, "scored_episodes": scored, "episodes_lost": n}
        for i, (r, n) in enumerate(zip(rewards, lost))
    ]


def test_infra_failures_over_a_window_of_rl_batches():
    """Lost episodes above the rate over the last `window` batches are a finding
    aimed at the sampler; one bad batch in the window is not."""
    rows = _rl_rows([0.1] * 5, lost=[0, 0, 8, 0, 0])
    assert detectors.infra_failures(rows, max_rate=0.5, window=3) == []
    rows = _rl_rows([0.1] * 5, lost=[0, 0, 8, 24, 24])
    (found,) = detectors.infra_failures(rows, max_rate=0.5, window=3)
    assert found.role == "sampler" and found.step == 5
    assert found.evidence["lost"] == 56 and found.evidence["episodes"] == 56 + 24


def test_reward_collapse_needs_earned_reward_then_a_sustained_fall():
    rising = _rl_rows([0.0, 0.1, 0.2, 0.3, 0.4, 0.4, 0.5, 0.5, 0.4, 0.5])
    assert detectors.reward_collapse(rising, window=3) == []
    never = _rl_rows([0.0] * 12)
    assert detectors.reward_collapse(never, window=3) == []
    collapsed = _rl_rows([0.3, 0.4, 0.5, 0.4, 0.3, 0.05, 0.0, 0.0, 0.0])
    (found,) = detectors.reward_collapse(collapsed, window=3, fraction=0.25)
    assert found.step == 9 and found.evidence["recent_mean"] == 0.0


def test_stalls_tell_a_waiting_role_from_a_stuck_one():
    now = 10_000.0
    beats = {
        "trainer": {"pid": 1, "time": now - 5, "progress_time": now - 4000, "stage": "rl"},
        "sampler": {"pid": 2, "time": now - 5, "progress_time": now - 4000, "waiting": "x"},
        "hung": {"pid": 3, "time": now - 4000, "progress_time": now - 4000},
        "fine": {"pid": 4, "time": now - 5, "progress_time": now - 60},
        "done": {"pid": 5, "time": now - 9000, "progress_time": now - 9000, "finished": True},
    }
    found = {f.role: f for f in detectors.stalls(beats, now, stall_s=1800)}
    assert set(found) == {"trainer", "hung"}
    assert "no progress" in found["trainer"].message
    assert "no heartbeat" in found["hung"].message


def test_disk_nearly_full_uses_fraction_and_bytes():
    usage = collections.namedtuple("usage", "total used free")
    full = lambda path: usage(100 * 2**30, 99 * 2**30, 2**29)
    roomy = lambda path: usage(100 * 2**30, 10 * 2**30, 90 * 2**30)
    assert len(detectors.disk_nearly_full("/x", usage=full)) == 1
    assert detectors.disk_nearly_full("/x", usage=roomy) == []


def test_failed_checkpoints_from_events_and_stale_orbax_temporaries(tmp_path):
    wd = Workdir(tmp_path)
    ckpt = wd.checkpoint_dir("pretrain")
    (ckpt / "20").mkdir(parents=True)
    stale = ckpt / "30.orbax-checkpoint-tmp-123"
    stale.mkdir()
    fresh = ckpt / "40.orbax-checkpoint-tmp-456"
    fresh.mkdir()
    old = time.time() - 7200
    os.utime(stale, (old, old))
    events = [{"event": "checkpoint_failed", "path": "/p", "step": 7, "error": "OSError()"}]
    found = detectors.failed_checkpoints(wd, events, time.time(), tmp_age_s=1800)
    assert len(found) == 2
    assert found[0].step == 7
    assert "30.orbax-checkpoint-tmp" in found[1].message


def test_checkpoint_manager_records_a_failed_save(tmp_path):
    """A save that raises (here: the disk is full) records ``checkpoint_failed`` in the
    event log, then raises: the watchdog's checkpoint detector sees it."""
    from cursor_rl import checkpoints

    record = heartbeat.checkpoint_failure_recorder(tmp_path, "main")
    manager = checkpoints.CheckpointManager(str(tmp_path / "c"), async_save=False, on_error=record)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    manager._manager.save = full_disk
    with pytest.raises(OSError, match="No space"):
        manager.save(3, {"params": {"w": np.zeros(2)}})
    (event,) = [e for e in heartbeat.read_events(tmp_path) if e["event"] == "checkpoint_failed"]
    assert event["step"] == 3 and event["role"] == "main"
    found = detectors.failed_checkpoints(tmp_path, heartbeat.read_events(tmp_path), time.time())
    assert len(found) == 1


# ---- heartbeats, metrics tail --------------------------------------------------------


def test_heartbeat_progress_waiting_and_finish(tmp_path, monkeypatch):
    monkeypatch.setenv(heartbeat.ROLE_ENV, "sampler")
    beat = heartbeat.Heartbeat(tmp_path, heartbeat.role_name("main"), min_interval_s=0)
    beat.progress("rl_rollouts", 3)
    first = heartbeat.read_heartbeats(tmp_path)["sampler"]
    assert first["pid"] == os.getpid() and first["step"] == 3 and first["waiting"] is None
    time.sleep(0.01)
    beat.waiting("the trainer")
    waiting = heartbeat.read_heartbeats(tmp_path)["sampler"]
    assert waiting["waiting"] == "the trainer"
    assert waiting["progress_time"] == first["progress_time"] < waiting["time"]
    beat.finished()
    assert heartbeat.read_heartbeats(tmp_path)["sampler"]["finished"] is True


def test_metrics_tail_reads_complete_lines_and_counts_malformed_ones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"stage": "a", "step": 1}\nnot json\n[1, 2]\n{"stage": "a", "st')
    tail = watch.MetricsTail(path)
    assert [r["step"] for r in tail.read()] == [1]
    assert tail.malformed == 2 and tail.malformed_lines == [2, 3]
    with path.open("a") as fh:
        fh.write('ep": 2}\n')
    assert [r["step"] for r in tail.read()] == [2]
    assert tail.read() == []


# ---- alerts --------------------------------------------------------------------------


class _Hook(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list] = []
    delay_s = 0.0
    status = 200

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.delay_s)
        type(self).received.append(json.loads(body))
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook():
    """A local Slack-compatible webhook: records each JSON body it is sent."""

    class Hook(_Hook):
        received: ClassVar[list] = []

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Hook, f"http://127.0.0.1:{server.server_port}/hook"
    server.shutdown()


def test_alerts_reach_the_webhook_once_per_key_and_are_rate_limited(webhook):
    hook, url = webhook
    recorded = []
    alerter = alerts.Alerter(
        url, run="r1", record=recorded.append, max_per_hour=2, timeout_s=30.0, retries=0
    )
    args = dict(event="nonfinite", message="NaN at rl 3", evidence={"step": 3}, action="rewound")
    assert alerter.alert(key="a", **args) == "queued"
    assert alerter.alert(key="a", **args) == "duplicate"
    assert alerter.alert(key="b", **args) == "queued"
    assert alerter.alert(key="c", **args) == "suppressed"
    alerter.close()
    assert len(hook.received) == 2 and alerter.counts["sent"] == 2
    text = hook.received[0]["text"]
    assert "r1" in text and "NaN at rl 3" in text and "rewound" in text and '"step": 3' in text
    assert [r["delivery"] for r in recorded] == ["queued", "queued", "suppressed"]


def test_a_slow_or_dead_webhook_never_blocks_the_caller(webhook):
    hook, url = webhook
    hook.delay_s = 3.0
    alerter = alerts.Alerter(url, run="r", timeout_s=0.5, retries=0, max_queue=2)
    start = time.time()
    fates = [alerter.alert(key=str(i), event="e", message="m") for i in range(6)]
    assert time.time() - start < 0.5  # queued or dropped, never waited for
    assert "dropped" in fates and fates[0] == "queued"
    alerter.close(timeout_s=5)
    assert alerter.counts["failed"] >= 1  # timed out
    dead = alerts.Alerter("http://127.0.0.1:9/none", run="r", timeout_s=0.5, retries=0)
    recorded = []
    dead.record = recorded.append
    dead.alert(key="x", event="e", message="m")
    dead.close()
    assert dead.counts["failed"] == 1
    assert recorded[-1]["event"] == "alert_failed"


# ---- rewind --------------------------------------------------------------------------


def _mkckpt(directory, *steps):
    for s in steps:
        (directory / str(s)).mkdir(parents=True)


def test_rewind_of_a_train_stage_quarantines_checkpoints_from_the_bad_step(tmp_path):
    wd = Workdir(tmp_path)
    _mkckpt(wd.checkpoint_dir("pretrain"), 10, 20, 30)
    done = watch.rewind(wd, [], "pretrain", 20, tag="t")
    assert done["restored_step"] == 10
    assert detectors.checkpoint_steps(wd.checkpoint_dir("pretrain")) == [10]
    assert sorted(done["quarantined"]) == ["pretrain/checkpoints/20", "pretrain/checkpoints/30"]
    assert (wd.quarantine_dir / "t" / "pretrain" / "checkpoints" / "30").is_dir()


def test_rewind_of_rl_sets_back_checkpoints_policies_rollouts_and_cursor(tmp_path):
    """NaN at RL step 4 (rollout 3): the trainer goes back to checkpoint 3 (version
    2), policies 3-4 and the rollouts they sampled are quarantined, rollout 3 (sampled
    by version 2) stays unless skip_bad_batch, TRAINED goes back to 3."""
    wd = Workdir(tmp_path)
    _mkckpt(wd.checkpoint_dir("rl"), 3, 4)
    _mkckpt(wd.policy_dir, 1, 2, 3, 4)
    wd.rollouts_dir.mkdir(parents=True)
    for index, version in enumerate([0, 1, 2, 2, 3, 4]):
        (wd.rollouts_dir / f"{index:06d}.json").write_text(json.dumps({"policy_version": version}))
    (wd.rollouts_dir / "TRAINED").write_text("5")
    rows = [{"stage": "rl", "step": s, "policy_version": v} for s, v in [(2, 1), (3, 2), (4, 3)]]
    done = watch.rewind(wd, rows, "rl", 4, tag="t")
    assert done["restored_step"] == 3 and done["restored_policy_version"] == 2
    assert detectors.checkpoint_steps(wd.checkpoint_dir("rl")) == [3]
    assert detectors.checkpoint_steps(wd.policy_dir) == [1, 2]
    left = sorted(p.name for p in wd.rollouts_dir.glob("0*.json"))
    assert left == [f"{i:06d}.json" for i in range(4)]
    assert (wd.rollouts_dir / "TRAINED").read_text() == "3"
    # Nothing is deleted: 1 checkpoint + 2 policies + 2 rollouts are in quarantine.
    assert len(done["quarantined"]) == 5
    assert len(list((wd.quarantine_dir / "t" / "rl" / "rollouts").glob("*.json"))) == 2
    again = watch.rewind(wd, rows, "rl", 4, skip_bad_batch=True, tag="u")
    assert "rl/rollouts/000003.json" in again["quarantined"]


def test_rewind_of_rl_quarantines_batches_past_a_gap_left_by_another_sampler(tmp_path):
    """Two samplers (sampler k writes indices k, k+2, ...): sampler 0 has not written
    batch 4 yet, sampler 1 has written 5 with a policy the rewind sets aside; 5 goes
    to quarantine too, so sampler 1 samples it again from the restored policy."""
    wd = Workdir(tmp_path)
    _mkckpt(wd.checkpoint_dir("rl"), 3, 4)
    _mkckpt(wd.policy_dir, 1, 2, 3)
    wd.rollouts_dir.mkdir(parents=True)
    for index, version in [(0, 0), (1, 1), (2, 2), (3, 2), (5, 3)]:
        (wd.rollouts_dir / f"{index:06d}.json").write_text(json.dumps({"policy_version": version}))
    rows = [{"stage": "rl", "step": s, "policy_version": v} for s, v in [(2, 1), (3, 2), (4, 3)]]
    done = watch.rewind(wd, rows, "rl", 4, tag="t")
    assert "rl/rollouts/000005.json" in done["quarantined"]
    left = sorted(p.name for p in wd.rollouts_dir.glob("0*.json"))
    assert left == [f"{i:06d}.json" for i in range(4)]


def test_nan_injection_fires_once_per_workdir(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.NAN_ENV, "rl:3")
    assert not faults.inject_nan(tmp_path, "rl", 2)
    assert faults.inject_nan(tmp_path, "rl", 3)
    assert not faults.inject_nan(tmp_path, "rl", 3)
    monkeypatch.delenv(faults.NAN_ENV)
    assert not faults.inject_nan(tmp_path / "other", "rl", 3)


# ---- supervising processes -----------------------------------------------------------

# A role that beats, crashes on its first life, and exits 0 on its second.
_FLAKY = """
import os, sys, time
from cursor_rl.ops import heartbeat
wd = sys.argv[1]
beat = heartbeat.Heartbeat(wd, heartbeat.role_name("x"), min_interval_s=0)
marker = os.path.join(wd, "lived")
first = not os.path.exists(marker)
open(marker, "a").write("x")
for step in range(3):
    beat.progress("work", step)
    time.sleep(0.1)
sys.exit(3 if first else 0)
"""

# A role that beats once and then hangs without beating (a deadlock).
_HANGS_ONCE = """
import os, sys, time
from cursor_rl.ops import heartbeat
wd = sys.argv[1]
beat = heartbeat.Heartbeat(wd, heartbeat.role_name("x"), min_interval_s=0)
marker = os.path.join(wd, "hung")
if not os.path.exists(marker):
    open(marker, "w").write("x")
    beat.progress("work", 1)
    time.sleep(600)
beat.progress("work", 2)
"""


def _config(**kw):
    return watch.WatchConfig(**{"poll_s": 0.2, **kw})


def _one_alert(hook, events):
    """The distinct texts the webhook got, after checking the watchdog queued one alert.

    Delivery is at least once: a post that times out on a loaded machine after the
    server read it is retried, so the webhook may see the same text twice."""
    queued = [e for e in events if e["event"] == "alert" and e["delivery"] == "queued"]
    assert len(queued) == 1, queued
    return sorted({body["text"] for body in hook.received})


def test_a_crashed_role_is_restarted_and_the_owner_alerted(tmp_path, webhook):
    hook, url = webhook
    script = tmp_path / "flaky.py"
    script.write_text(_FLAKY)
    config = _config(webhook_url=url, alert_timeout_s=30.0)
    dog = watch.Watchdog(tmp_path, config, {"worker": [sys.executable, str(script), str(tmp_path)]})
    assert dog.run() == 0
    assert dog.roles["worker"].restarts == 1
    events = heartbeat.read_events(tmp_path)
    kinds = [e["event"] for e in events]
    assert "detected" in kinds and "restarted" in kinds and kinds[-1] == "watch_stopped"
    (sent,) = _one_alert(hook, events)
    assert "exited with code 3" in sent and "restarted worker" in sent


def test_a_stalled_role_is_killed_and_restarted(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(_HANGS_ONCE)
    config = _config(stall_minutes=1.5 / 60)  # 1.5 s without a beat
    dog = watch.Watchdog(tmp_path, config, {"w": [sys.executable, str(script), str(tmp_path)]})
    start = time.time()
    assert dog.run() == 0
    assert time.time() - start < 60
    stalls = [e for e in heartbeat.read_events(tmp_path) if e.get("kind") == "stall"]
    assert stalls and stalls[0]["role"] == "w"


def test_the_restart_budget_stops_a_run_that_keeps_crashing(tmp_path):
    config = _config(restart_budget=2)
    crash = [sys.executable, "-c", "import sys; sys.exit(5)"]
    dog = watch.Watchdog(tmp_path, config, {"bad": crash})
    assert dog.run() == 1
    assert dog.roles["bad"].restarts == 2
    actions = [e["action"] for e in heartbeat.read_events(tmp_path) if e["event"] == "action"]
    assert "restart budget (2) spent" in actions[-1]


def test_watch_only_alerts_without_acting_and_counts_malformed_lines(tmp_path, webhook):
    hook, url = webhook
    wd = Workdir(tmp_path)
    wd.metrics_file.parent.mkdir(parents=True, exist_ok=True)
    rows = _train_rows([3.0, 2.9, 2.8, 2.8, 2.7, 2.7, 30.0])
    lines = [json.dumps(r) for r in rows] + ["{torn", json.dumps({"stage": "rl", "step": 1})]
    wd.metrics_file.write_text("\n".join(lines) + "\n")
    code = watch.main(
        ["watch", f"--workdir={tmp_path}", "--poll_s=0.1", "--max_minutes=0.005",
         f"--webhook_url={url}", "--alert_timeout_s=30"]
    )  # fmt: skip
    assert code == 0
    events = heartbeat.read_events(tmp_path)
    (sent,) = _one_alert(hook, events)
    assert "loss_spike" in sent and "none: alert only" in sent
    stopped = events[-1]
    assert stopped["event"] == "watch_stopped" and stopped["malformed_metric_lines"] == 1


def test_bad_flags_are_refused_with_a_message(tmp_path, capsys):
    assert watch.main(["watch", f"--workdir={tmp_path}", "--on_nonfinite=pray"]) == 2
    assert "on_nonfinite" in capsys.readouterr().err
    assert watch.main(["watch", f"--workdir={tmp_path}", "--role=nocommand"]) == 2


def test_the_command_after_double_dash_is_the_main_role(tmp_path):
    """``watch --workdir=W -- CMD --flag`` supervises CMD (flags and all) as ``main``
    with $CURSOR_RL_ROLE set, and exits 0 when it does."""
    out = tmp_path / "seen"
    code = (
        "import os, sys; open(sys.argv[1], 'w').write(os.environ['CURSOR_RL_ROLE'] + ' '"
        " + ' '.join(sys.argv[2:]))"
    )
    argv = ["watch", f"--workdir={tmp_path}", "--poll_s=0.1", "--", sys.executable, "-c", code]
    assert watch.main([*argv, str(out), "--config.x=1"]) == 0
    assert out.read_text() == "main --config.x=1"
