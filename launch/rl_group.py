"""An RL experiment as one job group: what each job runs and how much compute it gets.

``launch/xm_launch.py --rl_group`` turns the plan made here into an XManager
``xm.JobGroup``; nothing here imports XManager, so the plan is plain data that the
dry run prints and the tests read. The jobs, all on one workdir (local or ``gs://``):

* ``task_builder``: builds the run's task datasets (``rl.tasks``) into
  ``WORKDIR/tasks/{train,bench}`` with the task factory, as the RL stage would
  (``python -m launch.rl_tasks``); the trainer and samplers wait for them first, so no
  two jobs build the same dataset at once.
* ``trainer``: ``cursor_rl.main`` with ``rl.role=trainer`` (GRPO steps, publishes
  policies).
* ``sampler_0`` .. ``sampler_{N-1}``: ``rl.role=sampler`` with ``rl.sampler_id=i`` and
  ``rl.num_samplers=N`` (``cursor_rl/rl/loop.py``: sampler i writes rollout batches
  i, i+N, ...; sampler 0, the lead, also runs the held-out evals).
* the episode fleet, CPU only: with ``fleet=ray`` a Ray head (``fleet_head``, unless
  ``ray_address`` names a running one) and worker jobs (``fleet_worker_K``) that the
  samplers' tool calls run on (``rl.tool_backend=ray``, ``rl.ray.address``); each
  starts its Ray node, waits until every sampler has finished, and stops it. With
  ``fleet=local`` there are no fleet jobs: each sampler runs its own local tool pool
  (``rl.tool_workers`` processes on its own CPUs).
* ``evaluator``: waits until the trainer has written ``rl/DONE`` and the lead sampler
  has finished its last held-out eval, then writes the run's report
  (``python -m cursor_rl.eval.report``), CPU only.

The compute split: ``total`` accelerators are divided between training, rollouts,
evals and data generation by fractions (``DEFAULT_SPLIT``; largest remainders, so the
parts add up to ``total``). Training's part is the trainer's; rollouts' part is shared
evenly by the samplers (the lowest ids take any remainder); evals' part goes to
sampler 0 on top of its rollout part, since it runs the held-out evals; data
generation's part to the task builder (0 by default: building from ``tiny``,
``stdlib`` or a repository with the heuristic installer needs CPUs only).
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from launch import sweep

SHARES = ("train", "rollouts", "evals", "data")
DEFAULT_SPLIT = "train=0.5,rollouts=0.375,evals=0.125,data=0"
FLEETS = ("ray", "local")  # rl.tool_backend
ROLES = ("trainer", "sampler", "fleet", "evaluator", "task_builder")

RAY_STOP = ("ray", "stop")


@dataclasses.dataclass(frozen=True)
class Job:
    """One job of the group.

    ``steps`` are the commands it runs in order, each as an argument list (the last
    one is the job's work; earlier ones wait for what it needs). ``argv`` is the
    whole as one command line.
    """

    name: str
    role: str
    steps: tuple[tuple[str, ...], ...]
    accelerators: int = 0
    cpu: int | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def argv(self) -> list[str]:
        if len(self.steps) == 1:
            return list(self.steps[0])
        *first, last = self.steps
        script = " && ".join([*(shlex.join(s) for s in first), "exec " + shlex.join(last)])
        return ["sh", "-c", script]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role,
            "accelerators": self.accelerators,
            "cpu": self.cpu,
            "env": dict(self.env),
            "steps": [list(s) for s in self.steps],
            "argv": self.argv,
        }


# ---- the compute split ------------------------------------------------------------


def parse_split(text: str) -> dict[str, float]:
    """``train=0.5,rollouts=0.375,evals=0.125,data=0`` -> fractions that add up to 1."""
    split: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in SHARES:
            raise ValueError(f"split item {item!r}: want SHARE=FRACTION, SHARE one of {SHARES}")
        if key in split:
            raise ValueError(f"split names {key!r} twice")
        fraction = float(value)
        if not math.isfinite(fraction) or fraction < 0:
            raise ValueError(f"split {key}={value}: a fraction must be >= 0")
        split[key] = fraction
    if set(split) != set(SHARES):
        raise ValueError(f"split {text!r}: name every share of {SHARES}")
    if not math.isclose(sum(split.values()), 1.0, abs_tol=1e-6):
        raise ValueError(f"split {text!r}: the fractions add up to {sum(split.values())}, not 1")
    return split


def divide(total: int, split: Mapping[str, float]) -> dict[str, int]:
    """Whole accelerators per share, adding up to ``total`` (largest remainders)."""
    if total < 0:
        raise ValueError(f"{total} accelerators")
    exact = {key: total * split[key] for key in SHARES}
    parts = {key: math.floor(value) for key, value in exact.items()}
    by_remainder = sorted(SHARES, key=lambda k: (-(exact[k] - parts[k]), SHARES.index(k)))
    for key in by_remainder[: total - sum(parts.values())]:
        parts[key] += 1
    return parts


def sampler_accelerators(parts: Mapping[str, int], num_samplers: int) -> list[int]:
    """Accelerators per sampler: rollouts' part shared evenly, evals' part on sampler 0."""
    if num_samplers < 1:
        raise ValueError(f"num_samplers={num_samplers}: at least one sampler")
    base, extra = divmod(parts["rollouts"], num_samplers)
    counts = [base + (1 if i < extra else 0) for i in range(num_samplers)]
    counts[0] += parts["evals"]
    return counts


# ---- the jobs ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """What the launcher's flags ask for (see ``launch/xm_launch.py --rl_group``)."""

    config_arg: str
    workdir: str
    overrides: Mapping[str, Any]
    num_samplers: int = 2
    accelerators: int = 16
    split: str = DEFAULT_SPLIT
    fleet: str = "ray"
    fleet_workers: int = 2
    cpus: int = 16
    ray_address: str = ""
    ray_port: int = 6379
    python: str = "python"


def has_field(config: ml_collections.ConfigDict, key: str) -> bool:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            return False
        node = node[part]
    return True


def _main(spec: GroupSpec, *overrides: dict[str, Any]) -> tuple[str, ...]:
    merged: dict[str, Any] = {**spec.overrides, "stage": "rl"}
    for more in overrides:
        merged.update(more)
    return (
        spec.python,
        "-m",
        "cursor_rl.main",
        *sweep.main_flags(spec.config_arg, spec.workdir, merged, {}),
    )


def _tasks_step(spec: GroupSpec, *extra: str) -> tuple[str, ...]:
    flags = sweep.main_flags(spec.config_arg, spec.workdir, {**spec.overrides, "stage": "rl"}, {})
    return (spec.python, "-m", "launch.rl_tasks", *extra, *flags)


def heartbeat_role(sampler_id: int, num_samplers: int) -> str:
    """A sampler's heartbeat name (``CURSOR_RL_ROLE``), as ``cursor_rl.rl.loop`` names it."""
    return f"sampler-{sampler_id}" if num_samplers > 1 else "sampler"


def ray_address(spec: GroupSpec) -> str:
    """The Ray head the samplers and fleet workers connect to."""
    return spec.ray_address or f"127.0.0.1:{spec.ray_port}"


def plan(spec: GroupSpec) -> tuple[list[Job], dict[str, int]]:
    """The group's jobs and the accelerators of each share (they add up to the total)."""
    if spec.fleet not in FLEETS:
        raise ValueError(f"fleet={spec.fleet!r}: one of {FLEETS}")
    if spec.fleet_workers < 0:
        raise ValueError(f"fleet_workers={spec.fleet_workers}")
    parts = divide(spec.accelerators, parse_split(spec.split))
    if parts["train"] < 1:
        raise ValueError(f"the split gives training {parts['train']} of {spec.accelerators}")
    if parts["rollouts"] < spec.num_samplers:
        raise ValueError(
            f"the split gives rollouts {parts['rollouts']} accelerators, fewer than "
            f"{spec.num_samplers} samplers"
        )
    per_sampler = sampler_accelerators(parts, spec.num_samplers)
    wait = _tasks_step(spec, "--wait=tasks")
    fleet: dict[str, Any] = (
        {"rl.tool_backend": "ray", "rl.ray.address": ray_address(spec)}
        if spec.fleet == "ray"
        else {}
    )
    shared = {"rl.num_samplers": spec.num_samplers}  # the trainer logs it too

    jobs = [
        Job(
            "task_builder",
            "task_builder",
            (_tasks_step(spec),),
            accelerators=parts["data"],
            cpu=spec.cpus,
        ),
        Job(
            "trainer",
            "trainer",
            (wait, _main(spec, shared, {"rl.role": "trainer"})),
            accelerators=parts["train"],
            env={"CURSOR_RL_ROLE": "trainer"},
        ),
    ]
    for i, count in enumerate(per_sampler):
        own = {"rl.role": "sampler", "rl.sampler_id": i}
        jobs.append(
            Job(
                f"sampler_{i}",
                "sampler",
                (wait, _main(spec, shared, own, fleet)),
                accelerators=count,
                env={"CURSOR_RL_ROLE": heartbeat_role(i, spec.num_samplers)},
            )
        )
    if spec.fleet == "ray":
        # A fleet job starts its Ray node, serves until the samplers are done, stops it.
        samplers = ",".join(heartbeat_role(i, spec.num_samplers) for i in range(spec.num_samplers))
        serve = (_tasks_step(spec, "--wait=done", f"--finished_roles={samplers}"), RAY_STOP)
        cpus = f"--num-cpus={spec.cpus}"
        if not spec.ray_address:  # else the head is a cluster of the user's own
            head = ("ray", "start", "--head", f"--port={spec.ray_port}", cpus)
            jobs.append(Job("fleet_head", "fleet", (head, *serve), cpu=spec.cpus))
        for k in range(spec.fleet_workers):
            worker = ("ray", "start", f"--address={ray_address(spec)}", cpus)
            jobs.append(Job(f"fleet_worker_{k}", "fleet", (worker, *serve), cpu=spec.cpus))
    report = (spec.python, "-m", "cursor_rl.eval.report", f"--workdir={spec.workdir}")
    lead = heartbeat_role(0, spec.num_samplers)
    jobs.append(
        Job(
            "evaluator",
            "evaluator",
            (_tasks_step(spec, "--wait=done", f"--finished_roles={lead}"), report),
            cpu=spec.cpus,
        )
    )
    return jobs, parts


def config_overrides(job: Job) -> list[dict[str, str]]:
    """The ``--config.x=y`` overrides of each step of ``job`` that loads the config."""
    found = []
    for step in job.steps:
        if any(a.startswith("--config=") for a in step):
            found.append(
                dict(
                    a.removeprefix("--config.").split("=", 1)
                    for a in step
                    if a.startswith("--config.")
                )
            )
    return found


def missing_fields(config: ml_collections.ConfigDict, jobs: Sequence[Job]) -> list[str]:
    """Overridden fields the config does not have (sorted, each once)."""
    keys = {key for job in jobs for step in config_overrides(job) for key in step}
    return sorted(key for key in keys if not has_field(config, key))
