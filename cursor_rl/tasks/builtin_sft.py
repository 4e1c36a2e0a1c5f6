"""The built-in SFT set: a scripted agent solving real tasks with the real harness.

Until the RL loop produces agent trajectories, SFT needs demonstrations in the
harness's format. This module makes them by *running* an episode per task: the
task's repository in a real ``Sandbox``, the real tools (``cursor_rl.env.tools``),
the harness's episode loop (``cursor_rl.env.harness.AgentEpisode``), and a scripted
solver in place of the model. Every observation is what the tool really printed.

    python -m cursor_rl.tasks.builtin_sft --num_tasks=48           # rewrite data/sft.jsonl
    python -m cursor_rl.tasks.builtin_sft --tasks=DIR/tasks.jsonl --out=my_sft.jsonl

The solver (``plan_episode``) behaves like a careful agent: it reads the file named
in the task; for a bug or a missing feature it first runs a quick check that shows
the failure; it edits the file (``edit_file`` with the reference solution's hunks,
each cut to its changed lines plus the context that makes them unique); it runs
the check again (for a rename it searches for leftovers of the old name); then it
submits. The check is a ``python -c`` one-liner built from the assertions
of the task's FAIL_TO_PASS tests — what an agent would write from the documented
behaviour. Each demonstration is graded with the real grader and kept only if it
resolves the task and its last check really passed (its closing words say so).

Design choices:

1. **Tasks are pluggable**: any iterable of ``cursor_rl.tasks.records.TaskRecord``
   (a dataset file, or tiny-family tasks built on the fly with the task factory's
   ``build``). Only ``train``-split tasks are accepted: a benchmark task must never
   become training data.
2. **Messages, not tokens, are stored**, so the set is independent of the tokenizer.
   The episode itself runs on token ids (``AgentEpisode`` needs a ``ChatFormat``;
   any tokenizer with the special tokens serves), and every demonstration is checked
   to render (``ChatFormat.render``) to exactly the episode's token trajectory.
3. **The set ships with the package** (``cursor_rl/data/sft.jsonl``, read by
   ``cursor_rl.data.sft`` as the ``builtin`` source): SFT then needs no
   sandbox, no root and no task build at training time; this command regenerates it.
4. **The agent's ``python`` is the task's interpreter** (``grading.sandbox_kwargs``
   puts it on the sandbox ``PATH``), the interpreter the grader runs the hidden tests
   with.
5. **Hinted demonstrations teach the policy to follow a hint.** Textual feedback
   (``cursor_rl.rl.feedback``) scores an episode with a hint inserted where it went
   wrong; that teacher is only as good as the policy's response to hints, and a model
   trained only on single-instruction episodes has none. The ``hinted`` plan is the
   short plan with textual feedback's own hint for submitting untested inserted as a
   user turn after the edit, followed by the check it asks for: mixed into SFT
   (``sft_data.hinted_share``), the short episodes still submit untested, and the
   hinted ones show what the hint should change.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import functools
import multiprocessing
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from absl import app, flags

from cursor_rl.chat import protocol
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.data import sft
from cursor_rl.env import grader, harness, tools
from cursor_rl.env.sandbox import Sandbox
from cursor_rl.tasks import build, grading, records

SYSTEM_PROMPT = harness.DEFAULT_SYSTEM_PROMPT
PLANS = ("full", "short", "hinted")
_CHECK_ASSERTS = 3  # assertions of the FAIL_TO_PASS tests turned into the quick check


@dataclasses.dataclass(frozen=True)
class Demonstration:
    """One scripted episode: its messages (system, user, assistant, tool) and its grade.

    Attributes:
      task_id: the task.
      messages: the conversation as the harness rendered it.
      resolved: the grader's verdict on the final workspace.
      check_passed: the agent's last check succeeded (its closing words say so).
      seconds: wall time of episode and grading.
    """

    task_id: str
    messages: tuple[protocol.Message, ...]
    resolved: bool
    check_passed: bool
    seconds: float

    @property
    def usable(self) -> bool:
        """Fit to train on: the task is resolved and the transcript tells no lie."""
        return self.resolved and self.check_passed


# ---- the scripted solver -------------------------------------------------------------


def _tight_edit(old: list[str], new: list[str], current: str) -> tuple[str, str] | None:
    """The shortest (old_str, new_str) for one hunk whose old_str is unique in ``current``.

    The hunk's context lines (shared by ``old`` and ``new``) are dropped, then given
    back one at a time, the line before first, until ``old_str`` occurs exactly once:
    the edit a careful agent writes (the changed line, plus context only to make it
    unambiguous). None when even the whole hunk is not unique.
    """
    same = min(len(old), len(new))
    pre = 0
    while pre < same and old[pre] == new[pre]:
        pre += 1
    post = 0
    while post < same - pre and old[-1 - post] == new[-1 - post]:
        post += 1
    lo, hi = pre, post  # context lines dropped at the start and at the end
    while True:
        old_str = "".join(old[lo : len(old) - hi])
        if old_str and current.count(old_str) == 1:
            return old_str, "".join(new[lo : len(new) - hi])
        if lo == 0 and hi == 0:
            return None
        if lo > 0 and lo >= hi:
            lo -= 1
        else:
            hi -= 1


def _hunk_edits(old_text: str, new_text: str, patch_lines: Sequence[str]) -> list[tuple[str, str]]:
    """(old_str, new_str) per hunk of one file's diff (``_tight_edit``), or the whole file
    when a hunk is ambiguous or the hunks do not reproduce the solution."""
    edits = []
    current = old_text
    i = 0
    while i < len(patch_lines):
        if not patch_lines[i].startswith("@@"):
            i += 1
            continue
        i += 1
        old, new = [], []
        while i < len(patch_lines) and patch_lines[i][:1] in (" ", "-", "+"):
            tag, body = patch_lines[i][:1], patch_lines[i][1:]
            if tag in (" ", "-"):
                old.append(body)
            if tag in (" ", "+"):
                new.append(body)
            i += 1
        edit = _tight_edit(old, new, current)
        if edit is None:
            return [(current, new_text)] if current else [("", new_text)]
        current = current.replace(edit[0], edit[1], 1)
        edits.append(edit)
    if current != new_text:  # the hunks did not reproduce the solution: replace the file
        return [(old_text, new_text)]
    return edits


def _file_patches(patch: str) -> dict[str, list[str]]:
    """The lines of a unified diff grouped by the file they change (``b/`` path)."""
    out: dict[str, list[str]] = {}
    path = None
    for line in records.split_lines(patch):
        if line.startswith("+++ "):
            target = line[4:].strip()
            path = target[2:] if target.startswith("b/") else target
            out[path] = []
        elif line.startswith("--- "):
            path = None
        elif path is not None:
            out[path].append(line)
    return out


def _assert_expressions(task: records.TaskRecord) -> list[tuple[str, str]]:
    """(actual, expected) source pairs of the tests' ``assertEqual`` calls.

    The FAIL_TO_PASS tests for bugs and features (the behaviour to reach); the
    PASS_TO_PASS ones for refactors (the behaviour to keep), those of the refactored
    symbol first. Calls of a renamed symbol's old name are left out: the hidden tests
    reach it through an alias the agent's own check does not have.
    """
    refactor = task.category == "refactor"
    wanted = {
        tuple(t.split(".")[-2:]) for t in (task.pass_to_pass if refactor else task.fail_to_pass)
    }
    old_name = _renamed_symbol(task) if refactor else None
    found = []
    for text in task.hidden_tests.values():
        try:
            module = ast.parse(text)
        except SyntaxError:
            continue
        for cls in (n for n in module.body if isinstance(n, ast.ClassDef)):
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                if (cls.name, fn.name) in wanted:
                    found += [p for p in _assert_equal_pairs(fn) if not _mentions(p, old_name)]
    if refactor:
        found.sort(key=lambda pair: f".{task.provenance.symbol}(" not in pair[0])
    return found[:_CHECK_ASSERTS]


def _mentions(pair: tuple[str, str], name: str | None) -> bool:
    return name is not None and any(
        isinstance(n, ast.Name | ast.Attribute)
        and name in (getattr(n, "id", None), getattr(n, "attr", None))
        for part in pair
        for n in ast.walk(ast.parse(part, mode="eval"))
    )


def _assert_equal_pairs(fn: ast.FunctionDef) -> list[tuple[str, str]]:
    """``self.assertEqual(actual, expected)`` calls not involving ``self`` otherwise."""
    pairs = []
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "assertEqual"
            and len(node.args) == 2
            and not any(
                isinstance(n, ast.Name) and n.id == "self"
                for arg in node.args
                for n in ast.walk(arg)
            )
        ):
            actual, expected = (ast.unparse(a) for a in node.args)
            pairs.append((actual, expected))
    return pairs


def _check_command(task: records.TaskRecord) -> str:
    """A ``python -c`` one-liner checking the documented behaviour (or that it imports).

    Each assertion reports the actual value when it fails (``assert (r := f(x)) == y, r``).
    """
    module = task.provenance.module
    statements = [f"import {module}"]
    for actual, expected in _assert_expressions(task):
        statements.append(f"assert (r := {actual}) == {expected}, r")
    statements.append("print('check passed')" if len(statements) > 1 else "print('imports fine')")
    code = "; ".join(statements)
    if any(c in code for c in '"$`\\'):  # special inside double quotes for sh
        return "python -c " + shlex.quote(code)
    return f'python -c "{code}"'


def _renamed_symbol(task: records.TaskRecord) -> str | None:
    """The old name of a rename refactor, from its structural check's ``OLD`` constant."""
    for text in task.hidden_tests.values():
        try:
            module = ast.parse(text)
        except SyntaxError:
            continue
        for node in module.body:
            if (
                isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["OLD"]
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                return node.value.value
    return None


def _call(name: str, **arguments: Any) -> protocol.ToolCall:
    return protocol.ToolCall(name, arguments)


def plan_episode(
    task: records.TaskRecord,
    start_tree: dict[str, str],
    solution: dict[str, str | None],
    plan: str = "full",
    hint: str = "",
) -> list[protocol.Message]:
    """The scripted agent's turns for ``task`` (an oracle: it knows the patch).

    Args:
      task: a task record with a ``solution_patch``.
      start_tree: the task's starting repository (path -> text).
      solution: the files the solution changes (``grading.solution_files``).
      plan: ``full`` (read, reproduce, edit, re-check, submit), ``short`` (read,
        edit, submit: the shortest successful episode, for small models whose
        contexts and budgets are small) or ``hinted`` (choice 5: read, edit, then
        a user turn with ``hint``, then the check the hint asks for, then submit).
      hint: the user turn of the ``hinted`` plan (textual feedback's hint for
        submitting without running the tests, ``cursor_rl.rl.hints``).

    Returns:
      The messages, one per turn (assistant turns, and the ``hinted`` plan's user
      turn), ending with the ``submit`` call.
    """
    if plan not in PLANS:
        raise ValueError(f"plan={plan!r}: one of {PLANS}")
    if plan == "hinted" and not hint.strip():
        raise ValueError("plan='hinted' needs the hint text")
    short = plan in ("short", "hinted")
    symbol, file = task.provenance.symbol, task.provenance.file
    check = _check_command(task)
    turns = []
    opener = {
        "bug": f"The report points at `{file}`. Let me read it to find the cause.",
        "feature": f"I need to implement `{symbol}` in `{file}`. Let me read the file first.",
        "refactor": f"Let me read `{file}` to find `{symbol}` and its uses.",
    }[task.category]
    turns.append(protocol.Message("assistant", opener, (_call("read_file", path=file),)))
    if task.category in ("bug", "feature") and not short:
        turns.append(
            protocol.Message(
                "assistant",
                "Before changing anything, let me reproduce the problem with a quick check.",
                (_call("run_terminal", command=check),),
            )
        )
    edits = []
    for path, lines in _file_patches(task.solution_patch).items():
        after = solution.get(path) or ""
        for old_str, new_str in _hunk_edits(start_tree.get(path, ""), after, lines):
            edits.append(_call("edit_file", path=path, old_str=old_str, new_str=new_str))
    explain = {
        "bug": f"`{symbol}` does not do what its docstring says. I'll fix it.",
        "feature": f"I'll implement `{symbol}` as its docstring describes.",
        "refactor": {
            "rename_symbol": "I'll rename it in the definition and at every use.",
            "extract_function": "I'll move those statements into the new function and call it.",
        }.get(task.generator, "I'll make the requested change."),
    }[task.category]
    turns.append(protocol.Message("assistant", explain, tuple(edits)))
    old_name = _renamed_symbol(task) if task.category == "refactor" else None
    if plan == "short":
        turns.append(protocol.Message("assistant", "Done. Submitting.", (_call("submit"),)))
        return turns
    if plan == "hinted":
        turns.append(protocol.Message("user", hint))
        turns.append(
            protocol.Message(
                "assistant", "Let me run the check first.", (_call("run_terminal", command=check),)
            )
        )
        turns.append(
            protocol.Message("assistant", "The check passes. Submitting.", (_call("submit"),))
        )
        return turns
    if old_name:
        turns.append(
            protocol.Message(
                "assistant",
                f"Let me make sure nothing still refers to `{old_name}`.",
                (_call("search", pattern=rf"\b{old_name}\b", glob="*.py"),),
            )
        )
    turns.append(
        protocol.Message(
            "assistant",
            "Now let me run the check again."
            if task.category in ("bug", "feature")
            else "Now let me check that the module still behaves the same.",
            (_call("run_terminal", command=check),),
        )
    )
    turns.append(protocol.Message("assistant", "The check passes. Submitting.", (_call("submit"),)))
    return turns


# ---- running episodes ------------------------------------------------------------------


def run_demonstration(
    task: records.TaskRecord,
    chat: protocol.ChatFormat,
    *,
    dataset_dir: str = "",
    plan: str = "full",
    tools_style: str = "json",
    hint: str = "",
) -> Demonstration:
    """Runs the scripted agent on ``task`` in a sandbox and grades the result.

    Args:
      task: a ``train``-split task record.
      chat: the chat format the episode runs in (choice 2).
      dataset_dir: the task dataset's directory (for ``dir`` snapshots).
      plan: the solver's plan (``plan_episode``).
      tools_style: how the system prompt lists the tools (``protocol.tools_prompt``).
      hint: the ``hinted`` plan's user turn.

    Returns:
      The demonstration (messages exactly as the harness rendered them).
    """
    if task.split != "train":
        raise ValueError(f"task {task.task_id} is in split {task.split!r}: only train tasks")
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="builtin_sft_") as root:
        spec = grading.prepare_task(task, os.path.join(root, "task"), dataset_dir=dataset_dir)
        workspace = os.path.join(root, "workspace")
        shutil.copytree(spec.pristine_repo, workspace)
        start_tree = records.read_tree(workspace)
        solution = grading.solution_files(task, workspace)
        turns = plan_episode(task, start_tree, solution, plan, hint)
        specs = tools.TOOL_SPECS
        messages = [
            protocol.Message("system", harness.system_message(SYSTEM_PROMPT, specs, tools_style)),
            protocol.Message("user", task.prompt),
        ]
        with Sandbox(workspace, **grading.sandbox_kwargs(task)) as sandbox:
            episode = harness.AgentEpisode(
                chat,
                specs,
                tools.Tools(sandbox).execute,
                system=SYSTEM_PROMPT,
                task=task.prompt,
                tools_style=tools_style,
            )
            for turn in turns:
                if turn.role == "user":  # the hinted plan's hint, between two turns
                    episode.add_user_message(turn.content)
                    messages.append(turn)
                    continue
                step = episode.step(chat.assistant_body(turn))
                messages.append(turn)
                messages += [protocol.Message("tool", r.text) for r in step.results]
                if step.done:
                    break
        if chat.render(messages).tokens != episode.trajectory.tokens:
            raise AssertionError(f"{task.task_id}: messages do not render to the episode's tokens")
        result = grader.grade(spec, workspace)
    last_check = [
        messages[i + 1 + j].content
        for i, m in enumerate(messages)
        for j, c in enumerate(m.tool_calls)
        if c.name == "run_terminal"
    ][-1:]
    # The short plan runs no check: its closing words claim nothing to verify.
    check_passed = plan == "short" or (
        bool(last_check) and last_check[0].startswith("exit code: 0")
    )
    return Demonstration(
        task.task_id, tuple(messages), result.resolved, check_passed, time.time() - start
    )


