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

from launch import presubmit, sweep  # noqa: E402

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


def _requirements():
    resources: dict[str, Any] = {}
    if _ACCELERATOR.value:
        resources[_ACCELERATOR.value] = _ACCELERATOR_COUNT.value
    if _CPU.value:
        resources["cpu"] = _CPU.value
    if _RAM_GIB.value:
        resources["ram"] = _RAM_GIB.value * xm.GiB
    return xm.JobRequirements(**resources)


def vertex_job_spec(title: str, name: str, main_args: list[str]) -> dict[str, Any]:
    """The Vertex custom job XManager would create for one work unit, as plain data.

    Built with XManager's own machine-spec mapping and argument escaping (what
    ``xmanager.cloud.vertex.Client.launch`` does before it submits).
    """
    from google.cloud import aiplatform_v1 as aip_v1
    from xmanager.cloud import vertex
    from xmanager.xm import utils
    from xmanager.xm_local import executables

    executable = executables.GoogleContainerRegistryImage(name="cursor_rl", image_path=_IMAGE.value)
    job = xm.Job(
        executable=executable,
        executor=xm_local.Vertex(requirements=_requirements()),
        args=["python", "-m", "cursor_rl.main", *main_args],
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


# ---- main ------------------------------------------------------------------------


def main(argv):
    del argv
    config_arg = config_flags.get_config_filename(flags.FLAGS["config"])
    base = dict(config_flags.get_override_values(flags.FLAGS["config"]))
    points = sweep.load_sweep(config_arg)
    for point in points:
        sweep.check_overrides(_CONFIG.value, point)
    if _EXECUTOR.value == "local":
        # Work units start elsewhere than here: give them absolute paths.
        path, arg = sweep.split_config_arg(config_arg)
        config_arg = os.path.abspath(path) + (f":{arg}" if arg is not None else "")
        workdir = _WORKDIR.value if "://" in _WORKDIR.value else os.path.abspath(_WORKDIR.value)
    else:
        workdir = _WORKDIR.value
    units = sweep.work_units(config_arg, workdir, base, points)
    title = _TITLE.value or os.path.splitext(os.path.basename(config_arg.split(":")[0]))[0]

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
