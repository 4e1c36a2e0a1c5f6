"""The outer loop after classification (cursor_rl.outer.rank, .factory, .run): weak
areas ranked by count and pass@1 from an RL run's eval results; the task factory
turning areas into validated, decontaminated tiny datasets with provenance and a
registry entry; and the one command end to end on the example file."""

import json
import os
import subprocess
import sys
import time

import pytest

from cursor_rl.eval import registry as registry_lib
from cursor_rl.eval import runner
from cursor_rl.eval.testing import graded_episode
from cursor_rl.outer import classify, factory, ingest, rank
from cursor_rl.outer import run as outer_run
from cursor_rl.tasks import build, generators, records, validation
from cursor_rl.workdir import Workdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "cursor_rl", "outer", "example_feedback.jsonl")
BUG_GENERATORS = tuple(generators.names("bug"))


def _record(task_id, generator, split="bench"):
    """A task record for mapping and resolution (never run)."""
    return records.TaskRecord(
        task_id=task_id,
        split=split,
        family="tiny",
        category=generators.get(generator).category,
        generator=generator,
        prompt="Fix.",
        repo=records.archive_snapshot({"m.py": f"# {task_id}\n"}),
        hidden_tests={"test_m.py": "pass\n"},
        setup_commands=[],
        test_framework="unittest",
        test_command="python -m unittest",
        fail_to_pass=["test_m.T.t"],
        pass_to_pass=[],
        solution_patch="",
        difficulty={"patch_lines": 3.0},
        provenance=records.Provenance("tiny", "tiny:1", "m", "m.py", "f"),
        environment={},
        validation={},
    )


def _classification(event_id, category, *, kind="", generator=""):
    return classify.Classification(
        event_id, category, "easy", kind, generator, (), ("test",), "rules", category
    )


class _FakeRunner:
    """Returns chosen outcomes: task id -> list of resolved flags (or "lost")."""

    def __init__(self, outcomes):
        self.outcomes = outcomes

    def run(self, tasks, *, seed, group_size):
        episodes = []
        for task in tasks:
            for sample, outcome in enumerate(self.outcomes[task.task_id]):
                episodes.append(
                    graded_episode(
                        task.task_id,
                        task.category,
                        outcome is True,
                        sample=sample,
                        finish="lost" if outcome == "lost" else "submitted",
                    )
                )
        return episodes


def _fake_run(path, bench, evals, train=()):
    """An RL run's workdir: datasets, config.json and eval results written by the
    real benchmark runner (``evals``: (stage, step, outcomes) in time order)."""
    wd = Workdir(str(path))
    for split, tasks in (("bench", bench), ("train", train)):
        directory = wd.tasks_dir(split)
        os.makedirs(directory, exist_ok=True)
        records.write_tasks(tasks, os.fspath(directory / records.TASKS_FILE))
        (directory / build.STATS_FILE).write_text("{}")
    wd.config_file.write_text(json.dumps({"rl": {"tasks": {"family": "tiny", "bench": ""}}}))
    for stage, step, outcomes in evals:
        runner.evaluate(
            _FakeRunner(outcomes),
            bench,
            samples=4,
            seed=0,
            bench_name="tiny_bench",
            out_dir=wd.eval_dir,
            stage=stage,
            step=step,
        )
        time.sleep(0.01)  # distinct eval times
    return wd


# ---- ranking -------------------------------------------------------------------------------


def test_eval_results_of_the_current_checkpoint_are_read_per_task(tmp_path):
    """The latest eval is the current checkpoint (or the one named); lost episodes are
    not scored, episodes of tasks no dataset holds and unreadable lines are counted."""
    bench = [_record("b1", "off_by_one"), _record("b2", "remove_function_body")]
    wd = _fake_run(
        tmp_path,
        bench,
        [
            ("sft", 10, {"b1": [False] * 4, "b2": [True] * 4}),
            ("rl", 20, {"b1": [True, False, False, "lost"], "b2": [True, True, False, False]}),
        ],
    )
    with open(wd.eval_dir / "tiny_bench" / runner.RESULTS_FILE, "a") as f:
        f.write("{truncated\n")
        f.write(json.dumps({"stage": "rl", "step": 20, "time": 1.0, "task_id": "zz",
                            "resolved": True, "finish_reason": "submitted"}) + "\n")  # fmt: skip
    tasks = classify.task_index([os.fspath(wd.tasks_dir("bench"))])
    results = rank.load_results(wd.eval_dir, tasks)
    assert results.label == "rl:20" and results.checkpoints == ["sft:10", "rl:20"]
    assert results.outcomes == {"b1": (3, 1), "b2": (4, 2)}
    assert (results.lost, results.unmapped) == (1, 1)
    assert len(results.bad_lines) == 1 and ":17: JSONDecodeError" in results.bad_lines[0]
    value, ci, n = results.pass_at_1(["b1", "b2"])
    assert value == pytest.approx((1 / 3 + 2 / 4) / 2) and n == 2
    assert ci[0] <= value <= ci[1]
    earlier = rank.load_results(wd.eval_dir, tasks, checkpoint="sft:10")
    assert earlier.outcomes == {"b1": (4, 0), "b2": (4, 4)}
    with pytest.raises(ValueError, match="no eval results"):
        rank.load_results(wd.eval_dir, tasks, checkpoint="rl:99")
    assert rank.load_results(tmp_path / "nothing", tasks) is None


