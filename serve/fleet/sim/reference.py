"""Reference for ``simulation.py``: one replica at a time, one step at a time, no simpy.

Given each request's replica (a fixed assignment, e.g. round-robin), it loops over steps exactly as
the service model reads: at each step boundary, queue every arrival with ``arrival_ms ≤ t``, admit,
then run one prefill step or one decode step (advancing ``t`` by its duration). No buckets, no aborts,
no scale events. The fast simulation must produce the same per-request times (float tolerance: the
fast one computes ``start + k · step`` where this one adds ``step`` k times).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from serve.fleet.routing.block_cache import BlockLRUCache
from serve.fleet.scaling.scheduler import SCHEDULERS
from serve.fleet.sim.types import FleetConfig, FleetRequest, FleetRequestResult


def reference_replica(requests: Sequence[FleetRequest], cfg: FleetConfig, name: str) -> list[FleetRequestResult]:
    """Step-by-step run of one replica over ``requests`` (all routed to it)."""
    svc, bs = cfg.service, cfg.block_size
    cache = BlockLRUCache(cfg.cache_capacity_blocks) if cfg.cache_capacity_blocks != 0 else None
    sched = SCHEDULERS[cfg.scheduler](cfg.weights)
    pending = sorted(requests, key=lambda r: (r.arrival_ms, r.request_id))
    info: dict[int, dict] = {}
    running: list[list] = []  # [request, remaining tokens]
    kv_used, t, nxt = 0, 0.0, 0
    out: list[FleetRequestResult] = []

    class Item:  # what the scheduler needs
        def __init__(self, r: FleetRequest):
            self.r, self.request_id, self.klass, self.input_length = r, r.request_id, r.klass, r.input_length

    def hit(r: FleetRequest) -> int:
        return 0 if cache is None else min(cache.lookup(r.hash_ids) * bs, r.input_length)

    def done(r: FleetRequest, finish: float) -> None:
        d = info[r.request_id]
        out.append(FleetRequestResult(
            request_id=r.request_id, klass=r.klass, replica=name, status="completed", arrival_ms=r.arrival_ms,
            admitted_ms=r.arrival_ms, start_ms=d["start"], first_token_ms=d["first"], finish_ms=finish,
            hit_tokens=d["hit"], input_length=r.input_length, output_length=r.output_length))

    while nxt < len(pending) or len(sched) or running:
        while nxt < len(pending) and pending[nxt].arrival_ms <= t:
            sched.push(Item(pending[nxt]))
            nxt += 1
        batch: list[FleetRequest] = []
        tokens = 0

        def fits(item, batch=batch) -> bool:
            nonlocal tokens, kv_used
            r = item.r
            if len(running) + len(batch) >= svc.max_batch_requests:
                return False
            need = r.input_length + r.output_length
            if svc.kv_capacity_tokens is not None and kv_used + need > svc.kv_capacity_tokens and (running or batch):
                return False
            uncached = max(1, r.input_length - hit(r))
            if svc.max_prefill_tokens_per_step is not None and batch and tokens + uncached > svc.max_prefill_tokens_per_step:
                return False
            batch.append(r)
            tokens += uncached
            kv_used += need
            return True

        sched.pop_admissible(fits)
        if batch:
            for r in batch:
                h = hit(r)
                info[r.request_id] = {"start": t, "hit": h}
                if cache is not None:
                    cache.touch(r.hash_ids[: h // bs])
            t += svc.prefill_ms(tokens)
            for r in batch:
                if cache is not None:
                    cache.insert(r.hash_ids)
                info[r.request_id]["first"] = t
                if r.output_length <= 1:
                    kv_used -= r.input_length + r.output_length
                    done(r, t)
                else:
                    running.append([r, r.output_length - 1])
            continue
        if running:
            t += svc.decode_step_ms(len(running))
            for entry in running:
                entry[1] -= 1
                sched.on_decode(entry[0].klass, 1)
            for entry in [e for e in running if e[1] == 0]:
                running.remove(entry)
                kv_used -= entry[0].input_length + entry[0].output_length
                done(entry[0], t)
            continue
        t = max(t, pending[nxt].arrival_ms) if nxt < len(pending) else t
    return out


def reference_simulate(requests: Sequence[FleetRequest], cfg: FleetConfig,
                       assignment: dict[int, str]) -> list[FleetRequestResult]:
    """Run every replica of ``assignment`` (request id → replica name) independently."""
    by_replica: dict[str, list[FleetRequest]] = {}
    for r in requests:
        by_replica.setdefault(assignment[r.request_id], []).append(r)
    results = [res for name, reqs in by_replica.items() for res in reference_replica(reqs, cfg, name)]
    if len(results) != len(requests) or any(math.isnan(r.first_token_ms) for r in results):
        raise RuntimeError("reference simulation lost a request")
    return sorted(results, key=lambda r: r.request_id)
