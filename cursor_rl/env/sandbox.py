"""Isolated command execution for one episode: namespaces, an unprivileged uid, rlimits.

    with Sandbox(workspace, allow_hosts=("pypi.org:443",)) as sb:
        result = sb.run("python -m pytest -q", timeout_s=60)   # CommandResult

Each command runs as::

    prlimit (rlimits) → nsenter (the sandbox's network namespace) → bwrap (new mount, PID,
    IPC, UTS and cgroup namespaces; a read-only system view) → setpriv (the sandbox's
    uid, no capabilities, no_new_privs) → /bin/sh -c CMD

Inside, the agent sees ``/workspace`` (read-write), read-only ``/usr`` and a curated
``/etc``, fresh ``/proc`` and ``/dev``, private ``/tmp`` and ``/dev/shm``, the
harness's tools under ``/opt/harness`` and any ``readonly_paths`` (a toolchain).
Nothing else of the host exists there: not the hidden tests, not other episodes,
not the trainer's files, not the host's home.

Design choices:

1. **Root harness, unprivileged sandbox.** The harness must be root (it makes
   network namespaces and mounts); commands run as a uid of their own with no
   capabilities. Each live sandbox owns a *slot*, a flock-ed lock file that gives it
   a uid (``UID_BASE + slot``), a state directory and a namespace name, so
   ``RLIMIT_NPROC`` (counted per uid) bounds a fork bomb per episode, and sandboxes
   cannot signal or ptrace each other. A slot left by a crashed harness is cleaned
   (processes killed, mounts and namespace removed) by the next one to take it.
2. **The workspace lives on a size-limited tmpfs** (``Limits.disk_bytes``,
   ``disk_inodes``): entering copies the workspace in, leaving syncs it back, so
   filling the disk fills only the sandbox's own quota. ``/tmp`` and ``/dev/shm``
   are size-limited tmpfs too, fresh for every command.
3. **Git history never enters.** With ``hide_git_history`` every ``.git`` entry is
   left out of the copy and the agent gets a fresh single-commit repository (so
   ``git diff``/``git status`` work); leaving syncs the tree back without touching
   the original ``.git``, which is therefore restored exactly (it never moved).
4. **A command's processes die with it.** The PID namespace's init is killed on
   timeout (found through bwrap's ``--info-fd`` and held by a pidfd, so a recycled
   pid is never signalled); the kernel then kills every process in the namespace,
   background daemons included. Output is kept head and tail (``output_bytes``) and
   a command that writes more than ``output_kill_bytes`` is killed.
5. **Network = ``netns.NetworkNamespace``**: loopback plus forwarders for the
   allow-list, resolved up front; no DNS.
6. **No silent fallback.** Without root or the system tools, entering raises
   ``SandboxUnavailableError`` naming what is missing (``launch/install_system_deps.sh``
   installs the Debian packages); nothing ever runs unisolated.
7. **Setup failures are not command failures.** Entering runs a first command (the
   fresh repository, or ``true``) and raises ``SandboxError`` if it fails, so a broken
   configuration (a missing bind source) never shows up as the agent's failing
   commands; ``run`` raises it too when bwrap never starts a child.

One sandbox serves one thread at a time. Pure Python, no JAX.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import os
import random
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from cursor_rl.env import fs, netns

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
_KILL_GRACE_S = 5.0


class SandboxError(RuntimeError):
    """The sandbox could not be built or torn down (an infrastructure failure)."""


class SandboxUnavailableError(SandboxError):
    """This machine cannot isolate commands (not root, tools or kernel features missing)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of a sandbox (rlimits are per process unless noted).

    Attributes:
      cpu_s: CPU seconds (``RLIMIT_CPU``).
      memory_bytes: address space (``RLIMIT_AS``).
      processes: processes and threads of the sandbox's uid (``RLIMIT_NPROC``).
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
    file_bytes: int = 512 << 20
    open_files: int = 1024
    disk_bytes: int = 2 << 30
    disk_inodes: int = 200_000
    tmp_bytes: int = 512 << 20
    output_bytes: int = 256 << 10
    output_kill_bytes: int = 64 << 20