def demonstrations(
    tasks: Iterable[records.TaskRecord],
    chat: protocol.ChatFormat | None = None,
    *,
    dataset_dir: str = "",
    log: Any = print,
    plan: str = "full",
    tools_style: str = "json",
    workers: int = 1,
    plans: Sequence[str] | None = None,
    hint: str = "",
) -> Iterator[Demonstration]:
    """Runs ``run_demonstration`` over ``tasks``, yielding the usable ones in task order.

    ``plans`` gives each task its own plan (``hinted_plans``), else every task gets
    ``plan``. With ``workers > 1`` episodes run in that many fresh interpreter
    processes (``spawn``: the caller may have imported JAX, which must not be forked);
    each builds its own ``harness_tokenizer`` chat format.
    """
    tasks = list(tasks)
    plans = list(plans) if plans is not None else [plan] * len(tasks)
    if len(plans) != len(tasks):
        raise ValueError(f"{len(plans)} plans for {len(tasks)} tasks")
    kwargs = dict(dataset_dir=dataset_dir, tools_style=tools_style, hint=hint)
    if workers > 1:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            results = pool.map(functools.partial(_run_with_own_chat, **kwargs), tasks, plans)
            yield from _keep_usable(results, log)
        return
    chat = chat or protocol.ChatFormat(harness_tokenizer())
    runs = (run_demonstration(t, chat, plan=p, **kwargs) for t, p in zip(tasks, plans))
    yield from _keep_usable(runs, log)


