"""Test fixtures for eval code: graded episodes without a sampler, a sandbox or a grader.

``graded_episode`` builds the ``cursor_rl.chat.episodes.Episode`` that
``RolloutRunner.run`` would return after grading, with chosen outcome and lengths,
so metrics, the benchmark runner and reports can be tested in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from cursor_rl.chat import protocol
from cursor_rl.chat.episodes import Episode


def graded_episode(
    task_id: str,
    category: str,
    resolved: bool,
    *,
    sample: int = 0,
    fail_to_pass: tuple[int, int] = (0, 0),
    tokens: int = 100,
    calls: int = 2,
    segments: int = 1,
    finish: str = "submitted",
    versions: Sequence[int] = (),
) -> Episode:
    """A graded episode (a ``lost`` one carries no grade, as in rollouts).

    Args:
      task_id: the task (samples of a task share it).
      category: feature, bug or refactor.
      resolved: whether every hidden test passed.
      sample: the index within the task's group.
      fail_to_pass: (passed, total) FAIL_TO_PASS tests, for partial credit.
      tokens: generated tokens.
      calls: tool calls.
      segments: context windows (more than one after self-summarisation).
      finish: the finish reason.
      versions: the policy version of each sampled turn.
    """
    trajectory = protocol.Trajectory()
    # Segment boundaries are all that eval reads of a trajectory; no tokens needed.
    trajectory.segment_starts.extend(range(segments))
    grade = {}
    if finish != "lost":
        grade = {
            "resolved": resolved,
            "fail_to_pass_passed": fail_to_pass[0],
            "fail_to_pass_total": fail_to_pass[1],
            "pass_to_pass_broken": 0,
            "flags": [],
        }
    return Episode(
        task_id=task_id,
        category=category,
        task_index=0,
        sample=sample,
        trajectory=trajectory,
        finish_reason=finish,
        tool_calls=calls,
        generated_tokens=tokens,
        turn_versions=list(versions),
        grade=grade,
    )
