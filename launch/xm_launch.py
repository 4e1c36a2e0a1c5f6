r"""XManager launcher: one experiment per config file, one work unit per point of its sweep.

    bash launch/setup_xm_venv.sh     # once: .venv-xm with the xm extra
    .venv-xm/bin/python launch/xm_launch.py --config=configs/tiny.py:stage=pretrain \
        --workdir=/tmp/sweep [--config.train.num_steps=50] [--executor=local|vertex] [--dry_run]

Each work unit runs ``python -m cursor_rl.main --config=... --workdir=ROOT/wuN_...``
with the command-line ``--config.x=y`` overrides plus its sweep point's (the config
file's ``get_sweep()``; see ``launch/sweep.py``).

Executors:

* ``local``: ``xm_local.Local`` runs each work unit as a process of a local binary
  (this interpreter, or ``--python``); no Docker. XManager keeps its experiment
  records in ``~/.xmanager/experiments.sqlite3`` unless ``--xm_db_yaml_config_path``
  names another database.
* ``vertex``: ``xm_local.Vertex`` runs each work unit as a Vertex AI custom job in
  ``--image`` (a container with this repository at its working directory and
  cursor_rl installed) on the machine ``--accelerator``/``--accelerator_count``/
  ``--cpu``/``--ram_gib`` ask for. Needs gcloud credentials. ``--dry_run`` builds the
  job spec XManager would submit (worker pools, machine spec, container args) and
  prints it as JSON, submitting nothing. TPU pods (v4 and later) run on TPU VMs
  instead: ``launch/run_tpu.sh``, XManager's Vertex backend maps only TPU v2/v3.

``--rl_group`` launches the config's RL stage instead, as one experiment whose job group
is the trainer, ``--rl_num_samplers`` samplers, the episode fleet (Ray head and
workers), the evaluator and the task builder on one workdir, the accelerators split
between them by ``--rl_split`` (``launch/rl_group.py``). Locally the group is one work
unit, a process per job; on Vertex each job is its own custom job (Vertex allows a
custom job 4 worker pools). ``--dry_run`` prints every job as JSON.

``--aot_topology=v5p:4x4x4`` first compiles every sweep point's train step for that
TPU topology on this machine (``launch/presubmit.py`` in ``--aot_python``, which needs
libtpu) and refuses to launch if one does not fit in HBM.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from typing import Any

from absl import app, flags
from ml_collections import config_flags
from xmanager import xm, xm_local  # at the top: defines XManager's --xm_* flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make `launch` and `cursor_rl` importable
    sys.path.insert(0, ROOT)

from launch import presubmit, rl_group, sweep  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file[:ARG].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Root; each work unit writes ROOT/<its name>.")
_EXECUTOR = flags.DEFINE_enum("executor", "local", ["local", "vertex"], "Where to run.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print what would be launched; launch nothing.")
_TITLE = flags.DEFINE_string("title", None, "Experiment title (default: config name).")
_PYTHON = flags.DEFINE_string("python", sys.executable, "local: interpreter of the work units.")
_IMAGE = flags.DEFINE_string(
    "image", "gcr.io/PROJECT/cursor-rl:latest", "vertex: container image with cursor_rl."
)
_ACCELERATOR = flags.DEFINE_string(
    "accelerator", None, "vertex: accelerator type, e.g. h100, a100, l4_24th, tpu_v3."
)
_ACCELERATOR_COUNT = flags.DEFINE_integer("accelerator_count", 1, "vertex: accelerators/job.")
_CPU = flags.DEFINE_integer("cpu", None, "vertex: vCPUs per job.")
_RAM_GIB = flags.DEFINE_integer("ram_gib", None, "vertex: memory per job, GiB.")
_PROJECT = flags.DEFINE_string("project", None, "vertex: GCP project (default: gcloud's).")
_REGION = flags.DEFINE_string("region", "us-central1", "vertex: region.")
_AOT_TOPOLOGY = flags.DEFINE_string(
    "aot_topology", None, "Compile each point for this TPU topology first; refuse if too big."
)
_AOT_PYTHON = flags.DEFINE_string(
    "aot_python",
    os.path.join(ROOT, ".venv-tpu", "bin", "python"),
    "Interpreter with the tpu extra (libtpu) for --aot_topology.",
)
_RL_GROUP = flags.DEFINE_bool(
    "rl_group", False, "Launch the config's RL stage as one job group (launch/rl_group.py)."
)
_RL_SAMPLERS = flags.DEFINE_integer("rl_num_samplers", 2, "rl_group: sampler jobs.")
_RL_ACCELERATORS = flags.DEFINE_integer(
    "rl_accelerators", 16, "rl_group: accelerators of the whole group, divided by --rl_split."
)
_RL_SPLIT = flags.DEFINE_string(
    "rl_split", rl_group.DEFAULT_SPLIT, "rl_group: fractions of --rl_accelerators per share."
)
_RL_FLEET = flags.DEFINE_enum(
    "rl_fleet", "ray", list(rl_group.FLEETS), "rl_group: where episodes' tool calls run."
)
_RL_FLEET_WORKERS = flags.DEFINE_integer("rl_fleet_workers", 2, "rl_group: Ray worker jobs.")
_RL_CPUS = flags.DEFINE_integer(
    "rl_cpus", 16, "rl_group: vCPUs of each CPU-only job (fleet, evaluator, task builder)."
)
_RL_RAY_ADDRESS = flags.DEFINE_string(
    "rl_ray_address", "", "rl_group: an existing Ray head host:port (no head job then)."
)
_RL_RAY_PORT = flags.DEFINE_integer("rl_ray_port", 6379, "rl_group: the head job's port.")
flags.mark_flags_as_required(["config", "workdir"])


# ---- pre-submit check ------------------------------------------------------------


def check_fits(config_arg: str, flags_of_point: list[str], topology: str, python: str) -> None:
    """Compiles one work unit's train step for ``topology``; exits the launcher if it won't fit.

    Args:
      config_arg: ``configs/NAME.py[:ARG]``.
      flags_of_point: the work unit's ``--config.x=y`` overrides (``--workdir`` is ignored).
      topology: TPU topology (``v5p:4x4x4``) or ``cpu``.
      python: an interpreter whose environment has libtpu (the ``tpu`` extra).
    """
    cmd = [python, "-m", "launch.presubmit", f"--topology={topology}", *flags_of_point]
    env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_WORKER_HOSTNAMES="localhost")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    print(f"[presubmit] {config_arg} {' '.join(flags_of_point[2:])} on {topology}", flush=True)
    result = subprocess.run(cmd, cwd=ROOT, env=env, check=False)
    if result.returncode == presubmit.DOES_NOT_FIT:
        sys.exit(f"refusing to launch: the train step does not fit on {topology} (see above)")
    if result.returncode != 0:
        sys.exit(f"refusing to launch: the pre-submit compile failed ({result.returncode})")


# ---- executors -------------------------------------------------------------------

# The GPUs Vertex attaches to n1 machines; every other GPU needs its own machine family.
_N1_GPUS = frozenset(
    {"NVIDIA_TESLA_T4", "NVIDIA_TESLA_V100", "NVIDIA_TESLA_P100", "NVIDIA_TESLA_P4"}
)


def _requirements(accelerators: int | None = None, cpu: int | None = None):
    """The flags' machine; ``accelerators`` and ``cpu`` (an RL group's job) replace
    ``--accelerator_count`` and ``--cpu`` (0 accelerators: a CPU-only job)."""
    count = _ACCELERATOR_COUNT.value if accelerators is None else accelerators
    cpu = _CPU.value if cpu is None else cpu
    resources: dict[str, Any] = {}
    if _ACCELERATOR.value and count:
        resources[_ACCELERATOR.value] = count
    if cpu:
        resources["cpu"] = cpu
    if _RAM_GIB.value:
        resources["ram"] = _RAM_GIB.value * xm.GiB
    return xm.JobRequirements(**resources)


def vertex_job_spec(
    title: str,
    name: str,
    main_args: list[str],
    *,
    args: list[str] | None = None,
    requirements: xm.JobRequirements | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The Vertex custom job XManager would create for one work unit, as plain data.

    Built with XManager's own machine-spec mapping and argument escaping (what
    ``xmanager.cloud.vertex.Client.launch`` does before it submits). ``args`` (a
    whole command) replaces ``python -m cursor_rl.main MAIN_ARGS``.
    """
    from google.cloud import aiplatform_v1 as aip_v1
    from xmanager.cloud import vertex
    from xmanager.xm import utils
    from xmanager.xm_local import executables

    executable = executables.GoogleContainerRegistryImage(name="cursor_rl", image_path=_IMAGE.value)
    job = xm.Job(
        executable=executable,
        executor=xm_local.Vertex(requirements=requirements or _requirements()),
        args=args if args is not None else ["python", "-m", "cursor_rl.main", *main_args],
        env_vars=env or {},
    )
    machine = vertex.get_machine_spec(job)
    if "accelerator_type" in machine:
        accelerator = aip_v1.AcceleratorType(machine["accelerator_type"]).name
        machine["accelerator_type"] = accelerator
        # XManager falls back to an n1 machine for GPUs it has no table for (H100, H200,
        # B200), which Vertex rejects: say so here rather than after a submission.
        if machine["machine_type"].startswith("n1-") and accelerator not in _N1_GPUS:
            raise app.UsageError(
                f"XManager has no Vertex machine type for {accelerator}; use a100 or l4 "
                "here, or launch/run_gpu.sh on your own GPU VMs"
            )
    return {
        "display_name": f"{title}_{name}",
        "project": _PROJECT.value or "<gcloud default>",
        "location": _REGION.value,
        "worker_pool_specs": [
            {
                "machine_spec": machine,
                "replica_count": job.executor.requirements.replicas,
                "container_spec": {
                    "image_uri": executable.image_path,
                    "args": xm.merge_args(executable.args, job.args).to_list(utils.ARGV_ESCAPER),
                    "env": [{"name": k, "value": v} for k, v in job.env_vars.items()],
                },
            }
        ],
    }


