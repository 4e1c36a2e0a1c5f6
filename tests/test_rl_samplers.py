"""Many samplers, one trainer (``rl.num_samplers``, ``rl.sampler_id``): each sampler
writes only its own rollout indices, the trainer takes them in index order and drops
stale ones whoever sampled them, and a sampler killed mid-run resumes its own cursor
without losing or rewriting a batch."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
from test_rl_loop import ROOT, _episode, _tail, rl_workdir, tokenizer, variables  # noqa: F401

from cursor_rl import config_lib
from cursor_rl.chat import protocol
from cursor_rl.ops import heartbeat
from cursor_rl.rl import feedback, grpo
from cursor_rl.rl import loop as rl_loop
from cursor_rl.rl.loop import RolloutStore
from cursor_rl.train.metrics import read_metrics
from cursor_rl.workdir import Workdir
from tests.fake_gcs import fake_gcs

NUM_STEPS = 4
NUM_SAMPLERS = 2
EPISODES_PER_BATCH = 2 * 2  # rl_micro_config: tasks_per_step x group_size
MAX_STALENESS = 1  # rl_micro_config's (the default)


@pytest.mark.parametrize("remote", [False, True])
def test_samplers_write_disjoint_indices_and_resume_their_own_cursor(tmp_path, remote):
    """Sampler k of N owns indices k, k+N, ...; its cursor is the first of them with no
    file, whatever the others have written; a published batch is never written again."""
    with fake_gcs(str(tmp_path / "gcs")) if remote else contextlib.nullcontext():
        store = RolloutStore("gs://bucket/run" if remote else str(tmp_path / "run"))
        assert [store.cursor(k, 3) for k in range(3)] == [0, 1, 2]
        # Sampler 1's batch 4 is missing (set aside by a rewind, say): it is sampled again.
        for index in (0, 3, 1, 7):
            store.write(index, [], {"policy_version": 0, "sampler": index % 3}, exclusive=True)
        assert [store.cursor(k, 3) for k in range(3)] == [6, 4, 2]
        assert store.cursor() == 2  # one sampler: the first index with no file, as before
        with pytest.raises(FileExistsError, match=r"same rl\.sampler_id"):
            store.write(3, [], {"policy_version": 1}, exclusive=True)
        assert store.read(3) == ([], {"index": 3, "policy_version": 0, "sampler": 0})
        store.write(3, [], {"policy_version": 1})  # the colocated loop's plain write
    assert [rl_loop.owner_of(i, 3) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert rl_loop.owner_of(5, 1) == 0


def test_sampler_slot_is_checked():
    cfg = config_lib.base_config()
    assert rl_loop.sampler_slot(cfg) == (0, 1)  # the single sampler, as before
    cfg.rl.num_samplers, cfg.rl.sampler_id = 3, 2
    assert rl_loop.sampler_slot(cfg) == (2, 3)
    for k, n in ((3, 3), (-1, 2), (0, 0)):
        cfg.rl.num_samplers, cfg.rl.sampler_id = n, k
        with pytest.raises(ValueError, match="0 <= sampler_id < N"):
            rl_loop.sampler_slot(cfg)


class _FakeTrainer:
    """Stands in for RLTrainer in ``_train_on``: one version per batch trained."""

    def __init__(self, version):
        self.version, self.trained, self.extra = version, [], {}
        self.grpo = grpo.GRPOConfig(drop_zero_variance=False)
        self.feedback = feedback.FeedbackConfig()

    def train(self, episodes, advantages, **_):
        self.trained.append(len(episodes))
        self.version += 1
        return {"policy_loss": 0.0}

    def publish(self):
        pass

    def save(self, extra):
        self.extra = dict(extra)


def test_trainer_drops_stale_batches_whichever_sampler_wrote_them(tmp_path, tokenizer):  # noqa: F811
    """The staleness bound holds across samplers: a batch more than max_staleness
    versions old is dropped (counted in its row) and the next one trains; every row
    says which sampler's batch it was and how many episodes it held."""
    chat = protocol.ChatFormat(tokenizer)
    workdir = Workdir(str(tmp_path / "run"))
    cfg = config_lib.base_config()
    cfg.rl.max_staleness = 1
    ctx = types.SimpleNamespace(
        cfg=cfg, chat=chat, workdir=workdir, beat=types.SimpleNamespace(progress=lambda *a: None)
    )
    store = RolloutStore(workdir)
    for index, (sampler, version) in enumerate([(0, 5), (1, 3), (0, 5)]):
        episodes = [_episode(chat, t, s, segments=1) for t in range(2) for s in range(2)]
        store.write(index, episodes, {"policy_version": version, "sampler": sampler})
    rows = []
    writer = types.SimpleNamespace(write=lambda stage, step, row: rows.append((step, row)))
    trainer = _FakeTrainer(version=5)
    for index in range(3):
        rl_loop._train_on(trainer, ctx, store, index, writer)
    assert [step for step, _ in rows] == [1, 2, 3]
    assert [r["sampler"] for _, r in rows] == [0, 1, 0]
    assert [r["rollout_index"] for _, r in rows] == [0, 1, 2]
    assert [r["episodes"] for _, r in rows] == [4, 4, 4]
    # Batch 1 (sampler 1, version 3) meets a trainer at version 6: 3 > 1 versions old.
    assert [r["staleness"] for _, r in rows] == [0, 3, 1]
    assert [r["stale_batches_dropped"] for _, r in rows] == [0, 1, 0]
    assert trainer.trained == [4, 4] and "policy_loss" not in rows[1][1]
    assert store.trained() == 3 and trainer.extra == {"next_rollout": 3}


# ---- 2 samplers + 1 trainer as processes ---------------------------------------------


