"""What a running role says about itself: heartbeats and events, read by the watchdog.

    beat = Heartbeat(workdir, "trainer")   # one per process role
    beat.progress("rl", step)              # the role moved on: a step, a rollout batch
    beat.waiting("rollout 7")              # alive, but blocked on another role
    record_event(workdir, "checkpoint_failed", role="trainer", path=..., error=...)

Choices:

1. **One small file per role**, ``WORKDIR/ops/heartbeats/<role>.json``, replaced
   whole (``write_text_atomic``): the watchdog reads the newest state, never half of
   one, on local disk or ``gs://``. It holds the pid and host, the stage and step, the
   time of the last beat and of the last *progress*, and whether the role is waiting.
2. **Progress and liveness are told apart.** A sampler waiting for the trainer beats
   (``waiting``) but makes no progress; the watchdog calls a role stalled when it made
   no progress for T minutes and is not waiting (or when it stopped beating at all),
   so only the role that holds the run up is restarted.
3. **Cheap**: a beat writes at most once per ``min_interval_s`` (and when the stage
   or the waiting state changes), so a training loop can beat every step; progress
   times are then exact to ``min_interval_s``, far below any stall threshold.
4. **Events** (``WORKDIR/ops/events.jsonl``, one JSON object per line) are what a role
   cannot say with a beat: a checkpoint that failed to write. The watchdog appends
   its own detections, actions and alerts to the same file; the report reads it.
5. **Never fatal**: a heartbeat or event that cannot be written (disk full, a
   transient object-store error) is logged and the run goes on; losing a beat costs
   at most a false stall, which the watchdog's threshold absorbs.
6. The role name comes from the caller or ``$CURSOR_RL_ROLE`` (set by the watchdog
   for the processes it starts), so one command line serves every role.

Pure Python (no JAX): the watchdog imports it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

from cursor_rl.workdir import Workdir, append_text, write_text_atomic

log = logging.getLogger(__name__)

ROLE_ENV = "CURSOR_RL_ROLE"


def role_name(default: str) -> str:
    """``$CURSOR_RL_ROLE`` when the watchdog started this process, else ``default``."""
    return os.environ.get(ROLE_ENV) or default


class Heartbeat:
    """Writes one role's heartbeat file (see the module docstring)."""

    def __init__(
        self,
        workdir: Workdir | str,
        role: str,
        *,
        enabled: bool = True,
        min_interval_s: float = 10.0,
    ):
        self.workdir = Workdir.of(workdir)
        self.role = role
        self.enabled = enabled
        self.min_interval_s = float(min_interval_s)
        self._path = self.workdir.heartbeat_file(role)
        now = time.time()
        self._state: dict[str, Any] = {
            "role": role,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": now,
            "time": now,
            "progress_time": now,
            "stage": None,
            "step": None,
            "waiting": None,
        }
        self._written = 0.0
        self._write()

    def progress(self, stage: str, step: int, **info: Any) -> None:
        """The role moved on (a train step, a rollout batch, an eval)."""
        now = time.time()
        moved = (stage, int(step)) != (self._state["stage"], self._state["step"])
        was_waiting = self._state["waiting"] is not None
        new_stage = stage != self._state["stage"]
        self._state.update(info)
        self._state.update(stage=stage, step=int(step), time=now, waiting=None)
        if moved:
            self._state["progress_time"] = now
        if was_waiting or new_stage or now - self._written >= self.min_interval_s:
            self._write()

    def waiting(self, on: str) -> None:
        """Alive, blocked on another role (``on`` says what for)."""
        now = time.time()
        changed = self._state["waiting"] != on
        self._state.update(time=now, waiting=on)
        if changed or now - self._written >= self.min_interval_s:
            self._write()

    def finished(self) -> None:
        """The role's work is done: a stopped beat after this is not a stall."""
        self._state.update(time=time.time(), waiting=None, finished=True)
        self._write()

    def _write(self) -> None:
        if not self.enabled:
            return
        try:
            write_text_atomic(self._path, json.dumps(self._state))
            self._written = time.time()
        except OSError as e:  # choice 5
            log.warning("heartbeat %s not written: %s", self._path, e)


_BEATS: dict[tuple[str, str], Heartbeat] = {}


def for_role(workdir: Workdir | str, default_role: str, *, enabled: bool = True) -> Heartbeat:
    """This process's heartbeat for its role (``role_name(default_role)``), made once:
    the stages of one process share it."""
    workdir = Workdir.of(workdir)
    role = role_name(default_role)
    key = (str(workdir), role)
    if key not in _BEATS:
        _BEATS[key] = Heartbeat(workdir, role, enabled=enabled)
    return _BEATS[key]


def finish_all() -> None:
    """Marks every heartbeat of this process finished (its work is done)."""
    for beat in _BEATS.values():
        beat.finished()
    _BEATS.clear()


def checkpoint_failure_recorder(workdir: Workdir | str, default_role: str, *, enabled: bool = True):
    """A ``CheckpointManager(on_error=...)`` callback: records ``checkpoint_failed``
    with the role, the directory, the step and the error (the error still raises)."""

    def record(directory: str, step: int | None, error: BaseException) -> None:
        if enabled:
            record_event(
                workdir,
                "checkpoint_failed",
                role=role_name(default_role),
                path=directory,
                step=step,
                error=repr(error),
            )

    return record


def read_heartbeats(workdir: Workdir | str) -> dict[str, dict[str, Any]]:
    """Every role's latest heartbeat, by role (unreadable files are skipped)."""
    directory = Workdir.of(workdir).ops_dir / "heartbeats"
    beats: dict[str, dict[str, Any]] = {}
    if not directory.exists():
        return beats
    for path in directory.glob("*.json"):
        try:
            beat = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(beat, dict) and "role" in beat:
            beats[str(beat["role"])] = beat
    return beats


def record_event(workdir: Workdir | str, event: str, **fields: Any) -> dict[str, Any]:
    """Appends one event to ``WORKDIR/ops/events.jsonl``; returns it. Never raises."""
    row = {"time": time.time(), "event": event, **fields}
    try:
        append_text(Workdir.of(workdir).ops_events_file, json.dumps(row, default=str) + "\n")
    except OSError as e:  # choice 5
        log.warning("event %s not recorded: %s", event, e)
    return row


def read_events(workdir: Workdir | str) -> list[dict[str, Any]]:
    """The events so far, oldest first (a torn or malformed line is skipped)."""
    path = Workdir.of(workdir).ops_events_file
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
