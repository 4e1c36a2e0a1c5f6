"""Derived judges: a small classifier distilled from the policy on rule-graded episodes.

    python -m cursor_rl.outer.judge --workdir=RUN [--workdir=RUN2] --out=DIR \\
        [--policy=RUN/sft/checkpoints] [--labels=category,resolved,outcome]
    judge = load("DIR")                          # a DerivedJudge
    judge(event)                                 # FeedbackEvent -> category | None
    judge.probabilities(episodes, "resolved")    # [N, classes], for detectors and filters
    python -m cursor_rl.outer.run ... --judge=cursor_rl.outer.judge:category_judge=DIR

Composer's outer loop grades at scale with small "derived" judge and reward models
trained from the main model. Here the judge is the policy itself, frozen, read as a
feature extractor, with a linear softmax head per label trained on what rules say
about the recorded episodes of a run. ``DIR`` afterwards holds::

    judge.json          the policy (path, stage, step, model config), the tokenizer,
                        the feature settings, each head's classes and file, the data
    head_<label>.npz    a head: standardisation (mean, std), weight [F, C], bias [C]
    tokenizer.json      the tokenizer the features were computed with
    judge_report.md     held-out accuracy against the rule labels, per label
    judge_report.json   the same, with every count, the split and the bad records

Choices:

1. **Labels come from a rubric applied by rules** to recorded, graded episodes
   (``RUBRIC``): ``category``, the weak-area category the outer loop's rules give
   the episode's trajectory as a negative event without a comment
   (``classify.classify_event``: the textual-feedback detectors, earliest first,
   else the task kind), so a judge trained on it answers the question
   ``classify``'s hook asks; ``resolved``, whether the hidden tests passed (the
   grade); ``outcome``, the grade in four steps (``resolved``; ``broke_tests``: a
   PASS_TO_PASS test broke; ``partial``: some FAIL_TO_PASS tests pass;
   ``no_progress``). Lost episodes (infrastructure failures, no grade) have no
   label and are counted, not used.
2. **Episodes come from a run's workdir**, only read: the held-out evals
   (``eval/<bench>/results.jsonl``, lines with a ``trajectory``: ``rl.eval.
   save_trajectories``) and the RL rollouts (``rl/rollouts/NNNNNN.json``, as
   ``rl.loop.RolloutStore`` writes them). Every episode is read through the feedback
   loader's own checks (``ingest.parse_event``, episode format, with the run's
   tokenizer and ``rl.rollout.max_turns``), so a corrupt line or episode is a bad
   record named by file and line (or episode index), counted and reported, never
   silently dropped; a line without a trajectory is counted as such. Beyond
   ``max_episodes`` a seeded sample is kept (counted).
3. **The policy is a frozen feature extractor.** Each context window (segment) of an
   episode is one row through ``model.hidden_with_aux`` (final normed hidden
   states; padding has segment id 0); an episode's features are the mean over its
   sampled tokens (loss mask 1: what the policy wrote), the mean over all its
   tokens, and the last token's state, concatenated (``3 x hidden_size``). Rows are
   sorted by length and padded to multiples of ``bucket`` in batches of ``batch``,
   so XLA compiles once per bucket; a window longer than ``max_len`` keeps its first
   ``max_len`` tokens (counted). The policy is a trainer checkpoint (a step or
   checkpoints directory, its tokenizer from the metadata or the run), a base
   (``base:tiny`` or an HF directory, ``cursor_rl.bases``), or by default the
   newest checkpoint of the first workdir (``sampler.chat.find_checkpoint``). The
   tokenizer must be the one that wrote the episodes (checked).
4. **Held out by task**: the tasks (all workdirs together) are shuffled with the
   seed and ``held_out`` of them (at least one, never all) hold out every episode of
   theirs, so no task is on both sides and repeated samples of a task cannot leak.
5. **The head is a linear softmax layer** on features standardised with the
   training split's mean and deviation, trained full batch with Adam (optax) for
   ``steps`` steps from zeros, its learning rate decayed to 0 on a cosine (at a
   constant rate Adam's last iterate jitters around the optimum, on 768 weights per
   class enough to spoil the probabilities); a convex problem, so the same data
   gives the same head.
   The L2 weight is picked from ``l2_grid`` by task-grouped ``folds``-fold
   cross-validation inside the training split, on log loss (a proper score: it
   picks calibrated probabilities, which abstention reads, where accuracy ties
   once the classes separate; fold masks are example weights, so every fit is the
   same XLA program). A label whose training split holds a single
   class trains no head (reported).
6. **Measured on the held-out split against the rule labels**: accuracy; the
   majority baseline (always the training split's most common class); the gain
   over it; a control head trained on shuffled training labels (should land near
   the baseline; far above it means leakage); per-class precision, recall and
   support; the confusion matrix; coverage and accuracy when abstaining below
   ``min_confidence``. Intervals are 95% bootstrap intervals resampling held-out
   *tasks* (``eval.metrics``' level, replicates and seed), the gain paired.
7. **The judge abstains** (returns None) when its top probability is below
   ``min_confidence``, when the input lies farther from the training rows' mean
   (mean squared z-score) than ``ood_factor`` times their 99th percentile (an input
   unlike anything it was trained on), or when its class is not a ``classify``
   category; the rules then stand, and ``classify`` counts its errors. An event's
   trajectory is read as it came: an episode's token ids (checked against the
   model's vocabulary), or its messages rendered with the judge's chat format
   (calls as the model writes them), opened by the system turn most common in the
   training episodes when the log has none (the policy always saw one).
8. **A judge directory is small and self-describing**: heads and tokenizer are
   copied, the policy is referenced by path (with its model config, checked on
   load); ``load(DIR, policy=...)`` points a moved judge at its policy.

Exit status of the command: 0 when at least one head was trained and the report
written; 1 when no label could be trained (the report says why); 2 for unusable flags
or inputs (no episode, an unreadable policy, a tokenizer mismatch; a message says
which).

Measured on this project's 2-core CPU while other jobs shared it: see
``docs/outer_loop.md`` ("Derived judges") for the figure and its data.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags
from etils import epath

from cursor_rl import bases, checkpoints, model
from cursor_rl.chat import protocol
from cursor_rl.chat.episodes import Episode
from cursor_rl.chat.protocol import ChatFormat, Message, Trajectory
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.eval import metrics
from cursor_rl.model import hf
from cursor_rl.model.config import ModelConfig
from cursor_rl.outer import classify, ingest, report
from cursor_rl.outer.ingest import FeedbackEvent
from cursor_rl.sampler import weights
from cursor_rl.sampler.chat import find_checkpoint
from cursor_rl.workdir import Workdir, WorkdirError

SCHEMA_VERSION = 1
JUDGE_FILE = "judge.json"
TOKENIZER_FILE = "tokenizer.json"
REPORT_MD = "judge_report.md"
REPORT_JSON = "judge_report.json"
RESULTS_FILE = "results.jsonl"
SOURCES = ("eval", "rollouts")
BASE_PREFIX = "base:"
_ROLLOUT_FILE = re.compile(r"^\d{6}\.json$")
POOLING = ("mean_sampled", "mean_all", "last")
ROW_PAD = 64  # training rows are padded to a multiple of this (one compile per class count)


class JudgeError(ValueError):
    """An input the judge cannot use (exit status 2); the message says which."""


# ---- the rubric (choice 1) ---------------------------------------------------------------


def _resolved(record: RecordedEpisode) -> str:
    return "resolved" if record.grade["resolved"] else "unresolved"


def _outcome(record: RecordedEpisode) -> str:
    grade = record.grade
    if grade["resolved"]:
        return "resolved"
    if grade["pass_to_pass_broken"] > 0:
        return "broke_tests"
    if grade["fail_to_pass_passed"] > 0:
        return "partial"
    return "no_progress"


def _category(record: RecordedEpisode) -> str:
    task = classify.TaskInfo(
        task_id=record.task_id,
        split="",
        category=record.episode.category,
        generator="",
        tree_sha256="",
        difficulty={},
    )
    known = {record.task_id: task} if record.episode.category in classify.CATEGORY_OF_KIND else {}
    classification, errors = classify.classify_event(record.event, known)
    if errors:  # a detector raised: the rule label is not trustworthy
        raise ValueError(f"detector {errors[0][0]} raised {errors[0][1]}")
    return classification.category


RUBRIC: dict[str, tuple[str, Callable[[RecordedEpisode], str]]] = {
    "category": ("the outer loop's rule category of the trajectory (classify)", _category),
    "resolved": ("whether the hidden tests passed", _resolved),
    "outcome": ("resolved / broke_tests / partial / no_progress, from the grade", _outcome),
}


# ---- recorded episodes (choice 2) --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RecordedEpisode:
    """One graded episode of a run, as the rubric and the features read it.

    Attributes:
      source: where it was read: ``FILE:LINE`` (eval results) or ``FILE#INDEX``
        (rollout files).
      kind: ``eval`` or ``rollout``.
      task_id: its task.
      episode: the episode (trajectory, finish reason, task kind).
      grade: ``resolved``, ``fail_to_pass_passed``, ``pass_to_pass_broken``.
      event: the episode as the outer loop's rules read it (a negative feedback
        event without a comment).
      labels: the rubric's labels, by label name.
    """

    source: str
    kind: str
    task_id: str
    episode: Episode
    grade: Mapping[str, Any]
    event: FeedbackEvent
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Dataset:
    """What the workdirs held.

    Attributes:
      records: the labelled episodes, in reading order.
      bad: ``"SOURCE: problem"`` for every line, file or episode that did not read.
      skipped: counts of episodes not used and why (``lost``, ``no_trajectory``,
        ``sampled_out``).
      files: episodes read per file.
    """

    records: list[RecordedEpisode]
    bad: list[str] = dataclasses.field(default_factory=list)
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    files: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def tasks(self) -> list[str]:
        return sorted({r.task_id for r in self.records})


def _grade(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    grade = {}
    for key, kind in (
        ("resolved", bool),
        ("fail_to_pass_passed", int),
        ("pass_to_pass_broken", int),
    ):
        value = values.get(key, False if kind is bool else 0)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"field {key!r} of {where} must be {kind.__name__}, got {value!r}")
        grade[key] = value
    return grade


def _event(episode: Episode, source: str, chat: ChatFormat, max_turns: int | None) -> FeedbackEvent:
    row = {
        "schema_version": ingest.SCHEMA_VERSION,
        "event_id": source[-ingest.MAX_EVENT_ID_CHARS :],
        "rating": "down",
        "snapshot": {"task_id": episode.task_id or "unknown"},
        "trajectory": {"format": "episode", "episode": episode.to_json()},
    }
    if max_turns:
        row["trajectory"]["max_turns"] = max_turns
    return ingest.parse_event(row, chat=chat)


def _eval_episodes(path: str) -> Iterable[tuple[str, Any]]:
    """``(source, episode JSON | problem)`` per non-blank line of a results file."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                yield where, f"not a JSON line ({type(e).__name__}: {e})"
                continue
            if not isinstance(row, dict):
                yield where, "not a JSON object"
                continue
            yield where, row


