"""A run that survives faults: the watchdog supervises a micro RL run (trainer and
sampler as two processes); the test kills the sampler and injects a NaN into a
trainer step; the run completes, the alerts arrive, and nothing is lost."""

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import ClassVar

import pytest
from test_rl_loop import ROOT, rl_workdir, tokenizer, variables  # noqa: F401 (fixtures)

from cursor_rl.ops import detectors, faults, heartbeat
from cursor_rl.rl.loop import RolloutStore
from cursor_rl.train.metrics import read_metrics
from cursor_rl.workdir import Workdir

NUM_STEPS = 4
NAN_STEP = 3


class _Hook(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(json.loads(body)["text"])
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def _role(workdir, role):
    return (
        f"{role}={sys.executable} -m cursor_rl.main --config=tests/rl_micro_config.py "
        f"--workdir={workdir} --config.rl.role={role} --config.rl.num_steps={NUM_STEPS}"
    )


@pytest.mark.slow
def test_watchdog_recovers_a_killed_sampler_and_a_nan_step(rl_workdir, tmp_path):  # noqa: F811
    from cursor_rl.tasks import workdir as workdir_tasks

    workdir_tasks.ensure_datasets(rl_workdir, train_count=2, bench_count=2, log=lambda _: None)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "",
        "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
        faults.NAN_ENV: f"rl:{NAN_STEP}",
    }
    cmd = [
        sys.executable, "-m", "cursor_rl.ops.watch", f"--workdir={rl_workdir}",
        "--poll_s=0.5", f"--log_dir={tmp_path / 'logs'}",
        f"--webhook_url=http://127.0.0.1:{server.server_port}/hook",
        f"--role={_role(rl_workdir, 'trainer')}", f"--role={_role(rl_workdir, 'sampler')}",
    ]  # fmt: skip
    log = open(tmp_path / "watch.log", "w")  # noqa: SIM115
    dog = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wd = Workdir(rl_workdir)
    store = RolloutStore(rl_workdir)
    try:
        # Kill the sampler once it has written its first rollout batch.
        deadline = time.time() + 600
        while not store.exists(0):
            assert dog.poll() is None and time.time() < deadline, _logs(tmp_path)
            time.sleep(0.5)
        victim = heartbeat.read_heartbeats(rl_workdir)["sampler"]["pid"]
        os.kill(victim, signal.SIGKILL)
        code = dog.wait(timeout=max(1, deadline - time.time()))
    finally:
        if dog.poll() is None:
            dog.send_signal(signal.SIGTERM)
            dog.wait(60)
        server.shutdown()
    assert code == 0, _logs(tmp_path)

    events = heartbeat.read_events(rl_workdir)
    detected = [e for e in events if e["event"] == "detected"]
    kinds = [(e["kind"], e.get("role") or e.get("stage")) for e in detected]
    assert ("crash", "sampler") in kinds, kinds
    assert ("nonfinite", "rl") in kinds, kinds
    (rewound,) = [e for e in events if e["event"] == "rewound"]
    assert rewound["bad_step"] == NAN_STEP and rewound["restored_step"] == NAN_STEP - 1
    # The owner was told of both, with the action taken.
    sent = _Hook.received
    assert any("exited with code" in t and "restarted sampler" in t for t in sent), sent
    assert any("non-finite" in t and "rewound rl to step" in t for t in sent), sent

    # The run completed every step, each step's final row finite.
    assert store.done and store.trained() == NUM_STEPS
    final = {}
    for row in read_metrics(rl_workdir):
        if row["stage"] == "rl" and "scored_episodes" in row:
            final[row["step"]] = row
    assert sorted(final) == list(range(1, NUM_STEPS + 1))
    assert all(row["policy_loss"] is not None for row in final.values())
    # Nothing lost, counted: every rollout batch trained is on disk, each batch the run
    # ever wrote is on disk or in quarantine, and the trainer's checkpoints reach the end.
    for index in range(NUM_STEPS):
        assert store.exists(index)
    quarantined = set(rewound["quarantined"])
    # The policy the NaN step published is set aside: the trainer publishes it before it
    # writes the step's metrics row, so it is on disk when the watchdog sees the row. The
    # step's checkpoint is written after the row, so the watchdog may stop the trainer
    # before or after it lands; whichever, no checkpoint of the bad step or later stays.
    assert f"rl/policy/{NAN_STEP}" in quarantined, quarantined
    set_aside = [p for p in quarantined if p.startswith("rl/checkpoints/")]
    assert all(int(p.rsplit("/", 1)[1]) >= NAN_STEP for p in set_aside), set_aside
    for path in quarantined:  # set aside, not deleted
        assert (wd.quarantine_dir / rewound["tag"] / path).exists(), path
    written = {p.name for p in wd.rollouts_dir.glob("0*.json")}
    written |= {os.path.basename(p) for p in quarantined if p.startswith("rl/rollouts/0")}
    indexes = sorted(int(name.split(".")[0]) for name in written)
    assert indexes == list(range(len(indexes)))
    steps = sorted(int(p.name) for p in wd.checkpoint_dir("rl").iterdir() if p.name.isdigit())
    assert steps[-1] == NUM_STEPS
    # The detectors on this real stream: the injected NaN is the only fault in it.
    rows = read_metrics(rl_workdir)
    assert [(f.stage, f.step) for f in detectors.nonfinite(rows)] == [("rl", NAN_STEP)]
    quiet = detectors.loss_spikes(rows, ("ce_loss", "policy_loss"))
    quiet += detectors.infra_failures(rows) + detectors.reward_collapse(rows)
    assert quiet == []
    stopped = events[-1]
    assert stopped["event"] == "watch_stopped"
    assert stopped["restarts"]["sampler"] >= 1 and stopped["restarts"]["trainer"] == 1


def _logs(tmp_path):
    out = []
    for path in [tmp_path / "watch.log", *sorted((tmp_path / "logs").glob("*.log"))]:
        if os.path.exists(path):
            with open(path) as fh:
                out.append(f"--- {path.name}\n" + fh.read()[-2500:])
    return "\n".join(out)
