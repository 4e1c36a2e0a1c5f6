"""Validation: the selection logic (scripted outcomes) and real runs in the harness sandbox."""

import dataclasses
import json
import os
import shutil
import sys

import pytest
from test_tasks_generators import by_description, shapes_repo

from cursor_rl.env import grader, sandbox
from cursor_rl.tasks import build, generators, grading, records, sources, tiny, validation
from cursor_rl.tasks.generators.base import Candidate

needs_sandbox = pytest.mark.skipif(
    sandbox.unavailable_reason() is not None, reason=f"{sandbox.unavailable_reason()}"
)


def _candidate(**overrides) -> Candidate:
    fields = dict(
        generator="flip_comparison",
        category="bug",
        file="geometry.py",
        symbol="clamp",
        start_changes={"geometry.py": "# broken\n"},
        prompt=lambda failures: "fix",
        features={},
    )
    fields.update(overrides)
    return Candidate(**fields)


class ScriptedValidator(validation.RepoValidator):
    """Outcomes come from a script instead of the sandbox (logic tests only)."""

    def __init__(self, script):
        super().__init__(shapes_repo())
        self.script = list(script)  # one {test_id: status} per run_tests call
        self.calls = 0

    def collect(self, tree, hidden):
        return sorted({t for run in self.script for t in run})

    def run_tests(self, start, workspace, hidden, test_ids):
        statuses = self.script[self.calls]
        self.calls += 1
        return {t: grader.TestOutcome(t, statuses.get(t, "not_run"), 0.01, "") for t in test_ids}


P, F = "passed", "failed"


def test_flaky_tests_are_dropped_from_the_baseline_and_candidates():
    v = ScriptedValidator(
        [
            {"a": P, "b": P, "c": P, "flaky": P},  # baseline run 1
            {"a": P, "b": P, "c": P, "flaky": F},  # baseline run 2
            {"a": F, "b": F, "c": F},  # sensitivity probe: the tests notice missing code
            {"a": F, "b": F, "c": P},  # start run 1
            {"a": F, "b": P, "c": P},  # start run 2: b is flaky on the start state
        ]
    )
    assert v.baseline() is None
    assert v.stable == ["a", "b", "c"]
    task = v.validate(_candidate())
    assert isinstance(task, validation.ValidatedTask)
    assert task.fail_to_pass == ["a"] and task.pass_to_pass == ["c"] and task.flaky_dropped == 1


@pytest.mark.parametrize(
    "start_runs, reason",
    [
        ([{"a": P, "b": P}], "no_fail_to_pass"),  # second run skipped: nothing failed
        ([{"a": F, "b": F}, {"a": F, "b": F}], "no_pass_to_pass"),
        ([{"a": F, "b": P}, {"a": P, "b": P}], "flaky"),
        ([{"a": "timeout", "b": P}], "timeout"),
    ],
)
def test_rejections_are_named(start_runs, reason):
    v = ScriptedValidator([{"a": P, "b": P}, {"a": P, "b": P}, {"a": F, "b": P}, *start_runs])
    assert v.baseline() is None
    outcome = v.validate(_candidate())
    assert isinstance(outcome, validation.Rejection) and outcome.reason == reason
    assert outcome.reason in validation.REJECTION_REASONS
    assert v.calls == 3 + len(start_runs)


def test_baseline_without_passing_tests_is_rejected():
    v = ScriptedValidator([{"a": F}, {"a": F}])
    assert v.baseline().reason == "baseline_no_passing_tests"


def test_tests_that_ignore_the_code_reject_the_repository():
    # e.g. `random`: imported at interpreter start-up, so tests never see the copy.
    v = ScriptedValidator([{"a": P}, {"a": P}, {"a": P}])
    assert v.baseline().reason == "tests_ignore_code"
    assert v.stable == []