def _episode_of_eval_row(row: Mapping[str, Any], where: str) -> tuple[Episode, dict[str, Any]]:
    for key, kind in (("task_id", str), ("finish_reason", str), ("trajectory", dict)):
        if not isinstance(row.get(key), kind):
            raise ValueError(f"field {key!r} missing or not a {kind.__name__}")
    grade = _grade(row, "the line")
    episode = Episode(
        task_id=row["task_id"],
        category=str(row.get("category", "")),
        task_index=int(row.get("task_index", 0)),
        sample=int(row.get("sample", 0)),
        trajectory=Trajectory.from_json_dict(row["trajectory"]),
        finish_reason=row["finish_reason"],
        tool_calls=int(row.get("tool_calls", 0)),
        generated_tokens=int(row.get("generated_tokens", 0)),
        grade=dict(grade),
    )
    return episode, grade


def _run_settings(workdir: Workdir) -> dict[str, Any]:
    """The run's ``config.json`` (empty when missing or unreadable)."""
    try:
        config = json.loads(workdir.config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def read_workdirs(
    workdirs: Sequence[str],
    chat: ChatFormat,
    *,
    sources: Sequence[str] = SOURCES,
    labels: Sequence[str] = tuple(RUBRIC),
    max_turns: int = 0,
    max_episodes: int = 0,
    seed: int = 0,
    log: Callable[[str], None] = lambda _: None,
) -> Dataset:
    """Reads and labels the recorded episodes of runs (choices 1 and 2).

    Args:
      workdirs: run workdirs, only read.
      chat: the chat format of the tokenizer that wrote the episodes.
      sources: ``eval`` (held-out eval results) and/or ``rollouts`` (RL rollouts).
      labels: rubric labels to compute (``RUBRIC``).
      max_turns: the harness's turn limit (for the ``gave_up_early`` detector); 0
        reads ``rl.rollout.max_turns`` from each run's ``config.json``.
      max_episodes: keep a seeded sample of this many episodes (0: all).
      seed: the sample's seed.
      log: progress lines.

    Returns:
      The labelled episodes, the bad records and the skipped counts.

    Raises:
      JudgeError: an unknown source or label, a workdir that is not a directory, or
        no usable episode at all.
    """
    unknown = sorted(set(sources) - set(SOURCES)) + sorted(set(labels) - set(RUBRIC))
    if unknown:
        raise JudgeError(
            f"unknown source or label {unknown[0]!r} (sources: {SOURCES}; labels: {tuple(RUBRIC)})"
        )
    if not workdirs:
        raise JudgeError("no workdir given")
    data = Dataset([])
    found: list[tuple[str, str, Episode, dict[str, Any], int | None]] = []
    for spec in workdirs:
        try:
            wd = Workdir.of(spec)
        except WorkdirError as e:
            raise JudgeError(f"--workdir={spec}: {e}") from e
        if not wd.root.is_dir():
            raise JudgeError(f"--workdir={spec}: no such directory")
        rollout = _run_settings(wd).get("rl") or {}
        rollout = rollout.get("rollout") if isinstance(rollout, dict) else None
        turns = max_turns or (rollout.get("max_turns") if isinstance(rollout, dict) else None)
        turns = turns if isinstance(turns, int) and turns > 0 else None
        if "eval" in sources and wd.eval_dir.is_dir():
            for bench in sorted(wd.eval_dir.iterdir()):
                path = os.fspath(bench / RESULTS_FILE)
                if not os.path.isfile(path):
                    continue
                count = 0
                for where, row in _eval_episodes(path):
                    if isinstance(row, str):
                        data.bad.append(f"{where}: {row}")
                        continue
                    if row.get("finish_reason") == "lost":
                        data.skipped["lost"] += 1
                        continue
                    if "trajectory" not in row:
                        data.skipped["no_trajectory"] += 1
                        continue
                    try:
                        episode, grade = _episode_of_eval_row(row, where)
                    except (KeyError, TypeError, ValueError) as e:
                        data.bad.append(f"{where}: {e}")
                        continue
                    found.append((where, "eval", episode, grade, turns))
                    count += 1
                data.files[path] = count
        if "rollouts" in sources and wd.rollouts_dir.is_dir():
            for file in sorted(wd.rollouts_dir.iterdir()):
                if not _ROLLOUT_FILE.match(file.name):
                    continue
                path = os.fspath(file)
                try:
                    payload = json.loads(file.read_text(encoding="utf-8"))
                    episodes = payload["episodes"]
                    if not isinstance(episodes, list):
                        raise TypeError("'episodes' is not a list")
                except (OSError, ValueError, KeyError, TypeError) as e:
                    data.bad.append(f"{path}: not a rollout file ({type(e).__name__}: {e})")
                    continue
                count = 0
                for index, item in enumerate(episodes):
                    where = f"{path}#{index}"
                    try:
                        episode = Episode.from_json(item)
                        if episode.finish_reason == "lost":
                            data.skipped["lost"] += 1
                            continue
                        grade = _grade(episode.grade, "the grade")
                    except (KeyError, TypeError, ValueError) as e:
                        data.bad.append(f"{where}: not an episode ({type(e).__name__}: {e})")
                        continue
                    found.append((where, "rollout", episode, grade, turns))
                    count += 1
                data.files[path] = count
    if max_episodes and len(found) > max_episodes:
        keep = np.sort(np.random.default_rng(seed).choice(len(found), max_episodes, replace=False))
        data.skipped["sampled_out"] += len(found) - max_episodes
        found = [found[i] for i in keep]
    for where, kind, episode, grade, turns in found:
        try:
            event = _event(episode, where, chat, turns)
        except ingest.RowError as e:
            data.bad.append(f"{where}: {e}")
            continue
        record = RecordedEpisode(where, kind, episode.task_id, episode, grade, event)
        try:
            values = {name: RUBRIC[name][1](record) for name in labels}
        except Exception as e:  # a rule that cannot grade it: counted, never guessed
            data.bad.append(f"{where}: the rubric failed ({type(e).__name__}: {e})")
            continue
        data.records.append(dataclasses.replace(record, labels=values))
    log(
        f"episodes: {len(data.records)} labelled from {len(data.files)} files, "
        f"{len(data.bad)} bad, skipped {dict(data.skipped)}"
    )
    if not data.records:
        where = ", ".join(workdirs)
        bad = f"; {len(data.bad)} bad records, the first: {data.bad[0]}" if data.bad else ""
        raise JudgeError(
            f"no usable episode in {where} (sources {tuple(sources)}: eval results with "
            f"trajectories, rl/rollouts files){bad}"
        )
    return data


# ---- the split (choice 4) ----------------------------------------------------------------


def split_tasks(task_ids: Iterable[str], held_out: float, seed: int) -> tuple[list[str], list[str]]:
    """``(train tasks, held-out tasks)``: a seeded shuffle, ``held_out`` of them out.

    Raises:
      JudgeError: fewer than two tasks, or ``held_out`` outside (0, 1).
    """
    tasks = sorted(set(task_ids))
    if not 0 < held_out < 1:
        raise JudgeError(f"held_out={held_out} must be in (0, 1)")
    if len(tasks) < 2:
        raise JudgeError(f"{len(tasks)} task(s): a held-out split by task needs at least two")
    order = [tasks[i] for i in np.random.default_rng(seed).permutation(len(tasks))]
    count = min(max(1, round(held_out * len(tasks))), len(tasks) - 1)
    return sorted(order[count:]), sorted(order[:count])


# ---- the policy as a feature extractor (choice 3) ----------------------------------------


@dataclasses.dataclass
class Policy:
    """A loaded policy: model config, variables, tokenizer and what it is."""

    config: ModelConfig
    variables: Any
    tokenizer: Tokenizer
    description: dict[str, Any]

    @property
    def chat(self) -> ChatFormat:
        return ChatFormat(self.tokenizer)

    @property
    def feature_dim(self) -> int:
        return len(POOLING) * self.config.hidden_size


def load_policy(spec: str, workdir: str | None = None) -> Policy:
    """The policy ``spec`` names (choice 3).

    Args:
      spec: ``base:NAME`` or an HF directory (a base); a checkpoint step directory or
        checkpoints directory; ``""`` for the newest checkpoint of ``workdir``.
      workdir: a run, for the default checkpoint and for a tokenizer when the
        checkpoint's metadata has none.

    Raises:
      JudgeError: nothing to load, or the files cannot be read.
    """
    if not spec:
        if not workdir:
            raise JudgeError("no --policy and no workdir to take its newest checkpoint from")
        try:
            spec = find_checkpoint(workdir)
        except (FileNotFoundError, WorkdirError) as e:
            raise JudgeError(f"--policy not given and {e}") from e
    if spec.startswith(BASE_PREFIX) or os.path.isfile(os.path.join(spec, hf.CONFIG_FILE)):
        try:
            path = bases.resolve(spec.removeprefix(BASE_PREFIX))
            bases.verify(path)
            config, variables = hf.load_hf_checkpoint(
                path, scan_layers=False, param_dtype="float32", dtype="float32"
            )
            tokenizer = Tokenizer.load(bases.tokenizer_file(path))
        except (bases.BaseModelError, hf.HFCheckpointError, OSError, ValueError) as e:
            raise JudgeError(f"--policy={spec}: {e}") from e
        description = {"kind": "base", "spec": spec, "path": path, "stage": "base", "step": 0}
        return Policy(config, jax.tree.map(jnp.asarray, variables), tokenizer, description)
    # A checkpoints directory means its newest step, resolved once (a run may be writing).
    step_path = spec
    if not (epath.Path(spec) / checkpoints.PARAMS).is_dir():
        step_path = checkpoints.latest_checkpoint(spec) if epath.Path(spec).is_dir() else None
        if step_path is None:
            raise JudgeError(f"--policy={spec}: neither a checkpoint step nor a directory of them")
    try:
        metadata = checkpoints.read_metadata(step_path)
        config = checkpoints.model_config_from_metadata(metadata, step_path)
        variables, metadata = weights.restore_checkpoint(step_path, config, None)
    except (checkpoints.CheckpointError, OSError, ValueError) as e:
        raise JudgeError(f"--policy={spec}: not a readable checkpoint ({e})") from e
    if "tokenizer" in metadata:
        tokenizer = Tokenizer.from_json(metadata["tokenizer"])
    elif workdir and Workdir.of(workdir).tokenizer_file.exists():
        tokenizer = Tokenizer.load(Workdir.of(workdir).tokenizer_file)
    else:
        raise JudgeError(f"--policy={spec}: its metadata has no tokenizer and no run gives one")
    description = {
        "kind": "checkpoint",
        "spec": spec,
        "path": step_path if "://" in step_path else os.path.abspath(step_path),
        "stage": str(metadata.get("stage", "")),
        "step": int(metadata.get("step", 0)),
    }
    return Policy(config, variables, tokenizer, description)


@functools.lru_cache(maxsize=8)
def _pool_fn(config: ModelConfig):
    """The jitted per-row pooling for one model config (compiled once per shape)."""

    def pool(variables, tokens, segment_ids, sampled):
        hidden, _, _ = model.hidden_with_aux(config, variables, tokens, None, segment_ids)
        hidden = hidden.astype(jnp.float32)
        valid = (segment_ids != 0).astype(jnp.float32)
        sampled = sampled.astype(jnp.float32) * valid
        last = jnp.maximum(valid.sum(1).astype(jnp.int32) - 1, 0)
        return (
            jnp.einsum("btd,bt->bd", hidden, sampled),
            sampled.sum(1),
            jnp.einsum("btd,bt->bd", hidden, valid),
            valid.sum(1),
            jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0],
        )

    return jax.jit(pool)


