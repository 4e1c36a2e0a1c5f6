"""The sandbox: isolation, limits, network allow-list, git history, workspace round trip.

Needs root and the system tools (launch/install_system_deps.sh); skips with the
reason otherwise, as CI's root run never does.
"""

import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from cursor_rl.env import fs, netns, sandbox, testing
from cursor_rl.env.sandbox import Limits, Sandbox, SandboxUnavailableError


@pytest.fixture(autouse=True, scope="module")
def _needs_sandbox():
    testing.skip_without_sandbox()


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "main.py").write_text("print('hi')\n")
    return str(ws)


def test_unavailable_without_root(monkeypatch, workspace):
    sandbox._static_unavailable_reason.cache_clear()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    try:
        with pytest.raises(SandboxUnavailableError, match="needs root"), Sandbox(workspace):
            pass
    finally:
        monkeypatch.undo()
        sandbox._static_unavailable_reason.cache_clear()


def test_commands_run_unprivileged_in_the_workspace(workspace):
    with Sandbox(workspace) as sb:
        result = sb.run(
            "id -u; id -G; pwd; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status", 10
        )
        assert result.exit_code == 0, result.stderr
        lines = result.stdout.split()
        assert lines[0] == lines[1] == str(sb.uid) and sb.uid != 0
        assert lines[2] == "/workspace"
        assert "0000000000000000" in result.stdout and "NoNewPrivs:\t1" in result.stdout
        assert sb.run("exit 3", 10).exit_code == 3
        assert sb.run("kill -9 $$", 10).exit_code == 137
        assert sb.run("cat; echo -n !", 10, stdin=b"fed").stdout == "fed!"
        with pytest.raises(RuntimeError):
            Sandbox(workspace).run("true", 1)


def test_environment_is_scrubbed(workspace, monkeypatch):
    monkeypatch.setenv("CURSOR_RL_TEST_SECRET", "hunter2")
    with Sandbox(workspace, env={"TASK_VAR": "1"}) as sb:
        env = sb.run("env", 10).stdout
    assert "hunter2" not in env and "TASK_VAR=1" in env and "HOME=/tmp" in env


def test_output_is_capped_head_and_tail(workspace):
    with Sandbox(workspace, limits=Limits(output_bytes=1000)) as sb:
        result = sb.run("seq 100000; echo last line", 10)
    assert result.stdout.startswith("1\n2\n") and result.stdout.endswith("last line\n")
    assert "bytes of output omitted" in result.stdout and len(result.stdout) < 1200


def test_timeout_kills_every_process_of_the_command(workspace):
    with Sandbox(workspace) as sb:
        result = sb.run("sleep 300 & setsid sleep 300 & echo started; sleep 300", 1)
        assert result.timed_out and result.stdout == "started\n"
        assert "timed out after 1 s" in result.stderr
        assert sandbox._processes_of(sb.uid) == []
        result = sb.run("(setsid nohup sleep 300 >/dev/null 2>&1 &); echo daemon", 10)
        assert result.exit_code == 0 and not result.timed_out
        assert sandbox._processes_of(sb.uid) == []  # background daemons die with the command


def test_nothing_of_the_host_is_visible(workspace, tmp_path):
    hidden = tmp_path / "hidden_tests"
    hidden.mkdir()
    (hidden / "test_secret.py").write_text("SECRET")
    os.symlink(str(hidden / "test_secret.py"), os.path.join(workspace, "link"))
    with Sandbox(workspace) as sb:
        for cmd in (
            f"cat {hidden}/test_secret.py",
            "cat link",
            f"cat ../../../..{hidden}/test_secret.py",
            f"ls {os.path.expanduser('~')}",
            "ls /run/cursor_rl_sandbox",
            f"ls {os.path.dirname(os.path.abspath(__file__))}",
            "cat /etc/shadow",
            "touch /usr/x",
            "touch /etc/x",
            "touch /x",
            "mount -t tmpfs none /tmp",
            "ls /proc/1/root/",
        ):
            result = sb.run(cmd, 10)
            assert result.exit_code != 0 and "SECRET" not in result.stdout, cmd
        assert sb.run("ls /proc | grep -c '^[0-9]'", 10).stdout.strip() in ("2", "3", "4")


def test_git_history_is_hidden_then_restored_exactly(tmp_path):
    task = testing.make_toy_task(str(tmp_path))
    before = fs.scan_tree(os.path.join(task.repo, ".git"))
    with Sandbox(task.repo) as sb:
        script = (
            "git log --all --oneline; git reflog; git stash list; git tag; "
            "git cat-file --batch-all-objects --batch; cat .git/packed-refs; "
            "git fsck --lost-found 2>&1; grep -r 'a \\* b' .git"
        )
        result = sb.run(script, 30)
        assert "a * b" not in result.stdout
        assert sb.run("git log --all --oneline | wc -l", 10).stdout.strip() == "1"
        assert sb.run("git status --short", 10).stdout == ""
        sb.run("git commit -q --allow-empty -m mine && rm -rf .git/refs", 10)
    assert fs.scan_tree(os.path.join(task.repo, ".git")) == before


