"""Isolated command execution for one episode: namespaces, an unprivileged uid, limits.

    with Sandbox(workspace, allow_hosts=("pypi.org:443",)) as sb:
        result = sb.run("python -m pytest -q", timeout_s=60)   # CommandResult

Each command runs as::

    setpriv (dies with the harness) → sh (joins the command's cgroup) → prlimit (rlimits)
    → nsenter (the sandbox's network namespace) → bwrap (new mount, PID, IPC, UTS and
    cgroup namespaces; a read-only system view) → setpriv (the sandbox's uid, no
    capabilities, no_new_privs) → sh -c CMD

Inside, the agent sees ``/workspace`` (read-write), read-only ``/usr`` and a curated
``/etc``, fresh ``/proc`` and ``/dev``, private ``/tmp`` and ``/dev/shm``, the
harness's tools under ``/opt/harness`` and any ``readonly_paths`` (a toolchain).
``masked_paths`` are covered inside: a file by an empty read-only file, a directory
by an empty read-only tmpfs (a stdlib task's solution in the interpreter's own
library, see ``cursor_rl.tasks.environments.stdlib_copies_of``). Nothing else of
the host exists there: not the hidden tests, not other episodes, not the trainer's
files, not the host's home.

Design choices:

1. **Root harness, unprivileged sandbox.** The harness must be root (it makes
   network namespaces and mounts); commands run as a uid of their own with no
   capabilities. Each live sandbox owns a *slot*, a flock-ed lock file that gives it
   a uid (``UID_BASE + slot``), a state directory and a namespace name, so
   ``RLIMIT_NPROC`` (counted per uid) bounds a fork bomb per episode, and sandboxes
   cannot signal or ptrace each other. A crashed harness takes its commands with it
   (a parent-death signal); the mounts and namespace it leaves are removed by the
   slot's next holder, or at once by ``clean_stale_slots``.
2. **The workspace lives on a size-limited tmpfs** (``Limits.disk_bytes``,
   ``disk_inodes``): entering copies the workspace in, leaving syncs it back, so
   filling the disk fills only the sandbox's own quota. ``/tmp`` and ``/dev/shm``
   are size-limited tmpfs too, fresh for every command.
3. **Git history never enters.** With ``hide_git_history`` every ``.git`` entry is
   left out of the copy and the agent gets a fresh single-commit repository (so
   ``git diff``/``git status`` work); leaving syncs the tree back without touching
   the original ``.git``, which is therefore restored exactly (it never moved).
4. **A command's processes die with it**, background daemons included: the PID
   namespace ends with the command, and on a timeout or an output flood its init is
   killed (``cursor_rl.env.supervise``); ``run`` returns once nothing is left.
5. **Network = ``netns.NetworkNamespace``**: loopback plus forwarders for the
   allow-list, resolved up front; no DNS.
6. **No silent fallback.** Without root or the system tools, entering raises
   ``SandboxUnavailableError`` naming what is missing (``launch/install_system_deps.sh``
   installs the Debian packages); nothing ever runs unisolated.
7. **Setup failures are not command failures.** Entering runs a first command (the
   fresh repository, or ``true``) and raises ``SandboxError`` if it fails, so a broken
   configuration (a missing bind source) never shows up as the agent's failing
   commands; ``run`` raises it too when bwrap never starts a child.
8. **Whole-command caps through a cgroup, rlimits behind them.** rlimits are per
   process (``RLIMIT_AS``) or per uid (``RLIMIT_NPROC``): eight children may each
   allocate ``memory_bytes``. Each command therefore runs in a cgroup of its own
   (``cursor_rl.env.cgroups``: v2, else v1) capping the memory (``memory_bytes``, no
   swap) and the tasks (``max_pids``) of its whole process tree; the chain joins it
   before ``prlimit`` runs, so bwrap and everything inside inherit it, and it is
   removed (leftovers killed) when ``run`` returns; while it exists its directories
   are recorded in the slot's state directory, so the slot's next holder removes the
   cgroup a crashed harness left even from another cgroup of its own. A command the
   memory cap killed comes back as an ordinary ``CommandResult`` with a note in its
   stderr. The rlimits stay as a second line of defence; where cgroups are unavailable
   (no root, a read-only or controller-less hierarchy) they are the only one, and one
   warning per process says why.

One sandbox serves one thread at a time. Pure Python, no JAX.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from cursor_rl.env import cgroups, fs, netns
from cursor_rl.env.supervise import CommandResult, SandboxError, supervise

STATE_ROOT = "/run/cursor_rl_sandbox"
UID_BASE = 2_000_000  # far above regular users and the usual /etc/subuid ranges
MAX_SLOTS = 4096
WORKDIR = "/workspace"
HARNESS_DIR = "/opt/harness"  # read-only harness files inside the sandbox
TEST_RUNNER = HARNESS_DIR + "/testrunner.py"

_REQUIRED_TOOLS = ("bwrap", "nsenter", "setpriv", "prlimit", "ip", "git", "mount", "umount")
_ETC_FILES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "nsswitch.conf",
    "alternatives",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "localtime",
    "protocols",
    "services",
    "mime.types",
)
_USR_MERGED = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_CHAIN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
_NETNS_PREFIX = "cursor_rl_sb"
_CGROUP_PREFIX = "cursor_rl_sb"

_log = logging.getLogger(__name__)


class SandboxUnavailableError(SandboxError):
    """This machine cannot isolate commands (not root, tools or kernel features missing)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of a sandbox (rlimits are per process unless noted).

    Attributes:
      cpu_s: CPU seconds (``RLIMIT_CPU``).
      memory_bytes: address space (``RLIMIT_AS``), and the memory of the whole command
        together (its cgroup, swap excluded; choice 8).
      processes: processes and threads of the sandbox's uid (``RLIMIT_NPROC``).
      max_pids: processes and threads of the whole command at once, the command
        chain's few included (its cgroup's ``pids.max``; choice 8).
      file_bytes: largest file a process may write (``RLIMIT_FSIZE``).
      open_files: open file descriptors (``RLIMIT_NOFILE``).
      disk_bytes: size of the workspace tmpfs (whole sandbox).
      disk_inodes: files and directories in the workspace (whole sandbox).
      tmp_bytes: size of each command's ``/tmp`` and of its ``/dev/shm``.
      output_bytes: bytes of stdout and of stderr kept per command (head and tail).
      output_kill_bytes: a command writing more than this (both streams) is killed.
    """

    cpu_s: int = 300
    memory_bytes: int = 8 << 30
    processes: int = 512
    max_pids: int = 1024
    file_bytes: int = 512 << 20
    open_files: int = 1024
    disk_bytes: int = 2 << 30
    disk_inodes: int = 200_000
    tmp_bytes: int = 512 << 20
    output_bytes: int = 256 << 10
    output_kill_bytes: int = 64 << 20


@functools.cache
def _harness_binds() -> tuple[tuple[str, str], ...]:
    """(host path, sandbox path) of the harness files every sandbox gets read-only."""
    binds = [(os.path.join(os.path.dirname(__file__), "testrunner.py"), TEST_RUNNER)]
    for name in ("rg", "ruff"):
        # ruff usually sits beside the interpreter of the virtualenv running the harness.
        found = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
        if found:
            binds.append((os.path.realpath(found), f"{HARNESS_DIR}/bin/{name}"))
    return tuple(binds)


def harness_tool(name: str) -> str | None:
    """Path inside every sandbox of a harness binary (``rg``, ``ruff``), None if absent."""
    inside = f"{HARNESS_DIR}/bin/{name}"
    return inside if any(dest == inside for _, dest in _harness_binds()) else None


@functools.cache
def _static_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return (
            "the sandbox needs root (it creates network namespaces and mounts, then runs "
            "commands as an unprivileged uid)"
        )
    missing = [t for t in _REQUIRED_TOOLS if shutil.which(t, path=_CHAIN_ENV["PATH"]) is None]
    if missing:
        return f"missing system tools {missing}; run launch/install_system_deps.sh"
    if not fs.openat2_available():
        return "the kernel lacks openat2 (Linux >= 5.6 is needed)"
    return None


@functools.cache
def unavailable_reason() -> str | None:
    """Why sandboxes cannot run here, or None when they can (checked once per process).

    Beyond the static checks, a probe sandbox runs ``true``, so missing namespace or
    mount permissions (an unprivileged container) are reported too.
    """
    reason = _static_unavailable_reason()
    if reason is not None:
        return reason
    with tempfile.TemporaryDirectory(prefix="cursor_rl_probe_") as workspace:
        try:
            with Sandbox(workspace, hide_git_history=False) as sb:
                result = sb.run("true", timeout_s=30)
        except (SandboxError, OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", None) or e
            return f"the probe sandbox failed: {detail}"
    if result.exit_code != 0:
        return f"the probe sandbox failed: exit {result.exit_code}: {result.stderr.strip()}"
    return None


@functools.cache
def _cgroups_or_warn() -> bool:
    """Whether commands get cgroup caps; the first call without them warns (choice 8)."""
    reason = cgroups.unavailable_reason()
    if reason is not None:
        _log.warning(
            "cgroup limits are unavailable (%s): sandbox commands keep only their per-process "
            "rlimits, so a command that forks can use more than Limits.memory_bytes in total",
            reason,
        )
    return reason is None


def _processes_of(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) == uid:
                                pids.append(int(entry))
                            break
            except OSError:  # exited meanwhile
                continue
    return pids


def _kill_uid(uid: int) -> bool:
    """Kills every process of a sandbox uid (leftovers of a crash); True if there were any."""
    for attempt in range(10):
        pids = _processes_of(uid)
        if not pids:
            return attempt > 0
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    raise SandboxError(f"processes of sandbox uid {uid} survive SIGKILL: {_processes_of(uid)}")


def _state_dir(slot: int) -> str:
    return os.path.join(STATE_ROOT, f"slot{slot}")


def _live_root(slot: int) -> str:
    return os.path.join(_state_dir(slot), "ws")


def _netns_name(slot: int) -> str:
    return f"{_NETNS_PREFIX}{slot}"


def _cgroup_name(slot: int) -> str:
    return f"{_CGROUP_PREFIX}{slot}"


def _cgroup_record(slot: int) -> str:
    """Where a command's cgroup directories are recorded while it runs: a harness in
    another cgroup cleaning this slot after a crash would not find them otherwise."""
    return os.path.join(_state_dir(slot), "cgroups")


def _remove_stale_cgroups(slot: int) -> None:
    try:
        with open(_cgroup_record(slot)) as f:
            recorded = f.read().split("\n")
    except FileNotFoundError:
        recorded = []
    cgroups.remove_stale(_cgroup_name(slot), recorded)


def _lock_slot(slot: int) -> int | None:
    """The slot's flock-ed lock fd, or None when a live sandbox holds it."""
    fd = os.open(os.path.join(STATE_ROOT, f"slot{slot}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _clean_slot(slot: int) -> None:
    """Removes whatever a previous holder of this (locked) slot left."""
    _kill_uid(UID_BASE + slot)
    _remove_stale_cgroups(slot)
    netns.NetworkNamespace.remove_stale(_netns_name(slot))
    if os.path.isdir(_state_dir(slot)):
        _unmount(_live_root(slot))
        shutil.rmtree(_state_dir(slot))


def clean_stale_slots() -> list[int]:
    """Frees what sandboxes of dead processes left (tmpfs, namespace, processes).

    A slot's next holder cleans it anyway; a supervisor that just lost a worker calls
    this to release the memory at once. Slots held by live sandboxes are skipped.

    Returns:
      The slots that were cleaned.
    """
    if not os.path.isdir(STATE_ROOT):
        return []
    # A slot in use or left behind has a state directory or a namespace.
    names = os.listdir(netns.NETNS_DIR) if os.path.isdir(netns.NETNS_DIR) else []
    candidates = {int(n[len(_NETNS_PREFIX) :]) for n in names if n.startswith(_NETNS_PREFIX)}
    candidates |= {
        int(n[len("slot") :]) for n in os.listdir(STATE_ROOT) if re.fullmatch(r"slot\d+", n)
    }
    cleaned = []
    for slot in sorted(candidates):
        fd = _lock_slot(slot)
        if fd is None:
            continue
        try:
            _clean_slot(slot)
            cleaned.append(slot)
        finally:
            os.close(fd)
    return cleaned


def _ancestors(path: str) -> list[str]:
    """``/a/b/c`` -> ``["/a", "/a/b", "/a/b/c"]``."""
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _unmount(path: str) -> None:
    if not os.path.ismount(path):
        return
    if subprocess.run(["umount", path], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", path], check=True, capture_output=True)


class Sandbox:
    """An isolated workspace for one episode; a context manager.

    Args:
      workspace: the episode's private copy of the task repository. It is copied into
        the sandbox on entering and the agent's final tree is synced back on leaving.
      allow_hosts: ``host:port`` endpoints reachable from inside (TCP only).
      limits: resource limits; None uses ``Limits()``.
      hide_git_history: keep every ``.git`` out and give the agent a fresh
        single-commit repository (choice 3).
      readonly_paths: absolute host paths made visible read-only at the same path
        (a task's toolchain, e.g. a virtualenv and its base interpreter).
      env: extra environment variables for commands (over the scrubbed defaults).
      masked_paths: absolute host paths visible through ``/usr`` or ``readonly_paths``
        that must read as empty inside (a file becomes an empty file, a directory an
        empty directory); paths that do not exist are ignored.
    """

    def __init__(
        self,
        workspace: str,
        *,
        allow_hosts: Sequence[str] = (),
        limits: Limits | None = None,
        hide_git_history: bool = True,
        readonly_paths: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        masked_paths: Sequence[str] = (),
    ):
        self.workspace = os.path.abspath(workspace)
        self.allow_hosts = tuple(allow_hosts)
        self.limits = limits or Limits()
        self.hide_git_history = hide_git_history
        for path in readonly_paths:
            if not os.path.isabs(path) or os.path.realpath(path) == "/":
                raise ValueError(f"readonly_paths entries must be absolute and not /: {path!r}")
        self.readonly_paths = tuple(readonly_paths)
        for path in masked_paths:
            if not os.path.isabs(path) or os.path.realpath(path) == "/":
                raise ValueError(f"masked_paths entries must be absolute and not /: {path!r}")
        self.masked_paths = tuple(masked_paths)
        self._extra_env = dict(env or {})
        self._exclude = fs.git_history if hide_git_history else fs.no_excludes
        self._lock_fd: int | None = None
        self._net: netns.NetworkNamespace | None = None
        self.slot = -1

    # ---- identity of the slot ----

    @property
    def uid(self) -> int:
        """The unprivileged uid (and gid) commands run as."""
        return UID_BASE + self.slot

    @property
    def owner(self) -> tuple[int, int]:
        return self.uid, self.uid

    @property
    def _state_dir(self) -> str:
        return _state_dir(self.slot)

    @property
    def live_root(self) -> str:
        """Host path of the live workspace (the tmpfs); only the harness may touch it."""
        return _live_root(self.slot)

    @property
    def _netns_name(self) -> str:
        return _netns_name(self.slot)

    # ---- lifecycle ----

    def __enter__(self) -> Sandbox:
        reason = _static_unavailable_reason()
        if reason is not None:
            raise SandboxUnavailableError(reason)
        if not os.path.isdir(self.workspace):
            raise FileNotFoundError(f"workspace {self.workspace} is not a directory")
        _cgroups_or_warn()
        endpoints, names = netns.resolve_endpoints(self.allow_hosts)
        self._acquire_slot()
        try:
            os.makedirs(self.live_root, mode=0o700)
            subprocess.run(
                [
                    "mount", "-t", "tmpfs", "-o",
                    f"size={self.limits.disk_bytes},nr_inodes={self.limits.disk_inodes},"
                    f"mode=0755,uid={self.uid},gid={self.uid},nosuid,nodev",
                    "tmpfs", self.live_root,
                ],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            fs.sync_tree(self.workspace, self.live_root, exclude=self._exclude, owner=self.owner)
            self._write_etc(names)
            self._net = netns.NetworkNamespace(self._netns_name, endpoints).open()
            self._first_command()
        except BaseException:
            self._teardown(sync_back=False)
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self._teardown(sync_back=True)

    def _acquire_slot(self):
        os.makedirs(STATE_ROOT, mode=0o700, exist_ok=True)
        start = random.randrange(MAX_SLOTS)
        for i in range(MAX_SLOTS):
            slot = (start + i) % MAX_SLOTS
            fd = _lock_slot(slot)
            if fd is not None:
                self._lock_fd, self.slot = fd, slot
                _clean_slot(slot)
                return
        raise SandboxError(f"all {MAX_SLOTS} sandbox slots are in use")

    def _teardown(self, sync_back: bool):
        if self._lock_fd is None:
            return
        try:
            if self._net is not None:
                self._net.close()
                self._net = None
            _kill_uid(self.uid)
            if sync_back:
                fs.sync_tree(
                    self.live_root, self.workspace, exclude=self._exclude, owner=self._ws_owner()
                )
        finally:
            _clean_slot(self.slot)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _ws_owner(self) -> tuple[int, int]:
        st = os.stat(self.workspace)
        return st.st_uid, st.st_gid

    def _write_etc(self, names: dict[str, set]):
        etc = os.path.join(self._state_dir, "etc")
        os.makedirs(etc)
        files = {
            "passwd": (
                "root:x:0:0:root:/root:/usr/sbin/nologin\n"
                f"agent:x:{self.uid}:{self.uid}:agent:/tmp:/bin/sh\n"
                "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
            ),
            "group": f"root:x:0:\nagent:x:{self.uid}:\nnogroup:x:65534:\n",
            "hosts": netns.hosts_file(names),
            "resolv.conf": "# no DNS in the sandbox: allowed hosts are in /etc/hosts\n",
            "hostname": "sandbox\n",
        }
        for name, text in files.items():
            with open(os.path.join(etc, name), "w") as f:
                f.write(text)

    def _first_command(self):
        """Creates the fresh repository, or just runs ``true`` (choices 3 and 7)."""
        cmd = "true"
        if self.hide_git_history and os.path.lexists(os.path.join(self.workspace, ".git")):
            cmd = (
                "git init -q -b main && git add -A && "
                "git commit -q --no-verify --allow-empty -m 'Initial commit'"
            )
        result = self.run(cmd, timeout_s=300)
        if result.exit_code != 0:
            raise SandboxError(f"the sandbox cannot run commands: {cmd}: {result.stderr.strip()}")

    # ---- commands ----

    def _env(self) -> dict[str, str]:
        env = {
            "PATH": f"{HARNESS_DIR}/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "HOME": "/tmp",
            "TMPDIR": "/tmp",
            "USER": "agent",
            "LOGNAME": "agent",
            "SHELL": "/bin/sh",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "TERM": "dumb",
            "PAGER": "cat",
            "GIT_PAGER": "cat",
            "GIT_AUTHOR_NAME": "agent",
            "GIT_AUTHOR_EMAIL": "agent@sandbox",
            "GIT_COMMITTER_NAME": "agent",
            "GIT_COMMITTER_EMAIL": "agent@sandbox",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        env.update(self._extra_env)
        return env

    def _argv(
        self, cmd: str, info_fd: int, cgroup: cgroups.CgroupLimits | None = None
    ) -> list[str]:
        argv = self._bwrap_argv(cmd, info_fd)
        if cgroup is not None:
            argv = cgroup.join_argv(argv)  # before bwrap's namespaces (choice 8)
        # The chain, and through bwrap's --die-with-parent the command, die with us.
        return ["setpriv", "--pdeathsig=KILL", "--", *argv]

    def _bwrap_argv(self, cmd: str, info_fd: int) -> list[str]:
        lim = self.limits
        argv = [
            "prlimit",
            f"--cpu={lim.cpu_s}:{lim.cpu_s}",
            f"--as={lim.memory_bytes}:{lim.memory_bytes}",
            f"--nproc={lim.processes}:{lim.processes}",
            f"--fsize={lim.file_bytes}:{lim.file_bytes}",
            f"--nofile={lim.open_files}:{lim.open_files}",
            "--core=0:0",
            "--",
            "nsenter", f"--net={self._net.path}", "--",
            "bwrap",
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--info-fd", str(info_fd),
            "--ro-bind", "/usr", "/usr",
        ]  # fmt: skip
        for name in _USR_MERGED:
            host = "/" + name
            if os.path.islink(host):
                argv += ["--symlink", os.readlink(host), host]
            elif os.path.isdir(host):
                argv += ["--ro-bind", host, host]
        # Fresh mounts first, so binds below /tmp (a toolchain there) land on top of them.
        argv += [
            "--proc", "/proc",
            "--dev", "/dev",
            "--perms", "1777", "--size", str(lim.tmp_bytes), "--tmpfs", "/tmp",
            "--perms", "1777", "--size", str(lim.tmp_bytes), "--tmpfs", "/dev/shm",
        ]  # fmt: skip
        etc = os.path.join(self._state_dir, "etc")
        binds = [(f"/etc/{name}", f"/etc/{name}") for name in _ETC_FILES]
        binds += [(os.path.join(etc, name), f"/etc/{name}") for name in sorted(os.listdir(etc))]
        binds += list(_harness_binds()) + [(path, path) for path in self.readonly_paths]
        # bwrap would create missing parents mode 0700, unreadable for the sandbox's uid.
        parents = {os.path.dirname(inside) for _, inside in binds}
        while "/" in parents:
            parents.remove("/")
        for parent in sorted({p for d in parents for p in _ancestors(d)}):
            argv += ["--perms", "0755", "--dir", parent]
        for host, inside in binds:
            argv += ["--ro-bind-try" if host.startswith("/etc/") else "--ro-bind", host, inside]
        argv += self._mask_args()
        argv += [
            "--bind", self.live_root, WORKDIR,
            "--chdir", WORKDIR,
            "--clearenv",
        ]  # fmt: skip
        for key, value in self._env().items():
            argv += ["--setenv", key, value]
        argv += [
            "--",
            "setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs",
            "--",
            "/bin/sh", "-c", cmd,
        ]  # fmt: skip
        return argv

    def _mask_args(self) -> list[str]:
        """bwrap arguments covering ``masked_paths`` (after the binds they sit in)."""
        argv = []
        empty = os.path.join(self._state_dir, "empty")
        if self.masked_paths and not os.path.exists(empty):
            open(empty, "wb").close()
            os.chmod(empty, 0o444)
        for path in self.masked_paths:
            # Both the path as given and where it resolves to (a symlinked lib dir).
            for target in dict.fromkeys((os.path.normpath(path), os.path.realpath(path))):
                if os.path.isdir(target):
                    argv += ["--perms", "0555", "--size", "4096", "--tmpfs", target]
                    argv += ["--remount-ro", target]
                elif os.path.exists(target):
                    argv += ["--ro-bind", empty, target]
        return argv

    def run(self, cmd: str, timeout_s: float, *, stdin: bytes = b"") -> CommandResult:
        """Runs a shell command in the sandbox.

        Args:
          cmd: a ``/bin/sh -c`` command line, run in ``/workspace``.
          timeout_s: wall-clock limit; at expiry every process of the command is killed.
          stdin: bytes fed to the command's standard input (then closed); without
            any, standard input is ``/dev/null``.

        Returns:
          The command's exit code, captured output and whether it timed out.

        Raises:
          SandboxError: the sandbox could not be built for this command (choice 7).
        """
        if self._net is None:
            raise RuntimeError("Sandbox.run needs an entered sandbox (use it as a context manager)")
        cgroup = None
        if _cgroups_or_warn():
            cgroup = cgroups.CgroupLimits(
                _cgroup_name(self.slot), self.limits.memory_bytes, self.limits.max_pids
            )
            try:
                with open(_cgroup_record(self.slot), "w") as f:
                    f.write("\n".join(cgroup.dirs))
                cgroup.create()
            except OSError as e:
                raise SandboxError(f"cannot create the command's cgroup: {e}") from e
        try:
            result = self._run(cmd, timeout_s, stdin, cgroup)
        finally:
            if cgroup is not None:
                try:
                    cgroup.remove()
                    os.unlink(_cgroup_record(self.slot))
                except OSError as e:
                    raise SandboxError(f"cannot remove the command's cgroup: {e}") from e
        return result

    def _run(
        self, cmd: str, timeout_s: float, stdin: bytes, cgroup: cgroups.CgroupLimits | None
    ) -> CommandResult:
        info_r, info_w = os.pipe()
        try:
            proc = subprocess.Popen(
                self._argv(cmd, info_w, cgroup),
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(info_w,),
                start_new_session=True,
                env=_CHAIN_ENV,
                cwd="/",
            )
        finally:
            os.close(info_w)
        result = supervise(
            proc,
            info_r,
            stdin=stdin,
            timeout_s=timeout_s,
            output_bytes=self.limits.output_bytes,
            output_kill_bytes=self.limits.output_kill_bytes,
        )
        if cgroup is None:
            return result
        notes = ""
        if oom_kills := cgroup.oom_kills():
            notes += (
                f"\n[killed: sandbox memory limit (cgroup) exceeded: the command may use "
                f"{self.limits.memory_bytes >> 20} MiB in all; {oom_kills} of its "
                "processes were killed]"
            )
        if refused := cgroup.fork_refusals():
            notes += (
                f"\n[sandbox process limit (cgroup) reached: at most {self.limits.max_pids} "
                f"processes and threads at once; {refused} forks were refused]"
            )
        return dataclasses.replace(result, stderr=result.stderr + notes) if notes else result
