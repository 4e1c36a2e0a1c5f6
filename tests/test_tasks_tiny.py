"""The tiny family: seeded generation, tiny size, and the same build/grade path as real tasks."""

import ast
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from cursor_rl.data import splits, tiny_modules
from cursor_rl.env import grader, sandbox
from cursor_rl.tasks import build, contamination, grading, records, tiny

needs_sandbox = pytest.mark.skipif(
    sandbox.unavailable_reason() is not None, reason=f"{sandbox.unavailable_reason()}"
)


def test_generation_is_seeded_and_varied():
    assert tiny.tiny_repo(7).tree == tiny.tiny_repo(7).tree
    sources = {next(iter(tiny.tiny_repo(s).tree.values())) for s in range(300)}
    assert len(sources) == 300
    assert len(tiny_modules.TEMPLATES) >= 25


@pytest.mark.parametrize("seed", [0, 1, 2, 1_000_003])
def test_modules_are_tiny_and_their_tests_pass(seed, tmp_path):
    repo = tiny.tiny_repo(seed)
    (code_path,) = repo.target_files
    module = ast.parse(repo.tree[code_path])
    functions = [n for n in module.body if isinstance(n, ast.FunctionDef)]
    assert 3 <= len(functions) <= 6
    for fn in functions:
        assert ast.get_docstring(fn)  # the docstring is the specification
        assert 1 <= len(fn.body) - 1 <= 5
    assert len(repo.tree[code_path]) < 1200
    for path, text in repo.tree.items():
        (tmp_path / path).write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "unittest", "-v", repo.test_files[0][:-3]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(" ok\n") == 2 * len(functions)


def test_split_ranges_are_enforced():
    tiny.tiny_repo(5, split="train")
    with pytest.raises(ValueError, match="bench"):
        tiny.tiny_repo(5, split="bench")
    first_bench = next(tiny.tiny_repos("bench"))
    assert first_bench.name == f"tiny-{splits.TINY_BENCH_SEEDS.start:07d}"


@needs_sandbox
@pytest.mark.slow
def test_tiny_build_produces_gradable_short_tasks(tmp_path):
    out = str(tmp_path / "tiny")
    argv = ["build", "--source=tiny", "--split=train", f"--out={out}", "--count=4"]
    argv += ["--max_per_repo=4", "--workers=1", "--generators=remove_function_body,off_by_one"]
    assert build.main(argv) == 0
    tasks = records.load_tasks(out)
    assert len(tasks) == 4
    assert {t.category for t in tasks} == {"feature", "bug"}
    for task in tasks:
        assert task.family == "tiny" and task.split == "train"
        assert len(task.prompt) < 400, task.prompt
        assert task.validation["test_seconds"] < 0.5
    # The record grades through the harness: unsolved fails, the reference resolves.
    task = tasks[0]
    spec = grading.prepare_task(task, str(tmp_path / "task"))
    assert not grader.grade(spec, spec.pristine_repo).resolved
    workspace = str(tmp_path / "ws")
    shutil.copytree(spec.pristine_repo, workspace)
    grading.apply_patch_files(task, workspace)
    assert grader.grade(spec, workspace).resolved
    # Decontamination: against these tasks as the training set, the same module's
    # solutions are rejected during the build, before they count.
    reference = contamination.ReferenceIndex(
        text for t in tasks for _, text in contamination.task_documents(t)
    )
    config = build.BuildConfig(
        source="tiny", out=str(tmp_path / "again"), generators=("remove_function_body",),
        max_per_generator=1, max_attempts=1,
    )  # fmt: skip
    again = build.build_repo(
        tiny.tiny_repo(0), config, seen=set(), lock=threading.Lock(), reference=reference
    )
    assert again.tasks == [] and [r["reason"] for r in again.rejections] == ["contaminated"]


def _recording_build(seen):
    """A stand-in for ``build.build`` that records each config and leaves an empty,
    finished dataset (so ``ensure_datasets`` treats it as built)."""

    def fake_build(config, log):
        seen.append(config)
        os.makedirs(config.out, exist_ok=True)
        for name in (build.STATS_FILE, records.TASKS_FILE):
            open(os.path.join(config.out, name), "w").close()

    return fake_build


def test_run_datasets_pass_the_generator_choice_to_the_build(tmp_path, monkeypatch):
    """``rl.tasks.generators`` / ``max_per_generator`` reach the task factory, and a
    finished build is reused instead of rebuilt."""
    from cursor_rl.tasks import workdir

    seen = []

    monkeypatch.setattr(build, "build", _recording_build(seen))
    kwargs = dict(generators=("remove_function_body",), max_per_generator=4, log=lambda _: None)
    workdir.ensure_datasets(str(tmp_path), **kwargs)
    assert [(c.split, c.generators, c.max_per_generator) for c in seen] == [
        ("train", ("remove_function_body",), 4),
        ("bench", ("remove_function_body",), 4),
    ]
    workdir.ensure_datasets(str(tmp_path), **kwargs)
    assert len(seen) == 2


def test_the_bench_is_checked_against_the_familys_own_pretraining_corpus(tmp_path, monkeypatch):
    """A run that pretrains on tiny modules has its bench decontaminated against them
    (the training split never is), and only the family's own corpus specs are used."""
    from cursor_rl.tasks import workdir

    assert workdir.family_corpus(("stdlib", "tiny:64", "files:x/*.py", "tiny"), "tiny") == (
        "tiny:64",
        "tiny",
    )
    assert workdir.family_corpus(("stdlib",), "tiny") == ()
    seen = []

    monkeypatch.setattr(build, "build", _recording_build(seen))
    workdir.ensure_datasets(str(tmp_path), decontaminate_corpus=("tiny:64",), log=lambda _: None)
    assert [(c.split, c.decontaminate_corpus) for c in seen] == [
        ("train", ()),
        ("bench", ("tiny:64",)),
    ]
    assert seen[1].decontaminate_against == seen[0].out
    # The RL loop passes the run's own data.sources.
    from cursor_rl import config_lib
    from cursor_rl.rl import loop

    cfg = config_lib.base_config()
    cfg.data.sources = ("stdlib", "tiny:64")
    seen.clear()
    loop.task_datasets(cfg, str(tmp_path / "run"))
    assert [c.decontaminate_corpus for c in seen] == [(), ("tiny:64",)]


@needs_sandbox
def test_a_bench_build_drops_candidates_found_in_the_pretraining_corpus(tmp_path):
    """``decontaminate_corpus`` reaches the build: a bench module whose code is in the
    corpus gives no task (its candidates are rejected as contaminated); the next gives one."""
    first, second = (tiny.tiny_repo(s) for s in splits.tiny_seeds("bench")[:2])
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path, text in first.tree.items():
        (corpus / path).write_text(text)
    out = str(tmp_path / "bench")
    build.build(
        build.BuildConfig(
            source="tiny", out=out, split="bench", count=1, generators=("remove_function_body",),
            max_per_generator=1, max_per_repo=1, workers=1,
            decontaminate_corpus=(f"files:{corpus}",),
            decontaminate_threshold=contamination.threshold_for("tiny"),
        ),
        log=lambda _: None,
    )  # fmt: skip
    assert [t.provenance.repo for t in records.load_tasks(out)] == [second.repo]
    lines = (tmp_path / "bench" / "rejections.jsonl").read_text().splitlines()
    rejected = [json.loads(line) for line in lines]
    assert {(r["repo"], r["reason"]) for r in rejected} == {(first.name, "contaminated")}
