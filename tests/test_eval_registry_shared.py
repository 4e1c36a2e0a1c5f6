"""One saturation registry shared by the runs of an experiment (issue 23, item 5).

What is checked: runs share retirements through ``rl.eval.registry``; concurrent
writers (real processes, local and ``gs://``) lose no record and agree on one
retirement; the old single-file registry is still read and extended without being
rewritten; a corrupt record stops the read naming its file; the library default of
eval samples is 16 (tiny keeps 4); and the report's discrimination section (paired
pass@1 differences between checkpoints with bootstrap intervals over tasks).
"""

import itertools
import json
import os
import pathlib
import subprocess
import sys
import time
import types

import pytest

from cursor_rl import config_lib
from cursor_rl.eval import metrics, report, runner
from cursor_rl.eval import registry as registry_lib
from cursor_rl.eval.testing import graded_episode
from cursor_rl.workdir import Workdir, WorkdirError
from tests.fake_gcs import fake_gcs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _summary(pass_at_1, *, bench="shared_bench", stage="rl", step=1):
    return {
        "bench": bench,
        "stage": stage,
        "step": step,
        "k_values": [1, 4],
        "overall": {
            "pass@1": pass_at_1,
            "pass@4": pass_at_1,
            "best_of_4": pass_at_1,
            "tasks": 8,
            "episodes": 32,
        },
    }


# ---- two runs, one registry ---------------------------------------------------------


def test_runs_of_an_experiment_share_retirement_and_history(tmp_path):
    shared = str(tmp_path / "experiment" / "registry")
    run_a = registry_lib.Registry.for_run(str(tmp_path / "run_a"), shared)
    run_b = registry_lib.Registry.for_run(str(tmp_path / "run_b"), shared)
    assert run_a.records_dir == run_b.records_dir  # both write to the shared place
    assert not run_a.record(_summary(0.5, step=10))
    assert run_b.is_active("shared_bench")  # run B sees run A's eval, not saturated
    assert run_b.record(_summary(0.92, step=5))  # run B retires it
    assert not run_a.is_active("shared_bench")  # ... for run A too
    assert not run_a.record(_summary(0.97, step=20))  # history kept, changes nothing

    entry = registry_lib.Registry(shared).benchmarks()["shared_bench"]
    assert [h["run"] for h in entry["history"]] == [
        str(tmp_path / "run_a"),
        str(tmp_path / "run_b"),
        str(tmp_path / "run_a"),
    ]
    assert entry["retired"]["run"] == str(tmp_path / "run_b")
    assert entry["retired"]["pass@1"] == 0.92 and entry["retired"]["step"] == 5
    text = run_a.markdown(history=2)
    assert "| shared_bench | retired | 3 | 0.970 | 0.970 | rl step 5 (" in text
    assert f"in `{tmp_path / 'run_b'}` | 2 |" in text  # retired by run B; two runs recorded
    assert "shared_bench: last 2 of 3 evals" in text

    # Empty rl.eval.registry: each run keeps its own file, as before.
    own = registry_lib.Registry.for_run(str(tmp_path / "run_c"))
    assert os.fspath(own.path) == os.fspath(Workdir(str(tmp_path / "run_c")).registry_file)
    assert own.is_active("shared_bench")
    with pytest.raises(WorkdirError, match="ftp://"):
        registry_lib.Registry.for_run(str(tmp_path / "run_c"), "ftp://host/registry")


def test_each_record_carries_its_own_threshold(tmp_path):
    """Retirement is a function of the records alone: a reader's threshold does not
    re-judge what was recorded."""
    path = str(tmp_path / "registry")
    lenient = registry_lib.Registry(path, threshold=0.5)
    assert lenient.record(_summary(0.6, bench="easy"))
    strict = registry_lib.Registry(path, threshold=0.95)
    assert strict.retired() == ["easy"]  # retired under the writer's 0.5
    assert not strict.record(_summary(0.7, bench="hard"))
    assert registry_lib.Registry(path, threshold=0.5).active() == ["hard"]


# ---- concurrent writers ------------------------------------------------------------------

