"""The RL loop: segments share their episode's reward, the sampler's log-probs are the
trainer's on-policy, and trainer and sampler run as two processes through the bridge.
"""

import json
import math
import os
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest
from rl_micro_config import MODEL
from test_tasks_records import make_record

from cursor_rl import checkpoints, config_lib, model
from cursor_rl.chat import protocol
from cursor_rl.chat.episodes import Episode
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.rl import grpo, rewards
from cursor_rl.rl import loop as rl_loop
from cursor_rl.rl.loop import RolloutStore, score_groups
from cursor_rl.rl.trainer import build_batch
from cursor_rl.sampler import Sampler, SamplingParams
from cursor_rl.tasks import records
from cursor_rl.workdir import Workdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tokenizer():
    texts = [
        f"def f_{i}(x):\n    return x * {i} + {i % 7}\n# Return x multiplied by {i}.\n"
        for i in range(300)
    ]
    return Tokenizer.train(texts, MODEL.vocab_size)


@pytest.fixture(scope="module")
def variables():
    return model.init(MODEL, jax.random.key(0))


def _episode(chat, task_index, sample, segments, reward_tokens=3, logprobs=None):
    """An episode of ``segments`` context windows, each a user turn and a sampled turn."""
    traj = protocol.Trajectory()
    for s in range(segments):
        chat.start_segment(traj)
        chat.append_message(traj, protocol.Message("user", f"segment {s}"))
        chat.append_assistant_header(traj)
        chat.append_sampled(traj, [40 + s] * reward_tokens, logprobs or [-1.0] * reward_tokens)
    return Episode(
        task_id=f"t{task_index}",
        category="feature",
        task_index=task_index,
        sample=sample,
        trajectory=traj,
        finish_reason="submitted",
        generated_tokens=reward_tokens * segments,
        grade={"resolved": sample == 0, "fail_to_pass": {}, "pass_to_pass": {}},
    )


def test_every_segment_of_an_episode_trains_with_its_one_reward(tokenizer):
    """Self-summarized episodes: one reward per episode, the same advantage on the
    model tokens of each of its segments (each segment its own training sequence)."""
    chat = protocol.ChatFormat(tokenizer)
    group = [_episode(chat, 0, sample, segments=1 + sample % 3) for sample in range(4)]
    kept, advantages, metrics = score_groups(
        group, rewards.RewardConfig(), grpo.GRPOConfig(drop_zero_variance=True)
    )
    assert len(kept) == 4 and metrics["groups"] == 1
    assert len({round(a, 6) for a in advantages}) == 2  # solved vs unsolved
    batch, stats = build_batch(
        kept, advantages, seq_len=64, rows_multiple=1, aggregation="token_mean"
    )
    assert stats.sequences == sum(e.segments for e in kept) == 1 + 2 + 3 + 1
    # Each sampled token (40 + segment index) carries its episode's advantage.
    model_tokens = batch["loss_mask"] == 1
    for e in kept:
        assert all(sum(e.trajectory.segment(s)[1]) == 3 for s in range(e.segments))
    seen = batch["advantages"][model_tokens]
    expected = sorted(a for e, a in zip(kept, advantages) for _ in range(3 * e.segments))
    np.testing.assert_allclose(sorted(seen), expected, rtol=1e-6)
    assert stats.model_tokens == 3 * stats.sequences