@dataclasses.dataclass
class FeatureStats:
    rows: int = 0
    tokens: int = 0
    truncated_rows: int = 0
    batches: int = 0
    shapes: set = dataclasses.field(default_factory=set)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["shapes"] = sorted(list(s) for s in self.shapes)
        return out


def episode_features(
    policy: Policy,
    trajectories: Sequence[Trajectory],
    *,
    max_len: int = 0,
    bucket: int = 512,
    batch: int = 8,
    stats: FeatureStats | None = None,
) -> np.ndarray:
    """Pooled final hidden states of the policy, float32 [N, 3 * hidden] (choice 3).

    Raises:
      JudgeError: a token id outside the model's vocabulary (the wrong tokenizer).
    """
    stats = stats if stats is not None else FeatureStats()
    began = time.monotonic()
    limit = min(
        max_len or policy.config.max_position_embeddings, policy.config.max_position_embeddings
    )
    vocab = policy.config.vocab_size
    rows: list[tuple[int, list[int], list[int]]] = []  # (episode, tokens, sampled mask)
    for index, traj in enumerate(trajectories):
        if traj.tokens and not 0 <= min(traj.tokens) <= max(traj.tokens) < vocab:
            raise JudgeError(
                f"trajectory {index} has token ids outside the model's vocabulary [0, {vocab}): "
                "it was written with another tokenizer"
            )
        starts = traj.segment_starts or [0]
        for s, start in enumerate(starts):
            end = starts[s + 1] if s + 1 < len(starts) else len(traj.tokens)
            tokens, mask = traj.tokens[start:end], traj.loss_mask[start:end]
            if not tokens:
                continue
            if len(tokens) > limit:
                stats.truncated_rows += 1
                tokens, mask = tokens[:limit], mask[:limit]
            rows.append((index, tokens, mask))
    dim = policy.config.hidden_size
    sampled_sum = np.zeros((len(trajectories), dim), np.float64)
    sampled_count = np.zeros(len(trajectories), np.float64)
    all_sum = np.zeros((len(trajectories), dim), np.float64)
    all_count = np.zeros(len(trajectories), np.float64)
    last = np.zeros((len(trajectories), dim), np.float32)
    last_row: dict[int, int] = {}  # episode -> index of its last window among rows
    for i, (episode, _, _) in enumerate(rows):
        last_row[episode] = i
    pool = _pool_fn(policy.config)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][1]))
    for b in range(0, len(order), batch):
        chunk = order[b : b + batch]
        longest = max(len(rows[i][1]) for i in chunk)
        width = min(-(-longest // bucket) * bucket, limit)
        tokens = np.zeros((batch, width), np.int32)
        segments = np.zeros((batch, width), np.int32)
        sampled = np.zeros((batch, width), np.int32)
        for j, i in enumerate(chunk):
            _, ids, mask = rows[i]
            tokens[j, : len(ids)] = ids
            segments[j, : len(ids)] = 1
            sampled[j, : len(ids)] = mask
        out = jax.device_get(pool(policy.variables, tokens, segments, sampled))
        stats.shapes.add((batch, width))
        stats.batches += 1
        for j, i in enumerate(chunk):
            episode = rows[i][0]
            sampled_sum[episode] += out[0][j]
            sampled_count[episode] += out[1][j]
            all_sum[episode] += out[2][j]
            all_count[episode] += out[3][j]
            if last_row[episode] == i:
                last[episode] = out[4][j]
    stats.rows += len(rows)
    stats.tokens += int(sum(len(r[1]) for r in rows))
    stats.seconds += time.monotonic() - began
    mean_sampled = sampled_sum / np.maximum(sampled_count, 1.0)[:, None]
    mean_all = all_sum / np.maximum(all_count, 1.0)[:, None]
    return np.concatenate([mean_sampled, mean_all, last], axis=1).astype(np.float32)


def render_messages(
    chat: ChatFormat, messages: Sequence[Mapping[str, Any]], system_prompt: str = ""
) -> Trajectory:
    """A messages-format trajectory (``ingest``'s) as tokens, assistant turns as sampled
    (loss mask 1) and each call between the call tokens as the model writes it: the
    JSON object, or the raw text of a call that was not one; ``system_prompt`` opens a
    conversation that has no system message (choice 7)."""
    tok = chat.tokenizer
    special = tok.special_id
    traj = Trajectory()
    chat.start_segment(traj)
    if system_prompt and (not messages or messages[0].get("role") != "system"):
        chat.append_message(traj, Message("system", system_prompt))
    for message in messages:
        role = message["role"]
        if role != "assistant":
            chat.append_message(traj, Message(role, message.get("content", "")))
            continue
        ids = tok.encode(message.get("content", ""))
        if message.get("summary"):
            ids += [special(protocol.SUMMARY_OPEN), *tok.encode(message["summary"])]
            ids.append(special(protocol.SUMMARY_CLOSE))
        for call in message.get("tool_calls", []):
            raw = json.dumps(call, ensure_ascii=False) if isinstance(call, dict) else str(call)
            ids += [special(protocol.CALL_OPEN), *tok.encode(raw), special(protocol.CALL_CLOSE)]
        ids.append(special(protocol.END))
        chat.append_assistant_header(traj)
        chat.append_sampled(traj, ids)
    return traj


def event_trajectory(event: FeedbackEvent, chat: ChatFormat, system_prompt: str = "") -> Trajectory:
    """The tokens of a feedback event's trajectory, either format (``render_messages``)."""
    if event.trajectory_format == "episode":
        return event.view.episode.trajectory
    return render_messages(chat, event.row["trajectory"]["messages"], system_prompt)


def system_prompt_of(chat: ChatFormat, trajectories: Iterable[Trajectory]) -> str:
    """The most common system turn of recorded episodes, as text (``""`` if none)."""
    specials = set(chat.tokenizer.special_ids.values())
    counts: collections.Counter = collections.Counter()
    for traj in trajectories:
        span = next((t for t in traj.turns if t.role == "system"), None)
        if span is not None:
            counts[
                tuple(t for t in traj.tokens[span.start + 1 : span.end] if t not in specials)
            ] += 1
    if not counts:
        return ""
    return chat.tokenizer.decode(list(counts.most_common(1)[0][0]))


# ---- the head (choice 5) -----------------------------------------------------------------


@dataclasses.dataclass
class Head:
    """A linear softmax classifier on standardised features."""

    label: str
    classes: tuple[str, ...]
    mean: np.ndarray  # [F]
    std: np.ndarray  # [F]
    weight: np.ndarray  # [F, C]
    bias: np.ndarray  # [C]
    l2: float
    max_distance: float = float("inf")  # beyond it an input is unlike the training rows

    def distance(self, features: np.ndarray) -> np.ndarray:
        """Mean squared z-score of each row under the training standardisation."""
        z = (np.asarray(features, np.float32) - self.mean) / self.std
        return (z.astype(np.float64) ** 2).mean(axis=1)

    def answers(self, features: np.ndarray, min_confidence: float) -> tuple[np.ndarray, np.ndarray]:
        """``(probabilities [N, C], answered [N])``: a row is answered when its top
        probability is at least ``min_confidence`` and it lies within ``max_distance``
        (choice 7)."""
        probs = self.probabilities(features)
        answered = (probs.max(axis=1) >= min_confidence) & (
            self.distance(features) <= self.max_distance
        )
        return probs, answered

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        z = (np.asarray(features, np.float32) - self.mean) / self.std
        logits = z @ self.weight + self.bias
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(axis=1, keepdims=True)

    def predict(self, features: np.ndarray) -> list[str]:
        return [self.classes[i] for i in self.probabilities(features).argmax(axis=1)]

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            np.savez(
                f,
                classes=np.array(self.classes),
                mean=self.mean,
                std=self.std,
                weight=self.weight,
                bias=self.bias,
                l2=np.float64(self.l2),
                max_distance=np.float64(self.max_distance),
                label=np.array(self.label),
            )

    @classmethod
    def load(cls, path: str) -> Head:
        try:
            with np.load(path, allow_pickle=False) as z:
                head = cls(
                    label=str(z["label"]),
                    classes=tuple(str(c) for c in z["classes"]),
                    mean=z["mean"].astype(np.float32),
                    std=z["std"].astype(np.float32),
                    weight=z["weight"].astype(np.float32),
                    bias=z["bias"].astype(np.float32),
                    l2=float(z["l2"]),
                    max_distance=float(z["max_distance"]),
                )
        except (OSError, KeyError, ValueError) as e:
            raise JudgeError(f"{path}: not a judge head ({e})") from e
        f, c = head.weight.shape
        if head.mean.shape != (f,) or head.std.shape != (f,) or head.bias.shape != (c,):
            raise JudgeError(f"{path}: the head's arrays disagree in shape")
        if len(head.classes) != c:
            raise JudgeError(f"{path}: {len(head.classes)} classes but {c} outputs")
        return head


@functools.partial(jax.jit, static_argnames=("num_classes", "steps"))
def _fit(x, y, w, l2, learning_rate, *, num_classes: int, steps: int):
    """Weighted softmax regression by full-batch Adam from zeros, cosine-decayed."""
    params = {
        "weight": jnp.zeros((x.shape[1], num_classes), jnp.float32),
        "bias": jnp.zeros((num_classes,), jnp.float32),
    }
    opt = optax.adam(optax.cosine_decay_schedule(learning_rate, steps))

    def loss(p):
        logits = x @ p["weight"] + p["bias"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-9) + l2 * jnp.sum(p["weight"] ** 2)

    def step(_, carry):
        p, state = carry
        updates, state = opt.update(jax.grad(loss)(p), state, p)
        return optax.apply_updates(p, updates), state

    params, _ = jax.lax.fori_loop(0, steps, step, (params, opt.init(params)))
    return params


def _standardise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(axis=0).astype(np.float32)
    std = np.maximum(x.std(axis=0), 1e-6).astype(np.float32)
    return mean, std


def train_head(
    label: str,
    features: np.ndarray,
    targets: Sequence[str],
    groups: Sequence[str],
    *,
    l2_grid: Sequence[float] = (1e-3, 1e-2, 1e-1, 1.0),
    folds: int = 3,
    steps: int = 300,
    learning_rate: float = 0.05,
    seed: int = 0,
    ood_factor: float = 1.0,
) -> tuple[Head, list[dict[str, Any]]]:
    """A head for ``label`` and its L2 selection table (choice 5).

    Args:
      label: the rubric label.
      features: [N, F] training features.
      targets: N class names.
      groups: N task ids (cross-validation folds never split a task).
      l2_grid: L2 weights to choose from (one value: no cross-validation).
      folds: cross-validation folds (over tasks; fewer tasks than folds: no CV).
      steps, learning_rate: Adam's.
      seed: the fold assignment's.
      ood_factor: ``max_distance`` is this times the 99th percentile of the training
        rows' distance (0: no limit).

    Returns:
      The head (trained on all of ``features``) and one row per L2 value:
      ``{"l2", "cv_accuracy", "cv_log_loss"}`` (``None`` without cross-validation).

    Raises:
      ValueError: fewer than two classes, or mismatched lengths.
    """
    if not len(features) == len(targets) == len(groups):
        raise ValueError("features, targets and groups differ in length")
    if not l2_grid:
        raise ValueError("l2_grid is empty")
    classes = tuple(sorted(set(targets)))
    if len(classes) < 2:
        raise ValueError(f"label {label!r}: one class ({classes}) in the training split")
    mean, std = _standardise(features)
    # Rows padded to a multiple of ROW_PAD with weight 0: one XLA program per class
    # count for every fit of every label, fold and control of a run.
    n = len(targets)
    padded = -(-n // ROW_PAD) * ROW_PAD
    x = np.zeros((padded, features.shape[1]), np.float32)
    x[:n] = (features - mean) / std
    y = np.zeros(padded, np.int32)
    y[:n] = [classes.index(t) for t in targets]
    real = np.arange(padded) < n
    x, y = jnp.asarray(x), jnp.asarray(y)
    fit = functools.partial(_fit, num_classes=len(classes), steps=steps)
    tasks = sorted(set(groups))
    table: list[dict[str, Any]] = []
    if len(l2_grid) > 1 and len(tasks) >= max(folds, 2) and folds >= 2:
        order = [tasks[i] for i in np.random.default_rng(seed).permutation(len(tasks))]
        fold_of = {task: i % folds for i, task in enumerate(order)}
        fold = np.full(padded, -1)
        fold[:n] = [fold_of[g] for g in groups]
        y_host = np.asarray(y)
        for l2 in l2_grid:
            correct, nll = 0, 0.0
            for k in range(folds):
                w = jnp.asarray(real & (fold != k), jnp.float32)
                p = fit(x, y, w, jnp.float32(l2), jnp.float32(learning_rate))
                logp = np.asarray(jax.nn.log_softmax(x @ p["weight"] + p["bias"]), np.float64)
                out = fold == k
                correct += int(((logp.argmax(axis=1) == y_host) & out).sum())
                nll -= float(logp[out, y_host[out]].sum())
            table.append({"l2": float(l2), "cv_accuracy": correct / n, "cv_log_loss": nll / n})
        best = min(table, key=lambda row: (row["cv_log_loss"], -row["l2"]))["l2"]
    else:
        best = float(sorted(l2_grid)[len(l2_grid) // 2])
        table = [{"l2": float(l2), "cv_accuracy": None, "cv_log_loss": None} for l2 in l2_grid]
    p = fit(x, y, jnp.asarray(real, jnp.float32), jnp.float32(best), jnp.float32(learning_rate))
    head = Head(
        label=label,
        classes=classes,
        mean=mean,
        std=std,
        weight=np.asarray(p["weight"], np.float32),
        bias=np.asarray(p["bias"], np.float32),
        l2=best,
    )
    if ood_factor > 0:
        head.max_distance = float(np.quantile(head.distance(features), 0.99) * ood_factor)
    return head, table


# ---- evaluation (choice 6) ---------------------------------------------------------------


def cluster_bootstrap(
    values: Sequence[float],
    groups: Sequence[str],
    *,
    resamples: int = metrics.CI_RESAMPLES,
    level: float = metrics.CI_LEVEL,
    seed: int = metrics.CI_SEED,
) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of the mean of per-episode ``values``,
    resampling whole groups (tasks) with replacement; None without values."""
    if len(values) == 0:
        return None
    tasks = sorted(set(groups))
    index = {t: i for i, t in enumerate(tasks)}
    sums = np.zeros(len(tasks))
    counts = np.zeros(len(tasks))
    for value, group in zip(values, groups):
        sums[index[group]] += value
        counts[index[group]] += 1
    draws = np.random.default_rng(seed).integers(0, len(tasks), size=(resamples, len(tasks)))
    means = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def evaluate_head(
    head: Head,
    features: np.ndarray,
    targets: Sequence[str],
    groups: Sequence[str],
    *,
    majority: str,
    min_confidence: float,
) -> dict[str, Any]:
    """The held-out figures of choice 6 (without the shuffled control)."""
    probs, answered = head.answers(features, min_confidence)
    predicted = [head.classes[i] for i in probs.argmax(axis=1)]
    correct = np.array([p == t for p, t in zip(predicted, targets)], np.float64)
    base = np.array([majority == t for t in targets], np.float64)
    inside = head.distance(features) <= head.max_distance
    per_class = {}
    for c in sorted(set(head.classes) | set(targets)):
        tp = sum(p == c and t == c for p, t in zip(predicted, targets))
        said = sum(p == c for p in predicted)
        real = sum(t == c for t in targets)
        per_class[c] = {
            "support": real,
            "predicted": said,
            "precision": tp / said if said else None,
            "recall": tp / real if real else None,
        }
    labels_seen = sorted(set(head.classes) | set(targets))
    confusion = {t: {p: 0 for p in labels_seen} for t in labels_seen}
    for p, t in zip(predicted, targets):
        confusion[t][p] += 1
    return {
        "episodes": len(targets),
        "tasks": len(set(groups)),
        "accuracy": float(correct.mean()),
        "accuracy_ci": cluster_bootstrap(correct, groups),
        "majority_class": majority,
        "majority_accuracy": float(base.mean()),
        "majority_accuracy_ci": cluster_bootstrap(base, groups),
        "gain": float((correct - base).mean()),
        "gain_ci": cluster_bootstrap(correct - base, groups),
        "min_confidence": min_confidence,
        "coverage": float(answered.mean()),
        "within_distance": float(inside.mean()),
        "answered_accuracy": float(correct[answered].mean()) if answered.any() else None,
        "per_class": per_class,
        "confusion": confusion,
        "unseen_classes": sorted(set(targets) - set(head.classes)),
    }


# ---- the judge (choice 7) and its files (choice 8) ---------------------------------------


class DerivedJudge:
    """A trained judge: the policy's features and one head per label.

    Call it on a ``FeedbackEvent`` for ``classify``'s hook (the ``category`` head):
    a category, or None to abstain.
    """

    def __init__(
        self,
        policy: Policy,
        heads: Mapping[str, Head],
        *,
        min_confidence: float,
        max_len: int = 0,
        bucket: int = 512,
        batch: int = 8,
        directory: str = "",
        system_prompt: str = "",
    ):
        for head in heads.values():
            if head.weight.shape[0] != policy.feature_dim:
                raise JudgeError(
                    f"head {head.label!r} reads {head.weight.shape[0]} features, the policy "
                    f"gives {policy.feature_dim}: not the policy it was trained on"
                )
        self.policy = policy
        self.heads = dict(heads)
        self.min_confidence = min_confidence
        self.max_len, self.bucket, self.batch = max_len, bucket, batch
        self.directory = directory
        self.system_prompt = system_prompt
        self.chat = policy.chat

    def _head(self, label: str) -> Head:
        if label not in self.heads:
            raise KeyError(f"this judge has no {label!r} head (it has {sorted(self.heads)})")
        return self.heads[label]

    def features(self, trajectories: Sequence[Trajectory]) -> np.ndarray:
        return episode_features(
            self.policy,
            trajectories,
            max_len=self.max_len,
            bucket=self.bucket,
            batch=self.batch,
        )

    def probabilities(self, episodes: Sequence[Episode], label: str) -> np.ndarray:
        """[N, classes] of ``label``'s head (its ``classes`` order) for recorded episodes."""
        head = self._head(label)
        return head.probabilities(self.features([e.trajectory for e in episodes]))

    def event_probabilities(self, events: Sequence[FeedbackEvent], label: str) -> np.ndarray:
        head = self._head(label)
        trajectories = [event_trajectory(e, self.chat, self.system_prompt) for e in events]
        return head.probabilities(self.features(trajectories))

    def classes(self, label: str) -> tuple[str, ...]:
        return self._head(label).classes

    def score(
        self, episodes: Sequence[Episode], label: str = "resolved", positive: str = "resolved"
    ) -> np.ndarray:
        """P(``positive``) per episode, e.g. P(resolved): for task filtering."""
        classes = self.classes(label)
        if positive not in classes:
            raise KeyError(f"head {label!r} has no class {positive!r} (it has {classes})")
        return self.probabilities(episodes, label)[:, classes.index(positive)]

    def verdicts(self, events: Sequence[FeedbackEvent]) -> list[str | None]:
        """Each event's category, or None where the judge abstains (choice 7)."""
        head = self._head("category")
        features = self.features(
            [event_trajectory(e, self.chat, self.system_prompt) for e in events]
        )
        probs, answered = head.answers(features, self.min_confidence)
        out: list[str | None] = []
        for row, ok in zip(probs, answered):
            category = head.classes[int(row.argmax())]
            out.append(category if ok and category in classify.CATEGORIES else None)
        return out

    def __call__(self, event: FeedbackEvent) -> str | None:
        return self.verdicts([event])[0]


def task_pass_rates(judge: DerivedJudge, episodes: Sequence[Episode]) -> dict[str, float]:
    """Predicted pass rate per task: the mean P(resolved) of its episodes. For task
    filtering: a task the judge rates near 0 or 1 gives GRPO no reward variance."""
    scores = judge.score(episodes)
    by_task: dict[str, list[float]] = collections.defaultdict(list)
    for episode, p in zip(episodes, scores):
        by_task[episode.task_id].append(float(p))
    return {task: float(np.mean(values)) for task, values in sorted(by_task.items())}


def keep_tasks(rates: Mapping[str, float], low: float = 0.05, high: float = 0.95) -> list[str]:
    """Task ids whose predicted pass rate lies in ``[low, high]``."""
    return [task for task, rate in sorted(rates.items()) if low <= rate <= high]


def as_detector(judge: DerivedJudge, fire_on: Sequence[str] = classify.BEHAVIOURS):
    """A textual-feedback detector (``rl.feedback.DETECTORS``' signature) from the
    ``category`` head: it fires, at the last assistant turn, when the judge's
    category is one of ``fire_on`` (confidently); facts: ``category``,
    ``confidence``. To train with it, register it under a name that has a hint in
    ``rl.hints.HINTS``."""
    head = judge._head("category")

    def detector(view):
        if not view.turns:
            return None
        features = judge.features([view.episode.trajectory])
        probs, answered = head.answers(features, judge.min_confidence)
        probs = probs[0]
        best = int(probs.argmax())
        if not answered[0] or head.classes[best] not in fire_on:
            return None
        return view.turns[-1].start, {
            "category": head.classes[best],
            "confidence": round(float(probs[best]), 3),
        }

    return detector


def save(
    directory: str,
    policy: Policy,
    heads: Mapping[str, Head],
    *,
    settings: Mapping[str, Any],
    data: Mapping[str, Any],
    system_prompt: str = "",
) -> str:
    """Writes ``judge.json``, ``head_<label>.npz`` and ``tokenizer.json`` (choice 8)."""
    os.makedirs(directory, exist_ok=True)
    files = {}
    for label, head in heads.items():
        files[label] = f"head_{label}.npz"
        head.save(os.path.join(directory, files[label]))
    with open(os.path.join(directory, TOKENIZER_FILE), "w", encoding="utf-8") as f:
        f.write(policy.tokenizer.to_json())
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "policy": {**policy.description, "model_config": policy.config.to_dict()},
        "tokenizer": TOKENIZER_FILE,
        "features": {
            "pooling": list(POOLING),
            "dim": policy.feature_dim,
            "max_len": settings.get("max_len", 0),
            "bucket": settings.get("bucket", 512),
            "batch": settings.get("batch", 8),
        },
        "min_confidence": settings["min_confidence"],
        "system_prompt": system_prompt,
        "heads": {
            label: {
                "file": files[label],
                "classes": list(head.classes),
                "l2": head.l2,
                "max_distance": head.max_distance,
                "rubric": RUBRIC[label][0] if label in RUBRIC else "",
            }
            for label, head in heads.items()
        },
        "settings": dict(settings),
        "data": dict(data),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = os.path.join(directory, JUDGE_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
    return path


def load(directory: str, *, policy: str | None = None) -> DerivedJudge:
    """The judge saved in ``directory``; ``policy`` overrides the recorded policy path.

    Raises:
      JudgeError: a missing or malformed file, or a policy that does not fit.
    """
    path = os.path.join(directory, JUDGE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise JudgeError(f"{path}: not a judge directory ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
        raise JudgeError(f"{path}: schema_version must be {SCHEMA_VERSION}")
    try:
        recorded = manifest["policy"]
        spec = policy or recorded["path"]
        if recorded["kind"] == "base" and not policy:
            spec = recorded["spec"]
        loaded = load_policy(spec)
        saved = ModelConfig.from_dict(recorded["model_config"])
        if loaded.config.replace(scan_layers=saved.scan_layers) != saved:
            differs = model.first_shape_difference(saved, loaded.config)
            if differs is not None:
                raise JudgeError(f"policy {spec}: {differs[0]} differs from the judge's policy")
        tokenizer = Tokenizer.load(os.path.join(directory, manifest["tokenizer"]))
        if tokenizer.to_json() != loaded.tokenizer.to_json():
            raise JudgeError(f"policy {spec}: its tokenizer is not the judge's")
        heads = {
            label: Head.load(os.path.join(directory, entry["file"]))
            for label, entry in manifest["heads"].items()
        }
        features = manifest["features"]
        return DerivedJudge(
            loaded,
            heads,
            min_confidence=float(manifest["min_confidence"]),
            max_len=int(features["max_len"]),
            bucket=int(features["bucket"]),
            batch=int(features["batch"]),
            directory=directory,
            system_prompt=str(manifest.get("system_prompt", "")),
        )
    except (KeyError, TypeError) as e:
        raise JudgeError(f"{path}: malformed ({type(e).__name__}: {e})") from e


def category_judge(directory: str) -> DerivedJudge:
    """``classify``'s judge factory: ``--judge=cursor_rl.outer.judge:category_judge=DIR``."""
    judge = load(directory)
    judge._head("category")
    return judge


def register(name: str, directory: str) -> None:
    """Registers the judge in ``directory`` with ``classify.register_judge(name)``
    (loaded when ``classify.load_judge(name)`` asks for it)."""
    classify.register_judge(name)(lambda: category_judge(directory))


# ---- the command -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """The train command's settings (its flags; defaults documented in
    ``docs/outer_loop.md``)."""

    workdirs: tuple[str, ...]
    out: str
    policy: str = ""
    labels: tuple[str, ...] = tuple(RUBRIC)
    sources: tuple[str, ...] = SOURCES
    max_episodes: int = 400
    held_out: float = 0.3
    seed: int = 0
    max_len: int = 0
    bucket: int = 512
    batch: int = 8
    steps: int = 300
    learning_rate: float = 0.05
    l2_grid: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 1.0)
    folds: int = 3
    min_confidence: float = 0.6
    ood_factor: float = 1.0
    max_turns: int = 0


def _majority(targets: Sequence[str]) -> str:
    counts = collections.Counter(targets)
    return min(counts, key=lambda c: (-counts[c], c))


def train(config: JudgeConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Builds the dataset, extracts features, trains and evaluates the heads, saves
    the judge and writes the report. Returns the report's JSON.

    Raises:
      JudgeError: unusable settings or inputs (nothing is written).
    """
    began = time.monotonic()
    if config.min_confidence < 0 or config.min_confidence > 1:
        raise JudgeError(f"min_confidence={config.min_confidence} must be in [0, 1]")
    if config.bucket < 1 or config.batch < 1 or config.steps < 1 or config.max_episodes < 0:
        raise JudgeError("bucket, batch and steps must be >= 1, max_episodes >= 0")
    if not config.labels or not config.sources:
        raise JudgeError("no label to train or no source to read")
    unknown = sorted(set(config.sources) - set(SOURCES)) + sorted(set(config.labels) - set(RUBRIC))
    if unknown:
        raise JudgeError(
            f"unknown source or label {unknown[0]!r} (sources: {SOURCES}; labels: {tuple(RUBRIC)})"
        )
    for spec in config.workdirs:
        try:
            if not Workdir.of(spec).root.is_dir():
                raise JudgeError(f"--workdir={spec}: no such directory")
        except WorkdirError as e:
            raise JudgeError(f"--workdir={spec}: {e}") from e
    policy = load_policy(config.policy, config.workdirs[0] if config.workdirs else None)
    log(
        f"policy: {policy.description['path']} ({policy.description['stage']} step "
        f"{policy.description['step']}), {policy.feature_dim} features"
    )
    for spec in config.workdirs:
        wd_tokenizer = Workdir.of(spec).tokenizer_file
        if wd_tokenizer.exists() and (
            Tokenizer.load(wd_tokenizer).to_json() != policy.tokenizer.to_json()
        ):
            raise JudgeError(
                f"the tokenizer of {spec} is not the policy's: its episodes' token ids "
                "mean other text to this policy"
            )
    data = read_workdirs(
        config.workdirs,
        policy.chat,
        sources=config.sources,
        labels=config.labels,
        max_turns=config.max_turns,
        max_episodes=config.max_episodes,
        seed=config.seed,
        log=log,
    )
    train_tasks, held_tasks = split_tasks(data.tasks, config.held_out, config.seed)
    held = set(held_tasks)
    is_held = np.array([r.task_id in held for r in data.records])
    stats = FeatureStats()
    features = episode_features(
        policy,
        [r.episode.trajectory for r in data.records],
        max_len=config.max_len,
        bucket=config.bucket,
        batch=config.batch,
        stats=stats,
    )
    log(
        f"features: {stats.rows} windows, {stats.tokens} tokens in {stats.seconds:.1f} s "
        f"({len(stats.shapes)} shapes compiled)"
    )
    groups = [r.task_id for r in data.records]
    heads: dict[str, Head] = {}
    results: dict[str, Any] = {}
    for label in config.labels:
        targets = [r.labels[label] for r in data.records]
        tr = ~is_held
        tr_targets = [t for t, keep in zip(targets, tr) if keep]
        tr_groups = [g for g, keep in zip(groups, tr) if keep]
        ho_targets = [t for t, keep in zip(targets, is_held) if keep]
        ho_groups = [g for g, keep in zip(groups, is_held) if keep]
        entry: dict[str, Any] = {
            "rubric": RUBRIC[label][0],
            "train_counts": dict(collections.Counter(tr_targets)),
            "held_out_counts": dict(collections.Counter(ho_targets)),
        }
        if len(set(tr_targets)) < 2:
            entry["skipped"] = (
                f"the training split holds one class ({sorted(set(tr_targets))}): no head"
            )
            results[label] = entry
            log(f"{label}: {entry['skipped']}")
            continue
        head, table = train_head(
            label,
            features[tr],
            tr_targets,
            tr_groups,
            l2_grid=config.l2_grid,
            folds=config.folds,
            steps=config.steps,
            learning_rate=config.learning_rate,
            seed=config.seed,
            ood_factor=config.ood_factor,
        )
        majority = _majority(tr_targets)
        entry.update(
            evaluate_head(
                head,
                features[is_held],
                ho_targets,
                ho_groups,
                majority=majority,
                min_confidence=config.min_confidence,
            )
        )
        shuffled = list(np.random.default_rng(config.seed + 1).permutation(tr_targets))
        control, _ = train_head(
            label,
            features[tr],
            shuffled,
            tr_groups,
            l2_grid=(head.l2,),
            steps=config.steps,
            learning_rate=config.learning_rate,
        )
        control_correct = [p == t for p, t in zip(control.predict(features[is_held]), ho_targets)]
        entry["shuffled_control_accuracy"] = float(np.mean(control_correct))
        entry["train_accuracy"] = float(
            np.mean([p == t for p, t in zip(head.predict(features[tr]), tr_targets)])
        )
        entry["l2"] = head.l2
        entry["l2_selection"] = table
        entry["classes"] = list(head.classes)
        heads[label] = head
        results[label] = entry
        ci = entry["accuracy_ci"]
        log(
            f"{label}: held-out accuracy {entry['accuracy']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] "
            f"vs majority {entry['majority_accuracy']:.3f} ({majority}); shuffled-label "
            f"control {entry['shuffled_control_accuracy']:.3f}"
        )
    kinds = collections.Counter(r.kind for r in data.records)
    summary_data = {
        "workdirs": [os.path.abspath(w) for w in config.workdirs],
        "episodes": len(data.records),
        "by_source": dict(kinds),
        "tasks": len(data.tasks),
        "train_episodes": int((~is_held).sum()),
        "held_out_episodes": int(is_held.sum()),
        "train_tasks": train_tasks,
        "held_out_tasks": held_tasks,
        "files": data.files,
        "bad_records": data.bad,
        "skipped": dict(data.skipped),
    }
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("workdirs", "out")}
    summary = {
        "policy": policy.description,
        "model": {
            "hidden_size": policy.config.hidden_size,
            "num_layers": policy.config.num_layers,
            "feature_dim": policy.feature_dim,
        },
        "data": summary_data,
        "features": stats.to_json(),
        "labels": results,
        "trained": sorted(heads),
        "settings": settings,
    }
    os.makedirs(config.out, exist_ok=True)
    if heads:
        save(
            config.out,
            policy,
            heads,
            settings=settings,
            data={k: v for k, v in summary_data.items() if k not in ("files", "bad_records")},
            system_prompt=system_prompt_of(
                policy.chat, (r.episode.trajectory for r in data.records)
            ),
        )
    summary["seconds"] = time.monotonic() - began
    write_report(config.out, summary)
    return summary


# ---- the report --------------------------------------------------------------------------


def _ci(ci: Sequence[float] | None) -> str:
    return "" if not ci else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def render_report(summary: Mapping[str, Any]) -> str:
    """The Markdown of ``judge_report.md``."""
    pol, data, feat = summary["policy"], summary["data"], summary["features"]
    out = ["# Derived judge report", ""]
    out.append(
        f"Policy **{pol['stage']} step {pol['step']}** (`{pol['path']}`), frozen: "
        f"{summary['model']['num_layers']} layers, hidden {summary['model']['hidden_size']}; "
        f"features: mean over sampled tokens, mean over all tokens, last token "
        f"({summary['model']['feature_dim']})."
    )
    out.append("")
    by_source = ", ".join(f"{k} {v}" for k, v in sorted(data["by_source"].items()))
    out.append(
        f"Data: **{data['episodes']} episodes** ({by_source}) of {data['tasks']} tasks from "
        f"{', '.join(f'`{w}`' for w in data['workdirs'])}. Split by task (no task on both "
        f"sides): **train {data['train_episodes']} episodes / {len(data['train_tasks'])} "
        f"tasks, held-out {data['held_out_episodes']} episodes / "
        f"{len(data['held_out_tasks'])} tasks**. Not used: "
        f"{', '.join(f'{v} {k}' for k, v in sorted(data['skipped'].items())) or 'none'}; "
        f"**{len(data['bad_records'])} bad records**."
    )
    out.append("")
    out.append(
        f"Features: {feat['rows']} context windows, {feat['tokens']} tokens, "
        f"{feat['truncated_rows']} truncated, {len(feat['shapes'])} compiled shapes, "
        f"{feat['seconds']:.1f} s. Whole command: {summary.get('seconds', 0):.1f} s."
    )
    for label, entry in summary["labels"].items():
        out += ["", f"## {label}", "", f"Rule label: {entry['rubric']}.", ""]
        if "skipped" in entry:
            out.append(f"Not trained: {entry['skipped']}.")
            out.append(
                f"Train counts {entry['train_counts']}, held-out {entry['held_out_counts']}."
            )
            continue
        out += [
            "| held-out (rule labels) | value | 95% CI (tasks resampled) |",
            "|---|---:|---|",
            f"| **accuracy** | **{report.num(entry['accuracy'])}** | {_ci(entry['accuracy_ci'])} |",
            f"| majority baseline (always `{entry['majority_class']}`) | "
            f"{report.num(entry['majority_accuracy'])} | {_ci(entry['majority_accuracy_ci'])} |",
            f"| gain over the baseline (paired) | {entry['gain']:+.3f} | {_ci(entry['gain_ci'])} |",
            f"| shuffled-label control | {report.num(entry['shuffled_control_accuracy'])} | |",
            f"| within the training distance | {report.num(entry['within_distance'])} | |",
            f"| coverage (confidence >= {entry['min_confidence']}, within distance) | "
            f"{report.num(entry['coverage'])} | |",
            f"| accuracy when answering | {report.num(entry['answered_accuracy'])} | |",
            f"| training accuracy | {report.num(entry['train_accuracy'])} | |",
            "",
            f"{entry['episodes']} held-out episodes of {entry['tasks']} tasks"
            + (
                f" (classes never seen in training, always wrong: {entry['unseen_classes']})"
                if entry["unseen_classes"]
                else ""
            )
            + f"; L2 {entry['l2']:g}, picked by task-grouped cross-validation (L2: log "
            "loss / accuracy: "
            + ", ".join(
                f"{r['l2']:g}: {report.num(r['cv_log_loss'])} / {report.num(r['cv_accuracy'])}"
                for r in entry["l2_selection"]
            )
            + ").",
            "",
            "| class | train | held-out | predicted | precision | recall |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for c, row in entry["per_class"].items():
            out.append(
                f"| {c} | {entry['train_counts'].get(c, 0)} | {row['support']} | "
                f"{row['predicted']} | {report.num(row['precision'])} | "
                f"{report.num(row['recall'])} |"
            )
        names = list(entry["confusion"])
        out += ["", "Confusion (rows: rule label, columns: judge):", ""]
        out.append("| | " + " | ".join(names) + " |")
        out.append("|---|" + "---:|" * len(names))
        for t in names:
            out.append(
                f"| {t} | " + " | ".join(str(entry["confusion"][t][p]) for p in names) + " |"
            )
    if data["bad_records"]:
        out += ["", "## Bad records", ""]
        out += [f"- {report.cell(b)}" for b in data["bad_records"][:50]]
        if len(data["bad_records"]) > 50:
            out.append(f"- ... and {len(data['bad_records']) - 50} more (judge_report.json)")
    out += ["", "## Split", ""]
    out.append(f"Held-out tasks: {', '.join(f'`{t}`' for t in data['held_out_tasks'])}.")
    out.append("")
    return "\n".join(out)


def write_report(directory: str, summary: Mapping[str, Any]) -> tuple[str, str]:
    os.makedirs(directory, exist_ok=True)
    json_path = os.path.join(directory, REPORT_JSON)
    md_path = os.path.join(directory, REPORT_MD)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(render_report(summary))
    return json_path, md_path


def _list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (flags as in ``docs/outer_loop.md``)."""
    d = JudgeConfig((), "")
    fv = flags.FlagValues()
    flags.DEFINE_multi_string(
        "workdir", [], "A run's workdir (repeatable), only read.", flag_values=fv
    )
    flags.DEFINE_string("out", None, "Where the judge and its report go.", flag_values=fv)
    flags.DEFINE_string(
        "policy",
        d.policy,
        "Checkpoint, base:NAME or HF dir (default: the first workdir's newest checkpoint).",
        flag_values=fv,
    )
    flags.DEFINE_string("labels", ",".join(d.labels), "Rubric labels to train.", flag_values=fv)
    flags.DEFINE_string("sources", ",".join(d.sources), "eval and/or rollouts.", flag_values=fv)
    flags.DEFINE_integer("max_episodes", d.max_episodes, "Seeded sample (0: all).", flag_values=fv)
    flags.DEFINE_float("held_out", d.held_out, "Fraction of tasks held out.", flag_values=fv)
    flags.DEFINE_integer("seed", d.seed, "Split, sample and folds.", flag_values=fv)
    flags.DEFINE_integer(
        "max_len", d.max_len, "Tokens per window (0: the model's).", flag_values=fv
    )
    flags.DEFINE_integer("bucket", d.bucket, "Padding multiple of the windows.", flag_values=fv)
    flags.DEFINE_integer("batch", d.batch, "Windows per forward pass.", flag_values=fv)
    flags.DEFINE_integer("steps", d.steps, "Adam steps per head fit.", flag_values=fv)
    flags.DEFINE_float("learning_rate", d.learning_rate, "Adam's.", flag_values=fv)
    flags.DEFINE_string(
        "l2_grid", ",".join(map(str, d.l2_grid)), "L2 weights to pick from.", flag_values=fv
    )
    flags.DEFINE_integer("folds", d.folds, "Task-grouped CV folds for L2.", flag_values=fv)
    flags.DEFINE_float("min_confidence", d.min_confidence, "Abstain below.", flag_values=fv)
    flags.DEFINE_float(
        "ood_factor",
        d.ood_factor,
        "Abstain beyond this x the p99 distance (0: never).",
        flag_values=fv,
    )
    flags.DEFINE_integer("max_turns", d.max_turns, "Turn limit (0: the run's).", flag_values=fv)
    try:
        fv(list(argv if argv is not None else sys.argv))
        l2_grid = tuple(float(x) for x in _list(fv.l2_grid))
    except (flags.Error, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not fv.workdir or not fv.out:
        print("error: --workdir and --out are required", file=sys.stderr)
        return 2
    config = JudgeConfig(
        workdirs=tuple(fv.workdir),
        out=fv.out,
        policy=fv.policy,
        labels=_list(fv.labels),
        sources=_list(fv.sources),
        max_episodes=fv.max_episodes,
        held_out=fv.held_out,
        seed=fv.seed,
        max_len=fv.max_len,
        bucket=fv.bucket,
        batch=fv.batch,
        steps=fv.steps,
        learning_rate=fv.learning_rate,
        l2_grid=l2_grid,
        folds=fv.folds,
        min_confidence=fv.min_confidence,
        ood_factor=fv.ood_factor,
        max_turns=fv.max_turns,
    )
    try:
        summary = train(config, log=lambda line: print(line, file=sys.stderr, flush=True))
    except JudgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(os.path.join(config.out, REPORT_MD))
    return 0 if summary["trained"] else 1


if __name__ == "__main__":
    sys.exit(main())