def test_history_visible_when_not_hidden(tmp_path):
    task = testing.make_toy_task(str(tmp_path))
    with Sandbox(task.repo, hide_git_history=False) as sb:
        assert "a * b" in sb.run("git show v1-solution:calc/ops.py", 10).stdout


def test_workspace_changes_come_back(workspace):
    owner = os.stat(workspace).st_uid
    with Sandbox(workspace) as sb:
        script = "echo new > new.txt && rm src/main.py && mkdir -p d/e && ln -s ../new.txt d/l"
        assert sb.run(script + " && chmod 700 new.txt", 10).exit_code == 0
        assert not os.path.exists(os.path.join(workspace, "new.txt"))  # synced on exit
    assert pathlib.Path(workspace, "new.txt").read_text() == "new\n"
    assert not os.path.exists(os.path.join(workspace, "src", "main.py"))
    assert os.readlink(os.path.join(workspace, "d", "l")) == "../new.txt"
    st = os.stat(os.path.join(workspace, "new.txt"))
    assert st.st_uid == owner and st.st_mode & 0o777 == 0o700


def test_readonly_paths(workspace, tmp_path):
    tool = tmp_path / "toolchain"
    tool.mkdir()
    (tool / "bin.sh").write_text("echo tool ran\n")
    with Sandbox(workspace, readonly_paths=[str(tool)]) as sb:
        assert sb.run(f"sh {tool}/bin.sh", 10).stdout == "tool ran\n"
        assert sb.run(f"touch {tool}/x", 10).exit_code != 0
    with pytest.raises(ValueError):
        Sandbox(workspace, readonly_paths=["relative"])


class _Server:
    """A TCP server on the host that greets and closes."""

    def __init__(self, greeting, host="127.0.0.1"):
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        self.greeting = greeting
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(self.greeting)

    def close(self):
        self.sock.close()


_CLIENT = textwrap.dedent(
    """
    import socket, sys
    def try_(what, fn):
        try:
            print(what, "ok", fn())
        except Exception as e:
            print(what, "fail", type(e).__name__)
    def connect(host, port):
        with socket.create_connection((host, port), timeout=5) as s:
            return s.recv(100).decode()
    a, b, extra, c = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    try_("allowed", lambda: connect("127.0.0.1", a))
    try_("blocked", lambda: connect("127.0.0.1", b))
    try_("outside", lambda: connect("10.1.2.3", 80))
    try_("dns", lambda: socket.getaddrinfo("pypi.org", 443))
    try_("raw", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
    if extra != "-":
        try_("extra", lambda: connect(extra, c))
        try_("extra_other_port", lambda: connect(extra, b))
    """
)


def _host_address():
    """A non-loopback IPv4 address of this machine, if it has one."""
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        address = line.split()[3].split("/")[0]
        if not address.startswith("127."):
            return address
    return None


def test_network_allow_list(workspace):
    allowed, blocked = _Server(b"hello-A"), _Server(b"hello-B")
    extra = _host_address()
    wide = _Server(b"hello-C", host="0.0.0.0")  # reachable through the extra address
    allow = [f"127.0.0.1:{allowed.port}"] + ([f"{extra}:{wide.port}"] if extra else [])
    try:
        with Sandbox(workspace, allow_hosts=allow) as sb:
            with open(os.path.join(sb.live_root, "client.py"), "w") as f:
                f.write(_CLIENT)
            cmd = f"python3 client.py {allowed.port} {blocked.port} {extra or '-'} {wide.port}"
            out = sb.run(cmd, 30).stdout
            assert sb.run("ip addr add 10.9.9.9/32 dev lo", 10).exit_code != 0
            curl = sb.run(f"curl -sS --max-time 5 http://127.0.0.1:{blocked.port}/", 10)
            assert curl.exit_code != 0
    finally:
        for server in (allowed, blocked, wide):
            server.close()
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    assert lines["allowed"] == "ok hello-A"
    assert lines["blocked"] == "fail ConnectionRefusedError"
    assert lines["outside"].startswith("fail")
    assert lines["dns"] == "fail gaierror"
    assert lines["raw"] == "fail PermissionError"
    if extra:
        assert lines["extra"] == "ok hello-C"
        assert lines["extra_other_port"] == "fail ConnectionRefusedError"


def test_allow_list_entries_are_validated():
    with pytest.raises(ValueError):
        netns.resolve_endpoints(["no-port"])
    with pytest.raises(ValueError, match="does not resolve"):
        netns.resolve_endpoints(["no-such-host.invalid:443"])
    endpoints, names = netns.resolve_endpoints(["localhost:8080", "[::1]:9090"])
    assert ("127.0.0.1", 8080) in endpoints and ("::1", 9090) in endpoints
    assert "127.0.0.1 localhost" in netns.hosts_file(names)


