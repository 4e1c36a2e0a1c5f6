"""The command line: ``python -m cursor_rl.main --config=configs/NAME.py[:ARG] --workdir=DIR``.

``cursor_rl/main.py`` sets the process up, then calls ``run``. Intentionally short: it
parses flags and calls one function per stage family. ``--workdir`` may be relative,
absolute, start with ``~`` or be a ``gs://`` URL; it is resolved once here, created and
checked writable before anything else runs (an unusable one is an error naming the
path and the reason; see ``cursor_rl.workdir``). Multi-host: set ``--multihost``
(or CURSOR_RL_MULTIHOST=1) to call ``jax.distributed.initialize`` first (TPU pods
discover their peers; elsewhere pass ``--coordinator_address``, ``--num_processes``
and ``--process_id``).
"""

import logging
import os
import sys

import jax
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from cursor_rl import pipeline, stages
from cursor_rl.ops import heartbeat
from cursor_rl.train.loop import Preempted
from cursor_rl.workdir import Workdir, WorkdirError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where checkpoints, metrics and logs go: a directory or gs:// URL."
)
_MULTIHOST = flags.DEFINE_bool(
    "multihost", os.environ.get("CURSOR_RL_MULTIHOST", "0") == "1", "Initialise jax.distributed."
)
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    try:
        workdir = Workdir.create(_WORKDIR.value)
    except WorkdirError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if _MULTIHOST.value:
        # Asking for the backend here would initialise it, which initialize() forbids.
        # gloo only affects the CPU client, so it is harmless on TPU and GPU.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=_COORDINATOR.value,
            num_processes=_NUM_PROCESSES.value,
            process_id=_PROCESS_ID.value,
        )
    # Our progress at INFO; libraries (Orbax logs every save and restore) at WARNING.
    logging.getLogger("cursor_rl").setLevel(logging.INFO)
    absl_logging.set_verbosity(absl_logging.WARNING)
    overrides = config_flags.get_override_values(flags.FLAGS["config"])
    config = stages.apply_command_line(_CONFIG.value, overrides)
    try:
        rows = pipeline.run(config, workdir)
    except Preempted as e:
        print(e, flush=True)
        sys.exit(0)
    heartbeat.finish_all()  # done: a silent heartbeat from now on is not a stall
    if jax.process_index() == 0:
        print("\n" + pipeline.summary_table(rows), flush=True)


def run() -> None:
    """Parses the command line (loading the config file) and runs ``main``."""
    app.run(main)