def hinted_plans(count: int, plan: str, hinted_share: float) -> list[str]:
    """``count`` plans: ``plan``, with ``hinted`` spread evenly over ``hinted_share`` of
    them (task ``i`` is hinted when ``floor((i + 1) * share)`` steps up)."""
    if not 0.0 <= hinted_share <= 1.0:
        raise ValueError(f"hinted_share={hinted_share}: a fraction in [0, 1]")
    return [
        "hinted" if int((i + 1) * hinted_share) > int(i * hinted_share) else plan
        for i in range(count)
    ]


def _run_with_own_chat(task: records.TaskRecord, plan: str, **kwargs: Any) -> Demonstration:
    return run_demonstration(task, protocol.ChatFormat(harness_tokenizer()), plan=plan, **kwargs)


def _keep_usable(demos: Iterable[Demonstration], log: Any) -> Iterator[Demonstration]:
    for demo in demos:
        verdict = "usable" if demo.usable else "dropped"
        verdict += f" (resolved={demo.resolved}, check_passed={demo.check_passed})"
        log(f"{demo.task_id}: {verdict} in {demo.seconds:.1f}s")
        if demo.usable:
            yield demo


def build_tiny_tasks(
    out_dir: str, count: int, *, seed: int = 0, per_module: int = 4
) -> list[records.TaskRecord]:
    """Builds ``count`` validated tiny-family train tasks with the task factory.

    Args:
      out_dir: where the task dataset is written.
      count: number of tasks.
      seed: the build's seed (tiny module offset and candidate order).
      per_module: tasks per generated module, so the set spans many modules.

    Returns:
      The task records.
    """
    # One worker: with several, which repositories fill ``count`` first depends on
    # thread timing, and the shipped set should come out the same on every run.
    config = build.BuildConfig(
        source="tiny",
        out=out_dir,
        split="train",
        count=count,
        seed=seed,
        max_per_repo=per_module,
        workers=1,
    )
    build.build(config, log=lambda line: None)
    return records.load_tasks(os.path.join(out_dir, records.TASKS_FILE))


