"""Textual feedback (cursor_rl.rl.feedback): detectors on recorded episodes, teacher
rows in the batch, teacher log-probs equal to a direct forward pass on the hinted
sequence, coef = 0 reproducing plain GRPO bitwise, and the "kl" objective equal to the
whole-vocabulary KL between two direct forward passes and moving the student toward
the teacher."""

import functools
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from rl_micro_config import MODEL
from test_rl_loop import ROOT, rl_workdir, tokenizer, variables  # noqa: F401 (fixtures)

from cursor_rl import config_lib, model
from cursor_rl.chat import protocol
from cursor_rl.chat.episodes import Episode
from cursor_rl.chat.protocol import CALL_CLOSE, CALL_OPEN, END, ChatFormat, Message, ToolCall
from cursor_rl.data import packing
from cursor_rl.env import harness
from cursor_rl.env.tools import TOOL_SPECS, ToolResult
from cursor_rl.rl import feedback, grpo, hints
from cursor_rl.rl.trainer import build_batch
from cursor_rl.train import optimizer as optim
from cursor_rl.train import step as step_lib
from cursor_rl.train.metrics import read_metrics


def _call(name, **arguments):
    return ToolCall(name, arguments)


def _episode(chat, turns, *, finish="submitted", task_index=0, sample=0):
    """A recorded episode: each turn is a ToolCall list or raw markup text; tools answer
    "ok" (submit ends it)."""

    def execute(call):
        if isinstance(call, protocol.ToolCallError):
            return ToolResult(call.message, ok=False)
        return ToolResult("ok", submitted=call.name == "submit")

    agent = harness.AgentEpisode(
        chat, TOOL_SPECS, execute, system="Fix it.", task="Fix.", tools_style="compact"
    )
    for turn in turns:
        agent.prompt()
        if isinstance(turn, str):
            ids = chat.encode_markup(turn + END)
        else:
            ids = chat.assistant_body(Message("assistant", "", tool_calls=tuple(turn)))
        agent.step(ids, [-0.5] * len(ids))
    return Episode(
        task_id=f"t{task_index}", category="bug", task_index=task_index, sample=sample,
        trajectory=agent.trajectory, finish_reason=finish, generated_tokens=10,
    )  # fmt: skip


def _starts(episode):
    return [t.start for t in episode.trajectory.turns if t.role == "assistant"]


@pytest.fixture(scope="module")
def chat(tokenizer):  # noqa: F811
    return ChatFormat(tokenizer)


def test_each_detector_finds_its_turn_and_fills_its_hint(chat):
    edit = _call("edit_file", path="mod.py", old_str="a", new_str="b")
    read = [_call("read_file", path="mod.py")]
    test_edit = _call("edit_file", path="tests/test_mod.py", old_str="1", new_str="2")
    cases = {
        "malformed_tool_call": [read, f"{CALL_OPEN}{{not json{CALL_CLOSE}"],
        "repeated_edit": [[edit], read, [edit]],
        "submitted_without_tests": [[edit], [_call("submit")]],
        "edited_tests": [read, [test_edit]],
        "gave_up_early": [[edit], "I cannot do this."],
    }
    config = feedback.FeedbackConfig(enabled=True)
    for name, turns in cases.items():
        finish = "answered" if name == "gave_up_early" else "submitted"
        episode = _episode(chat, turns, finish=finish)
        (point,), metrics = feedback.find_points([episode], chat, config, max_turns=8)
        assert point is not None and point.detector == name, (name, point)
        assert point.position == _starts(episode)[-1], name  # the turn that went wrong
        assert metrics[f"feedback/{name}"] == 1.0
    malformed = _episode(chat, cases["malformed_tool_call"])
    (point,), _ = feedback.find_points([malformed], chat, config)
    assert "read_file" in point.hint and "submit" in point.hint  # the tool list
    tests = _episode(chat, cases["edited_tests"])
    (point,), _ = feedback.find_points([tests], chat, config)
    assert "tests/test_mod.py" in point.hint


