"""XManager launcher, run in its own virtualenv (.venv-xm: xmanager needs protobuf<7).

Create it with ``bash launch/setup_xm_venv.sh``. Without it these tests skip, unless
CURSOR_RL_REQUIRE_XM=1 (CI sets it) turns the skip into a failure.
"""

import json
import os
import subprocess

import pytest

from cursor_rl.train import metrics
from launch import presubmit
from tests.train_helpers import SMALL_CORPUS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
XM_PYTHON = os.environ.get("CURSOR_RL_XM_PYTHON", os.path.join(ROOT, ".venv-xm", "bin", "python"))

if not os.path.exists(XM_PYTHON):
    if os.environ.get("CURSOR_RL_REQUIRE_XM") == "1":
        raise RuntimeError(f"{XM_PYTHON} is missing: run `bash launch/setup_xm_venv.sh`")
    pytest.skip("needs .venv-xm (bash launch/setup_xm_venv.sh)", allow_module_level=True)


def _launch(tmp_path, *flags, timeout=600):
    # XManager keeps experiment records in ~/.xmanager: keep them (and HOME) in tmp_path.
    db = tmp_path / "xm_db.yaml"
    db.write_text(
        "sql_connector: sqlite\nsql_connection_settings:\n  backend: sqlite\n"
        f"  db_name: {tmp_path / 'xm.sqlite3'}\n"
    )
    env = dict(os.environ, HOME=str(tmp_path), JAX_PLATFORMS="cpu", XLA_FLAGS="")
    cmd = [XM_PYTHON, "launch/xm_launch.py", f"--xm_db_yaml_config_path={db}", *flags]
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.slow
def test_local_sweep_runs_every_work_unit_to_its_own_workdir(tmp_path):
    root = tmp_path / "sweep"
    result = _launch(
        tmp_path,
        "--config=configs/tiny.py:stage=pretrain",
        f"--workdir={root}",
        "--executor=local",
        "--config.train.num_steps=3",
        "--config.train.batch_size=4",
        "--config.train.seq_len=64",
        "--config.train.log_every=1",
        "--config.train.eval_every=0",
        f"--config.data.sources=({SMALL_CORPUS!r},)",
        "--config.data.read_threads=1",
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "2 work units" in result.stdout
    workdirs = sorted(os.listdir(root))
    assert len(workdirs) == 2, workdirs
    last_losses = {}
    for name in workdirs:
        rows = [r for r in metrics.read_metrics(str(root / name)) if "ce_loss" in r]
        assert [r["step"] for r in rows] == [1, 2, 3], name
        with open(root / name / "config.json", encoding="utf-8") as fh:
            config = json.load(fh)
        assert config["train"]["num_steps"] == 3  # the command line reached every unit
        last_losses[config["optimizer"]["learning_rate"]] = rows[-1]["ce_loss"]
    # ... and so did each point of configs/tiny.py's get_sweep(): two rates, two results.
    assert sorted(last_losses) == [1e-3, 3e-3]
    assert last_losses[1e-3] != last_losses[3e-3]


def test_vertex_dry_run_prints_the_job_specs_it_would_submit(tmp_path):
    result = _launch(
        tmp_path,
        "--config=configs/tiny.py:stage=pretrain",
        "--workdir=gs://bucket/sweep",
        "--executor=vertex",
        "--dry_run",
        "--accelerator=a100",
        "--accelerator_count=8",
        "--image=gcr.io/proj/cursor-rl:1",
        "--config.train.num_steps=1000",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    specs = json.loads(result.stdout[result.stdout.index("[\n") :])
    assert len(specs) == 2
    for spec in specs:
        [pool] = spec["worker_pool_specs"]
        assert pool["machine_spec"] == {
            "accelerator_type": "NVIDIA_TESLA_A100",
            "accelerator_count": 8,
            "machine_type": "a2-highgpu-8g",
        }
        container = pool["container_spec"]
        assert container["image_uri"] == "gcr.io/proj/cursor-rl:1"
        assert container["args"][:4] == [
            "python",
            "-m",
            "cursor_rl.main",
            "--config=configs/tiny.py:stage=pretrain",
        ]
        assert "--config.train.num_steps=1000" in container["args"]
    workdirs = {a for s in specs for a in s["worker_pool_specs"][0]["container_spec"]["args"]}
    assert {w for w in workdirs if w.startswith("--workdir=gs://bucket/sweep/wu")} == {
        "--workdir=gs://bucket/sweep/wu0_learning_rate=0.003",
        "--workdir=gs://bucket/sweep/wu1_learning_rate=0.001",
    }


def test_vertex_refuses_gpus_xmanager_has_no_machine_for(tmp_path):
    result = _launch(
        tmp_path,
        "--config=configs/tiny.py",
        "--workdir=gs://b/s",
        "--executor=vertex",
        "--dry_run",
        "--accelerator=h100",
        "--accelerator_count=8",
    )
    assert result.returncode != 0
    assert "NVIDIA_H100_80GB" in result.stderr and "run_gpu.sh" in result.stderr


def test_launcher_refuses_a_sweep_point_that_does_not_fit(tmp_path):
    """The pre-submit compile runs in --aot_python (libtpu); a stand-in says 'too big'."""
    fake_python = tmp_path / "aot_python"
    fake_python.write_text(
        "#!/bin/sh\necho 'total 120.00 GiB per device, HBM 95.0 GiB: DOES NOT FIT'\n"
        f"exit {presubmit.DOES_NOT_FIT}\n"
    )
    fake_python.chmod(0o755)
    result = _launch(
        tmp_path,
        "--config=configs/tiny.py",
        f"--workdir={tmp_path / 'never'}",
        "--aot_topology=v5p:2x2x1",
        f"--aot_python={fake_python}",
    )
    assert result.returncode != 0
    assert "DOES NOT FIT" in result.stdout
    assert "refusing to launch" in result.stderr
    assert not (tmp_path / "never").exists()
