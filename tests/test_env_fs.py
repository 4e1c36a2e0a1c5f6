"""Tree operations on agent-controlled directories: confinement, sync, diff, restore."""

import errno
import os
import stat

import pytest

from cursor_rl.env import fs


def _write(path, text="x", mode=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    if mode is not None:
        os.chmod(path, mode)


def test_open_in_root_cannot_leave_the_root(tmp_path):
    root = tmp_path / "root"
    _write(str(root / "inside.txt"), "inside")
    _write(str(tmp_path / "secret.txt"), "secret")
    os.symlink(str(tmp_path / "secret.txt"), root / "abs_link")
    os.symlink("../secret.txt", root / "rel_link")
    os.symlink("/inside.txt", root / "rooted_link")  # absolute links resolve in the root
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for escape in ("abs_link", "rel_link", "../secret.txt", str(tmp_path / "secret.txt")):
            with pytest.raises(FileNotFoundError):
                fs.open_in_root(fd, escape, os.O_RDONLY)
        for path in ("rooted_link", "../../inside.txt", "/inside.txt"):
            f = fs.open_in_root(fd, path, os.O_RDONLY)
            assert os.read(f, 100) == b"inside"
            os.close(f)
        with pytest.raises(OSError) as e:
            fs.open_in_root(fd, "/proc/self/root/etc/passwd", os.O_RDONLY)
        assert e.value.errno == errno.ENOENT
    finally:
        os.close(fd)


def test_sync_mirrors_and_keeps_excluded_entries(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _write(str(src / "a.py"), "new a")
    _write(str(src / "pkg" / "b.py"), "b")
    _write(str(src / "tool.sh"), "#!/bin/sh", mode=0o4755)  # setuid is dropped
    _write(str(src / ".git" / "HEAD"), "agent's history")
    _write(str(src / "sub" / ".git" / "HEAD"), "agent's nested history")
    os.symlink("/etc/passwd", src / "link")
    os.mkfifo(src / "fifo")
    _write(str(dst / "a.py"), "old a")
    _write(str(dst / "stale.py"), "deleted by the agent")
    _write(str(dst / "pkg" / "b.py"), "b")
    _write(str(dst / ".git" / "HEAD"), "real history")
    unchanged_inode = os.stat(dst / "pkg" / "b.py").st_ino
    stats = fs.sync_tree(str(src), str(dst), exclude=fs.git_history)
    assert (dst / "a.py").read_text() == "new a"
    assert not (dst / "stale.py").exists()
    assert os.stat(dst / "pkg" / "b.py").st_ino == unchanged_inode
    assert stat.S_IMODE(os.stat(dst / "tool.sh").st_mode) == 0o755
    assert os.readlink(dst / "link") == "/etc/passwd"
    assert not (dst / "fifo").exists() and stats.skipped == 1
    assert (dst / ".git" / "HEAD").read_text() == "real history"
    assert not (dst / "sub" / ".git").exists()


def test_sync_survives_absurd_nesting(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    deep = src
    for _ in range(fs.MAX_DEPTH + 5):
        deep = deep / "d"
    _write(str(deep / "f"))
    dst.mkdir()
    fs.sync_tree(str(src), str(dst))
    assert (dst / "d").is_dir()


def test_diff_trees(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        _write(str(root / "same.py"), "same")
        _write(str(root / "__pycache__" / "x.pyc"), str(root))
    _write(str(a / "edited.py"), "1")
    _write(str(b / "edited.py"), "2")
    _write(str(a / "chmod.sh"), "s", mode=0o644)
    _write(str(b / "chmod.sh"), "s", mode=0o755)
    _write(str(a / "gone.py"))
    _write(str(b / "new.py"))
    os.symlink("x", a / "link")
    os.symlink("y", b / "link")
    diff = fs.diff_trees(str(a), str(b), exclude=fs.history_and_bytecode)
    assert diff.added == ("new.py",)
    assert diff.deleted == ("gone.py",)
    assert diff.modified == ("chmod.sh", "edited.py", "link")


def test_copy_path_never_writes_through_links(tmp_path):
    src, dst, outside = tmp_path / "src", tmp_path / "dst", tmp_path / "outside"
    _write(str(src / "tests" / "test_x.py"), "hidden test")
    outside.mkdir()
    dst.mkdir()
    os.symlink(str(outside), dst / "tests")  # the agent replaced tests/ with a link
    fs.copy_path(str(src), str(dst), "tests/test_x.py")
    assert not os.listdir(outside)
    assert (dst / "tests").is_dir() and not (dst / "tests").is_symlink()
    assert (dst / "tests" / "test_x.py").read_text() == "hidden test"
    _write(str(dst / "conftest.py"), "planted")
    fs.copy_path(str(src), str(dst), "conftest.py")  # absent at the source: removed
    assert not (dst / "conftest.py").exists()


def test_iter_files_does_not_follow_links(tmp_path):
    root = tmp_path / "root"
    _write(str(root / "a" / "f.py"), "f")
    _write(str(tmp_path / "outside" / "g.py"), "g")
    os.symlink(str(tmp_path / "outside"), root / "a" / "out")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        files = dict(fs.iter_files(fd, ".", exclude=fs.no_excludes, max_bytes=10))
        assert files == {"a/f.py": b"f"}
        assert dict(fs.iter_files(fd, "a/f.py", exclude=fs.no_excludes, max_bytes=10)) == files
    finally:
        os.close(fd)
