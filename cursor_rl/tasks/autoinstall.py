"""Autoinstall: make any Python repository installable and testable, then prove it.

Before RL on real repositories, Cursor had an agent explore each repository, work
out its install commands and write validation tests. This module does the same in
two modes:

* **heuristic** (``autoinstall``): read the build files (``pyproject.toml``,
  ``setup.py``/``setup.cfg``, ``requirements*.txt``, ``tox.ini``, ``noxfile.py``,
  ``Makefile``, CI workflows; ``cursor_rl.tasks.buildfiles.discover``), collect the
  dependencies and the test command, create a virtualenv, install, write the
  validation test and run it;
* **agent** (``agent_install``): a model gets the repository in the harness sandbox
  with the harness tools (``cursor_rl.env.tools``) and proposes the commands itself;
  its recipe is then checked by the same validation test, and the heuristic mode runs
  as the fallback when the agent's recipe fails. Tests use the heuristic mode as the
  oracle (a scripted agent replays its plan).

``cursor_rl.tasks.sources.repo_source`` turns an installed repository into a task
source; ``python -m cursor_rl.tasks.autoinstall --out=DIR PATH...`` installs a batch.
From the task builder, ``python -m cursor_rl.tasks.build --source=PATH
--autoinstall=heuristic|agent|scripted`` picks the mode (choice 5).

Design choices:

1. **Everything a repository controls runs in the sandbox** (``setup.py`` and build
   backends execute code at install time): the sandbox workspace is the
   environment directory ``ENV/`` holding ``repo/`` (a copy) and ``venv/``; the
   network allow-list admits only the package index (the host's pip configuration
   is carried in: its index URLs become allowed hosts, local ``file://`` indexes and
   ``--find-links`` directories are mounted read-only).
2. **Dependencies are installed, the project is not.** Tests must exercise the
   agent's working tree, not a copy in ``site-packages``; the project's code is put
   on ``sys.path`` (``python_path``: ``src`` for src layouts, else the root). A
   project that needs compiling (C extensions) is recorded as a failure.
3. **The validation test** (``ENV/autoinstall_check.py``, a unittest file) imports
   every top-level package of the project (smoke test) and runs the discovered test
   command, which must run tests and pass ``min_pass_fraction`` of them (90% by
   default: a test that needs what the machine lacks should not sink a repository).
   The recipe (``recipe.json``) records the interpreter, the virtualenv, the install
   commands and the test command, so the environment can be rebuilt and checked.
4. **Failures are data.** ``autoinstall`` never raises: a failure returns a result
   with a reason from ``FAILURE_REASONS`` and writes ``failure.json`` plus the log, so
   a batch over many repositories always finishes.
5. **The agent is part of the settings.** ``AutoinstallConfig.agent`` (an ``Agent``:
   a policy per repository, its chat format, a turn limit) switches ``autoinstall``
   itself to the agent mode, so every caller (``sources.repo_source``, the task
   builder) runs it unchanged. Two agents: ``model_agent(PATH)``, a policy sampled
   from a trainer checkpoint, an HF directory or a built-in base (``tiny``), and
   ``scripted_agent()``, which replays the heuristic plan through the harness tools
   (list the repository, run each install command, write the recipe, submit): the
   agent mode's plumbing end to end without a model, and its baseline. Which one
   ran is logged first in ``autoinstall.log``; the recipe's ``mode`` says whether
   the agent's recipe or the heuristic fallback was kept. The scripted agent's
   tokens only carry its text to the harness and back, so any byte-level tokenizer
   with the chat tokens does: it trains a small one on the agent's prompt (no model,
   no file).

Pure Python, no JAX (``model_agent`` and ``resolve_policy`` import it when called).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import traceback
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from absl import flags

from cursor_rl.chat.protocol import ChatFormat, Message, ToolCall
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.env.harness import AgentEpisode
from cursor_rl.env.sandbox import Limits, Sandbox, unavailable_reason
from cursor_rl.env.tools import TOOL_SPECS, Tools
from cursor_rl.tasks import buildfiles, environments

FAILURE_REASONS = (
    "fetch_failed",  # the sdist could not be downloaded or unpacked
    "no_tests_found",  # no test files and no test command
    "sandbox_unavailable",  # this machine cannot run sandboxes
    "venv_failed",  # the virtualenv could not be created
    "install_failed",  # pip failed
    "import_failed",  # the smoke test could not import the project
    "tests_failed",  # the discovered test command did not exit 0
    "crashed",  # an unexpected error (traceback in the log)
)
CHECK_FILE = "autoinstall_check.py"
RECIPE_FILE = "recipe.json"
FAILURE_FILE = "failure.json"
LOG_FILE = "autoinstall.log"
AGENT_RECIPE_FILE = "autoinstall.json"  # what the agent writes in its workspace
_PYPI_HOSTS = ("pypi.org:443", "files.pythonhosted.org:443")
_PIP_KEYS = ("index-url", "extra-index-url", "find-links", "cert")
_PIP_CONFIG_FILES = (
    "/etc/pip.conf",
    "/etc/xdg/pip/pip.conf",
    "~/.pip/pip.conf",
    "~/.config/pip/pip.conf",
)


class AutoinstallFailed(RuntimeError):
    """A repository could not be installed (``result`` holds the reason and log)."""

    def __init__(self, result: AutoinstallResult):
        super().__init__(f"autoinstall of {result.repo} failed: {result.reason}")
        self.result = result


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A recorded, validated environment (written as ``recipe.json``).

    Attributes:
      repo: the repository path installed.
      mode: ``heuristic`` or ``agent``.
      python: the virtualenv's interpreter (host path).
      python_version: its version.
      venv: the virtualenv directory.
      readonly_paths: what a sandbox must mount to run ``python``.
      python_path: repository directories put first on ``sys.path``.
      install_commands: the commands that built the environment (run in ``ENV/``).
      test_command: the test command (run in the repository with the venv first on PATH).
      framework: ``pytest`` or ``unittest``.
      test_files: the test files.
      packages: the project's top-level packages and modules.
      build_files: the build files read.
    """

    repo: str
    mode: str
    python: str
    python_version: str
    venv: str
    readonly_paths: tuple[str, ...]
    python_path: tuple[str, ...]
    install_commands: tuple[str, ...]
    test_command: str
    framework: str
    test_files: tuple[str, ...]
    packages: tuple[str, ...]
    build_files: tuple[str, ...] = ()

    def environment(self) -> dict[str, Any]:
        """The environment recipe a task record carries (see ``environments``)."""
        return {
            "python": self.python,
            "python_version": self.python_version,
            "readonly_paths": list(self.readonly_paths),
            "python_path": list(self.python_path),
            "venv": self.venv,
        }


