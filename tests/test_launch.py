"""Launch scripts and launcher logic that need no XManager: sweeps, pre-submit, dry runs."""

import ast
import dataclasses
import glob
import json
import os
import subprocess
import sys

import pytest

from cursor_rl import stages
from launch import presubmit, sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")


def _load_config(config_arg):
    path, arg = sweep.split_config_arg(config_arg)
    module = sweep._load_module(path)
    return module.get_config(arg) if arg else module.get_config()


# ---- sweeps ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))), ids=os.path.basename
)
def test_every_sweep_point_names_fields_of_its_config(path):
    config = _load_config(path)
    for point in sweep.load_sweep(path):
        sweep.check_overrides(config, point)
        for stage in stages.STAGES:  # and each stage of the overridden config is valid
            overridden = stages.stage_config(config, stage)
            overridden.update_from_flattened_dict(point)
            stages.model_config(overridden).validate()


def test_tiny_sweep_gives_each_work_unit_its_overrides_and_workdir():
    points = sweep.load_sweep(TINY + ":stage=pretrain")
    assert len(points) == 2
    units = sweep.work_units(
        "configs/tiny.py:stage=pretrain", "gs://bucket/sweep", {"train.num_steps": 3}, points
    )
    names = [name for name, _ in units]
    assert len(set(names)) == 2
    for (name, flags), point in zip(units, points):
        assert flags[0] == "--config=configs/tiny.py:stage=pretrain"
        assert flags[1] == f"--workdir=gs://bucket/sweep/{name}"
        assert "--config.train.num_steps=3" in flags
        ((key, value),) = point.items()
        assert f"--config.{key}={value}" in flags


def test_a_point_overrides_the_command_line_and_values_round_trip():
    flags = sweep.main_flags(
        "c.py",
        "/w",
        {"optimizer.learning_rate": 1.0, "data.sources": ("files:a b/*.py", "stdlib")},
        {"optimizer.learning_rate": 0.5, "checkpoint.async_save": False},
    )
    values = dict(f.removeprefix("--config.").split("=", 1) for f in flags[2:])
    assert values["optimizer.learning_rate"] == "0.5"
    assert values["checkpoint.async_save"] == "false"
    assert ast.literal_eval(values["data.sources"]) == ("files:a b/*.py", "stdlib")


def test_an_override_that_is_not_a_field_is_refused():
    config = _load_config(TINY)
    with pytest.raises(ValueError, match=r"optimizer\.learning_rat"):
        sweep.check_overrides(config, {"optimizer.learning_rat": 1e-3})
    with pytest.raises(ValueError, match=r"train\.num_steps\.x"):
        sweep.check_overrides(config, {"train.num_steps.x": 1})


# ---- pre-submit (AOT) ------------------------------------------------------------


@dataclasses.dataclass
class FakeReport:
    fits: bool

    def text(self):
        return f"arguments 80.00 GiB\ntotal 120.00 GiB per device, HBM 95.0 GiB: fits={self.fits}"


def test_presubmit_refuses_a_step_that_does_not_fit_and_prints_the_breakdown(capsys):
    calls = []

    def compile_fn(config, topology):
        calls.append((config, topology))
        return FakeReport(fits=False)

    with pytest.raises(presubmit.DoesNotFit, match="v5p:2x2x1") as error:
        presubmit.check("CONFIG", "v5p:2x2x1", compile_fn=compile_fn)
    assert calls == [("CONFIG", "v5p:2x2x1")]
    assert "total 120.00 GiB" in capsys.readouterr().out
    assert "arguments 80.00 GiB" in str(error.value)


def test_presubmit_passes_a_step_that_fits(capsys):
    report = presubmit.check("CONFIG", "v5p:2x2x1", compile_fn=lambda c, t: FakeReport(fits=True))
    assert report.fits
    assert "HBM 95.0 GiB" in capsys.readouterr().out


def _script_env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **extra)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    return env


def _bash(*args, **env):
    return subprocess.run(
        ["bash", *args], cwd=ROOT, env=_script_env(**env), capture_output=True, text=True
    )


