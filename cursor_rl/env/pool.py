"""Tool calls of many episodes at once, on a pool of worker processes.

    with ToolPool(num_workers=8, max_pending=64) as pool:
        episode = pool.open_episode(workspace, allow_hosts=...)
        result = episode.execute(call)          # or episode.submit(call) -> Future
        episode.close()                          # leaves the sandbox, syncs the workspace

Design choices:

1. **An episode lives on one worker.** Its sandbox (tmpfs, network namespace,
   forwarders) belongs to the worker process that entered it, so every call of the
   episode goes there; a new episode goes to the worker with the fewest.
2. **Back-pressure:** at most ``max_pending`` calls are queued or running across the
   pool; ``submit`` blocks (or times out) beyond that, so a fast sampler cannot pile
   up unbounded work.
3. **A crashed or hung worker costs only its own episodes.** Each call has a
   deadline (its tool's own timeout plus ``slack_s``). A worker that dies, or misses
   a deadline, is killed and replaced; the call gets an error observation and the
   worker's episodes are marked ``lost`` (their later calls answer so at once, and
   the RL loop should drop them). Commands that hang or crash inside a sandbox are
   the sandbox's business (timeouts, process-group kills) and never reach this point.
4. **Workers are fresh interpreters** (``python -c``, a socket pair for pickled
   messages), neither forked (a parent that imported JAX or runs threads is never
   duplicated) nor multiprocessing-spawned (which re-imports the parent's main
   module); workers import only ``cursor_rl.env``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from cursor_rl.chat.protocol import ToolCall, ToolCallError
from cursor_rl.env.sandbox import Sandbox, clean_stale_slots
from cursor_rl.env.tools import ToolConfig, ToolResult, Tools

_OPEN_CLOSE_TIMEOUT_S = 900.0  # copying a workspace in or out


def _worker_main(fd: int) -> None:
    """A worker's loop: owns sandboxes, runs their tool calls (choice 4)."""
    conn = Connection(fd)
    episodes: dict[int, tuple[Sandbox, Tools]] = {}
    try:
        while True:
            try:
                request_id, op, episode_id, payload = conn.recv()
            except EOFError:
                return
            try:
                if op == "open":
                    sandbox = Sandbox(**payload["sandbox"]).__enter__()
                    episodes[episode_id] = (sandbox, Tools(sandbox, payload["config"]))
                    reply = None
                elif op == "call":
                    reply = episodes[episode_id][1].execute(payload)
                else:  # "close"
                    episodes.pop(episode_id)[0].__exit__(None, None, None)
                    reply = None
                conn.send((request_id, True, reply))
            except Exception as e:
                conn.send((request_id, False, f"{type(e).__name__}: {e}"))
    finally:
        for sandbox, _ in episodes.values():
            sandbox.__exit__(None, None, None)


@dataclasses.dataclass
class _Request:
    op: str
    episode_id: int
    payload: Any
    deadline_s: float
    future: concurrent.futures.Future


