"""The harness-owned test runner: runs named tests and reports each on a private channel.

It runs inside the grading sandbox, read-only at ``/opt/harness/testrunner.py``,
with the task's interpreter (stdlib only, no project import)::

    python -I -X pycache_prefix=/tmp/pycache /opt/harness/testrunner.py \\
        --framework unittest|pytest [--path DIR ...] -- TEST_ID ...

**Contract** (``cursor_rl.env.grader`` is the other side):

- stdin carries one line, a random nonce; it is read before any repository code is
  imported and is never in argv or the environment.
- The report channel is the process's original stdout. Before importing anything of
  the repository the runner moves it to a private descriptor and points fds 1 and 2
  at stderr, so whatever tests or the code under test print goes to stderr and
  never into the report.
- Each report line is ``<nonce> <JSON object>``:
  ``{"event": "start", "id": ID}`` before a test,
  ``{"event": "result", "id": ID, "status": S, "duration": SECONDS, "detail": TEXT}``
  after it, ``{"event": "collect_error", "detail": TEXT}`` when a pytest module fails
  to import, and ``{"event": "done"}`` at the end. Status is one of ``passed``,
  ``failed``, ``error``, ``skipped``, ``xfailed``, ``xpassed``, ``tampered``.
- Test ids: unittest ids are dotted ``package.module.Class.method`` (``TestCase.id()``,
  e.g. ``test.test_heapq.TestHeapPython.test_push_pop``); pytest ids are node ids
  ``path/to/test_file.py::Class::test[param]`` relative to the repository root.
  Only the requested ids are reported.

Design choices:

1. **Isolated interpreter, framework first.** ``-I`` ignores ``PYTHON*`` variables,
   the user site and the current directory, so a ``sitecustomize.py``,
   ``usercustomize.py`` or ``.pth`` file in the repository is never imported at
   start-up. The test framework (``unittest``; pytest with the plugins it always
   loads) is imported before the ``--path`` entries join ``sys.path``, so a
   repository file named ``unittest.py`` or ``pytest.py`` cannot stand in for it.
   ``-X pycache_prefix`` (on a fresh ``/tmp``) makes Python and pytest ignore any
   ``__pycache__`` in the repository, so planted bytecode for a hidden test is never
   loaded.
2. **The repository shadows the interpreter.** Modules the runner imported itself
   (``unittest`` pulls in ``heapq``, ``difflib``, ``fnmatch``, ...) are dropped from
   ``sys.modules`` when the repository provides them, so the tests import the
   repository's version. The test framework itself (``unittest``; pytest and its
   dependencies) and modules loaded at interpreter start-up (``os``, ``io``,
   ``codecs``...) stay the interpreter's.
3. **Tamper evidence.** Before any repository code can run, the runner records every
   function and class in the test framework's modules, in ``builtins`` and in itself,
   and the trace and profile hooks. After each test it compares; a test that ran
   after any change reports ``tampered`` (the one patch pytest applies to itself
   while configuring is accepted, if it comes from pytest's own code). For pytest, a
   hook that runs, collects or reports tests implemented in the repository outside
   a ``conftest.py`` counts as a change too, whenever it was registered.
4. **Exits prove nothing.** The exit status is ignored; a test without a result record
   crashed (``os._exit``, a signal) and the grader reruns the tests after it in a
   fresh process. The runner leaves with ``os._exit`` so threads or ``atexit``
   handlers left by tests cannot hang or extend the run.

Residual risk: code written to attack this runner specifically (walking the
garbage collector to find the report descriptor and nonce) can forge a report from
inside the process; the grader's other defences (protected files restored, tests
run on a fresh copy, no network) still hold.
"""

import os
import sys
import time

_STARTUP_MODULES = frozenset(sys.modules)

import json  # noqa: E402  (after recording the start-up modules, choice 2)
import traceback  # noqa: E402
import types  # noqa: E402
from importlib.machinery import PathFinder  # noqa: E402

_DETAIL_CHARS = 4000
_UNITTEST_PACKAGES = ("unittest",)
_PYTEST_PACKAGES = (
    "unittest",
    "_pytest",
    "pytest",
    "pluggy",
    "iniconfig",
    "packaging",
    "exceptiongroup",
    "tomli",
    "py",
)
_HOOKED = (staticmethod, classmethod, property)


class Reporter:
    """Writes nonce-tagged JSON records to the private report descriptor."""

    def __init__(self, fd, nonce):
        self._fd = fd
        self._nonce = nonce

    def __call__(self, event, **fields):
        fields["event"] = event
        line = f"{self._nonce} {json.dumps(fields)}\n".encode()
        while line:
            line = line[os.write(self._fd, line) :]