def test_areas_rank_by_count_then_pass_at_1_and_map_to_generators():
    """More events first; at equal counts the lower pass@1 (on bench tasks of the
    area's generators) first; kind areas map to their kind's generators, behaviour
    areas to their events' tasks or kinds; ``other`` is never selected."""
    classifications = [
        _classification("1", "bug_fix", kind="bug"),
        _classification("2", "bug_fix", kind="bug"),
        _classification("3", "test_handling", kind="feature", generator="remove_function_body"),
        _classification("4", "test_handling", kind="bug"),
        _classification("5", "other"),
        _classification("6", "other"),
        _classification("7", "other"),
        _classification("8", "style"),
    ]
    results = rank.CheckpointResults(
        eval_dir="x",
        stage="rl",
        step=5,
        benches=["b"],
        outcomes={"bug1": (4, 1), "bug2": (4, 1), "feat": (4, 4)},
        generator_of={
            "bug1": "off_by_one",
            "bug2": "drop_condition",
            "feat": "remove_function_body",
        },
    )
    areas = rank.weak_areas(classifications, results)
    assert [a.name for a in areas] == ["other", "bug_fix", "test_handling", "style"]
    by_name = {a.name: a for a in areas}
    assert by_name["bug_fix"].generators == BUG_GENERATORS
    assert (
        by_name["bug_fix"].pass_at_1 == pytest.approx(0.25) and by_name["bug_fix"].bench_tasks == 2
    )
    assert by_name["test_handling"].generators == tuple(
        sorted({"remove_function_body", *BUG_GENERATORS})
    )
    assert by_name["test_handling"].pass_at_1 == pytest.approx(0.5)
    assert by_name["style"].generators == tuple(generators.names())  # nothing known: all
    assert by_name["test_handling"].task_kinds == {"feature": 1, "bug": 1}
    assert [a.name for a in rank.select(areas, 2)] == ["bug_fix", "test_handling"]
    # by pass@1: 0.25, then the three areas at 0.5 by their counts
    assert [a.name for a in rank.by_pass_at_1(areas)] == [
        "bug_fix",
        "other",
        "test_handling",
        "style",
    ]
    # without results: by count, then name
    assert [a.name for a in rank.weak_areas(classifications)][1:3] == ["bug_fix", "test_handling"]


# ---- the task factory ----------------------------------------------------------------------


def test_generators_without_candidates_on_tiny_are_dropped_before_building():
    """Tiny modules have no classes: a build restricted to remove_class would look for
    candidates forever, so it is dropped (and said why) before any build starts."""
    kept, dropped = factory.usable_generators(
        ("remove_class", "remove_function_body"), factory.FactoryConfig(), "train", 100_000
    )
    assert kept == ("remove_function_body",)
    assert "no candidate on 8 tiny train modules" in dropped["remove_class"]


