"""XManager launcher, run in its own virtualenv (.venv-xm: xmanager needs protobuf<7).

Create it with ``bash launch/setup_xm_venv.sh``. Without it these tests skip, unless
CURSOR_RL_REQUIRE_XM=1 (CI sets it) turns the skip into a failure.
"""

import ast
import json
import os
import shlex
import subprocess
import sys
from unittest import mock

import pytest
from absl import flags as absl_flags
from ml_collections import config_flags

from cursor_rl import stages
from cursor_rl.ops import heartbeat
from cursor_rl.tasks import build
from cursor_rl.train import metrics
from cursor_rl.workdir import Workdir
from launch import presubmit, rl_group, rl_tasks, sweep
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


# ---- the RL job group (--rl_group) ----------------------------------------------

GROUP_ROOT = "gs://bucket/rl/run1"


def _group_dry_run(tmp_path, *flags):
    result = _launch(
        tmp_path,
        "--config=configs/tiny.py",
        f"--workdir={GROUP_ROOT}",
        "--rl_group",
        "--dry_run",
        "--config.rl.num_steps=7",
        *flags,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout[result.stdout.index("[\n") :])


def _defined_flags(module_path):
    """The flag names a module defines (any ``DEFINE_*("name", ...)`` call in its source)."""
    with open(os.path.join(ROOT, module_path), encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr.startswith("DEFINE")
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }


def _parse(fv, argv):
    # config_flags finds the --config.x=y overrides in sys.argv, as in a real process.
    with mock.patch.object(sys, "argv", argv):
        fv(argv)


def _parse_main(step):
    """Parses one ``cursor_rl.main`` command line as its CLI would: the config file with
    every ``--config.x=y`` applied (a misspelt field raises), the other flags checked
    against those ``cursor_rl/cli.py`` defines. Returns (the RL stage's config, workdir)."""
    assert step[1:3] == ["-m", "cursor_rl.main"], step
    args = step[3:]
    cli_flags = _defined_flags("cursor_rl/cli.py") - {"config"}
    others = {a.split("=", 1)[0].lstrip("-") for a in args if not a.startswith("--config")}
    assert others <= cli_flags, others
    fv = absl_flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv)
    for name in cli_flags:
        absl_flags.DEFINE_string(name, None, "", flag_values=fv)
    _parse(fv, ["main", *args])
    overrides = config_flags.get_override_values(fv["config"])
    config = stages.stage_config(stages.apply_command_line(fv.config, overrides), "rl")
    return config, fv.workdir


def _parse_rl_tasks(step):
    assert step[1:3] == ["-m", "launch.rl_tasks"], step
    fv = absl_flags.FlagValues()
    rl_tasks.define_flags(fv)
    _parse(fv, ["rl_tasks", *step[3:]])
    return rl_tasks.rl_config(fv), fv


def _config_of(config_arg):
    path, arg = sweep.split_config_arg(config_arg)
    module = sweep._load_module(path)
    return module.get_config(arg) if arg else module.get_config()


def jobs_of(entries):
    return [rl_group.Job(j["name"], j["role"], tuple(map(tuple, j["steps"]))) for j in entries]


