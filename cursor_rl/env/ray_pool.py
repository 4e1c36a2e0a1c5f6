"""Many episodes' tool calls and grading on Ray actors: ``ToolPool``'s interface, a cluster.

    with RayToolPool(num_workers=64, address="ray://head:10001", max_in_flight=256) as pool:
        episode = pool.open_episode(workspace, allow_hosts=...)
        result = episode.execute(call)          # or episode.submit(call) -> Future
        episode.close()                          # the workspace gets the agent's tree
        graded = pool.grade(spec, workspace)     # grader.grade, on a worker

``tool_pool(backend, num_workers, options)`` builds this or the local ``ToolPool``
from the ``rl.tool_backend`` / ``rl.ray`` config. Ray is an optional extra
(``pip install -e '.[ray]'``), imported when a ``RayToolPool`` is made.

Design choices:

1. **Workers are Ray actors** (``_SandboxHost``, one CPU each by default), each
   running one command at a time like a ``ToolPool`` process; an episode lives on one
   actor, a new one goes to the actor with the fewest. The driver talks to an actor
   under a per-actor lock, one call at a time, so a call's deadline (its tool's
   timeout plus ``slack_s``) measures the call, not the actor's queue.
2. **Workspaces travel** (``ship_workspaces``, the default): the driver packs the
   episode's starting tree into a tar, stores it in Ray's object store once per
   distinct content (a task group's episodes share one), and an actor unpacks it
   on its own node; closing the episode packs the agent's tree and the driver
   writes it into the workspace. So workers need no shared filesystem, only the same
   image (interpreters and ``readonly_paths`` at the same paths). Without shipping
   (one machine, or an NFS) actors enter the driver's paths directly.
3. **Per-worker caches.** An actor keeps the trees it unpacked (by content digest,
   ``cache_entries`` of them): the group's next episode on that actor, and grading
   against the same pristine repository, start from a local copy and fetch nothing.
   The driver sends a new episode to the least loaded actor, preferring one that
   already holds the tree.
4. **Back-pressure**: at most ``max_in_flight`` operations (opens, calls, closes,
   grades) are queued or running across the cluster; ``submit`` blocks (or times out)
   beyond that, as ``ToolPool``'s ``max_pending``.
5. **A dead worker is retried, then counted as lost.** A Ray error other than the
   method's own exception (the actor's process or node died, or it missed a
   deadline and was killed) replaces the actor. Each of its episodes, at its next
   operation, is *recovered* on another actor: a fresh sandbox from the starting
   tree, then its earlier calls replayed in order. The replay must give exactly the
   observations the agent saw; if one differs (a command whose output varies), or
   the episode has used up ``max_retries`` recoveries, it is ``lost``: its calls
   answer with an error, ``lost`` is true, and the RL loop drops it as an
   infrastructure failure, never a zero reward. Opens and grades carry no state and
   are simply retried on another actor. Other episodes never notice.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import io
import itertools
import os
import shutil
import tarfile
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

from cursor_rl.chat.protocol import ToolCall, ToolCallError
from cursor_rl.env import grader
from cursor_rl.env.pool import ToolPool
from cursor_rl.env.sandbox import Sandbox, clean_stale_slots
from cursor_rl.env.tools import ToolConfig, ToolResult, Tools

BACKENDS = ("local", "ray")
_OPEN_CLOSE_TIMEOUT_S = 900.0  # copying a workspace in or out


class WorkerLostError(RuntimeError):
    """Ray work whose worker died more often than the retries allow."""


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "rl.tool_backend='ray' needs the ray package: pip install -e '.[ray]'"
        ) from e
    return ray


# ---- trees in transit ----------------------------------------------------------------


def _owner_free(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def pack_tree(root: str) -> bytes:
    """The tree under ``root`` as an uncompressed tar (sorted, owners left out, links kept)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        tar.add(root, arcname=".", filter=_owner_free)
    return out.getvalue()


