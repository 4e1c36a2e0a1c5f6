"""The watchdog's detectors: small pure functions from what a run wrote to findings.

Each detector reads one kind of evidence — metric rows (``metrics.jsonl``), heartbeats
(``cursor_rl.ops.heartbeat``), events, the disk — and returns a list of ``Finding``.
A finding carries a ``key`` that names the fault once (``nonfinite:rl:5``): the
watchdog acts and alerts once per key, however often a detector sees it again.

    nonfinite(rows)                                   NaN/Inf loss or gradient norm
    loss_spikes(rows, keys=("ce_loss",), factor=3.0)  loss > factor x rolling median
    infra_failures(rows, max_rate=0.5)                lost episodes (sandbox/infra)
    reward_collapse(rows, window=5, fraction=0.25)    RL reward fell and stayed down
    stalls(heartbeats, now, stall_s)                  no progress for T per role
    disk_nearly_full(path, min_free_fraction)         free space on the workdir's disk
    failed_checkpoints(workdir, events, now, ...)     a checkpoint write that failed

Choices:

1. **Rows as written.** ``MetricsWriter`` writes a non-finite float as ``null`` and
   lists its key under ``nonfinite``; the train step reports ``update_skipped`` when
   it refused a non-finite update. Any of the three on a watched key is a finding.
2. **Medians, not means**, for the spike baseline: one earlier spike does not raise
   the bar for the next. The baseline is the ``window`` rows before the one judged,
   of the same stage, and needs ``min_rows`` of them (the first steps of a stage
   fall fast and are not spikes).
3. **Rates over a window** for infrastructure failures and reward: one bad batch is
   noise, ``window`` of them is a fault. Reward collapse needs the run to have
   earned some reward first (``min_best``): a run that never learned has not
   collapsed.
4. **Pure**: detectors take their inputs (``now`` too) and touch nothing, so each is
   tested on recorded metric streams; ``disk_nearly_full`` takes the usage function.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from etils import epath

from cursor_rl.workdir import Workdir

# Keys whose non-finite value is a fault (losses of every stage, the gradient norm).
WATCHED_KEYS = ("loss", "ce_loss", "policy_loss", "grad_norm", "eval_loss")
# Orbax writes a checkpoint into ``<step>.orbax-checkpoint-tmp...`` and renames it
# when complete; one left behind is a write that never finished.
ORBAX_TMP_MARK = ".orbax-checkpoint-tmp"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One fault seen in a run."""

    kind: str  # nonfinite, loss_spike, infra_failures, reward_collapse, stall, disk, checkpoint
    key: str  # names the fault once (dedup of actions and alerts)
    message: str
    role: str | None = None  # the process role to act on, when one is to blame
    stage: str | None = None
    step: int | None = None
    evidence: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"evidence": dict(self.evidence)}


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def nonfinite(
    rows: Iterable[Mapping[str, Any]], keys: Sequence[str] = WATCHED_KEYS
) -> list[Finding]:
    """Rows whose loss or gradient norm is NaN/Inf (``null``), or that say so."""
    found = []
    for row in rows:
        stage, step = row.get("stage"), row.get("step")
        listed = [k for k in row.get("nonfinite") or () if k in keys]
        nulls = [k for k in keys if k in row and row[k] is None]
        bad = sorted(set(listed) | set(nulls))
        skipped = row.get("update_skipped")
        if not bad and not (_finite(skipped) and skipped > 0):
            continue
        what = ", ".join(bad) if bad else "update skipped for a non-finite loss or gradient"
        found.append(
            Finding(
                kind="nonfinite",
                key=f"nonfinite:{stage}:{step}",
                message=f"non-finite {what} at {stage} step {step}",
                stage=stage,
                step=step,
                evidence={"keys": bad, "update_skipped": skipped},
            )
        )
    return found


