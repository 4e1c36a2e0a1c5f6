"""Validation: a candidate becomes a task only if the tests say so, in the sandbox.

Every test run here is the harness's own grading (``cursor_rl.env.grader.grade``:
fresh sandbox, hidden tests overlaid, the harness test runner), so a task is
validated by exactly the code that will grade the agent. Collection (listing a
test file's ids) runs in the harness sandbox too.

For one repository (``RepoValidator``):

1. **Baseline.** Collect the hidden tests' ids, run them all ``runs`` times on the
   original repository; tests that pass every time are the *stable* set. A test that
   passes only sometimes is flaky and dropped everywhere. Then a sensitivity probe:
   with the code files made unimportable at least one stable test must fail, or the
   tests are exercising some other copy of the code and the repository is rejected.
2. **Candidate.** The reference solution (the original, or a refactor's result)
   must pass the selected tests; for refactors it is run ``runs`` times with the new
   hidden tests and no originally passing test may fail on it. Then the starting
   state runs: FAIL_TO_PASS = stable tests that fail there, PASS_TO_PASS = stable
   tests that pass. At least one of each is required. The starting state runs a
   second time only when the first found a FAIL_TO_PASS test (rejections stay
   cheap); tests whose outcome differs between the runs are dropped as flaky.
   Refactors must fail only their structural check tests (behaviour preserved).

Each rejection has a reason from ``REJECTION_REASONS``; the build counts them.

Pure Python, no JAX.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import tempfile
import time
from collections.abc import Mapping, Sequence

from cursor_rl.env import grader
from cursor_rl.env.sandbox import Limits, Sandbox, SandboxError
from cursor_rl.tasks import environments, records
from cursor_rl.tasks.generators.base import Candidate, SourceRepo

REJECTION_REASONS = (
    "baseline_collect_failed",  # the hidden tests could not be listed
    "baseline_no_passing_tests",  # nothing passes on the original
    "tests_ignore_code",  # the tests pass with the code removed (they test another copy)
    "no_fail_to_pass",  # the change breaks no stable test
    "no_pass_to_pass",  # the change breaks every stable test
    "flaky",  # FAIL_TO_PASS did not survive the second run
    "timeout",  # a test hung on the starting state
    "reference_fails",  # the reference solution fails a test it must pass
    "not_behavior_preserving",  # a refactor's start state fails a behavioural test
    "duplicate",  # same starting tree and tests as an accepted task
    "sandbox_error",  # the sandbox could not run the tests
    "contaminated",  # (build) the solution overlaps the training tasks
    "autoinstall_failed",  # (build) the repository could not be installed
    "crashed",  # (build) an unexpected error while building a repository's tasks
)
_COLLECT_UNITTEST = """
import json, sys, unittest
sys.path[:0] = {paths}
loader = unittest.TestLoader()
ids, errors = [], []
def walk(suite):
    for test in suite:
        if isinstance(test, unittest.TestSuite):
            walk(test)
        elif type(test).__module__.startswith("unittest."):
            errors.append(test.id())
        else:
            ids.append(test.id())
for name in {modules}:
    try:
        walk(loader.loadTestsFromName(name))
    except Exception as e:
        errors.append(f"{{name}}: {{e!r}}")