def _inside_only(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's ``data`` filter, dropping (not failing on) links that lead out of the tree."""
    try:
        return tarfile.data_filter(member, dest)
    except tarfile.FilterError:
        return None


def unpack_tree(blob: bytes, dest: str) -> None:
    """Writes a ``pack_tree`` archive into ``dest`` (created; agent trees are untrusted)."""
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
        tar.extractall(dest, filter=_inside_only)


def _replace_tree(blob: bytes, workspace: str) -> None:
    """The workspace becomes exactly the packed tree (files the agent deleted go too)."""
    parent = os.path.dirname(os.path.abspath(workspace))
    fresh = tempfile.mkdtemp(prefix=".incoming_", dir=parent)
    try:
        unpack_tree(blob, fresh)
        shutil.rmtree(workspace)
        os.rename(fresh, workspace)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise


# ---- the worker (runs inside a Ray actor) --------------------------------------------


class _SandboxHost:
    """One worker: its episodes' sandboxes and its cache of unpacked trees (choices 1, 3).

    Every method returns ``(ok, value)``: an exception of its own is data (``ok``
    false, the message), so a Ray error always means the worker itself failed.
    """

    def __init__(self, tool_config: ToolConfig, cache_entries: int):
        clean_stale_slots()  # what a dead predecessor on this node left
        self.tool_config = tool_config
        self.cache_entries = cache_entries
        self.scratch = tempfile.mkdtemp(prefix="cursor_rl_ray_")
        self.trees: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.unpacked = 0  # trees fetched and unpacked (cache misses)
        self.episodes: dict[int, tuple[Sandbox, Tools, str | None]] = {}

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> tuple[bool, dict[str, int]]:
        return True, {"unpacked": self.unpacked, "cached": len(self.trees)}

    def _tree(self, digest: str, holder: list) -> str:
        """The cached tree ``digest``; fetched (``holder[0]``, an ObjectRef) on a miss."""
        if digest in self.trees:
            self.trees.move_to_end(digest)
            return self.trees[digest]
        import ray

        path = os.path.join(self.scratch, "trees", digest)
        unpack_tree(ray.get(holder[0]), path)
        self.unpacked += 1
        self.trees[digest] = path
        while len(self.trees) > self.cache_entries:
            shutil.rmtree(self.trees.popitem(last=False)[1], ignore_errors=True)
        return path

    def _source(self, source: tuple, name: str) -> tuple[str, str | None]:
        """A path to work in: the driver's own (shared filesystem) or a private copy."""
        if source[0] == "path":
            return source[1], None
        copy = os.path.join(self.scratch, name)
        if source[0] == "once":  # a tree used once (a workspace to grade): not cached
            unpack_tree(source[1], copy)
            return copy, copy
        shutil.copytree(self._tree(source[1], source[2]), copy, symlinks=True)
        return copy, copy

    def open(self, episode_id: int, source: tuple, sandbox_args: dict[str, Any]):
        own = None
        try:
            workspace, own = self._source(source, f"episodes/{episode_id}-{os.urandom(4).hex()}")
            sandbox = Sandbox(workspace, **sandbox_args).__enter__()
            self.episodes[episode_id] = (sandbox, Tools(sandbox, self.tool_config), own)
            return True, None
        except Exception as e:
            if own:
                shutil.rmtree(own, ignore_errors=True)
            return False, f"{type(e).__name__}: {e}"

    def call(self, episode_id: int, call: ToolCall | ToolCallError):
        try:
            return True, self.episodes[episode_id][1].execute(call)
        except Exception as e:
            return False, f"{type(e).__name__}: {e}"

    def close(self, episode_id: int):
        """Leaves the sandbox; a private copy comes back packed."""
        try:
            sandbox, _, own = self.episodes.pop(episode_id)
            sandbox.__exit__(None, None, None)
            if own is None:
                return True, None
            blob = pack_tree(own)
            shutil.rmtree(own, ignore_errors=True)
            return True, blob
        except Exception as e:
            return False, f"{type(e).__name__}: {e}"

    def grade(self, spec: grader.GradeSpec, sources: dict[str, tuple]):
        """``grader.grade`` with the spec's trees and the workspace found on this node."""
        made = []
        try:
            paths = {}
            for field, source in sources.items():
                paths[field], own = self._source(source, f"grade/{field}-{os.urandom(4).hex()}")
                made += [own] if own else []
            workspace = paths.pop("workspace")
            return True, grader.grade(dataclasses.replace(spec, **paths), workspace)
        except Exception as e:
            return False, f"{type(e).__name__}: {e}"
        finally:
            for path in made:
                shutil.rmtree(path, ignore_errors=True)

    def shutdown(self):
        for sandbox, _, _ in self.episodes.values():
            sandbox.__exit__(None, None, None)
        self.episodes.clear()
        shutil.rmtree(self.scratch, ignore_errors=True)
        return True, None


# ---- the driver ----------------------------------------------------------------------


class _WorkerDied(Exception):
    """The actor failed (died, hung, or was replaced since the episode was placed)."""


class _Replaced(_WorkerDied):
    """The episode's actor had been replaced before this operation reached it."""


class _Slot:
    """A place for one actor; a dead actor is replaced in it (``generation`` moves on)."""

    def __init__(self, pool: RayToolPool, index: int):
        self.pool = pool
        self.index = index
        self.lock = threading.Lock()
        self.generation = 0
        self.episodes: set[int] = set()
        self.trees: set[str] = set()  # digests the actor has (as far as the driver knows)
        self._start()

    def _start(self):
        self.actor = self.pool._actor_class.remote(self.pool.tool_config, self.pool.cache_entries)
        self._pid = self.actor.pid.remote()  # first in the actor's queue

    @property
    def pid(self) -> int:
        return self.pool._ray.get(self._pid)

    def invoke(self, generation: int | None, method: str, args: tuple, deadline_s: float):
        """Runs ``method`` on the actor; ``(ok, value)``, or ``_WorkerDied``."""
        ray = self.pool._ray
        with self.lock:
            if generation is not None and generation != self.generation:
                raise _Replaced("its worker was replaced")
            try:
                return ray.get(getattr(self.actor, method).remote(*args), timeout=deadline_s)
            except ray.exceptions.RayTaskError:
                raise
            except ray.exceptions.RayError as e:
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                self._replace()
                raise _WorkerDied(why) from e

    def _replace(self):
        """Kills the actor (it may be hung, not dead) and starts a fresh one (choice 5)."""
        with contextlib.suppress(Exception):  # already gone
            self.pool._ray.kill(self.actor, no_restart=True)
        with self.pool._lock:
            self.generation += 1
            self.episodes.clear()
            self.trees.clear()
            self.pool.replaced += 1
        self._start()


class RayEpisode:
    """An episode's handle (``PoolEpisode``'s interface); its operations run in order."""

    def __init__(self, pool: RayToolPool, episode_id: int, workspace: str, sandbox_args):
        self._pool = pool
        self.episode_id = episode_id
        self.workspace = workspace
        self._sandbox_args = sandbox_args
        self._source = pool._source_of(workspace)
        self._slot: _Slot | None = None
        self._generation = -1
        self._log: list[tuple[ToolCall | ToolCallError, ToolResult]] = []
        self.retries = 0  # recoveries used (choice 5)
        self.lost_reason: str | None = None
        self._closed = False
        self._ops: collections.deque = collections.deque()
        self._ops_lock = threading.Lock()
        self._draining = False

    @property
    def lost(self) -> bool:
        """Whether the episode's environment is gone for good (an infrastructure failure)."""
        return self.lost_reason is not None

    @property
    def worker_pid(self) -> int:
        """The pid of the actor now holding the episode's sandbox."""
        return self._slot.pid

    def submit(self, call: ToolCall | ToolCallError, timeout: float | None = None):
        """Queues a call; blocks while ``max_in_flight`` operations are in flight.

        Returns:
          A Future of the ``ToolResult``.

        Raises:
          TimeoutError: no room within ``timeout`` seconds.
        """
        if self.lost:
            future = concurrent.futures.Future()
            future.set_result(self._lost_result())
            return future
        return self._pool._enqueue(self, "call", call, timeout)

    def execute(self, call: ToolCall | ToolCallError) -> ToolResult:
        """Runs a call and waits for its observation (an ``AgentEpisode`` executor)."""
        return self.submit(call).result()

    def close(self) -> None:
        """Leaves the sandbox: the workspace gets the agent's final tree."""
        if not self.lost:
            self._pool._enqueue(self, "close", None, None).result()

    # ---- run on the pool's threads, one operation of the episode at a time --------

    def _drain(self) -> None:
        while True:
            with self._ops_lock:
                if not self._ops:
                    self._draining = False
                    return
                op, payload, future = self._ops.popleft()
            try:
                future.set_result(getattr(self, "_do_" + op)(payload))
            except BaseException as e:
                future.set_exception(e)

    def _lost_result(self) -> ToolResult:
        return ToolResult(
            f"Error: the environment of this episode was lost ({self.lost_reason}).", ok=False
        )

    def _mark_lost(self, why: str) -> None:
        self.lost_reason = why
        if self._slot is not None:
            with self._pool._lock:
                self._slot.episodes.discard(self.episode_id)

    def _do_open(self, _) -> None:
        self._ensure_placed(first=True)

    def _do_call(self, call) -> ToolResult:
        while self._ensure_placed():
            try:
                ok, value = self._invoke(
                    "call", (self.episode_id, call), self._pool._deadline(call)
                )
            except _WorkerDied:
                continue  # recovered (or lost) by the next _ensure_placed
            if not ok:
                raise RuntimeError(value)
            self._log.append((call, value))
            return value
        return self._lost_result()

    def _do_close(self, _) -> None:
        if self._closed:
            return
        while self._ensure_placed():
            try:
                ok, value = self._invoke("close", (self.episode_id,), _OPEN_CLOSE_TIMEOUT_S)
            except _WorkerDied as e:
                if self._source[0] == "path" and not isinstance(e, _Replaced):
                    # The sync back into the driver's workspace may have begun: no replay.
                    self._mark_lost(f"its worker died while leaving the sandbox ({e})")
                    return
                continue
            if not ok:
                raise RuntimeError(value)
            if value is not None:
                _replace_tree(value, self.workspace)
            self._closed = True
            with self._pool._lock:
                self._slot.episodes.discard(self.episode_id)
            return

    def _invoke(self, method: str, args: tuple, deadline_s: float):
        return self._slot.invoke(self._generation, method, args, deadline_s)

    def _ensure_placed(self, first: bool = False) -> bool:
        """True once the episode has a live sandbox; recovers it if its worker died.

        Raises:
          RuntimeError: the sandbox could not be entered (not a worker failure).
        """
        if self.lost:
            return False
        if not first and self._generation == self._slot.generation:
            return True
        while True:
            if not first:
                self.retries += 1
                if self.retries > self._pool.max_retries:
                    self._mark_lost(f"its worker died {self.retries} times")
                    return False
            first = False
            self._slot, self._generation = self._pool._place(self)
            try:
                ok, value = self._invoke(
                    "open",
                    (self.episode_id, self._source, self._sandbox_args),
                    _OPEN_CLOSE_TIMEOUT_S,
                )
                if not ok:
                    with self._pool._lock:
                        self._slot.episodes.discard(self.episode_id)
                    raise RuntimeError(value)
                with self._pool._lock:
                    self._slot.trees.add(self._source[1])
                for call, seen in self._log:  # the replay (choice 5)
                    ok, again = self._invoke(
                        "call", (self.episode_id, call), self._pool._deadline(call)
                    )
                    if not ok or again != seen:
                        self._mark_lost(
                            "its worker died and replaying its calls gave other results"
                        )
                        return False
                with self._pool._lock:
                    self._pool.recovered += bool(self._log)
                return True
            except _WorkerDied:
                continue


class RayToolPool:
    """Ray actors running many episodes' tool calls and grades (see the module docstring).

    Args:
      num_workers: actors (each runs one command at a time).
      max_in_flight: operations queued or running across the pool before ``submit`` blocks.
      max_retries: worker deaths an episode (or a grade) survives before it is lost.
      tool_config: the tools' limits (also used to set call deadlines).
      slack_s: grace added to a call's own timeout before its actor counts as hung.
      address: the cluster to join (``ray.init(address=...)``; "" or None: a local
        Ray, unless one is already initialised, which is then used as it is).
      ship_workspaces: send trees through the object store (choice 2); False when the
        actors see the driver's paths.
      num_cpus_per_worker: CPUs each actor reserves (Ray's scheduling unit).
      cache_entries: unpacked trees each actor keeps (choice 3).
      init_kwargs: more ``ray.init`` arguments (``num_cpus``, ``object_store_memory``...).
    """

    def __init__(
        self,
        num_workers: int,
        *,
        max_in_flight: int = 64,
        max_retries: int = 1,
        tool_config: ToolConfig | None = None,
        slack_s: float = 30.0,
        address: str | None = None,
        ship_workspaces: bool = True,
        num_cpus_per_worker: float = 1.0,
        cache_entries: int = 16,
        init_kwargs: Mapping[str, Any] | None = None,
    ):
        self._ray = ray = _import_ray()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address or None, **dict(init_kwargs or {}))
        self.tool_config = tool_config or ToolConfig()
        self.slack_s = slack_s
        self.max_retries = max_retries
        self.ship_workspaces = ship_workspaces
        self.cache_entries = cache_entries
        self.max_in_flight = max_in_flight
        self.replaced = 0  # actors replaced after a failure
        self.recovered = 0  # episodes recovered by replay
        self.in_flight = 0
        self.peak_in_flight = 0
        self._lock = threading.Lock()
        self._room = threading.BoundedSemaphore(max_in_flight)
        self._ids = itertools.count()
        self._blobs: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_in_flight, thread_name_prefix="ray-tool"
        )
        self._actor_class = ray.remote(num_cpus=num_cpus_per_worker, max_restarts=0)(_SandboxHost)
        self._slots = [_Slot(self, i) for i in range(num_workers)]

    def __enter__(self) -> RayToolPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Leaves the sandboxes still open, stops the actors (and a Ray this pool started)."""
        self._threads.shutdown(wait=True)
        ray = self._ray
        for slot in self._slots:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(slot.actor.shutdown.remote(), timeout=_OPEN_CLOSE_TIMEOUT_S)
            ray.kill(slot.actor, no_restart=True)
        self._slots = []
        self._blobs.clear()
        if self._owns_ray:
            ray.shutdown()

    def worker_stats(self) -> list[dict[str, int]]:
        """Per actor: trees unpacked (cache misses) and trees cached."""
        return [slot.invoke(None, "stats", (), 60.0)[1] for slot in self._slots]

    def _deadline(self, call: ToolCall | ToolCallError) -> float:
        return ToolPool._deadline(self, call)  # same rule: the tool's timeout plus slack

    def _source_of(self, path: str, once: bool = False) -> tuple:
        """How an actor finds a tree: ("path", path), ("tree", digest, [ObjectRef]) for
        one its cache keeps, or ("once", tar) for one it uses once."""
        if not self.ship_workspaces:
            return ("path", path)
        blob = pack_tree(path)
        if once:
            return ("once", blob)
        digest = hashlib.sha256(blob).hexdigest()
        with self._lock:
            ref = self._blobs.get(digest)
            if ref is None:
                ref = self._blobs[digest] = self._ray.put(blob)
            self._blobs.move_to_end(digest)
            while len(self._blobs) > 4 * self.cache_entries:  # holders keep their own refs
                self._blobs.popitem(last=False)
        return ("tree", digest, [ref])

    def _place(self, episode: RayEpisode | None, digest: str | None = None) -> tuple[_Slot, int]:
        """The least loaded slot, one holding the tree first among equals (choice 3)."""
        if episode is not None:
            digest = episode._source[1]
        with self._lock:
            slot = min(self._slots, key=lambda s: (len(s.episodes), digest not in s.trees))
            if episode is not None:
                slot.episodes.add(episode.episode_id)
            return slot, slot.generation

    def _enqueue(self, episode: RayEpisode, op: str, payload, timeout: float | None):
        future = self._take_room(timeout)
        with episode._ops_lock:
            episode._ops.append((op, payload, future))
            start = not episode._draining
            episode._draining = True
        if start:
            self._threads.submit(episode._drain)
        return future

    def _take_room(self, timeout: float | None) -> concurrent.futures.Future:
        """Choice 4: a future that holds one of ``max_in_flight`` places until it is done."""
        if not self._room.acquire(timeout=timeout):
            raise TimeoutError(f"the Ray tool pool has no room within {timeout} s")
        with self._lock:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        future = concurrent.futures.Future()
        future.add_done_callback(lambda _: self._give_room())
        return future

    def _give_room(self) -> None:
        with self._lock:
            self.in_flight -= 1
        self._room.release()

    def open_episode(self, workspace: str, **sandbox_args: Any) -> RayEpisode:
        """Enters a sandbox for ``workspace`` on the least loaded actor.

        A worker that keeps dying makes a ``lost`` episode, not an error.

        Raises:
          RuntimeError: the sandbox could not be entered (the worker's error message).
        """
        episode = RayEpisode(self, next(self._ids), workspace, sandbox_args)
        self._enqueue(episode, "open", None, None).result()
        return episode

    def grade(self, spec: grader.GradeSpec, workspace: str) -> grader.GradeResult:
        """``grader.grade(spec, workspace)`` on an actor, retried if its worker dies.

        Raises:
          WorkerLostError: the work's worker died more than ``max_retries`` times.
          RuntimeError: grading itself failed (the worker's error message).
        """
        future = self._take_room(None)
        try:
            sources = {"workspace": self._source_of(workspace, once=True)}
            sources["pristine_repo"] = self._source_of(spec.pristine_repo)
            if spec.hidden_tests:
                sources["hidden_tests"] = self._source_of(spec.hidden_tests)
            deadline = spec.setup_timeout_s + spec.total_timeout_s + _OPEN_CLOSE_TIMEOUT_S
            for _ in range(self.max_retries + 1):
                slot, generation = self._place(None, sources["pristine_repo"][1])
                try:
                    ok, value = slot.invoke(generation, "grade", (spec, sources), deadline)
                except _WorkerDied:
                    continue
                if not ok:
                    raise RuntimeError(value)
                return value
            raise WorkerLostError(f"grading's worker died {self.max_retries + 1} times")
        finally:
            future.set_result(None)


def tool_pool(
    backend: str,
    num_workers: int,
    ray_options: Mapping[str, Any] | None = None,
    *,
    tool_config: ToolConfig | None = None,
) -> ToolPool | RayToolPool:
    """The pool ``rl.tool_backend`` names: ``"local"`` (``ToolPool``) or ``"ray"``.

    Args:
      backend: ``"local"`` or ``"ray"``.
      num_workers: worker processes or actors (``rl.tool_workers``).
      ray_options: the ``rl.ray`` section: ``address``, ``max_in_flight``,
        ``max_retries``, ``num_cpus_per_worker``, ``ship_workspaces``,
        ``object_store_memory_mb`` (a local Ray's store; 0: Ray's default).
    """
    if backend == "local":
        return ToolPool(num_workers, tool_config=tool_config)
    if backend != "ray":
        raise ValueError(f"rl.tool_backend must be one of {BACKENDS}, not {backend!r}")
    options = dict(ray_options or {})
    init_kwargs = {}
    store_mb = int(options.get("object_store_memory_mb", 0))
    if store_mb and not options.get("address"):
        init_kwargs["object_store_memory"] = store_mb << 20
    return RayToolPool(
        num_workers,
        max_in_flight=int(options.get("max_in_flight", 64)),
        max_retries=int(options.get("max_retries", 1)),
        tool_config=tool_config,
        address=str(options.get("address", "")) or None,
        ship_workspaces=bool(options.get("ship_workspaces", True)),
        num_cpus_per_worker=float(options.get("num_cpus_per_worker", 1.0)),
        init_kwargs=init_kwargs,
    )