def harness_tokenizer() -> Tokenizer:
    """A small tokenizer with the special tokens, to run episodes on ids (choice 2)."""
    with open(__file__, encoding="utf-8") as fh:
        return Tokenizer.train([fh.read()], vocab_size=400)


def write_demonstrations(path: str, demos: Sequence[Demonstration]) -> None:
    """Writes demonstrations as SFT JSONL (``sft.ConversationSource`` reads it)."""
    sft.write_conversations(path, [(d.task_id, d.messages) for d in demos])


def define_flags() -> None:
    """Defines the command-line flags (only when run as a program: no clashes on import)."""
    flags.DEFINE_string("out", sft.BUILTIN_PATH, "The SFT JSONL file to write.")
    flags.DEFINE_string("tasks", None, "A tasks.jsonl (train split); default: build tiny.")
    flags.DEFINE_integer("num_tasks", 48, "Tiny tasks to build when --tasks is unset.")
    flags.DEFINE_integer("seed", 0, "Tiny build seed.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="builtin_sft_tasks_") as tmp:
        if flags.FLAGS.tasks:
            task_list = records.load_tasks(flags.FLAGS.tasks)
            dataset_dir = os.path.dirname(os.path.abspath(flags.FLAGS.tasks))
        else:
            task_list = build_tiny_tasks(tmp, flags.FLAGS.num_tasks, seed=flags.FLAGS.seed)
            dataset_dir = tmp
        print(f"{len(task_list)} tasks ready in {time.time() - start:.0f}s", file=sys.stderr)
        chat = protocol.ChatFormat(harness_tokenizer())
        demos = list(demonstrations(task_list, chat, dataset_dir=dataset_dir))
    write_demonstrations(flags.FLAGS.out, demos)
    print(
        f"wrote {len(demos)} demonstrations of {len(task_list)} tasks to {flags.FLAGS.out} "
        f"in {time.time() - start:.0f}s"
    )


if __name__ == "__main__":
    define_flags()
    app.run(main)
