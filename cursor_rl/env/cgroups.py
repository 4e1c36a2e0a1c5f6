"""Memory and process caps for a whole sandboxed command: one cgroup per command.

    with CgroupLimits("cursor_rl_sb7", memory_bytes=1 << 30, max_pids=512) as cg:
        proc = subprocess.Popen(cg.join_argv(argv))   # joins the cgroup, then execs argv
        ...
        cg.oom_kills()                                 # processes the memory cap killed
    # leaving kills whatever is left in the cgroup and removes it

rlimits are per process: ``RLIMIT_AS`` lets eight children allocate eight times the
limit. A cgroup counts the memory and the tasks of every process in it, and every
descendant of a member is a member, so a command's whole process tree shares one cap.

Design choices:

1. **cgroup v2 first, v1 second, else nothing.** v2 (the unified hierarchy) is used
   when its ``memory`` and ``pids`` controllers are available to this process's
   cgroup (``memory.max``, ``memory.swap.max`` = 0, ``pids.max``); they are enabled
   in its ``cgroup.subtree_control`` when needed and allowed. v2 forbids that for a
   cgroup holding processes of its own (the "no internal processes" rule), so a
   harness needs a delegated cgroup there, and the reason says so. Otherwise the v1
   ``memory`` and ``pids`` hierarchies are used when mounted and writable
   (``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` set equal, so no
   swap; ``pids.max``). When neither works (not root, read-only, controllers
   missing), ``unavailable_reason`` says why and ``create`` returns None: the caller
   keeps its rlimits (the sandbox logs one warning).
2. **Children of our own cgroup, never of the root.** ``/proc/self/cgroup`` and
   ``/proc/self/mountinfo`` locate this process's cgroup in each hierarchy; sandbox
   cgroups are created beneath it, so limits set above us (a container's) still bound
   them, and nothing outside our subtree is touched.
3. **Usability is probed, not guessed.** A probe cgroup is created, its control
   files are checked and written, and it is removed: a directory that is not a cgroup
   filesystem (mkdir succeeds but no control files appear), a read-only mount or a
   missing permission all give a reason instead of a half-working setup.
4. **The command joins before it runs.** ``join_argv`` prefixes the argv with a
   tiny ``sh`` that writes its own pid into ``cgroup.procs`` and then ``exec``s the
   command, so the command is a member before its first instruction and every
   descendant (bwrap's new namespaces included) inherits the membership. No
   ``preexec_fn`` (unsafe in a threaded harness).
5. **Removal kills what is left.** v2 writes ``cgroup.kill``; v1 (or a v2 kernel
   without it) SIGKILLs every pid in ``cgroup.procs`` until it is empty; then the
   directory is removed. Stale cgroups of a crashed harness are removed the same way
   (``remove_stale``, which also takes the directories the crashed harness recorded:
   one in another cgroup had other parents).
6. **Kills by the cap are reported.** ``oom_kills`` reads the memory controller's
   oom-kill count (v2 ``memory.events``, v1 ``memory.oom_control``) and
   ``fork_refusals`` the pids controller's (``pids.events``), so a caller can say why
   a command died.

Pure Python, no JAX.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import itertools
import os
import re
import shlex
import signal
import time
from collections.abc import Sequence

PROC_SELF_CGROUP = "/proc/self/cgroup"
PROC_SELF_MOUNTINFO = "/proc/self/mountinfo"
_KILL_WAIT_S = 10.0
_probe_ids = itertools.count()


class CgroupError(OSError):
    """A cgroup could not be created, filled or removed."""


@dataclasses.dataclass(frozen=True)
class Parents:
    """Where sandbox cgroups are created: this process's cgroup in each hierarchy.

    Attributes:
      version: 2 (one unified directory) or 1 (a memory and a pids directory, the
        same one when the two controllers share a hierarchy).
      memory_dir: parent directory in the hierarchy with the memory controller.
      pids_dir: parent directory in the hierarchy with the pids controller.
    """

    version: int
    memory_dir: str
    pids_dir: str

    @property
    def dirs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.memory_dir, self.pids_dir)))


# ---- finding our cgroups ----


@dataclasses.dataclass(frozen=True)
class _Mount:
    mount_point: str
    root: str  # the cgroup shown at mount_point
    fstype: str
    options: frozenset[str]  # mount and super options together


def _unescape(field: str) -> str:
    """mountinfo escapes spaces and the like as octal (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _read_mounts(mountinfo: str) -> list[_Mount]:
    mounts = []
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 6 or len(tail) < 3:
                continue
            if tail[0] not in ("cgroup", "cgroup2"):
                continue
            options = frozenset(fields[5].split(",")) | frozenset(tail[2].split(","))
            mounts.append(_Mount(_unescape(fields[4]), _unescape(fields[3]), tail[0], options))
    return mounts


def _read_memberships(proc_cgroup: str) -> dict[str, str]:
    """Controller (``""`` for v2) -> this process's cgroup path in that hierarchy."""
    paths = {}
    with open(proc_cgroup) as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def _dir_of(mount: _Mount, path: str) -> str | None:
    """Host directory of cgroup ``path`` seen through ``mount``, None if outside it."""
    root = mount.root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    return os.path.join(mount.mount_point, path[len(root) :].lstrip("/")).rstrip("/")


def _v2_parents(mounts: list[_Mount], memberships: dict[str, str]) -> Parents | str:
    if "" not in memberships:
        return "this process is in no cgroup v2 hierarchy"
    for mount in mounts:
        if mount.fstype != "cgroup2":
            continue
        parent = _dir_of(mount, memberships[""])
        if parent is None:
            continue
        try:
            with open(os.path.join(parent, "cgroup.controllers")) as f:
                available = f.read().split()
        except OSError as e:
            return f"cgroup v2 at {parent}: {e.strerror or e}"
        missing = [c for c in ("memory", "pids") if c not in available]
        if missing:
            return (
                f"cgroup v2 at {parent} lacks the {' and '.join(missing)} controller(s) "
                f"(available: {' '.join(available) or 'none'})"
            )
        return Parents(2, parent, parent)
    return "no cgroup v2 mount shows this process's cgroup"


def _v1_parents(mounts: list[_Mount], memberships: dict[str, str]) -> Parents | str:
    found = {}
    for controller in ("memory", "pids"):
        if controller not in memberships:
            return f"no cgroup v1 {controller} hierarchy"
        for mount in mounts:
            if mount.fstype == "cgroup" and controller in mount.options:
                parent = _dir_of(mount, memberships[controller])
                if parent is not None:
                    found[controller] = parent
                    break
        else:
            return f"the cgroup v1 {controller} hierarchy is not mounted here"
    return Parents(1, found["memory"], found["pids"])


def find_parents(
    proc_cgroup: str = PROC_SELF_CGROUP, mountinfo: str = PROC_SELF_MOUNTINFO
) -> list[Parents | str]:
    """Candidate parents, v2 first then v1, each a ``Parents`` or why it is unusable."""
    try:
        mounts, memberships = _read_mounts(mountinfo), _read_memberships(proc_cgroup)
    except (OSError, ValueError) as e:
        return [f"cannot read this process's cgroups: {e}"]
    return [_v2_parents(mounts, memberships), _v1_parents(mounts, memberships)]


# ---- control files ----


def _write(path: str, value: str | int) -> None:
    with open(path, "w") as f:
        f.write(f"{value}\n")


def _read_keyed(path: str) -> dict[str, int]:
    """A flat-keyed file (``memory.events``, ``memory.oom_control``, ``pids.events``)."""
    values = {}
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                    values[parts[0]] = int(parts[1])
    except FileNotFoundError:
        pass
    return values


def _read_pids(directory: str) -> list[int]:
    try:
        with open(os.path.join(directory, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _limit_files(version: int) -> dict[str, tuple[str, ...]]:
    """Control files a fresh child must have, per controller."""
    if version == 2:
        return {"memory": ("memory.max",), "pids": ("pids.max",)}
    return {"memory": ("memory.limit_in_bytes",), "pids": ("pids.max",)}


def _enable_v2_controllers(parent: str) -> None:
    """Enables memory and pids for the children of ``parent`` (choice 1)."""
    path = os.path.join(parent, "cgroup.subtree_control")
    with open(path) as f:
        enabled = f.read().split()
    for controller in ("memory", "pids"):
        if controller in enabled:
            continue
        try:
            _write(path, f"+{controller}")
        except OSError as e:
            hint = (
                " (it has processes of its own, which cgroup v2 forbids for a cgroup with "
                "controllers: run the harness in a delegated cgroup, e.g. a systemd scope "
                "with Delegate=yes)"
                if e.errno == errno.EBUSY
                else ""
            )
            raise CgroupError(
                e.errno, f"cannot enable {controller} in {path}: {e.strerror}{hint}"
            ) from e


def _probe(parents: Parents) -> str | None:
    """Creates, checks and removes a throwaway cgroup (choice 3); why not, or None."""
    version = parents.version
    if os.geteuid() != 0:
        return "creating cgroups needs root"
    try:
        if version == 2:
            _enable_v2_controllers(parents.memory_dir)
    except OSError as e:
        return f"cgroup v{version} at {parents.memory_dir}: {e.strerror or e}"
    name = f"cursor_rl_probe_{os.getpid()}_{next(_probe_ids)}"
    for parent in parents.dirs:
        controllers = [
            c
            for c, d in (("memory", parents.memory_dir), ("pids", parents.pids_dir))
            if d == parent
        ]
        child = os.path.join(parent, name)
        try:
            os.mkdir(child)
        except OSError as e:
            return f"cgroup v{version}: cannot create a cgroup in {parent}: {e.strerror or e}"
        try:
            for controller in controllers:
                for file in _limit_files(version)[controller]:
                    if not os.path.exists(os.path.join(child, file)):
                        return (
                            f"{parent} is not a cgroup v{version} directory with the "
                            f"{controller} controller (a new child has no {file})"
                        )
                    value = "max" if file == "pids.max" else 1 << 30
                    try:
                        _write(os.path.join(child, file), value)
                    except OSError as e:
                        return f"cgroup v{version}: cannot write {file}: {e.strerror or e}"
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(child)
    return None


def resolve(
    candidates: Sequence[Parents | str] | None = None,
) -> Parents | str:
    """The first usable parents among ``candidates`` (default: this process's), or why none.

    Each candidate is probed (choice 3).
    """
    if candidates is None:
        candidates = find_parents()
    reasons = []
    for candidate in candidates:
        if isinstance(candidate, str):
            reasons.append(candidate)
            continue
        reason = _probe(candidate)
        if reason is None:
            return candidate
        reasons.append(reason)
    return "; ".join(reasons) or "no cgroup hierarchy"


@functools.cache
def _resolved() -> Parents | str:
    return resolve()


def unavailable_reason() -> str | None:
    """Why commands cannot get cgroup limits here, or None when they can (probed once)."""
    resolved = _resolved()
    return resolved if isinstance(resolved, str) else None


def usable_parents() -> Parents | None:
    """This process's usable parents (probed once), or None."""
    resolved = _resolved()
    return None if isinstance(resolved, str) else resolved


# ---- one command's cgroup ----


class CgroupLimits:
    """One cgroup with a memory cap and a task cap; a context manager.

    Entering creates it (removing a stale one of the same name first) and writes the
    limits; leaving kills whatever is left in it and removes it.

    Args:
      name: the cgroup's directory name under the parents (unique among live users).
      memory_bytes: memory of all its processes together (swap not allowed).
      max_pids: processes and threads in it at once.
      parents: where to create it; None uses this process's (``usable_parents()``).

    Raises:
      CgroupError: on entering, when cgroups are unavailable or cannot be created.
    """

    def __init__(
        self, name: str, memory_bytes: int, max_pids: int, *, parents: Parents | None = None
    ):
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"bad cgroup name {name!r}")
        self.name = name
        self.memory_bytes = int(memory_bytes)
        self.max_pids = int(max_pids)
        self._parents = parents
        self.created = False

    @property
    def parents(self) -> Parents:
        if self._parents is None:
            found = usable_parents()
            if found is None:
                raise CgroupError(errno.ENOTSUP, f"no cgroup limits: {unavailable_reason()}")
            self._parents = found
        return self._parents

    @property
    def version(self) -> int:
        return self.parents.version

    @property
    def memory_dir(self) -> str:
        return os.path.join(self.parents.memory_dir, self.name)

    @property
    def pids_dir(self) -> str:
        return os.path.join(self.parents.pids_dir, self.name)

    @property
    def dirs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.memory_dir, self.pids_dir)))

    @property
    def procs_files(self) -> tuple[str, ...]:
        """The ``cgroup.procs`` files a process writes its pid into to join."""
        return tuple(os.path.join(d, "cgroup.procs") for d in self.dirs)

    # ---- lifecycle ----

    def __enter__(self) -> CgroupLimits:
        self.create()
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()

    def create(self) -> None:
        """Creates the cgroup (after removing a stale one) and writes its limits."""
        self.remove()
        try:
            if self.version == 2:
                _enable_v2_controllers(self.parents.memory_dir)
            for d in self.dirs:
                os.mkdir(d)
            self.created = True
            self._write_limits()
        except OSError as e:
            with contextlib.suppress(OSError):
                self.remove()
            raise CgroupError(e.errno, f"cannot set up cgroup {self.name}: {e}") from e

    def _write_limits(self) -> None:
        mem, pids = self.memory_dir, self.pids_dir
        if self.version == 2:
            _write(os.path.join(mem, "memory.max"), self.memory_bytes)
            if os.path.exists(os.path.join(mem, "memory.swap.max")):
                _write(os.path.join(mem, "memory.swap.max"), 0)
        else:
            # memsw (memory + swap) must stay >= the memory limit: memory first.
            _write(os.path.join(mem, "memory.limit_in_bytes"), self.memory_bytes)
            if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
                _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), self.memory_bytes)
        _write(os.path.join(pids, "pids.max"), self.max_pids)

    def remove(self) -> None:
        """Kills every process left in the cgroup, then removes it (choice 5); idempotent.

        Raises:
          CgroupError: processes survive SIGKILL, or a directory cannot be removed.
        """
        if self._parents is None and usable_parents() is None:
            return
        for d in self.dirs:
            remove_dir(d)
        self.created = False

    # ---- members ----

    def join_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it joins this cgroup before it runs (choice 4)."""
        joins = " && ".join(f"echo $$ > {shlex.quote(p)}" for p in self.procs_files)
        return ["/bin/sh", "-c", f'{joins} && exec "$@"', "cgroup-join", *argv]

    def add(self, pid: int) -> None:
        """Moves a running process into the cgroup (its later children follow it)."""
        for path in self.procs_files:
            _write(path, pid)

    def pids(self) -> list[int]:
        """Processes now in the cgroup (pids of this process's PID namespace)."""
        found = []
        for d in self.dirs:
            found += [p for p in _read_pids(d) if p not in found]
        return found

    # ---- what the caps did ----

    def oom_kills(self) -> int:
        """Processes the kernel killed because the memory cap was reached (choice 6)."""
        if self.version == 2:
            events = _read_keyed(os.path.join(self.memory_dir, "memory.events"))
            return events.get("oom_kill", 0)
        control = _read_keyed(os.path.join(self.memory_dir, "memory.oom_control"))
        if "oom_kill" in control:
            return control["oom_kill"]
        # Kernels before 4.13 do not count kills: report that the cap was hit at all.
        return int(control.get("under_oom", 0) > 0)

    def fork_refusals(self) -> int:
        """Forks (and thread creations) the task cap refused."""
        return _read_keyed(os.path.join(self.pids_dir, "pids.events")).get("max", 0)

    def memory_peak_bytes(self) -> int | None:
        """Most memory in use at once, when the kernel reports it."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            with open(os.path.join(self.memory_dir, name)) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None


def _kill_all(directory: str) -> None:
    """SIGKILLs every process in a cgroup until it is empty (choice 5)."""
    kill_file = os.path.join(directory, "cgroup.kill")  # v2, Linux >= 5.14
    if os.path.exists(kill_file):
        _write(kill_file, 1)
    deadline = time.monotonic() + _KILL_WAIT_S
    while pids := _read_pids(directory):
        if time.monotonic() > deadline:
            raise CgroupError(
                errno.EBUSY, f"processes {pids} in cgroup {directory} survive SIGKILL"
            )
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def remove_dir(directory: str) -> None:
    """Kills whatever is in one cgroup directory, then removes it; absent is fine.

    Raises:
      CgroupError: processes survive SIGKILL, or the directory cannot be removed.
    """
    if not os.path.isdir(directory):
        return
    _kill_all(directory)
    deadline = time.monotonic() + _KILL_WAIT_S
    while True:
        try:
            os.rmdir(directory)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            # EBUSY while the last killed tasks are still exiting.
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise CgroupError(e.errno, f"cannot remove cgroup {directory}: {e}") from e
            _kill_all(directory)
            time.sleep(0.01)


def create(name: str, memory_bytes: int, max_pids: int) -> CgroupLimits | None:
    """A ``CgroupLimits`` under this process's parents, not yet entered; None when
    cgroups are unavailable here (``unavailable_reason`` says why)."""
    if usable_parents() is None:
        return None
    return CgroupLimits(name, memory_bytes, max_pids)


def remove_stale(name: str, recorded: Sequence[str] = ()) -> None:
    """Removes a cgroup a crashed user left (killing its processes), if any.

    Args:
      name: its directory name, looked for under this process's parents.
      recorded: its directories as the crashed user recorded them (a user in another
        cgroup has other parents); only entries named ``name`` are considered.
    """
    found = usable_parents()
    dirs = [os.path.join(d, name) for d in found.dirs] if found is not None else []
    dirs += [d for d in recorded if os.path.isabs(d) and os.path.basename(d) == name]
    for d in dict.fromkeys(dirs):
        remove_dir(d)
