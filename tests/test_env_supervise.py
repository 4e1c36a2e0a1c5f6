"""supervise: a sandbox's init that is already gone when its pid is read (a quick
command on a loaded machine) is an empty namespace, not an error."""

import json
import os
import subprocess
import sys

import pytest

from cursor_rl.env import supervise
from cursor_rl.env.sandbox import SandboxError


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _run(info: bytes):
    """supervise() on a plain command, with ``info`` as what bwrap's --info-fd said."""
    read, write = os.pipe()
    os.write(write, info)
    os.close(write)
    proc = subprocess.Popen(
        [sys.executable, "-c", "print('done')"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    return supervise.supervise(
        proc, read, stdin=b"", timeout_s=30, output_bytes=4096, output_kill_bytes=1 << 20
    )


def test_an_init_reaped_before_its_pid_is_read_is_an_empty_namespace():
    result = _run(json.dumps({"child-pid": _dead_pid()}).encode())
    assert result.exit_code == 0 and result.stdout.strip() == "done" and not result.timed_out


def test_no_init_reported_is_still_a_start_failure():
    with pytest.raises(SandboxError, match="could not start the command"):
        _run(b"")
