"""Contamination check: n-gram overlap with a corpus and with training tasks, and its verdict."""

import json

from test_tasks_records import make_record

from cursor_rl.tasks import contamination, records

SOLUTION = (
    "    width = self.width - len(indent)\n"
    "    while chunks and len(chunks[-1]) <= width:\n"
    "        cur_line.append(chunks.pop())\n"
    "    return cur_line\n"
)


def task_with_solution(task_id: str, solution: str, **overrides) -> records.TaskRecord:
    patch = "--- a/m.py\n+++ b/m.py\n@@ -1,1 +1,4 @@\n" + "".join(
        "+" + line + "\n" for line in solution.rstrip("\n").split("\n")
    )
    return make_record(task_id=task_id, solution_patch=patch, **overrides)


def test_tokens_and_ngrams():
    assert contamination.code_tokens("x = a[-1]  # c\n# only a comment\ny") == [
        "x", "=", "a", "[", "-", "1", "]", "#", "c", "y",
    ]  # fmt: skip
    assert contamination.ngrams(["a", "b", "c"], 2) == {("a", "b"), ("b", "c")}
    assert contamination.ngrams(["a"], 2) == {("a",)}
    assert contamination.solution_text(task_with_solution("t", "x = 1")) == "x = 1"


def test_copied_solution_is_flagged_and_unrelated_code_is_not(tmp_path):
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "vendored.py").write_text(
        "def f(self, chunks, cur_line, indent):\n" + SOLUTION
    )
    (tmp_path / "clean").mkdir()
    (tmp_path / "clean" / "other.py").write_text("def g(x):\n    return [y * 2 for y in x]\n")
    bench = [task_with_solution("bench-1", SOLUTION)]
    copied = contamination.check(bench, corpus=[f"files:{tmp_path}/copy"], threshold=0.5)
    assert copied["rows"][0]["corpus_overlap"] == 1.0
    assert copied["rows"][0]["corpus_best_match"].endswith("vendored.py")
    assert copied["flagged"] == ["bench-1"]
    clean = contamination.check(bench, corpus=[f"files:{tmp_path}/clean"], threshold=0.5)
    assert clean["rows"][0]["corpus_overlap"] == 0.0 and clean["flagged"] == []
    # Half the solution copied: half the n-grams... roughly, and below a 0.9 threshold.
    half = SOLUTION.split("\n")[:2]
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "part.py").write_text("\n".join(half) + "\n")
    partial = contamination.check(bench, corpus=[f"files:{tmp_path}/half"], threshold=0.9)
    assert 0.2 < partial["rows"][0]["corpus_overlap"] < 0.9 and partial["flagged"] == []


def test_training_tasks_are_compared_too():
    bench = [task_with_solution("bench-1", SOLUTION), task_with_solution("bench-2", "return x + 7")]
    train = [
        task_with_solution("train-1", "y = 0\n" + SOLUTION),
        task_with_solution("train-2", "def h(x):\n    return x + 7\n"),
    ]
    report = contamination.check(bench, train=train, threshold=0.5)
    rows = {r["task_id"]: r for r in report["rows"]}
    assert rows["bench-1"]["train_tasks_overlap"] == 1.0
    assert rows["bench-1"]["train_tasks_best_match"] == "train-1:solution"
    # A solution shorter than n tokens counts when its whole token sequence occurs.
    assert rows["bench-2"]["train_tasks_overlap"] == 1.0
    assert sorted(report["flagged"]) == ["bench-1", "bench-2"]


def test_command_line_report_and_exit_code(tmp_path):
    bench_dir, train_dir = tmp_path / "bench", tmp_path / "train"
    bench_dir.mkdir()
    train_dir.mkdir()
    records.write_tasks([task_with_solution("b", SOLUTION)], str(bench_dir / "tasks.jsonl"))
    records.write_tasks([task_with_solution("t", "z = 1\n")], str(train_dir / "tasks.jsonl"))
    report = tmp_path / "report.json"
    argv = ["c", f"--bench={bench_dir}", f"--train={train_dir}", f"--report={report}"]
    assert contamination.main(argv) == 0
    assert json.loads(report.read_text())["tasks"] == 1
    records.write_tasks([task_with_solution("t", SOLUTION)], str(train_dir / "tasks.jsonl"))
    assert contamination.main(argv) == 1


def test_reference_index_checks_one_task_at_a_time():
    index = contamination.ReferenceIndex(
        ["def f(x):\n" + SOLUTION, "def g(x):\n    return x + 7\n"]
    )
    assert index.overlap(task_with_solution("a", SOLUTION)) == 1.0
    assert index.overlap(task_with_solution("b", "return x + 7")) == 1.0
    assert index.overlap(task_with_solution("c", "return x + 8")) == 0.0
    assert (
        index.overlap(task_with_solution("d", "total = sum(v for v in values if v > limit)")) == 0.0
    )


def test_array_record_corpus_is_read_without_jax(tmp_path):
    import subprocess
    import sys

    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "shard.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    for i, text in enumerate(["def f(self, chunks, cur_line, indent):\n" + SOLUTION, "y = 2"]):
        writer.write(json.dumps({"text": text, "id": str(i)}).encode())
    writer.close()
    docs = list(contamination.corpus_documents(f"array_record:{path}"))
    assert [d[0] for d in docs] == [f"{path}:0", f"{path}:1"]
    report = contamination.check(
        [task_with_solution("b", SOLUTION)], corpus=[f"array_record:{path}"]
    )
    assert report["rows"][0]["corpus_overlap"] == 1.0
    code = (
        "import sys\nfrom cursor_rl.tasks import contamination\n"
        f"list(contamination.corpus_documents('array_record:{path}'))\n"
        "print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
