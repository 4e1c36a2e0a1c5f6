"""Filesystem operations on trees an agent controls: copy, sync, diff, confined open.

The harness runs as root and touches directories whose contents an untrusted agent
wrote (symlinks to ``/etc``, FIFOs, absurd nesting). Everything here is written so
that such contents cannot redirect a root-owned read or write outside the tree.

Design choices:

1. **Directory file descriptors, not path strings.** Walks open each directory with
   ``O_NOFOLLOW`` relative to its parent's fd, so a symlink is copied or compared as a
   link and never followed, and deep trees hit no ``PATH_MAX``.
2. **Confined lookups use the kernel.** ``open_in_root`` is ``openat2`` with
   ``RESOLVE_IN_ROOT``: ``..`` and absolute symlinks resolve inside the root, as in a
   chroot, so the agent-facing file tools follow links the way a shell in the sandbox
   would and still cannot leave the workspace (Linux >= 5.6).
3. **Only plain data crosses.** Regular files, directories and symlinks are copied,
   with permission bits ``& 0o777`` (no setuid/setgid/sticky); FIFOs, sockets and
   devices are skipped, and regular files are opened ``O_NONBLOCK`` after an ``lstat``
   so a FIFO swapped in cannot block the harness.
4. **Exclusion by entry name** (``.git``, ``__pycache__``, ``*.pyc``) applies at every
   depth, on both sides of a sync, so excluded entries in the destination are left
   exactly as they were (how the real git history survives an episode untouched).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import os
import posixpath
import shutil
import stat
from collections.abc import Callable, Iterator

Exclude = Callable[[str], bool]

MAX_DEPTH = 64  # deeper directories are skipped by walks and syncs (an agent can nest absurdly)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY

# openat2(2): struct open_how and the RESOLVE_* flags from <linux/openat2.h>.
_SYS_OPENAT2 = 437  # same number on every architecture (new syscalls are unified)
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def no_excludes(name: str) -> bool:
    """An ``Exclude`` that keeps everything."""
    del name
    return False


def history_and_bytecode(name: str) -> bool:
    """An ``Exclude`` for git history and Python bytecode caches."""
    return name in (".git", "__pycache__") or name.endswith((".pyc", ".pyo"))


def git_history(name: str) -> bool:
    """An ``Exclude`` for git history only."""
    return name == ".git"


def open_in_root(root_fd: int, path: str, flags: int, mode: int = 0) -> int:
    """Opens ``path`` resolved as if ``root_fd`` were ``/`` (kernel-enforced, choice 2).

    Args:
      root_fd: an open directory fd; nothing outside it can be reached.
      path: relative or absolute; ``..`` and symlinks stay inside the root.
      flags: ``os.O_*`` open flags (``O_CLOEXEC`` is added).
      mode: permission bits when ``flags`` has ``O_CREAT``.

    Returns:
      The new fd.

    Raises:
      OSError: as ``open`` would (ENOENT, EISDIR, ...); EXDEV if a mount point is crossed.
    """
    how = _OpenHow(
        flags | os.O_CLOEXEC,
        mode if flags & os.O_CREAT else 0,
        _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_XDEV,
    )
    fd = _libc.syscall(
        ctypes.c_long(_SYS_OPENAT2),
        ctypes.c_int(root_fd),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def openat2_available() -> bool:
    """Whether the kernel has ``openat2`` (Linux >= 5.6)."""
    fd = os.open("/", _DIR_FLAGS)
    try:
        os.close(open_in_root(fd, ".", os.O_RDONLY | os.O_DIRECTORY))
        return True
    except OSError as e:
        if e.errno in (errno.ENOSYS, errno.EPERM):
            return False
        raise
    finally:
        os.close(fd)


def make_dirs_in_root(root_fd: int, path: str, owner: tuple[int, int] | None = None) -> int:
    """``mkdir -p`` inside a root (as ``open_in_root`` resolves); returns the dir's fd."""
    parts = [p for p in posixpath.normpath("/" + path).split("/") if p]
    fd = os.dup(root_fd)
    try:
        for part in parts:
            try:
                nxt = open_in_root(fd, part, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                os.mkdir(part, 0o755, dir_fd=fd)
                if owner is not None:
                    os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
                nxt = open_in_root(fd, part, os.O_RDONLY | os.O_DIRECTORY)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def _opened_dir(path: str | int, dir_fd: int | None = None) -> Iterator[int]:
    fd = os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _entries(dir_fd: int, exclude: Exclude) -> dict[str, os.stat_result]:
    names = [n for n in os.listdir(dir_fd) if not exclude(n)]
    return {n: os.stat(n, dir_fd=dir_fd, follow_symlinks=False) for n in names}


def _kind(st: os.stat_result) -> str:
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    if stat.S_ISREG(st.st_mode):
        return "file"
    if stat.S_ISLNK(st.st_mode):
        return "link"
    return "other"


def read_regular(name: str, dir_fd: int, limit: int | None = None) -> bytes | None:
    """Contents of a regular file (at most ``limit`` bytes); None if it is not one."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, total = [], 0
        while limit is None or total < limit:
            chunk = os.read(fd, 1 << 20 if limit is None else min(1 << 20, limit - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _write_new(name: str, dir_fd: int, data: bytes, mode: int, owner: tuple[int, int] | None):
    fd = os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dir_fd,
    )
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode & 0o777)
    finally:
        os.close(fd)


def _remove(name: str, dir_fd: int):
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)  # fd-based, symlink-safe on Linux
    else:
        os.unlink(name, dir_fd=dir_fd)


def _copy_entry(name, st, src_fd, dst_fd, owner, exclude, depth, stats):
    kind = _kind(st)
    if kind == "dir":
        os.mkdir(name, 0o700, dir_fd=dst_fd)
        with _opened_dir(name, src_fd) as s, _opened_dir(name, dst_fd) as d:
            _sync_dir(s, d, owner, exclude, depth + 1, stats)
            if owner is not None:
                os.fchown(d, *owner)
            os.fchmod(d, st.st_mode & 0o777)
    elif kind == "link":
        os.symlink(os.readlink(name, dir_fd=src_fd), name, dir_fd=dst_fd)
        if owner is not None:
            os.chown(name, *owner, dir_fd=dst_fd, follow_symlinks=False)
    elif kind == "file":
        data = read_regular(name, src_fd)
        if data is None:  # replaced by a non-file between lstat and open
            stats.skipped += 1
            return
        _write_new(name, dst_fd, data, st.st_mode, owner)
        stats.bytes += len(data)
    else:
        stats.skipped += 1
        return
    os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dst_fd, follow_symlinks=False)
    stats.entries += 1


def _same(name, s_st, d_st, src_fd, dst_fd) -> bool:
    kind = _kind(s_st)
    if kind != _kind(d_st) or kind not in ("file", "link"):
        return False
    if kind == "link":
        return os.readlink(name, dir_fd=src_fd) == os.readlink(name, dir_fd=dst_fd)
    if s_st.st_size != d_st.st_size or (s_st.st_mode ^ d_st.st_mode) & 0o777:
        return False
    return read_regular(name, src_fd) == read_regular(name, dst_fd)


@dataclasses.dataclass
class SyncStats:
    """What a sync did: entries written, bytes copied, special files/too-deep dirs skipped."""

    entries: int = 0
    bytes: int = 0
    skipped: int = 0


def _sync_dir(src_fd, dst_fd, owner, exclude, depth, stats):
    if depth > MAX_DEPTH:
        stats.skipped += 1
        return
    src = _entries(src_fd, exclude)
    dst = _entries(dst_fd, exclude)
    for name in dst.keys() - src.keys():
        _remove(name, dst_fd)
    for name, s_st in sorted(src.items()):
        d_st = dst.get(name)
        if d_st is not None:
            if _kind(s_st) == "dir" and _kind(d_st) == "dir":
                with _opened_dir(name, src_fd) as s, _opened_dir(name, dst_fd) as d:
                    _sync_dir(s, d, owner, exclude, depth + 1, stats)
                    if owner is not None:
                        os.fchown(d, *owner)
                    os.fchmod(d, s_st.st_mode & 0o777)
                continue
            if _same(name, s_st, d_st, src_fd, dst_fd):
                continue
            _remove(name, dst_fd)
        _copy_entry(name, s_st, src_fd, dst_fd, owner, exclude, depth, stats)


def sync_tree(
    src: str, dst: str, *, exclude: Exclude = no_excludes, owner: tuple[int, int] | None = None
) -> SyncStats:
    """Makes ``dst``'s contents mirror ``src``'s (both directories must exist).

    Entries that ``exclude`` names are neither copied nor touched in ``dst``
    (choice 4). Unchanged files are left alone, so syncing back a barely edited
    workspace writes little.

    Args:
      src: the tree to copy (may be agent-controlled).
      dst: the tree to update.
      exclude: predicate on entry names.
      owner: (uid, gid) for everything written; None keeps the writer's (root's).

    Returns:
      Counts of what was written and skipped.
    """
    stats = SyncStats()
    with _opened_dir(src) as s, _opened_dir(dst) as d:
        _sync_dir(s, d, owner, exclude, 0, stats)
    return stats


@dataclasses.dataclass(frozen=True)
class Entry:
    """A leaf of a tree: a regular file (with a content digest) or a symlink."""

    kind: str  # "file" or "link"
    mode: int  # permission bits (files)
    digest: str  # blake2b of the contents (files) or the link target (links)


def _scan_dir(dir_fd, prefix, exclude, depth, out):
    if depth > MAX_DEPTH:
        return
    for name, st in sorted(_entries(dir_fd, exclude).items()):
        rel = prefix + name
        kind = _kind(st)
        if kind == "dir":
            with _opened_dir(name, dir_fd) as sub:
                _scan_dir(sub, rel + "/", exclude, depth + 1, out)
        elif kind == "link":
            target = os.readlink(name, dir_fd=dir_fd)
            out[rel] = Entry("link", 0, target)
        elif kind == "file":
            data = read_regular(name, dir_fd)
            if data is not None:
                out[rel] = Entry("file", st.st_mode & 0o777, hashlib.blake2b(data).hexdigest())


def scan_tree(root: str, *, exclude: Exclude = no_excludes) -> dict[str, Entry]:
    """Every file and symlink under ``root`` by relative path (symlinks not followed)."""
    out: dict[str, Entry] = {}
    with _opened_dir(root) as fd:
        _scan_dir(fd, "", exclude, 0, out)
    return out


@dataclasses.dataclass(frozen=True)
class TreeDiff:
    """Relative paths of files and symlinks added, modified or deleted between two trees."""

    added: tuple[str, ...]
    modified: tuple[str, ...]
    deleted: tuple[str, ...]

    @property
    def changed(self) -> tuple[str, ...]:
        return tuple(sorted(self.added + self.modified + self.deleted))


def diff_trees(before: str, after: str, *, exclude: Exclude = no_excludes) -> TreeDiff:
    """File-level diff (contents, executable bits, link targets) of two trees."""
    a = scan_tree(before, exclude=exclude)
    b = scan_tree(after, exclude=exclude)
    return TreeDiff(
        added=tuple(sorted(b.keys() - a.keys())),
        modified=tuple(sorted(p for p in a.keys() & b.keys() if a[p] != b[p])),
        deleted=tuple(sorted(a.keys() - b.keys())),
    )


def _iter_dir(dir_fd, rel, exclude, max_bytes, depth):
    for name, entry in sorted(_entries(dir_fd, exclude).items()):
        kind = _kind(entry)
        if kind == "file":
            data = read_regular(name, dir_fd, max_bytes)
            if data is not None:
                yield rel + name, data
        elif kind == "dir" and depth < MAX_DEPTH:
            with _opened_dir(name, dir_fd) as sub:
                yield from _iter_dir(sub, rel + name + "/", exclude, max_bytes, depth + 1)


def iter_files(
    root_fd: int, start: str, *, exclude: Exclude, max_bytes: int
) -> Iterator[tuple[str, bytes]]:
    """(path, first ``max_bytes``) of each regular file at or under ``start``, sorted.

    ``start`` resolves inside the root (``open_in_root``); below it nothing is followed.
    Paths are relative to the root, prefixed with ``start``.
    """
    prefix = posixpath.normpath(start.lstrip("/") or ".")
    fd = open_in_root(root_fd, start, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            yield prefix, os.read(fd, max_bytes)
        elif stat.S_ISDIR(mode):
            yield from _iter_dir(fd, "" if prefix == "." else prefix + "/", exclude, max_bytes, 0)
    finally:
        os.close(fd)


def _real_parent(root_fd: int, parts: list[str]) -> int:
    """Fd of root/parts, making every component a real directory (links/files replaced)."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            try:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    _remove(part, fd)
                    raise FileNotFoundError(part)
            except FileNotFoundError:
                os.mkdir(part, 0o755, dir_fd=fd)
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _split(path: str) -> list[str]:
    parts = [p for p in posixpath.normpath("/" + path).split("/") if p]
    if not parts:
        raise ValueError(f"not a file path: {path!r}")
    return parts


