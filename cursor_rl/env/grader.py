"""Grading an episode: the agent's tree, test files restored, hidden tests run in a fresh sandbox.

    spec = GradeSpec(pristine_repo="/tasks/t1/repo", hidden_tests="/tasks/t1/hidden",
                     fail_to_pass=("tests/test_x.py::test_new",),
                     pass_to_pass=("tests/test_x.py::test_old",))
    result = grade(spec, workspace)       # GradeResult
    result.resolved                       # every FAIL_TO_PASS and PASS_TO_PASS test passed

The same call validates a task: ``grade(spec, spec.pristine_repo)`` must fail every
FAIL_TO_PASS test and pass every PASS_TO_PASS one; ``grade(spec, solved_copy)`` must
resolve.

Test ids: ``path/test_file.py::Class::test[param]`` runs under pytest (node ids,
relative to the repository root); a dotted ``package.module.Class.test_method`` runs
under unittest (as in CPython's ``test`` package, with ``python_path`` naming the
directory that holds ``test/``). The runner contract, the report format and its
defences are in ``cursor_rl.env.testrunner``.

Design choices:

1. **A fresh tree, never the agent's sandbox.** The grader copies the agent's final
   workspace (without ``.git``, ``__pycache__``, ``*.pyc``) into a new directory
   (equal to applying the agent's diff to a pristine copy, and immune to patch
   conflicts), restores every *protected* path (``GradeSpec.protected`` patterns:
   test files, ``conftest.py``, ``sitecustomize.py``, ``*.pth``, test configuration)
   to its pristine version, deleting ones the agent added, then overlays the hidden
   tests. Protected paths the agent changed are reported in ``discarded_paths`` and
   flagged ``modified_tests``; the reward ignores them.
2. **A fresh sandbox**, no network, with the same limits as episodes; an optional
   ``setup_command`` (e.g. building extensions) runs first, after which protected
   paths are restored again, so setup cannot plant files either.
3. **Results come only from the runner's report channel** (nonce-tagged lines on the
   runner's private stdout); test output, exit codes and junit files are ignored.
   A line without the nonce means a forgery attempt: the run's tests all fail and
   the result is flagged ``forged_report``.
4. **Crashes cost one test, not the run.** Tests are run per file (pytest) or module
   (unittest) in a runner process; a test that started but reported nothing crashed
   (``crashed``) or hung until the per-run timeout (``timeout``), and the tests after
   it run again in a fresh process. A run that makes no progress ends the group:
   its remaining tests are ``not_run``.
5. **Only ``passed`` passes.** ``skipped``, ``xfailed`` and ``xpassed`` do not: code under
   test can raise ``SkipTest`` or call ``pytest.xfail()`` itself.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import posixpath
import re
import secrets
import shlex
import tempfile
import time
from collections.abc import Mapping, Sequence

from cursor_rl.env import fs
from cursor_rl.env.sandbox import TEST_RUNNER, Limits, Sandbox

DEFAULT_PROTECTED: tuple[str, ...] = (
    "conftest.py",
    "sitecustomize.py",
    "usercustomize.py",
    "*.pth",
    "pytest.ini",
    "tox.ini",
    "setup.cfg",
    "pyproject.toml",
    "test_*.py",
    "*_test.py",
    "tests/*",
    "*/tests/*",
    "test/*",
    "*/test/*",
)
PASSING = "passed"
_UNITTEST_ID = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
_GRADING_OUTPUT_BYTES = 16 << 20  # the report channel must not be cut (see Limits.output_bytes)


@dataclasses.dataclass(frozen=True)
class GradeSpec:
    """What grading a task needs (explicit; independent of how tasks are stored).

    Attributes:
      pristine_repo: the repository as the agent received it.
      fail_to_pass: test ids that must pass after the agent's change (and fail before).
      pass_to_pass: test ids that must keep passing.
      hidden_tests: directory whose files are overlaid onto the repository at grading
        (same relative paths); None when all tests are in the repository.
      python: the interpreter inside the sandbox that runs the tests.
      python_path: directories (relative to the repository root) put first on
        ``sys.path``.
      protected: patterns of paths restored to their pristine version before testing;
        a pattern without ``/`` matches a file name at any depth, one with ``/`` the
        whole relative path (``*`` crosses directories).
      setup_command: shell command run in the grading sandbox before the tests.
      readonly_paths: host paths visible read-only in the sandbox (the interpreter's
        installation, a virtualenv).
      env: extra environment variables for the setup command and the tests.
      limits: sandbox limits (None: defaults).
      test_timeout_s: limit of one runner process (one file or module's tests).
      setup_timeout_s: limit of the setup command.
      total_timeout_s: limit of all test runs together.
    """

    pristine_repo: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...] = ()
    hidden_tests: str | None = None
    python: str = "/usr/bin/python3"
    python_path: tuple[str, ...] = (".",)
    protected: tuple[str, ...] = DEFAULT_PROTECTED
    setup_command: str | None = None
    readonly_paths: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    limits: Limits | None = None
    test_timeout_s: float = 300.0
    setup_timeout_s: float = 600.0
    total_timeout_s: float = 1800.0

    def __post_init__(self):
        ids = self.fail_to_pass + self.pass_to_pass
        if not self.fail_to_pass:
            raise ValueError("a task needs at least one FAIL_TO_PASS test")
        if len(set(ids)) != len(ids):
            raise ValueError("a test id appears twice in FAIL_TO_PASS + PASS_TO_PASS")
        for test_id in ids:
            framework_of(test_id)


def framework_of(test_id: str) -> str:
    """``"pytest"`` for a node id (has ``::``), ``"unittest"`` for a dotted id.

    Raises:
      ValueError: neither form.
    """
    if "::" in test_id:
        path = test_id.split("::", 1)[0]
        if path.startswith(("-", "/")) or ".." in path.split("/") or not path.endswith(".py"):
            raise ValueError(f"pytest id {test_id!r} must start with a relative path to a .py file")
        return "pytest"
    if _UNITTEST_ID.fullmatch(test_id):
        return "unittest"
    raise ValueError(f"{test_id!r} is neither a pytest node id (a::b) nor a dotted unittest id")


def _group_of(test_id: str) -> str:
    if framework_of(test_id) == "pytest":
        return test_id.split("::", 1)[0]
    return test_id.rsplit(".", 2)[0]


@dataclasses.dataclass(frozen=True)
class TestOutcome:
    """One test's outcome.

    ``status``: the runner's ``passed``, ``failed``, ``error``, ``skipped``,
    ``xfailed``, ``xpassed``, ``tampered``; or the grader's ``crashed``, ``timeout``,
    ``not_run``, ``forged``. Only ``passed`` passes.
    """

    __test__ = False  # not a pytest test class

    test_id: str
    status: str
    duration_s: float = 0.0
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASSING


@dataclasses.dataclass(frozen=True)
class GradeResult:
    """The grade of one workspace.

    Attributes:
      tests: outcome of every FAIL_TO_PASS and PASS_TO_PASS test.
      fail_to_pass: FAIL_TO_PASS id -> passed.
      pass_to_pass: PASS_TO_PASS id -> passed.
      resolved: all of them passed (the binary reward input).
      changed_paths: files the agent added, modified or deleted (vs the pristine repo).
      discarded_paths: the protected ones among them, restored before testing.
      flags: ``modified_tests``, ``tampered``, ``forged_report``, ``crashed``, ``timeout``,
        ``not_run``, ``setup_failed``.
      timings: seconds spent in ``prepare``, ``setup``, ``tests`` and ``total``.
      log: the tail of the test runs' stderr and the setup command's output.
    """

    tests: Mapping[str, TestOutcome]
    fail_to_pass: Mapping[str, bool]
    pass_to_pass: Mapping[str, bool]
    resolved: bool
    changed_paths: tuple[str, ...]
    discarded_paths: tuple[str, ...]
    flags: tuple[str, ...]
    timings: Mapping[str, float]
    log: str


def _matches(path: str, patterns: Sequence[str]) -> bool:
    name = posixpath.basename(path)
    return any(fnmatch.fnmatchcase(path if "/" in p else name, p) for p in patterns)


def _restore_protected(tree: str, spec: GradeSpec, hidden: set[str], pristine: set[str]) -> None:
    """Choice 1: protected paths back to pristine, hidden tests on top."""
    present = set(fs.scan_tree(tree, exclude=fs.history_and_bytecode))
    for path in sorted((present | pristine) - hidden):
        if _matches(path, spec.protected):
            fs.copy_path(spec.pristine_repo, tree, path)
    for path in sorted(hidden):
        fs.copy_path(spec.hidden_tests, tree, path)


class _Run:
    """Parses one runner process's report channel (choice 3)."""

    def __init__(self, stdout: str, nonce: str):
        self.results: dict[str, TestOutcome] = {}
        self.started: list[str] = []
        self.collect_errors: list[str] = []
        self.forged = False
        lines = stdout.split("\n")
        # A final line without newline was cut when the process died mid-write.
        for line in lines[:-1]:
            self._parse(line, nonce)

    def _parse(self, line: str, nonce: str):
        tag, _, payload = line.partition(" ")
        try:
            record = json.loads(payload) if secrets.compare_digest(tag, nonce) else None
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("id", ""), str):
            self.forged = True
            return
        event = record.get("event")
        if event == "start":
            self.started.append(record["id"])
        elif event == "result":
            test_id = record["id"]
            if test_id in self.results or test_id not in self.started:
                self.forged = True  # the runner reports each test once, after its start
                return
            status, detail = str(record.get("status")), str(record.get("detail", ""))
            duration = record.get("duration", 0.0)
            duration = float(duration) if isinstance(duration, int | float) else 0.0
            self.results[test_id] = TestOutcome(test_id, status, duration, detail)
        elif event == "collect_error":
            self.collect_errors.append(str(record.get("detail", "")))
        elif event != "done":
            self.forged = True


