"""Sources of working repositories: the standard library, tiny modules, any repository.

Source specs, as the build command takes them:

    stdlib            CPython modules with their tests from the interpreter's ``test``
                      package (``splits.stdlib_modules(split)``)
    tiny              generated tiny modules (``cursor_rl.tasks.tiny``), seeds of the split
    PATH              a local repository, installed and tested through Autoinstall
    sdist:NAME[==V]   a PyPI source distribution fetched with pip, then as PATH

A stdlib task repository is two files at its root: ``NAME.py`` (the module's source,
copied from the interpreter) and ``test_NAME.py`` (its unit tests from the ``test``
package, hidden from the agent). At the root, the copy shadows the interpreter's own
module for the tests (the harness runner evicts modules it imported itself), and
``from test import support`` still finds the interpreter's test helpers.

Pure Python, no JAX.
"""

from __future__ import annotations

import os
import platform
import sysconfig
from collections.abc import Iterator

from cursor_rl.tasks import environments, splits
from cursor_rl.tasks.generators.base import SourceRepo


def stdlib_dir() -> str:
    """The running interpreter's standard library directory."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_repo(module: str) -> SourceRepo:
    """The task repository of one single-file stdlib module and its unit tests.

    Raises:
      FileNotFoundError: the module is not a single file, or it has no test file
        (some distributions strip the ``test`` package).
    """
    root = stdlib_dir()
    source = os.path.join(root, f"{module}.py")
    tests = os.path.join(root, "test", f"test_{module}.py")
    for path in (source, tests):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist (is the `test` package installed?)")
    tree = {}
    for path, rel in ((source, f"{module}.py"), (tests, f"test_{module}.py")):
        with open(path, encoding="utf-8") as f:
            tree[rel] = f.read()
    environment = environments.interpreter_environment()
    environment["hidden_paths"] = environments.stdlib_copies_of(module, environment)
    return SourceRepo(
        name=module,
        tree=tree,
        test_files=(f"test_{module}.py",),
        target_files={f"{module}.py": module},
        test_framework="unittest",
        test_command=f"python -m unittest test_{module}",
        source="stdlib",
        repo=f"cpython-{platform.python_version()}",
        family="stdlib",
        environment=environment,
    )


def stdlib_repos(split: str, modules: tuple[str, ...] | None = None) -> Iterator[SourceRepo]:
    """The stdlib repositories of ``split`` (or the named subset of its modules).

    Raises:
      ValueError: a named module is not in the split (the split must stay clean).
    """
    allowed = splits.stdlib_modules(split)
    for module in modules or allowed:
        if module not in allowed:
            raise ValueError(f"{module!r} is not a {split} module (see cursor_rl.tasks.splits)")
        yield stdlib_repo(module)