@pytest.mark.parametrize(
    "limits, cmd, check",
    [
        (
            Limits(processes=64),
            "bomb() { bomb | bomb & }; bomb; sleep 2",
            lambda r: "Cannot fork" in r.stderr and not r.timed_out,
        ),
        (
            Limits(disk_bytes=16 << 20),
            "dd if=/dev/zero of=big bs=1M count=64",
            lambda r: "No space left" in r.stderr,
        ),
        (
            Limits(disk_inodes=500),
            "for i in $(seq 1000); do : > f$i; done",
            lambda r: "No space left" in r.stderr,
        ),
        (
            Limits(tmp_bytes=8 << 20),
            "dd if=/dev/zero of=/tmp/big bs=1M count=64",
            lambda r: "No space left" in r.stderr,
        ),
        (
            Limits(file_bytes=1 << 20),
            "head -c 4000000 /dev/zero > f",
            lambda r: r.exit_code != 0,
        ),
        (
            Limits(memory_bytes=512 << 20),
            "python3 -c 'x = bytearray(2 << 30)'",
            lambda r: "MemoryError" in r.stderr,
        ),
        (
            Limits(cpu_s=1),
            "python3 -c 'while True: pass'",
            lambda r: r.exit_code in (128 + signal.SIGXCPU, 137) and not r.timed_out,
        ),
        (
            Limits(output_kill_bytes=1 << 20),
            "yes",
            lambda r: "bytes of output" in r.stderr and not r.timed_out,
        ),
    ],
    ids=["fork-bomb", "disk", "inodes", "tmp", "file-size", "memory", "cpu", "output"],
)
def test_limits_bound_the_command_not_the_host(workspace, limits, cmd, check):
    free_before = shutil.disk_usage(workspace).free
    with Sandbox(workspace, limits=limits) as sb:
        result = sb.run(cmd, timeout_s=8)
        assert check(result), result
        assert sandbox._processes_of(sb.uid) == []
        assert sb.run("echo still fine", 10).stdout == "still fine\n"
    assert shutil.disk_usage(workspace).free > free_before - (64 << 20)
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def test_a_crashed_harness_leaves_nothing_behind(workspace, monkeypatch):
    def crash():
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from cursor_rl.env.sandbox import Sandbox\n"
                "sb = Sandbox(sys.argv[1]).__enter__()\n"
                "print(sb.slot, flush=True)\n"
                "sb.run('sleep 300', 300)\n",
                workspace,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        slot = int(child.stdout.readline())
        uid = sandbox.UID_BASE + slot
        while not sandbox._processes_of(uid):  # wait for the command to run
            time.sleep(0.01)
        child.kill()
        child.wait()
        deadline = time.monotonic() + 10
        while sandbox._processes_of(uid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sandbox._processes_of(uid) == []  # the command died with its harness
        stale_netns = os.path.join(netns.NETNS_DIR, f"cursor_rl_sb{slot}")
        assert os.path.exists(stale_netns)  # but a crash leaves state behind ...
        return slot, stale_netns

    def assert_clean(slot, stale_netns):
        assert sandbox._processes_of(sandbox.UID_BASE + slot) == []
        assert not os.path.exists(stale_netns)
        assert not os.path.exists(os.path.join(sandbox.STATE_ROOT, f"slot{slot}"))

    slot, stale_netns = crash()
    assert slot in sandbox.clean_stale_slots()  # ... which a supervisor can remove at once
    assert_clean(slot, stale_netns)
    slot, stale_netns = crash()
    monkeypatch.setattr(random, "randrange", lambda n: slot)
    with Sandbox(workspace) as sb:  # ... or the slot's next holder removes
        assert sb.slot == slot and sb.run("true", 10).exit_code == 0
    assert_clean(slot, stale_netns)


def test_masked_paths_read_as_empty(workspace, tmp_path):
    """A masked file reads empty and a masked directory lists empty (the stdlib copy
    of a task's module); everything beside them stays readable; nothing is writable."""
    tool = tmp_path / "toolchain"
    (tool / "pkg").mkdir(parents=True)
    (tool / "solution.py").write_text("SECRET = 1\n")
    (tool / "pkg" / "tests.py").write_text("SECRET = 2\n")
    (tool / "other.py").write_text("fine\n")
    masked = [str(tool / "solution.py"), str(tool / "pkg"), str(tool / "missing.py")]
    with Sandbox(workspace, readonly_paths=[str(tool)], masked_paths=masked) as sb:
        assert sb.run(f"cat {tool}/other.py", 10).stdout == "fine\n"
        shown = sb.run(f"cat {tool}/solution.py; ls -A {tool}/pkg; grep -r SECRET {tool}", 10)
        assert "SECRET" not in shown.stdout and "tests.py" not in shown.stdout
        assert sb.run(f"echo x > {tool}/solution.py", 10).exit_code != 0
        assert sb.run(f"touch {tool}/pkg/new.py", 10).exit_code != 0
    with pytest.raises(ValueError):
        Sandbox(workspace, masked_paths=["relative"])
