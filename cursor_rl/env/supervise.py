"""Supervising one sandboxed command: input, output capture, limits, and its processes' end.

``Sandbox.run`` starts the command chain; ``supervise`` sees it through:

1. **Output is kept head and tail.** Each stream keeps its first and last
   ``output_bytes / 2`` bytes around a marker; the middle of a long log matters least.
2. **Limits kill the whole command.** At the wall-clock timeout, or once the
   command has written ``output_kill_bytes``, the PID namespace's init is killed;
   the kernel then kills every process inside it. The init is found through bwrap's
   ``--info-fd`` and held by a pidfd, so a recycled pid is never signalled.
3. **Return means quiescent.** bwrap reports the command's status while its init
   (killed by ``--die-with-parent``) may still be killing leftovers; ``supervise``
   returns only when the init's pidfd says the namespace is empty, so the harness
   never races a process of the agent. An init already gone when its pid is read
   (a quick command on a loaded machine: bwrap reaped it first) left an empty
   namespace behind, since the kernel kills a namespace with its init: nothing is
   left to wait for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import selectors
import signal
import subprocess
import time

_KILL_GRACE_S = 5.0


class SandboxError(RuntimeError):
    """The sandbox could not be built or torn down (an infrastructure failure)."""


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
    """Keeps the head and tail of a stream (choice 1)."""

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


class _Command:
    """One running command: feeds stdin, captures output, enforces time and output limits."""

    def __init__(
        self, proc: subprocess.Popen, info_r: int, output_bytes: int, output_kill_bytes: int
    ):
        self.proc = proc
        self.info_r = info_r
        self.info = b""
        self.init_pidfd: int | None = None  # the PID namespace's init (choice 2)
        self.init_gone = False  # the init had exited before its pid was read (choice 3)
        self.proc_pidfd = os.pidfd_open(proc.pid)
        self.output_kill_bytes = output_kill_bytes
        self.out = _Capture(output_bytes)
        self.err = _Capture(output_bytes)
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
        if self.init_pidfd is not None or self.init_gone:
            return
        try:
            pid = json.loads(self.info)["child-pid"]
        except (ValueError, KeyError):  # not complete yet
            return
        try:
            self.init_pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # exited and reaped already: its namespace is empty
            self.init_gone = True

    def _kill(self, why: str):
        self.killed_for = why
        if self.init_pidfd is not None:
            # SIGKILL to the namespace's init: the kernel kills everything inside.
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.init_pidfd, signal.SIGKILL)
        else:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _reap_namespace(self):
        """Waits until the PID namespace is empty (choice 3): the init's pidfd turns
        readable only after the kernel has killed everything else inside."""
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
                    and self.out.total + self.err.total > self.output_kill_bytes
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
        if self.init_pidfd is None and not self.init_gone:
            raise SandboxError(
                f"the sandbox could not start the command: {self.err.text()[-2000:]}"
            )
        if self.init_pidfd is not None:
            self._reap_namespace()
        stderr = self.err.text()
        if self.killed_for == "timeout":
            stderr += (
                f"\n[timed out after {timeout_s:g} s: the command and its processes were killed]"
            )
        elif self.killed_for == "output":
            stderr += (
                f"\n[more than {self.output_kill_bytes} bytes of output: "
                "the command and its processes were killed]"
            )
        return CommandResult(
            exit_code=exit_code if exit_code >= 0 else 128 - exit_code,
            stdout=self.out.text(),
            stderr=stderr,
            timed_out=self.killed_for == "timeout",
        )


def supervise(
    proc: subprocess.Popen,
    info_r: int,
    *,
    stdin: bytes,
    timeout_s: float,
    output_bytes: int,
    output_kill_bytes: int,
) -> CommandResult:
    """Sees a started command chain through and returns what it did.

    Args:
      proc: the chain (its stdout and stderr are pipes; stdin a pipe if ``stdin``).
      info_r: read end of bwrap's ``--info-fd`` (closed here).
      stdin: bytes to feed, then close.
      timeout_s: wall-clock limit.
      output_bytes: bytes kept per stream.
      output_kill_bytes: output after which the command is killed.

    Returns:
      Exit code, captured output and whether the timeout fired.

    Raises:
      SandboxError: bwrap never started the command, or its processes outlived SIGKILL.
    """
    command = _Command(proc, info_r, output_bytes, output_kill_bytes)
    with contextlib.closing(command):
        return command.communicate(stdin, timeout_s)