def _open_parent(root: str, parents: list[str]) -> int | None:
    """Fd of ``root/parents`` following no symlink; None if a component is not a real dir."""
    current = os.open(root, _DIR_FLAGS)
    for part in parents:
        try:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=current)
        except OSError:
            os.close(current)
            return None
        os.close(current)
        current = nxt
    return current


def remove_path(root: str, path: str) -> None:
    """Deletes ``root/path`` if present, following no symlink on the way."""
    *parents, name = _split(path)
    fd = _open_parent(root, parents)
    if fd is None:  # nothing of ours can be below a missing or non-directory component
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            _remove(name, fd)
    finally:
        os.close(fd)


def copy_path(src_root: str, dst_root: str, path: str) -> None:
    """Makes ``dst_root/path`` what ``src_root/path`` is, following no symlink (choice 1).

    A regular file or symlink is copied (permission bits kept); anything else, or
    nothing, at the source removes the destination entry. Whatever occupies a parent
    component in the destination (a symlink, a file) is replaced by a directory.
    """
    *parents, name = _split(path)
    src_fd = _open_parent(src_root, parents)
    st = None
    if src_fd is not None:
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
    try:
        if st is None or _kind(st) not in ("file", "link"):
            remove_path(dst_root, path)
            return
        with _opened_dir(dst_root) as root_fd:
            dst_fd = _real_parent(root_fd, parents)
        try:
            with contextlib.suppress(FileNotFoundError):
                _remove(name, dst_fd)
            if _kind(st) == "link":
                os.symlink(os.readlink(name, dir_fd=src_fd), name, dir_fd=dst_fd)
            else:
                data = read_regular(name, src_fd)
                _write_new(name, dst_fd, data or b"", st.st_mode, None)
        finally:
            os.close(dst_fd)
    finally:
        if src_fd is not None:
            os.close(src_fd)
