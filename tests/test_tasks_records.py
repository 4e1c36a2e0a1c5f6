"""Task records: JSONL round trip, snapshots pinned by hash, errors that name the field."""

import json
import os

import pytest

from cursor_rl.tasks import records

TREE = {"pkg/mod.py": "def f():\n    return 1\n", "README": "hello\x0cworld\n"}


def make_record(**overrides) -> records.TaskRecord:
    fields = dict(
        task_id="t-1",
        split="train",
        family="stdlib",
        category="bug",
        generator="flip_comparison",
        prompt="Fix it.",
        repo=records.archive_snapshot(TREE),
        hidden_tests={"test_mod.py": "import unittest\n"},
        setup_commands=[],
        test_framework="unittest",
        test_command="python -m unittest test_mod",
        fail_to_pass=["test_mod.T.test_a"],
        pass_to_pass=["test_mod.T.test_b"],
        solution_patch="",
        difficulty={"lines_changed": 1.0},
        provenance=records.Provenance("stdlib", "cpython-3.11", "mod", "pkg/mod.py", "f"),
        environment={"python": "/usr/bin/python3"},
        validation={"seconds": 0.5},
    )
    fields.update(overrides)
    return records.TaskRecord(**fields)


def test_jsonl_round_trip(tmp_path):
    record = make_record()
    path = str(tmp_path / "tasks.jsonl")
    assert records.write_tasks([record, make_record(task_id="t-2")], path) == 2
    loaded = records.load_tasks(str(tmp_path))  # a dataset directory works too
    assert loaded[0] == record
    assert [r.task_id for r in loaded] == ["t-1", "t-2"]
    with open(path) as f:
        line = json.loads(f.readline())
    assert line["schema_version"] == records.SCHEMA_VERSION
    assert line["provenance"]["symbol"] == "f" and "fail_to_pass" in line


def test_archive_snapshot_is_deterministic_and_checked(tmp_path):
    a, b = records.archive_snapshot(TREE), records.archive_snapshot(dict(reversed(TREE.items())))
    assert a == b
    assert records.snapshot_tree(a) == TREE
    records.materialize(make_record(), str(tmp_path / "ws"))
    assert (tmp_path / "ws" / "pkg" / "mod.py").read_text() == TREE["pkg/mod.py"]
    other = records.archive_snapshot({"pkg/mod.py": "tampered\n"})
    forged = records.Snapshot("archive", a.tree_sha256, data=other.data)
    with pytest.raises(records.TaskRecordError, match="tree_sha256"):
        records.snapshot_tree(forged)


def test_dir_snapshot_matches_archive_hash(tmp_path):
    snap = records.dir_snapshot(TREE, str(tmp_path), "repos/t-1")
    assert snap.tree_sha256 == records.archive_snapshot(TREE).tree_sha256
    assert records.snapshot_tree(snap, str(tmp_path)) == TREE


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.pop("fail_to_pass"), "missing field 'fail_to_pass'"),
        (lambda r: r.update(fail_to_pass="test_a"), "field 'fail_to_pass' must be"),
        (lambda r: r.update(fail_to_pass=[]), "field 'fail_to_pass' must be"),
        (lambda r: r.update(category="typo"), "field 'category'"),
        (lambda r: r["provenance"].pop("module"), "field 'provenance.module'"),
        (lambda r: r["repo"].update(format="zip"), "field 'repo.format'"),
        (lambda r: r.update(schema_version=99), "field 'schema_version' is 99"),
        (lambda r: r.update(extra=1), "unknown field 'extra'"),
        (lambda r: r["difficulty"].update(lines=True), "field 'difficulty'"),
    ],
)
def test_malformed_record_names_record_and_field(tmp_path, mutate, message):
    good = make_record().to_json()
    bad = make_record(task_id="broken-7").to_json()
    mutate(bad)
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(records.TaskRecordError) as err:
        records.load_tasks(str(path))
    assert f"{path}:2" in str(err.value)
    assert "broken-7" in str(err.value)
    assert message in str(err.value)


def test_bad_json_line_is_named(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(make_record().to_json()) + "\n{not json\n")
    with pytest.raises(records.TaskRecordError, match=r"tasks.jsonl:2: not valid JSON"):
        records.load_tasks(str(path))


def test_unsafe_paths_are_refused(tmp_path):
    for bad in ("../escape.py", "/etc/passwd", "a/../../b"):
        with pytest.raises(records.TaskRecordError, match="unsafe path"):
            records.write_tree({bad: "x"}, str(tmp_path))
    assert not os.path.exists(tmp_path.parent / "escape.py")


def test_split_lines_keeps_form_feeds_inside_lines():
    assert records.split_lines("a\x0cb\nc") == ["a\x0cb\n", "c"]
    assert records.split_lines("a\n") == ["a\n"]


def test_solve_rates_are_attached_in_place(tmp_path):
    records.write_tasks([make_record(), make_record(task_id="t-2")], str(tmp_path / "tasks.jsonl"))
    assert records.attach_solve_rates(str(tmp_path), {"t-2": (3, 4), "missing": (1, 1)}) == 1
    first, second = records.load_tasks(str(tmp_path))
    assert "solve_rate" not in first.difficulty
    assert second.difficulty["solve_rate"] == 0.75 and second.difficulty["solve_attempts"] == 4.0
    assert second.difficulty["lines_changed"] == 1.0  # static features stay