@needs_sandbox
@pytest.mark.slow
def test_fixture_candidates_validate_in_the_sandbox():
    repo = shapes_repo()
    v = validation.RepoValidator(repo)
    assert v.baseline() is None
    assert len(v.stable) == 8  # every fixture test passes twice
    removed = by_description(generators.get("remove_function_body").fn(repo), ":perimeter")
    task = v.validate(removed)
    assert sorted(task.fail_to_pass) == [
        "test_geometry.FunctionsTest.test_perimeter_empty",
        "test_geometry.FunctionsTest.test_perimeter_square",
        "test_report.DescribeTest.test_triangle",
    ]
    assert "test_geometry.FunctionsTest.test_clamp" in task.pass_to_pass
    untested = _candidate(
        start_changes={
            "geometry.py": repo.tree["geometry.py"] + "\n\ndef unused():\n    return 1\n"
        }
    )
    assert v.validate(untested).reason == "no_fail_to_pass"
    no_import = _candidate(start_changes={"geometry.py": "raise ImportError('gone')\n"})
    assert v.validate(no_import).reason == "no_pass_to_pass"
    renamed = by_description(generators.get("rename_symbol").fn(repo), "clamp")
    task = v.validate(renamed)
    assert sorted(task.fail_to_pass) == [
        "test_refactor_check.RefactorCheck.test_new_name_is_defined",
        "test_refactor_check.RefactorCheck.test_old_name_is_gone",
    ]
    assert len(task.pass_to_pass) == 8


@needs_sandbox
def test_stdlib_task_validates_and_grades(tmp_path):
    repo = sources.stdlib_repo("colorsys")
    v = validation.RepoValidator(repo)
    assert v.baseline() is None
    cand = by_description(generators.get("remove_function_body").fn(repo), ":rgb_to_hls")
    task = v.validate(cand)
    assert isinstance(task, validation.ValidatedTask), task
    record = build.make_record(
        repo, task, split="bench", out=str(tmp_path), snapshot="archive",
        environment=v.environment, runs=2,
    )  # fmt: skip
    assert record.provenance.module == "colorsys" and record.provenance.symbol == "rgb_to_hls"
    assert "test_colorsys.py" not in grading.records.snapshot_tree(record.repo)  # hidden
    spec = grading.prepare_task(record, str(tmp_path / "task"))
    unsolved = grader.grade(spec, spec.pristine_repo)
    assert not unsolved.resolved and not any(unsolved.fail_to_pass.values())
    assert all(unsolved.pass_to_pass.values())
    workspace = str(tmp_path / "ws")
    shutil.copytree(spec.pristine_repo, workspace)
    # The agent's sandbox runs the task's interpreter and cannot see the hidden tests.
    with sandbox.Sandbox(workspace, **grading.sandbox_kwargs(record)) as sb:
        probe = sb.run("python -c 'import platform; print(platform.python_version())'; ls", 60)
    assert probe.stdout.split() == [record.environment["python_version"], "colorsys.py"]
    # The interpreter's own copy of the module and its tests are masked in the sandbox:
    # reading them (or their bytecode) shows nothing of the solution.
    hidden = record.environment["hidden_paths"]
    assert any(p.endswith("/colorsys.py") for p in hidden)
    assert any(p.endswith("/test/test_colorsys.py") for p in hidden)
    with open(next(p for p in hidden if p.endswith("/colorsys.py"))) as f:
        assert "maxc = max(r, g, b)" in f.read()  # on the host the copy is there
    with sandbox.Sandbox(workspace, **grading.sandbox_kwargs(record)) as sb:
        leaked = sb.run(
            "cat " + " ".join(hidden) + "; python -c 'import inspect, colorsys; "
            "print(inspect.getsource(colorsys.rgb_to_hls))' 2>&1; cd /tmp && python -c "
            "'import inspect, colorsys; print(inspect.getsource(colorsys.rgb_to_hls))' 2>&1",
            60,
        )
    assert "maxc" not in leaked.stdout, leaked.stdout  # the body (the workspace has a stub)
    assert "has no attribute 'rgb_to_hls'" in leaked.stdout  # outside it: an empty module
    grading.apply_patch_files(record, workspace)
    with open(os.path.join(workspace, "colorsys.py")) as f:
        assert f.read() == repo.tree["colorsys.py"]
    assert grader.grade(spec, workspace).resolved


def test_solution_patch_round_trips_through_apply(tmp_path):
    from test_tasks_records import make_record

    from cursor_rl.tasks import records

    start = {
        "a.py": "x = 1\ny = 2\n\x0c\nz = 3\n",
        "gone.py": "old\n",
        "tail.py": "no newline at the end",
        "pkg/keep.py": "same\n",
    }
    reference = {
        "a.py": "x = 1\ny = 20\n\x0c\nz = 3\n",
        "new/file.py": "fresh = True\n",
        "tail.py": "no newline at the end, still",
        "pkg/keep.py": "same\n",
    }
    patch = build.solution_patch(start, reference)
    record = make_record(repo=records.archive_snapshot(start), solution_patch=patch)
    workspace = str(tmp_path / "ws")
    records.materialize(record, workspace)
    grading.apply_patch_files(record, workspace)
    assert records.read_tree(workspace) == reference


