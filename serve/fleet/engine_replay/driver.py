"""The replay driver: the real engine run step by step on a clock, requests submitted as they arrive on it.

At each step boundary (clock time t): every request whose ``arrival_ms`` <= t is submitted, then one
``engine.step()`` runs; the submissions and the step are one boundary's work, timed by the clock
(:mod:`serve.fleet.engine_replay.clock`: the strict clock advances by that work's thread CPU time). When no
request is in flight and the next arrival is later than t, the clock waits for it (strict: jumps). A request's
first token and its finish are stamped with the end of the boundary in which they appeared (read through the
engine's public ``result``). Each boundary is logged as a :class:`StepRecord` (its composition, from the
requests' progress, and its CPU and wall ms) for the service model's fit (:mod:`serve.fleet.engine_replay.fit`).

The engine is built by :func:`build_replay_engine` only (one place to change how).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from serve.engine.request import RequestStatus
from serve.fleet.engine_replay.clock import CLOCKS
from serve.fleet.engine_replay.metrics import RequestTimes
from serve.fleet.engine_replay.workload import ReplayRequest
from serve.http.model import EngineSpec, build_engine

DONE = (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.REJECTED)
MAX_MODEL_LEN = 512             # the longest replayed prompt (384) + output (24), rounded up


def build_replay_engine(num_state_slots: int, model=None):
    """The engine a replay drives: the server's batched engine (prefix cache on, whole-prompt prefill, fp32
    states) with ``num_state_slots`` running requests at most (each holds one KDA state slot), its pool sized so
    that cached prefixes are never evicted during a replay (the simulator's cache is unbounded). The pool's
    memory is written once here, outside any clock: a fresh ``torch.empty`` arena page-faults on first touch,
    which made a fresh engine's first steps 20-40 % slower than the same steps later (a server's pool is warm
    after its first requests)."""
    spec = EngineSpec(max_num_seqs=num_state_slots, max_model_len=MAX_MODEL_LEN, num_pages=4096)
    engine = build_engine(spec, model)
    engine.pool.arena.zero_()
    return engine


class StepRecord(NamedTuple):
    """One step boundary: ``start_ms`` on the clock; ``cpu_ms`` / ``wall_ms`` of its work; ``clock_ms`` how
    far it moved the clock; ``prefill`` ``((new tokens, cached tokens), ...)`` per prompt computed;
    ``decode_rows``; ``decode_context`` the decode rows' tokens in cache, summed; ``submitted`` requests;
    ``in_flight`` requests submitted and not finished after it (0: the clock may wait before the next boundary)."""

    start_ms: float
    cpu_ms: float
    wall_ms: float
    clock_ms: float
    prefill: tuple
    decode_rows: int
    decode_context: int
    submitted: int
    in_flight: int = 0


class ReplayRun(NamedTuple):
    """``times`` of the completed requests (by request id), every ``steps`` record, ``hit_tokens`` per request,
    the ``clock`` name."""

    times: list
    steps: list
    hit_tokens: list
    clock: str


class Replayer:
    """One replay in progress: ``requests`` (sorted by arrival) on a fresh engine (:func:`build_replay_engine`,
    or ``engine``) and a ``clock`` ("cpu" strict, "wall"). :meth:`boundary` runs one step boundary; :meth:`run`
    (the result) once :attr:`done`. Raises ValueError for an unknown clock or unsorted arrivals."""

    def __init__(self, requests: Sequence[ReplayRequest], num_state_slots: int, clock: str = "cpu", model=None,
                 engine=None):
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
        if any(b.arrival_ms < a.arrival_ms for a, b in zip(requests, requests[1:])):
            raise ValueError("requests must be sorted by arrival_ms")
        self.requests, self.clock = list(requests), CLOCKS[clock]()
        self.engine = build_replay_engine(num_state_slots, model) if engine is None else engine
        self.rid_of, self.first, self.finish, self.steps, self.next = {}, {}, {}, [], 0
        self.emitted, self.total_tokens = 0, sum(r.max_new_tokens for r in self.requests)

    @property
    def done(self) -> bool:
        return len(self.finish) == len(self.requests)

    @property
    def progress(self) -> float:
        """Share of the replay's output tokens emitted so far, in [0, 1]."""
        return self.emitted / self.total_tokens

    def boundary(self) -> None:
        """Submit what has arrived, run one step, stamp first tokens and finishes, log the step (call with torch
        on 1 thread, under ``torch.inference_mode``). Raises RuntimeError if a request ends rejected or aborted."""
        engine, clk, reqs = self.engine, self.clock, self.requests
        if len(self.rid_of) == len(self.finish):                    # idle: wait for the next arrival
            clk.wait_until(reqs[self.next].arrival_ms)
        now = clk.now_ms()
        due = []
        while self.next < len(reqs) and reqs[self.next].arrival_ms <= now:
            due.append(reqs[self.next])
            self.next += 1
        before = {r: engine.result(rid) for r, rid in self.rid_of.items() if r not in self.finish}

        def work():
            for r in due:
                self.rid_of[r.request_id] = engine.submit(list(r.prompt), r.max_new_tokens)
            engine.step()

        cpu_ms, wall_ms = clk.run(work)
        end = clk.now_ms()
        prefill, rows, context = [], 0, 0
        for r in list(before) + [q.request_id for q in due]:
            res, old = engine.result(self.rid_of[r]), before.get(r)
            self.emitted += len(res.output_tokens) - (len(old.output_tokens) if old is not None else 0)
            if old is not None and old.status is RequestStatus.DECODE:
                rows += 1
                context += old.prompt_tokens + len(old.output_tokens)
            elif res.prefill_tokens > (old.prefill_tokens if old is not None else 0):
                prefill.append((res.prefill_tokens - (old.prefill_tokens if old is not None else 0), res.hit_tokens))
            if res.output_tokens and r not in self.first:
                self.first[r] = end
            if res.status in DONE:
                if res.status is not RequestStatus.FINISHED:
                    raise RuntimeError(f"request {r} ended {res.status.value}: {res.reason}")
                self.finish[r] = end
        self.steps.append(StepRecord(now, cpu_ms, wall_ms, end - now, tuple(prefill), rows, context, len(due),
                                     len(self.rid_of) - len(self.finish)))

    def run(self) -> ReplayRun:
        """The finished replay's :class:`ReplayRun`. Raises RuntimeError if it is not done."""
        if not self.done:
            raise RuntimeError(f"replay not done: {len(self.finish)} of {len(self.requests)} requests finished")
        times = [RequestTimes(r.arrival_ms, self.first[r.request_id], self.finish[r.request_id], r.max_new_tokens)
                 for r in self.requests]
        hits = [self.engine.result(self.rid_of[r.request_id]).hit_tokens for r in self.requests]
        return ReplayRun(times, self.steps, hits, self.clock.name)