def _start(workdir, role, log_path, *flags):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    env.pop(heartbeat.ROLE_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
    cmd = [
        sys.executable, "-m", "cursor_rl.main", "--config=tests/rl_micro_config.py",
        f"--workdir={workdir}", f"--config.rl.role={role}",
        f"--config.rl.num_steps={NUM_STEPS}", f"--config.rl.num_samplers={NUM_SAMPLERS}",
        "--config.rl.eval.every=-1",  # no held-out evals: the bridge is under test
        *flags,
    ]  # fmt: skip
    out = open(log_path, "a")  # noqa: SIM115
    # A session of its own: a SIGKILL of its group takes its sandbox workers too.
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def _snapshot(store, index):
    path = store.path(index)
    return path.read_bytes(), os.stat(os.fspath(path)).st_mtime_ns


@pytest.mark.slow
def test_two_samplers_one_trainer_and_a_killed_sampler(rl_workdir, tmp_path):  # noqa: F811
    """2 samplers + 1 trainer as processes. Sampler 1 is killed (SIGKILL) once it has
    published its first batch; the trainer trains on everything before that sampler's
    next index and waits there; sampler 1 restarts, resumes at that index, and the run
    completes. Every batch was trained once, from both samplers, none lost, none
    written twice, every episode counted."""
    from cursor_rl.tasks import workdir as workdir_tasks

    workdir_tasks.ensure_datasets(rl_workdir, train_count=2, bench_count=2, log=lambda _: None)
    logs = {name: str(tmp_path / f"{name}.log") for name in ("trainer", "sampler0", "sampler1")}

    def sampler(k):
        return _start(rl_workdir, "sampler", logs[f"sampler{k}"], f"--config.rl.sampler_id={k}")

    procs = {
        "trainer": _start(rl_workdir, "trainer", logs["trainer"]),
        "sampler0": sampler(0),
        "sampler1": sampler(1),
    }
    store = RolloutStore(rl_workdir)

    def fail(message):
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        tails = "\n".join(f"--- {n}\n{_tail(p)}" for n, p in logs.items())
        pytest.fail(f"{message}\n{tails}")

    def wait_for(condition, what, timeout=600):
        deadline = time.time() + timeout
        while not condition():
            if time.time() > deadline or any(p.poll() not in (None, 0) for p in procs.values()):
                fail(f"waiting for {what}")
            time.sleep(0.2)

    start = time.time()
    wait_for(lambda: store.exists(1), "sampler 1's first batch")
    published = _snapshot(store, 1)
    killed = procs.pop("sampler1")
    os.killpg(killed.pid, signal.SIGKILL)  # the sampler and its sandbox workers
    killed.wait(60)
    killed_at = time.time()
    assert not store.done
    # The trainer takes every batch before sampler 1's next one, then waits for it.
    wait_for(lambda: store.trained() == 3, "the trainer to train batches 0-2")
    waiting = lambda: heartbeat.read_heartbeats(rl_workdir)["trainer"].get("waiting") or ""
    wait_for(lambda: waiting() == "rollout 3 (sampler 1)", "the trainer to wait on sampler 1")
    assert not store.exists(3) and not store.done
    procs["sampler1"] = sampler(1)  # restarted: resumes its own cursor
    deadline = time.time() + 600
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            fail(f"{name} did not finish")
        if proc.returncode != 0:
            fail(f"{name} exited with {proc.returncode}")
    wall = time.time() - start

    assert store.done and store.trained() == NUM_STEPS
    # Sampler 1's batch published before the kill is the very file it was: not rewritten.
    assert _snapshot(store, 1) == published
    # Every batch on disk was written by its owner; none runs more than max_staleness
    # ahead of the last batch trained; the one sampler 1 owed was written after it restarted.
    files = sorted(int(p.name[:-5]) for p in store.directory.glob("[0-9]*.json"))
    assert files[:NUM_STEPS] == list(range(NUM_STEPS))
    assert files[-1] <= NUM_STEPS + MAX_STALENESS, files
    batches = {i: store.read(i) for i in files}
    assert all(info["sampler"] == i % NUM_SAMPLERS for i, (_, info) in batches.items())
    assert os.stat(os.fspath(store.path(3))).st_mtime > killed_at

    # The trainer's rows: one per step, exactly once each, in index order, alternating
    # samplers; none dropped as stale; each episode tagged with the versions it came from.
    rows = [r for r in read_metrics(rl_workdir) if r["stage"] == "rl" and "scored_episodes" in r]
    assert [r["step"] for r in rows] == list(range(1, NUM_STEPS + 1))
    assert [r["rollout_index"] for r in rows] == list(range(NUM_STEPS))
    assert [r["sampler"] for r in rows] == [i % NUM_SAMPLERS for i in range(NUM_STEPS)]
    assert all(r["stale_batches_dropped"] == 0 for r in rows)
    assert all(0 <= r["staleness"] <= MAX_STALENESS for r in rows)
    assert all(np.isfinite(r["policy_loss"]) for r in rows)
    per_sampler = {k: sum(r["episodes"] for r in rows if r["sampler"] == k) for k in (0, 1)}
    assert per_sampler == {k: EPISODES_PER_BATCH * NUM_STEPS // NUM_SAMPLERS for k in (0, 1)}
    seen = set()
    for index in range(NUM_STEPS):
        episodes, info = batches[index]
        assert len(episodes) == rows[index]["episodes"] == EPISODES_PER_BATCH
        for e in episodes:
            assert e.turn_versions and min(e.turn_versions) >= info["policy_version"]
            seen.add((index, e.task_index, e.sample))
    assert len(seen) == NUM_STEPS * EPISODES_PER_BATCH  # no episode twice, none missing
    print(f"2 samplers + trainer, {NUM_STEPS} steps, one sampler killed: {wall:.0f} s")
