"""The workdir layout: local paths resolved once, ``gs://`` through a stand-in GCS, and
an unusable workdir refused before any stage runs."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from cursor_rl import checkpoints, workdir
from cursor_rl.workdir import Workdir, WorkdirError
from tests.fake_gcs import fake_gcs
from tests.train_helpers import micro_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- resolution and layout ---------------------------------------------------------


def test_relative_and_home_paths_become_absolute_when_made(tmp_path, monkeypatch):
    """Relative paths are taken from the current directory at creation and keep meaning
    the same directory after a chdir; ``~`` is the home directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    relative = Workdir("workdirs/tiny-1")
    assert os.fspath(relative) == str(tmp_path / "workdirs" / "tiny-1")
    assert os.fspath(Workdir("~/runs/a")) == str(tmp_path / "home" / "runs" / "a")
    assert os.fspath(Workdir(str(tmp_path / "x" / ".." / "abs"))) == str(tmp_path / "abs")
    monkeypatch.chdir("/")
    assert os.fspath(relative.checkpoint_dir("pretrain")) == str(
        tmp_path / "workdirs" / "tiny-1" / "pretrain" / "checkpoints"
    )
    assert Workdir.of(relative) is relative
    assert not relative.is_remote and relative.local_root == os.fspath(relative)


def test_every_path_of_the_layout_is_under_the_root(tmp_path):
    wd = Workdir(tmp_path / "run")
    root = str(tmp_path / "run")
    expected = {
        wd.config_file: "config.json",
        wd.metrics_file: "metrics.jsonl",
        wd.tensorboard_dir: "tensorboard",
        wd.tokenizer_file: "tokenizer/tokenizer.json",
        wd.checkpoint_dir("long_context"): "long_context/checkpoints",
        wd.checkpoint_dir("rl"): "rl/checkpoints",
        wd.policy_dir: "rl/policy",
        wd.rollouts_dir: "rl/rollouts",
        wd.rl_done_file: "rl/DONE",
        wd.sft_demos_file: "sft_data/demos.jsonl",
        wd.tasks_dir("bench"): "tasks/bench",
        wd.eval_dir: "eval",
        wd.registry_file: "eval/registry.json",
        wd.report_file: "report.md",
        wd.plot_file("loss.png"): "loss.png",
    }
    for path, relative in expected.items():
        assert os.fspath(path) == os.path.join(root, relative)
    for bad in ("../up", "a/b", ""):
        with pytest.raises(ValueError, match="not a plain directory name"):
            wd.checkpoint_dir(bad)


def test_gs_urls_stay_urls_and_other_forms_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(workdir.LOCAL_CACHE_ENV, str(tmp_path / "cache"))
    wd = Workdir("gs://bucket/runs/a")
    assert (
        wd.is_remote and os.fspath(wd.sft_demos_file) == "gs://bucket/runs/a/sft_data/demos.jsonl"
    )
    assert wd.local_path(wd.tasks_dir("train")) == str(
        tmp_path / "cache" / "runs" / "gs" / "bucket" / "runs" / "a" / "tasks" / "train"
    )
    for bad, reason in (
        ("", "empty"),
        ("   ", "empty"),
        ("s3://bucket/run", "s3:// is not supported"),
        ("file:///tmp/run", "file:// is not supported"),
        ("gs://", "names no bucket"),
    ):
        with pytest.raises(WorkdirError, match=reason):
            Workdir(bad)


# ---- an unusable workdir ---------------------------------------------------------