def test_clean_episodes_have_no_point_and_limits_are_respected(chat):
    clean = _episode(
        chat,
        [
            [_call("edit_file", path="mod.py", old_str="a", new_str="b")],
            [_call("run_terminal", command="python -m pytest -q")],
            [_call("submit")],
        ],
    )
    config = feedback.FeedbackConfig(enabled=True)
    (point,), metrics = feedback.find_points([clean], chat, config)
    assert point is None and metrics["feedback/points"] == 0
    # Stopping at the turn limit is not giving up early.
    at_limit = _episode(chat, [[_call("read_file", path="a")], "done"], finish="answered")
    (point,), _ = feedback.find_points([at_limit], chat, config, max_turns=2)
    assert point is None
    # Only the enabled detectors run; the earliest point wins.
    both = _episode(chat, [f"{CALL_OPEN}bad{CALL_CLOSE}", [_call("submit")]])
    (point,), _ = feedback.find_points([both], chat, config)
    assert point.detector == "malformed_tool_call"
    only = feedback.FeedbackConfig(enabled=True, detectors=("submitted_without_tests",))
    (point,), _ = feedback.find_points([both], chat, only)
    assert point.detector == "submitted_without_tests"


def test_a_detector_that_raises_is_counted_and_the_others_still_run(chat, monkeypatch):
    def broken(view):
        raise RuntimeError("bug in a detector")

    monkeypatch.setitem(feedback.DETECTORS, "repeated_edit", broken)
    episode = _episode(chat, [[_call("submit")]])
    (point,), metrics = feedback.find_points([episode], chat, feedback.FeedbackConfig(enabled=True))
    assert point.detector == "submitted_without_tests"
    assert metrics["feedback/detector_errors"] == 1


def test_feedback_config_is_checked():
    with pytest.raises(ValueError, match="unknown"):
        feedback.FeedbackConfig.from_mapping({"detectors": ["telepathy"]})
    with pytest.raises(ValueError, match="unknown field"):
        feedback.FeedbackConfig.from_mapping({"lambda": 1.0})
    assert set(hints.HINTS) >= set(feedback.DETECTORS)


def _batch_with_points(chat, window=64, seq_len=2048):
    episodes = [
        _episode(chat, [[_call("read_file", path="mod.py")], [_call("submit")]], sample=0),
        _episode(chat, [[_call("run_terminal", command="pytest")], [_call("submit")]], sample=1),
    ]
    points, _ = feedback.find_points(episodes, chat, feedback.FeedbackConfig(enabled=True))
    assert [p is not None for p in points] == [True, False]
    hint_ids = functools.partial(feedback.hint_tokens, chat)
    batch, stats = build_batch(
        episodes, [0.5, -0.5], seq_len=seq_len, rows_multiple=1, aggregation="token_mean",
        points=points, hint_ids=hint_ids, window=window,
    )  # fmt: skip
    return episodes, points, batch, stats, hint_ids


def test_teacher_rows_link_each_window_token_to_its_copy_in_the_hinted_sequence(chat):
    episodes, points, batch, stats, hint_ids = _batch_with_points(chat, window=4)
    assert stats.feedback_points == 1 and stats.teacher_rows >= 1
    index = batch["feedback_index"]
    on = index >= 0
    assert on.sum() == 4  # the window's model tokens
    assert (batch["loss_mask"][on] == 1).all()
    flat_targets = batch["teacher_targets"].reshape(-1)
    np.testing.assert_array_equal(flat_targets[index[on]], batch["targets"][on])
    # The hinted sequence: the episode's tokens with the hint's user turn at the point.
    traj = episodes[0].trajectory
    at = points[0].position
    hinted = [*traj.tokens[:at], *hint_ids(points[0].hint), *traj.tokens[at:]]
    n = len(hinted) - 1
    row = int(np.argmax((batch["teacher_segment_ids"] > 0).sum(1)))
    np.testing.assert_array_equal(batch["teacher_tokens"][row, :n], hinted[:-1])
    # A hinted segment that does not fit is dropped and counted.
    _, _, _, too_long, _ = _batch_with_points(chat, seq_len=len(traj.tokens) + 1)
    assert too_long.feedback_too_long == 1 and too_long.teacher_rows == 0


def _put(batch, old_logprobs):
    out = {k: jax.numpy.asarray(v) for k, v in batch.items()}
    out["old_logprobs"] = jax.numpy.asarray(old_logprobs)
    return out