def _run_group(
    sb: Sandbox, spec: GradeSpec, test_ids: list[str], deadline: float, logs: list[str]
) -> tuple[dict[str, TestOutcome], set[str]]:
    """Runs one file's or module's tests, resuming after crashes (choice 4)."""
    framework = framework_of(test_ids[0])
    outcomes: dict[str, TestOutcome] = {}
    flags: set[str] = set()
    remaining = list(test_ids)
    detail = ""
    while remaining:
        budget = min(spec.test_timeout_s, deadline - time.monotonic())
        if budget <= 0:
            detail = "the grading time budget ran out"
            break
        nonce = secrets.token_hex(16)
        cmd = [spec.python, "-I", "-X", "pycache_prefix=/tmp/pycache", TEST_RUNNER]
        cmd += ["--framework", framework]
        for path in spec.python_path:
            cmd += ["--path", path]
        cmd += ["--", *remaining]
        # exec: the runner replaces the shell, so no process of the sandbox's uid stands
        # between it and the namespace's init. A test calling kill(-1) would otherwise kill
        # that shell, bwrap would end the run, and whichever test was running then (often
        # an innocent one after the culprit) would be charged with the crash.
        line = "exec " + shlex.join(cmd)
        result = sb.run(line, timeout_s=budget, stdin=f"{nonce}\n".encode())
        logs.append(result.stderr[-4000:])
        if result.timed_out:
            flags.add("timeout")
        run = _Run(result.stdout, nonce)
        if run.forged:
            flags.add("forged_report")
            for test_id in remaining:
                outcomes[test_id] = TestOutcome(test_id, "forged", 0.0, "the report was forged")
            return outcomes, flags
        for test_id in remaining:
            if test_id in run.results:
                outcomes[test_id] = run.results[test_id]
        unfinished = [t for t in run.started if t in remaining and t not in run.results]
        if unfinished:
            status = "timeout" if result.timed_out else "crashed"
            tail = result.stderr[-2000:]
            outcomes[unfinished[0]] = TestOutcome(unfinished[0], status, 0.0, tail)
        progressed = [t for t in remaining if t in outcomes]
        remaining = [t for t in remaining if t not in outcomes]
        if not progressed:
            detail = "\n".join(run.collect_errors) or result.stderr[-2000:]
            break
    for test_id in remaining:
        outcomes[test_id] = TestOutcome(test_id, "not_run", 0.0, detail)
    flags |= {o.status for o in outcomes.values()} & {"tampered", "crashed", "timeout", "not_run"}
    return outcomes, flags