def launch_local(title: str, units: list[tuple[str, list[str]]]) -> None:
    """Runs every work unit on this machine and waits for them (raises if one fails)."""
    with xm_local.create_experiment(experiment_title=title) as experiment:
        [executable] = experiment.package(
            [
                xm.binary(
                    executor_spec=xm_local.Local.Spec(),
                    path=_PYTHON.value,
                    args=["-m", "cursor_rl.main"],
                    # Config files import the project (and tests' helpers) from the root.
                    env_vars={"PYTHONPATH": ROOT},
                )
            ]
        )
        for _, main_args in units:
            experiment.add(xm.Job(executable=executable, executor=xm_local.Local(), args=main_args))
        print(f"experiment {experiment.experiment_id}: {len(units)} work units", flush=True)


def launch_vertex(title: str, units: list[tuple[str, list[str]]]) -> None:
    """Submits every work unit as a Vertex AI custom job (needs gcloud credentials)."""
    from xmanager.cloud import vertex

    vertex.set_default_client(vertex.Client(project=_PROJECT.value, location=_REGION.value))
    with xm_local.create_experiment(experiment_title=title) as experiment:
        [executable] = experiment.package(
            [
                xm.container(
                    executor_spec=xm_local.Vertex.Spec(),
                    image_path=_IMAGE.value,
                    args=["python", "-m", "cursor_rl.main"],
                )
            ]
        )
        executor = xm_local.Vertex(requirements=_requirements())
        for _, main_args in units:
            experiment.add(xm.Job(executable=executable, executor=executor, args=main_args))
        print(f"experiment {experiment.experiment_id}: {len(units)} Vertex jobs", flush=True)