class Integrity:
    """Snapshot of framework internals, compared after every test (choice 3)."""

    def __init__(self, packages):
        self._modules = []
        self._items = []
        for name in sorted(sys.modules):
            if name in ("builtins", "__main__") or name.partition(".")[0] in packages:
                self._add_module(name, sys.modules[name])
        self._hooks = (sys.gettrace(), sys.getprofile())

    def _add_module(self, name, module):
        if not isinstance(module, types.ModuleType):
            return
        self._modules.append((name, module))
        for key, value in list(vars(module).items()):
            if callable(value) or isinstance(value, _HOOKED):
                self._items.append((f"{name}.{key}", vars(module), key, value))
            if isinstance(value, type) and value.__module__ == name:
                for attr, member in list(vars(value).items()):
                    if callable(member) or isinstance(member, _HOOKED):
                        self._items.append((f"{name}.{key}.{attr}", vars(value), attr, member))

    def violations(self):
        """Descriptions of what changed since the snapshot (empty when intact)."""
        missing = object()
        bad = [f"sys.modules[{n!r}]" for n, m in self._modules if sys.modules.get(n) is not m]
        bad += [
            label for label, space, key, obj in self._items if space.get(key, missing) is not obj
        ]
        if (sys.gettrace(), sys.getprofile()) != self._hooks:
            bad.append("sys.settrace/sys.setprofile")
        return bad

    def accept_self_patches(self, labels, framework_dirs):
        """Takes in the patches the framework applies to itself while configuring.

        An entry named in ``labels`` may change once, to a function whose code lives
        under ``framework_dirs``; any other change stays a violation.
        """
        for i, (label, space, key, obj) in enumerate(self._items):
            new = space.get(key)
            code = getattr(new, "__code__", None)
            if (
                label in labels
                and new is not obj
                and code is not None
                and code.co_filename.startswith(framework_dirs)
            ):
                self._items[i] = (label, space, key, new)


def _evict_shadowed(repo_paths, framework_packages):
    """Drops modules the repository provides from ``sys.modules`` (choice 2)."""
    tops = {name.partition(".")[0] for name in sys.modules if name not in _STARTUP_MODULES}
    for top in tops - set(framework_packages) - {"__main__"}:
        if PathFinder.find_spec(top, repo_paths) is None:
            continue
        for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
            if name not in _STARTUP_MODULES:
                del sys.modules[name]


def _detail(text):
    return text if len(text) <= _DETAIL_CHARS else "..." + text[-_DETAIL_CHARS:]


def _tampered(integrity, extra=()):
    changed = integrity.violations() + list(extra)
    return "changed while the tests ran: " + ", ".join(changed[:20]) if changed else None


def _report_error(emit, test_id, detail):
    """A test that could not run (not loadable, a fixture failed): start and result records."""
    emit("start", id=test_id)
    emit("result", id=test_id, status="error", duration=0.0, detail=_detail(detail))


def _flatten(suite):
    import unittest

    if isinstance(suite, unittest.TestSuite):
        for test in suite:
            yield from _flatten(test)
    else:
        yield suite


def run_unittest(test_ids, integrity, emit):
    """Runs unittest ids as one suite (so class and module fixtures run) and reports each."""
    import unittest

    loader = unittest.TestLoader()
    tests = []
    for test_id in test_ids:
        errors_before = len(loader.errors)
        try:
            found = list(_flatten(loader.loadTestsFromName(test_id)))
        except Exception:
            _report_error(emit, test_id, traceback.format_exc())
            continue
        if len(found) == 1 and found[0].id() == test_id:
            tests.append(found[0])
            continue
        why = (
            "".join(loader.errors[errors_before:])
            or f"{test_id!r} names {len(found)} tests, not one"
        )
        _report_error(emit, test_id, why)

    class Result(unittest.TestResult):
        def __init__(self):
            super().__init__()
            self.t0 = None  # set while a test runs
            self.fixture_errors = []
            self.reported = set()

        def startTest(self, test):
            super().startTest(test)
            self.outcome, self.detail, self.t0 = None, "", time.perf_counter()
            emit("start", id=test.id())

        def _record(self, status, detail=""):
            # A failure or error outranks a success or skip reported for the same test.
            if self.outcome not in ("failed", "error"):
                self.outcome = status
            self.detail += detail

        def addSuccess(self, test):
            self._record("passed")

        def addFailure(self, test, err):
            self._record("failed", self._exc_info_to_string(err, test))

        def addError(self, test, err):
            if self.t0 is None:  # setUpClass/setUpModule and friends, outside any test
                self.fixture_errors.append(f"{test}: {err[0].__name__}: {err[1]}")
            else:
                self._record("error", self._exc_info_to_string(err, test))

        def addSkip(self, test, reason):
            self._record("skipped", reason)

        def addExpectedFailure(self, test, err):
            self._record("xfailed")

        def addUnexpectedSuccess(self, test):
            self._record("xpassed")

        def addSubTest(self, test, subtest, err):
            if err is not None:
                failed = issubclass(err[0], test.failureException)
                self._record("failed" if failed else "error", self._exc_info_to_string(err, test))

        def stopTest(self, test):
            super().stopTest(test)
            status = self.outcome or "error"
            detail = self.detail if self.outcome else "no outcome reported"
            tampered = _tampered(integrity)
            if tampered:
                status, detail = "tampered", tampered
            duration = time.perf_counter() - self.t0
            emit("result", id=test.id(), status=status, duration=duration, detail=_detail(detail))
            self.reported.add(test.id())
            self.t0 = None

    result = Result()
    unittest.TestSuite(tests).run(result)
    for test in tests:  # never started: a class or module fixture failed
        if test.id() not in result.reported:
            _report_error(emit, test.id(), "; ".join(result.fixture_errors) or "not run")