def test_teacher_logprobs_equal_a_direct_forward_pass_on_the_hinted_sequence(
    chat,
    variables,  # noqa: F811
):
    episodes, points, batch, _, hint_ids = _batch_with_points(chat)
    teacher_lp, on = grpo.teacher_logprobs(variables, batch, config=MODEL, chunk_rows=1)
    traj = episodes[0].trajectory
    at = points[0].position
    hinted = [*traj.tokens[:at], *hint_ids(points[0].hint), *traj.tokens[at:]]
    mask = [0] * (at + len(hint_ids(points[0].hint))) + list(traj.loss_mask[at:])
    example = packing.example_from_ids(hinted, mask)
    example["positions"] = np.arange(len(hinted) - 1, dtype=np.int32)
    example["segment_ids"] = np.ones(len(hinted) - 1, np.int32)
    direct = grpo.logprobs_step(
        variables,
        {k: jax.numpy.asarray(v)[None] for k, v in example.items()},
        config=MODEL,
    )[0]
    expected = np.asarray(direct)[np.asarray(example["loss_mask"]) == 1]
    got = np.asarray(teacher_lp)[np.asarray(on)]
    assert got.shape == expected[: got.shape[0]].shape and got.size > 10
    np.testing.assert_allclose(got, expected[: got.size], atol=1e-5)


def _update(weights, data, coef, objective="advantage", learning_rate=1e-2):
    """One GRPO step from ``weights`` on ``data`` (its old log-probs computed here), with
    textual feedback's ``coef`` and ``objective``: (new state, metrics)."""
    plain = {k: v for k, v in data.items() if k not in grpo.FEEDBACK_KEYS}
    old = np.asarray(
        grpo.logprobs_step(weights, {k: plain[k] for k in step_lib.BATCH_KEYS}, config=MODEL)
    )
    opt = config_lib.base_config().optimizer
    opt.update(learning_rate=learning_rate, schedule="constant", warmup_steps=0)
    tx = optim.make_optimizer(opt, 10)
    state = step_lib.TrainState(
        step=jax.numpy.int32(0), params=weights["params"], router=weights["router"],
        opt_state=tx.init(weights["params"]), skipped=jax.numpy.int32(0),
    )  # fmt: skip
    return grpo.grpo_step(
        state, _put(data, old), config=MODEL, grpo=grpo.GRPOConfig(), tx=tx,
        schedule=optim.make_schedule(opt, 10), feedback_coef=coef,
        feedback_objective=objective,
    )  # fmt: skip


def test_coef_zero_reproduces_plain_grpo_bitwise_and_coef_moves_the_update(
    chat,
    variables,  # noqa: F811
):
    _, _, batch, _, _ = _batch_with_points(chat)
    plain = {k: v for k, v in batch.items() if k not in grpo.FEEDBACK_KEYS}

    def step(data, coef):
        new, metrics = _update(variables, data, coef)
        return jax.tree.leaves(new.params), metrics

    base, _ = step(plain, 0.0)
    zero, metrics = step(batch, 0.0)
    for a, b in zip(base, zero):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(metrics["feedback_tokens"]) > 0
    assert abs(float(metrics["feedback_signal"])) > 0
    moved, _ = step(batch, 1.0)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(base, moved))


def _full_logp(weights, tokens):
    """log softmax of the model's logits [T-1, V] for one unpacked sequence."""
    ids = np.asarray(tokens, np.int32)[None, :-1]
    n = ids.shape[1]
    hidden, head, _ = model.hidden_with_aux(
        MODEL, weights, jax.numpy.asarray(ids), jax.numpy.arange(n)[None],
        jax.numpy.ones((1, n), jax.numpy.int32),
    )  # fmt: skip
    logits = model.project_logits(hidden, head)[0]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)


def _kl_step(weights, data, coef):
    return _update(weights, data, coef, objective="kl", learning_rate=1e-3)


@pytest.fixture(scope="module")
def sharp(variables):  # noqa: F811
    """The micro model's weights (matrices) scaled by 4: at initialisation its
    next-token distributions are nearly uniform whatever the context, so a hint barely
    moves them (KL ~1e-7); scaled, the hinted and plain distributions differ (KL ~0.1)."""
    params = jax.tree.map(lambda x: x * 4 if x.ndim >= 2 else x, variables["params"])
    return {"params": params, "router": variables["router"]}