def test_rl_group_dry_run_has_every_role_and_a_split_that_adds_up(tmp_path):
    entries = _group_dry_run(
        tmp_path, "--rl_num_samplers=3", "--rl_accelerators=16", "--rl_fleet_workers=2"
    )
    jobs = [e["job"] for e in entries]
    by_role = {}
    for job in jobs:
        by_role.setdefault(job["role"], []).append(job)
    assert set(by_role) == set(rl_group.ROLES)
    assert [j["name"] for j in by_role["sampler"]] == ["sampler_0", "sampler_1", "sampler_2"]
    assert len({j["name"] for j in jobs}) == len(jobs)
    assert {j["name"] for j in by_role["fleet"]} == {
        "fleet_head",
        "fleet_worker_0",
        "fleet_worker_1",
    }
    # The split: 16 x (0.5, 0.375, 0.125, 0): trainer 8, samplers 2 each, evals on sampler 0.
    parts = rl_group.divide(16, rl_group.parse_split(rl_group.DEFAULT_SPLIT))
    assert parts == {"train": 8, "rollouts": 6, "evals": 2, "data": 0}
    assert sum(j["accelerators"] for j in jobs) == 16
    assert by_role["trainer"][0]["accelerators"] == parts["train"]
    assert [j["accelerators"] for j in by_role["sampler"]] == [4, 2, 2]
    assert by_role["task_builder"][0]["accelerators"] == parts["data"]
    for role in ("fleet", "evaluator", "task_builder"):
        assert all(j["accelerators"] == 0 and j["cpu"] == 16 for j in by_role[role]), role
    # One workdir for all: every command that takes one names the same.
    workdirs = {
        a.split("=", 1)[1]
        for j in jobs
        for step in j["steps"]
        for a in step
        if a.startswith("--workdir=")
    }
    assert workdirs == {GROUP_ROOT}
    # A job of several steps runs them in order in one shell, the last one exec'ed.
    trainer = by_role["trainer"][0]
    assert trainer["argv"][:2] == ["sh", "-c"]
    assert trainer["argv"][2] == " && ".join(
        [shlex.join(trainer["steps"][0]), "exec " + shlex.join(trainer["steps"][1])]
    )


def test_rl_group_command_lines_parse_with_the_projects_flags(tmp_path):
    jobs = [e["job"] for e in _group_dry_run(tmp_path, "--rl_num_samplers=3")]
    sampler_ids = []
    for job in jobs:
        for step in job["steps"]:
            if step[1:3] == ["-m", "cursor_rl.main"]:
                cfg, workdir = _parse_main(step)
                assert workdir == GROUP_ROOT
                assert cfg.stage == "rl" and cfg.rl.num_steps == 7  # the launcher's override
                assert cfg.rl.role == job["role"]
                assert cfg.rl.num_samplers == 3
                if job["role"] == "sampler":
                    sampler_ids.append(cfg.rl.sampler_id)
                    assert job["name"] == f"sampler_{cfg.rl.sampler_id}"
                    assert job["env"] == {"CURSOR_RL_ROLE": f"sampler-{cfg.rl.sampler_id}"}
                    assert cfg.rl.tool_backend == "ray"
                    assert cfg.rl.ray.address == "127.0.0.1:6379"  # the fleet_head job
            elif step[1:3] == ["-m", "launch.rl_tasks"]:
                cfg, fv = _parse_rl_tasks(step)
                assert fv.workdir == GROUP_ROOT and cfg.rl.num_steps == 7
                if job["role"] == "task_builder":
                    assert fv.wait == "" and len(job["steps"]) == 1  # it builds
                if job["role"] in ("trainer", "sampler"):
                    assert fv.wait == "tasks" and step is job["steps"][0]
                if job["role"] == "evaluator":  # the lead sampler runs the held-out evals
                    assert fv.wait == "done" and fv.finished_roles == ["sampler-0"]
                if job["role"] == "fleet":  # serves until every sampler is done
                    assert fv.wait == "done"
                    assert fv.finished_roles == ["sampler-0", "sampler-1", "sampler-2"]
            elif step[1:3] == ["-m", "cursor_rl.eval.report"]:
                names = {a.split("=", 1)[0].lstrip("-") for a in step[3:]}
                assert names <= _defined_flags("cursor_rl/eval/report.py"), names
                assert job["role"] == "evaluator"
            elif step[0] == "ray":
                assert job["role"] == "fleet"
                assert step[1] in ("start", "stop")
            else:
                raise AssertionError(f"{job['name']}: unknown command {step}")
    assert sorted(sampler_ids) == [0, 1, 2]
    # The launcher checks every override against the config before launching ...
    config = _config_of(os.path.join(ROOT, "configs", "tiny.py"))
    typo = rl_group.Job("x", "trainer", (("python", "--config=c.py", "--config.rl.rol=a"),))
    assert rl_group.missing_fields(config, jobs_of(jobs)) == []
    assert rl_group.missing_fields(config, [typo]) == ["rl.rol"]
    # ... and the parser is strict: a misspelt field fails like a real job would.
    with pytest.raises((AttributeError, KeyError, absl_flags.Error)):
        _parse_main(
            [
                "python",
                "-m",
                "cursor_rl.main",
                f"--config={os.path.join(ROOT, 'configs', 'tiny.py')}",
                "--workdir=/w",
                "--config.rl.rol=trainer",
            ]
        )


