"""Multi-turn agent rollouts: the sampler, the product harness and the sandbox, many at once.

    runner = RolloutRunner(sampler, chat, pool, RolloutConfig(group_size=8))
    episodes = runner.run(tasks, seed=step)        # len(tasks) * group_size episodes, graded

Choices:

1. **One loop drives every episode.** The sampler's sessions advance together
   (continuous batching over its slots); a finished turn's tool calls run on a
   thread per episode against the worker pool (``cursor_rl.env.pool``), so the
   sampler keeps decoding other episodes while tools and tests run. Grading runs
   on its own threads once an episode ends.
2. **An episode ends** when the model calls ``submit``, ends a turn without a tool
   call, reaches ``max_turns`` assistant turns, or has generated ``token_budget``
   tokens (a turn's ``max_new_tokens`` is capped by what is left of the budget).
   A worker lost by the pool ends it as ``lost`` (dropped from training).
3. **Token level, never re-tokenised**: the harness appends the sampler's tokens
   and log-probs to the episode's trajectory; what the sampler is given next is
   exactly the trajectory's new tokens (tool turns, the next assistant header).
4. **Self-summarisation**: when a segment's context reaches
   ``summary_threshold`` tokens, the model gets a fixed instruction and writes a
   summary (trained: it is the model's own output); a new segment then starts from
   [system, task, that summary] with the summary as untrained context, in a fresh
   sampler session. Every segment is its own training sequence; all share the
   episode's final reward.
5. **Sampling seeds** are (rollout seed, task index, sample index): reproducible,
   and independent of how the scheduler interleaves episodes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from cursor_rl.chat import protocol
from cursor_rl.chat.episodes import Episode
from cursor_rl.env import grader, harness, ray_pool, tools
from cursor_rl.sampler import SamplingParams
from cursor_rl.tasks import grading, records

SUMMARY_INSTRUCTION = (
    "Your context is nearly full. Summarise your progress so far: what the task is, what "
    "you found, what you changed and what is left to do. Reply with the summary only."
)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 8
    max_turns: int = 8
    max_new_tokens: int = 256  # per assistant turn
    token_budget: int = 2048  # generated tokens per episode, summaries included
    temperature: float = 1.0
    top_p: float = 1.0
    summary_threshold: int = 0  # context tokens that trigger a self-summary (0: never)
    max_summaries: int = 2
    summary_max_tokens: int = 256
    grade_workers: int = 2
    system_prompt: str = harness.DEFAULT_SYSTEM_PROMPT
    tools_style: str = "json"  # how the system prompt lists the tools (protocol.tools_prompt)


def grade_summary(result: grader.GradeResult) -> dict[str, Any]:
    """The JSON-friendly part of a grade that rewards, metrics and reports use."""
    f2p = result.fail_to_pass
    p2p = result.pass_to_pass
    return {
        "resolved": bool(result.resolved),
        "fail_to_pass_passed": sum(1 for v in f2p.values() if v),
        "fail_to_pass_total": len(f2p),
        "pass_to_pass_broken": sum(1 for v in p2p.values() if not v),
        "flags": sorted(result.flags),
    }


class _Live:
    """One running episode. Only one thread touches it at a time: the driver between
    turns, a tool thread while its turn's calls run."""

    def __init__(
        self, episode: Episode, agent: harness.AgentEpisode, spec, workspace, tool_ep, seed
    ):
        self.episode = episode
        self.agent = agent
        self.spec = spec
        self.workspace = workspace
        self.tool_ep = tool_ep
        self.seed = seed
        self.session = None
        self.session_len = 0  # tokens the sampler session holds
        self.session_window = -1  # the trajectory segment the session holds
        self.summarising = False
        self.started = time.time()