def test_score_groups_counts_self_summarised_episodes(tokenizer):
    """Per step: how many scored episodes summarised, and the mean reward of those and
    of the rest (a lost episode is in neither)."""
    chat = protocol.ChatFormat(tokenizer)
    episodes = [_episode(chat, task, sample, segments=1) for task in (0, 1) for sample in range(3)]
    for e in episodes:
        if e.sample > 0:  # samples 1, 2 of each task wrote a summary; sample 0 solved it
            e.summary_tokens.append(7)
    episodes[-1].finish_reason = "lost"
    _, _, metrics = score_groups(
        episodes, rewards.RewardConfig(), grpo.GRPOConfig(drop_zero_variance=False)
    )
    assert metrics["scored_episodes"] == 5 and metrics["summarised_episodes"] == 3
    reward = {id(e): e.grade["reward"] for e in episodes if "reward" in e.grade}
    summarised = [reward[id(e)] for e in episodes[:-1] if e.summary_tokens]
    rest = [reward[id(e)] for e in episodes[:-1] if not e.summary_tokens]
    assert metrics["summarised_reward"] == pytest.approx(np.mean(summarised))
    assert metrics["unsummarised_reward"] == pytest.approx(np.mean(rest))
    assert metrics["unsummarised_reward"] > metrics["summarised_reward"]  # solved vs not

    for e in episodes:
        e.summary_tokens.clear()
    _, _, metrics = score_groups(episodes, rewards.RewardConfig(), grpo.GRPOConfig())
    assert metrics["summarised_episodes"] == 0 and "summarised_reward" not in metrics


class _ScriptedRunner:
    """Stands in for RolloutRunner: a group of 4 per task, solved by sample 0 only on the
    tasks in ``solvable`` (those groups have reward variance), by none elsewhere."""

    def __init__(self, chat, solvable):
        self.chat, self.solvable, self.calls = chat, set(solvable), []

    def run(self, tasks, seed=0):
        self.calls.append((list(tasks), seed))
        out = []
        for i, task in enumerate(tasks):
            for g in range(4):
                e = _episode(self.chat, i, g, segments=1)
                e.task_id = task
                e.grade["resolved"] = g == 0 and task in self.solvable
                out.append(e)
        return out


def _sampler_side(chat, rounds, solvable):
    cfg = config_lib.base_config()
    cfg.rl.tasks_per_step = 2
    cfg.rl.sample_rounds = rounds
    ctx = types.SimpleNamespace(cfg=cfg, train_tasks=[f"task{i}" for i in range(12)])
    side = rl_loop._SamplerSide.__new__(rl_loop._SamplerSide)
    side.ctx, side.runner = ctx, _ScriptedRunner(chat, solvable)
    side.sampler = types.SimpleNamespace(policy_version=0)
    return side


def test_dynamic_sampling_samples_rounds_until_enough_groups_have_signal(tokenizer):
    """rl.sample_rounds > 1 (DAPO's dynamic sampling): new rounds of tasks_per_step tasks
    until tasks_per_step groups have reward variance, at most sample_rounds rounds; every
    episode is kept, each round's groups distinct; one round is the plain batch."""
    chat = protocol.ChatFormat(tokenizer)
    plain = _sampler_side(chat, 1, solvable=[])
    episodes, info = plain.rollouts(3)
    assert info["sample_rounds"] == 1 and len(plain.runner.calls) == 1
    assert plain.runner.calls[0][0] == rl_loop._task_batch(plain.ctx, 3)  # unchanged batch

    ctx = _sampler_side(chat, 4, []).ctx
    order = [t for batch in range(3) for t in rl_loop._task_batch(ctx, batch)]
    # One solvable task in each of the first two rounds: two rounds fill the batch.
    side = _sampler_side(chat, 4, solvable=[order[0], order[3]])
    episodes, info = side.rollouts(0)
    assert info["sample_rounds"] == 2 and len(side.runner.calls) == 2
    assert [t for tasks, _ in side.runner.calls for t in tasks] == order[:4]
    assert len({seed for _, seed in side.runner.calls}) == 2
    assert sorted({e.task_index for e in episodes}) == [0, 1, 2, 3] and len(episodes) == 16
    reward_config = rewards.RewardConfig()
    assert rl_loop.signal_groups(episodes, reward_config) == 2
    kept, _, metrics = score_groups(episodes, reward_config, grpo.GRPOConfig())
    assert {e.task_id for e in kept} == {order[0], order[3]}
    assert metrics["groups"] == 4 and metrics["zero_variance_groups"] == 2

    # No group with signal anywhere: the rounds run out and the batch is all of them.
    side = _sampler_side(chat, 3, solvable=[])
    episodes, info = side.rollouts(0)
    assert info["sample_rounds"] == 3 and len(episodes) == 3 * 2 * 4


