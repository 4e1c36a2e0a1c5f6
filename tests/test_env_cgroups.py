"""cgroup caps for a sandboxed command: limits written, members counted, caps enforced,
leftovers killed on removal, and the reason given when cgroups are unusable.

Tests that need a real hierarchy skip with ``cgroups.unavailable_reason()`` (not root,
no writable v2 or v1 memory and pids controllers); the fallback tests always run.
"""

import itertools
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from cursor_rl.env import cgroups, sandbox, testing
from cursor_rl.env.cgroups import CgroupLimits, Parents

_names = itertools.count()


@pytest.fixture
def parents():
    reason = cgroups.unavailable_reason()
    if reason is not None:
        pytest.skip(f"cgroups unavailable: {reason}")
    found = cgroups.usable_parents()
    yield found
    # Nothing a test created may outlive it.
    for d in found.dirs:
        leftovers = [n for n in os.listdir(d) if n.startswith(f"cursor_rl_test_{os.getpid()}_")]
        assert leftovers == [], d


def fresh_name():
    return f"cursor_rl_test_{os.getpid()}_{next(_names)}"


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def alive(pid):
    """Running (not merely a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def read(directory, name):
    with open(os.path.join(directory, name)) as f:
        return f.read().strip()


def test_finds_this_process_cgroup(parents):
    with open("/proc/self/cgroup") as f:
        lines = f.read().splitlines()
    controller = "" if parents.version == 2 else "memory"
    own = next(
        line.split(":", 2)[2] for line in lines if controller in line.split(":")[1].split(",")
    )
    assert parents.memory_dir.endswith(own.rstrip("/")) and os.path.isdir(parents.memory_dir)
    assert os.path.exists(os.path.join(parents.pids_dir, "cgroup.procs"))


def test_limits_are_written(parents):
    with CgroupLimits(fresh_name(), memory_bytes=96 << 20, max_pids=17) as cg:
        assert all(os.path.isdir(d) for d in cg.dirs)
        if cg.version == 2:
            assert read(cg.memory_dir, "memory.max") == str(96 << 20)
            if os.path.exists(os.path.join(cg.memory_dir, "memory.swap.max")):
                assert read(cg.memory_dir, "memory.swap.max") == "0"
        else:
            assert read(cg.memory_dir, "memory.limit_in_bytes") == str(96 << 20)
            if os.path.exists(os.path.join(cg.memory_dir, "memory.memsw.limit_in_bytes")):
                assert read(cg.memory_dir, "memory.memsw.limit_in_bytes") == str(96 << 20)
        assert read(cg.pids_dir, "pids.max") == "17"
        assert cg.pids() == [] and cg.oom_kills() == 0 and cg.fork_refusals() == 0
    assert not any(os.path.exists(d) for d in cg.dirs)


def test_processes_placed_in_it_are_counted(parents):
    with CgroupLimits(fresh_name(), 256 << 20, 64) as cg:
        # Joining before exec: the command and its children are members from the start.
        joined = subprocess.Popen(
            cg.join_argv(["sh", "-c", "sleep 30 & echo $!; wait"]),
            stdout=subprocess.PIPE,
            text=True,
        )
        grandchild = int(joined.stdout.readline())
        # Moving a running process: its later children follow it.
        moved = subprocess.Popen(["sleep", "30"])
        cg.add(moved.pid)
        wait_for(lambda: {joined.pid, grandchild, moved.pid} <= set(cg.pids()))
        with open(f"/proc/{grandchild}/cgroup") as f:
            assert cg.name in f.read()
        outside = subprocess.Popen(["sleep", "30"])
        assert outside.pid not in cg.pids()
        outside.kill()
        outside.wait()
    # Leaving killed the members.
    assert joined.wait(10) == -9 and moved.wait(10) == -9


# Children that succeed all hold their memory at the common deadline.
_ALLOCATE = textwrap.dedent(
    """
    import os, sys, time
    n, mib = int(sys.argv[1]), int(sys.argv[2])
    deadline = time.monotonic() + 1.5
    kids = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:
            block = bytearray(mib << 20)
            for j in range(0, len(block), 4096):
                block[j] = 1
            if time.monotonic() >= deadline:
                os._exit(2)
            time.sleep(deadline - time.monotonic())
            os._exit(0)
        kids.append(pid)
    ok = sum(os.waitpid(pid, 0)[1] == 0 for pid in kids)
    print("held", ok)
    sys.exit(0 if ok == n else 1)
    """
)


def test_memory_cap_kills_inside_and_is_reported(parents):
    with CgroupLimits(fresh_name(), memory_bytes=64 << 20, max_pids=64) as cg:
        proc = subprocess.run(
            cg.join_argv([sys.executable, "-c", _ALLOCATE, "4", "40"]),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode != 0
        held = int(proc.stdout.split()[-1]) if proc.stdout else 0  # 0: the parent was killed
        assert held <= 1  # 2 x 40 MiB at once never fit in 64 MiB
        assert cg.oom_kills() >= 1
        peak = cg.memory_peak_bytes()
        assert peak is None or peak <= 64 << 20
    assert subprocess.run(["true"]).returncode == 0  # the host is fine


def test_pids_cap_refuses_forks(parents):
    count_forks = textwrap.dedent(
        """
        import os, time
        n = 0
        try:
            while n < 200:
                if os.fork() == 0:
                    os.close(1), os.close(2)  # let the caller see the end of the output
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError:
            pass
        print(n)
        """
    )
    with CgroupLimits(fresh_name(), memory_bytes=1 << 30, max_pids=12) as cg:
        out = subprocess.run(
            cg.join_argv([sys.executable, "-c", count_forks]),
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert int(out) < 12  # the forker itself is one of the 12
        assert cg.fork_refusals() >= 1
        assert len(cg.pids()) == int(out)  # the orphaned sleepers are still members


def test_removal_kills_leftovers_and_removes_the_directory(parents):
    cg = CgroupLimits(fresh_name(), 256 << 20, 64)
    cg.create()
    out = subprocess.run(
        cg.join_argv(["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!"]),
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout
    daemon = int(out)
    assert alive(daemon) and daemon in cg.pids()  # it outlived the command
    cg.remove()
    wait_for(lambda: not alive(daemon))
    assert not any(os.path.exists(d) for d in cg.dirs)
    cg.remove()  # idempotent


def test_a_stale_cgroup_is_removed(parents):
    name = fresh_name()
    cg = CgroupLimits(name, 256 << 20, 64)
    cg.create()
    stray = subprocess.Popen(cg.join_argv(["sleep", "300"]))
    wait_for(lambda: stray.pid in cg.pids())
    # A crashed harness forgot it; the next user of the name cleans up first.
    with CgroupLimits(name, 128 << 20, 8) as again:
        assert stray.wait(10) == -9 and again.pids() == []
        assert read(again.pids_dir, "pids.max") == "8"
    cg.create()
    cgroups.remove_stale(name)
    assert not any(os.path.exists(d) for d in cg.dirs)


def test_a_stale_cgroup_under_other_parents_is_removed_from_its_record(parents):
    # A harness in another cgroup created it: our parents do not hold it.
    other = os.path.join(parents.memory_dir, fresh_name())
    os.mkdir(other)
    try:
        elsewhere = Parents(
            parents.version, other, other if parents.version == 2 else parents.pids_dir
        )
        name = fresh_name()
        cg = CgroupLimits(name, 256 << 20, 64, parents=elsewhere)
        cg.create()
        stray = subprocess.Popen(cg.join_argv(["sleep", "300"]))
        wait_for(lambda: stray.pid in cg.pids())
        cgroups.remove_stale(name, recorded=[other])  # not named like it: ignored
        assert os.path.isdir(cg.memory_dir)
        cgroups.remove_stale(name, recorded=cg.dirs)
        assert stray.wait(10) == -9
        assert not any(os.path.exists(d) for d in cg.dirs)
    finally:
        os.rmdir(other)


@pytest.mark.parametrize("version", [1, 2])
def test_a_directory_that_is_not_a_cgroup_gives_a_reason(tmp_path, monkeypatch, version):
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # get past the root check
    if version == 2:  # one unified directory, controllers seemingly enabled
        fake = Parents(2, str(tmp_path / "unified"), str(tmp_path / "unified"))
        os.mkdir(fake.memory_dir)
        (tmp_path / "unified" / "cgroup.subtree_control").write_text("memory pids\n")
    else:
        fake = Parents(1, str(tmp_path / "memory"), str(tmp_path / "pids"))
        for d in fake.dirs:
            os.mkdir(d)
    reason = cgroups.resolve([fake])
    assert isinstance(reason, str)
    assert f"is not a cgroup v{version} directory with the memory controller" in reason
    assert os.listdir(fake.memory_dir) == (["cgroup.subtree_control"] if version == 2 else [])
    # Missing directories, and reasons found earlier, are reported too.
    missing = Parents(version, str(tmp_path / "gone"), str(tmp_path / "gone"))
    reason = cgroups.resolve(["no v2 here", missing])
    assert reason.startswith("no v2 here; ") and "gone" in reason


def test_without_root_or_hierarchies_there_is_a_reason(tmp_path, monkeypatch):
    proc_cgroup = tmp_path / "cgroup"
    proc_cgroup.write_text("4:memory:/a\n0::/b\n")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    )
    found = cgroups.find_parents(str(proc_cgroup), str(mountinfo))
    assert isinstance(found[0], str)  # v2: no memory controller listed there
    assert found[1] == "no cgroup v1 pids hierarchy"
    assert "cannot read" in cgroups.find_parents(str(tmp_path / "none"), str(mountinfo))[0]
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in cgroups.resolve([Parents(1, str(tmp_path), str(tmp_path))])


def test_sandbox_without_cgroups_warns_once_and_keeps_rlimits(tmp_path, monkeypatch, caplog):
    testing.skip_without_sandbox()
    monkeypatch.setattr(cgroups, "_resolved", lambda: "no hierarchy (test)")
    sandbox._cgroups_or_warn.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="cursor_rl.env.sandbox"):
            for _ in range(2):
                with sandbox.Sandbox(str(tmp_path)) as sb:
                    result = sb.run("cat /proc/self/cgroup; ulimit -v", 10)
                    assert result.exit_code == 0, result.stderr
                    assert sb.run("echo again", 10).stdout == "again\n"
        warnings = [r for r in caplog.records if "cgroup limits are unavailable" in r.message]
        assert len(warnings) == 1 and "no hierarchy (test)" in warnings[0].message
        assert result.stdout.split()[-1] == str(sandbox.Limits().memory_bytes >> 10)
    finally:
        monkeypatch.undo()
        sandbox._cgroups_or_warn.cache_clear()