def loss_spikes(
    rows: Iterable[Mapping[str, Any]],
    keys: Sequence[str] = ("ce_loss",),
    *,
    factor: float = 3.0,
    window: int = 20,
    min_rows: int = 5,
) -> list[Finding]:
    """Rows whose loss exceeds ``factor`` x the median of the ``window`` rows before it
    (same stage and key; needs ``min_rows`` of them)."""
    history: dict[tuple[str, str], list[float]] = {}
    found = []
    for row in rows:
        stage = row.get("stage")
        for key in keys:
            value = row.get(key)
            if not _finite(value):
                continue
            past = history.setdefault((stage, key), [])
            if len(past) >= min_rows:
                median = statistics.median(past[-window:])
                if median > 0 and value > factor * median:
                    found.append(
                        Finding(
                            kind="loss_spike",
                            key=f"loss_spike:{stage}:{row.get('step')}:{key}",
                            message=(
                                f"{key} {value:.4g} at {stage} step {row.get('step')} is "
                                f"{value / median:.1f}x the median {median:.4g} of the "
                                f"{min(len(past), window)} rows before"
                            ),
                            stage=stage,
                            step=row.get("step"),
                            evidence={"value": value, "median": median, "factor": factor},
                        )
                    )
            past.append(float(value))
    return found


def rl_train_rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The RL trainer's rows (one per rollout batch), last row per step."""
    by_step = {}
    for row in rows:
        if row.get("stage") == "rl" and "scored_episodes" in row:
            by_step[row.get("step")] = row
    return [by_step[s] for s in sorted(by_step, key=lambda s: (s is None, s))]


def infra_failures(
    rows: Iterable[Mapping[str, Any]], *, max_rate: float = 0.5, window: int = 3
) -> list[Finding]:
    """The share of episodes lost to the sandbox or the infrastructure (not graded)
    over the last ``window`` RL batches is above ``max_rate``."""
    recent = rl_train_rows(rows)[-window:]
    if len(recent) < window:
        return []
    lost = sum(float(r.get("episodes_lost") or 0) for r in recent)
    scored = sum(float(r.get("scored_episodes") or 0) for r in recent)
    total = lost + scored
    if not total or lost / total <= max_rate:
        return []
    first, last = recent[0].get("step"), recent[-1].get("step")
    return [
        Finding(
            kind="infra_failures",
            key=f"infra_failures:rl:{last}",
            message=(
                f"{lost:.0f} of {total:.0f} episodes lost to the sandbox/infrastructure in "
                f"RL steps {first}-{last} ({lost / total:.0%} > {max_rate:.0%})"
            ),
            role="sampler",
            stage="rl",
            step=last,
            evidence={"lost": lost, "episodes": total, "rate": lost / total},
        )
    ]


def reward_collapse(
    rows: Iterable[Mapping[str, Any]],
    *,
    window: int = 5,
    fraction: float = 0.25,
    min_best: float = 0.05,
) -> list[Finding]:
    """The mean RL reward of the last ``window`` steps is below ``fraction`` of the
    best earlier ``window``-step mean, which was at least ``min_best``."""
    rewards = [
        (r.get("step"), float(r["reward"])) for r in rl_train_rows(rows) if _finite(r.get("reward"))
    ]
    if len(rewards) < 2 * window:
        return []
    means = [
        statistics.fmean(v for _, v in rewards[i : i + window])
        for i in range(len(rewards) - window + 1)
    ]
    best, now = max(means[:-window] or means[:1]), means[-1]
    if best < min_best or now >= fraction * best:
        return []
    step = rewards[-1][0]
    return [
        Finding(
            kind="reward_collapse",
            key=f"reward_collapse:rl:{step}",
            message=(
                f"RL reward over the last {window} steps is {now:.3f}, below "
                f"{fraction:.0%} of its best {window}-step mean {best:.3f}"
            ),
            stage="rl",
            step=step,
            evidence={"recent_mean": now, "best_mean": best},
        )
    ]