@dataclasses.dataclass(frozen=True)
class AutoinstallResult:
    """The outcome for one repository (``ok`` with a recipe, or a reason and a log)."""

    repo: str
    ok: bool
    reason: str
    recipe: Recipe | None
    log: str
    workdir: str


# A policy maps the prompt's token ids to one sampled assistant turn's token ids.
Policy = Callable[[list[int]], list[int]]


@dataclasses.dataclass(frozen=True)
class Agent:
    """Who runs the agent mode (choice 5).

    Attributes:
      name: what it is, for the log (``scripted``, or the model's path).
      chat: the ``ChatFormat`` of the policy's tokenizer.
      policy_for: the policy for one repository (its path); called once per
        repository, inside the agent run (its errors fall back to the heuristic).
      max_turns: assistant turns before the episode is cut.
    """

    name: str
    chat: ChatFormat
    policy_for: Callable[[str], Policy]
    max_turns: int = 30


@dataclasses.dataclass(frozen=True)
class AutoinstallConfig:
    """Settings of Autoinstall.

    Attributes:
      pip_args: pip options for every install; None derives them from the host's pip
        configuration (index URLs, find-links), see choice 1.
      allow_hosts: endpoints the install sandbox may reach; None: the package
        indexes of ``pip_args`` plus PyPI.
      base_python: the interpreter the virtualenv is made from (None: the running
        one's base installation).
      min_pass_fraction: the share of the discovered tests that must pass (see
        ``check_source``).
      install_timeout_s: limit of each install command.
      check_timeout_s: limit of the validation test.
      limits: sandbox limits (None: the harness defaults).
      agent: None for the heuristic mode; an ``Agent`` for the agent mode with the
        heuristic as its fallback (choice 5).
    """

    pip_args: tuple[str, ...] | None = None
    allow_hosts: tuple[str, ...] | None = None
    base_python: str | None = None
    min_pass_fraction: float = 0.9
    install_timeout_s: float = 900.0
    check_timeout_s: float = 600.0
    limits: Limits | None = None
    agent: Agent | None = None