@dataclasses.dataclass(frozen=True)
class CommandResult:
    """What a command did.

    Attributes:
      exit_code: the shell's status (128 + N when killed by signal N).
      stdout: decoded stdout, with a marker where the middle was dropped.
      stderr: decoded stderr, likewise, plus a note when the harness killed it.
      timed_out: whether the wall-clock timeout killed it.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool


class _Capture:
    """Keeps the head and tail of a stream (choice 4)."""

    def __init__(self, keep: int):
        self.head_limit = keep // 2
        self.tail_limit = keep - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes):
        self.total += len(data)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        if len(self.tail) > 2 * self.tail_limit:
            del self.tail[: -self.tail_limit]

    def text(self) -> str:
        tail = bytes(self.tail[-self.tail_limit :]) if self.tail_limit else b""
        omitted = self.total - len(self.head) - len(tail)
        middle = f"\n[... {omitted} bytes of output omitted ...]\n".encode() if omitted else b""
        return (bytes(self.head) + middle + tail).decode("utf-8", errors="replace")


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


def _kill_uid(uid: int) -> None:
    """Kills every process of a sandbox uid (only leftovers of a crashed harness)."""
    for _ in range(10):
        pids = _processes_of(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    raise SandboxError(f"processes of sandbox uid {uid} survive SIGKILL: {_processes_of(uid)}")


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
    ):
        self.workspace = os.path.abspath(workspace)
        self.allow_hosts = tuple(allow_hosts)
        self.limits = limits or Limits()
        self.hide_git_history = hide_git_history
        for path in readonly_paths:
            if not os.path.isabs(path) or os.path.realpath(path) == "/":
                raise ValueError(f"readonly_paths entries must be absolute and not /: {path!r}")
        self.readonly_paths = tuple(readonly_paths)
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
        return os.path.join(STATE_ROOT, f"slot{self.slot}")

    @property
    def live_root(self) -> str:
        """Host path of the live workspace (the tmpfs); only the harness may touch it."""
        return os.path.join(self._state_dir, "ws")

    @property
    def _netns_name(self) -> str:
        return f"cursor_rl_sb{self.slot}"

    # ---- lifecycle ----

    def __enter__(self) -> Sandbox:
        reason = _static_unavailable_reason()
        if reason is not None:
            raise SandboxUnavailableError(reason)
        if not os.path.isdir(self.workspace):
            raise FileNotFoundError(f"workspace {self.workspace} is not a directory")
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
            fd = os.open(
                os.path.join(STATE_ROOT, f"slot{slot}.lock"), os.O_RDWR | os.O_CREAT, 0o600
            )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._lock_fd, self.slot = fd, slot
            self._clean_slot()
            return
        raise SandboxError(f"all {MAX_SLOTS} sandbox slots are in use")

    def _clean_slot(self):
        """Removes whatever a previous holder of this slot left (choice 1)."""
        _kill_uid(self.uid)
        netns.NetworkNamespace.remove_stale(self._netns_name)
        if os.path.isdir(self._state_dir):
            _unmount(self.live_root)
            shutil.rmtree(self._state_dir)

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
            self._clean_slot()
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

    def _argv(self, cmd: str, info_fd: int) -> list[str]:
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
        info_r, info_w = os.pipe()
        try:
            proc = subprocess.Popen(
                self._argv(cmd, info_w),
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
        with contextlib.closing(_Command(proc, info_r, self.limits)) as command:
            return command.communicate(stdin, timeout_s)


class _Command:
    """One running command: feeds stdin, captures output, enforces time and output limits."""

    def __init__(self, proc: subprocess.Popen, info_r: int, limits: Limits):
        self.proc = proc
        self.info_r = info_r
        self.info = b""
        self.init_pidfd: int | None = None  # the PID namespace's init (choice 4)
        self.proc_pidfd = os.pidfd_open(proc.pid)
        self.limits = limits
        self.out = _Capture(limits.output_bytes)
        self.err = _Capture(limits.output_bytes)
        self.killed_for: str | None = None
        self.exited = False

    def close(self):
        for fd in (self.info_r, self.proc_pidfd, self.init_pidfd):
            if fd is not None:
                os.close(fd)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None and not stream.closed:
                stream.close()
        if self.proc.poll() is None:  # only after an exception: never leave it behind
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def _read_info(self, data: bytes):
        self.info += data
        if self.init_pidfd is not None:
            return
        try:
            pid = json.loads(self.info)["child-pid"]
        except (ValueError, KeyError):  # not complete yet
            return
        self.init_pidfd = os.pidfd_open(pid)

    def _kill(self, why: str):
        self.killed_for = why
        if self.init_pidfd is not None:
            # SIGKILL to the namespace's init: the kernel kills everything inside.
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.init_pidfd, signal.SIGKILL)
        else:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _reap_namespace(self):
        """Waits until the PID namespace is empty (choice 4).

        bwrap reports the command's status as soon as the command exits, while its
        init (killed by ``--die-with-parent``) may still be killing leftovers; the
        init's pidfd turns readable only after the kernel has killed them all.
        """
        poller = select.poll()
        poller.register(self.init_pidfd, select.POLLIN)
        if not poller.poll(_KILL_GRACE_S * 1000):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.init_pidfd, signal.SIGKILL)
            if not poller.poll(_KILL_GRACE_S * 1000):
                raise SandboxError("the sandbox's processes survive SIGKILL")

    def communicate(self, stdin: bytes, timeout_s: float) -> CommandResult:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ, self.out)
        sel.register(self.proc.stderr, selectors.EVENT_READ, self.err)
        sel.register(self.info_r, selectors.EVENT_READ, "info")
        sel.register(self.proc_pidfd, selectors.EVENT_READ, "exit")
        pending = memoryview(stdin)
        if pending:
            os.set_blocking(self.proc.stdin.fileno(), False)
            sel.register(self.proc.stdin, selectors.EVENT_WRITE, "stdin")
        deadline = time.monotonic() + timeout_s
        drain_until = None  # after the command is gone, wait this long for pipes to close
        try:
            while sel.get_map():
                now = time.monotonic()
                if self.killed_for is None and not self.exited and now >= deadline:
                    self._kill("timeout")
                    drain_until = now + _KILL_GRACE_S
                if drain_until is not None and now >= drain_until:
                    break
                wait = (drain_until if drain_until is not None else deadline) - now
                for key, _ in sel.select(timeout=max(wait, 0.0)):
                    if key.data == "exit":
                        sel.unregister(key.fileobj)
                        self.exited = True
                        drain_until = time.monotonic() + _KILL_GRACE_S
                    elif key.data == "stdin":
                        try:
                            pending = pending[os.write(key.fd, pending) :]
                        except BrokenPipeError:
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(key.fileobj)
                            self.proc.stdin.close()
                    else:
                        data = os.read(key.fd, 1 << 16)
                        if not data:
                            sel.unregister(key.fileobj)
                        elif key.data == "info":
                            self._read_info(data)
                        else:
                            key.data.add(data)
                if (
                    self.killed_for is None
                    and not self.exited
                    and self.out.total + self.err.total > self.limits.output_kill_bytes
                ):
                    self._kill("output")
                    drain_until = time.monotonic() + _KILL_GRACE_S
        finally:
            sel.close()
        try:
            exit_code = self.proc.wait(timeout=_KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            exit_code = self.proc.wait()
        if self.init_pidfd is None:
            raise SandboxError(
                f"the sandbox could not start the command: {self.err.text()[-2000:]}"
            )
        self._reap_namespace()
        stderr = self.err.text()
        if self.killed_for == "timeout":
            stderr += (
                f"\n[timed out after {timeout_s:g} s: the command and its processes were killed]"
            )
        elif self.killed_for == "output":
            stderr += (
                f"\n[more than {self.limits.output_kill_bytes} bytes of output: "
                "the command and its processes were killed]"
            )
        return CommandResult(
            exit_code=exit_code if exit_code >= 0 else 128 - exit_code,
            stdout=self.out.text(),
            stderr=stderr,
            timed_out=self.killed_for == "timeout",
        )
