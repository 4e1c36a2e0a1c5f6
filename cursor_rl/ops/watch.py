"""The watchdog: watches a run, restarts what stalled or crashed, and alerts its owner.

    # supervise: start the roles, restart them, alert (what launch scripts do)
    python -m cursor_rl.ops.watch --workdir=W -- python -m cursor_rl.main --config=... --workdir=W
    python -m cursor_rl.ops.watch --workdir=W \
        --role='trainer=python -m cursor_rl.main ... --config.rl.role=trainer' \
        --role='sampler=python -m cursor_rl.main ... --config.rl.role=sampler'
    # watch only: alerts, no actions (a run started some other way)
    python -m cursor_rl.ops.watch --workdir=W --max_minutes=600

Every ``--poll_s`` seconds it reads what the run wrote — new rows of ``metrics.jsonl``
(a malformed line is skipped and counted), the roles' heartbeats, the event log, the
disk — and runs the detectors of ``cursor_rl.ops.detectors``. Each new finding is
recorded in ``WORKDIR/ops/events.jsonl``, acted on, and alerted (``ops.alerts``).

Actions (choices):

1. **A crashed role** (non-zero exit) **or a stalled one** (``--stall_minutes`` without
   progress; its whole process group is killed first) is restarted with the same
   command. Every role resumes from its own last checkpoint — the train loop from
   its stage's newest checkpoint, the RL trainer from its checkpoint and rollout
   cursor, the sampler from the newest policy — so a restart is a relaunch. Each
   role has ``--restart_budget`` restarts; past it the watchdog stops every role,
   alerts, and exits non-zero.
2. **A non-finite loss or gradient** (``--on_nonfinite=rewind``, the default): every
   role is stopped, the run is rewound to the newest checkpoint *before* the bad
   step, and the roles are restarted. Rewinding never deletes: the checkpoints saved
   at or after the bad step — for RL also the policies published after the restored
   one and the rollouts those policies sampled — move to ``WORKDIR/ops/quarantine/``
   and the trainer's rollout cursor is set back. ``--skip_bad_batch`` quarantines
   the offending rollout batch too, so the sampler draws a fresh one. ``restart``
   restarts without rewinding; ``alert`` only alerts.
3. **Everything else** (loss spike, infrastructure failure rate, reward collapse,
   disk nearly full, a failed checkpoint write) is alerted, not acted on: those need
   a person's judgement (or no action can fix them).
4. **Without roles** (watch only) findings are alerted with the action a supervisor
   would have taken; stalls and crashes of processes it did not start are not its
   to fix.
5. Alerts never block the loop (``ops.alerts``); the watchdog's own state —
   findings handled, restarts per role, malformed metric lines — is in its events.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from absl import flags
from etils import epath

from cursor_rl.ops import detectors, heartbeat
from cursor_rl.ops.alerts import Alerter
from cursor_rl.ops.detectors import Finding
from cursor_rl.workdir import Workdir, write_text_atomic

TRAIN_STAGES = ("pretrain", "long_context", "sft")
NONFINITE_ACTIONS = ("rewind", "restart", "alert")


@dataclasses.dataclass
class WatchConfig:
    """The watchdog's thresholds and actions (each is a flag of the same name)."""

    poll_s: float = 15.0
    stall_minutes: float = 30.0
    restart_budget: int = 3
    on_nonfinite: str = "rewind"
    skip_bad_batch: bool = False
    spike_factor: float = 3.0
    spike_window: int = 20
    spike_min_rows: int = 5
    spike_keys: tuple[str, ...] = ("ce_loss",)
    infra_max_rate: float = 0.5
    infra_window: int = 3
    reward_window: int = 5
    reward_fraction: float = 0.25
    reward_min_best: float = 0.05
    disk_min_free_fraction: float = 0.05
    disk_min_free_gib: float = 1.0
    checkpoint_tmp_minutes: float = 30.0
    webhook_url: str = ""  # or $CURSOR_RL_ALERT_WEBHOOK
    alert_timeout_s: float = 5.0
    alert_max_per_hour: int = 30
    max_minutes: float = 0.0  # watch only: stop after this long (0: until the run is done)

    def __post_init__(self):
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r}: one of {NONFINITE_ACTIONS}")
        if self.poll_s <= 0 or self.stall_minutes <= 0 or self.restart_budget < 0:
            raise ValueError("poll_s and stall_minutes must be > 0, restart_budget >= 0")


