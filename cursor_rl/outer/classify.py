"""Weak areas: each negative feedback event gets a category and a difficulty.

    tasks = task_index(["RUN/tasks/bench", "RUN/tasks/train"])   # resolves snapshot task ids
    judged = classify_events(feedback.negative, tasks=tasks, judge=load_judge("rules"))
    judged.classifications[0].category, .difficulty, .evidence

Categories (``CATEGORIES``) are of two kinds. *Task kinds* say what sort of work the
user asked for, and map to the task factory's categories (``KIND_OF_CATEGORY``):
``feature`` (feature), ``bug_fix`` (bug), ``refactor`` (refactor). *Behaviours* say how
the agent went wrong whatever the task: ``tool_misuse`` (malformed or unknown tool
calls, the same edit again and again), ``test_handling`` (edited the tests,
submitted without running them), ``incomplete`` (stopped with the work undone),
``style`` (the change works but reads badly). ``other``: nothing said which.

Choices:

1. **Rules first, in a fixed order**, the first that applies decides, and every rule
   that matched is kept as evidence: (a) behaviour words in the comment (the user
   said what bothered them); (b) the textual-feedback detectors
   (``cursor_rl.rl.feedback.DETECTORS``, run unchanged on the event's view) mapped
   by ``DETECTOR_CATEGORY``, the earliest point winning as in ``find_points``
   (where the episode first went wrong); (c) task-kind words in the comment;
   (d) the event's task kind; (e) ``other``. Behaviours come before kinds because
   they name the failure; a complaint about a bug fix whose trajectory edited the
   tests is a test-handling weakness on a bug-fix task.
2. **Task kind** (what generators a weak area maps to): the kind of the snapshot's
   task when a dataset the command was given holds it (its record's ``category``
   and ``generator``), else kind words in the user's request (what was asked for),
   else in the comment (which often says "fix" of whatever went wrong).
3. **Difficulty** (``easy`` / ``medium`` / ``hard``): words in the comment ("should
   have been simple", "complex", "across files"), else the snapshot task's measured
   solve rate (``difficulty.solve_rate``: >= 0.5 easy, >= 0.1 medium) or its
   reference patch size (``patch_lines`` <= 4 easy, <= 12 medium), else the
   trajectory's assistant turns (<= 4 easy, <= 10 medium). Rules of thumb, said in
   the evidence so a reader can disagree.
4. **A judge replaces the rules' category where configured.** A judge is any
   callable ``(FeedbackEvent) -> category | None`` (``Judge``): registered by name
   (``register_judge``; ``rules`` is the default and has no judge), named as
   ``package.module:attribute``, or made by a factory named with its argument,
   ``package.module:factory=ARGUMENT`` (a derived judge model:
   ``cursor_rl.outer.judge:category_judge=DIR``). ``None`` abstains (the rules
   stand); an answer outside ``CATEGORIES`` or an exception is counted
   (``judge_errors``) and the rules stand, so a flaky judge model never loses an
   event. The difficulty stays the rules'.
5. **Counted, never silent**: a detector that raises (as in ``rl.feedback``, choice 6)
   is counted in ``detector_errors`` and named in the event's evidence; a snapshot
   task id no dataset holds is counted in ``unresolved_tasks``; a snapshot whose
   ``tree_sha256`` differs from its task's is counted in ``snapshot_mismatches``.

Pure Python, no JAX.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from cursor_rl.outer.ingest import FeedbackEvent
from cursor_rl.rl import feedback
from cursor_rl.tasks import records

CATEGORIES = (
    "feature",
    "bug_fix",
    "refactor",
    "tool_misuse",
    "test_handling",
    "incomplete",
    "style",
    "other",
)
KIND_OF_CATEGORY = {"feature": "feature", "bug_fix": "bug", "refactor": "refactor"}
CATEGORY_OF_KIND = {kind: category for category, kind in KIND_OF_CATEGORY.items()}
BEHAVIOURS = ("tool_misuse", "test_handling", "incomplete", "style")  # tie order too
DIFFICULTIES = ("easy", "medium", "hard")

# rl.feedback detector -> the behaviour it shows.
DETECTOR_CATEGORY = {
    "malformed_tool_call": "tool_misuse",
    "repeated_edit": "tool_misuse",
    "submitted_without_tests": "test_handling",
    "edited_tests": "test_handling",
    "gave_up_early": "incomplete",
}

_NEG = r"(?:didn'?t|did not|never|without|not)"
# Comment words per category (case-insensitive regular expressions, matched anywhere).
COMMENT_RULES: dict[str, tuple[str, ...]] = {
    "tool_misuse": (
        r"\btool[- ]?calls?\b",
        r"\bmalformed\b",
        r"\binvalid (?:json|call|arguments?)\b",
        r"\bunknown tool\b",
        r"\bwrong tool\b",
        r"\bsame (?:edit|command|call)\b",
        r"\b(?:loop(?:ed|ing|s)?|in circles)\b",
        r"\bkept (?:calling|editing|running|re-?reading)\b",
    ),
    "test_handling": (
        r"\b(?:edit|chang|modif|delet|rewr|weaken|touch)\w* (?:the |my |our )?(?:unit )?tests?\b",
        rf"\b{_NEG} (?:even )?(?:run|running|ran)(?: the| any)? tests?\b",
        r"\btests? (?:were|was) (?:changed|edited|deleted|skipped|disabled)\b",
        r"\b(?:skip|disabl)\w* (?:the )?tests?\b",
    ),
    "incomplete": (
        r"\bgave up\b",
        r"\bgive up\b",
        r"\bstopped\b",
        r"\bincomplete\b",
        r"\bunfinished\b",
        r"\bhalf[- ]?(?:done|finished)\b",
        rf"\b{_NEG} finish\w*\b",
        r"\bleft (?:a )?todo\b",
    ),
    "style": (
        r"\bstyle\b",
        r"\bformatt?\w*\b",
        r"\blint\w*\b",
        r"\bnaming\b",
        r"\bpep ?8\b",
        r"\bverbose\b",
        r"\bunreadable\b",
        r"\bdocstrings?\b",
        r"\bindentation\b",
        r"\bugly\b",
    ),
    "refactor": (
        r"\brefactor\w*\b",
        r"\brenam\w*\b",
        r"\bextract\w*\b",
        r"\bclean(?:ed|ing)?[- ]?up\b",
        r"\brestructur\w*\b",
        r"\bduplicat\w*\b",
    ),
    "bug_fix": (
        r"\bbugs?\b",
        r"\bfix\w*\b",
        r"\bwrong (?:result|answer|output|value)s?\b",
        r"\bincorrect\w*\b",
        r"\bcrash\w*\b",
        r"\bexceptions?\b",
        r"\boff[- ]by[- ]one\b",
        r"\bregressions?\b",
        r"\bstill fail\w*\b",
    ),
    "feature": (
        r"\bimplement\w*\b",
        r"\bfeatures?\b",
        r"\bnot implemented\b",
        r"\bnotimplementederror\b",
        r"\bsupport for\b",
        r"\badd(?:ed|ing)? (?:a |an |the )?(?:new )?(?:function|method|class|option|flag)\b",
        r"\bmissing (?:function|method|feature|option)\b",
    ),
}
DIFFICULTY_RULES: dict[str, tuple[str, ...]] = {
    "easy": (
        r"\b(?:simple|trivial|easy|basic|obvious)\b",
        r"\bone[- ]line\w*\b",
    ),
    "hard": (
        r"\b(?:complex|complicated|difficult|hard|tricky|subtle)\b",
        r"\bacross (?:several |many |multiple )?(?:files|modules)\b",
        r"\bmany files\b",
        r"\blarge (?:change|diff|refactor\w*)\b",
    ),
}
_COMPILED = {
    name: tuple(re.compile(p, re.IGNORECASE) for p in patterns)
    for name, patterns in {**COMMENT_RULES, **DIFFICULTY_RULES}.items()
}

Judge = Callable[[FeedbackEvent], str | None]
_JUDGES: dict[str, Callable[[], Judge | None]] = {"rules": lambda: None}


def register_judge(name: str) -> Callable[[Callable[[], Judge | None]], Callable[[], Judge]]:
    """Decorator registering a judge factory under ``name`` (choice 4)."""

    def wrap(factory):
        if name in _JUDGES:
            raise ValueError(f"judge {name!r} is registered twice")
        _JUDGES[name] = factory
        return factory

    return wrap


def judge_names() -> list[str]:
    return sorted(_JUDGES)


def load_judge(spec: str) -> Judge | None:
    """The judge named by ``spec``: a registered name (``rules``: none, the rules
    decide), ``package.module:attribute`` (a callable ``(event) -> category | None``)
    or ``package.module:factory=ARGUMENT`` (``factory(ARGUMENT)`` makes the judge,
    e.g. ``cursor_rl.outer.judge:category_judge=DIR`` loads a derived judge).

    Raises:
      ValueError: an unknown name, an attribute that is missing or not callable, or
        a factory that raised or made no callable.
    """
    spec = spec or "rules"
    if spec in _JUDGES:
        return _JUDGES[spec]()
    module_name, sep, attribute = spec.partition(":")
    attribute, has_argument, argument = attribute.partition("=")
    if not sep or not module_name or not attribute:
        raise ValueError(
            f"unknown judge {spec!r}: one of {judge_names()}, package.module:attribute or "
            "package.module:factory=ARGUMENT"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"judge {spec!r}: cannot import {module_name}: {e}") from e
    judge = getattr(module, attribute, None)
    if not callable(judge):
        raise ValueError(f"judge {spec!r}: {module_name} has no callable {attribute!r}")
    if has_argument:
        try:
            judge = judge(argument)
        except Exception as e:  # whatever the factory raised, said as a usage error
            raise ValueError(f"judge {spec!r}: {attribute}({argument!r}) failed: {e}") from e
        if not callable(judge):
            raise ValueError(f"judge {spec!r}: {attribute}({argument!r}) made no callable")
    return judge


# ---- the snapshot's task ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TaskInfo:
    """What classification and ranking need of a task record."""

    task_id: str
    split: str
    category: str  # feature | bug | refactor
    generator: str
    tree_sha256: str
    difficulty: Mapping[str, float]

    @classmethod
    def of(cls, record: records.TaskRecord) -> TaskInfo:
        return cls(
            record.task_id,
            record.split,
            record.category,
            record.generator,
            record.repo.tree_sha256,
            dict(record.difficulty),
        )


def task_index(datasets: Iterable[str]) -> dict[str, TaskInfo]:
    """Task id -> ``TaskInfo`` over dataset directories (or ``tasks.jsonl`` files).

    Raises:
      records.TaskRecordError: a dataset is malformed (named by file and line).
    """
    index: dict[str, TaskInfo] = {}
    for path in datasets:
        for record in records.read_tasks(path):
            index.setdefault(record.task_id, TaskInfo.of(record))
    return index


# ---- classification ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Classification:
    """One negative event's weak area.

    Attributes:
      event_id: the event.
      category: its weak-area category (``CATEGORIES``).
      difficulty: ``easy``, ``medium`` or ``hard``.
      task_kind: ``feature``, ``bug``, ``refactor``, or ``""`` when unknown.
      generator: the snapshot task's generator when known, else ``""``.
      detectors: the detectors that fired, earliest point first.
      evidence: why, one line per rule that matched (the deciding one first).
      decided_by: ``rules`` or ``judge``.
      rule_category: what the rules said (differs from ``category`` when a judge
        overrode them).
    """

    event_id: str
    category: str
    difficulty: str
    task_kind: str
    generator: str
    detectors: tuple[str, ...]
    evidence: tuple[str, ...]
    decided_by: str
    rule_category: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Classified:
    """Classifications of a set of events, and the counts of choice 5."""

    classifications: list[Classification]
    judged: int = 0
    judge_abstained: int = 0
    judge_errors: list[str] = dataclasses.field(default_factory=list)
    detector_errors: list[str] = dataclasses.field(default_factory=list)
    unresolved_tasks: list[str] = dataclasses.field(default_factory=list)
    snapshot_mismatches: list[str] = dataclasses.field(default_factory=list)

    def stats(self) -> dict[str, Any]:
        return {
            "classified": len(self.classifications),
            "by_category": dict(collections.Counter(c.category for c in self.classifications)),
            "judged": self.judged,
            "judge_abstained": self.judge_abstained,
            "judge_errors": list(self.judge_errors),
            "detector_errors": list(self.detector_errors),
            "unresolved_tasks": list(self.unresolved_tasks),
            "snapshot_mismatches": list(self.snapshot_mismatches),
        }


def comment_matches(text: str, categories: Sequence[str]) -> dict[str, list[str]]:
    """For each of ``categories`` (or difficulty levels), the words of ``text`` its
    rules matched; only categories with a match are present."""
    found: dict[str, list[str]] = {}
    for name in categories:
        hits = [m.group(0) for pattern in _COMPILED[name] if (m := pattern.search(text))]
        if hits:
            found[name] = hits
    return found


def _best(matches: Mapping[str, list[str]], order: Sequence[str]) -> str | None:
    """The category with the most matched rules; ties go to the first in ``order``."""
    if not matches:
        return None
    return max(order, key=lambda name: (len(matches.get(name, ())), -order.index(name)))


def run_detectors(
    event: FeedbackEvent,
) -> tuple[list[tuple[int, str, str]], list[tuple[str, str]]]:
    """The detectors' hits on the event's view, earliest first, as ``(position, name,
    description)``, and ``(name, error)`` of each detector that raised (choice 5)."""
    hits, errors = [], []
    turn_of = {turn.start: i + 1 for i, turn in enumerate(event.view.turns)}
    for name, detector in feedback.DETECTORS.items():
        try:
            hit = detector(event.view)
        except Exception as e:  # choice 5: counted, the other detectors still run
            errors.append((name, repr(e)))
            continue
        if hit is None:
            continue
        position, facts = hit
        where = f"assistant turn {turn_of.get(position, '?')}"
        detail = ", ".join(f"{k}={v!r}" for k, v in sorted(facts.items()) if v)
        hits.append((int(position), name, f"{where}" + (f" ({detail})" if detail else "")))
    hits.sort(key=lambda h: (h[0], list(feedback.DETECTORS).index(h[1])))
    return hits, errors


def classify_event(
    event: FeedbackEvent, tasks: Mapping[str, TaskInfo] | None = None
) -> tuple[Classification, list[tuple[str, str]]]:
    """The rules' classification of one event (choices 1-3), and detector errors."""
    tasks = tasks or {}
    task = tasks.get(event.snapshot.task_id) if event.snapshot.task_id else None
    evidence: list[str] = []
    comment = comment_matches(event.comment, CATEGORIES[:-1])
    request = comment_matches(event.request, list(KIND_OF_CATEGORY))
    hits, errors = run_detectors(event)

    behaviour = {k: v for k, v in comment.items() if k in BEHAVIOURS}
    kinds = {k: v for k, v in comment.items() if k in KIND_OF_CATEGORY}
    # Choice 2: the task kind.
    if task is not None:
        task_kind = task.category
        kind_why = f"snapshot task {task.task_id}: {task.category} ({task.generator})"
    elif request:
        task_kind = KIND_OF_CATEGORY[_best(request, list(KIND_OF_CATEGORY))]
        kind_why = f"request says {request[CATEGORY_OF_KIND[task_kind]][0]!r}"
    elif kinds:
        task_kind = KIND_OF_CATEGORY[_best(kinds, list(KIND_OF_CATEGORY))]
        kind_why = f"comment says {kinds[CATEGORY_OF_KIND[task_kind]][0]!r}"
    else:
        task_kind, kind_why = "", ""
    # Choice 1: the category.
    detector_lines = [
        f"trajectory: {name} at {where} -> {DETECTOR_CATEGORY.get(name, 'other')}"
        for _, name, where in hits
    ]
    if behaviour:
        category = _best(behaviour, BEHAVIOURS)
        evidence.append(f"comment: {', '.join(map(repr, behaviour[category]))} -> {category}")
        evidence += detector_lines
    elif hits:
        category = DETECTOR_CATEGORY.get(hits[0][1], "other")
        evidence += detector_lines
    elif kinds:
        category = _best(kinds, list(KIND_OF_CATEGORY))
        evidence.append(f"comment: {', '.join(map(repr, kinds[category]))} -> {category}")
    elif task_kind:
        category = CATEGORY_OF_KIND[task_kind]
        evidence.append(f"task kind {task_kind} ({kind_why}) -> {category}")
        kind_why = ""  # said already
    else:
        category = "other"
        evidence.append("no rule matched -> other")
    for name, words in comment.items():
        if name != category:
            evidence.append(f"comment also: {', '.join(map(repr, words))} ({name})")
    if kind_why:
        evidence.append(f"task kind {task_kind}: {kind_why}")
    difficulty, why = _difficulty(event, task)
    evidence.append(f"difficulty {difficulty}: {why}")
    evidence += [f"detector {name} raised {error} (counted)" for name, error in errors]
    return (
        Classification(
            event_id=event.event_id,
            category=category,
            difficulty=difficulty,
            task_kind=task_kind,
            generator=task.generator if task is not None else "",
            detectors=tuple(name for _, name, _ in hits),
            evidence=tuple(evidence),
            decided_by="rules",
            rule_category=category,
        ),
        errors,
    )


