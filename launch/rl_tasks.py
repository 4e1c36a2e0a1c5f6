r"""The RL job group's task builder, and the waits of the jobs that need its output.

    # build the run's task datasets (rl.tasks) into WORKDIR/tasks/{train,bench}
    python -m launch.rl_tasks --config=configs/small.py --workdir=gs://B/run \
        --config.stage=rl [--config.x=y]
    # wait until they are there (the trainer's and samplers' first step)
    python -m launch.rl_tasks --wait=tasks --config=... --workdir=...
    # wait until the trainer wrote rl/DONE and sampler_0 finished (the evaluator's)
    python -m launch.rl_tasks --wait=done --finished_roles=sampler_0 --config=... --workdir=...

The build is the RL stage's own (``cursor_rl.rl.loop.task_datasets``: the task factory
``cursor_rl.tasks.build`` with the config's ``rl.tasks`` counts, seed and generators,
the bench decontaminated against the train split); a ``gs://`` workdir gets a copy,
its ``stats.json`` last. Started alone, every RL role would build the datasets
itself, all at once into one workdir; in the group only this job builds and the
others wait (``launch/rl_group.py``). Datasets named by ``rl.tasks.train`` /
``rl.tasks.bench`` are not built or waited for.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags
from ml_collections import config_flags

from cursor_rl import stages
from cursor_rl.ops import heartbeat
from cursor_rl.tasks import build
from cursor_rl.workdir import Workdir


def define_flags(fv: flags.FlagValues) -> None:
    """This command's flags, on ``fv`` (the tests parse job command lines with them)."""
    config_flags.DEFINE_config_file("config", None, "Experiment config file[:ARG].", flag_values=fv)
    flags.DEFINE_string("workdir", None, "The run's workdir (local or gs://).", flag_values=fv)
    flags.DEFINE_enum(
        "wait",
        "",
        ["", "tasks", "done"],
        "Wait instead of building: for the task datasets, or for the end of the run.",
        flag_values=fv,
    )
    flags.DEFINE_list(
        "finished_roles",
        [],
        "--wait=done: also wait for these roles' heartbeats to say finished.",
        flag_values=fv,
    )
    flags.DEFINE_float("poll_s", 10.0, "Seconds between looks.", flag_values=fv)
    flags.DEFINE_float(
        "timeout_s", 0.0, "Give up (exit 1) after this long; 0: never.", flag_values=fv
    )
    flags.mark_flags_as_required(["config", "workdir"], flag_values=fv)


def rl_config(fv: flags.FlagValues):
    """The RL stage's config from parsed flags (command-line values win, as in main)."""
    overrides = config_flags.get_override_values(fv["config"])
    return stages.stage_config(stages.apply_command_line(fv.config, overrides), "rl")


def datasets_ready(cfg, workdir: Workdir) -> bool:
    """Whether every split the RL stage would build is in the workdir, build finished."""
    for split in ("train", "bench"):
        if not cfg.rl.tasks[split] and not (workdir.tasks_dir(split) / build.STATS_FILE).exists():
            return False
    return True


def run_finished(workdir: Workdir, roles: list[str]) -> bool:
    """Whether the trainer wrote ``rl/DONE`` and every role of ``roles`` finished."""
    if not workdir.rl_done_file.exists():
        return False
    beats = heartbeat.read_heartbeats(workdir)
    return all(beats.get(role, {}).get("finished") for role in roles)


def main(argv):
    del argv
    fv = flags.FLAGS
    cfg = rl_config(fv)
    if not fv.wait:
        from cursor_rl.rl import loop as rl_loop  # the RL stack: only the builder needs it

        workdir = Workdir.create(fv.workdir)
        train_dir, bench_dir = rl_loop.task_datasets(cfg, workdir)
        print(f"[rl_tasks] train {train_dir}, bench {bench_dir}", flush=True)
        return
    workdir = Workdir(fv.workdir)
    if fv.wait == "tasks":
        ready, what = (lambda: datasets_ready(cfg, workdir)), "the task datasets"
    else:
        roles = list(fv.finished_roles)
        ready, what = (lambda: run_finished(workdir, roles)), f"rl/DONE and {roles} finished"
    start = time.time()
    print(f"[rl_tasks] waiting for {what} in {workdir.root}", flush=True)
    while not ready():
        if fv.timeout_s and time.time() - start > fv.timeout_s:
            sys.exit(f"[rl_tasks] gave up waiting for {what} after {fv.timeout_s:.0f}s")
        time.sleep(fv.poll_s)
    print(f"[rl_tasks] {what}: ready after {time.time() - start:.0f}s", flush=True)


if __name__ == "__main__":
    define_flags(flags.FLAGS)
    app.run(main)
