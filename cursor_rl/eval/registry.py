"""The saturation registry: every eval of each benchmark, across runs, and which are retired.

    registry = Registry.for_run(workdir, shared=cfg.rl.eval.registry)  # see choice 2
    if registry.is_active("tiny_bench"):
        summary = runner.evaluate(...)
        registry.record(summary)          # True when this eval retired the benchmark

Composer 2 gives evals a half-life: once the best checkpoint reaches 90% on one, it is
retired and replaced. For that to hold across an experiment, every run of it records
into one registry (``rl.eval.registry``, a local path or ``gs://``), so a benchmark
saturated by one run is skipped by the next.

Choices:

1. **Retire at saturation.** A benchmark is retired by the first record whose pass@1
   reaches that record's threshold (``>=``, default 0.9, the Composer 2 rule; each
   record carries the threshold of the process that wrote it, so the state is a
   function of the records alone, whoever reads them). A retired benchmark is no
   longer evaluated (``is_active``); later records of it are kept in its history but
   change nothing. Retirement is permanent for the registry.
2. **Where it lives.** ``rl.eval.registry`` empty: the run's own registry,
   ``WORKDIR/eval/registry.json`` (``Workdir.registry_file``), as before; set: that
   path, shared by every run of the experiment (give an absolute path or a ``gs://``
   URL, since every run must name the same place). Paths go through ``etils.epath``,
   like the rest of the workdir code.
3. **No locks: an append-only directory of records.** Object stores have no file
   locks and no atomic read-modify-write of one object, so writers never rewrite
   anything: each eval is one new JSON object with a name no other writer can pick
   (``<write time, ns>-<host>-<pid>-<random>.json``), written under a name starting
   with ``.`` (which readers skip) and renamed into place, so no reader sees half a
   record (locally ``workdir.write_text_atomic``; on ``gs://`` the rename is a
   server-side copy: plain GCS uploads are whole already, but a store reached
   through fsspec need not be). Concurrent writers therefore lose nothing. The state
   (status, retirement, history) is the fold over all records in name order (write
   time, then the unique suffix as a tie-break), recomputed on every call, so a
   restarted process, another run or the report sees exactly what was recorded.
   ``record``'s return value reports the fold right after its own write: with
   several writers racing past the threshold at once, each may briefly see itself
   first, but every later read agrees on one retiring record.
4. **Layout and the old format.** For a path ending in ``.json`` (the per-run
   default) the records go to the sibling directory ``<stem>.records/`` and the path
   itself is the legacy single-file registry (``"format": 1``, written by earlier
   versions); for any other path (a directory) they go to ``PATH/records/`` and
   ``PATH/registry.json`` is the legacy file. A legacy file, when present, is read
   as the registry's oldest history (its benchmarks, statuses and retirements as
   stored, ahead of every record) and never written again: new evals become
   records, so it needs no migration, and copying an old run's ``registry.json``
   into a shared registry's directory carries its history over.
5. **A corrupt record stops the read** with a ``RegistryError`` naming the file, as
   a corrupt legacy file does; nothing is ever overwritten or deleted. A record is
   history, and the fold's answer (is the benchmark retired, by which eval) can
   depend on any one of them, so skipping one could silently re-activate a retired
   benchmark or move its retirement; the error says to repair the file or move it
   out of the records directory. Records cannot be torn by a crash (choice 3), so
   this means a hand edit or a foreign file. Names starting with ``.`` (a local
   write in progress) and names not ending in ``.json`` are not records.
   ``record`` reads the registry before writing, so nothing is added to a registry
   that cannot be read.

Record format (``"format": 2``)::

    {"format": 2, "bench", "stage", "step", "date", "time", "pass@1", "k", "pass@k",
     "best_of_k", "tasks", "episodes", "threshold", "run", "writer"}

``benchmarks()`` returns, per benchmark, ``{"status": "active" | "retired",
"retired": null | {"stage", "step", "date", "time", "pass@1", "threshold", "run",
"record"}, "history": [{"stage", "step", "date", "time", "pass@1", "k", "pass@k",
"best_of_k", "tasks", "episodes", "threshold", "run", "record"}, ...]}`` where
``record`` names the file an entry came from (the legacy file's name for its entries).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import re
import socket
import threading
import time
import uuid
from typing import Any

from etils import epath

from cursor_rl.workdir import Workdir, is_remote, resolve, write_text_atomic

DEFAULT_THRESHOLD = 0.9
FORMAT = 1  # the legacy single-file registry
RECORD_FORMAT = 2  # one record per eval
LEGACY_FILE = "registry.json"
RECORDS_DIR = "records"
ACTIVE, RETIRED = "active", "retired"
_RETIRED_KEYS = ("stage", "step", "date", "time", "pass@1", "threshold", "run", "record")
_HISTORY_KEYS = ("stage", "step", "date", "time", "pass@1", "k", "pass@k", "best_of_k",
                 "tasks", "episodes", "threshold", "run", "record")  # fmt: skip
_HOST = re.compile(r"[^A-Za-z0-9]+")
_clock_lock = threading.Lock()
_last_ns = [0]


class RegistryError(ValueError):
    """The registry (its legacy file or one of its records) is not valid."""


class Registry:
    """Benchmarks' eval history and saturation status, kept as records (module docstring).

    Args:
      path: the registry: a ``.json`` file path (records beside it) or a directory
        (choice 4); local or ``gs://``. Created on the first record.
      threshold: the pass@1 at which this process's records retire a benchmark.
      run: who records (e.g. the run's workdir), kept with each record.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        threshold: float = DEFAULT_THRESHOLD,
        run: str | None = None,
    ):
        if not 0 < threshold <= 1:
            raise ValueError(f"saturation threshold {threshold} must be in (0, 1]")
        self.path = epath.Path(path)
        self.threshold = threshold
        self.run = run
        if self.path.name.endswith(".json"):
            self.legacy_file = self.path
            self.records_dir = self.path.parent / (self.path.name[: -len(".json")] + ".records")
        else:
            self.legacy_file = self.path / LEGACY_FILE
            self.records_dir = self.path / RECORDS_DIR

    @classmethod
    def for_run(
        cls,
        workdir: Workdir | str | os.PathLike,
        shared: str = "",
        *,
        threshold: float = DEFAULT_THRESHOLD,
    ) -> Registry:
        """The registry a run records into (choice 2).

        Args:
          workdir: the run's directory.
          shared: ``rl.eval.registry``: empty for the run's own
            ``WORKDIR/eval/registry.json``, else the experiment's shared registry.
          threshold: ``rl.eval.retire_at``.
        """
        workdir = Workdir.of(workdir)
        path = resolve(shared, "eval registry") if shared else workdir.registry_file
        return cls(path, threshold=threshold, run=str(workdir))

    def benchmarks(self) -> dict[str, dict[str, Any]]:
        """Every recorded benchmark's entry (a copy; see the module docstring's format)."""
        return copy.deepcopy(self._load())

    def is_active(self, name: str) -> bool:
        """Whether ``name`` should still be evaluated (never recorded counts as active)."""
        entry = self._load().get(name)
        return entry is None or entry["status"] == ACTIVE

    def active(self) -> list[str]:
        return sorted(n for n, e in self._load().items() if e["status"] == ACTIVE)

    def retired(self) -> list[str]:
        return sorted(n for n, e in self._load().items() if e["status"] == RETIRED)

    def record(self, summary: dict[str, Any], *, now: float | None = None) -> bool:
        """Adds one eval to its benchmark's history as a new record (choice 3).

        Args:
          summary: what ``cursor_rl.eval.runner.evaluate`` returned (``bench``,
            ``stage``, ``step``, ``k_values`` and ``overall`` are read).
          now: the eval's time (seconds since the epoch; default: now).

        Returns:
          True if this eval retired the benchmark.

        Raises:
          RegistryError: the registry cannot be read (nothing is written then).
        """
        self._load()  # choice 5: never add to a registry that cannot be read
        now = time.time() if now is None else now
        overall = summary["overall"]
        ks = summary.get("k_values") or []
        k = ks[-1] if ks else None
        bench = summary["bench"]
        if not isinstance(bench, str) or not bench:
            raise ValueError(f"summary names no benchmark (bench={bench!r})")
        record = {
            "format": RECORD_FORMAT,
            "bench": bench,
            "stage": summary["stage"],
            "step": int(summary["step"]),
            "date": _date(now),
            "time": now,
            "pass@1": overall.get("pass@1"),
            "k": k,
            "pass@k": overall.get(f"pass@{k}"),
            "best_of_k": overall.get(f"best_of_{k}"),
            "tasks": overall.get("tasks"),
            "episodes": overall.get("episodes"),
            "threshold": self.threshold,
            "run": self.run,
            "writer": f"{socket.gethostname()}:{os.getpid()}",
        }
        name = _record_name()
        _publish(self.records_dir / name, json.dumps(record, sort_keys=True) + "\n")
        retired = self._load().get(bench, {}).get("retired")
        return retired is not None and retired["record"] == name

    def record_files(self) -> list[epath.Path]:
        """The record files, in fold order (choice 3)."""
        directory = self.records_dir
        if is_remote(directory):
            _forget_listing(directory)
        if not directory.exists():
            return []
        names = sorted(
            p.name for p in directory.iterdir() if p.name.endswith(".json") and p.name[:1] != "."
        )
        return [directory / name for name in names]

    def markdown(self, *, history: int = 0) -> str:
        """A Markdown table of every benchmark: status, evals, last and best pass@1,
        where it was retired and how many runs recorded it; with ``history`` > 0, each
        benchmark's last ``history`` evals too."""
        benchmarks = self._load()
        if not benchmarks:
            return f"No benchmark recorded (saturation threshold {self.threshold:.0%})."
        lines = [
            f"Saturation threshold: pass@1 ≥ {self.threshold:.0%}. Records: "
            f"`{os.fspath(self.records_dir)}`.",
            "",
            "| benchmark | status | evals | last pass@1 | best pass@1 | retired at | runs |",
            "|---|---|---:|---:|---:|---|---:|",
        ]
        for name, entry in sorted(benchmarks.items()):
            entries = entry["history"]
            scores = [h["pass@1"] for h in entries if h["pass@1"] is not None]
            last = f"{scores[-1]:.3f}" if scores else "-"
            best = f"{max(scores):.3f}" if scores else "-"
            retired = entry["retired"]
            where = "-"
            if retired:
                where = f"{retired['stage']} step {retired['step']} ({retired['date']})"
                if retired.get("run"):
                    where += f" in `{retired['run']}`"
            runs = len({h["run"] for h in entries if h.get("run")})
            lines.append(
                f"| {name} | {entry['status']} | {len(entries)} | {last} | {best} | {where} "
                f"| {runs} |"
            )
        if history > 0:
            for name, entry in sorted(benchmarks.items()):
                shown = entry["history"][-history:]
                lines += [
                    "",
                    f"{name}: last {len(shown)} of {len(entry['history'])} evals",
                    "",
                    "| eval | pass@1 | tasks | run | date |",
                    "|---|---:|---:|---|---|",
                ]
                for h in shown:
                    score = "-" if h["pass@1"] is None else f"{h['pass@1']:.3f}"
                    lines.append(
                        f"| {h.get('stage')} step {h.get('step')} | {score} "
                        f"| {h.get('tasks', '-')} | {h.get('run') or '-'} | {h.get('date', '-')} |"
                    )
        return "\n".join(lines)

    # ---- the fold ---------------------------------------------------------------

    def _load(self) -> dict[str, dict[str, Any]]:
        """The registry's state: the legacy file, then every record (choices 3-5)."""
        state = self._load_legacy()
        for path in self.record_files():
            record = self._read_record(path)
            entry = {key: record.get(key) for key in _HISTORY_KEYS} | {"record": path.name}
            bench = state.setdefault(
                record["bench"], {"status": ACTIVE, "retired": None, "history": []}
            )
            bench["history"].append(entry)
            score = entry["pass@1"]
            if bench["status"] == ACTIVE and score is not None and score >= entry["threshold"]:
                bench["status"] = RETIRED
                bench["retired"] = {key: entry[key] for key in _RETIRED_KEYS}
        return state

    def _load_legacy(self) -> dict[str, dict[str, Any]]:
        path = self.legacy_file
        if not path.exists() or path.is_dir():
            return {}
        text = path.read_text(encoding="utf-8")
        try:
            state = json.loads(text)
        except json.JSONDecodeError as err:
            raise self._corrupt(path, f"not JSON ({err})") from err
        _validate_legacy(state, lambda reason: self._corrupt(path, reason))
        benchmarks = state["benchmarks"]
        for entry in benchmarks.values():
            entry["history"] = [
                {key: h.get(key) for key in _HISTORY_KEYS} | {"record": path.name}
                for h in entry["history"]
            ]
            if entry["retired"] is not None:
                entry["retired"] = {key: entry["retired"].get(key) for key in _RETIRED_KEYS} | {
                    "record": path.name
                }
        return benchmarks

    def _read_record(self, path: epath.Path) -> dict[str, Any]:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise self._corrupt(path, f"not JSON ({err})") from err
        reason = _record_problem(record)
        if reason:
            raise self._corrupt(path, reason)
        return record

    def _corrupt(self, path: epath.Path, reason: str) -> RegistryError:
        return RegistryError(
            f"eval registry {os.fspath(path)} is corrupt: {reason}. It is part of the "
            "benchmarks' eval history, so it is neither overwritten nor skipped: repair it "
            f"or move it out of {os.fspath(path.parent)}."
        )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _record_problem(record: Any) -> str:
    """What is wrong with a record ("" if nothing)."""
    if not isinstance(record, dict):
        return "expected a JSON object"
    if record.get("format") != RECORD_FORMAT:
        return f"format {record.get('format')!r}, expected {RECORD_FORMAT}"
    if not isinstance(record.get("bench"), str) or not record["bench"]:
        return 'no "bench" name'
    if not isinstance(record.get("stage"), str):
        return 'no "stage"'
    if not isinstance(record.get("step"), int) or isinstance(record.get("step"), bool):
        return '"step" is not an integer'
    if not _number(record.get("time")):
        return '"time" is not a number'
    score = record.get("pass@1", "missing")
    if score is not None and not (_number(score) and 0 <= score <= 1):
        return f'"pass@1" {score!r} is not a number in [0, 1] or null'
    threshold = record.get("threshold")
    if not (_number(threshold) and 0 < threshold <= 1):
        return f'"threshold" {threshold!r} is not a number in (0, 1]'
    return ""