# ---- pip configuration and the install sandbox ----


def host_pip_options() -> tuple[list[str], list[str], list[str]]:
    """(pip args, allowed hosts, read-only paths) from the host's pip configuration.

    Index URLs and find-links become ``--index-url``/``--extra-index-url``/``--find-links``
    (remote ones add their host to the allow-list, local ones are mounted); a
    configured CA bundle (``cert``) is passed on, since the sandbox has no pip config.
    """
    settings: dict[str, list[str]] = {key: [] for key in _PIP_KEYS}
    for path in _PIP_CONFIG_FILES:
        cfg = buildfiles.read_config(os.path.expanduser(path))
        for key in _PIP_KEYS:
            settings[key] += cfg.get("global", key, fallback="").split()
    for key in _PIP_KEYS:
        settings[key] += os.environ.get("PIP_" + key.upper().replace("-", "_"), "").split()
    args, hosts, paths = [], list(_PYPI_HOSTS), []
    for key in _PIP_KEYS:
        for value in dict.fromkeys(settings[key]):
            parsed = urllib.parse.urlparse(value)
            if parsed.scheme in ("http", "https"):
                port = parsed.port or (443 if parsed.scheme == "https" else 80)
                hosts.append(f"{parsed.hostname}:{port}")
            else:
                local = parsed.path if parsed.scheme == "file" else value
                if not os.path.exists(local):
                    continue
                local = os.path.realpath(local if os.path.isdir(local) else os.path.dirname(local))
                # A PEP 503 index's pages link to files beside it (../../files/...).
                paths.append(os.path.dirname(local) if local.endswith("/simple") else local)
            args += [f"--{key}", value]
            if key == "cert":
                break  # one CA bundle
    return args, list(dict.fromkeys(hosts)), list(dict.fromkeys(paths))


def _reachable(hosts: Sequence[str]) -> list[str]:
    """The hosts that resolve (the sandbox resolves its allow-list up front)."""
    found = []
    for entry in hosts:
        host, _, port = entry.rpartition(":")
        try:
            socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError):
            continue
        found.append(entry)
    return found


