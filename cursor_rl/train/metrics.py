"""Metrics sinks: ``WORKDIR/metrics.jsonl``, TensorBoard event files and the console.

Every row of metrics.jsonl is a JSON object with at least ``stage`` and ``step``;
rows from every stage (and from RL and eval) go to the same file. Only process 0
writes. A NaN or infinite value is written as ``null`` and its key listed under
``nonfinite``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from etils import epath

from cursor_rl.workdir import REMOTE_SCHEMES, Workdir


def _plain(value: Any) -> Any:
    """JSON-friendly scalar (numpy/jax scalars -> float/int; NaN/inf -> null)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends metric rows to metrics.jsonl and TensorBoard (process 0 only)."""

    def __init__(self, workdir: Workdir | str, *, enabled: bool = True):
        workdir = Workdir.of(workdir)
        self.enabled = enabled
        self._tb = None
        self._path = workdir.metrics_file
        self._tb_dir = os.fspath(workdir.tensorboard_dir)
        # Object stores (gs://) cannot append: there the file is rewritten whole, from
        # the rows kept here (read once, not before every write).
        self._rewrite: list[str] | None = None
        if enabled:
            workdir.root.mkdir(parents=True, exist_ok=True)
            if workdir.is_remote:
                _register_remote_event_files()
                old = self._path.read_text(encoding="utf-8") if self._path.exists() else ""
                self._rewrite = old.splitlines(keepends=True)

    def write(self, stage: str, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        row = {"stage": stage, "step": int(step), "time": time.time()}
        row.update({k: _plain(v) for k, v in metrics.items()})
        # JSON has no NaN: a non-finite value is written as null and named here, so a
        # reader (the watchdog) tells a NaN loss from a missing one.
        nonfinite = [k for k, v in metrics.items() if _plain(v) is None and v is not None]
        if nonfinite:
            row["nonfinite"] = nonfinite
        if not self.enabled:
            return row
        line = json.dumps(row) + "\n"
        if self._rewrite is None:
            with self._path.open("a", encoding="utf-8") as fh:
                fh.write(line)
        else:
            self._rewrite.append(line)
            self._path.write_text("".join(self._rewrite), encoding="utf-8")
        if self._tb is None:
            # Only writers pay for it (~2 s: protobuf); readers of metrics.jsonl do not.
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(self._tb_dir, flush_secs=30)
        for key, value in row.items():
            if key not in ("stage", "step", "time") and isinstance(value, int | float):
                self._tb.add_scalar(f"{stage}/{key}", value, int(step))
        return row

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(workdir: Workdir | str) -> list[dict[str, Any]]:
    """All rows of ``WORKDIR/metrics.jsonl`` (skipping a torn last line)."""
    path = Workdir.of(workdir).metrics_file
    rows = []
    if not path.exists():
        return rows
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


class _EventFile:
    """A TensorBoard event file on an object store, written through epath.

    An object cannot be appended to: the bytes so far are kept and the object is
    rewritten whole at each flush (tensorboardX flushes every ``flush_secs``).
    """

    def __init__(self, path: str):
        self._path = epath.Path(path)
        self._data = bytearray()
        self._written = 0

    def write(self, data: bytes) -> None:
        self._data += data

    def flush(self) -> None:
        if len(self._data) != self._written:
            self._path.write_bytes(bytes(self._data))
            self._written = len(self._data)

    def close(self) -> None:
        self.flush()


class _EventFiles:
    """tensorboardX's writer factory for URL paths: event files go through epath."""

    def open(self, path: str) -> _EventFile:
        return _EventFile(path)

    def directory_check(self, path: str) -> None:
        epath.Path(path).mkdir(parents=True, exist_ok=True)


def _register_remote_event_files() -> None:
    """Routes tensorboardX's ``gs://`` event files through epath, like every other file
    of the run (one client and one set of credentials; tensorboardX's own GCS writer
    would need google-cloud-storage credentials of its own)."""
    from tensorboardX import record_writer

    for scheme in REMOTE_SCHEMES:
        record_writer.register_writer_factory(scheme, _EventFiles())


class Progress:
    """A one-line console progress bar with the latest metrics."""

    def __init__(self, stage: str, total: int, *, enabled: bool = True, width: int = 24):
        self.stage, self.total, self.enabled, self.width = stage, max(total, 1), enabled, width
        self._tty = sys.stdout.isatty()

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        done = min(step / self.total, 1.0)
        filled = int(done * self.width)
        bar = "█" * filled + "░" * (self.width - filled)
        shown = " ".join(f"{k} {_format(v)}" for k, v in metrics.items() if _plain(v) is not None)
        line = f"[{self.stage}] {step:>6}/{self.total} {bar} {shown}"
        if self._tty:
            sys.stdout.write("\r" + line[:200])
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def finish(self) -> None:
        if self.enabled and self._tty:
            sys.stdout.write("\n")


def _format(value: Any) -> str:
    value = _plain(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
