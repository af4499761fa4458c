"""``Scheduler``: the waiting / running queues and the per-step choice of rows (nano-vllm's
``nanovllm/engine/scheduler.py`` seam; vLLM's decode-first order, ``reorder_batch_threshold = 1``).

Each step:
1. admission, FCFS from the head of the waiting queue: ask first (``memory.can_admit``: KV pages AND a
   state slot AND the hit's checkpoint pages), then act (``memory.admit``); a request that can NEVER fit
   is rejected with its reason; the first that fits only LATER stops admission (no overtaking). At most
   ``max_num_seqs`` requests run at once, and never more than ``num_state_slots`` (each running request
   holds one KDA state slot; sglang#40706: the state pool caps the running requests);
2. decode rows first: every decoding request, one token each, counted against the token budget
   ``max_num_batched_tokens``;
3. then prefill chunks, oldest first, in what is left of the budget. A prefill row's chunk is
   ``min(rest of the prompt, max_prefill_chunk, max_num_batched_tokens)``: it does not depend on the
   neighbours, so a request computes the same chunks in any batch (batch invariance). When that chunk
   does not fit the budget left, it is cut at a multiple of the 64-token grid (bitwise the uncut chunk)
   if the chunk sizes are on the grid and the state is fp32, else the row waits for a later step (a 16-bit
   state is rounded at each chunk end, so a cut would make the output depend on the neighbours).

Preemption by recompute (nano-vllm's ``preempt``): :meth:`preempt` frees the newest running request's
slot and pages and puts it back at the head of the waiting queue with its progress dropped; its output,
recomputed, is bitwise the uninterrupted one. Admission reserves a request's final pages, so a running
request never runs out of pages mid-decode: preemption is an explicit call (memory pressure from outside,
e.g. a higher-priority arrival), never forced by a decode step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kda_core.chunk import CHUNK_SIZE
from serve.errors import check_int


@dataclass
class SchedulerConfig:
    """max_num_seqs: most running requests (None: no cap but the state slots); max_num_batched_tokens:
    tokens per step, decode and prefill together (None: no cap); num_state_slots: KDA state slots
    (None: as many as the pool's pages allow); max_prefill_chunk: tokens per prefill chunk (None: no cap);
    exact_state: the state round-trips its pages bitwise (fp32), so a chunk cut on the grid is bitwise the
    uncut chunk; False (a 16-bit state, rounded at every chunk end) never cuts a chunk to fit the budget.
    Raises ValueError for a non-positive or non-int value."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_state_slots: int | None = None
    max_prefill_chunk: int | None = None
    exact_state: bool = True

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_state_slots", "max_prefill_chunk"):
            v = getattr(self, name)
            if v is not None:
                check_int(name, v, minimum=1)

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
    """One step's choice: decode requests, prefill (request, num_tokens) pairs, and whether admission
    or rejection happened (work even when no row runs)."""

    decode: list = field(default_factory=list)
    prefill: list = field(default_factory=list)
    admitted: bool = False

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    """Owns ``waiting`` and ``running`` (request ids, shared with the engine) and picks each step's rows.

    ``memory`` answers and acts for admission: ``rematch(req)``, ``can_admit(req) -> Fit``,
    ``admit(req)``, ``reject(req, reason)``, ``preempt(req)`` (the engine's page bookkeeping).
    """

    def __init__(self, config: SchedulerConfig, memory, requests: dict, waiting: list, running: list):
        self.config, self.memory, self.requests = config, memory, requests
        self.waiting, self.running = waiting, running

    def can_run_another(self) -> bool:
        cap = self.config.max_running
        return cap is None or len(self.running) < cap

    def schedule(self, fit_now, fit_never) -> Schedule:
        """Admit, then choose the rows of this step (decode first, then prefill chunks)."""
        from serve.engine.request import RequestStatus  # local: request imports nothing from here
        sched = Schedule()
        while self.waiting and self.can_run_another():
            req = self.requests[self.waiting[0]]
            self.memory.rematch(req)
            fit = self.memory.can_admit(req)
            if fit is fit_now:
                self.waiting.pop(0)
                self.memory.admit(req)
                sched.admitted = True
            elif fit is fit_never:
                self.waiting.pop(0)
                self.memory.reject(req)
                sched.admitted = True
            else:
                break
        budget = self.config.max_num_batched_tokens
        left = float("inf") if budget is None else budget
        for rid in self.running:
            req = self.requests[rid]
            if req.status is RequestStatus.DECODE and left >= 1:
                sched.decode.append(req)
                left -= 1
        for rid in self.running:
            req = self.requests[rid]
            if req.status is not RequestStatus.PREFILL or left < 1:
                continue
            n = self.config.prefill_chunk(len(req.prompt) - req.computed)
            if n > left:
                cut = int(left) // CHUNK_SIZE * CHUNK_SIZE
                if not (self.config.on_grid and cut):
                    continue
                n = cut
            sched.prefill.append((req, n))
            left -= n
        return sched

    def preempt_newest(self):
        """Preempt the newest running request by recompute; returns it, or None if nothing runs."""
        if not self.running:
            return None
        req = self.requests[self.running[-1]]
        self.running.remove(req.rid)
        self.memory.preempt(req)
        self.waiting.insert(0, req.rid)
        return req
