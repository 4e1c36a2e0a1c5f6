"""Pre-submit check: compile a config's train step for the target topology; refuse if it won't fit.

    JAX_PLATFORMS=cpu TPU_WORKER_HOSTNAMES=localhost .venv-tpu/bin/python -m launch.presubmit \\
        --topology=v5p:4x4x4 --config=configs/small.py [--config.x=y] [--workdir=ignored]

Runs ``cursor_rl.tools.aot_compile.compile_train_step`` on this machine (libtpu, from the
``tpu`` extra, compiles for TPU chips it does not have), prints the per-device memory
breakdown and exits with status 3 when the step exceeds HBM. The launchers
(``xm_launch.py --aot_topology``, ``run_tpu.sh`` with ``TOPOLOGY``) run it in the TPU
virtualenv before they submit anything and stop on any non-zero status. It accepts and
ignores ``--workdir`` so a launcher can pass the job's own flags through unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from absl import app, flags

# Exit status for "compiled, and it does not fit" (1 is any other failure, e.g. a bad config).
DOES_NOT_FIT = 3


class DoesNotFit(RuntimeError):
    """The compiled train step needs more memory per device than the chip has."""


def check(config, topology: str, compile_fn: Callable[..., Any] | None = None):
    """Compiles ``config`` for ``topology``, prints the breakdown, raises if it won't fit.

    Args:
      config: an experiment ConfigDict (overrides applied).
      topology: e.g. ``v5p:4x4x4``; ``cpu`` compiles for the local devices.
      compile_fn: ``(config, topology) -> report`` with ``.fits`` and ``.text()``;
        default ``cursor_rl.tools.aot_compile.compile_train_step``.

    Returns:
      The report, when the step fits.

    Raises:
      DoesNotFit: with the breakdown in its message.
    """
    if compile_fn is None:
        from cursor_rl.tools.aot_compile import compile_train_step as compile_fn
    report = compile_fn(config, topology)
    print(report.text(), flush=True)
    if not report.fits:
        raise DoesNotFit(
            f"the train step does not fit in HBM on {topology}; not submitting.\n{report.text()}"
        )
    return report


def _main(argv):
    del argv
    try:
        check(flags.FLAGS.config, flags.FLAGS.topology)
    except DoesNotFit as e:
        print(f"presubmit: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        sys.exit(DOES_NOT_FIT)


if __name__ == "__main__":
    # The AOT tool's flags: --config (with --config.x=y overrides), --topology, --stage.
    from cursor_rl.tools import aot_compile

    aot_compile.define_flags()

    flags.DEFINE_string("workdir", None, "Ignored (accepted so job flags pass through).")
    flags.mark_flags_as_required(["config", "topology"])
    app.run(_main)