# ---- the RL job group ------------------------------------------------------------


def rl_group_jobs(config_arg: str, workdir: str, base: dict[str, Any]) -> list[rl_group.Job]:
    """The group's jobs from the flags; refuses what the config or the executor cannot run."""
    config = _CONFIG.value
    spec = rl_group.GroupSpec(
        config_arg=config_arg,
        workdir=workdir,
        overrides=base,
        num_samplers=_RL_SAMPLERS.value,
        accelerators=_RL_ACCELERATORS.value,
        split=_RL_SPLIT.value,
        fleet=_RL_FLEET.value,
        fleet_workers=_RL_FLEET_WORKERS.value,
        cpus=_RL_CPUS.value,
        ray_address=_RL_RAY_ADDRESS.value,
        ray_port=_RL_RAY_PORT.value,
        python=_PYTHON.value if _EXECUTOR.value == "local" else "python",
    )
    if _EXECUTOR.value == "vertex" and spec.fleet == "ray" and not spec.ray_address:
        raise app.UsageError(
            "--rl_fleet=ray on Vertex needs --rl_ray_address: each job is its own custom "
            "job there, with no address known before it starts (or use --rl_fleet=local)"
        )
    try:
        jobs, _ = rl_group.plan(spec)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    missing = rl_group.missing_fields(config, jobs)
    if missing:  # this config (or checkout) cannot run the group's command lines
        raise app.UsageError(f"the config has no {', '.join(missing)} (set by the RL group)")
    staleness = int(config.rl.max_staleness)
    if staleness < spec.num_samplers - 1:
        print(
            f"warning: rl.max_staleness={staleness} lets only {staleness + 1} of the "
            f"{spec.num_samplers} samplers sample at once (cursor_rl/rl/loop.py)",
            file=sys.stderr,
            flush=True,
        )
    return jobs