print("COLLECTED " + json.dumps({{"ids": ids, "errors": errors + loader.errors}}))
"""

_PROBE_SOURCE = 'raise ImportError("cursor_rl validation: sensitivity probe")\n'
_COLLECT_PYTEST = """
import sys
sys.path[:0] = {paths}
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *{files}]))
"""


@dataclasses.dataclass(frozen=True)
class ValidationConfig:
    """How candidates are validated.

    Attributes:
      runs: runs per state (2: a test must behave the same twice).
      test_timeout_s: upper limit of one runner process (one test module).
      timeout_factor: after the baseline, a run may take this many times the slowest
        baseline run (at least ``min_timeout_s``): an injected bug that loops forever
        is then rejected in seconds, not minutes.
      min_timeout_s: lower bound of the adaptive limit.
      total_timeout_s: limit of one grading call.
      limits: sandbox limits (None: the harness defaults).
    """

    runs: int = 2
    test_timeout_s: float = 120.0
    timeout_factor: float = 10.0
    min_timeout_s: float = 10.0
    total_timeout_s: float = 600.0
    limits: Limits | None = None


@dataclasses.dataclass(frozen=True)
class Rejection:
    """Why a candidate (or a whole repository) did not become a task."""

    reason: str
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class ValidatedTask:
    """A candidate that passed validation, with everything a record needs.

    Attributes:
      candidate: the candidate.
      start_tree: the agent's starting repository (no hidden tests).
      reference_tree: the reference solution's repository.
      hidden_tests: hidden test files (path -> text).
      fail_to_pass: test ids that fail on the start and pass on the reference.
      pass_to_pass: test ids that pass on both.
      failures: ``(test_id, detail)`` of FAIL_TO_PASS tests on the starting state.
      seconds: wall time spent validating this candidate.
      test_seconds: the tests' own run time on the reference (sum of durations).
      flaky_dropped: tests dropped because their outcome changed between runs.
    """

    candidate: Candidate
    start_tree: dict[str, str]
    reference_tree: dict[str, str]
    hidden_tests: dict[str, str]
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    failures: list[tuple[str, str]]
    seconds: float
    test_seconds: float
    flaky_dropped: int


def apply_changes(tree: Mapping[str, str], changes: Mapping[str, str | None]) -> dict[str, str]:
    """A copy of ``tree`` with ``changes`` applied (None deletes a file)."""
    out = dict(tree)
    for path, text in changes.items():
        if text is None:
            out.pop(path, None)
        else:
            out[path] = text
    return out


def _gradable(ids: Sequence[str]) -> list[str]:
    """Sorted unique ids the grader can address (a doctest's bare id cannot be)."""
    keep = []
    for test_id in dict.fromkeys(ids):
        try:
            grader.framework_of(test_id)
        except ValueError:
            continue
        keep.append(test_id)
    return sorted(keep)


def _module_name(path: str) -> str:
    return path[: -len(".py")].replace("/", ".")


class RepoValidator:
    """Validates candidates of one repository against its cached baseline.

    Args:
      repo: the working repository.
      config: validation settings.
    """

    def __init__(self, repo: SourceRepo, config: ValidationConfig | None = None):
        self.repo = repo
        self.config = config or ValidationConfig()
        self.environment = environments.resolve(repo.environment)
        self.original = {p: t for p, t in repo.tree.items() if p not in repo.test_files}
        self.hidden = {p: repo.tree[p] for p in repo.test_files}
        self.all_ids: list[str] = []  # every collected id of the original tests
        self.stable: list[str] = []  # those that pass on every baseline run
        self.baseline_seconds = 0.0
        self.timeout_s = self.config.test_timeout_s  # adapted by baseline()

    # ---- running tests through the harness ----

    def collect(self, tree: Mapping[str, str], hidden: Mapping[str, str]) -> list[str]:
        """Test ids defined by the hidden test files (collected in the sandbox).

        Raises:
          RuntimeError: collection failed (a test file does not import).
        """
        env = self.environment
        with tempfile.TemporaryDirectory(prefix="cursor_rl_collect_") as root:
            records.write_tree({**tree, **hidden}, root)
            test_paths = sorted(p for p in hidden if p.endswith(".py"))
            if self.repo.test_framework == "unittest":
                script = _COLLECT_UNITTEST.format(
                    paths=json.dumps(env["python_path"]),
                    modules=json.dumps([_module_name(p) for p in test_paths]),
                )
                cmd = shlex.join([env["python"], "-I", "-c", script])
            else:
                script = _COLLECT_PYTEST.format(
                    paths=json.dumps(env["python_path"]), files=json.dumps(test_paths)
                )
                cmd = shlex.join([env["python"], "-I", "-c", script])
            with Sandbox(
                root,
                limits=self.config.limits,
                hide_git_history=False,
                readonly_paths=env["readonly_paths"],
            ) as sb:
                result = sb.run(cmd, timeout_s=self.config.test_timeout_s)
        if self.repo.test_framework == "unittest":
            for line in result.stdout.splitlines():
                if line.startswith("COLLECTED "):
                    found = json.loads(line[len("COLLECTED ") :])
                    if found["errors"]:
                        raise RuntimeError("test import errors: " + "; ".join(found["errors"]))
                    return _gradable(found["ids"])
            raise RuntimeError(f"collection printed nothing: {result.stderr[-2000:]}")
        ids = [line.strip() for line in result.stdout.splitlines() if "::" in line]
        if result.exit_code not in (0, 5) or not ids:
            raise RuntimeError(f"pytest collection failed: {result.stdout[-2000:]}")
        return _gradable(ids)

    def run_tests(
        self,
        start: Mapping[str, str],
        workspace: Mapping[str, str],
        hidden: Mapping[str, str],
        test_ids: Sequence[str],
    ) -> dict[str, grader.TestOutcome]:
        """Grades ``workspace`` as an agent's result on a task starting from ``start``."""
        env = self.environment
        with tempfile.TemporaryDirectory(prefix="cursor_rl_validate_") as root:
            paths = {name: os.path.join(root, name) for name in ("start", "work", "hidden")}
            for name, tree in (("start", start), ("work", workspace), ("hidden", hidden)):
                os.makedirs(paths[name])
                records.write_tree(tree, paths[name])
            spec = grader.GradeSpec(
                pristine_repo=paths["start"],
                fail_to_pass=tuple(test_ids),
                hidden_tests=paths["hidden"],
                python=env["python"],
                python_path=tuple(env["python_path"]),
                readonly_paths=tuple(env["readonly_paths"]),
                limits=self.config.limits,
                test_timeout_s=self.timeout_s,
                total_timeout_s=self.config.total_timeout_s,
            )
            return dict(grader.grade(spec, paths["work"]).tests)

    # ---- baseline and candidates ----

    def baseline(self) -> Rejection | None:
        """Collects the tests and finds the stable passing set (None on success)."""
        start = time.monotonic()
        try:
            ids = self.collect(self.original, self.hidden)
        except (RuntimeError, SandboxError) as e:
            return Rejection("baseline_collect_failed", str(e)[-2000:])
        if not ids:
            return Rejection("baseline_collect_failed", "no tests found")
        self.all_ids = ids
        passing = set(ids)
        slowest = 0.0
        for _ in range(self.config.runs):
            run_start = time.monotonic()
            outcomes = self.run_tests(self.original, self.original, self.hidden, ids)
            slowest = max(slowest, time.monotonic() - run_start)
            passing &= {t for t, o in outcomes.items() if o.passed}
        self.stable = sorted(passing)
        self.timeout_s = min(
            self.config.test_timeout_s,
            max(self.config.min_timeout_s, self.config.timeout_factor * slowest),
        )
        if not self.stable:
            self.baseline_seconds = time.monotonic() - start
            return Rejection("baseline_no_passing_tests", f"{len(ids)} tests, none pass")
        # Sensitivity probe: with every target file unimportable, the tests must notice.
        # If none fails, they exercise another copy of the code (a module the
        # interpreter imported at start-up shadows the repository's), and every task
        # from this repository would be graded on code the agent cannot change.
        probe = {path: _PROBE_SOURCE for path in self.repo.target_files}
        broken = apply_changes(self.original, probe)
        outcomes = self.run_tests(broken, broken, self.hidden, self.stable)
        self.baseline_seconds = time.monotonic() - start
        if all(outcomes[t].passed for t in self.stable):
            self.stable = []
            return Rejection(
                "tests_ignore_code", "the tests pass with the repository's code unimportable"
            )
        return None

    def validate(self, candidate: Candidate) -> ValidatedTask | Rejection:
        """Validates one candidate (see the module docstring)."""
        if not self.stable:
            raise RuntimeError("call baseline() first (and check that it succeeded)")
        began = time.monotonic()
        try:
            return self._validate(candidate, began)
        except SandboxError as e:
            return Rejection("sandbox_error", str(e)[-2000:])

    def _validate(self, candidate: Candidate, began: float) -> ValidatedTask | Rejection:
        start_tree = apply_changes(self.original, candidate.start_changes)
        reference = apply_changes(self.original, candidate.solution_changes)
        hidden = {**self.hidden, **candidate.test_changes}
        refactor = bool(candidate.test_changes)
        expected = list(self.stable)
        added: set[str] = set()
        test_seconds = 0.0
        if refactor or candidate.solution_changes:
            try:
                ids = self.collect(reference, hidden)
            except (RuntimeError, SandboxError) as e:
                return Rejection("reference_fails", f"collection: {e}"[-2000:])
            added = set(ids) - set(self.all_ids)
            wanted = sorted(set(self.stable) | added)
            passing = set(wanted)
            for _ in range(self.config.runs):
                outcomes = self.run_tests(start_tree, reference, hidden, wanted)
                passing &= {t for t, o in outcomes.items() if o.passed}
                test_seconds = sum(o.duration_s for o in outcomes.values())
            broken = sorted(set(wanted) - passing)
            if broken:
                return Rejection("reference_fails", f"{len(broken)} tests, e.g. {broken[0]}")
            expected = wanted
        runs = []
        for attempt in range(self.config.runs):
            outcomes = self.run_tests(start_tree, start_tree, hidden, expected)
            if any(o.status == "timeout" for o in outcomes.values()):
                return Rejection("timeout", "a test hung on the starting state")
            runs.append(outcomes)
            failing = [t for t in expected if not outcomes[t].passed]
            if attempt == 0 and not failing:
                return Rejection("no_fail_to_pass")
        first = runs[0]
        flaky = {t for t in expected if len({r[t].passed for r in runs}) > 1}
        fail_to_pass = [t for t in expected if t not in flaky and not first[t].passed]
        pass_to_pass = [t for t in expected if t not in flaky and first[t].passed]
        if not fail_to_pass:
            return Rejection("flaky", f"{len(flaky)} tests changed outcome between runs")
        if not pass_to_pass:
            return Rejection("no_pass_to_pass", f"all {len(expected)} tests fail")
        if refactor and set(fail_to_pass) != added:
            behavioural = sorted(set(fail_to_pass) - added)
            detail = f"fails {behavioural[:3]}" if behavioural else "a structural test passes"
            return Rejection("not_behavior_preserving", detail)
        if not test_seconds:
            test_seconds = sum(o.duration_s for o in first.values())
        return ValidatedTask(
            candidate=candidate,
            start_tree=start_tree,
            reference_tree=reference,
            hidden_tests=hidden,
            fail_to_pass=fail_to_pass,
            pass_to_pass=pass_to_pass,
            failures=[(t, first[t].detail) for t in fail_to_pass],
            seconds=time.monotonic() - began,
            test_seconds=test_seconds,
            flaky_dropped=len(flaky),
        )