class _Worker:
    """A worker process and the thread that feeds it one request at a time."""

    def __init__(self, pool: ToolPool, index: int):
        self.pool = pool
        self.index = index
        self.requests: queue.Queue[_Request | None] = queue.Queue()
        self.episodes: set[int] = set()
        self._start_process()
        self.thread = threading.Thread(target=self._serve, daemon=True, name=f"tool-worker-{index}")
        self.thread.start()

    def _start_process(self):
        parent, child = socket.socketpair()
        with child:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    f"from cursor_rl.env.pool import _worker_main; _worker_main({child.fileno()})",
                ],
                pass_fds=(child.fileno(),),
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            )
        self.conn = Connection(parent.detach())

    def _serve(self):
        ids = itertools.count()
        while (request := self.requests.get()) is not None:
            request_id = next(ids)
            with self.pool._lock:
                lost = request.episode_id in self.pool._lost
            if lost:
                self._fail(request, "its worker crashed or hung earlier")
                continue
            try:
                self.conn.send((request_id, request.op, request.episode_id, request.payload))
                if not self.conn.poll(request.deadline_s):
                    raise TimeoutError(f"no reply within {request.deadline_s:g} s")
                reply_id, ok, value = self.conn.recv()
                if reply_id != request_id:
                    raise EOFError(f"reply {reply_id} to request {request_id}")
            except (OSError, EOFError, TimeoutError) as e:
                self._replace(f"the tool worker failed ({type(e).__name__}: {e})")
                self._fail(request, "its worker crashed or hung")
                continue
            if ok:
                request.future.set_result(value)
            else:
                request.future.set_exception(RuntimeError(value))

    def _fail(self, request: _Request, why: str):
        if request.op == "call":
            request.future.set_result(
                ToolResult(f"Error: the environment of this episode was lost ({why}).", ok=False)
            )
        else:
            request.future.set_exception(RuntimeError(f"episode {request.episode_id}: {why}"))

    def _replace(self, why: str):
        """Choice 3: kill, mark the episodes lost, start a fresh process."""
        self.process.kill()
        self.process.wait()
        self.conn.close()
        clean_stale_slots()  # release the dead worker's tmpfs and namespaces now
        with self.pool._lock:
            self.pool._lost |= self.episodes
            self.episodes.clear()
        self._start_process()

    def stop(self):
        self.requests.put(None)
        self.thread.join()
        self.conn.close()  # the worker sees EOF, leaves its sandboxes and exits
        try:
            self.process.wait(timeout=_OPEN_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class PoolEpisode:
    """An episode's handle: its tool calls run on its worker."""

    def __init__(self, pool: ToolPool, episode_id: int, worker: _Worker):
        self._pool = pool
        self.episode_id = episode_id
        self._worker = worker

    @property
    def lost(self) -> bool:
        """Whether the episode's worker died (choice 3); its sandbox is gone."""
        with self._pool._lock:
            return self.episode_id in self._pool._lost

    @property
    def worker_pid(self) -> int:
        return self._worker.process.pid

    def submit(self, call: ToolCall | ToolCallError, timeout: float | None = None):
        """Queues a call; blocks while ``max_pending`` calls are in flight (choice 2).

        Returns:
          A Future of the ``ToolResult``.

        Raises:
          TimeoutError: no room in the pool within ``timeout`` seconds.
        """
        if self.lost:
            future = concurrent.futures.Future()
            future.set_result(
                ToolResult("Error: the environment of this episode was lost.", ok=False)
            )
            return future
        return self._pool._enqueue(
            self._worker, "call", self.episode_id, call, self._pool._deadline(call), timeout
        )

    def execute(self, call: ToolCall | ToolCallError) -> ToolResult:
        """Runs a call and waits for its observation (an ``AgentEpisode`` executor)."""
        return self.submit(call).result()

    def close(self) -> None:
        """Leaves the sandbox: the workspace gets the agent's final tree."""
        if self.lost:
            return
        self._pool._enqueue(
            self._worker, "close", self.episode_id, None, _OPEN_CLOSE_TIMEOUT_S, None
        ).result()
        with self._pool._lock:
            self._worker.episodes.discard(self.episode_id)


class ToolPool:
    """Worker processes running many episodes' tool calls concurrently.

    Args:
      num_workers: worker processes (each runs one command at a time).
      max_pending: calls queued or running across the pool before ``submit`` blocks.
      tool_config: the tools' limits (also used to set call deadlines).
      slack_s: grace added to a call's own timeout before its worker counts as hung.
    """

    def __init__(
        self,
        num_workers: int,
        *,
        max_pending: int = 64,
        tool_config: ToolConfig | None = None,
        slack_s: float = 30.0,
    ):
        self.tool_config = tool_config or ToolConfig()
        self.slack_s = slack_s
        self._lock = threading.Lock()
        self._lost: set[int] = set()
        self._slots = threading.BoundedSemaphore(max_pending)
        self._ids = itertools.count()
        self._workers = [_Worker(self, i) for i in range(num_workers)]

    def __enter__(self) -> ToolPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stops the workers; sandboxes still open are left (workspaces synced) first."""
        for worker in self._workers:
            worker.stop()

    def _deadline(self, call: ToolCall | ToolCallError) -> float:
        cfg = self.tool_config
        timeout = {
            "run_terminal": cfg.max_timeout_s,
            "search": cfg.search_timeout_s,
            "lint": cfg.lint_timeout_s,
        }.get(getattr(call, "name", ""), 0.0)
        if isinstance(call, ToolCall) and call.name == "run_terminal":
            timeout = min(float(call.arguments.get("timeout_s", cfg.default_timeout_s)), timeout)
        return timeout + self.slack_s

    def _enqueue(self, worker, op, episode_id, payload, deadline_s, timeout):
        if not self._slots.acquire(timeout=timeout):
            raise TimeoutError(f"the tool pool has no room within {timeout} s")
        future = concurrent.futures.Future()
        future.add_done_callback(lambda _: self._slots.release())
        worker.requests.put(_Request(op, episode_id, payload, deadline_s, future))
        return future

    def open_episode(self, workspace: str, **sandbox_args: Any) -> PoolEpisode:
        """Enters a sandbox for ``workspace`` on the least loaded worker.

        Args:
          workspace: the episode's private copy of the repository.
          **sandbox_args: ``Sandbox``'s keyword arguments (``allow_hosts``, ``limits``,
            ``hide_git_history``, ``readonly_paths``, ``env``).

        Raises:
          RuntimeError: the sandbox could not be entered (the worker's error message).
        """
        episode_id = next(self._ids)
        with self._lock:
            worker = min(self._workers, key=lambda w: len(w.episodes))
            worker.episodes.add(episode_id)
        payload = {"sandbox": {"workspace": workspace, **sandbox_args}, "config": self.tool_config}
        try:
            self._enqueue(worker, "open", episode_id, payload, _OPEN_CLOSE_TIMEOUT_S, None).result()
        except BaseException:
            with self._lock:
                worker.episodes.discard(episode_id)
            raise
        return PoolEpisode(self, episode_id, worker)
