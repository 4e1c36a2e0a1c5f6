"""The saturation registry: each benchmark's results over time, and which are retired.

    registry = Registry(Workdir(workdir).registry_file)  # WORKDIR/eval/registry.json
    if registry.is_active("tiny_bench"):
        summary = runner.evaluate(...)
        registry.record(summary)                          # True when this eval retired it

Choices:

1. **Retire at saturation.** A benchmark whose pass@1 reaches the threshold
   (``>=``, default 0.9, the Composer 2 rule) is retired: it no longer separates
   good policies from better ones, so the RL loop stops spending rollouts on it
   (``is_active``). Retirement is permanent for the file; later records of a
   retired benchmark are still kept in its history but change nothing.
2. **The file is the state.** Every call reads the JSON file afresh, so a
   restarted process (or the report) sees exactly what was recorded; a benchmark
   never recorded is active. One process records (the one running evals): there is
   no lock between concurrent writers.
3. **Atomic writes** (``cursor_rl.workdir.write_text_atomic``): a local file is
   replaced through a temporary file in the same directory and a rename (a crash
   leaves the old or the new registry, never half of one); an object store
   (``gs://``) replaces objects whole.
4. **A corrupt file is an error, not a reset**: ``RegistryError`` names the file
   and what is wrong, and nothing overwrites it, since it is a run's history.

Format (``"format": 1``)::

    {"format": 1, "benchmarks": {NAME: {
        "status": "active" | "retired",
        "retired": null | {"stage", "step", "date", "time", "pass@1", "threshold"},
        "history": [{"stage", "step", "date", "time", "pass@1", "k", "pass@k",
                     "best_of_k", "tasks", "episodes"}, ...]}}}
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import time
from typing import Any

from etils import epath

from cursor_rl.workdir import write_text_atomic

DEFAULT_THRESHOLD = 0.9
FORMAT = 1
ACTIVE, RETIRED = "active", "retired"


class RegistryError(ValueError):
    """The registry file is not a valid saturation registry."""


class Registry:
    """Benchmarks' eval history and saturation status, kept in one JSON file.

    Args:
      path: the registry file (created on the first record).
      threshold: the pass@1 at which a benchmark is retired.
    """

    def __init__(self, path: str | os.PathLike, *, threshold: float = DEFAULT_THRESHOLD):
        if not 0 < threshold <= 1:
            raise ValueError(f"saturation threshold {threshold} must be in (0, 1]")
        self.path = epath.Path(path)
        self.threshold = threshold

    def benchmarks(self) -> dict[str, dict[str, Any]]:
        """Every recorded benchmark's entry (a copy; see the module docstring's format)."""
        return copy.deepcopy(self._load()["benchmarks"])

    def is_active(self, name: str) -> bool:
        """Whether ``name`` should still be evaluated (never recorded counts as active)."""
        entry = self._load()["benchmarks"].get(name)
        return entry is None or entry["status"] == ACTIVE

    def active(self) -> list[str]:
        return sorted(n for n, e in self._load()["benchmarks"].items() if e["status"] == ACTIVE)

    def retired(self) -> list[str]:
        return sorted(n for n, e in self._load()["benchmarks"].items() if e["status"] == RETIRED)

    def record(self, summary: dict[str, Any], *, now: float | None = None) -> bool:
        """Adds one eval to its benchmark's history; retires the benchmark if saturated.

        Args:
          summary: what ``cursor_rl.eval.runner.evaluate`` returned (``bench``,
            ``stage``, ``step``, ``k_values`` and ``overall`` are read).
          now: the eval's time (seconds since the epoch; default: now).

        Returns:
          True if this eval retired the benchmark.
        """
        now = time.time() if now is None else now
        overall = summary["overall"]
        ks = summary.get("k_values") or []
        k = ks[-1] if ks else None
        entry = {
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
        }
        state = self._load()
        bench = state["benchmarks"].setdefault(
            summary["bench"], {"status": ACTIVE, "retired": None, "history": []}
        )
        bench["history"].append(entry)
        newly_retired = (
            bench["status"] == ACTIVE
            and entry["pass@1"] is not None
            and entry["pass@1"] >= self.threshold
        )
        if newly_retired:
            bench["status"] = RETIRED
            bench["retired"] = {
                key: entry[key] for key in ("stage", "step", "date", "time", "pass@1")
            } | {"threshold": self.threshold}
        self._save(state)
        return newly_retired

    def markdown(self) -> str:
        """A Markdown table of every benchmark: status, evals, last and best pass@1."""
        benchmarks = self._load()["benchmarks"]
        if not benchmarks:
            return f"No benchmark recorded (saturation threshold {self.threshold:.0%})."
        lines = [
            f"Saturation threshold: pass@1 ≥ {self.threshold:.0%}.",
            "",
            "| benchmark | status | evals | last pass@1 | best pass@1 | retired at |",
            "|---|---|---:|---:|---:|---|",
        ]
        for name, entry in sorted(benchmarks.items()):
            history = entry["history"]
            scores = [h["pass@1"] for h in history if h["pass@1"] is not None]
            last = f"{scores[-1]:.3f}" if scores else "-"
            best = f"{max(scores):.3f}" if scores else "-"
            retired = entry["retired"]
            where = (
                f"{retired['stage']} step {retired['step']} ({retired['date']})" if retired else "-"
            )
            lines.append(
                f"| {name} | {entry['status']} | {len(history)} | {last} | {best} | {where} |"
            )
        return "\n".join(lines)

    def _load(self) -> dict[str, Any]:
        if not self.path.exists():
            return {"format": FORMAT, "benchmarks": {}}
        text = self.path.read_text(encoding="utf-8")
        try:
            state = json.loads(text)
        except json.JSONDecodeError as err:
            raise self._corrupt(f"not JSON ({err})") from err
        _validate(state, self._corrupt)
        return state

    def _corrupt(self, reason: str) -> RegistryError:
        return RegistryError(
            f"eval registry {os.fspath(self.path)} is corrupt: {reason}. It holds the run's "
            "eval history, so it is not overwritten: repair it or move it away."
        )

    def _save(self, state: dict[str, Any]) -> None:
        write_text_atomic(self.path, json.dumps(state, indent=2, sort_keys=True) + "\n")


def _validate(state: Any, corrupt) -> None:
    """Raises ``corrupt(reason)`` unless ``state`` has the registry's format."""
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


def _date(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="seconds")
