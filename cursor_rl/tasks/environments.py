"""Where a task's tests run: the interpreter and what the sandbox must see of it.

A record's ``environment`` is a small JSON recipe:

    {"python": "/root/.pyenv/versions/3.11.7/bin/python3.11",
     "python_version": "3.11.7",
     "readonly_paths": ["/root/.pyenv/versions/3.11.7"],
     "python_path": ["."]}

``python`` runs the harness test runner inside the sandbox; ``readonly_paths`` are
the host directories it needs (its installation; for Autoinstall repositories also
the task's virtualenv); ``python_path`` are repository directories put first on
``sys.path``. Stdlib and tiny tasks use the interpreter whose standard library and
``test`` package they were cut from, not the system Python: the hidden tests are that
interpreter's tests.

A dataset built on one machine names that machine's interpreter; ``resolve`` maps a
recorded interpreter that does not exist here to the running one when the
``major.minor`` version matches, and fails clearly otherwise.

Pure Python, no JAX.
"""

from __future__ import annotations

import glob
import os
import platform
import sys
from collections.abc import Mapping
from typing import Any


class TaskEnvironmentError(RuntimeError):
    """A task's environment cannot be provided on this machine."""


def base_interpreter() -> str:
    """The running interpreter's base installation binary (outside any virtualenv)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidate = os.path.join(sys.base_prefix, "bin", version)
    return candidate if os.path.exists(candidate) else os.path.realpath(sys.executable)


def interpreter_environment() -> dict[str, Any]:
    """The environment recipe of the running interpreter's base installation."""
    return {
        "python": base_interpreter(),
        "python_version": platform.python_version(),
        "readonly_paths": [os.path.realpath(sys.base_prefix)],
        "python_path": ["."],
    }


def stdlib_copies_of(module: str, environment: Mapping[str, Any]) -> list[str]:
    """Host paths that would show a stdlib task's solution or hidden tests to the agent.

    The interpreter that runs a stdlib task carries the module's original source and
    its unit tests (``lib/pythonX.Y/NAME.py``, ``test/test_NAME.py``, their bytecode),
    and so may the system Python under ``/usr/lib``, which every sandbox mounts. A
    record lists them as ``environment["hidden_paths"]``; the episode's sandbox must
    mask them (see ``cursor_rl.tasks.grading.sandbox_kwargs``).
    """
    roots = set()
    python = environment.get("python") or base_interpreter()
    prefix = os.path.realpath(os.path.join(os.path.dirname(python), ".."))
    roots |= set(glob.glob(os.path.join(prefix, "lib", "python3*")))
    roots |= set(glob.glob("/usr/lib/python3*"))
    patterns = (
        f"{module}.py",
        f"_py{module}.py",
        f"__pycache__/{module}.*.pyc",
        f"__pycache__/_py{module}.*.pyc",
        f"test/test_{module}.py",
        f"test/test_{module}_*.py",
        f"test/test_{module}",
        f"test/__pycache__/test_{module}.*.pyc",
        f"test/__pycache__/test_{module}_*.pyc",
    )
    found = {
        p for root in roots for pattern in patterns for p in glob.glob(os.path.join(root, pattern))
    }
    return sorted(os.path.realpath(p) for p in found)


def resolve(environment: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe usable on this machine (see the module docstring).

    An empty recipe means the running interpreter's base installation.

    Raises:
      TaskEnvironmentError: the recorded interpreter is missing and the running one has a
        different ``major.minor`` version.
    """
    if not environment.get("python"):  # no recipe: the running interpreter's installation
        return interpreter_environment()
    env = dict(environment)
    if os.path.exists(env["python"]):
        return env
    recorded = ".".join(str(env.get("python_version", "")).split(".")[:2])
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    if recorded != running or env.get("venv"):
        raise TaskEnvironmentError(
            f"the task's interpreter {env['python']} (Python {recorded}) does not exist here "
            f"and the running Python is {running}"
        )
    local = interpreter_environment()
    old_prefix = os.path.realpath(os.path.join(os.path.dirname(env["python"]), ".."))
    new_prefix = local["readonly_paths"][0]
    env.update(python=local["python"], readonly_paths=local["readonly_paths"])
    env["hidden_paths"] = [  # the same files in this machine's installation
        new_prefix + p[len(old_prefix) :] if p.startswith(old_prefix + "/") else p
        for p in env.get("hidden_paths", [])
    ]
    return env