def test_kl_objective_is_the_whole_vocabulary_kl_to_the_hinted_forward_pass(chat, sharp):
    """objective="kl": the step's mean KL over the window equals KL(teacher || student)
    computed from two direct forward passes, the hinted sequence's and the episode's,
    at the window's positions; and the teacher's log p of the sampled tokens equals
    teacher_logprobs'."""
    episodes, points, batch, _, hint_ids = _batch_with_points(chat)
    _, metrics = _kl_step(sharp, batch, coef=1.0)
    traj = episodes[0].trajectory
    at = points[0].position
    hint = list(hint_ids(points[0].hint))
    student = _full_logp(sharp, traj.tokens)
    teacher = _full_logp(sharp, [*traj.tokens[:at], *hint, *traj.tokens[at:]])
    # The window's model tokens j (predicted at row j - 1) and their hinted twins.
    # (64: _batch_with_points' window)
    window = [j for j in range(at, len(traj.tokens)) if traj.loss_mask[j]][:64]
    kls = []
    for j in window:
        p, q = teacher[j - 1 + len(hint)], student[j - 1]
        kls.append(float(np.sum(np.exp(p) * (p - q))))
    assert len(kls) == int(metrics["feedback_tokens"]) and len(kls) > 10
    np.testing.assert_allclose(float(metrics["feedback_kl"]), np.mean(kls), rtol=1e-4)
    teacher_lp, on = grpo.teacher_logprobs(sharp, batch, config=MODEL)
    old = grpo.logprobs_step(
        sharp, {k: jax.numpy.asarray(batch[k]) for k in step_lib.BATCH_KEYS}, config=MODEL
    )
    expected = float(((teacher_lp - old) * on).sum() / on.sum())
    np.testing.assert_allclose(float(metrics["feedback_signal"]), expected, atol=1e-5)


def test_kl_objective_moves_the_student_toward_the_teacher(chat, sharp):
    """One update with the KL term (advantages zeroed, so only the KL acts) lowers the
    KL from the original teacher's distributions; coef = 0 under objective "kl" is
    plain GRPO, bitwise."""
    _, _, batch, _, _ = _batch_with_points(chat)
    quiet = dict(batch, advantages=np.zeros_like(batch["advantages"]))
    plain = {k: v for k, v in quiet.items() if k not in grpo.FEEDBACK_KEYS}
    base, _ = _kl_step(sharp, plain, coef=0.0)
    zero, _ = _kl_step(sharp, quiet, coef=0.0)
    for a, b in zip(jax.tree.leaves(base.params), jax.tree.leaves(zero.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    new, metrics = _kl_step(sharp, quiet, coef=1.0)
    hidden, on = grpo.teacher_hidden(sharp, batch, config=MODEL)
    data = {k: jax.numpy.asarray(batch[k]) for k in step_lib.BATCH_KEYS}
    weight = on / on.sum()

    def kl(params):
        stats, _ = step_lib.token_stats(MODEL, params, sharp["router"], data, teacher_hidden=hidden)
        return float((stats["kl_teacher"] * weight).sum())

    before, after = kl(sharp["params"]), kl(new.params)
    np.testing.assert_allclose(before, float(metrics["feedback_kl"]), rtol=1e-4)
    assert after < before * 0.99, (before, after)


def test_feedback_objective_is_checked():
    with pytest.raises(ValueError, match="objective"):
        feedback.FeedbackConfig.from_mapping({"objective": "reverse"})
    assert feedback.FeedbackConfig.from_mapping({"objective": "kl"}).objective == "kl"


@pytest.mark.slow
def test_the_rl_loop_trains_with_feedback_end_to_end(rl_workdir, tmp_path):  # noqa: F811
    """The micro RL run (colocated) with rl.feedback.enabled: the untrained policy
    stops calling tools with turns left (gave_up_early), the detectors' rates are in
    every RL row, the points' episodes train with teacher rows in the same update,
    and the loss stays finite."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
    cmd = [
        sys.executable, "-m", "cursor_rl.main", "--config=tests/rl_micro_config.py",
        f"--workdir={rl_workdir}", "--config.rl.feedback.enabled=True",
        "--config.rl.eval.every=-1", "--config.rl.feedback.coef=0.5",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [r for r in read_metrics(rl_workdir) if r["stage"] == "rl" and "scored_episodes" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert set(feedback.DETECTORS) <= {
            k.split("/")[1] for k in row if k.startswith("feedback/")
        }
    trained = [r for r in rows if r.get("feedback/trained_points", 0) > 0]
    assert trained, rows
    assert all(r["feedback_tokens"] > 0 and r["policy_loss"] is not None for r in trained)
