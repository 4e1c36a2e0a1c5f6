"""Derived judges (cursor_rl.outer.judge): the rubric labels recorded episodes as the
outer loop's rules do; the split keeps every task on one side; the head learns a
separable set and does not learn shuffled labels; the train command writes a judge
and a report; a saved judge predicts as the trained one did and plugs into the outer
loop's judge hook; bad inputs are clear errors or counted bad records."""

import json
import os
import shutil
import types

import jax
import numpy as np
import pytest
from train_helpers import MICRO_MODEL

from cursor_rl import checkpoints, model, partitioning
from cursor_rl.chat.episodes import Episode
from cursor_rl.chat.protocol import END, ChatFormat, Message, ToolCall, ToolCallError
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.env import harness
from cursor_rl.env.tools import TOOL_SPECS, ToolResult
from cursor_rl.eval import runner
from cursor_rl.outer import classify, ingest
from cursor_rl.outer import judge as judge_lib
from cursor_rl.rl import feedback
from cursor_rl.rl.loop import RolloutStore
from cursor_rl.workdir import Workdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_TOKENIZER = os.path.join(ROOT, "cursor_rl", "bases", "tiny", "tokenizer.json")
FILES = ("mod.py", "util.py", "core/calc.py", "app.py", "lib/strings.py", "parse.py")


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(Tokenizer.load(TINY_TOKENIZER))


def _random_variables(config, seed=0):
    """Random weights of ``config`` drawn on the host from the variables' shapes, as
    ``model.init`` draws them (normal, std ``initializer_range``; gains 1, biases 0)
    without compiling an init: seconds saved."""
    rng = np.random.default_rng(seed)
    shapes = partitioning.strip_axis_metadata(model.abstract_variables(config))

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return np.ones(leaf.shape, leaf.dtype)
        if "bias" in name:
            return np.zeros(leaf.shape, leaf.dtype)
        noise = rng.standard_normal(leaf.shape) * config.initializer_range
        return noise.astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.fixture(scope="module")
def policy(chat, tmp_path_factory):
    """A random micro model saved as a trainer checkpoint (with its tokenizer), loaded
    back through the judge's loader."""
    config = MICRO_MODEL.replace(vocab_size=chat.tokenizer.vocab_size, max_position_embeddings=1024)
    variables = _random_variables(config)
    metadata = checkpoints.make_metadata(
        config, stage="sft", step=3, tokenizer_json=chat.tokenizer.to_json()
    )
    path = checkpoints.save_variables(
        os.fspath(tmp_path_factory.mktemp("policy") / "checkpoints"), variables, metadata
    )
    return judge_lib.load_policy(path)


def _call(name, **arguments):
    return ToolCall(name, arguments)


def _recorded(chat, kind, task, sample, rng, *, grade=None, finish=None):
    """An episode recorded through the harness, with the behaviour ``kind`` names:
    ``tool_misuse`` (a malformed call), ``test_handling`` (submits without running
    the tests), ``bug_fix`` (edits, runs the tests, submits: no detector fires, the
    task kind decides), ``gave_up`` (stops answering with turns left)."""
    path = FILES[rng.integers(len(FILES))]
    reads = [[_call("read_file", path=FILES[rng.integers(len(FILES))])]
             for _ in range(rng.integers(0, 3))]  # fmt: skip
    edit = [_call("edit_file", path=path, old_str=f"x{rng.integers(9)}", new_str="y")]
    tests = [_call("run_terminal", command="python -m pytest -q")]
    turns = {
        "tool_misuse": [*reads, '<|tool_call|>{"name": "edit_file", "args"<|/tool_call|>', edit,
                        tests, [_call("submit")]],
        "test_handling": [*reads, edit, [_call("submit")]],
        "bug_fix": [*reads, edit, tests, [_call("submit")]],
        "gave_up": [*reads, edit, "I cannot finish this."],
    }[kind]  # fmt: skip

    def execute(call):
        if isinstance(call, ToolCallError):
            return ToolResult(call.message, ok=False)
        return ToolResult("ok", submitted=call.name == "submit")

    agent = harness.AgentEpisode(
        chat, TOOL_SPECS, execute, system="Fix it.", task=f"Fix `{path}`.", tools_style="compact"
    )
    for turn in turns:
        agent.prompt()
        if isinstance(turn, str):
            ids = chat.encode_markup(turn + END)
        else:
            ids = chat.assistant_body(Message("assistant", "", tool_calls=tuple(turn)))
        agent.step(ids, [-0.5] * len(ids))
    if grade is None:
        grade = {"resolved": kind == "bug_fix", "fail_to_pass_passed": int(kind == "bug_fix"),
                 "fail_to_pass_total": 1, "pass_to_pass_broken": 0, "flags": []}  # fmt: skip
    return Episode(
        task_id=task, category="bug", task_index=0, sample=sample, trajectory=agent.trajectory,
        finish_reason=finish or ("submitted" if agent.submitted else "answered"),
        tool_calls=len(turns), generated_tokens=len(agent.trajectory), grade=grade,
    )  # fmt: skip