def _difficulty(event: FeedbackEvent, task: TaskInfo | None) -> tuple[str, str]:
    """Choice 3."""
    words = comment_matches(event.comment, ["easy", "hard"])
    if words:
        level = _best(words, ["hard", "easy"])
        return level, f"comment says {words[level][0]!r}"
    if task is not None and "solve_rate" in task.difficulty:
        rate = task.difficulty["solve_rate"]
        level = "easy" if rate >= 0.5 else "medium" if rate >= 0.1 else "hard"
        return level, f"task solve rate {rate:.2f}"
    if task is not None and "patch_lines" in task.difficulty:
        lines = task.difficulty["patch_lines"]
        level = "easy" if lines <= 4 else "medium" if lines <= 12 else "hard"
        return level, f"task patch of {lines:g} lines"
    turns = event.assistant_turns
    level = "easy" if turns <= 4 else "medium" if turns <= 10 else "hard"
    return level, f"{turns} assistant turns"


def classify_events(
    events: Iterable[FeedbackEvent],
    *,
    tasks: Mapping[str, TaskInfo] | None = None,
    judge: Judge | None = None,
) -> Classified:
    """Classifies each event (pass the negative ones): rules, then the judge if any.

    Args:
      events: the events to classify.
      tasks: known tasks by id (``task_index``), to resolve snapshot task ids.
      judge: a judge (choice 4), or None for the rules alone.

    Returns:
      The classifications in event order, with the counts of choice 5.
    """
    tasks = tasks or {}
    out = Classified([])
    for event in events:
        rules, errors = classify_event(event, tasks)
        out.detector_errors += [f"{event.event_id}: {name} raised {e}" for name, e in errors]
        snap = event.snapshot
        if snap.task_id and snap.task_id not in tasks:
            out.unresolved_tasks.append(event.event_id)
        elif (
            snap.task_id
            and snap.tree_sha256
            and tasks[snap.task_id].tree_sha256 != (snap.tree_sha256)
        ):
            out.snapshot_mismatches.append(event.event_id)
        if judge is not None:
            try:
                verdict = judge(event)
            except Exception as e:  # choice 4: a failing judge never loses an event
                verdict = None
                out.judge_errors.append(f"{event.event_id}: the judge raised {e!r}")
            else:
                if verdict is None:
                    out.judge_abstained += 1
                elif verdict not in CATEGORIES:
                    out.judge_errors.append(
                        f"{event.event_id}: the judge answered {verdict!r}, not a category"
                    )
                    verdict = None
            if verdict is not None:
                out.judged += 1
                rules = dataclasses.replace(
                    rules,
                    category=verdict,
                    decided_by="judge",
                    evidence=(f"judge -> {verdict} (rules: {rules.category})", *rules.evidence),
                )
        out.classifications.append(rules)
    return out