WRITER = """
import json, os, sys, time
sys.path.insert(0, {root!r})
path, writer, count, go, gcs_root = sys.argv[1:6]
count = int(count)
if gcs_root:
    import fsspec
    from tests.fake_gcs import FakeGcsFileSystem
    FakeGcsFileSystem.root = gcs_root
    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, FakeGcsFileSystem, clobber=True)
from cursor_rl.eval.registry import Registry
registry = Registry(path, run=writer)
open(go + "." + writer, "w").close()  # ready
deadline = time.time() + 60
while not os.path.exists(go) and time.time() < deadline:  # start together
    time.sleep(0.005)
retired_by_me = []
for step in range(count):
    bench = "shared_bench" if step % 2 == 0 else "other_bench"
    score = 0.95 if step == count // 2 else 0.1  # every writer races to retire it
    summary = {{"bench": bench, "stage": "rl", "step": step, "k_values": [1],
               "overall": {{"pass@1": score, "tasks": 4, "episodes": 4}}}}
    if registry.record(summary):
        retired_by_me.append(bench)
print(json.dumps(retired_by_me))
"""


def _run_writers(tmp_path, path, writers, count, gcs_root=""):
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(root=ROOT))
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), path, f"w{w}", str(count), str(go), gcs_root],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(writers)
    ]
    deadline = time.time() + 60
    while time.time() < deadline and not all(
        os.path.exists(f"{go}.w{w}") or procs[w].poll() is not None for w in range(writers)
    ):
        time.sleep(0.01)  # every interpreter started and waits at the line
    go.write_text("go")
    outputs = [p.communicate(timeout=120) for p in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def _check_nothing_lost(registry, writers, count):
    state = registry.benchmarks()
    recorded = {(h["run"], h["step"]) for entry in state.values() for h in entry["history"]}
    assert recorded == {(f"w{w}", s) for w in range(writers) for s in range(count)}
    assert sum(len(e["history"]) for e in state.values()) == writers * count  # no duplicate
    assert len(registry.record_files()) == writers * count
    # The writers really overlapped: their records interleave in write order.
    order = [json.loads(p.read_text())["run"] for p in registry.record_files()]
    switches = sum(a != b for a, b in itertools.pairwise(order))
    assert switches >= writers, order
    # One retirement, the same for every reader: the first 0.95 in record order.
    bench = "shared_bench" if (count // 2) % 2 == 0 else "other_bench"
    entry = state[bench]
    assert entry["status"] == "retired" and entry["retired"]["pass@1"] == 0.95
    first = next(h for h in entry["history"] if h["pass@1"] == 0.95)
    assert entry["retired"]["record"] == first["record"]
    return bench


def test_concurrent_writer_processes_lose_nothing(tmp_path):
    path = str(tmp_path / "shared" / "registry")
    writers, count = 3, 24
    reported = _run_writers(tmp_path, path, writers, count)
    registry = registry_lib.Registry(path)
    bench = _check_nothing_lost(registry, writers, count)
    # A writer that reported the retirement saw its own record first; racing writers
    # may each have seen themselves first for a moment (module docstring, choice 3).
    assert 1 <= sum(bench in r for r in reported) <= writers
    assert registry_lib.Registry(path).benchmarks() == registry.benchmarks()
    leftovers = [n for n in os.listdir(registry.records_dir) if not n.endswith(".json")]
    assert leftovers == []  # no temporary file left behind


def test_concurrent_writers_on_gcs_lose_nothing(tmp_path):
    root = str(tmp_path / "gcs")
    writers, count = 2, 16
    with fake_gcs(root):
        _run_writers(tmp_path, "gs://bucket/exp/registry", writers, count, gcs_root=root)
        registry = registry_lib.Registry("gs://bucket/exp/registry")
        _check_nothing_lost(registry, writers, count)
        assert os.fspath(registry.records_dir) == "gs://bucket/exp/registry/records"
    on_disk = os.listdir(os.path.join(root, "bucket", "exp", "registry", "records"))
    assert len(on_disk) == writers * count


# ---- the old format, corrupt records ------------------------------------------------------

LEGACY = {
    "format": 1,
    "benchmarks": {
        "old_retired": {
            "status": "retired",
            "retired": {"stage": "rl", "step": 9, "date": "2026-01-01T00:00:00+00:00",
                        "time": 1.0, "pass@1": 0.91, "threshold": 0.9},
            "history": [{"stage": "rl", "step": 9, "date": "2026-01-01T00:00:00+00:00",
                         "time": 1.0, "pass@1": 0.91, "k": 4, "pass@k": 1.0,
                         "best_of_k": 1.0, "tasks": 8, "episodes": 32}],
        },
        "old_active": {
            "status": "active",
            "retired": None,
            "history": [{"stage": "sft", "step": 0, "date": "2026-01-01T00:00:00+00:00",
                         "time": 0.5, "pass@1": 0.4, "k": 4, "pass@k": 0.6,
                         "best_of_k": 0.6, "tasks": 8, "episodes": 32}],
        },
    },
}  # fmt: skip


@pytest.mark.parametrize("shared", [False, True])
def test_legacy_single_file_is_read_and_extended_not_rewritten(tmp_path, shared):
    if shared:  # an old run's registry.json copied into a shared registry directory
        legacy = tmp_path / "registry" / "registry.json"
        path = str(tmp_path / "registry")
    else:  # the per-run default path, written by an earlier version
        legacy = tmp_path / "eval" / "registry.json"
        path = str(legacy)
    legacy.parent.mkdir(parents=True)
    legacy.write_text(json.dumps(LEGACY))
    registry = registry_lib.Registry(path)
    assert registry.retired() == ["old_retired"] and registry.active() == ["old_active"]
    assert registry.record(_summary(0.93, bench="old_active", step=30))
    assert not registry.record(_summary(0.99, bench="old_retired", step=31))
    state = registry.benchmarks()
    assert [h["step"] for h in state["old_active"]["history"]] == [0, 30]
    assert state["old_active"]["history"][0]["record"] == "registry.json"
    assert state["old_retired"]["retired"]["step"] == 9  # the stored retirement stands
    assert len(state["old_retired"]["history"]) == 2
    assert json.loads(legacy.read_text()) == LEGACY  # never rewritten


def test_corrupt_record_stops_the_read_and_names_its_file(tmp_path):
    path = str(tmp_path / "registry")
    registry = registry_lib.Registry(path)
    registry.record(_summary(0.3))
    records = tmp_path / "registry" / "records"
    # Not records: a local write in progress and a foreign non-JSON name.
    (records / ".00000000000000000009-x.json.tmp").write_text("{half")
    (records / "README").write_text("notes")
    assert registry.is_active("shared_bench")
    bad = records / "00000000000000000001-host-1-abc.json"
    out_of_range = {"format": 2, "bench": "b", "stage": "rl", "step": 1, "time": 0.0}
    out_of_range.update({"pass@1": 1.5, "threshold": 0.9})
    for content, reason in [
        ("{torn", "not JSON"),
        (json.dumps(out_of_range), '"pass@1" 1.5'),
        (json.dumps({"format": 7}), "format 7"),
    ]:
        bad.write_text(content)
        with pytest.raises(registry_lib.RegistryError, match="corrupt") as err:
            registry.is_active("shared_bench")
        assert str(bad) in str(err.value) and reason in str(err.value)
        assert "move it out of" in str(err.value)
        before = sorted(os.listdir(records))
        with pytest.raises(registry_lib.RegistryError):
            registry.record(_summary(0.95))
        assert sorted(os.listdir(records)) == before  # nothing added to it
        assert bad.read_text() == content  # never overwritten
    # The report still gets written, with the error in the registry section.
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text("")
    text = pathlib.Path(report.write_report(str(workdir), registry_path=path)).read_text()
    assert "Unreadable: eval registry" in text and str(bad) in text


def test_registry_on_gcs(tmp_path):
    with fake_gcs(str(tmp_path / "gcs")):
        registry = registry_lib.Registry.for_run("gs://bucket/run", "gs://bucket/exp/reg")
        assert not registry.record(_summary(0.2, step=1))
        assert registry.record(_summary(0.9, step=2))
        again = registry_lib.Registry("gs://bucket/exp/reg")
        assert again.retired() == ["shared_bench"]
        assert again.benchmarks()["shared_bench"]["retired"]["run"] == "gs://bucket/run"
    assert len(os.listdir(tmp_path / "gcs" / "bucket" / "exp" / "reg" / "records")) == 2


# ---- config -------------------------------------------------------------------------------


def test_eval_config_defaults():
    from configs import small, tiny

    base = config_lib.base_config()
    assert base.rl.eval.samples == 16  # best-of-16 where the budget allows
    assert base.rl.eval.registry == "" and base.rl.eval.retire_at == 0.9
    assert small.get_config().rl.eval.samples == 16
    assert tiny.get_config().rl.eval.samples == 4  # budget-bound on 2 CPU cores
    assert metrics.default_k_values(16) == (1, 2, 4, 8, 16)


# ---- discrimination in the report ----------------------------------------------------------


def test_paired_difference():
    before = {f"t{i}": 0.0 for i in range(20)}
    after = {f"t{i}": 1.0 if i < 12 else 0.0 for i in range(20)}
    diff = metrics.paired_difference(before, after)
    assert diff["tasks"] == 20 and diff["difference"] == pytest.approx(0.6)
    low, high = diff["ci"]
    assert 0 < low < 0.6 < high <= 1 and diff["separated"]
    same = metrics.paired_difference(before, {**before, "t0": 1.0, "t1": -0.0})
    assert same["ci"][0] <= 0 <= same["ci"][1] and not same["separated"]
    # Only shared tasks count; none shared: no comparison.
    assert metrics.paired_difference({"a": 1.0, "b": 0.0}, {"b": 1.0})["tasks"] == 1
    assert metrics.paired_difference({"a": 1.0}, {"b": 1.0}) is None
    rates = metrics.task_pass_rates(
        [
            graded_episode("a", "bug", True),
            graded_episode("a", "bug", False),
            graded_episode("a", "bug", True, finish="lost"),  # not scored
            {"task_id": "b", "finish_reason": "submitted", "resolved": True},
        ]
    )
    assert rates == {"a": 0.5, "b": 1.0}


class _Runner:
    """Task i resolves in its first ``solved[i]`` of the samples."""

    def __init__(self, solved):
        self.solved = solved

    def run(self, tasks, seed=0, group_size=None):
        return [
            graded_episode(t.task_id, "bug", g < self.solved[i], sample=g)
            for i, t in enumerate(tasks)
            for g in range(group_size)
        ]


def test_report_discrimination_between_checkpoints(tmp_path):
    """base, SFT and RL evals through the real eval path (results.jsonl + metrics rows):
    SFT is far above base on 24 tasks, RL equals SFT; the report gives each pair's
    paired difference with its interval and says which it separates."""
    workdir = Workdir(str(tmp_path / "run"))
    tasks = [types.SimpleNamespace(task_id=f"t{i}", category="bug") for i in range(24)]
    plans = {
        ("base", 3): [0] * 24,
        ("sft", 8): [4 if i < 16 else 0 for i in range(24)],
        ("rl", 4): [4 if i < 16 else 0 for i in range(24)],
    }
    rows = []
    for (stage, step), solved in plans.items():
        summary = runner.evaluate(
            _Runner(solved),
            tasks,
            samples=4,
            seed=0,
            bench_name="tiny_bench",
            out_dir=workdir.eval_dir,
            stage=stage,
            step=step,
        )
        rows.append({"stage": stage, "step": step, **runner.eval_row(summary)})
    with open(workdir.metrics_file, "a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
        fh.write('{"torn')
    with open(workdir.eval_dir / "tiny_bench" / "results.jsonl", "a") as fh:
        fh.write('{"torn line')
    text = pathlib.Path(report.write_report(workdir)).read_text()
    section = text.split("### Discrimination between checkpoints")[1].split("\n### ")[0]
    assert "| base → SFT | 24 | 0.000 → 0.667 | +0.667 [" in section
    assert "| SFT → RL | 24 | 0.667 → 0.667 | +0.000 [0.000, 0.000] | no |" in section
    assert "| base → RL | 24 | 0.000 → 0.667 | +0.667 [" in section
    assert "tiny_bench separates base → SFT, base → RL; it does not separate SFT → RL" in section
    assert "1 unreadable line(s) of `eval/tiny_bench/results.jsonl` skipped." in section


def test_report_reads_the_shared_registry_from_the_config(tmp_path):
    workdir = Workdir(str(tmp_path / "run"))
    workdir.root.mkdir(parents=True)
    shared = str(tmp_path / "experiment_registry")
    config = config_lib.base_config()
    config.rl.eval.registry = shared
    workdir.config_file.write_text(config.to_json_best_effort())
    workdir.metrics_file.write_text("")
    registry_lib.Registry.for_run(str(tmp_path / "other_run"), shared).record(_summary(0.95))
    text = pathlib.Path(report.write_report(workdir)).read_text()
    registry_section = text.split("## Benchmark registry")[1]
    assert "| shared_bench | retired | 1 |" in registry_section
    assert shared in registry_section
    assert "No held-out evaluation recorded." in text  # no eval in this run itself
