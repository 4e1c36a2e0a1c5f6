"""``Sampler``: generation for eval, chat and RL rollouts, with policy-version tracking.

One-shot generation::

    sampler = Sampler.from_checkpoint(path, mesh=mesh, num_slots=64)
    completions = sampler.generate(prompts, SamplingParams(max_new_tokens=512, temperature=1.0))

Multi-turn sessions (RL episodes). A session keeps its cache between turns, so a
tool result is appended and decoding continues without recomputing the prefix.
Many sessions advance together: ``submit`` queues a turn, each ``step`` runs one
scheduling round (admit, prefill, one compiled decode call over every slot) and
returns the turns that finished; a paused session holds its pages, not a slot::

    s = sampler.open(prompt_ids, seed=episode_index)
    sampler.submit(s, params)
    while episodes_live:
        for session, completion in sampler.step():     # one round: one decode call
            ...run the tool for this session (e.g. in a thread pool)...
        for session, result_ids in tool_results_ready():
            sampler.append(session, result_ids)
            sampler.submit(session, params)
    sampler.close(s)

``advance(sessions, params)`` is the blocking form (submit all, step until all are
done). ``Completion.policy_version`` is the weight version that produced every
token of that turn: weights change only between turns (``set_params`` refuses
while a turn is in progress; a watched directory's new checkpoint is swapped in
once the running turns have drained, admitting no new turns meanwhile). With
``refresh_cache_on_swap`` (default) cached prefixes of paused sessions are
recomputed under the new weights at their next turn, so a turn's log-probs are
exactly the new policy's; without it the old-weight cache is reused (cheaper,
slightly off-policy).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from cursor_rl import checkpoints, partitioning
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.model import hf, hf_stream
from cursor_rl.model.config import ModelConfig
from cursor_rl.sampler import weights
from cursor_rl.sampler.engine import Engine
from cursor_rl.sampler.sampling import Completion, SamplingParams
from cursor_rl.sampler.scheduler import Scheduler, Session


class Sampler:
    """Batched, multi-turn generation on the sampler's own mesh (see module docstring).

    Args:
      config: the model config (shapes must match the weights loaded).
      variables: initial weights (version 0), or None to load later.
      mesh: the sampler's mesh (any shape; need not be the trainer's); None for
        the default device.
      rules: logical-axis rules on that mesh.
      tokenizer: needed for stop strings only.
      num_slots: decode slots (concurrently running turns); divisible by the
        number of row shards (the product of the ``cache_batch`` mesh axes).
      max_seq_len: the longest sequence (prompt + everything generated and
        appended); default the model's ``max_position_embeddings``.
      page_size: tokens per cache page.
      num_pages: cache pages in all; default room for ``2 * num_slots`` sequences
        of ``max_seq_len``.
      decode_steps: decode steps per compiled call.
      prefill_chunk: longest prefill chunk per sequence and call.
      prefill_tokens: most padded tokens (rows x chunk length) per prefill call; more
        rows are split over several calls (0: no cap; engine.py note 5).
      max_programs: compiled prefill (and decode) shapes kept, least recently used
        dropped past it; 0 keeps all (engine.py note 6).
      refresh_cache_on_swap: recompute cached prefixes after a weight swap.
      scan_layers: the layout the sampler keeps the weights in (whatever layout
        they come in). Unscanned by default, as MaxText decodes: under a scan
        over layers each step slices every layer's weights out of the stacked
        arrays, which XLA:CPU does by copying them.
    """

    def __init__(
        self,
        config: ModelConfig,
        variables: Mapping[str, Any] | None = None,
        *,
        mesh: jax.sharding.Mesh | None = None,
        rules: partitioning.LogicalRules = partitioning.DEFAULT_RULES,
        tokenizer: Tokenizer | None = None,
        num_slots: int = 8,
        max_seq_len: int | None = None,
        page_size: int = 32,
        num_pages: int | None = None,
        decode_steps: int = 32,
        prefill_chunk: int = 256,
        prefill_tokens: int = 0,
        max_programs: int = 0,
        refresh_cache_on_swap: bool = True,
        scan_layers: bool = False,
    ):
        self.config = config = config.replace(scan_layers=scan_layers)
        self.tokenizer = tokenizer
        self.refresh_cache_on_swap = refresh_cache_on_swap
        self.engine = Engine(
            config,
            mesh=mesh,
            rules=rules,
            num_slots=num_slots,
            max_seq_len=max_seq_len,
            page_size=page_size,
            num_pages=num_pages,
            decode_steps=decode_steps,
            prefill_chunk=prefill_chunk,
            prefill_tokens=prefill_tokens,
            max_programs=max_programs,
        )
        self._scheduler = Scheduler(self.engine, tokenizer.decode if tokenizer else None)
        self._backlog: list[tuple[Session, Completion]] = []
        self._watch_dir: str | None = None
        self._watch_interval = 0.0
        self._last_poll = -float("inf")
        self._pending: tuple[int, str] | None = None
        if variables is not None:
            self.set_params(variables, version=0)

    # ---- construction from files ----------------------------------------------------

    @classmethod
    def from_checkpoint(cls, path: str, **kwargs) -> Sampler:
        """A sampler for a trainer checkpoint: its model config, tokenizer and weights.

        Args:
          path: a checkpoint step directory or a checkpoints directory (its latest).
          **kwargs: ``Sampler`` options (mesh, num_slots, ...).
        """
        metadata = checkpoints.read_metadata(path)
        config = checkpoints.model_config_from_metadata(metadata, path)
        if "tokenizer" in metadata and "tokenizer" not in kwargs:
            kwargs["tokenizer"] = Tokenizer.from_json(metadata["tokenizer"])
        sampler = cls(config, **kwargs)
        sampler.load_checkpoint(path)
        return sampler

    @classmethod
    def from_hf(cls, path: str, **kwargs) -> Sampler:
        """A sampler for a Hugging Face DeepSeek-V3 / Kimi-K2 directory (version 0),
        its weights streamed into the sampler's shardings (``load_hf``)."""
        plan = hf.plan_hf_import(path, scan_layers=kwargs.get("scan_layers", False))
        sampler = cls(plan.config, **kwargs)
        sampler.load_hf(path, version=0)
        return sampler

    # ---- weights ----------------------------------------------------------------

    @property
    def policy_version(self) -> int | None:
        """Version of the current weights (a checkpoint's step, or set_params' count)."""
        return self._scheduler.version

    def set_params(self, variables: Mapping[str, Any], version: int | None = None) -> None:
        """Swaps in new weights (only between turns).

        Arrays are placed in the sampler's shardings; in the colocated mode they
        come from the trainer on the same devices. Separate programs use
        ``load_checkpoint`` instead.

        Args:
          variables: ``{"params": ..., "router": ...}`` in the sampler's layout.
          version: the policy version; default the previous one plus one.
        """
        if self._scheduler.turns_in_progress():
            raise RuntimeError("set_params between turns: some are still running")
        if version is None:
            version = 0 if self.policy_version is None else self.policy_version + 1
        self.engine.set_variables(variables)
        if self.policy_version is not None and self.refresh_cache_on_swap:
            self._scheduler.invalidate_caches()
        self._scheduler.version = version

    def load_checkpoint(self, path: str, version: int | None = None) -> int:
        """Restores a trainer checkpoint straight into the sampler's shardings.

        Args:
          path: a checkpoint step directory or a checkpoints directory (its latest).
          version: default the checkpoint's step.

        Returns:
          The policy version now in use.
        """
        variables, metadata = weights.restore_checkpoint(
            path, self.config, self.engine.mesh, self.engine.rules
        )
        self.set_params(variables, int(metadata.get("step", 0)) if version is None else version)
        return self.policy_version

    def load_hf(self, path: str, version: int | None = None) -> int:
        """Loads weights from a Hugging Face directory (bf16/fp32 or block-fp8), each
        shard of each array read straight into the sampler's shardings
        (``hf_stream.load_hf_checkpoint_sharded``): no host copy of the model, and each
        process reads only its own shards' slices. The checkpoint's shapes are checked
        against the sampler's model (from the headers) before any read."""
        overrides = {"scan_layers": self.config.scan_layers, "param_dtype": self.config.param_dtype}
        plan = hf.plan_hf_import(path, **overrides)
        weights.check_compatible(plan.config, self.config, path)
        mesh = self.engine.mesh
        if mesh is None:  # the engine's single default device, as a one-device mesh
            mesh = partitioning.make_mesh(devices=jax.devices()[:1])
        _, variables = hf_stream.load_hf_checkpoint_sharded(
            path, mesh, self.engine.rules, **overrides
        )
        self.set_params(variables, version)
        return self.policy_version

    def watch(self, directory: str, interval_s: float = 10.0) -> None:
        """Picks up newer checkpoints from ``directory`` (``<version>/`` steps) as they land.

        Checked at most every ``interval_s`` seconds during ``step``; a newer one is
        loaded once running turns finish, while new turns wait.
        """
        self._watch_dir, self._watch_interval = directory, interval_s
        self._last_poll = -float("inf")

    def _poll_policy(self) -> None:
        now = time.monotonic()
        if self._watch_dir is None or now - self._last_poll < self._watch_interval:
            return
        self._last_poll = now
        latest = weights.latest_policy(self._watch_dir)
        current = -1 if self.policy_version is None else self.policy_version
        if latest is not None and latest[0] > current:
            self._pending = latest

    # ---- sessions ---------------------------------------------------------------

    def open(self, prompt: Sequence[int], seed: int | None = None) -> Session:
        """A new session holding ``prompt``; ``seed`` (default: its id) keys its sampling."""
        return self._scheduler.open(prompt, seed)

    def append(self, session: Session, tokens: Sequence[int]) -> None:
        """Appends tokens (e.g. a tool result) to an idle session; its cache is kept."""
        self._scheduler.append(session, tokens)

    def submit(self, session: Session, params: SamplingParams) -> None:
        """Queues one turn of an idle session; ``step`` returns its completion."""
        self._scheduler.submit(session, params)

    def close(self, session: Session) -> None:
        """Frees the session's cache pages."""
        self._scheduler.close(session)

    def step(self) -> list[tuple[Session, Completion]]:
        """One scheduling round; returns the turns that finished, as (session, completion)."""
        finished, self._backlog = self._backlog, []
        self._poll_policy()
        if self._pending is not None:
            if not self._scheduler.turns_in_progress():
                version, path = self._pending
                self._pending = None
                self.load_checkpoint(path, version)
            else:
                return finished + self._scheduler.step(admit_new=False)
        return finished + self._scheduler.step()

    @property
    def stats(self) -> dict[str, int]:
        """Counters: preemptions, evictions, prefill tokens, decode calls."""
        return dict(self._scheduler.stats)

    @property
    def busy(self) -> bool:
        """Whether any turn is waiting or running."""
        s = self._scheduler
        return bool(s.num_running or s.num_waiting or self._backlog)

    def advance(
        self, sessions: Sequence[Session], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """Runs one turn of each session (together) and returns their completions in order.

        Args:
          sessions: idle sessions.
          params: one SamplingParams for all, or one per session.
        """
        if isinstance(params, SamplingParams):
            params = [params] * len(sessions)
        if len(params) != len(sessions):
            raise ValueError(f"{len(params)} SamplingParams for {len(sessions)} sessions")
        for session, p in zip(sessions, params):
            self.submit(session, p)
        wanted = {s.id: i for i, s in enumerate(sessions)}
        results: list[Completion | None] = [None] * len(sessions)
        remaining = len(sessions)
        while remaining:
            others = []
            for session, completion in self.step():
                if session.id in wanted and results[wanted[session.id]] is None:
                    results[wanted[session.id]] = completion
                    remaining -= 1
                else:
                    others.append((session, completion))
            # Turns submitted by someone else are handed back by the next step().
            self._backlog.extend(others)
        return results

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        """Completes each prompt once; continuous batching over the sampler's slots.

        Prompt ``i`` samples with session seed ``i``, so its completion depends on
        (params.seed, i, the prompt, the weights), not on the other prompts.
        """
        sessions = [self.open(prompt, seed=i) for i, prompt in enumerate(prompts)]
        try:
            return self.advance(sessions, params)
        finally:
            for session in sessions:
                if session.state == "idle":
                    self.close(session)