def test_weak_areas_become_validated_decontaminated_tasks_with_provenance(tmp_path, monkeypatch):
    """One area on the tiny family: the task factory's own build makes its train set,
    then its bench set decontaminated against the existing and new training tasks;
    the records load (validated: FAIL_TO_PASS tests, sandbox timings), provenance.json
    names the area and its events, and the bench is in the registry."""
    existing = tmp_path / "run_train"
    os.makedirs(existing)
    records.write_tasks([_record("old-1", "off_by_one", "train")], str(existing / "tasks.jsonl"))
    feedback = ingest.load_feedback(EXAMPLE)
    area = rank.WeakArea("bug_fix", ["fb-0001", "fb-0002"], {"easy": 2}, {"bug": 2}, BUG_GENERATORS)
    configs = []
    real_build = build.build

    def spy(config, **kwargs):
        configs.append(config)
        return real_build(config, **kwargs)

    monkeypatch.setattr(build, "build", spy)
    registry = registry_lib.Registry(str(tmp_path / "registry.json"))
    out = str(tmp_path / "tasks")
    config = factory.FactoryConfig(
        train_per_area=1, bench_per_area=1, reference_train=(str(existing),)
    )
    (result,) = factory.build_areas(
        [area], out, config, feedback=feedback, registry=registry, log=lambda _: None
    )
    assert result.problems == [] and (result.train_tasks, result.bench_tasks) == (1, 1)
    train_cfg, bench_cfg = configs
    assert (train_cfg.split, train_cfg.generators, train_cfg.decontaminate_against) == (
        "train",
        BUG_GENERATORS,
        "",
    )
    assert bench_cfg.split == "bench" and bench_cfg.decontaminate_threshold == 0.99
    reference = [t.task_id for t in records.load_tasks(bench_cfg.decontaminate_against)]
    new_train = records.load_tasks(result.train_dir)
    assert reference == ["old-1", *(t.task_id for t in new_train)]
    for directory, split in ((result.train_dir, "train"), (result.bench_dir, "bench")):
        (task,) = records.load_tasks(directory)
        assert task.split == split and task.generator in BUG_GENERATORS
        assert task.fail_to_pass and task.validation["runs"] == 2
        seed = int(task.provenance.repo.split(":")[1])
        assert seed >= factory.OUTER_SEED_BASE + (1_000_000 if split == "bench" else 0)
        with open(os.path.join(directory, factory.PROVENANCE_FILE)) as f:
            provenance = json.load(f)
        assert provenance["weak_area"] == "bug_fix" and provenance["split"] == split
        assert provenance["event_ids"] == ["fb-0001", "fb-0002"]
        assert provenance["feedback"]["sha256"] == feedback.sha256
        assert provenance["task_ids"] == [task.task_id]
        assert provenance["bench"] == result.bench_name
    assert set(validation.REJECTION_REASONS) >= set(result.bench_stats["rejections"])
    assert provenance["decontaminated_against"] == bench_cfg.decontaminate_against
    assert result.registered and result.bench_name.startswith("outer-bug_fix-")
    entry = registry.benchmarks()[result.bench_name]
    assert registry.is_active(result.bench_name)
    assert [(h["stage"], h["tasks"], h["pass@1"]) for h in entry["history"]] == [("outer", 1, None)]


# ---- the one command ------------------------------------------------------------------------


def test_the_command_runs_the_outer_loop_on_the_example_file(tmp_path, capsys):
    """End to end with an RL run's eval results: ingest, classify (snapshot tasks
    resolved from the run's datasets), rank by count and the current checkpoint's
    pass@1, build tasks for the top area, register its bench, write the report; the
    run's workdir is only read."""
    bench = [
        _record("tiny-1000101-off_by_one-3f2a9c1d7e", "off_by_one"),
        _record("b-bug", "flip_comparison"),
        _record("tiny-1000101-remove_function_body-51c0d7e2b3", "remove_function_body"),
        _record("b-ref", "rename_symbol"),
    ]
    outcomes = {
        "tiny-1000101-off_by_one-3f2a9c1d7e": [False] * 4,
        "b-bug": [True, False, False, False],
        "tiny-1000101-remove_function_body-51c0d7e2b3": [True, True, False, False],
        "b-ref": [True] * 4,
    }
    run_dir = _fake_run(tmp_path / "run", bench, [("rl", 20, outcomes)])
    out = tmp_path / "outer"
    code = outer_run.main(
        [
            "run",
            f"--feedback={EXAMPLE}",
            f"--workdir={out}",
            f"--eval_workdir={run_dir}",
            "--top_areas=1",  # two areas build side by side: see the factory tests
            "--train_per_area=1",
            "--bench_per_area=1",
        ]
    )
    assert code == 0, capsys.readouterr().out
    with open(out / "outer_summary.json") as f:
        summary = json.load(f)
    assert summary["status"] == "ok" and summary["problems"] == []
    assert summary["feedback"]["events"] == 15 and summary["feedback"]["bad_rows"] == []
    assert summary["eval"]["checkpoint"] == "rl:20" and summary["eval"]["tasks"] == 4
    areas = {a["name"]: a for a in summary["areas"]}
    assert areas["bug_fix"]["pass_at_1"] == pytest.approx(0.125)  # (0 + 1/4) / 2
    assert areas["refactor"]["pass_at_1"] == pytest.approx(1.0)
    # bug_fix and test_handling have 3 events each; bug_fix's pass@1 is the lower
    assert [a["name"] for a in summary["areas"][:2]] == ["bug_fix", "test_handling"]
    assert areas["test_handling"]["pass_at_1"] == pytest.approx(0.25)  # bug and feature tasks
    assert summary["selected"] == ["bug_fix"]
    # fb-0001 and fb-0004 resolve to the run's bench tasks; 3, 6, 10 name source trees
    unresolved = ["fb-0002", "fb-0005", "fb-0007", "fb-0008", "fb-0009", "fb-0011", "fb-0012"]
    assert summary["classification"]["unresolved_tasks"] == [*unresolved, "fb-0013"]
    fb1 = next(e for e in summary["events"] if e["event_id"] == "fb-0001")
    assert fb1["generator"] == "off_by_one"  # resolved from the run's bench dataset
    registry = registry_lib.Registry(str(out / outer_run.REGISTRY_FILE))
    for b in summary["builds"]:
        assert (b["train_tasks"], b["bench_tasks"]) == (1, 1) and b["registered"]
        assert registry.is_active(b["bench_name"])
        assert os.path.exists(os.path.join(b["bench_dir"], factory.PROVENANCE_FILE))
    report = (out / "outer_report.md").read_text()
    assert "Current checkpoint **rl:20**" in report
    assert "| 1 | bug_fix | 3 |" in report and "0.125" in report
    assert "`outer-bug_fix-" in report and "(registered)" in report
    assert not os.path.exists(Workdir(str(run_dir)).registry_file)  # the run is only read


