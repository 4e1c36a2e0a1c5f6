"""Multi-host: a 2-process x 4-device CPU "pod" trains like 1 process x 8 devices.

The pod's processes start through ``launch/run_tpu.sh worker``, the command every TPU
VM worker runs, with explicit coordinator settings (TPU workers discover their peers;
CPU processes on one machine need to be told). ``data.process_sharding="rows"`` makes
each process read the global stream and keep its own rows, so the losses do not
depend on the process count.
"""

import os
import subprocess
import sys
import textwrap

import jax
import portpicker
import pytest

from cursor_rl import checkpoints
from cursor_rl.train import loop, metrics
from cursor_rl.workdir import Workdir
from tests.train_helpers import micro_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS_FIRST, STEPS_TOTAL = 4, 6


def _pod_config(num_steps):
    """The micro config as the pod runs it (the config file below says the same)."""
    config = micro_config(num_steps=num_steps)
    config.data.process_sharding = "rows"
    # A schedule that does not depend on num_steps, so 4 steps + a resumed 2 equal 6 steps.
    config.optimizer.schedule = "constant"
    return config


def _losses(workdir):
    return {
        row["step"]: row["ce_loss"]
        for row in metrics.read_metrics(workdir)
        if row["stage"] == "pretrain" and "ce_loss" in row
    }


def _run_pod(config_file, workdir, num_steps, num_processes=2, devices_per_process=4):
    """Starts the pod's processes through the TPU worker script; returns their outputs."""
    port = portpicker.pick_unused_port()
    procs = []
    for process_id in range(num_processes):
        env = dict(
            os.environ,
            PYTHONPATH=ROOT,
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
            CURSOR_RL_PYTHON=sys.executable,
            CURSOR_RL_COORDINATOR=f"127.0.0.1:{port}",
            CURSOR_RL_NUM_PROCESSES=str(num_processes),
            CURSOR_RL_PROCESS_ID=str(process_id),
        )
        cmd = [
            "bash",
            os.path.join(ROOT, "launch", "run_tpu.sh"),
            "worker",
            "--",
            f"--config={config_file}",
            f"--workdir={workdir}",
            f"--config.train.num_steps={num_steps}",
        ]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=400)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for process_id, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {process_id} failed:\n{output[-4000:]}"
    return outputs


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="the reference needs 8 (emulated) devices")
def test_two_process_pod_matches_one_process_and_resumes_across_processes(tmp_path):
    reference = str(tmp_path / "reference")
    loop.run(_pod_config(STEPS_TOTAL), reference)
    expected = _losses(reference)
    assert sorted(expected) == list(range(1, STEPS_TOTAL + 1))

    config_file = tmp_path / "pod_config.py"
    config_file.write_text(
        textwrap.dedent(
            """
            from tests.train_helpers import micro_config

            def get_config(arg=None):
                c = micro_config()
                c.data.process_sharding = "rows"
                c.optimizer.schedule = "constant"
                return c
            """
        )
    )
    workdir = str(tmp_path / "pod")
    outputs = _run_pod(config_file, workdir, STEPS_FIRST)
    assert "[pretrain]" in outputs[0] and "[pretrain]" not in outputs[1], "process 0 reports"
    # Both processes wrote their share of checkpoint 4 (the data item holds one file each).
    manager = checkpoints.CheckpointManager(Workdir(workdir).checkpoint_dir("pretrain"))
    assert manager.all_steps() == [2, 4]
    manager.close()
    data_files = os.listdir(Workdir(workdir).checkpoint_dir("pretrain") / "4" / "data")
    assert len([f for f in data_files if "process" in f]) == 2, data_files

    # A new pod restores checkpoint 4 (each process its own shards and iterator) and goes on.
    _run_pod(config_file, workdir, STEPS_TOTAL)
    rows = [r for r in metrics.read_metrics(workdir) if "ce_loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS_TOTAL + 1)), "resumed, not restarted"
    got = _losses(workdir)
    for step in range(1, STEPS_TOTAL + 1):
        # The same global batch and program; only the cross-process reduction differs.
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
