"""The stage loop: kill -9 and resume bit for bit, SIGTERM, resharded resume, bad configs."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import pytest

from cursor_rl import checkpoints, hostmem
from cursor_rl.train import loop, metrics
from cursor_rl.workdir import Workdir
from tests.train_helpers import micro_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _losses(workdir, stage="pretrain"):
    """Last logged train loss per step (a resumed run re-logs the steps it redoes)."""
    out = {}
    for row in metrics.read_metrics(workdir):
        if row["stage"] == stage and "ce_loss" in row:
            out[row["step"]] = row["ce_loss"]
    return out


def _config_file(tmp_path, body):
    path = tmp_path / "cfg.py"
    path.write_text(
        textwrap.dedent(
            """
            from tests.train_helpers import micro_config

            def get_config(arg=None):
                c = micro_config()
            """
        )
        + textwrap.indent(textwrap.dedent(body), "    ")
        + "    return c\n"
    )
    return str(path)


def _start(config_file, workdir, *flags):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cursor_rl.main",
            f"--config={config_file}",
            f"--workdir={workdir}",
            *flags,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_step(proc, workdir, step, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if max(_losses(workdir), default=0) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early:\n{proc.stdout.read()}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"step {step} not reached in {timeout}s")


@pytest.mark.slow
def test_sigkill_and_restart_reproduces_losses_bitwise(tmp_path):
    steps = 8
    reference = str(tmp_path / "reference")
    loop.run(micro_config(num_steps=steps), reference)
    expected = _losses(reference)
    assert sorted(expected) == list(range(1, steps + 1))

    config_file = _config_file(tmp_path, f"c.train.num_steps = {steps}\n")
    workdir = str(tmp_path / "killed")
    proc = _start(config_file, workdir)
    _wait_for_step(proc, workdir, 5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = checkpoints.CheckpointManager(Workdir(workdir).checkpoint_dir("pretrain"))
    resumed_from = saved.latest_step()
    saved.close()
    assert resumed_from is not None and resumed_from < steps

    proc = _start(config_file, workdir)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    got = _losses(workdir)
    # Same losses step for step, to the last bit: state, data order and step all resumed.
    assert got == expected


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_then_exits_cleanly(tmp_path):
    config_file = _config_file(
        tmp_path, "c.train.num_steps = 200\nc.checkpoint.every_steps = 1000\n"
    )
    workdir = str(tmp_path / "run")
    proc = _start(config_file, workdir)
    _wait_for_step(proc, workdir, 3)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "SIGTERM" in output
    manager = checkpoints.CheckpointManager(Workdir(workdir).checkpoint_dir("pretrain"))
    step = manager.latest_step()
    manager.close()
    assert step is not None and 3 <= step < 200


def test_sigterm_flag_is_only_installed_while_a_stage_trains():
    """Between stages (task build, demonstrations, RL) SIGTERM must stop the run, not
    set a flag no loop polls any more."""
    original = signal.getsignal(signal.SIGTERM)
    poll, restore = loop._install_sigterm_handler()
    try:
        assert signal.getsignal(signal.SIGTERM) is not original
        os.kill(os.getpid(), signal.SIGTERM)
        assert poll()
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) is original


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (emulated) devices")
@pytest.mark.slow
def test_resume_on_a_different_mesh(tmp_path):
    """4 steps, then resume to 6: on the same mesh vs on another one (fsdp x expert)."""

    def run(workdir, second_mesh):
        loop.run(micro_config(num_steps=4), workdir)
        second = micro_config(num_steps=6)
        if second_mesh:
            second.mesh.ici = second_mesh
        loop.run(second, workdir)
        return _losses(workdir)

    expected = run(str(tmp_path / "same"), None)
    got = run(
        str(tmp_path / "other"), {"data": 2, "fsdp": 2, "expert": 2, "context": 1, "tensor": 1}
    )
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        # Only the reduction order differs between the meshes.
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("train.batch_size", 12, "train.batch_size"),
        ("train.microbatches", 3, "train.batch_size"),
        ("model.n_group", 3, "n_group"),
        ("optimizer.schedule", "linear", "optimizer.schedule"),
        ("train.num_steps", 0, "train.num_steps"),
    ],
)
def test_invalid_config_fails_before_compiling_and_names_the_field(tmp_path, field, value, match):
    config = micro_config()
    section, name = field.split(".")
    config[section][name] = value
    start = time.time()
    with pytest.raises(ValueError, match=match):
        loop.run(config, str(tmp_path))
    assert time.time() - start < 10  # failed at validation, not after a compile
    assert not Workdir(tmp_path).checkpoint_dir("pretrain").exists()


def test_later_stage_without_its_predecessor_is_a_clear_error(tmp_path):
    config = micro_config()
    config.stage = "long_context"
    with pytest.raises(FileNotFoundError, match="pretrain"):
        loop.run(config, str(tmp_path))


def test_layer_layout_mismatch_names_the_flag_that_fixes_it():
    """A checkpoint with scanned layers cannot seed an unscanned model (or back):
    the error says which layout each has and the override to use."""
    from cursor_rl.model.config import ModelConfig

    config = ModelConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        num_layers=2, num_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
        v_head_dim=4, n_routed_experts=4, num_experts_per_tok=2, first_k_dense=1,
    )  # fmt: skip
    meta = checkpoints.make_metadata(config, stage="pretrain")
    loop._check_compatible(meta, config, "/ckpt/10")  # same layout: fine
    with pytest.raises(ValueError, match=r"scanned layers .* unscanned.*scan_layers=True"):
        loop._check_compatible(meta, config.replace(scan_layers=False), "/ckpt/10")


@pytest.mark.slow
@pytest.mark.parametrize("release", [True, False])
def test_free_memory_is_released_around_evals_and_checkpoints(tmp_path, monkeypatch, release):
    """train.release_memory: the loop hands the allocator's free pages back after the first
    logged window and before and after each eval / checkpoint step, not between other
    steps; off, never."""
    calls = []
    monkeypatch.setattr(hostmem, "release_free_memory", lambda: calls.append(1))
    cfg = micro_config(num_steps=7, log_every=2, eval_every=3, release_memory=release)
    cfg.train.eval_batches = 1
    cfg.checkpoint.every_steps = 5
    loop.run_stage(cfg, "pretrain", str(tmp_path / "run"))
    # Events: step 2 (first window), 3 and 6 (eval), 5 (checkpoint), 7 (the last step),
    # each released twice (before and after); the other steps (1, 4) not at all.
    assert len(calls) == (2 * 5 if release else 0)