def test_rl_group_on_vertex_prints_one_custom_job_per_group_job(tmp_path):
    entries = _group_dry_run(
        tmp_path,
        "--executor=vertex",
        "--accelerator=a100",
        "--rl_accelerators=8",
        "--rl_split=train=0.5,rollouts=0.25,evals=0.25,data=0",
        "--rl_num_samplers=2",
        "--rl_fleet=local",
        "--image=gcr.io/proj/cursor-rl:1",
    )
    gpus = 0
    for entry in entries:
        job, spec = entry["job"], entry["vertex"]
        [pool] = spec["worker_pool_specs"]
        assert spec["display_name"] == f"tiny_rl_{job['name']}"
        assert pool["container_spec"]["args"] == job["argv"]
        assert pool["container_spec"]["image_uri"] == "gcr.io/proj/cursor-rl:1"
        assert {e["name"]: e["value"] for e in pool["container_spec"]["env"]} == job["env"]
        machine = pool["machine_spec"]
        if job["accelerators"]:
            assert machine["accelerator_type"] == "NVIDIA_TESLA_A100"
            assert machine["accelerator_count"] == job["accelerators"]
            gpus += machine["accelerator_count"]
        else:
            assert "accelerator_type" not in machine, job["name"]
        for step in job["steps"]:
            assert step[0] in ("python", "ray")  # the image's interpreter, not this one's
    assert gpus == 8
    roles = [e["job"]["role"] for e in entries]
    assert "fleet" not in roles  # local: each sampler runs its own tool workers
    assert roles.count("sampler") == 2


def test_rl_group_refuses_a_split_that_does_not_add_up_and_vertex_ray_without_a_head(tmp_path):
    result = _launch(
        tmp_path,
        "--config=configs/tiny.py",
        "--workdir=gs://b/r",
        "--rl_group",
        "--dry_run",
        "--rl_split=train=0.5,rollouts=0.4,evals=0.2,data=0",
    )
    assert result.returncode != 0 and "add up to" in result.stderr
    result = _launch(
        tmp_path,
        "--config=configs/tiny.py",
        "--workdir=gs://b/r",
        "--rl_group",
        "--dry_run",
        "--executor=vertex",
        "--accelerator=a100",
    )
    assert result.returncode != 0 and "--rl_ray_address" in result.stderr


def test_rl_tasks_waits_for_the_datasets_and_for_the_end_of_the_run(tmp_path):
    workdir = Workdir(str(tmp_path / "w"))
    cfg = stages.stage_config(_config_of(os.path.join(ROOT, "configs", "tiny.py")), "rl")
    assert not rl_tasks.datasets_ready(cfg, workdir)
    for split in ("train", "bench"):
        path = workdir.tasks_dir(split)
        path.mkdir(parents=True)
        assert not rl_tasks.datasets_ready(cfg, workdir)
        (path / build.STATS_FILE).write_text("{}")
    assert rl_tasks.datasets_ready(cfg, workdir)

    assert not rl_tasks.run_finished(workdir, ["sampler_0"])
    workdir.rl_done_file.parent.mkdir(parents=True)
    workdir.rl_done_file.write_text("1")
    assert rl_tasks.run_finished(workdir, [])
    beat = heartbeat.Heartbeat(workdir, "sampler_0")
    assert not rl_tasks.run_finished(workdir, ["sampler_0"])
    beat.finished()
    assert rl_tasks.run_finished(workdir, ["sampler_0"])
