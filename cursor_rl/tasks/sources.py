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

``repo_source`` turns a repository path or sdist into a source: Autoinstall builds
and checks its environment; the tree is read as text (binary files are left out);
the discovered test files are hidden; code files under the project's packages are
the generators' targets.

Pure Python, no JAX.
"""

from __future__ import annotations

import glob
import os
import platform
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from collections.abc import Iterator

from cursor_rl.data import splits
from cursor_rl.tasks import autoinstall, buildfiles, environments
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
            raise ValueError(f"{module!r} is not a {split} module (see cursor_rl.data.splits)")
        yield stdlib_repo(module)


def fetch_sdist(requirement: str, dest: str) -> str:
    """Downloads a PyPI source distribution with pip and unpacks it; returns its root.

    Raises:
      AutoinstallFailed: pip could not download it or the archive is not an sdist.
    """
    download = os.path.join(dest, "download")
    os.makedirs(download, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", "-d", download, requirement]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    archives = sorted(
        glob.glob(os.path.join(download, "*.tar.gz")) + glob.glob(os.path.join(download, "*.zip"))
    )
    if proc.returncode != 0 or not archives:
        result = autoinstall.AutoinstallResult(
            requirement, False, "fetch_failed", None, proc.stdout + proc.stderr, dest
        )
        raise autoinstall.AutoinstallFailed(result)
    src = os.path.join(dest, "src")
    os.makedirs(src, exist_ok=True)
    if archives[0].endswith(".zip"):
        with zipfile.ZipFile(archives[0]) as zf:
            zf.extractall(src)
    else:
        with tarfile.open(archives[0]) as tf:
            tf.extractall(src, filter="data")
    roots = [os.path.join(src, d) for d in os.listdir(src) if os.path.isdir(os.path.join(src, d))]
    return roots[0] if len(roots) == 1 else src


def repo_source(
    spec: str, workdir: str, config: autoinstall.AutoinstallConfig | None = None
) -> SourceRepo:
    """A repository (``PATH`` or ``sdist:NAME[==VERSION]``) as a task source, via Autoinstall.

    Raises:
      AutoinstallFailed: the repository could not be installed and tested (the
        result, with its reason and log, is attached and written under ``workdir``).
    """
    os.makedirs(workdir, exist_ok=True)
    if spec.startswith("sdist:"):
        path = fetch_sdist(spec[len("sdist:") :], workdir)
        repo_id = "pypi:" + spec[len("sdist:") :]
    else:
        path = os.path.abspath(spec)
        repo_id = path
    result = autoinstall.autoinstall(path, workdir, config)
    if not result.ok:
        raise autoinstall.AutoinstallFailed(result)
    recipe = result.recipe
    tree = {}
    for rel in buildfiles.walk_files(path):
        try:
            with open(os.path.join(path, rel), encoding="utf-8") as f:
                tree[rel] = f.read()
        except (UnicodeDecodeError, OSError):
            continue  # binary files are not part of a text task tree
    test_files = tuple(f for f in recipe.test_files if f in tree)
    targets = {}
    for rel in tree:
        if not rel.endswith(".py") or rel in test_files:
            continue
        for root in recipe.python_path:
            prefix = "" if root == "." else root.rstrip("/") + "/"
            inner = rel[len(prefix) :] if rel.startswith(prefix) else None
            if inner is None:
                continue
            dotted = inner[: -len(".py")].replace("/", ".").removesuffix(".__init__")
            if dotted.split(".")[0] in recipe.packages:
                targets[rel] = dotted
                break
    name = os.path.basename(os.path.normpath(path))
    return SourceRepo(
        name=re.sub(r"[^A-Za-z0-9_.-]", "_", name),
        tree=tree,
        test_files=test_files,
        target_files=targets,
        test_framework=recipe.framework,
        test_command=recipe.test_command,
        setup_commands=recipe.install_commands,
        source="sdist" if spec.startswith("sdist:") else "local",
        repo=repo_id,
        family="repo",
        environment=recipe.environment(),
    )