KINDS = ("test_handling", "test_handling", "tool_misuse", "bug_fix")  # imbalanced on purpose


def _episodes(chat, tasks, per_task, seed):
    rng = np.random.default_rng(seed)
    out = []
    for t in range(tasks):
        for s in range(per_task):
            kind = KINDS[rng.integers(len(KINDS))]
            out.append(_recorded(chat, kind, f"task-{seed}-{t:03d}", s, rng))
    return out


class _Replay:
    """A rollout runner that returns recorded episodes (the eval writes them)."""

    def __init__(self, episodes):
        self.episodes = episodes

    def run(self, tasks, *, seed, group_size):
        return self.episodes


def _workdir(path, chat, evals=(), rollouts=()):
    """A run's workdir as the pipeline leaves it: config, tokenizer, eval results with
    trajectories (written by the real benchmark runner), rollout files."""
    wd = Workdir(os.fspath(path))
    os.makedirs(wd.tokenizer_dir, exist_ok=True)
    shutil.copy(TINY_TOKENIZER, wd.tokenizer_file)
    wd.config_file.write_text(json.dumps({"rl": {"rollout": {"max_turns": 8}}}))
    if evals:
        tasks = [types.SimpleNamespace(task_id=e.task_id, category=e.category) for e in evals]
        runner.evaluate(
            _Replay(list(evals)), tasks, samples=1, seed=0, bench_name="tiny_bench",
            out_dir=wd.eval_dir, stage="sft", step=3, save_trajectories=True,
        )  # fmt: skip
    if rollouts:
        store = RolloutStore(wd)
        for i in range(0, len(rollouts), 8):
            store.write(i // 8, rollouts[i : i + 8], {"policy_version": 0})
    return wd


# ---- the rubric and the data -------------------------------------------------------------


def test_the_rubric_labels_recorded_episodes_as_the_rules_do(chat, tmp_path):
    """Category as the outer loop's rules classify the trajectory, resolved and outcome
    from the grade; lost episodes and lines without a trajectory are counted, not used."""
    rng = np.random.default_rng(0)
    broke = {"resolved": False, "fail_to_pass_passed": 0, "pass_to_pass_broken": 2}
    partial = {"resolved": False, "fail_to_pass_passed": 1, "pass_to_pass_broken": 0}
    evals = [
        _recorded(chat, "tool_misuse", "a", 0, rng),
        _recorded(chat, "bug_fix", "b", 0, rng),
        _recorded(chat, "gave_up", "c", 0, rng, grade=broke),
    ]
    rollouts = [
        _recorded(chat, "test_handling", "d", 0, rng, grade=partial),
        _recorded(chat, "bug_fix", "e", 0, rng, finish="lost"),
    ]
    wd = _workdir(tmp_path, chat, evals, rollouts)
    with open(wd.eval_dir / "tiny_bench" / runner.RESULTS_FILE, "a") as f:
        f.write(json.dumps({"task_id": "f", "finish_reason": "submitted", "resolved": False}))
        f.write("\n")
    data = judge_lib.read_workdirs([os.fspath(wd)], chat)
    labels = {r.task_id: dict(r.labels) for r in data.records}
    assert labels == {
        "a": {"category": "tool_misuse", "resolved": "unresolved", "outcome": "no_progress"},
        "b": {"category": "bug_fix", "resolved": "resolved", "outcome": "resolved"},
        "c": {"category": "incomplete", "resolved": "unresolved", "outcome": "broke_tests"},
        "d": {"category": "test_handling", "resolved": "unresolved", "outcome": "partial"},
    }
    assert data.skipped == {"lost": 1, "no_trajectory": 1} and data.bad == []
    # The same label the outer loop gives the episode as a feedback event.
    event = next(r.event for r in data.records if r.task_id == "a")
    hits, _ = classify.run_detectors(event)
    assert classify.DETECTOR_CATEGORY[hits[0][1]] == "tool_misuse"
    assert {r.kind for r in data.records} == {"eval", "rollout"}


def test_the_split_keeps_each_task_on_one_side():
    """Every episode of a task is on one side; the split is seeded; at least one task
    is held out and at least one kept; too few tasks or a bad fraction are errors."""
    tasks = [f"t{i}" for i in range(20)]
    train, held = judge_lib.split_tasks(tasks * 3, 0.3, seed=1)
    assert not set(train) & set(held) and set(train) | set(held) == set(tasks)
    assert len(held) == 6
    assert judge_lib.split_tasks(tasks, 0.3, seed=1) == (train, held)  # seeded
    assert judge_lib.split_tasks(tasks, 0.3, seed=2) != (train, held)
    assert len(judge_lib.split_tasks(["a", "b"], 0.9, seed=0)[0]) == 1  # never all out
    with pytest.raises(judge_lib.JudgeError, match="at least two"):
        judge_lib.split_tasks(["a", "a"], 0.3, seed=0)
    with pytest.raises(judge_lib.JudgeError, match="must be in"):
        judge_lib.split_tasks(tasks, 1.0, seed=0)


# ---- the head ----------------------------------------------------------------------------


def _blobs(n, seed, classes=("a", "b", "c"), weights=(0.5, 0.3, 0.2), dim=24):
    """Gaussian blobs, one per class, a few tasks each of several episodes."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(len(classes), dim)) * 1.5
    y = rng.choice(len(classes), size=n, p=weights)
    x = centres[y] + rng.normal(size=(n, dim))
    groups = [f"g{i // 3}" for i in range(n)]
    return x.astype(np.float32), [classes[i] for i in y], groups


def test_the_head_learns_a_separable_set_and_not_shuffled_labels():
    """Held-out accuracy near 1 on separable classes; trained on shuffled labels the
    same head stays near the majority baseline (the check can fail)."""
    x, y, groups = _blobs(240, seed=0)
    train, _ = judge_lib.split_tasks(groups, 0.3, seed=0)
    tr = np.array([g in set(train) for g in groups])

    def pick(values, mask):
        return [v for v, m in zip(values, mask) if m]

    head, table = judge_lib.train_head("toy", x[tr], pick(y, tr), pick(groups, tr))
    assert head.classes == ("a", "b", "c") and len(table) == 4
    assert all(row["cv_accuracy"] is not None for row in table)
    majority = max(set(pick(y, tr)), key=pick(y, tr).count)
    result = judge_lib.evaluate_head(
        head, x[~tr], pick(y, ~tr), pick(groups, ~tr), majority=majority, min_confidence=0.6
    )
    assert result["accuracy"] >= 0.95, result
    assert 0.35 < result["majority_accuracy"] < 0.65
    low, high = result["accuracy_ci"]
    assert low <= result["accuracy"] <= high and result["gain_ci"][0] > 0
    assert set(result["per_class"]) == {"a", "b", "c"}
    assert sum(sum(row.values()) for row in result["confusion"].values()) == (~tr).sum()
    assert result["coverage"] >= 0.9  # confident and within the training distance
    _, answered = head.answers(x[~tr] + 8.0, min_confidence=0.0)  # unlike the training rows
    assert not answered.any()
    shuffled = list(np.random.default_rng(1).permutation(pick(y, tr)))
    control, _ = judge_lib.train_head("toy", x[tr], shuffled, pick(groups, tr))
    control_acc = np.mean([p == t for p, t in zip(control.predict(x[~tr]), pick(y, ~tr))])
    assert control_acc <= result["majority_accuracy"] + 0.1, control_acc
    with pytest.raises(ValueError, match="one class"):
        judge_lib.train_head("toy", x[:5], ["a"] * 5, groups[:5])


# ---- the command, the saved judge and the hook -------------------------------------------


def test_features_of_the_policy_learn_behaviours_and_a_saved_judge_predicts_the_same(
    chat, policy, tmp_path
):
    """On constructed episodes the policy's pooled features (a random micro model)
    carry the behaviour; save then load gives the same probabilities, event
    trajectories of both formats read, and the helpers for detectors and task
    filtering answer."""
    episodes = _episodes(chat, tasks=30, per_task=2, seed=3)
    data = judge_lib.read_workdirs([os.fspath(_workdir(tmp_path / "run", chat, episodes))], chat)
    features = judge_lib.episode_features(policy, [r.episode.trajectory for r in data.records],
                                          bucket=768)  # fmt: skip
    assert features.shape == (60, policy.feature_dim) and np.isfinite(features).all()
    train, _ = judge_lib.split_tasks(data.tasks, 0.3, seed=0)
    tr = np.array([r.task_id in set(train) for r in data.records])
    heads = {}
    for label in ("category", "resolved"):
        targets = [r.labels[label] for r, keep in zip(data.records, tr) if keep]
        groups = [r.task_id for r, keep in zip(data.records, tr) if keep]
        heads[label], _ = judge_lib.train_head(label, features[tr], targets, groups)
        held = [r.labels[label] for r, keep in zip(data.records, tr) if not keep]
        accuracy = np.mean([p == t for p, t in zip(heads[label].predict(features[~tr]), held)])
        assert accuracy >= 0.85, (label, accuracy)
    out = os.fspath(tmp_path / "judge")
    system = judge_lib.system_prompt_of(chat, (r.episode.trajectory for r in data.records))
    assert system.startswith("Fix it.\n\n")  # the harness's system turn of the episodes
    judge_lib.save(out, policy, heads, settings={"min_confidence": 0.5, "bucket": 768},
                   data={"episodes": 60}, system_prompt=system)  # fmt: skip
    assert sorted(os.listdir(out)) == [
        "head_category.npz", "head_resolved.npz", "judge.json", "tokenizer.json"
    ]  # fmt: skip
    fresh = judge_lib.DerivedJudge(policy, heads, min_confidence=0.5, bucket=768)
    loaded = judge_lib.load(out)
    assert loaded.policy.description["path"] == policy.description["path"]
    episodes = [r.episode for r in data.records[:10]]
    np.testing.assert_allclose(
        loaded.probabilities(episodes, "category"),
        fresh.probabilities(episodes, "category"),
        rtol=1e-5,
        atol=1e-6,
    )
    assert loaded.classes("category") == ("bug_fix", "test_handling", "tool_misuse")
    # Events in both trajectory forms; the verdict is a category or None.
    event = data.records[0].event
    as_messages = ingest.parse_event(
        {"schema_version": 1, "event_id": "m", "rating": "down", "snapshot": {"task_id": "x"},
         "trajectory": {"format": "messages", "messages": [
             {"role": "user", "content": "Fix mod.py."},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"name": "edit_file", "arguments": {"path": "mod.py", "old_str": "a",
                                                     "new_str": "b"}}]},
             {"role": "tool", "content": "ok"},
             {"role": "assistant", "content": "", "tool_calls": [{"name": "submit",
                                                                  "arguments": {}}]}]}},
    )  # fmt: skip
    rendered = judge_lib.event_trajectory(as_messages, loaded.chat, loaded.system_prompt)
    assert sum(rendered.loss_mask) > 0 and len(rendered.segment_starts) == 1
    assert [t.role for t in rendered.turns] == ["system", "user", "assistant", "tool", "assistant"]
    assert loaded.system_prompt == system
    for verdict in loaded.verdicts([event, as_messages]):
        assert verdict is None or verdict in classify.CATEGORIES
    seen = [r for r, keep in zip(data.records, tr) if keep][:8]  # training episodes
    verdicts = loaded.verdicts([r.event for r in seen])
    assert sum(v is not None for v in verdicts) >= 6
    assert all(v in (None, r.labels["category"]) for v, r in zip(verdicts, seen))
    scores = loaded.score(episodes)
    assert scores.shape == (10,) and ((scores >= 0) & (scores <= 1)).all()
    rates = judge_lib.task_pass_rates(loaded, episodes)
    assert set(rates) == {e.task_id for e in episodes}
    assert judge_lib.keep_tasks({"a": 0.0, "b": 0.5, "c": 1.0}) == ["b"]
    detector = judge_lib.as_detector(loaded)
    view = feedback.view(data.records[0].episode, chat)
    hit = detector(view)
    assert hit is None or (hit[0] == view.turns[-1].start and hit[1]["category"] in
                           classify.BEHAVIOURS)  # fmt: skip
    with pytest.raises(KeyError, match="no 'outcome' head"):
        loaded.probabilities(episodes, "outcome")


def test_the_train_command_writes_a_judge_the_outer_loop_can_call(chat, policy, tmp_path):
    """``python -m cursor_rl.outer.judge``: a report with the held-out accuracy against
    the rule labels, the majority baseline and the split's counts; the judge loads
    through ``classify.load_judge`` (factory=DIR) and ``register_judge``, and
    classifies feedback events without an error."""
    episodes = _episodes(chat, tasks=24, per_task=2, seed=5)
    wd = _workdir(tmp_path / "run", chat, evals=episodes[:24], rollouts=episodes[24:])
    out = os.fspath(tmp_path / "judge")
    argv = [
        "judge",
        f"--workdir={wd}",
        f"--out={out}",
        f"--policy={policy.description['path']}",
        "--labels=category,resolved",
        "--bucket=768",
        "--steps=200",
        "--min_confidence=0.5",
    ]
    assert judge_lib.main(argv) == 0
    with open(os.path.join(out, judge_lib.REPORT_JSON)) as f:
        summary = json.load(f)
    data = summary["data"]
    assert data["episodes"] == 48 and data["by_source"] == {"eval": 24, "rollout": 24}
    assert not set(data["train_tasks"]) & set(data["held_out_tasks"])
    assert data["train_episodes"] + data["held_out_episodes"] == 48
    category = summary["labels"]["category"]
    assert category["accuracy"] >= 0.8 and category["accuracy"] > category["majority_accuracy"]
    with open(os.path.join(out, judge_lib.REPORT_MD)) as f:
        report = f.read()
    assert "| **accuracy** |" in report and "majority baseline" in report
    assert "no task on both sides" in report and "shuffled-label control" in report

    judge = classify.load_judge(f"cursor_rl.outer.judge:category_judge={out}")
    assert isinstance(judge, judge_lib.DerivedJudge)
    judge_lib.register("derived-test-judge", out)
    assert isinstance(classify.load_judge("derived-test-judge"), judge_lib.DerivedJudge)
    rows = [
        {"schema_version": 1, "event_id": f"e{i}", "rating": "down",
         "snapshot": {"task_id": e.task_id},
         "trajectory": {"format": "episode", "episode": e.to_json(), "max_turns": 8}}
        for i, e in enumerate(episodes[:6])
    ]  # fmt: skip
    events = [ingest.parse_event(row, chat=chat) for row in rows]
    judged = classify.classify_events(events, judge=judge)
    assert judged.judge_errors == []
    assert judged.judged + judged.judge_abstained == 6 and judged.judged >= 4
    for c in judged.classifications:
        if c.decided_by == "judge":
            assert c.category in classify.CATEGORIES and c.evidence[0].startswith("judge -> ")
    with pytest.raises(ValueError, match=r"category_judge\(.*\) failed: .*not a judge directory"):
        classify.load_judge(f"cursor_rl.outer.judge:category_judge={tmp_path / 'nowhere'}")


# ---- bad inputs --------------------------------------------------------------------------


def test_bad_inputs_are_clear_errors_or_counted_records(chat, policy, tmp_path, capsys):
    """A workdir without episodes, a missing workdir or policy, an unknown label: exit
    2 with a line saying which. Corrupt result lines, a token id of another tokenizer
    and a broken rollout file: bad records named by file and line, counted in the
    report, the other episodes used."""
    path = policy.description["path"]
    empty = _workdir(tmp_path / "empty", chat)
    argv = ["judge", f"--workdir={empty}", f"--out={tmp_path / 'o1'}", f"--policy={path}"]
    assert judge_lib.main(argv) == 2
    assert "no usable episode in" in capsys.readouterr().err
    assert judge_lib.main(["judge", f"--workdir={tmp_path / 'none'}", "--out=x"]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert judge_lib.main(["judge", "--out=x"]) == 2
    assert judge_lib.main(["judge", f"--workdir={empty}", "--out=x", "--labels=vibes"]) == 2
    assert "unknown source or label 'vibes'" in capsys.readouterr().err
    assert judge_lib.main(["judge", f"--workdir={empty}", "--out=x", "--policy=/no/ckpt"]) == 2
    assert "--policy=/no/ckpt" in capsys.readouterr().err

    # Corrupt lines and rollout files: counted, named by file and line, the rest used.
    rng = np.random.default_rng(7)
    episodes = [_recorded(chat, k, f"t{i}", 0, rng) for i, k in enumerate(KINDS * 2)]
    wd = _workdir(tmp_path / "run", chat, evals=episodes[:6], rollouts=episodes[6:])
    results = wd.eval_dir / "tiny_bench" / runner.RESULTS_FILE
    with open(results, "a") as f:
        f.write("{truncated\n")
        row = json.loads(results.read_text().splitlines()[0])
        row["trajectory"]["tokens"][5] = 10**9  # not a token of this tokenizer
        f.write(json.dumps(row) + "\n")
    (wd.rollouts_dir / "000009.json").write_text("not json")
    data = judge_lib.read_workdirs([os.fspath(wd)], chat)
    assert len(data.records) == 8 and len(data.bad) == 3, data.bad
    bad = sorted(data.bad)
    assert bad[0].startswith(f"{results}:7: not a JSON line")
    assert bad[1].startswith(f"{results}:8: ") and "token ids must be integers" in bad[1]
    assert bad[2].startswith(f"{wd.rollouts_dir / '000009.json'}: not a rollout file")
    out = tmp_path / "o2"
    argv = ["judge", f"--workdir={wd}", f"--out={out}", f"--policy={path}", "--bucket=768",
            "--labels=resolved", "--steps=50"]  # fmt: skip
    assert judge_lib.main(argv) in (0, 1)
    report = (out / judge_lib.REPORT_MD).read_text()
    assert "**3 bad records**" in report and f"{results}:7" in report
    with pytest.raises(judge_lib.JudgeError, match="not a judge directory"):
        judge_lib.load(os.fspath(tmp_path / "o1"))
