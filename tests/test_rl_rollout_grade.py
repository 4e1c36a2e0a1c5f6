"""RolloutRunner's grading step: an episode whose worker was lost, even while leaving
the sandbox, ends ``lost`` and is never graded (a zero reward would train on a
workspace without the agent's work); a pool that grades (the Ray fleet) grades on its
workers, and a pool that lost grading's worker makes the episode ``lost`` too."""

import time
import types

from cursor_rl.env import grader, ray_pool
from cursor_rl.eval.testing import graded_episode
from cursor_rl.rl import rollout


def _result(resolved):
    return grader.GradeResult(
        tests={}, fail_to_pass={"t": resolved}, pass_to_pass={}, resolved=resolved,
        changed_paths=(), discarded_paths=(), flags=(), timings={}, log="",
    )  # fmt: skip


class _ToolEpisode:
    def __init__(self, lost_on_close=False):
        self.lost = False
        self.lost_on_close = lost_on_close

    def close(self):
        self.lost = self.lost or self.lost_on_close


class _GradingPool:
    def __init__(self, outcome):
        self.outcome = outcome
        self.graded = []

    def grade(self, spec, workspace):
        self.graded.append(workspace)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def _grade(pool, tool_ep, monkeypatch, local=None):
    local_calls = []

    def local_grade(spec, workspace):
        local_calls.append(workspace)
        return local

    monkeypatch.setattr(grader, "grade", local_grade)
    runner = rollout.RolloutRunner.__new__(rollout.RolloutRunner)
    runner.pool = pool
    episode = graded_episode("t1", "bug", False, finish="submitted")
    episode.grade = None
    live = types.SimpleNamespace(
        episode=episode, tool_ep=tool_ep, spec=object(), workspace="/ws", started=time.time()
    )
    return runner._grade(live), local_calls


def test_an_episode_lost_while_leaving_the_sandbox_is_lost_and_not_graded(monkeypatch):
    episode, local_calls = _grade(
        object(), _ToolEpisode(lost_on_close=True), monkeypatch, _result(True)
    )
    assert episode.finish_reason == "lost" and episode.grade is None and local_calls == []


def test_a_pool_without_grade_grades_here(monkeypatch):
    episode, local_calls = _grade(object(), _ToolEpisode(), monkeypatch, _result(True))
    assert local_calls == ["/ws"] and episode.grade["resolved"] is True
    assert episode.finish_reason == "submitted"


def test_a_grading_pool_grades_on_its_workers_and_a_lost_worker_loses_the_episode(monkeypatch):
    pool = _GradingPool(_result(True))
    episode, local_calls = _grade(pool, _ToolEpisode(), monkeypatch, _result(False))
    assert pool.graded == ["/ws"] and local_calls == [] and episode.grade["resolved"] is True
    lost = _GradingPool(ray_pool.WorkerLostError("grading's worker died 3 times"))
    episode, _ = _grade(lost, _ToolEpisode(), monkeypatch)
    assert episode.finish_reason == "lost" and episode.grade is None