def test_rl_can_skip_the_tasks_sft_demonstrated(tmp_path):
    """rl.tasks.skip_demonstrated: RL samples only the tasks after the first
    sft_data.demos (the demonstrated ones); all demonstrated is a clear error."""
    records.write_tasks(
        [make_record(task_id=f"t-{i}") for i in range(5)], str(tmp_path / "tasks.jsonl")
    )
    cfg = config_lib.base_config()
    cfg.sft_data.demos = 3
    assert [t.task_id for t in rl_loop.rl_train_tasks(cfg, str(tmp_path))] == [
        f"t-{i}" for i in range(5)
    ]
    cfg.rl.tasks.skip_demonstrated = True
    assert [t.task_id for t in rl_loop.rl_train_tasks(cfg, str(tmp_path))] == ["t-3", "t-4"]
    cfg.sft_data.demos = 5
    with pytest.raises(ValueError, match=r"all 5 training tasks .* \(sft_data.demos=5\)"):
        rl_loop.rl_train_tasks(cfg, str(tmp_path))


@pytest.mark.slow
def test_sampler_logprobs_are_the_trainers_on_policy(tokenizer, variables):
    """Sampled turns appended to a trajectory, packed by ``build_batch`` and scored by
    the trainer's ``logprobs_step``: the trainer's log p of every model token equals
    the sampler's (same weights, temperature 1), so the importance ratio is 1."""
    chat = protocol.ChatFormat(tokenizer)
    sampler = Sampler(MODEL, variables, num_slots=4, max_seq_len=256, decode_steps=8)
    params = SamplingParams(
        temperature=1.0, max_new_tokens=12, seed=3, stop_token_ids=tuple(chat.stop_token_ids)
    )
    episodes = []
    for i, text in enumerate(["Return x multiplied by 3.", "def f_7(x):", "Fix the code"]):
        traj = protocol.Trajectory()
        chat.start_segment(traj)
        chat.append_message(traj, protocol.Message("user", text))
        session, sent = None, 0
        for turn in range(2):  # the second turn continues the cached sequence
            chat.append_assistant_header(traj)
            context = traj.current_context()
            if session is None:
                session = sampler.open(context, seed=i)
            else:
                sampler.append(session, context[sent:])
            (completion,) = sampler.advance([session], params)
            sent = len(context) + len(completion.tokens)
            chat.append_sampled(traj, completion.tokens, completion.logprobs)
            chat.append_message(traj, protocol.Message("tool", f"result {turn}"))
        sampler.close(session)
        episodes.append(
            Episode(f"t{i}", "feature", i, 0, traj, "submitted", grade={"resolved": False})
        )
    batch, _ = build_batch(
        episodes, [1.0] * len(episodes), seq_len=256, rows_multiple=1, aggregation="token_mean"
    )
    logp = np.asarray(grpo.logprobs_step(variables, {k: batch[k] for k in batch}, config=MODEL))
    mask = batch["loss_mask"] == 1
    sampled = [
        lp
        for e in episodes
        for lp, m in zip(e.trajectory.logprobs, e.trajectory.loss_mask)
        if m and not math.isnan(lp)
    ]
    assert mask.sum() == len(sampled) > 10
    np.testing.assert_allclose(logp[mask], batch["sampler_logprobs"][mask], atol=2e-4)