def _one_thread(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            return fn()
    finally:
        torch.set_num_threads(threads)


def replay(requests: Sequence[ReplayRequest], num_state_slots: int, clock: str = "cpu", model=None,
           engine=None) -> ReplayRun:
    """Run ``requests`` (sorted by arrival) to the end on a fresh engine (:class:`Replayer`) on ``clock``; torch
    on 1 thread (restored after). Raises as :class:`Replayer` does."""
    rep = Replayer(requests, num_state_slots, clock, model, engine)

    def go():
        while not rep.done:
            rep.boundary()
        return rep.run()

    return _one_thread(go)


def replay_lockstep(workloads: Sequence[Sequence[ReplayRequest]], num_state_slots: int,
                    model=None) -> list[ReplayRun]:
    """Strict replays of several ``workloads`` at once, each on its own engine and its own CPU-time clock; the
    next step boundary is always the one of the replay least far along (:attr:`Replayer.progress`), so every
    replay spreads over the whole run: whatever the host does to this thread's CPU speed over time (other jobs
    on the shared cores and caches), it does to every replay alike (calibration and scored replays see the same
    host). Each result equals a :func:`replay` of that workload but for the CPU times themselves."""
    reps = [Replayer(w, num_state_slots, "cpu", model) for w in workloads]

    def go():
        while not all(r.done for r in reps):
            min((r for r in reps if not r.done), key=lambda r: r.progress).boundary()
        return [r.run() for r in reps]

    return _one_thread(go)