def _validate_legacy(state: Any, corrupt) -> None:
    """Raises ``corrupt(reason)`` unless ``state`` has the legacy registry's format."""
    if not isinstance(state, dict) or not isinstance(state.get("benchmarks"), dict):
        raise corrupt('expected an object with a "benchmarks" object')
    if state.get("format") != FORMAT:
        raise corrupt(f"format {state.get('format')!r}, expected {FORMAT}")
    for name, entry in state["benchmarks"].items():
        if (
            not isinstance(entry, dict)
            or entry.get("status") not in (ACTIVE, RETIRED)
            or not isinstance(entry.get("history"), list)
            or not all(isinstance(h, dict) and "pass@1" in h for h in entry["history"])
            or not (entry.get("retired") is None or isinstance(entry.get("retired"), dict))
            or (entry["status"] == RETIRED) != isinstance(entry.get("retired"), dict)
        ):
            raise corrupt(f"benchmark {name!r} is malformed")


def _record_name() -> str:
    """A record name no other writer picks: the write time in nanoseconds (strictly
    increasing within the process), the host, the process id and 48 random bits."""
    with _clock_lock:
        stamp = max(time.time_ns(), _last_ns[0] + 1)
        _last_ns[0] = stamp
    host = _HOST.sub("-", socket.gethostname()).strip("-")[:40] or "host"
    return f"{stamp:020d}-{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}.json"


def _publish(path: epath.Path, text: str) -> None:
    """Writes a record so that no reader sees part of it (choice 3)."""
    if not is_remote(path):
        write_text_atomic(path, text)  # a temporary ``.name...`` file renamed into place
        return
    # GCS uploads are whole objects already; a store reached through fsspec need not
    # be (a mounted or emulated one writes as it goes), so write a dot-name, which
    # readers skip, and rename it (a server-side copy on GCS).
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f".{path.name}.partial"
    partial.write_text(text, encoding="utf-8")
    partial.rename(path)


def _forget_listing(directory: epath.Path) -> None:
    """Drops fsspec's cached listing of ``directory``: another process may have added
    records since this one last listed it (gcsfs caches listings per process)."""
    from etils.epath import backend

    backend.fsspec_backend.fs(os.fspath(directory)).invalidate_cache(os.fspath(directory))


def _date(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="seconds")
