"""Reading a repository's build files: what to install, how to test, where the code is.

The heuristic half of Autoinstall (``cursor_rl.tasks.autoinstall``): ``discover``
reads ``pyproject.toml`` (PEP 621 and Poetry), ``setup.cfg``, ``setup.py`` (parsed,
never executed), ``requirements*.txt``, ``tox.ini``, ``noxfile.py``, a ``Makefile``'s
test targets and CI workflows, and decides:

1. **Dependencies**: runtime plus test extras (``test``, ``tests``, ``testing``,
   ``dev``) and tox deps; the project itself is never a requirement (its tests must
   import the working tree).
2. **Test command**: the first usable one from tox, nox, the Makefile, then CI,
   normalized to ``python -m pytest ...`` or ``python -m unittest ...`` (anything
   else, or a command chaining shell operators, is not a test command); failing
   that, pytest when the repository is configured for or written for pytest, else
   ``unittest discover``.
3. **Layout**: ``src/`` layouts put ``src`` on ``sys.path``; the top-level packages
   and modules are what the smoke test imports.

Pure Python, no JAX.
"""

from __future__ import annotations

import ast
import configparser
import contextlib
import dataclasses
import os
import re
import shlex
import tomllib
from collections.abc import Iterable
from typing import Any

_SKIP_DIRS = frozenset(
    {".git", ".hg", ".tox", ".nox", ".venv", "venv", "env", "build", "dist", "__pycache__",
     "node_modules", ".eggs", "site-packages", ".mypy_cache", ".pytest_cache", "docs"}
)  # fmt: skip
_NOT_PACKAGES = frozenset({"tests", "test", "testing", "docs", "doc", "examples", "benchmarks"})
_NOT_MODULES = frozenset({"setup", "conftest", "noxfile", "fabfile", "tasks", "manage"})
_TEST_EXTRAS = ("test", "tests", "testing", "dev")
_TEST_TARGETS = ("test", "tests", "check", "unittest", "pytest")


@dataclasses.dataclass(frozen=True)
class Discovery:
    """What the build files say about installing and testing a repository.

    Attributes:
      build_files: the build/CI files found (relative paths).
      requirements: requirement specifiers to install.
      requirement_files: requirement files to install with ``-r``.
      framework: ``pytest`` or ``unittest``.
      test_command: the command that runs the tests, from the repository root.
      test_files: the test files (relative paths).
      python_path: directories put on ``sys.path`` so the project imports.
      packages: top-level packages and modules of the project (smoke test).
      notes: where each decision came from.
    """

    build_files: tuple[str, ...]
    requirements: tuple[str, ...]
    requirement_files: tuple[str, ...]
    framework: str
    test_command: str
    test_files: tuple[str, ...]
    python_path: tuple[str, ...]
    packages: tuple[str, ...]
    notes: tuple[str, ...] = ()


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def walk_files(repo: str) -> Iterable[str]:
    """Relative paths of files worth reading (build dirs and environments skipped)."""
    for dirpath, dirnames, filenames in os.walk(repo):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info")
        )
        for name in sorted(filenames):
            yield os.path.relpath(os.path.join(dirpath, name), repo).replace(os.sep, "/")