def launch_group_local(title: str, jobs: list[rl_group.Job]) -> None:
    """Runs the group on this machine, one process per job, and waits for all of them."""
    with xm_local.create_experiment(experiment_title=title) as experiment:
        [shell] = experiment.package(
            [
                xm.binary(
                    executor_spec=xm_local.Local.Spec(),
                    path="/bin/sh",
                    args=[],
                    env_vars={"PYTHONPATH": ROOT},
                )
            ]
        )
        group = {
            job.name: xm.Job(
                executable=shell,
                executor=xm_local.Local(),
                args=["-c", shlex.join(job.argv)],
                env_vars=dict(job.env),
            )
            for job in jobs
        }
        experiment.add(xm.JobGroup(**group))
        print(f"experiment {experiment.experiment_id}: a group of {len(jobs)} jobs", flush=True)


def launch_group_vertex(title: str, jobs: list[rl_group.Job]) -> None:
    """Submits each job of the group as its own Vertex custom job (one work unit each).

    XManager submits a whole ``xm.JobGroup`` as one custom job with a worker pool per
    job, and Vertex allows 4 pools; the jobs share nothing but the workdir (and the Ray
    head's address), so separate custom jobs run them just as well.
    """
    from xmanager.cloud import vertex

    vertex.set_default_client(vertex.Client(project=_PROJECT.value, location=_REGION.value))
    with xm_local.create_experiment(experiment_title=title) as experiment:
        [image] = experiment.package(
            [xm.container(executor_spec=xm_local.Vertex.Spec(), image_path=_IMAGE.value)]
        )
        for job in jobs:
            requirements = _requirements(job.accelerators, job.cpu)
            xm_job = xm.Job(
                executable=image,
                executor=xm_local.Vertex(requirements=requirements),
                args=job.argv,
                env_vars=dict(job.env),
                name=job.name,
            )
            experiment.add(xm.JobGroup(**{job.name: xm_job}))
        print(f"experiment {experiment.experiment_id}: {len(jobs)} Vertex jobs", flush=True)


def run_rl_group(config_arg: str, workdir: str, base: dict[str, Any], title: str) -> None:
    jobs = rl_group_jobs(config_arg, workdir, base)
    if _EXECUTOR.value == "vertex":
        specs = []
        for job in jobs:
            requirements = _requirements(job.accelerators, job.cpu)
            spec = vertex_job_spec(
                title, job.name, [], args=job.argv, requirements=requirements, env=dict(job.env)
            )
            specs.append({"job": job.to_json(), "vertex": spec})
        if _DRY_RUN.value:
            print(json.dumps(specs, indent=2))
        else:
            launch_group_vertex(title, jobs)
    elif _DRY_RUN.value:
        print(json.dumps([{"job": job.to_json()} for job in jobs], indent=2))
    else:
        launch_group_local(title, jobs)


# ---- main ------------------------------------------------------------------------


def _absolute(config_arg: str, workdir: str) -> tuple[str, str]:
    """Local work units start elsewhere than here: give them absolute paths."""
    if _EXECUTOR.value != "local":
        return config_arg, workdir
    path, arg = sweep.split_config_arg(config_arg)
    config_arg = os.path.abspath(path) + (f":{arg}" if arg is not None else "")
    return config_arg, workdir if "://" in workdir else os.path.abspath(workdir)


def _title(config_arg: str) -> str:
    return os.path.splitext(os.path.basename(config_arg.split(":")[0]))[0]


def main(argv):
    del argv
    config_arg = config_flags.get_config_filename(flags.FLAGS["config"])
    base = dict(config_flags.get_override_values(flags.FLAGS["config"]))
    if _RL_GROUP.value:  # the config as given: a sweep's points are not applied
        config_arg, workdir = _absolute(config_arg, _WORKDIR.value)
        title = _TITLE.value or _title(config_arg) + "_rl"
        run_rl_group(config_arg, workdir, base, title)
        return
    points = sweep.load_sweep(config_arg)
    for point in points:
        sweep.check_overrides(_CONFIG.value, point)
    config_arg, workdir = _absolute(config_arg, _WORKDIR.value)
    units = sweep.work_units(config_arg, workdir, base, points)
    title = _TITLE.value or _title(config_arg)

    if _AOT_TOPOLOGY.value:
        for _, main_args in units:
            check_fits(config_arg, main_args, _AOT_TOPOLOGY.value, _AOT_PYTHON.value)

    if _EXECUTOR.value == "vertex":
        # Built before any submission too: it refuses machines XManager cannot map.
        specs = [vertex_job_spec(title, name, main_args) for name, main_args in units]
        if _DRY_RUN.value:
            print(json.dumps(specs, indent=2))
        else:
            launch_vertex(title, units)
    elif _DRY_RUN.value:
        for name, main_args in units:
            print(f"{name}: {shlex.join([_PYTHON.value, '-m', 'cursor_rl.main', *main_args])}")
    else:
        launch_local(title, units)


if __name__ == "__main__":
    app.run(main)