def test_recorded_interpreter_is_mapped_to_this_machine():
    import platform

    from cursor_rl.tasks import environments

    local = environments.interpreter_environment()
    moved = {
        "python": "/elsewhere/py/bin/python3",
        "python_version": platform.python_version(),
        "readonly_paths": ["/elsewhere/py"],
        "python_path": ["."],
        "hidden_paths": ["/elsewhere/py/lib/python3/colorsys.py", "/usr/lib/x.py"],
    }
    env = environments.resolve(moved)
    assert env["python"] == local["python"] and env["readonly_paths"] == local["readonly_paths"]
    assert env["hidden_paths"] == [
        local["readonly_paths"][0] + "/lib/python3/colorsys.py",
        "/usr/lib/x.py",
    ]
    with pytest.raises(environments.TaskEnvironmentError, match="does not exist here"):
        environments.resolve({**moved, "python_version": "2.7.18"})
    assert environments.resolve({})["python"] == local["python"]


class _Finalized:
    """Garbage whose finalizer runs Python code. Freed by the cycle collector, which runs
    at allocation-heavy moments such as a parse, it lets the interpreter switch threads
    there (in a real build, subprocess objects' finalizers do the same)."""

    def __init__(self):
        self.cycle = self

    def __del__(self):
        sum(range(300))


class _RejectAll:
    """A validator that rejects every candidate without running tests: the build's
    threads then do nothing but generate candidates (which parses Python)."""

    def __init__(self, repo, config=None):
        self.environment, self.baseline_seconds = {}, 0.0

    def baseline(self):
        return None

    def validate(self, candidate):
        return validation.Rejection("no_fail_to_pass")


def _build_rejecting_all(out, workers):
    config = build.BuildConfig(source="tiny", out=str(out), workers=workers)
    build.build(config, log=lambda line: None)
    with open(os.path.join(out, build.REJECTIONS_FILE)) as f:
        return [json.loads(line) for line in f]


def test_parallel_generation_survives_thread_switches_inside_parses(tmp_path, monkeypatch):
    """CPython 3.11 cannot build ``ast`` trees on two threads at once (``build._AST_LOCK``).
    Here finalizers run inside the generators' parses and threads switch every 10 us, so
    without the lock several of these repositories crash ("AST constructor recursion depth
    mismatch"); with it, four threads generate exactly what one does."""
    original = generators.get

    def get(name):
        spec = original(name)

        def generate(repo):
            for _ in range(100):
                _Finalized()
            return spec.fn(repo)

        return dataclasses.replace(spec, fn=generate)

    monkeypatch.setattr(generators, "get", get)
    monkeypatch.setattr(validation, "RepoValidator", _RejectAll)
    repos = [tiny.tiny_repo(seed) for seed in range(24)]
    monkeypatch.setattr(build, "iter_repos", lambda config, failures: iter(repos))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        parallel = _build_rejecting_all(tmp_path / "parallel", workers=4)
    finally:
        sys.setswitchinterval(interval)
    crashed = [r["detail"] for r in parallel if r["reason"] == "crashed"]
    assert not crashed, f"{len(crashed)} repositories crashed; the first: {crashed[0]}"
    serial = _build_rejecting_all(tmp_path / "serial", workers=1)
    key = lambda r: (r["repo"], r["generator"], r["candidate"])
    assert sorted(map(key, parallel)) == sorted(map(key, serial))
    assert {r["repo"] for r in serial} == {repo.name for repo in repos}


@needs_sandbox
@pytest.mark.slow
def test_parallel_build_validates_several_tasks_in_the_sandbox(tmp_path):
    """Two threads validating repositories at once: every repository is built (none
    crashed) and the tasks are validated and distinct."""
    config = build.BuildConfig(
        source="tiny", out=str(tmp_path), split="train", count=6, max_per_repo=2, workers=2,
        generators=("remove_function_body", "off_by_one"),
    )  # fmt: skip
    stats = build.build(config, log=lambda line: None)
    tasks = records.load_tasks(str(tmp_path))
    assert len(tasks) == stats["tasks"] == 6
    assert len({t.task_id for t in tasks}) == 6
    assert len({t.provenance.repo for t in tasks}) >= 3  # several repositories: threads overlap
    assert "crashed" not in stats["rejections"]
    for task in tasks:
        assert task.fail_to_pass and task.pass_to_pass, task.task_id