def test_unusable_workdir_is_an_error_naming_the_path_and_reason(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory")
    with pytest.raises(WorkdirError, match=f"workdir {a_file} is not usable: it is a file"):
        Workdir.create(a_file)
    below = a_file / "run"
    with pytest.raises(WorkdirError, match=f"workdir {below} is not usable: Not a directory"):
        Workdir.create(below)
    ok = Workdir.create(tmp_path / "new" / "run")
    assert os.path.isdir(ok.root) and os.listdir(ok.root) == []  # the probe is gone


def test_main_command_refuses_an_unusable_workdir_before_any_stage(tmp_path):
    """The main command stops at once with one line naming the path and the reason, not
    a traceback from Orbax at the first checkpoint."""
    a_file = tmp_path / "taken"
    a_file.write_text("")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    result = subprocess.run(
        [sys.executable, "-m", "cursor_rl.main", "--config=configs/tiny.py",
         f"--workdir={a_file}/run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"error: workdir {a_file}/run is not usable: Not a directory" in result.stderr
    assert "Traceback" not in result.stderr and "[pretrain]" not in result.stdout


# ---- a relative workdir, end to end through Orbax ---------------------------------


@pytest.mark.slow
def test_relative_workdir_checkpoints(tmp_path, monkeypatch):
    """Orbax refuses relative checkpoint paths: the run resolves them first (this was
    the main command's crash at its first checkpoint)."""
    from cursor_rl.train import loop

    monkeypatch.chdir(tmp_path)
    result = loop.run(micro_config(num_steps=2), "workdirs/rel")
    ckpts = tmp_path / "workdirs" / "rel" / "pretrain" / "checkpoints"
    assert result[0].checkpoint == str(ckpts / "2")
    assert checkpoints.finalised_steps(str(ckpts)) == [2]


# ---- gs:// through the stand-in ---------------------------------------------------


@pytest.mark.slow
def test_gs_workdir_trains_resumes_and_reports_through_the_stand_in(tmp_path, monkeypatch):
    """Every file of a training stage goes to gs:// (Orbax arrays through TensorStore's
    GCS client, the rest through epath): checkpoint saved, restored on resume, metrics
    and TensorBoard events rewritten whole (the stand-in refuses appends), report and
    plots written. Nothing lands in a local folder named ``gs:``."""
    from cursor_rl.eval import report
    from cursor_rl.train import loop, metrics

    monkeypatch.chdir(tmp_path)
    bucket = tmp_path / "gcs" / "bucket"
    with fake_gcs(str(tmp_path / "gcs")):
        loop.run(micro_config(num_steps=2), "gs://bucket/run")
        assert (bucket / "run" / "pretrain" / "checkpoints" / "2" / "commit_success.txt").exists()
        resumed = loop.run(micro_config(num_steps=3), "gs://bucket/run")
        assert resumed[0].checkpoint == "gs://bucket/run/pretrain/checkpoints/3"
        rows = metrics.read_metrics("gs://bucket/run")
        assert [r["step"] for r in rows if "ce_loss" in r] == [1, 2, 3]
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
            checkpoints.restore_variables("gs://bucket/run/pretrain/checkpoints/2", _target()),
        )
        restored = checkpoints.restore_variables("gs://bucket/run/pretrain/checkpoints", target)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored))
        path = report.write_report("gs://bucket/run")
    assert path == "gs://bucket/run/report.md"
    assert "## Stages" in (bucket / "run" / "report.md").read_text()
    assert (bucket / "run" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((bucket / "run" / "config.json").read_text())["stage"] == "pretrain"
    assert (bucket / "run" / "tokenizer" / "tokenizer.json").exists()
    events = list((bucket / "run" / "tensorboard").iterdir())
    assert events and all(e.stat().st_size > 0 for e in events)
    assert not os.path.exists(tmp_path / "gs:"), "nothing may land in a local folder gs:"


def _target():
    from cursor_rl import model, partitioning
    from tests.train_helpers import MICRO_MODEL

    return partitioning.strip_axis_metadata(model.abstract_variables(MICRO_MODEL))


def test_gs_workdir_rl_files_and_local_copies(tmp_path, monkeypatch):
    """After the training stages: task datasets are built locally (sandboxes need a
    disk), copied to gs:// and copied back by a job restarted elsewhere; rollouts, the
    trainer's markers, the eval registry and the tokenizer go through gs://."""
    from cursor_rl.chat.tokenizer import Tokenizer
    from cursor_rl.eval import registry
    from cursor_rl.rl.loop import RolloutStore
    from cursor_rl.tasks import build, records
    from cursor_rl.tasks import workdir as workdir_tasks

    builds = []

    def fake_build(config, log):  # the real build runs sandboxes: not needed here
        builds.append(config.split)
        os.makedirs(os.path.join(config.out, "repos"), exist_ok=True)
        for name in (build.STATS_FILE, records.TASKS_FILE, os.path.join("repos", "r.txt")):
            with open(os.path.join(config.out, name), "w") as fh:
                fh.write(f"{config.split} {name}")

    monkeypatch.setattr(build, "build", fake_build)
    monkeypatch.setenv(workdir.LOCAL_CACHE_ENV, str(tmp_path / "cache"))
    bucket = tmp_path / "gcs" / "bucket"
    with fake_gcs(str(tmp_path / "gcs")):
        wd = Workdir("gs://bucket/run")
        train_dir, _ = workdir_tasks.ensure_datasets(wd, log=lambda _: None)
        assert train_dir == wd.local_path(wd.tasks_dir("train"))
        assert train_dir.startswith(str(tmp_path / "cache"))
        assert (bucket / "run" / "tasks" / "bench" / "repos" / "r.txt").read_text() == (
            "bench repos/r.txt"
        )
        # A job restarted on another machine: no local copy, the workdir has the tasks.
        monkeypatch.setenv(workdir.LOCAL_CACHE_ENV, str(tmp_path / "elsewhere"))
        again = workdir_tasks.ensure_datasets(Workdir("gs://bucket/run"), log=lambda _: None)
        assert builds == ["train", "bench"], "copied back, not built again"
        with open(os.path.join(again[0], "repos", "r.txt")) as fh:
            assert fh.read() == "train repos/r.txt"
        # A single file (the SFT demonstrations) makes the same round trip.
        demos = Workdir("gs://bucket/run")
        assert not demos.fetch(demos.sft_demos_file)  # nowhere yet
        os.makedirs(os.path.dirname(demos.local_path(demos.sft_demos_file)))
        with open(demos.local_path(demos.sft_demos_file), "w") as fh:
            fh.write('{"messages": []}\n')
        demos.publish(demos.sft_demos_file)
        monkeypatch.setenv(workdir.LOCAL_CACHE_ENV, str(tmp_path / "third"))
        assert demos.fetch(demos.sft_demos_file)
        with open(demos.local_path(demos.sft_demos_file)) as fh:
            assert fh.read() == '{"messages": []}\n'

        store = RolloutStore(wd)
        store.write(0, [], {"policy_version": 3})
        store.mark_trained(1)
        store.mark_done()
        reopened = RolloutStore("gs://bucket/run")
        assert reopened.read(0) == ([], {"index": 0, "policy_version": 3})
        assert reopened.cursor() == 1 and reopened.trained() == 1 and reopened.done

        reg = registry.Registry(wd.registry_file)
        reg.record(
            {"bench": "b", "stage": "sft", "step": 0, "k_values": [1], "overall": {"pass@1": 0.5}}
        )
        assert registry.Registry(wd.registry_file).is_active("b")

        tokenizer = Tokenizer.train(["def f(x):\n    return x\n"] * 20, 300)
        wd.tokenizer_file.parent.mkdir(parents=True, exist_ok=True)
        wd.tokenizer_file.write_text(tokenizer.to_json())
        assert Tokenizer.load(wd.tokenizer_file).to_json() == tokenizer.to_json()
    assert (bucket / "run" / "rl" / "rollouts" / "000000.json").exists()
    assert (bucket / "run" / "rl" / "DONE").exists()
    assert len(list((bucket / "run" / "eval" / "registry.records").iterdir())) == 1  # one record


def test_stand_in_refuses_appends_like_gcs(tmp_path):
    """The stand-in must not be kinder than GCS, or the tests above could pass on code
    that appends; ``append_text`` rewrites instead."""
    with fake_gcs(str(tmp_path / "gcs")):
        path = Workdir("gs://bucket/run").metrics_file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("a\n")
        with pytest.raises(NotImplementedError), path.open("a") as fh:
            fh.write("b\n")
        workdir.append_text(path, "b\n")
        assert path.read_text() == "a\nb\n"