@pytest.fixture
def rl_workdir(tmp_path, tokenizer, variables):
    """A workdir as the SFT stage leaves it: tokenizer, an SFT checkpoint, and the
    long-context checkpoint before it (the same weights here, at step 3)."""
    from cursor_rl.env import sandbox

    if sandbox.unavailable_reason():
        pytest.skip(f"sandbox unavailable: {sandbox.unavailable_reason()}")
    workdir = str(tmp_path / "run")
    tokenizer.save(os.path.join(workdir, "tokenizer"))
    checkpoints.save_variables(
        Workdir(workdir).checkpoint_dir("sft"),
        jax.device_get(variables),
        checkpoints.make_metadata(MODEL, stage="sft", step=1, tokenizer_json=tokenizer.to_json()),
    )
    checkpoints.save_variables(
        Workdir(workdir).checkpoint_dir("long_context"),
        jax.device_get(variables),
        checkpoints.make_metadata(
            MODEL, stage="long_context", step=3, tokenizer_json=tokenizer.to_json()
        ),
    )
    return workdir


def _start(workdir, role, log_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
    cmd = [
        sys.executable, "-m", "cursor_rl.main", "--config=tests/rl_micro_config.py",
        f"--workdir={workdir}", f"--config.rl.role={role}",
    ]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log_path, "w"), stderr=-2)


def _tail(path):
    with open(path) as fh:
        return fh.read()[-3000:]


@pytest.mark.slow
def test_trainer_and_sampler_as_two_processes(rl_workdir, tmp_path):
    """Two programs, one bridge: the sampler process writes rollout files tagged with
    policy versions and evaluates; the trainer process trains on them and publishes
    each policy as an Orbax checkpoint, which the sampler picks up."""
    # The task datasets are built once, before either process starts (both would).
    from cursor_rl.tasks import workdir as workdir_tasks

    workdir_tasks.ensure_datasets(rl_workdir, train_count=2, bench_count=2, log=lambda _: None)
    logs = {role: str(tmp_path / f"{role}.log") for role in ("trainer", "sampler")}
    procs = {role: _start(rl_workdir, role, logs[role]) for role in ("sampler", "trainer")}
    deadline = time.time() + 600
    for role, proc in procs.items():
        try:
            proc.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"{role} did not finish:\n" + _tail(logs[role]))
    for role, proc in procs.items():
        assert proc.returncode == 0, f"{role} failed:\n" + _tail(logs[role])
    store = RolloutStore(rl_workdir)
    assert store.done and store.trained() == 2
    for index in (0, 1):
        episodes, info = store.read(index)
        assert len(episodes) == 2 * 2  # tasks_per_step x group_size
        assert info["policy_version"] <= index  # at most max_staleness=1 behind
        assert all(e.trajectory.tokens and e.grade for e in episodes)
    policies = sorted(
        int(p) for p in os.listdir(os.path.join(rl_workdir, "rl", "policy")) if p.isdigit()
    )
    assert policies[-1] == 2  # one optimizer update per rollout batch
    with open(os.path.join(rl_workdir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    trained = [r for r in rows if r["stage"] == "rl" and "policy_loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(np.isfinite(r["policy_loss"]) for r in trained)
    evals = {(r["stage"], r["step"]): r for r in rows if "pass@1" in r and "k" in r}
    assert ("base", 3) in evals and ("sft", 0) in evals and ("rl", 2) in evals
    assert [r["stage"] for r in rows if "bench" in r][:2] == ["base", "sft"]
    assert all("pass@1_ci_low" in r for r in evals.values())
    # The base eval's turns were sampled with the long-context weights (version -1);
    # the SFT policy (version 0) was swapped back in for the SFT eval.
    with open(os.path.join(rl_workdir, "eval", "tiny_bench", "results.jsonl")) as fh:
        results = [json.loads(line) for line in fh]
    versions = {"base": set(), "sft": set()}
    for r in results:
        if r["stage"] in versions:
            versions[r["stage"]].update(r["policy_versions"])
    assert versions == {"base": {-1}, "sft": {0}}
    assert all("summarised_episodes" in r for r in trained)
