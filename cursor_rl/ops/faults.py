"""Fault injection, for proving that the watchdog recovers a run (tests and drills).

    CURSOR_RL_INJECT_NAN=rl:3 python -m cursor_rl.main ...   # RL step 3's update sees NaN

The named step's update is fed NaN advantages once per workdir (a marker under
``WORKDIR/ops/faults/`` remembers it was done), so the loss and gradients really are
NaN, the train step's guard skips the update and reports it, and a run restarted
from an earlier checkpoint replays the step cleanly — what a transient numerical
fault looks like. Unset (the default), nothing here runs.
"""

from __future__ import annotations

import os

from cursor_rl.workdir import Workdir, write_text_atomic

NAN_ENV = "CURSOR_RL_INJECT_NAN"


def inject_nan(workdir: Workdir | str, stage: str, step: int) -> bool:
    """Whether ``$CURSOR_RL_INJECT_NAN`` asks for NaN at (``stage``, ``step``) and this
    workdir has not had it yet (records that it has)."""
    wanted = os.environ.get(NAN_ENV, "")
    if wanted != f"{stage}:{int(step)}":
        return False
    marker = Workdir.of(workdir).ops_dir / "faults" / f"nan-{stage}-{int(step)}"
    if marker.exists():
        return False
    write_text_atomic(marker, "injected\n")
    return True
