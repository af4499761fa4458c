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

from serve.fleet.engine_replay.clock import CLOCKS
from serve.fleet.engine_replay.metrics import RequestTimes
from serve.fleet.engine_replay.workload import ReplayRequest
from serve.http.model import EngineSpec, build_engine
from serve.request import RequestStatus

DONE = (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.REJECTED)
MAX_MODEL_LEN = 512             # the longest replayed prompt (384) + output (24), rounded up


def build_replay_engine(num_state_slots: int, model=None):
    """The engine a replay drives: the server's batched engine (prefix cache on, whole-prompt prefill, fp32
    states) with ``num_state_slots`` running requests at most (each holds one KDA state slot), its pool sized so
    that cached prefixes are never evicted during a replay (the simulator's cache is unbounded)."""
    spec = EngineSpec(max_num_seqs=num_state_slots, max_model_len=MAX_MODEL_LEN, num_pages=4096)
    return build_engine(spec, model)


class StepRecord(NamedTuple):
    """One step boundary: ``start_ms`` on the clock; ``cpu_ms`` / ``wall_ms`` of its work; ``clock_ms`` how
    far it moved the clock; ``prefill`` ``((new tokens, cached tokens), ...)`` per prompt computed;
    ``decode_rows``; ``decode_context`` the decode rows' tokens in cache, summed; ``submitted`` requests."""

    start_ms: float
    cpu_ms: float
    wall_ms: float
    clock_ms: float
    prefill: tuple
    decode_rows: int
    decode_context: int
    submitted: int


class ReplayRun(NamedTuple):
    """``times`` of the completed requests (by request id), every ``steps`` record, ``hit_tokens`` per request,
    the ``clock`` name."""

    times: list
    steps: list
    hit_tokens: list
    clock: str


def replay(requests: Sequence[ReplayRequest], num_state_slots: int, clock: str = "cpu", model=None,
           engine=None) -> ReplayRun:
    """Run ``requests`` (sorted by arrival) through a fresh engine (:func:`build_replay_engine`, or ``engine``)
    on a ``clock`` ("cpu" strict, "wall"); torch runs on 1 thread (restored after). Raises ValueError for an
    unknown clock or unsorted arrivals; RuntimeError if a request does not finish (rejected or aborted)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    if any(b.arrival_ms < a.arrival_ms for a, b in zip(requests, requests[1:])):
        raise ValueError("requests must be sorted by arrival_ms")
    engine = build_replay_engine(num_state_slots, model) if engine is None else engine
    clk, threads = CLOCKS[clock](), torch.get_num_threads()
    torch.set_num_threads(1)
    rid_of, first, finish, steps, nxt = {}, {}, {}, [], 0
    try:
        with torch.inference_mode():
            while len(finish) < len(requests):
                if len(rid_of) == len(finish):                     # idle: wait for the next arrival
                    clk.wait_until(requests[nxt].arrival_ms)
                now = clk.now_ms()
                due = []
                while nxt < len(requests) and requests[nxt].arrival_ms <= now:
                    due.append(requests[nxt])
                    nxt += 1
                before = {r: engine.result(rid) for r, rid in rid_of.items() if r not in finish}

                def work(due=due):
                    for r in due:
                        rid_of[r.request_id] = engine.submit(list(r.prompt), r.max_new_tokens)
                    engine.step()

                cpu_ms, wall_ms = clk.run(work)
                end = clk.now_ms()
                prefill, rows, context = [], 0, 0
                for r in list(before) + [q.request_id for q in due]:
                    res, old = engine.result(rid_of[r]), before.get(r)
                    if old is not None and old.status is RequestStatus.DECODE:
                        rows += 1
                        context += old.prompt_tokens + len(old.output_tokens)
                    elif res.prefill_tokens > (old.prefill_tokens if old is not None else 0):
                        prefill.append((res.prefill_tokens - (old.prefill_tokens if old is not None else 0),
                                        res.hit_tokens))
                    if res.output_tokens and r not in first:
                        first[r] = end
                    if res.status in DONE:
                        if res.status is not RequestStatus.FINISHED:
                            raise RuntimeError(f"request {r} ended {res.status.value}: {res.reason}")
                        finish[r] = end
                steps.append(StepRecord(now, cpu_ms, wall_ms, end - now, tuple(prefill), rows, context, len(due)))
    finally:
        torch.set_num_threads(threads)
    times = [RequestTimes(r.arrival_ms, first[r.request_id], finish[r.request_id], r.max_new_tokens)
             for r in requests]
    hits = [engine.result(rid_of[r.request_id]).hit_tokens for r in requests]
    return ReplayRun(times, steps, hits, clock)