@pytest.mark.slow
def test_tpu_run_compiles_first_then_starts_the_same_command_on_every_worker(tmp_path):
    """run_tpu.sh run: the real pre-submit compile (on the CPU topology), then the ssh line."""
    config_file = tmp_path / "micro.py"
    config_file.write_text(
        "from tests.train_helpers import micro_config\n\n"
        "def get_config(arg=None):\n    return micro_config()\n"
    )
    result = _bash(
        "launch/run_tpu.sh",
        "run",
        "pod",
        "--",
        f"--config={config_file}",
        "--workdir=gs://bucket/run",
        "--config.train.batch_size=16",
        DRY_RUN="1",
        TOPOLOGY="cpu",
        AOT_PYTHON=sys.executable,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "train (pretrain) on cpu: 8 x cpu" in out and "no HBM limit known" in out
    ssh = out.strip().splitlines()[-1]
    assert ssh.startswith("gcloud compute tpus tpu-vm ssh pod ")
    assert "--worker=all" in ssh and "launch/run_tpu.sh\\ worker" in ssh
    assert "--workdir=gs://bucket/run" in ssh and "--config.train.batch_size=16" in ssh


def test_tpu_run_refuses_when_the_presubmit_says_it_does_not_fit(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text(
        "#!/bin/sh\necho 'total 120.00 GiB per device: DOES NOT FIT'\n"
        f"exit {presubmit.DOES_NOT_FIT}\n"
    )
    fake_python.chmod(0o755)
    result = _bash(
        "launch/run_tpu.sh",
        "run",
        "pod",
        "--",
        "--config=configs/small.py",
        "--workdir=gs://b/r",
        DRY_RUN="1",
        TOPOLOGY="v5p:2x2x1",
        AOT_PYTHON=str(fake_python),
    )
    assert result.returncode == presubmit.DOES_NOT_FIT
    assert "DOES NOT FIT" in result.stdout
    assert "gcloud" not in result.stdout, "nothing may be started after a failed check"


# ---- dry runs of the pod and GPU scripts -----------------------------------------


def test_tpu_multislice_commands_use_a_queued_resource_on_every_node():
    env = dict(DRY_RUN="1", NUM_SLICES="2", ACCELERATOR="v5p-256", ZONE="us-east5-a")
    create = _bash("launch/run_tpu.sh", "create", "pod", **env).stdout
    assert "queued-resources create pod" in create
    assert "--node-count=2" in create and "--accelerator-type=v5p-256" in create
    run = _bash(
        "launch/run_tpu.sh", "run", "pod", "--", "--config=configs/small.py", "--workdir=x", **env
    ).stdout
    assert "queued-resources ssh pod" in run and "--node=all --worker=all" in run
    single = _bash("launch/run_tpu.sh", "create", "one", DRY_RUN="1", SPOT="1").stdout
    assert "tpu-vm create one" in single and "--spot" in single


def test_tpu_worker_command_switches_multihost_on():
    result = _bash(
        "launch/run_tpu.sh",
        "worker",
        "--",
        "--config=configs/small.py",
        "--workdir=gs://b/r",
        DRY_RUN="1",
        CURSOR_RL_PYTHON="python3",
    )
    assert result.stdout.split() == [
        "python3",
        "-m",
        "cursor_rl.main",
        "--multihost",
        "--config=configs/small.py",
        "--workdir=gs://b/r",
    ]


def test_gpu_script_passes_coordinator_flags_and_gpu_xla_flags():
    result = _bash(
        "launch/run_gpu.sh",
        "--coordinator=10.0.0.2:8476",
        "--num_hosts=2",
        "--host_id=1",
        "--",
        "--config=configs/small.py",
        "--workdir=gs://b/r",
        DRY_RUN="1",
        CURSOR_RL_PYTHON="python3",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in lines[0]
    assert lines[-1].split() == [
        "python3",
        "-m",
        "cursor_rl.main",
        "--multihost",
        "--coordinator_address=10.0.0.2:8476",
        "--num_processes=2",
        "--process_id=1",
        "--config=configs/small.py",
        "--workdir=gs://b/r",
    ]
    single = _bash(
        "launch/run_gpu.sh",
        "--",
        "--config=c.py",
        "--workdir=w",
        DRY_RUN="1",
        CURSOR_RL_PYTHON="python3",
    )
    assert "--multihost" not in single.stdout
    missing = _bash(
        "launch/run_gpu.sh",
        "--num_hosts=2",
        "--",
        "--config=c.py",
        DRY_RUN="1",
        SLURM_JOB_ID="",
        OMPI_COMM_WORLD_SIZE="",
    )
    assert missing.returncode == 2 and "coordinator" in missing.stderr


def test_gpu_xla_flags_are_known_to_this_xla():
    """XLA aborts on an unknown XLA_FLAGS entry: the script's flags must all exist."""
    flags = (
        _bash("launch/run_gpu.sh", "--", "--config=c.py", DRY_RUN="1", CURSOR_RL_PYTHON="python3")
        .stdout.splitlines()[0]
        .removeprefix("XLA_FLAGS=")
    )
    env = _script_env()
    env["XLA_FLAGS"] = flags
    result = subprocess.run(
        [sys.executable, "-c", "import jax.numpy as jnp; jnp.ones(2).sum().block_until_ready()"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]


# ---- the smoke run of the main command (CURSOR_RL_SMOKE=1) -----------------------


def _smoke_flags():
    with open(os.path.join(ROOT, "launch", "smoke.flags")) as fh:
        lines = [line.split("#", 1)[0].strip() for line in fh]
    return [line for line in lines if line]


def test_smoke_flags_parse_as_overrides_of_the_tiny_config(tmp_path):
    """Every smoke flag names a field of configs/tiny.py with a value of its type: the
    main command's own flag parser accepts them (it would exit 1 at a bad one) and
    stops only at the deliberately unusable workdir (exit 2)."""
    flags = _smoke_flags()
    assert flags and all(f.startswith("--config.") and "=" in f for f in flags), flags
    keys = {f[len("--config.") :].split("=", 1)[0] for f in flags}
    assert {"train.num_steps", "rl.num_steps", "rl.tasks.train_count"} <= keys
    sweep.check_overrides(_load_config(TINY), dict.fromkeys(keys))
    taken = tmp_path / "a_file"
    taken.write_text("")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    result = subprocess.run(
        [sys.executable, "-m", "cursor_rl.main", "--config=configs/tiny.py",
         f"--workdir={taken}/run", *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "is not usable" in result.stderr, result.stderr[-2000:]


def _fake_finished_run(workdir, config):
    """The files a finished run leaves, as check_run sees them (no real checkpoints:
    a step directory with Orbax's commit marker is what counts as finalised)."""
    from cursor_rl import stages as stages_lib
    from cursor_rl.workdir import Workdir

    wd = Workdir(workdir)
    wd.root.mkdir(parents=True)
    wd.config_file.write_text(config.to_json_best_effort())
    wd.tokenizer_file.parent.mkdir()
    wd.tokenizer_file.write_text("{}")
    stages = (*stages_lib.TRAIN_STAGES, "rl")
    last = {s: stages_lib.stage_config(config, s).train.num_steps for s in stages}
    last["rl"] = config.rl.num_steps
    for directory, step in [(wd.checkpoint_dir(s), last[s]) for s in stages] + [(wd.policy_dir, 1)]:
        (directory / str(step)).mkdir(parents=True)
        (directory / str(step) / "commit_success.txt").write_text("")
    wd.rl_done_file.write_text("")
    rows = [{"stage": s, "step": 1} for s in stages]
    rows += [{"stage": "sft", "step": 0, "bench": "b"}, {"stage": "rl", "step": 1, "bench": "b"}]
    wd.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wd.report_file.write_text("".join(f"| {s} | 1 |\n" for s in stages))
    return wd


def test_check_run_passes_a_finished_run_and_names_what_is_missing(tmp_path, capsys):
    from launch import check_run

    config = _load_config(TINY)
    wd = _fake_finished_run(tmp_path / "run", config)
    assert check_run.main(["check_run", str(tmp_path / "run")]) == 0
    assert "every stage ran" in capsys.readouterr().out

    # The SFT stage stopped early: its last checkpoint is not at train.num_steps.
    sft_steps = config.stage_overrides.sft.train.num_steps
    os.rename(wd.checkpoint_dir("sft") / str(sft_steps), wd.checkpoint_dir("sft") / "5")
    wd.report_file.write_text("| pretrain |\n")
    assert check_run.main(["check_run", str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out
    assert f"FAIL sft checkpoint at step {sft_steps}" in out and "(steps [5])" in out
    assert "FAIL report names every stage (missing: ['long_context', 'sft', 'rl'])" in out
    assert "1 check(s) failed" not in out and "2 check(s) failed" in out
    assert check_run.main(["check_run", str(tmp_path / "nowhere")]) == 2


# ---- venv installs -----------------------------------------------------------------


@pytest.mark.parametrize("status", [0, 3])
def test_pip_install_wrapper_passes_pips_exit_status_through(tmp_path, status):
    """The venv scripts install through launch/pip_install.sh: pip's "is ignored"
    notices are dropped, everything else is shown, and a failed pip (no disk space,
    no index) fails the script, so a broken venv is never stamped as installed."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        'echo "$@"\n'
        'echo "pip 1.0 is ignored"\n'
        'echo "ERROR: No space left on device" >&2\n'
        f"exit {status}\n"
    )
    fake.chmod(0o755)
    result = subprocess.run(
        ["bash", os.path.join(ROOT, "launch", "pip_install.sh"), str(fake), "-e", ".[hf]"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == status
    assert "-m pip install -q -e .[hf]" in result.stdout
    assert "No space left on device" in result.stdout
    assert "is ignored" not in result.stdout
    assert ("failed (exit 3)" in result.stderr) == (status == 3)