def _requirement_name(spec: str) -> str:
    return re.split(r"[\s\[<>=!~;@]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject(repo: str, notes: list[str]) -> tuple[list[str], str, bool]:
    """Dependencies, project name and whether pytest is configured, from pyproject.toml."""
    text = _read(os.path.join(repo, "pyproject.toml"))
    if not text:
        return [], "", False
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        notes.append(f"pyproject.toml does not parse: {e}")
        return [], "", False
    project = data.get("project", {})
    deps = list(project.get("dependencies", []))
    for extra in _TEST_EXTRAS:
        deps += project.get("optional-dependencies", {}).get(extra, [])
    poetry = data.get("tool", {}).get("poetry", {})
    for section in (poetry.get("dependencies", {}), poetry.get("dev-dependencies", {})):
        deps += [name for name in section if name.lower() != "python"]
    for group in poetry.get("group", {}).values():
        deps += [name for name in group.get("dependencies", {}) if name.lower() != "python"]
    name = project.get("name") or poetry.get("name", "")
    pytest_configured = "pytest" in data.get("tool", {})
    if deps:
        notes.append(f"pyproject.toml: {len(deps)} dependencies")
    return deps, name, pytest_configured


def read_config(path: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    with contextlib.suppress(configparser.Error):
        parser.read_string(_read(path))
    return parser


def _lines(value: str) -> list[str]:
    return [
        v.strip() for v in re.split(r"[\n;]", value) if v.strip() and not v.strip().startswith("#")
    ]


def _setup_cfg(repo: str) -> tuple[list[str], str, bool]:
    cfg = read_config(os.path.join(repo, "setup.cfg"))
    deps = _lines(cfg.get("options", "install_requires", fallback=""))
    for extra in _TEST_EXTRAS:
        deps += _lines(cfg.get("options.extras_require", extra, fallback=""))
    deps += _lines(cfg.get("options", "tests_require", fallback=""))
    return deps, cfg.get("metadata", "name", fallback=""), cfg.has_section("tool:pytest")


def _setup_py(repo: str, notes: list[str]) -> tuple[list[str], str]:
    """Literal ``install_requires``/``tests_require``/test extras of ``setup(...)``.

    Parsed, never executed: running a repository's setup.py outside the sandbox
    would run its code on the host.
    """
    text = _read(os.path.join(repo, "setup.py"))
    if not text:
        return [], ""
    try:
        module = ast.parse(text)
    except SyntaxError:
        notes.append("setup.py does not parse")
        return [], ""
    constants: dict[str, Any] = {}
    for node in module.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                with contextlib.suppress(ValueError):
                    constants[target.id] = ast.literal_eval(node.value)

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        try:
            return ast.literal_eval(node)
        except ValueError:
            return None

    deps: list[str] = []
    name = ""
    for node in ast.walk(module):
        if not (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", "")) == "setup"
        ):
            continue
        for kw in node.keywords:
            found = value(kw.value)
            if kw.arg in ("install_requires", "tests_require") and isinstance(found, list | tuple):
                deps += [d for d in found if isinstance(d, str)]
            elif kw.arg == "extras_require" and isinstance(found, dict):
                for extra in _TEST_EXTRAS:
                    deps += [d for d in found.get(extra, []) if isinstance(d, str)]
            elif kw.arg == "name" and isinstance(found, str):
                name = found
    return deps, name


def _requirement_files(repo: str, files: list[str]) -> list[str]:
    wanted = []
    for rel in files:
        name = rel.rsplit("/", 1)[-1]
        top = rel.count("/") == 0 or rel.startswith("requirements/")
        if top and name.endswith(".txt") and "requirement" in name and "doc" not in name:
            wanted.append(rel)
    return wanted


def _normalize_command(cmd: str) -> str | None:
    """A test command as ``python -m pytest ...``/``python -m unittest ...``, or None."""
    cmd = cmd.strip().lstrip("@-").strip()  # Make's silent / ignore-errors prefixes
    cmd = re.sub(r"\{posargs[^}]*\}|\{toxinidir\}/?", "", cmd)
    cmd = re.sub(r"\$\(PYTHON\)|\$\{PYTHON\}|\$PYTHON\b", "python", cmd)
    cmd = re.sub(r"\$\(PYTEST\)|\$\{PYTEST\}", "pytest", cmd)
    try:
        tokens = shlex.split(cmd)
    except ValueError:
        return None
    while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
        tokens = tokens[1:]  # leading VAR=value assignments
    if tokens[:3] == ["coverage", "run", "-m"]:
        tokens = ["python", "-m", *tokens[3:]]
    if not tokens:
        return None
    if tokens[0] in ("pytest", "py.test"):
        tokens = ["python", "-m", "pytest", *tokens[1:]]
    elif re.fullmatch(r"python[0-9.]*", tokens[0]):
        tokens = ["python", *tokens[1:]]
    if tokens[:3] not in (["python", "-m", "pytest"], ["python", "-m", "unittest"]):
        return None
    if any(t in ("&&", "||", ";", "|") for t in tokens):
        return None
    return shlex.join(tokens)


def _makefile_commands(text: str) -> list[str]:
    commands, target = [], None
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", line)
        if match:
            target = match.group(1)
        elif line.startswith("\t") and target in _TEST_TARGETS:
            commands.append(line.strip())
        elif line.strip() and not line.startswith("\t"):
            target = None
    return commands


def _tox_commands(repo: str) -> tuple[list[str], list[str]]:
    cfg = read_config(os.path.join(repo, "tox.ini"))
    section = "testenv" if cfg.has_section("testenv") else None
    if section is None:
        return [], []
    commands = _lines(cfg.get(section, "commands", fallback=""))
    deps = [
        d for d in _lines(cfg.get(section, "deps", fallback="")) if not d.startswith(("-", "."))
    ]
    return commands, deps


def _nox_commands(text: str) -> list[str]:
    commands = []
    for match in re.finditer(r"session\.run\(([^)]*)\)", text):
        try:
            args = ast.literal_eval(f"({match.group(1)},)")
        except (ValueError, SyntaxError):
            continue
        if all(isinstance(a, str) for a in args):
            commands.append(shlex.join(args))
    return commands


def _ci_commands(repo: str, files: list[str]) -> list[str]:
    commands = []
    for rel in files:
        if rel.startswith(".github/workflows/") or rel in (".travis.yml", ".gitlab-ci.yml"):
            for line in _read(os.path.join(repo, rel)).splitlines():
                match = re.match(
                    r"^\s*(?:-\s*)?(?:run:\s*|script:\s*)?(.*(?:pytest|unittest).*)$", line
                )
                if match:
                    commands.append(match.group(1).strip().strip("'\""))
    return commands


def _test_files(repo: str, files: list[str], framework: str) -> list[str]:
    pattern = re.compile(
        r"(^|/)(test_[^/]*|[^/]*_test)\.py$" if framework == "pytest" else r"(^|/)test[^/]*\.py$"
    )
    return [f for f in files if pattern.search(f) and not f.endswith("conftest.py")]


def _uses_pytest(repo: str, test_files: list[str]) -> bool:
    for rel in test_files:
        text = _read(os.path.join(repo, rel))
        if re.search(r"^\s*(import pytest|from pytest)", text, re.M):
            return True
        if re.search(r"^def test_", text, re.M) and "unittest" not in text:
            return True
    return False


def _layout(repo: str, files: list[str]) -> tuple[list[str], list[str]]:
    """(python_path, top-level packages and modules) of the project."""
    python_path = ["src", "."] if os.path.isdir(os.path.join(repo, "src")) else ["."]
    packages = []
    for root in python_path:
        base = os.path.join(repo, root)
        for entry in sorted(os.listdir(base)):
            full = os.path.join(base, entry)
            if entry in _NOT_PACKAGES or entry.startswith((".", "_")) or entry in _SKIP_DIRS:
                continue
            if os.path.isfile(os.path.join(full, "__init__.py")):
                packages.append(entry)
            elif entry.endswith(".py") and os.path.isfile(full):
                name = entry[:-3]
                if (
                    name not in _NOT_MODULES
                    and not name.startswith("test")
                    and not name.endswith("_test")
                ):
                    packages.append(name)
    return python_path, sorted(set(packages))


def discover(repo: str) -> Discovery:
    """Reads a repository's build files (see the module docstring).

    Args:
      repo: the repository directory.

    Returns:
      What to install, how to test, where the code is.
    """
    notes: list[str] = []
    files = list(walk_files(repo))
    build_names = (
        "pyproject.toml",
        "setup.py",
        "setup.cfg",
        "tox.ini",
        "noxfile.py",
        "Makefile",
        "pytest.ini",
    )
    build_files = [f for f in files if f in build_names or f.startswith(".github/workflows/")]
    build_files += [f for f in files if f in (".travis.yml", ".gitlab-ci.yml")]
    req_files = _requirement_files(repo, files)
    build_files += req_files
    deps, name, pytest_cfg = _pyproject(repo, notes)
    cfg_deps, cfg_name, cfg_pytest = _setup_cfg(repo)
    py_deps, py_name = _setup_py(repo, notes)
    tox_cmds, tox_deps = _tox_commands(repo)
    deps += cfg_deps + py_deps + tox_deps
    project = (
        _requirement_name(name or cfg_name or py_name) if (name or cfg_name or py_name) else ""
    )
    candidates: list[tuple[str, str]] = [(c, "tox.ini") for c in tox_cmds]
    candidates += [
        (c, "noxfile.py") for c in _nox_commands(_read(os.path.join(repo, "noxfile.py")))
    ]
    candidates += [
        (c, "Makefile") for c in _makefile_commands(_read(os.path.join(repo, "Makefile")))
    ]
    candidates += [(c, "CI") for c in _ci_commands(repo, files)]
    test_command = ""
    for raw, origin in candidates:
        normalized = _normalize_command(raw)
        if normalized:
            test_command = normalized
            notes.append(f"test command from {origin}: {raw!r}")
            break
    pytest_hint = (
        pytest_cfg
        or cfg_pytest
        or "pytest.ini" in files
        or "conftest.py" in [f.rsplit("/", 1)[-1] for f in files]
    )
    if test_command:
        framework = "pytest" if "pytest" in test_command else "unittest"
    else:
        framework = (
            "pytest"
            if pytest_hint or _uses_pytest(repo, _test_files(repo, files, "pytest"))
            else "unittest"
        )
    test_files = _test_files(repo, files, framework)
    if not test_command and test_files:
        if framework == "pytest":
            test_command = "python -m pytest -q"
        else:
            dirs = sorted({f.rsplit("/", 1)[0] if "/" in f else "." for f in test_files})
            start = dirs[0] if len(dirs) == 1 else "."
            test_command = f"python -m unittest discover -s {start} -t ."
        notes.append(f"test command from the test files ({framework})")
    if framework == "pytest" and "pytest" not in {_requirement_name(d) for d in deps}:
        deps.append("pytest")
    deps = [
        d for d in dict.fromkeys(d.strip() for d in deps) if d and _requirement_name(d) != project
    ]
    python_path, packages = _layout(repo, files)
    return Discovery(
        build_files=tuple(sorted(set(build_files))),
        requirements=tuple(deps),
        requirement_files=tuple(req_files),
        framework=framework,
        test_command=test_command,
        test_files=tuple(test_files),
        python_path=tuple(python_path),
        packages=tuple(packages),
        notes=tuple(notes),
    )