class _Installer:
    """Runs commands in the install sandbox over ``ENV/`` (repo copy + venv)."""

    def __init__(self, repo: str, workdir: str, config: AutoinstallConfig):
        self.repo = os.path.abspath(repo)
        self.workdir = os.path.abspath(workdir)
        self.env_dir = os.path.join(self.workdir, "env")
        self.config = config
        pip_args, hosts, paths = host_pip_options()
        self.pip_args = list(config.pip_args) if config.pip_args is not None else pip_args
        self.allow_hosts = _reachable(
            config.allow_hosts if config.allow_hosts is not None else hosts
        )
        self.base_python = config.base_python or environments.base_interpreter()
        base_prefix = os.path.realpath(os.path.join(os.path.dirname(self.base_python), ".."))
        self.readonly = sorted({base_prefix, *paths})
        self.log: list[str] = []

    def prepare(self) -> None:
        if os.path.exists(self.env_dir):
            shutil.rmtree(self.env_dir)
        os.makedirs(self.env_dir)
        shutil.copytree(
            self.repo,
            os.path.join(self.env_dir, "repo"),
            ignore=shutil.ignore_patterns(".git", ".tox", ".nox", "__pycache__", "*.pyc", ".venv"),
            symlinks=True,
        )

    def sandbox(self) -> Sandbox:
        path = "/workspace/venv/bin:/usr/local/bin:/usr/bin:/bin"
        return Sandbox(
            self.env_dir,
            allow_hosts=self.allow_hosts,
            limits=self.config.limits,
            readonly_paths=self.readonly,
            env={"PATH": path, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        )

    def run(self, sb: Sandbox, cmd: str, timeout_s: float) -> bool:
        result = sb.run(cmd, timeout_s=timeout_s)
        status = f"exit {result.exit_code}" + (", timed out" if result.timed_out else "")
        self.log.append(f"$ {cmd}\n[{status}]\n{result.stdout[-6000:]}{result.stderr[-6000:]}")
        return result.exit_code == 0 and not result.timed_out

    def install_commands(self, discovery: buildfiles.Discovery) -> list[str]:
        commands = [shlex.join([self.base_python, "-m", "venv", "venv"])]
        specs = list(discovery.requirements)
        for rel in discovery.requirement_files:
            specs += ["-r", f"repo/{rel}"]
        if specs:
            commands.append(
                shlex.join(["venv/bin/python", "-m", "pip", "install", *self.pip_args, *specs])
            )
        return commands

    def write_check(self, recipe_parts: dict[str, Any]) -> None:
        with open(os.path.join(self.env_dir, CHECK_FILE), "w", encoding="utf-8") as f:
            f.write(
                check_source(
                    recipe_parts["packages"],
                    recipe_parts["python_path"],
                    recipe_parts["test_command"],
                    self.config.min_pass_fraction,
                )
            )

    def check(self, sb: Sandbox) -> str:
        """Runs the validation test; returns a failure reason or ``""``."""
        result = sb.run(f"venv/bin/python {CHECK_FILE} -v", timeout_s=self.config.check_timeout_s)
        output = result.stdout[-8000:] + result.stderr[-8000:]
        self.log.append(f"$ venv/bin/python {CHECK_FILE} -v\n[exit {result.exit_code}]\n{output}")
        if result.exit_code == 0:
            return ""
        if re.search(r"test_imports \(.*\) \.\.\. (FAIL|ERROR)", output):
            return "import_failed"
        return "tests_failed"


def check_source(
    packages: Sequence[str],
    python_path: Sequence[str],
    test_command: str,
    min_pass_fraction: float = 1.0,
) -> str:
    """The validation test: import smoke test plus the discovered test command.

    The suite must run (pytest or unittest report counts), pass at least one test,
    and pass at least ``min_pass_fraction`` of those that ran: real repositories
    often have a test or two that need something the machine lacks, and the task
    builder uses only tests that pass stably anyway.
    """
    return f'''"""Autoinstall validation test (generated by cursor_rl.tasks.autoinstall).

Run from the environment directory with the virtualenv's interpreter:
    venv/bin/python {CHECK_FILE}
"""

import importlib
import os
import re
import subprocess
import sys
import unittest

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "repo")
PYTHON_PATH = {list(python_path)!r}
PACKAGES = {list(packages)!r}
TEST_COMMAND = {test_command!r}
MIN_PASS_FRACTION = {min_pass_fraction!r}


def counts(output):
    """(passed, failed) from a pytest summary line or a unittest report."""
    found = dict((k, int(n)) for n, k in re.findall(r"(\\d+) (passed|failed|errors?)\\b", output))
    if "passed" in found or "failed" in found:
        bad = found.get("failed", 0) + found.get("error", 0) + found.get("errors", 0)
        return found.get("passed", 0), bad
    ran = re.search(r"^Ran (\\d+) tests?", output, re.M)
    if not ran:
        return 0, 0
    bad = sum(int(n) for n in re.findall(r"(?:failures|errors)=(\\d+)", output))
    skipped = sum(int(n) for n in re.findall(r"skipped=(\\d+)", output))
    return int(ran.group(1)) - bad - skipped, bad


class AutoinstallCheck(unittest.TestCase):
    def test_imports(self):
        sys.path[:0] = [os.path.join(REPO, p) for p in PYTHON_PATH]
        for name in PACKAGES:
            with self.subTest(package=name):
                importlib.import_module(name)

    def test_suite(self):
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        env["PYTHONPATH"] = os.pathsep.join(os.path.join(REPO, p) for p in PYTHON_PATH)
        result = subprocess.run(TEST_COMMAND, shell=True, cwd=REPO, env=env,
                                capture_output=True, text=True)
        output = result.stdout + result.stderr
        passed, failed = counts(output)
        print(f"suite: {{passed}} passed, {{failed}} failed, exit {{result.returncode}}")
        tail = output[-3000:]
        self.assertIn(result.returncode, (0, 1), tail)
        self.assertGreater(passed, 0, tail)
        self.assertGreaterEqual(passed, MIN_PASS_FRACTION * (passed + failed), tail)


if __name__ == "__main__":
    unittest.main()
'''


def _finish(
    workdir: str, repo: str, reason: str, recipe: Recipe | None, log: list[str]
) -> AutoinstallResult:
    text = "\n".join(log)
    with open(os.path.join(workdir, LOG_FILE), "w", encoding="utf-8") as f:
        f.write(text)
    if recipe is not None and not reason:
        with open(os.path.join(workdir, RECIPE_FILE), "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(recipe), f, indent=2)
    else:
        with open(os.path.join(workdir, FAILURE_FILE), "w", encoding="utf-8") as f:
            json.dump(
                {"repo": repo, "reason": reason, "log": LOG_FILE, "tail": text[-4000:]}, f, indent=2
            )
    return AutoinstallResult(
        repo, not reason, reason, recipe if not reason else None, text, workdir
    )


def _recipe(
    installer: _Installer, discovery: buildfiles.Discovery, commands: Sequence[str], mode: str
) -> Recipe:
    venv = os.path.join(installer.env_dir, "venv")
    return Recipe(
        repo=installer.repo,
        mode=mode,
        python=os.path.join(venv, "bin", "python"),
        python_version=_version_of(installer.base_python),
        venv=venv,
        readonly_paths=tuple(sorted({os.path.realpath(venv), *installer.readonly})),
        python_path=discovery.python_path,
        install_commands=tuple(commands),
        test_command=discovery.test_command,
        framework=discovery.framework,
        test_files=discovery.test_files,
        packages=discovery.packages,
        build_files=discovery.build_files,
    )


def _version_of(python: str) -> str:
    try:
        out = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def autoinstall(
    repo: str,
    workdir: str,
    config: AutoinstallConfig | None = None,
    *,
    discovery: buildfiles.Discovery | None = None,
) -> AutoinstallResult:
    """Autoinstall of one repository; never raises (choice 4).

    The heuristic mode, or with ``config.agent`` the agent mode (``agent_install``,
    the heuristic mode its fallback; choice 5).

    Args:
      repo: the repository directory (left untouched).
      workdir: where the environment (``env/``), recipe, validation test and logs go.
      config: settings.
      discovery: use this plan instead of reading the build files (the agent mode
        passes its own).

    Returns:
      The result; ``result.recipe`` is set when the validation test passed.
    """
    config = config or AutoinstallConfig()
    if config.agent is not None and discovery is None:
        agent = config.agent
        return agent_install(
            repo,
            workdir,
            _lazy_policy(agent, repo),
            agent.chat,
            config,
            max_turns=agent.max_turns,
        )
    os.makedirs(workdir, exist_ok=True)
    log: list[str] = []
    try:
        reason = unavailable_reason()
        if reason is not None:
            return _finish(workdir, repo, "sandbox_unavailable", None, [reason])
        discovery = discovery or buildfiles.discover(repo)
        log.append(f"discovery: {json.dumps(dataclasses.asdict(discovery), indent=1)}")
        if not discovery.test_command or not discovery.test_files:
            return _finish(workdir, repo, "no_tests_found", None, log)
        installer = _Installer(repo, workdir, config)
        installer.log = log
        installer.prepare()
        commands = installer.install_commands(discovery)
        installer.write_check(dataclasses.asdict(discovery))
        with installer.sandbox() as sb:
            for i, cmd in enumerate(commands):
                if not installer.run(sb, cmd, config.install_timeout_s):
                    return _finish(
                        workdir, repo, "venv_failed" if i == 0 else "install_failed", None, log
                    )
            reason = installer.check(sb)
        recipe = _recipe(installer, discovery, commands, "heuristic")
        return _finish(workdir, repo, reason, recipe, log)
    except Exception:  # a batch must survive anything one repository does (choice 4)
        log.append(traceback.format_exc())
        return _finish(workdir, repo, "crashed", None, log)


def autoinstall_batch(
    repos: Sequence[str], out: str, config: AutoinstallConfig | None = None
) -> list[AutoinstallResult]:
    """Autoinstall of many repositories into ``out/<index>-<name>/``; never raises."""
    results = []
    for i, repo in enumerate(repos):
        name = os.path.basename(os.path.normpath(repo)) or "repo"
        results.append(autoinstall(repo, os.path.join(out, f"{i:04d}-{name}"), config))
    return results


# ---- agent mode ----

AGENT_SYSTEM = (
    "You set up Python repositories so that their tests can run. You work in a sandbox "
    "through tools; the repository is in `repo/`."
)
AGENT_TASK = """Make the repository in `repo/` installable and testable.

1. Create a virtualenv: `{python} -m venv venv` (in the workspace root, not in repo/).
2. Install what the repository needs to run its tests with
   `venv/bin/python -m pip install {pip_args}...` (read pyproject.toml, setup.py,
   setup.cfg, requirements*.txt, tox.ini, Makefile, CI files).
   Do not install the project itself: its tests must import the code in repo/.
3. Find the command that runs the tests from inside repo/ (`python` is the venv's).
4. Write `{recipe_file}` (workspace root) as JSON with the keys: "install_commands" (the
   commands you ran, from the workspace root), "test_command", "framework" ("pytest" or
   "unittest"), "python_path" (directories of repo/ to put on sys.path, e.g. ["."] or
   ["src", "."]), "packages" (the project's top-level import names), "test_files".
5. Call submit.
"""


def agent_install(
    repo: str,
    workdir: str,
    policy: Policy,
    chat: Any,
    config: AutoinstallConfig | None = None,
    *,
    max_turns: int = 30,
) -> AutoinstallResult:
    """Agent-mode Autoinstall, with the heuristic mode as the fallback; never raises.

    The model works in the install sandbox with the harness tools
    (``cursor_rl.env.tools``) and writes its recipe; the recipe is accepted only if the
    validation test passes in a fresh sandbox with the environment it built.

    Args:
      repo: the repository directory.
      workdir: as for ``autoinstall``.
      policy: the model (``Policy``), e.g. a ``Sampler.generate`` wrapper.
      chat: the ``cursor_rl.chat.protocol.ChatFormat`` of the model's tokenizer.
      config: settings.
      max_turns: assistant turns before the episode is cut.

    Returns:
      The agent's result (``recipe.mode == "agent"``) or the heuristic fallback's.
    """
    config = config or AutoinstallConfig()
    heuristic = dataclasses.replace(config, agent=None)
    os.makedirs(workdir, exist_ok=True)
    log: list[str] = [f"agent: {config.agent.name if config.agent else 'caller-supplied policy'}"]
    try:
        if unavailable_reason() is not None:
            return _finish(workdir, repo, "sandbox_unavailable", None, [str(unavailable_reason())])
        installer = _Installer(repo, workdir, config)
        installer.log = log
        installer.prepare()
        task = AGENT_TASK.format(
            python=installer.base_python,
            pip_args=" ".join(installer.pip_args) + " " if installer.pip_args else "",
            recipe_file=AGENT_RECIPE_FILE,
        )
        with installer.sandbox() as sb:
            tools = Tools(sb)
            episode = AgentEpisode(chat, TOOL_SPECS, tools.execute, system=AGENT_SYSTEM, task=task,
                                   max_turns=max_turns)  # fmt: skip
            while not episode.done:
                step = episode.step(policy(episode.prompt()))
                for call, result in zip(step.parsed.calls, step.results):
                    log.append(f"agent: {call}\n{result.text[-2000:]}")
                if not step.parsed.calls:  # the turn that ended the episode
                    log.append(f"agent turn {episode.turns} made no call: "
                               f"{step.parsed.content[-500:]!r}")  # fmt: skip
            if not episode.submitted and episode.turns >= max_turns:
                log.append(f"agent cut off after max_turns={max_turns} turns")
        claimed = _agent_recipe(os.path.join(installer.env_dir, AGENT_RECIPE_FILE))
        if claimed is not None:
            discovery, commands = claimed
            installer.write_check(dataclasses.asdict(discovery))
            with installer.sandbox() as sb:
                reason = installer.check(sb)
            if not reason:
                return _finish(
                    workdir, repo, "", _recipe(installer, discovery, commands, "agent"), log
                )
            log.append(f"agent recipe rejected by the validation test: {reason}")
        else:
            log.append("the agent wrote no valid recipe")
    except Exception:
        log.append(traceback.format_exc())
    fallback = autoinstall(repo, os.path.join(workdir, "heuristic"), heuristic)
    note = "\n".join(log)
    with open(os.path.join(workdir, LOG_FILE), "w", encoding="utf-8") as f:
        f.write(note + "\n--- heuristic fallback ---\n" + fallback.log)
    return dataclasses.replace(fallback, log=note + "\n--- heuristic fallback ---\n" + fallback.log)


def _lazy_policy(agent: Agent, repo: str) -> Policy:
    """``agent.policy_for(repo)``, made at the first turn (inside the agent run, whose
    errors fall back to the heuristic) and kept for the rest of the episode."""
    made: list[Policy] = []

    def policy(prompt: list[int]) -> list[int]:
        if not made:
            made.append(agent.policy_for(repo))
        return made[0](prompt)

    return policy


def scripted_agent(config: AutoinstallConfig | None = None, *, max_turns: int = 30) -> Agent:
    """The scripted agent (choice 5): the heuristic plan replayed through the tools.

    Per repository it reads the build files (``buildfiles.discover``, host side, read
    only), then plays one tool call per turn: ``list_dir repo``, each install command
    with ``run_terminal`` (in the sandbox), the recipe written with ``edit_file``, and
    ``submit``; after its plan it ends the episode with a turn without calls.

    Args:
      config: the settings the install commands are made with (pip options).
      max_turns: assistant turns before the episode is cut (a plan needs 3 + the
        number of install commands).
    """
    config = config or AutoinstallConfig()
    schemas = [json.dumps(spec.json_schema()) for spec in TOOL_SPECS]
    chat = ChatFormat(Tokenizer.train([AGENT_SYSTEM, AGENT_TASK, *schemas], vocab_size=400))

    def policy_for(repo: str) -> Policy:
        return _scripted_policy(chat, scripted_turns(repo, config))

    return Agent(name="scripted", chat=chat, policy_for=policy_for, max_turns=max_turns)


def scripted_turns(
    repo: str, config: AutoinstallConfig, recipe_overrides: dict[str, Any] | None = None
) -> list[ToolCall]:
    """The heuristic plan replayed as harness tool calls: list the repository, run each
    install command, write the recipe (with ``recipe_overrides``), submit."""
    plan = buildfiles.discover(repo)
    # Only the installer's commands are used (nothing is prepared in its workdir).
    commands = _Installer(repo, repo, config).install_commands(plan)
    recipe = {
        "install_commands": commands,
        "test_command": plan.test_command,
        "framework": plan.framework,
        "python_path": list(plan.python_path),
        "packages": list(plan.packages),
        "test_files": list(plan.test_files),
        **(recipe_overrides or {}),
    }
    turns = [ToolCall("list_dir", {"path": "repo"})]
    turns += [ToolCall("run_terminal", {"command": c, "timeout_s": 600}) for c in commands]
    write = {"path": AGENT_RECIPE_FILE, "old_str": "", "new_str": json.dumps(recipe, indent=1)}
    turns.append(ToolCall("edit_file", write))
    turns.append(ToolCall("submit", {}))
    return turns


def _scripted_policy(chat: ChatFormat, turns: Sequence[ToolCall]) -> Policy:
    queue = list(turns)

    def policy(prompt: list[int]) -> list[int]:
        del prompt  # the plan does not depend on what the tools said
        calls = (queue.pop(0),) if queue else ()
        text = "" if calls else "Nothing left to do."
        return chat.assistant_body(Message("assistant", text, tool_calls=calls))

    return policy


def model_agent(
    path: str,
    *,
    max_turns: int = 30,
    max_new_tokens: int = 512,
    temperature: float = 0.6,
    seed: int = 0,
) -> Agent:
    """A model's policy as the agent (choice 5), sampled with ``cursor_rl.sampler``.

    Each turn is sampled from the whole conversation so far (``Sampler.generate``;
    nothing is cached between turns: an install takes a few dozen turns at most).

    Args:
      path: a built-in base name (``cursor_rl.bases``, e.g. ``tiny``), an HF directory
        of the project's export (``config.json``, ``model.safetensors``,
        ``tokenizer.json``), or a trainer checkpoint (a step directory or a
        checkpoints directory, its latest step; the tokenizer from its metadata).
      max_turns: assistant turns before the episode is cut.
      max_new_tokens: tokens per assistant turn.
      temperature: sampling temperature (0: greedy).
      seed: the sampling seed.

    Raises:
      ValueError: ``path`` names none of these (checked before any model loads).
    """
    # JAX only here: the heuristic and scripted modes stay pure Python.
    from cursor_rl.sampler.chat import load_sampler
    from cursor_rl.sampler.sampler import Sampler
    from cursor_rl.sampler.sampling import SamplingParams

    kind, where = resolve_policy(path)
    if kind == "hf":
        tokenizer = Tokenizer.load(os.path.join(where, "tokenizer.json"))
        sampler = Sampler.from_hf(where, tokenizer=tokenizer, num_slots=1)
    else:
        sampler = load_sampler(where, num_slots=1)
    chat = ChatFormat(sampler.tokenizer)
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        stop_token_ids=chat.stop_token_ids,
        seed=seed,
    )

    def policy(prompt: list[int]) -> list[int]:
        return list(sampler.generate([prompt], params)[0].tokens)

    return Agent(name=path, chat=chat, policy_for=lambda repo: policy, max_turns=max_turns)


def resolve_policy(path: str) -> tuple[str, str]:
    """What ``model_agent``'s ``path`` names: ``("hf", directory)`` for a built-in base
    or an HF directory, ``("checkpoint", path)`` for a trainer checkpoint.

    Raises:
      ValueError: it names none of these (nothing is loaded to find out but the
        checkpoint's metadata).
    """
    from cursor_rl import bases, checkpoints  # JAX (and Orbax): the agent mode only

    hf_dir = bases.BUILTIN.get(path, path)
    if os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        return "hf", hf_dir
    try:
        checkpoints.read_metadata(path)
    except (checkpoints.CheckpointError, OSError, ValueError) as err:
        raise ValueError(
            f"autoinstall policy {path!r} is not a built-in base "
            f"({', '.join(sorted(bases.BUILTIN))}), an HF directory with model.safetensors, "
            f"or a trainer checkpoint ({err})"
        ) from err
    return "checkpoint", path


def _agent_recipe(path: str) -> tuple[buildfiles.Discovery, list[str]] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        framework = data["framework"]
        if framework not in ("pytest", "unittest") or not isinstance(data["test_command"], str):
            return None
        discovery = buildfiles.Discovery(
            build_files=(),
            requirements=(),
            requirement_files=(),
            framework=framework,
            test_command=data["test_command"],
            test_files=tuple(str(t) for t in data.get("test_files", [])),
            python_path=tuple(str(p) for p in data.get("python_path", ["."])),
            packages=tuple(str(p) for p in data.get("packages", [])),
            notes=("agent",),
        )
        return discovery, [str(c) for c in data.get("install_commands", [])]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cursor_rl.tasks.autoinstall --out=DIR PATH...``: install and report."""
    fv = flags.FlagValues()
    flags.DEFINE_string("out", None, "Where environments, recipes and logs go.", flag_values=fv)
    rest = fv(list(argv if argv is not None else sys.argv))[1:]
    if not fv.out or not rest:
        print("usage: python -m cursor_rl.tasks.autoinstall --out=DIR PATH...", file=sys.stderr)
        return 2
    results = autoinstall_batch(rest, fv.out)
    for r in results:
        status = "ok" if r.ok else f"FAILED ({r.reason})"
        detail = f": {r.recipe.test_command}" if r.recipe else f"; log: {r.workdir}/{LOG_FILE}"
        print(f"{r.repo}: {status}{detail}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