class RolloutRunner:
    """Runs groups of episodes for a batch of tasks (see the module docstring).

    Args:
      sampler: a ``cursor_rl.sampler.Sampler`` with the policy loaded.
      chat: the chat format (the run's tokenizer).
      pool: a ``cursor_rl.env.pool.ToolPool`` running the sandboxes.
      config: rollout settings.
      dataset_dir: the task dataset's directory (for ``dir`` snapshots).
    """

    def __init__(
        self, sampler, chat: protocol.ChatFormat, pool, config: RolloutConfig, *, dataset_dir=""
    ):
        self.sampler = sampler
        self.chat = chat
        self.pool = pool
        self.config = config
        self.dataset_dir = dataset_dir
        self.specs = tools.TOOL_SPECS

    def run(
        self, tasks: Sequence[records.TaskRecord], seed: int = 0, group_size: int | None = None
    ) -> list[Episode]:
        """Runs ``group_size`` episodes per task and grades them; returns all of them.

        Args:
          tasks: the batch; episodes of task ``i`` carry ``task_index=i``.
          seed: the rollout seed (with task and sample index it keys sampling).
          group_size: episodes per task (default ``config.group_size``).
        """
        group_size = group_size or self.config.group_size
        root = tempfile.mkdtemp(prefix="rollouts_")
        lives: list[_Live] = []
        finished: list[Episode] = []
        tool_threads = concurrent.futures.ThreadPoolExecutor(max(8, len(tasks) * group_size))
        grade_threads = concurrent.futures.ThreadPoolExecutor(self.config.grade_workers)
        grading_jobs = []
        try:
            for i, task in enumerate(tasks):
                for g in range(group_size):
                    episode_seed = (seed * 100_003 + i) * 1_009 + g
                    lives.append(
                        self._start(task, i, g, episode_seed, os.path.join(root, f"{i}-{g}"))
                    )
            by_session: dict[int, _Live] = {}
            for live in lives:
                self._queue_turn(live)
                by_session[live.session.id] = live
            running: dict[concurrent.futures.Future, _Live] = {}
            open_lives = len(lives)
            while open_lives:
                for session, completion in self.sampler.step():
                    live = by_session[session.id]
                    running[tool_threads.submit(self._take_turn, live, completion)] = live
                done = [f for f in running if f.done()]
                if not done and not self.sampler.busy and running:
                    done, _ = concurrent.futures.wait(
                        running, return_when=concurrent.futures.FIRST_COMPLETED
                    )
                for future in done:
                    live = running.pop(future)
                    reason = future.result()
                    if reason is None:
                        old = live.session.id
                        self._queue_turn(live)
                        if live.session.id != old:
                            by_session.pop(old, None)
                            by_session[live.session.id] = live
                        continue
                    open_lives -= 1
                    self._end(live, reason)
                    grading_jobs.append(grade_threads.submit(self._grade, live))
            for job in grading_jobs:
                finished.append(job.result())
        finally:
            tool_threads.shutdown(wait=True)
            grade_threads.shutdown(wait=True)
            shutil.rmtree(root, ignore_errors=True)
        finished.sort(key=lambda e: (e.task_index, e.sample))
        return finished

    # ---- episode lifecycle -------------------------------------------------------

    def _start(self, task, task_index: int, sample: int, seed: int, root: str) -> _Live:
        spec = grading.prepare_task(task, os.path.join(root, "task"), dataset_dir=self.dataset_dir)
        workspace = os.path.join(root, "workspace")
        shutil.copytree(spec.pristine_repo, workspace)
        tool_ep = self.pool.open_episode(workspace, **grading.sandbox_kwargs(task))
        agent = harness.AgentEpisode(
            self.chat,
            self.specs,
            tool_ep.execute,
            system=self.config.system_prompt,
            task=task.prompt,
            max_turns=self.config.max_turns,
            tools_style=self.config.tools_style,
        )
        episode = Episode(
            task_id=task.task_id,
            category=task.category,
            task_index=task_index,
            sample=sample,
            trajectory=agent.trajectory,
            finish_reason="",
        )
        return _Live(episode, agent, spec, workspace, tool_ep, seed)

    def _queue_turn(self, live: _Live) -> None:
        """Gives the sampler the trajectory's new tokens and queues the next turn (choice 3)."""
        context = live.agent.prompt()
        window = len(live.episode.trajectory.segment_starts)
        if live.session is None or live.session_window != window:
            if live.session is not None:
                self.sampler.close(live.session)
            live.session = self.sampler.open(context, seed=live.seed)
            live.session_window = window
        else:
            self.sampler.append(live.session, context[live.session_len :])
        live.session_len = len(context)
        if live.summarising:
            budget = self.config.summary_max_tokens
        else:
            budget = self.config.max_new_tokens
        budget = min(budget, self.config.token_budget - live.episode.generated_tokens)
        params = SamplingParams(
            max_new_tokens=max(1, budget),
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            stop_token_ids=tuple(self.chat.stop_token_ids),
            seed=live.seed,
        )
        self.sampler.submit(live.session, params)

    def _take_turn(self, live: _Live, completion) -> str | None:
        """Records one sampled turn and runs its tools; returns a finish reason or None."""
        ep = live.episode
        ep.generated_tokens += len(completion.tokens)
        live.session_len += len(completion.tokens)
        if completion.policy_version is not None:
            ep.turn_versions.append(int(completion.policy_version))
        if completion.finish_reason == "context":
            live.agent.record(completion.tokens, completion.logprobs)
            return "context"
        if live.summarising:
            summary = live.agent.record(completion.tokens, completion.logprobs)
            ep.summary_tokens.append(len(completion.tokens))
            live.summarising = False
            live.agent.restart_from_summary(summary)
        else:
            result = live.agent.step(completion.tokens, completion.logprobs)
            ep.tool_calls += len(result.parsed.calls)
            if live.tool_ep.lost:
                return "lost"
            if live.agent.submitted:
                return "submitted"
            if result.done:
                return "answered" if not result.parsed.calls else "turn_limit"
        if ep.generated_tokens >= self.config.token_budget:
            return "token_budget"
        if self._needs_summary(live):
            live.agent.add_user_message(SUMMARY_INSTRUCTION)
            live.summarising = True
        return None

    def _needs_summary(self, live: _Live) -> bool:
        c = self.config
        context = len(live.episode.trajectory.current_context())
        return (
            c.summary_threshold > 0
            and len(live.episode.summary_tokens) < c.max_summaries
            and context >= c.summary_threshold
        )

    def _end(self, live: _Live, reason: str) -> None:
        live.episode.finish_reason = reason
        self.sampler.close(live.session)
        live.session = None

    def _grade(self, live: _Live) -> Episode:
        """Leaves the sandbox (syncing the workspace back) and grades it: on the pool's
        workers when the pool grades (the Ray fleet), else here. An episode whose worker
        was lost, even while leaving the sandbox, is ``lost``, not graded: its workspace
        may not hold the agent's work, and a zero reward would train on it."""
        ep = live.episode
        try:
            live.tool_ep.close()
            if live.tool_ep.lost:
                ep.finish_reason = "lost"
            start = time.time()
            if ep.finish_reason != "lost":
                grade = getattr(self.pool, "grade", grader.grade)
                try:
                    ep.grade = grade_summary(grade(live.spec, live.workspace))
                except ray_pool.WorkerLostError:
                    ep.finish_reason = "lost"
            ep.seconds["grade"] = time.time() - start
        finally:
            ep.seconds["episode"] = time.time() - live.started
        return ep