def grade(spec: GradeSpec, workspace: str) -> GradeResult:
    """Grades the agent's final ``workspace`` against ``spec``.

    Args:
      spec: the task's grading spec.
      workspace: the episode's workspace after the sandbox was left (its ``.git``
        and bytecode are ignored).

    Returns:
      Per-test outcomes, FAIL_TO_PASS/PASS_TO_PASS results, flags and timings.

    Raises:
      SandboxUnavailableError: this machine cannot run sandboxes.
    """
    start = time.monotonic()
    timings: dict[str, float] = {}
    flags: set[str] = set()
    logs: list[str] = []
    limits = spec.limits or Limits()
    limits = dataclasses.replace(
        limits,
        output_bytes=max(limits.output_bytes, _GRADING_OUTPUT_BYTES),
        output_kill_bytes=max(limits.output_kill_bytes, 2 * _GRADING_OUTPUT_BYTES),
    )
    hidden = set(fs.scan_tree(spec.hidden_tests)) if spec.hidden_tests else set()
    pristine = set(fs.scan_tree(spec.pristine_repo, exclude=fs.history_and_bytecode))
    changed = fs.diff_trees(spec.pristine_repo, workspace, exclude=fs.history_and_bytecode).changed
    discarded = tuple(p for p in changed if p in hidden or _matches(p, spec.protected))
    if discarded:
        flags.add("modified_tests")
    tests: dict[str, TestOutcome] = {}
    with tempfile.TemporaryDirectory(prefix="cursor_rl_grade_") as tmp:
        tree = posixpath.join(tmp, "repo")
        os.mkdir(tree)
        fs.sync_tree(workspace, tree, exclude=fs.history_and_bytecode)
        _restore_protected(tree, spec, hidden, pristine)
        timings["prepare"] = time.monotonic() - start
        with Sandbox(
            tree,
            limits=limits,
            readonly_paths=spec.readonly_paths,
            env=spec.env,
        ) as sb:
            setup_start = time.monotonic()
            if spec.setup_command:
                result = sb.run(spec.setup_command, timeout_s=spec.setup_timeout_s)
                logs.append(result.stdout[-2000:] + result.stderr[-2000:])
                if result.exit_code != 0 or result.timed_out:
                    flags.add("setup_failed")
                _restore_protected(sb.live_root, spec, hidden, pristine)
            timings["setup"] = time.monotonic() - setup_start
            tests_start = time.monotonic()
            deadline = tests_start + spec.total_timeout_s
            groups: dict[str, list[str]] = {}
            for test_id in spec.fail_to_pass + spec.pass_to_pass:
                groups.setdefault(_group_of(test_id), []).append(test_id)
            for test_ids in groups.values():
                outcomes, group_flags = _run_group(sb, spec, test_ids, deadline, logs)
                tests.update(outcomes)
                flags |= group_flags
            timings["tests"] = time.monotonic() - tests_start
    f2p = {t: tests[t].passed for t in spec.fail_to_pass}
    p2p = {t: tests[t].passed for t in spec.pass_to_pass}
    timings["total"] = time.monotonic() - start
    return GradeResult(
        tests=tests,
        fail_to_pass=f2p,
        pass_to_pass=p2p,
        resolved=all(f2p.values()) and all(p2p.values()),
        changed_paths=changed,
        discarded_paths=discarded,
        flags=tuple(sorted(flags)),
        timings=timings,
        log="\n".join(log for log in logs if log.strip())[-16000:],
    )
