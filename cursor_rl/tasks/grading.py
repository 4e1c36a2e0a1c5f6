"""From a task record to the harness: the agent's workspace and the grader's spec.

    task = load_tasks("/data/tasks/train")[0]
    spec = prepare_task(task, root)           # root/repo (pristine), root/hidden
    shutil.copytree(spec.pristine_repo, workspace)   # the episode's private copy
    ... agent works in Sandbox(workspace, **sandbox_kwargs(task)) ...
    result = cursor_rl.env.grader.grade(spec, workspace)

The spec runs exactly the record's FAIL_TO_PASS and PASS_TO_PASS ids with the
record's interpreter (resolved for this machine, see ``environments.resolve``).

Pure Python, no JAX.
"""

from __future__ import annotations

import os
import re
from typing import Any

from cursor_rl.env import grader
from cursor_rl.env.sandbox import HARNESS_DIR
from cursor_rl.tasks import environments, records

_HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def prepare_task(
    task: records.TaskRecord, root: str, *, dataset_dir: str = "", **overrides: Any
) -> grader.GradeSpec:
    """Writes the task's pristine repository and hidden tests under ``root``.

    Args:
      task: the record.
      root: an empty or missing directory; ``root/repo`` and ``root/hidden`` are created.
      dataset_dir: the dataset directory (for ``dir`` snapshots).
      **overrides: ``GradeSpec`` fields to override (limits, timeouts).

    Returns:
      The grading spec for this task.
    """
    repo, hidden = os.path.join(root, "repo"), os.path.join(root, "hidden")
    records.materialize(task, repo, dataset_dir=dataset_dir)
    os.makedirs(hidden, exist_ok=True)
    records.write_tree(task.hidden_tests, hidden)
    env = environments.resolve(task.environment)
    fields: dict[str, Any] = {
        "pristine_repo": repo,
        "fail_to_pass": tuple(task.fail_to_pass),
        "pass_to_pass": tuple(task.pass_to_pass),
        "hidden_tests": hidden,
        "python": env["python"],
        "python_path": tuple(env["python_path"]),
        "readonly_paths": tuple(env["readonly_paths"]),
    }
    fields.update(overrides)
    return grader.GradeSpec(**fields)


def sandbox_kwargs(task: records.TaskRecord) -> dict[str, Any]:
    """Keyword arguments for the episode's ``Sandbox``.

    The task's interpreter is mounted and is the ``python`` on ``PATH`` (the agent
    tests with what grading uses). A stdlib task's ``hidden_paths`` (the interpreter's
    own copy of the module and of its tests, see ``environments.stdlib_copies_of``)
    are masked (``Sandbox(masked_paths=...)``): inside they read as empty files.
    """
    env = environments.resolve(task.environment)
    bin_dir = os.path.dirname(env["python"])
    path = f"{HARNESS_DIR}/bin:{bin_dir}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
    return {
        "readonly_paths": tuple(env["readonly_paths"]),
        "env": {"PATH": path},
        "masked_paths": tuple(env.get("hidden_paths", ())),
    }


def apply_patch_files(task: records.TaskRecord, workspace: str) -> None:
    """Applies the reference solution to ``workspace`` (a materialized starting repo).

    For tests, sanity checks and demonstrations; the agent never sees the patch.
    """
    for path, text in solution_files(task, workspace).items():
        full = os.path.join(workspace, *path.split("/"))
        if text is None:
            os.remove(full)
            continue
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(text)


def solution_files(task: records.TaskRecord, workspace: str) -> dict[str, str | None]:
    """The files the reference solution changes: path -> new text (None: deleted).

    Args:
      task: the record.
      workspace: a directory holding the task's starting repository.
    """
    out: dict[str, str | None] = {}
    lines = records.split_lines(task.solution_patch)
    i = 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1
            continue
        old, new = lines[i][4:].strip(), lines[i + 1][4:].strip()
        i += 2
        path = (new if new != "/dev/null" else old)[2:]
        before = []
        if old != "/dev/null":
            with open(os.path.join(workspace, *path.split("/")), encoding="utf-8") as f:
                before = records.split_lines(f.read())
        after: list[str] = []
        pos = 0
        while i < len(lines) and lines[i].startswith("@@"):
            match = _HUNK.match(lines[i])
            old_start, old_count, new_count = (
                int(match.group(1)),
                int(match.group(2) or 1),
                int(match.group(4) or 1),
            )
            i += 1
            hunk_start = max(old_start - 1, 0) if old_count else old_start
            after += before[pos:hunk_start]
            pos = hunk_start
            previous = ""
            # A hunk holds exactly old_count old and new_count new lines.
            while old_count or new_count or (i < len(lines) and lines[i].startswith("\\")):
                tag, body = lines[i][:1], lines[i][1:]
                if tag == "\\":  # "\ No newline at end of file" for the line before
                    if previous in (" ", "+"):
                        after[-1] = after[-1].removesuffix("\n")
                elif tag in (" ", "-"):
                    pos += 1
                    old_count -= 1
                if tag in (" ", "+"):
                    after.append(body)
                    new_count -= 1
                previous = tag
                i += 1
        after += before[pos:]
        out[path] = None if new == "/dev/null" else "".join(after)
    return out