def test_the_command_reports_bad_rows_and_usage_errors(tmp_path):
    """As a process: bad rows are listed with their lines in the report (exit 0: the
    good rows were used); a file of bad rows only exits 1; a missing file exits 2."""
    with open(EXAMPLE) as f:
        good = f.read().splitlines()[:3]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join([good[0], "{oops", good[1], '{"event_id": "x"}', good[2]]) + "\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "cursor_rl.outer.run", "--nobuild"]
    done = subprocess.run(
        [*command, f"--feedback={mixed}", f"--workdir={tmp_path / 'a'}"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "3 valid events (3 negative), 2 bad rows" in done.stdout
    report = (tmp_path / "a" / "outer_report.md").read_text()
    assert "| 2 | - | not valid JSON" in report
    assert "| 4 | x | missing field 'schema_version' |" in report
    bad_only = tmp_path / "bad.jsonl"
    bad_only.write_text("{oops\n")
    done = subprocess.run(
        [*command, f"--feedback={bad_only}", f"--workdir={tmp_path / 'b'}"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert json.loads((tmp_path / "b" / "outer_summary.json").read_text())["problems"] == [
        f"no valid event in {bad_only}"
    ]
    assert outer_run.main(["run", f"--feedback={tmp_path / 'none.jsonl'}", "--workdir=x"]) == 2
    assert outer_run.main(["run", f"--feedback={bad_only}"]) == 2


def test_a_failing_build_is_a_problem_of_its_area_only(tmp_path, monkeypatch):
    """One area's build raising leaves that area with a problem (no bench, no
    registry entry) while the other area's datasets, provenance and entry are made."""

    def fake_build(config, **_):
        if "style" in config.out:
            raise RuntimeError("sandbox unavailable")
        os.makedirs(config.out, exist_ok=True)
        task = _record(f"new-{config.split}", "off_by_one", config.split)
        records.write_tasks([task], os.path.join(config.out, records.TASKS_FILE))
        return {"tasks": 1, "rejections": {}}

    monkeypatch.setattr(build, "build", fake_build)
    areas = [
        rank.WeakArea(name, [f"e-{name}"], {"easy": 1}, {"bug": 1}, BUG_GENERATORS)
        for name in ("style", "bug_fix")
    ]
    registry = registry_lib.Registry(str(tmp_path / "registry.json"))
    feedback = ingest.load_feedback(EXAMPLE)
    style, bug_fix = factory.build_areas(
        areas, str(tmp_path), factory.FactoryConfig(), feedback=feedback, registry=registry,
        log=lambda _: None,
    )  # fmt: skip
    assert style.problems == ["the train build failed: RuntimeError('sandbox unavailable')"]
    assert style.bench_stats is None and not style.registered
    assert bug_fix.problems == [] and bug_fix.registered
    assert sorted(registry.benchmarks()) == [bug_fix.bench_name]
    assert not os.path.exists(os.path.join(style.train_dir, factory.PROVENANCE_FILE))