# ---- reading the run ----------------------------------------------------------------


class MetricsTail:
    """New rows of ``metrics.jsonl`` since the last read.

    Only complete lines are read (a line being written is left for the next read); a
    complete line that is not a JSON object is skipped and counted in ``malformed``.
    """

    def __init__(self, path: epath.Path):
        self.path = epath.Path(path)
        self.offset = 0
        self.malformed = 0
        self.malformed_lines: list[int] = []
        self._line = 0

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        rows = []
        for raw in data[: end + 1].splitlines():
            self._line += 1
            try:
                row = json.loads(raw)
            except ValueError:
                row = None
            if not isinstance(row, dict):
                self.malformed += 1
                self.malformed_lines.append(self._line)
                continue
            rows.append(row)
        return rows


# ---- rewinding ----------------------------------------------------------------------


def _quarantine(workdir: Workdir, path: epath.Path, tag: str) -> str:
    """Moves ``path`` under ``WORKDIR/ops/quarantine/<tag>/`` keeping its place."""
    relative = os.path.relpath(os.fspath(path), os.fspath(workdir.root))
    target = workdir.quarantine_dir / tag / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    path.rename(target)
    return relative


def rewind(
    workdir: Workdir | str,
    rows: Sequence[Mapping[str, Any]],
    stage: str,
    bad_step: int,
    *,
    skip_bad_batch: bool = False,
    tag: str | None = None,
) -> dict[str, Any]:
    """Sets ``stage`` back to its newest checkpoint before ``bad_step`` (choice 2).

    Returns what was done: the step restored (None: the stage starts over from the
    stage before it) and every path moved to quarantine.
    """
    workdir = Workdir.of(workdir)
    tag = tag or f"{stage}-{bad_step}-{int(time.time())}"
    directory = workdir.checkpoint_dir(stage)
    steps = detectors.checkpoint_steps(directory)
    moved = [_quarantine(workdir, directory / str(s), tag) for s in steps if s >= bad_step]
    kept = [s for s in steps if s < bad_step]
    restored = kept[-1] if kept else None
    done: dict[str, Any] = {
        "stage": stage,
        "bad_step": bad_step,
        "restored_step": restored,
        "tag": tag,
    }
    if stage == "rl":
        done.update(_rewind_rl(workdir, rows, restored or 0, bad_step, skip_bad_batch, tag, moved))
    done["quarantined"] = moved
    return done


def _rewind_rl(workdir, rows, restored, bad_step, skip_bad_batch, tag, moved) -> dict[str, Any]:
    """RL's part of a rewind: the trainer restarts at rollout ``restored`` with the
    policy version it had there; policies published later and rollouts they sampled
    are quarantined; the rollout cursor (``TRAINED``) goes back."""
    version = 0
    for row in rows:  # the policy version after RL step `restored`
        if row.get("stage") == "rl" and row.get("step") == restored and "policy_version" in row:
            version = int(row["policy_version"])
    for v in detectors.checkpoint_steps(workdir.policy_dir):
        if v > version:
            moved.append(_quarantine(workdir, workdir.policy_dir / str(v), tag))
    rollouts = workdir.rollouts_dir
    # Every batch from ``restored`` on, gaps included: with several samplers (sampler k
    # writes indices k, k+N, ...) a later batch may exist while an earlier one does not.
    indices = sorted(
        int(p.stem) for p in rollouts.glob("*.json") if p.stem.isdigit() and len(p.stem) == 6
    )
    for index in (i for i in indices if i >= restored):
        path = rollouts / f"{index:06d}.json"
        sampled_by = int(json.loads(path.read_text(encoding="utf-8")).get("policy_version") or 0)
        if sampled_by > version or (skip_bad_batch and index == bad_step - 1):
            moved.append(_quarantine(workdir, path, tag))
    write_text_atomic(rollouts / "TRAINED", str(restored))
    if workdir.rl_done_file.exists():
        moved.append(_quarantine(workdir, workdir.rl_done_file, tag))
    return {"restored_policy_version": version, "trained": restored}


