"""Host-side scheduling: sessions, decode slots, page allocation, admission, preemption.

A *session* is one live token sequence (an RL episode's context window). A *turn*
is one request to extend it: sample until a stop, ``max_new_tokens`` or the
context limit. Between turns the caller appends tokens (a tool result) and the
next turn continues from the cached prefix.

Invariant: ``tokens[:cached]`` have latents in the session's pages and at least
the last token is uncached while a turn waits or runs (a turn's last sampled
token is never fed), so every turn starts with a prefill of the uncached tail.

Policies:

1. Admission is first-come first-served over free slots. A session that still
   holds pages must run in a slot of the shard holding them; one without pages
   goes to the shard with the most free pages.
2. Pages are allocated lazily: the prompt's when a turn is admitted, then before
   each decode call those the call can reach.
3. When a shard runs out of pages, sessions outside a slot (idle or waiting) lose
   their cache first, least recently used first; it is recomputed by prefill when
   they next run. Failing that, the most recently admitted running turn is
   preempted (cache dropped, turn put back at the head of the queue). Sampling
   keys depend only on (seed, session seed, position), so a preempted or evicted
   sequence produces the same tokens as one that never was.
4. A round prefills the newly admitted turns completely (chunk by chunk, all of
   them in each call), then runs one decode call over every occupied slot. Simple
   and batch-friendly; a very long prompt delays the running slots' next tokens
   by its prefill time (interleaving chunks with decode calls would bound that).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable, Sequence

from cursor_rl.sampler import engine as engine_lib
from cursor_rl.sampler.sampling import (
    FINISH_CONTEXT,
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    SamplingParams,
    stop_string_cut,
)

IDLE, WAITING, RUNNING, CLOSED = "idle", "waiting", "running", "closed"


@dataclasses.dataclass
class _Turn:
    params: SamplingParams
    start: int  # len(session.tokens) when the turn was submitted
    logprobs: list[float] = dataclasses.field(default_factory=list)
    version: int | None = None  # policy version, fixed when first admitted
    slot: int | None = None
    admitted_at: int = 0


class Session:
    """Handle of one live sequence; created by ``Sampler.open``.

    Attributes:
      id: unique within the sampler.
      seed: the session seed (sampling keys are ``(params.seed, seed, position)``).
    """

    def __init__(self, session_id: int, prompt: Sequence[int], seed: int):
        self.id = session_id
        self.seed = seed
        self._tokens = [int(t) for t in prompt]
        self._cached = 0
        self._shard: int | None = None
        self._pages: list[int] = []
        self._state = IDLE
        self._turn: _Turn | None = None
        self._last_used = 0

    @property
    def tokens(self) -> tuple[int, ...]:
        """The whole sequence: prompt, sampled and appended tokens."""
        return tuple(self._tokens)

    @property
    def state(self) -> str:
        """``idle`` (between turns), ``waiting``/``running`` (a turn), ``closed``."""
        return self._state

    @property
    def num_cached(self) -> int:
        """How many leading tokens have their latents in the cache."""
        return self._cached

    @property
    def partial(self) -> tuple[int, ...]:
        """Tokens generated so far by the current turn (for streaming)."""
        return () if self._turn is None else tuple(self._tokens[self._turn.start :])

    def __repr__(self) -> str:
        return f"Session(id={self.id}, state={self._state}, len={len(self._tokens)})"


class Scheduler:
    """Runs turns of many sessions through an ``Engine`` (see the module docstring)."""

    def __init__(self, engine: engine_lib.Engine, decode_text: Callable | None = None):
        self.engine = engine
        self.decode_text = decode_text  # token ids -> text, for stop strings
        self.version: int | None = None  # stamped on turns when admitted
        shards, per_shard = engine.row_shards, engine.num_slots // engine.row_shards
        self._free_pages = [list(range(engine.pages_per_shard)) for _ in range(shards)]
        self._free_slots = [list(range(k * per_shard, (k + 1) * per_shard)) for k in range(shards)]
        self._slots: dict[int, Session] = {}
        self._waiting: deque[Session] = deque()
        self._full: list[Session] = []  # submitted with a full context
        self._sessions: dict[int, Session] = {}
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self.stats = {"preemptions": 0, "evictions": 0, "prefill_tokens": 0, "decode_calls": 0}

    # ---- sessions -------------------------------------------------------------------

    def open(self, prompt: Sequence[int], seed: int | None = None) -> Session:
        if not prompt:
            raise ValueError("a session needs a non-empty prompt")
        session_id = next(self._ids)
        session = Session(session_id, prompt, session_id if seed is None else seed)
        self._sessions[session_id] = session
        return session

    def append(self, session: Session, tokens: Sequence[int]) -> None:
        self._check(session, IDLE, "append to")
        session._tokens.extend(int(t) for t in tokens)

    def close(self, session: Session) -> None:
        if session._state in (WAITING, RUNNING):
            raise ValueError(f"{session} has a turn in progress; wait for its completion")
        self._drop_cache(session)
        session._state = CLOSED
        self._sessions.pop(session.id, None)

    def submit(self, session: Session, params: SamplingParams) -> None:
        """Queues one turn of ``session``."""
        self._check(session, IDLE, "submit")
        if params.stop_strings and self.decode_text is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer= to the Sampler")
        session._turn = _Turn(params, start=len(session._tokens))
        session._state = WAITING
        if len(session._tokens) >= self.engine.max_seq_len:
            # No room for a single token: the turn ends at the next step, empty.
            session._turn.version = self.version
            self._full.append(session)
        else:
            self._waiting.append(session)

    def invalidate_caches(self) -> None:
        """Marks every cached prefix stale (new weights); pages stay with their sessions."""
        for session in self._sessions.values():
            session._cached = 0

    @property
    def num_running(self) -> int:
        return len(self._slots)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def turns_in_progress(self) -> int:
        """Turns that have produced tokens under the current version (running or preempted)."""
        waiting = sum(s._turn.version is not None for s in self._waiting)
        return len(self._slots) + waiting

    def _check(self, session: Session, state: str, action: str) -> None:
        if self._sessions.get(session.id) is not session:
            raise ValueError(f"{session} does not belong to this sampler (or is closed)")
        if session._state != state:
            raise ValueError(f"cannot {action} {session}: it is {session._state}")

    # ---- one scheduling round ----------------------------------------------------

    def step(self, admit_new: bool = True) -> list[tuple[Session, Completion]]:
        """Admits waiting turns, prefills them, runs one decode call.

        Args:
          admit_new: False admits only turns already started (used while draining
            for a weight swap).

        Returns:
          The turns that finished in this round, as (session, completion).
        """
        finished: list[tuple[Session, Completion]] = []
        for session in self._full:
            self._complete(session, FINISH_CONTEXT, finished)
        self._full.clear()
        admitted = self._admit(admit_new)
        if admitted:
            self._prefill(admitted, finished)
        if self._slots:
            self._decode(finished)
        return finished

    def _admit(self, admit_new: bool) -> list[Session]:
        admitted = []
        for session in list(self._waiting):
            turn = session._turn
            if not admit_new and turn.version is None:
                continue
            if session._pages:
                shards = [session._shard]
            else:
                shards = sorted(
                    range(self.engine.row_shards), key=lambda k: -len(self._free_pages[k])
                )
            for shard in shards:
                if self._free_slots[shard] and self._reserve(session, shard, len(session._tokens)):
                    break
            else:
                continue
            self._waiting.remove(session)
            turn.slot = self._free_slots[shard].pop(0)
            turn.admitted_at = next(self._clock)
            if turn.version is None:
                turn.version = self.version
            self._slots[turn.slot] = session
            session._state = RUNNING
            admitted.append(session)
        return admitted

    def _prefill(self, sessions: list[Session], finished) -> None:
        chunk = self.engine.prefill_chunk
        pending = list(sessions)
        while pending:
            rows = []
            for s in pending:
                tokens = s._tokens[s._cached : s._cached + chunk]
                is_last = s._cached + len(tokens) == len(s._tokens)
                spec = self._spec(s) if is_last else None
                rows.append(engine_lib.PrefillRow(s._shard, tokens, s._cached, s._pages, spec))
            results = self.engine.prefill(rows)
            self.stats["prefill_tokens"] += sum(len(r.tokens) for r in rows)
            still = []
            for s, row, result in zip(pending, rows, results):
                s._cached += len(row.tokens)
                if result is None:
                    still.append(s)
                else:
                    self._accept(s, [result[0]], [result[1]], None, finished)
            pending = still

    def _decode(self, finished) -> None:
        budget = {
            slot: s._turn.params.max_new_tokens - (len(s._tokens) - s._turn.start)
            for slot, s in self._slots.items()
        }
        steps = min(self.engine.decode_steps, max(budget.values()))
        for slot in sorted(self._slots, key=lambda k: self._slots[k]._turn.admitted_at):
            session = self._slots.get(slot)
            if session is not None:
                reach = min(session._cached + steps, self.engine.max_seq_len)
                while not self._reserve(session, session._shard, reach):
                    self._preempt_latest(session._shard)
                    if session._state != RUNNING:
                        break
        slots = {
            slot: engine_lib.DecodeSlot(
                s._tokens[-1], s._cached, s._pages, budget[slot], self._spec(s)
            )
            for slot, s in self._slots.items()
        }
        if not slots:
            return
        results = self.engine.decode(slots, steps)
        self.stats["decode_calls"] += 1
        for slot, result in results.items():
            session = self._slots[slot]
            session._cached += len(result.tokens)  # each step fed the previous token
            self._accept(session, result.tokens, result.logprobs, result.finish, finished)

    # ---- turns ------------------------------------------------------------------

    def _spec(self, session: Session) -> engine_lib.TurnSpec:
        p = session._turn.params
        return engine_lib.TurnSpec(
            (p.seed, session.seed), p.temperature, p.top_p, p.top_k, p.stop_token_ids
        )

    def _accept(self, session, tokens, logprobs, finish, finished) -> None:
        """Appends sampled tokens to the turn; completes it when it is done."""
        turn = session._turn
        session._tokens.extend(tokens)
        turn.logprobs.extend(logprobs)
        params = turn.params
        generated = session._tokens[turn.start :]
        if finish is None and generated:  # the prefill's token is checked here
            if generated[-1] in params.stop_token_ids:
                finish = FINISH_STOP
            elif len(generated) >= params.max_new_tokens:
                finish = FINISH_LENGTH
            elif len(session._tokens) >= self.engine.max_seq_len:
                finish = FINISH_CONTEXT
        cut = stop_string_cut(self.decode_text, generated, params.stop_strings)
        if cut is not None:
            del session._tokens[turn.start + cut :]
            del turn.logprobs[cut:]
            session._cached = min(session._cached, len(session._tokens) - 1)
            finish = FINISH_STOP
        if finish is not None:
            del self._slots[turn.slot]
            self._free_slots[session._shard].append(turn.slot)
            self._complete(session, finish, finished)

    def _complete(self, session, finish, finished) -> None:
        turn = session._turn
        completion = Completion(
            list(session._tokens[turn.start :]), list(turn.logprobs), finish, turn.version
        )
        session._turn = None
        session._state = IDLE
        session._last_used = next(self._clock)
        finished.append((session, completion))

    # ---- pages ------------------------------------------------------------------

    def _reserve(self, session: Session, shard: int, positions: int) -> bool:
        """Gives ``session`` pages in ``shard`` covering ``positions``; False if impossible."""
        needed = -(-positions // self.engine.page_size) - len(session._pages)
        if needed <= 0:
            return True
        free = self._free_pages[shard]
        if len(free) < needed:
            self._evict_idle(shard, needed - len(free), keep=session)
        if len(free) < needed:
            return False
        session._shard = shard
        session._pages.extend(free[:needed])
        del free[:needed]
        return True

    def _evict_idle(self, shard: int, count: int, keep: Session) -> None:
        """Drops the caches of sessions outside a slot, least recently used first."""
        victims = [
            s
            for s in self._sessions.values()
            if s._shard == shard and s._pages and s._state in (IDLE, WAITING) and s is not keep
        ]
        for victim in sorted(victims, key=lambda s: s._last_used):
            if len(self._free_pages[shard]) >= count:
                return
            self.stats["evictions"] += 1
            self._drop_cache(victim)

    def _preempt_latest(self, shard: int) -> None:
        """Puts the most recently admitted running turn of ``shard`` back in the queue."""
        running = [s for s in self._slots.values() if s._shard == shard]
        victim = max(running, key=lambda s: s._turn.admitted_at)
        self.stats["preemptions"] += 1
        slot = victim._turn.slot
        del self._slots[slot]
        self._free_slots[shard].append(slot)
        victim._turn.slot = None
        victim._state = WAITING
        self._drop_cache(victim)
        self._waiting.appendleft(victim)

    def _drop_cache(self, session: Session) -> None:
        if session._pages:
            self._free_pages[session._shard].extend(session._pages)
        session._pages, session._shard, session._cached = [], None, 0