def stalls(
    heartbeats: Mapping[str, Mapping[str, Any]], now: float, stall_s: float
) -> list[Finding]:
    """Roles that made no progress for ``stall_s`` and are not waiting on another
    role, or that stopped beating (a hung process) for ``stall_s``."""
    found = []
    for role, beat in sorted(heartbeats.items()):
        if beat.get("finished"):
            continue
        silent = now - float(beat.get("time") or 0)
        idle = now - float(beat.get("progress_time") or 0)
        if silent >= stall_s:
            why = f"no heartbeat for {silent / 60:.1f} min"
        elif idle >= stall_s and not beat.get("waiting"):
            why = f"no progress for {idle / 60:.1f} min (at {beat.get('stage')} {beat.get('step')})"
        else:
            continue
        found.append(
            Finding(
                kind="stall",
                key=f"stall:{role}:{beat.get('pid')}:{beat.get('stage')}:{beat.get('step')}",
                message=f"{role} (pid {beat.get('pid')}) stalled: {why}",
                role=role,
                stage=beat.get("stage"),
                step=beat.get("step"),
                evidence={"silent_s": silent, "idle_s": idle, "pid": beat.get("pid")},
            )
        )
    return found


def disk_nearly_full(
    path: str,
    *,
    min_free_fraction: float = 0.05,
    min_free_bytes: int = 2**30,
    usage: Callable[[str], Any] = shutil.disk_usage,
) -> list[Finding]:
    """The disk that holds ``path`` has less than ``min_free_fraction`` of its size or
    ``min_free_bytes`` free (a local workdir; object stores do not fill)."""
    try:
        du = usage(path)
    except OSError:
        return []
    if du.free >= min_free_bytes and du.free >= min_free_fraction * du.total:
        return []
    return [
        Finding(
            kind="disk",
            key=f"disk:{path}",
            message=(
                f"disk of {path} nearly full: {du.free / 2**30:.2f} GiB free of "
                f"{du.total / 2**30:.1f} GiB"
            ),
            evidence={"free": du.free, "total": du.total},
        )
    ]


def failed_checkpoints(
    workdir: Workdir | str,
    events: Iterable[Mapping[str, Any]],
    now: float,
    *,
    tmp_age_s: float = 1800.0,
    stages: Sequence[str] = ("pretrain", "long_context", "sft", "rl"),
) -> list[Finding]:
    """Checkpoint writes that failed: ``checkpoint_failed`` events the roles recorded,
    and Orbax temporary directories older than ``tmp_age_s`` (a write that never
    finished)."""
    workdir = Workdir.of(workdir)
    found = []
    for e in events:
        if e.get("event") == "checkpoint_failed":
            found.append(
                Finding(
                    kind="checkpoint",
                    key=f"checkpoint:{e.get('path')}:{e.get('step')}",
                    message=(
                        f"checkpoint {e.get('step')} at {e.get('path')} failed: {e.get('error')}"
                    ),
                    role=e.get("role"),
                    step=e.get("step"),
                    evidence=dict(e),
                )
            )
    dirs = [workdir.checkpoint_dir(s) for s in stages] + [workdir.policy_dir]
    for directory in dirs:
        if workdir.is_remote or not directory.exists():
            continue
        for entry in directory.iterdir():
            if ORBAX_TMP_MARK not in entry.name:
                continue
            age = now - os.path.getmtime(os.fspath(entry))
            if age >= tmp_age_s:
                found.append(
                    Finding(
                        kind="checkpoint",
                        key=f"checkpoint:{entry}",
                        message=(
                            f"checkpoint write never finished: {entry} "
                            f"(unchanged for {age / 60:.0f} min)"
                        ),
                        evidence={"path": os.fspath(entry), "age_s": age},
                    )
                )
    return found


def checkpoint_steps(directory: epath.Path | str) -> list[int]:
    """The finished checkpoint steps in an Orbax directory, ascending."""
    directory = epath.Path(directory)
    if not directory.exists():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