# ---- the roles it supervises --------------------------------------------------------


class Role:
    """One supervised process: started in its own session (so a stop reaches every
    process it started, sandboxes included) with ``$CURSOR_RL_ROLE`` set."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: str | None):
        self.name, self.argv, self.log_dir = name, list(argv), log_dir
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.done = False
        self.seen_exit = False  # this life's exit was handled

    def start(self) -> None:
        self.seen_exit = False
        env = {**os.environ, heartbeat.ROLE_ENV: self.name}
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{self.name}.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )  # fmt: skip
        if out is not None:
            out.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def kill_leftovers(self) -> None:
        """SIGKILL to what an exited role left in its process group (tool workers,
        sandboxes), so a restarted role never races its previous life. Called as soon
        as the exit is seen: later, the group id could name someone else's group."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``grace_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


# ---- the watchdog -------------------------------------------------------------------


class Watchdog:
    """Reads the run, detects, acts and alerts (see the module docstring)."""

    def __init__(
        self,
        workdir: Workdir | str,
        config: WatchConfig,
        roles: Mapping[str, Sequence[str]] = (),
        *,
        log_dir: str | None = None,
        clock=time.time,
    ):
        self.workdir = Workdir.of(workdir)
        self.config = config
        self.clock = clock
        self.roles = {name: Role(name, argv, log_dir) for name, argv in dict(roles).items()}
        self.tail = MetricsTail(self.workdir.metrics_file)
        self.rows: list[dict[str, Any]] = []
        self.handled: set[str] = set()
        self.failed = False
        self.rewinds = 0
        self.alerter = Alerter(
            config.webhook_url or None,
            run=os.path.basename(os.fspath(self.workdir.root).rstrip("/")),
            record=lambda row: heartbeat.record_event(self.workdir, **row),
            timeout_s=config.alert_timeout_s,
            max_per_hour=config.alert_max_per_hour,
        )
        self._reported_malformed = 0

    # -- one look at the run --

    def findings(self) -> list[Finding]:
        """Every detector's findings on what the run has written so far."""
        cfg = self.config
        self.rows += self.tail.read()
        now = self.clock()
        found = detectors.nonfinite(self.rows)
        found += detectors.loss_spikes(
            self.rows,
            cfg.spike_keys,
            factor=cfg.spike_factor,
            window=cfg.spike_window,
            min_rows=cfg.spike_min_rows,
        )
        found += detectors.infra_failures(
            self.rows, max_rate=cfg.infra_max_rate, window=cfg.infra_window
        )
        found += detectors.reward_collapse(
            self.rows,
            window=cfg.reward_window,
            fraction=cfg.reward_fraction,
            min_best=cfg.reward_min_best,
        )
        beats = heartbeat.read_heartbeats(self.workdir)
        if self.roles:
            beats = self._supervised(beats)
        found += detectors.stalls(beats, now, cfg.stall_minutes * 60)
        if not self.workdir.is_remote:
            found += detectors.disk_nearly_full(
                os.fspath(self.workdir.root),
                min_free_fraction=cfg.disk_min_free_fraction,
                min_free_bytes=int(cfg.disk_min_free_gib * 2**30),
            )
        found += detectors.failed_checkpoints(
            self.workdir,
            heartbeat.read_events(self.workdir),
            now,
            tmp_age_s=cfg.checkpoint_tmp_minutes * 60,
        )
        return found

    def _supervised(self, beats: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        """The heartbeats of live processes of the roles it runs, by role: a beat
        belongs to the role whose session its process is in (a role's command may be
        a wrapper around the Python process that beats)."""
        sessions = {r.pid: r.name for r in self.roles.values() if r.poll() is None}
        mine = {}
        for beat in beats.values():
            try:
                session = os.getsid(int(beat.get("pid") or 0))
            except (ProcessLookupError, PermissionError, ValueError):
                continue
            if session in sessions:
                mine[sessions[session]] = {**beat, "role": sessions[session]}
        return mine

    def check(self) -> list[Finding]:
        """One poll: exits of the roles, then the detectors; acts on what is new."""
        new = []
        for role in self.roles.values():
            if role.done or role.seen_exit:
                continue
            code = role.poll()
            if code is None:
                continue
            role.seen_exit = True
            role.kill_leftovers()
            if code == 0:
                role.done = True
                heartbeat.record_event(self.workdir, "role_exited", role=role.name, code=0)
                continue
            new.append(
                Finding(
                    kind="crash",
                    key=f"crash:{role.name}:{role.pid}",
                    message=f"{role.name} (pid {role.pid}) exited with code {code}",
                    role=role.name,
                    evidence={"code": code, "restarts": role.restarts},
                )
            )
        for f in self.findings():
            if f.kind == "nonfinite":  # a rewind replays the step: its key is new then
                f = dataclasses.replace(f, key=f"{f.key}@{self.rewinds}")
            if f.key not in self.handled:
                new.append(f)
        if self.tail.malformed > self._reported_malformed:
            heartbeat.record_event(
                self.workdir,
                "metrics_malformed",
                count=self.tail.malformed,
                lines=self.tail.malformed_lines[-20:],
            )
            self._reported_malformed = self.tail.malformed
        for finding in new:
            self.handled.add(finding.key)
            heartbeat.record_event(self.workdir, "detected", **finding.to_json())
            action = self.act(finding)
            heartbeat.record_event(self.workdir, "action", key=finding.key, action=action)
            self.alerter.alert(
                key=finding.key,
                event=finding.kind,
                message=finding.message,
                evidence=finding.evidence,
                action=action,
            )
        return new

    # -- acting --

    def act(self, finding: Finding) -> str:
        """Takes the action for ``finding`` (choices 1-4); returns what was done."""
        kind = finding.kind
        if kind in ("crash", "stall"):
            role = self.roles.get(finding.role or "")
            if role is None:
                return f"none: not supervising {finding.role!r} (would restart it)"
            return self._restart([role], why=kind)
        if kind == "nonfinite":
            how = self.config.on_nonfinite
            if not self.roles or how == "alert":
                return f"none: alert only (on_nonfinite={how}, roles {sorted(self.roles)})"
            live = [r for r in self.roles.values() if not r.done]
            if how == "restart":
                return self._restart(live, why=kind)
            for r in live:
                r.stop()
            done = rewind(
                self.workdir,
                self.rows,
                finding.stage or "",
                int(finding.step or 0),
                skip_bad_batch=self.config.skip_bad_batch,
            )
            heartbeat.record_event(self.workdir, "rewound", **done)
            self.rewinds += 1
            stage, bad = finding.stage, int(finding.step or 0)
            self.rows = [
                r
                for r in self.rows
                if not (r.get("stage") == stage and (r.get("step") or 0) >= bad)
            ]
            where = done["restored_step"]
            where = f"step {where}" if where is not None else "the previous stage's checkpoint"
            moved = len(done["quarantined"])
            return (
                f"rewound {finding.stage} to {where} ({moved} paths quarantined); "
                + self._restart(live, why=kind, stopped=True)
            )
        return "none: alert only"

    def _restart(self, roles: Iterable[Role], *, why: str, stopped: bool = False) -> str:
        roles = list(roles)
        over = [r.name for r in roles if r.restarts >= self.config.restart_budget]
        if over:
            self.failed = True
            for r in self.roles.values():
                r.stop()
            return f"restart budget ({self.config.restart_budget}) spent by {over}: stopped the run"
        said = []
        for r in roles:
            if not stopped:
                r.stop()  # a stalled role (a crashed one's leftovers are gone already)
            r.restarts += 1
            r.done = False
            r.start()
            said.append(f"{r.name} (restart {r.restarts}/{self.config.restart_budget})")
        heartbeat.record_event(self.workdir, "restarted", roles=[r.name for r in roles], why=why)
        return "restarted " + ", ".join(said)

    # -- the loop --

    def run(self) -> int:
        """Starts the roles and watches until they are all done (0), the restart budget
        is spent (1), or, watching only, ``max_minutes`` pass (0)."""
        start = self.clock()
        heartbeat.record_event(self.workdir, "watch_started", roles=sorted(self.roles))
        for role in self.roles.values():
            role.start()
        try:
            while True:
                self.check()
                if self.failed:
                    return 1
                if self.roles and all(r.done for r in self.roles.values()):
                    return 0
                limit = self.config.max_minutes * 60
                if not self.roles and limit and self.clock() - start >= limit:
                    return 0
                time.sleep(self.config.poll_s)
        finally:
            for role in self.roles.values():
                role.stop()
            self.alerter.close()
            heartbeat.record_event(
                self.workdir,
                "watch_stopped",
                restarts={r.name: r.restarts for r in self.roles.values()},
                alerts=dict(self.alerter.counts),
                malformed_metric_lines=self.tail.malformed,
            )


# ---- command line -------------------------------------------------------------------


def _define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("workdir", None, "The run to watch.", flag_values=fv)
    flags.DEFINE_multi_string(
        "role", [], "NAME=COMMAND: a process to start and supervise.", flag_values=fv
    )
    flags.DEFINE_string(
        "log_dir", "", "Write each role's output to LOG_DIR/<role>.log.", flag_values=fv
    )
    for field in dataclasses.fields(WatchConfig):
        default = field.default
        if isinstance(default, bool):
            flags.DEFINE_bool(field.name, default, field.name, flag_values=fv)
        elif isinstance(default, int):
            flags.DEFINE_integer(field.name, default, field.name, flag_values=fv)
        elif isinstance(default, float):
            flags.DEFINE_float(field.name, default, field.name, flag_values=fv)
        elif isinstance(default, tuple):
            flags.DEFINE_list(field.name, list(default), field.name, flag_values=fv)
        else:
            flags.DEFINE_string(field.name, default, field.name, flag_values=fv)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cursor_rl.ops.watch --workdir=W [--role=N=CMD ...] [-- CMD]``."""
    fv = flags.FlagValues()
    _define_flags(fv)
    rest = fv(list(argv if argv is not None else sys.argv))[1:]
    if not fv.workdir:
        print("--workdir is required", file=sys.stderr)
        return 2
    values = {}
    for field in dataclasses.fields(WatchConfig):
        value = fv[field.name].value
        values[field.name] = tuple(value) if isinstance(field.default, tuple) else value
    try:
        config = WatchConfig(**values)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    roles = {}
    for spec in fv.role:
        name, sep, command = spec.partition("=")
        if not sep or not name or not command.strip():
            print(f"--role={spec!r}: expected NAME=COMMAND", file=sys.stderr)
            return 2
        roles[name] = shlex.split(command)
    if rest:
        roles.setdefault("main", rest)
    watchdog = Watchdog(fv.workdir, config, roles, log_dir=fv.log_dir or None)
    return watchdog.run()


if __name__ == "__main__":
    sys.exit(main())