# What pytest patches in itself while configuring (legacypath), accepted by choice 3.
_PYTEST_SELF_PATCHES = frozenset({"_pytest.config.Config._getini_unknown_type"})
# Hooks through which a plugin decides what runs and what is reported (choice 3).
_REPORTING_HOOKS = (
    "pytest_collection_modifyitems",
    "pytest_make_collect_report",
    "pytest_collectreport",
    "pytest_runtest_protocol",
    "pytest_runtest_setup",
    "pytest_runtest_call",
    "pytest_runtest_teardown",
    "pytest_runtest_makereport",
    "pytest_runtest_logreport",
    "pytest_pyfunc_call",
    "pytest_report_teststatus",
)


def run_pytest(test_ids, integrity, emit):
    """Runs pytest node ids in one session with a reporting plugin."""
    import pytest

    wanted = set(test_ids)
    root = os.getcwd()

    def repo_hooks(config):
        """Reporting hooks implemented in the repository outside a conftest.py."""
        found = []
        for name in _REPORTING_HOOKS:
            for impl in getattr(config.hook, name).get_hookimpls():
                code = getattr(impl.function, "__code__", None)
                path = code.co_filename if code else ""
                if path.startswith(root + os.sep) and os.path.basename(path) != "conftest.py":
                    found.append(f"{name} from {path}")
        return found

    class Plugin:
        """Hook names and argument names are pytest's; pluggy passes arguments by name."""

        def __init__(self):
            self.config = None
            self.outcomes = {}
            self.t0 = {}

        def pytest_configure(self, config):
            self.config = config

        def pytest_sessionstart(self, session):
            framework_dir = os.path.dirname(sys.modules["_pytest"].__file__) + os.sep
            integrity.accept_self_patches(_PYTEST_SELF_PATCHES, framework_dir)

        def pytest_collectreport(self, report):
            if report.failed:
                emit("collect_error", detail=_detail(str(report.longreprtext)))

        def pytest_runtest_logstart(self, nodeid, location):
            if nodeid in wanted:
                self.t0[nodeid] = time.perf_counter()
                emit("start", id=nodeid)

        def pytest_runtest_logreport(self, report):
            nodeid = report.nodeid
            if nodeid not in wanted:
                return
            xfail = hasattr(report, "wasxfail")
            if report.when == "call":
                if report.outcome == "passed":
                    status = "xpassed" if xfail else "passed"
                else:
                    status = "failed" if report.outcome == "failed" else "skipped"
                    status = "xfailed" if xfail and status == "skipped" else status
                self.outcomes.setdefault(nodeid, (status, report.longreprtext))
            elif report.failed:
                self.outcomes[nodeid] = ("error", report.longreprtext)
            elif report.skipped:
                status = "xfailed" if xfail else "skipped"
                self.outcomes.setdefault(nodeid, (status, report.longreprtext))
            if report.when != "teardown":
                return
            status, detail = self.outcomes.pop(nodeid, ("error", "no outcome reported"))
            tampered = _tampered(integrity, repo_hooks(self.config))
            if tampered:
                status, detail = "tampered", tampered
            duration = time.perf_counter() - self.t0.pop(nodeid)
            emit("result", id=nodeid, status=status, duration=duration, detail=_detail(detail))

    pytest.main(["-p", "no:cacheprovider", "-q", "--rootdir", root, *test_ids], plugins=[Plugin()])


def _import_framework(framework):
    """Imports what the framework will use, before the repository is importable (choice 1)."""
    import importlib
    import unittest  # noqa: F401  (pytest runs TestCase classes too)

    if framework == "pytest":
        from _pytest.config import default_plugins

        for name in default_plugins:
            importlib.import_module(f"_pytest.{name}")
        return _PYTEST_PACKAGES
    return _UNITTEST_PACKAGES


def main(argv):
    nonce = sys.stdin.readline().strip()
    framework, paths, test_ids = "unittest", [], []
    args = iter(argv)
    for arg in args:
        if arg == "--framework":
            framework = next(args)
        elif arg == "--path":
            paths.append(os.path.abspath(next(args)))
        elif arg == "--":
            test_ids = list(args)
    if not nonce or framework not in ("unittest", "pytest"):
        sys.stderr.write("usage: see the module docstring\n")
        os._exit(2)
    # Private report channel; fds 0-2 now belong to the tests (contract above).
    report_fd = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    emit = Reporter(report_fd, nonce)
    sys.argv[:] = [sys.argv[0]]
    try:
        packages = _import_framework(framework)
        integrity = Integrity(packages)
        sys.path[:0] = paths
        _evict_shadowed(paths, packages)
        (run_unittest if framework == "unittest" else run_pytest)(test_ids, integrity, emit)
        emit("done")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
