"""``Scheduler``: the waiting / running queues and the per-step choice of rows (nano-vllm's
``nanovllm/engine/scheduler.py`` seam; vLLM's decode-first order, ``reorder_batch_threshold = 1``).

Each step:
1. admission, FCFS from the head of the waiting queue: ask first (:meth:`RequestMemory.match`: the prefix is
   looked up only now, as vLLM does, and the hit chosen that fits: KV pages AND a state slot AND the hit's
   checkpoint pages, else no hit), then act (:meth:`RequestMemory.admit`, which pins the hit). Waiting requests pin
   nothing, so no page the head needs is held by a request behind it; a request that can NEVER fit (not even
   without its hit, in a pool where nothing runs) is rejected with its reason; the first that fits only LATER stops admission (no overtaking), and so does one
   whose state finds no run of consecutive free pages while others run (it waits at the head). At most
   ``max_num_seqs`` requests run at once, and never more than ``num_state_slots`` (each running request
   holds one KDA state slot; sglang#40706: the state pool caps the running requests);
2. decode rows first: every decoding request, one token each, counted against the token budget
   ``max_num_batched_tokens``; with speculation (``num_spec_tokens``) each decode row is a verify row of 1 +
   its drafts, and its drafts count too (vLLM schedules 1 + the spec tokens of a decode request inside the
   budget and trims the spec tokens to what is left): after every decode row has its token, each gets
   :func:`serve.spec_decode.verify.draft_budget` drafts, oldest first, cut to what is left (never below 0)
   with an fp32 state; with a 16-bit state a row that does not get its drafts waits, as a chunk does;
3. then prefill chunks, oldest first, in what is left of the budget. A prefill row's chunk is
   ``min(rest of the prompt, max_prefill_chunk, max_num_batched_tokens)``: it does not depend on the
   neighbours, so a request computes the same chunks in any batch (batch invariance). When that chunk
   does not fit the budget left, it is cut at a multiple of the 64-token grid (bitwise the uncut chunk)
   if the chunk sizes are on the grid and the state is fp32, else the row waits for a later step (a 16-bit
   state is rounded at each chunk end, so a cut would make the output depend on the neighbours), and so do
   the younger prefill rows behind it: FCFS, as vLLM's v1 ``Scheduler.schedule`` stops at the first waiting
   request whose tokens exceed the budget when it cannot chunk them (``break``), so a stream of short prompts
   never starves an older long one (their small chunks would otherwise take the budget it waits for).

Preemption by recompute (nano-vllm's ``preempt``): :meth:`Scheduler.preempt_newest` frees the newest running request's
slot and pages and puts it back at the head of the waiting queue with its progress dropped; its output,
recomputed, is bitwise the uninterrupted one. Admission reserves a request's final pages, so a running
request never runs out of pages mid-decode: preemption is an explicit call (memory pressure from outside,
e.g. a higher-priority arrival), never forced by a decode step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kda_core.chunk import CHUNK_SIZE
from serve.engine.request import Request, RequestStatus
from serve.engine.request_memory import Fit, RequestMemory
from serve.errors import check_int
from serve.spec_decode.verify import draft_budget

DONE = (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.REJECTED)


@dataclass
class SchedulerConfig:
    """max_num_seqs: most running requests (None: no cap but the state slots); max_num_batched_tokens:
    tokens per step, decode and prefill together (None: no cap); num_state_slots: KDA state slots
    (None: as many as the pool's pages allow); max_prefill_chunk: tokens per prefill chunk (None: no cap);
    exact_state: the state round-trips its pages bitwise (fp32), so a chunk cut on the grid is bitwise the
    uncut chunk; False (a 16-bit state, rounded at every chunk end) never cuts a chunk to fit the budget;
    num_spec_tokens: drafts a decode row verifies at most with speculation (None: no speculation, plain decode
    rows), counted in ``max_num_batched_tokens``.
    Raises ValueError for a non-positive or non-int value (a negative one for ``num_spec_tokens``)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_state_slots: int | None = None
    max_prefill_chunk: int | None = None
    exact_state: bool = True
    num_spec_tokens: int | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_state_slots", "max_prefill_chunk"):
            v = getattr(self, name)
            if v is not None:
                check_int(name, v, minimum=1)
        if self.num_spec_tokens is not None:
            check_int("num_spec_tokens", self.num_spec_tokens, minimum=0)

    @property
    def max_running(self) -> int | None:
        caps = [c for c in (self.max_num_seqs, self.num_state_slots) if c is not None]
        return min(caps) if caps else None

    def prefill_chunk(self, remaining: int) -> int:
        """The chunk a prefill row computes next, whatever its neighbours: min(rest, caps)."""
        caps = [c for c in (self.max_prefill_chunk, self.max_num_batched_tokens) if c is not None]
        return min([remaining] + caps)

    @property
    def on_grid(self) -> bool:
        """Whether a chunk cut on the 64-token grid is bitwise the uncut chunk: every chunk cap is a multiple
        of the grid and the state round-trips its pages exactly (``exact_state``)."""
        return self.exact_state and all(c is None or c % CHUNK_SIZE == 0 for c in (self.max_prefill_chunk, self.max_num_batched_tokens))


@dataclass
class Schedule:
    """One step's choice: decode requests, prefill (request, num_tokens) pairs, with speculation the drafts of
    each decode request's verify row (request id -> num drafts), and whether admission or rejection happened
    (work even when no row runs)."""

    decode: list = field(default_factory=list)
    prefill: list = field(default_factory=list)
    drafts: dict = field(default_factory=dict)
    admitted: bool = False

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    """Owns the requests (``requests``: id -> :class:`Request`, every status until :meth:`pop`), the ``waiting``
    and ``running`` queues (request ids, oldest first) and their :class:`RequestMemory`; picks each step's rows.
    The engine reads the queues through it and never writes them."""

    def __init__(self, config: SchedulerConfig, memory: RequestMemory):
        self.config, self.memory = config, memory
        self.requests: dict[int, Request] = {}
        self.waiting: list[int] = []
        self.running: list[int] = []

    def add(self, req: Request) -> None:
        """Queue a new (matched) request at the tail of ``waiting``."""
        self.requests[req.rid] = req
        self.waiting.append(req.rid)

    def get(self, rid: int) -> Request:
        """The request ``rid`` (any status). Raises ValueError for an unknown id."""
        if rid not in self.requests:
            raise ValueError(f"unknown request id {rid!r}")
        return self.requests[rid]

    def can_run_another(self) -> bool:
        cap = self.config.max_running
        return cap is None or len(self.running) < cap

    def schedule(self) -> Schedule:
        """Admit, then choose the rows of this step (decode first, then prefill chunks)."""
        sched = Schedule()
        while self.waiting and self.can_run_another():
            req = self.requests[self.waiting[0]]
            fit = self.memory.match(req, bool(self.running))
            if fit is Fit.LATER:
                break
            self.waiting.pop(0)
            if fit is Fit.NEVER:
                self.memory.reject(req)
            elif self.memory.admit(req, bool(self.running)):
                self.running.append(req.rid)
            elif req.status is RequestStatus.WAITING:     # no run of free pages for its state yet: wait
                self.waiting.insert(0, req.rid)
                break
            sched.admitted = True
        budget = self.config.max_num_batched_tokens
        left = float("inf") if budget is None else budget
        for rid in self.running:
            req = self.requests[rid]
            if req.status is RequestStatus.DECODE and left >= 1:
                sched.decode.append(req)
                left -= 1
        if self.config.num_spec_tokens is not None:
            left = self._drafts(sched, left)
        for rid in self.running:
            req = self.requests[rid]
            if req.status is not RequestStatus.PREFILL:
                continue
            n = self.config.prefill_chunk(len(req.prompt) - req.computed)
            if n > left:
                cut = int(left) // CHUNK_SIZE * CHUNK_SIZE
                if not (self.config.on_grid and cut):
                    break                                # FCFS: no younger chunk takes the budget it waits for
                n = cut
            sched.prefill.append((req, n))
            left -= n
        return sched

    def _drafts(self, sched: Schedule, left: float) -> float:
        """Give each verify row of ``sched`` its drafts (``sched.drafts``), oldest first, inside the ``left`` tokens
        of the budget; returns what is left. A row's drafts are :func:`draft_budget`'s, at most what it would get
        alone (``max_num_batched_tokens - 1``), cut to what is left when the state is exact (fp32: a verify row's
        outputs do not depend on its number of drafts). A 16-bit state is rounded at each verify commit, so
        there a row that does not get its drafts waits for a later step, with the rows behind it (FCFS), rather
        than carry fewer drafts than alone (its output would depend on the neighbours)."""
        cap, exact = self.config.max_num_batched_tokens, self.config.exact_state
        if not exact:                                    # counted again below, each row with its drafts
            left += len(sched.decode)
        for i, req in enumerate(sched.decode):
            k = draft_budget(self.config.num_spec_tokens, req.computed, req.max_new_tokens - len(req.output),
                             self.memory.final_boundary(req))
            k = k if cap is None else min(k, cap - 1)
            if not exact and 1 + k > left:               # (the oldest row always fits: 1 + k <= cap)
                del sched.decode[i:]
                break
            n = int(min(k, left)) if exact else k
            sched.drafts[req.rid] = n
            left -= n + (not exact)
        return left

    def finish(self, req: Request) -> None:
        """FINISHED (``finish_t`` now): out of the running queue, everything it held released
        (:meth:`RequestMemory.release`)."""
        self.running.remove(req.rid)
        self.memory.release(req)
        req.status, req.finish_t = RequestStatus.FINISHED, time.perf_counter()

    def abort(self, rid: int) -> bool:
        """ABORTED: out of its queue, everything it held released. Returns False if it had already ended.
        Raises ValueError for an unknown id."""
        req = self.get(rid)
        if req.status in DONE:
            return False
        (self.waiting if req.status is RequestStatus.WAITING else self.running).remove(rid)
        self.memory.release(req)
        req.status = RequestStatus.ABORTED
        return True

    def pop(self, rid: int) -> Request:
        """Forget an ended request (FINISHED, ABORTED or REJECTED) and return it. Raises ValueError for an
        unknown id or one still waiting or running."""
        req = self.get(rid)
        if req.status not in DONE:
            raise ValueError(f"request {rid} is still {req.status}: abort it before releasing it")
        return self.requests.pop(rid)

    def preempt_newest(self) -> Request | None:
        """Preempt the newest running request by recompute (:meth:`RequestMemory.preempt`) and put it back at
        the head of the waiting queue; returns it, or None if nothing runs."""
        if not self.running:
            return None
        req = self.requests[self.running.pop()]
        self.memory.preempt(req)
        self.waiting.insert(0, req.rid)
        return req
