"""Discrete-event simulation of a fleet with ``simpy``: class buckets → router → replicas.

Flow of one request: arrival → its class's token bucket (FIFO wait; rejected if larger than the
bucket) → ``router.route`` (routing key = first ``routing_k`` blocks) → the replica's scheduler queue
(FCFS or VTC) → a prefill step (uncached tokens only; the prompt's blocks enter the replica's
:class:`BlockLRUCache` when it ends; first token) → decode steps → done. The step model is in
``service_model.py``.

Replicas (``replica.py``) skip ahead over decode steps; the result equals the step-by-step
reference (``reference.py``).

Scale events: "add" starts an empty replica; "remove" takes a replica out of the router, re-routes
its queued (not yet started) requests and lets its running ones finish. Aborts (``abort_ms``) remove
a request wherever it is (bucket queue, replica queue, or at the next step boundary if running).
Every request ends exactly once (``check_integrity``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from numbers import Integral, Real

import simpy

from serve.fleet.routing.hashing import routing_key
from serve.fleet.routing.prefix_score import PREFIX_SCORE_ROUTERS, PrefixScoreRouter
from serve.fleet.routing.registry import make_router, replica_names
from serve.fleet.routing.router import RouteQuery
from serve.fleet.scaling.budgets import TokenBucket
from serve.fleet.sim.replica import Job, Replica
from serve.fleet.sim.types import Admission, FleetConfig, FleetRequest, FleetSimResult
from serve.traces.limits import MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS


class FleetSim:
    """Builds the simpy environment for one run; use :func:`simulate`."""

    def __init__(self, requests: Sequence[FleetRequest], cfg: FleetConfig):
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request_id values must be unique")
        for r in requests:
            check_request(r)
        self.cfg = cfg
        self.env = simpy.Environment()
        names = replica_names(cfg.num_replicas)
        if cfg.router in PREFIX_SCORE_ROUTERS:
            self.router = PrefixScoreRouter(names, lambda name, req: self.replicas[name].prefix_tokens(req),
                                            PREFIX_SCORE_ROUTERS[cfg.router])
        else:
            self.router = make_router(cfg.router, names, **cfg.router_params)
        self.replicas = {n: Replica(self.env, cfg, n, self.finish) for n in names}
        self.jobs = [Job(r) for r in sorted(requests, key=lambda r: (r.arrival_ms, r.request_id))]
        self.buckets = {c.name: TokenBucket(c.rate_tokens_per_s, c.burst_tokens) for c in cfg.classes if c.has_bucket}
        self.gate_queues: dict[str, deque[Job]] = {k: deque() for k in self.buckets}
        self.gate_busy: dict[str, bool] = dict.fromkeys(self.buckets, False)
        self.admissions: list[Admission] = []
        self.finished = 0

    # --- request life cycle -------------------------------------------------------------
    def finish(self, job: Job, status: str) -> None:
        if job.status:
            raise RuntimeError(f"request {job.request_id} finished twice ({job.status}, then {status})")
        job.status, job.finish_ms, job.state = status, self.env.now, "done"
        if job.replica:
            self.router.on_finish(job.replica)
        self.finished += 1

    def dispatch(self, job: Job) -> None:
        if math.isnan(job.admitted_ms):
            job.admitted_ms = self.env.now
        query = RouteQuery(routing_key(job.req.hash_ids, self.cfg.routing_k), job.req.hash_ids, job.req)
        job.replica = self.router.route(query)
        self.router.on_start(job.replica)
        self.replicas[job.replica].submit(job)

    def enter(self, job: Job) -> None:
        bucket = self.buckets.get(job.klass)
        if bucket is None:
            self.dispatch(job)
            return
        cost = job.req.input_length + job.req.output_length
        if cost > bucket.burst_tokens:
            self.finish(job, "rejected")
            return
        job.state = "gate"
        self.gate_queues[job.klass].append(job)
        if not self.gate_busy[job.klass]:
            self.env.process(self.gate(job.klass))

    def gate(self, klass: str):
        bucket, queue = self.buckets[klass], self.gate_queues[klass]
        self.gate_busy[klass] = True
        while queue:
            job = queue[0]
            cost = job.req.input_length + job.req.output_length
            wait = bucket.wait_ms(self.env.now, cost)
            if wait > 1e-9:
                yield self.env.timeout(wait)
                continue
            bucket.take(self.env.now, cost)
            queue.popleft()
            self.admissions.append(Admission(self.env.now, klass, cost))
            self.dispatch(job)
        self.gate_busy[klass] = False

    def abort(self, job: Job):
        yield self.env.timeout(job.req.abort_ms - self.env.now)
        if job.state == "gate":
            self.gate_queues[job.klass].remove(job)
            self.finish(job, "aborted")
        elif job.state == "queued":
            if not self.replicas[job.replica].remove_queued(job):
                raise RuntimeError(f"request {job.request_id} queued but not in its replica's queue")
            self.finish(job, "aborted")
        elif job.state in ("prefill", "running"):
            job.abort_requested = True
            self.replicas[job.replica].poke()

    # --- processes --------------------------------------------------------------------
    def arrivals(self, progress: Callable[[float], None] | None):
        n = len(self.jobs)
        for i, job in enumerate(self.jobs):
            delay = job.req.arrival_ms - self.env.now
            if delay > 0:
                yield self.env.timeout(delay)
            if job.req.abort_ms is not None:
                self.env.process(self.abort(job))
            self.enter(job)
            if progress is not None and (i + 1) % 500 == 0:
                progress((i + 1) / n)

    def scaling(self):
        for event in sorted(self.cfg.scale_events, key=lambda e: e.time_ms):
            if event.time_ms > self.env.now:
                yield self.env.timeout(event.time_ms - self.env.now)
            if event.action == "add":
                if event.replica in self.replicas:
                    raise ValueError(f"replica name '{event.replica}' already used in this run")
                self.router.add_replica(event.replica)
                self.replicas[event.replica] = Replica(self.env, self.cfg, event.replica, self.finish)
            else:
                self.router.remove_replica(event.replica)
                replica = self.replicas[event.replica]
                replica.accepting = False
                for job in replica.drain_queued():
                    self.router.on_finish(event.replica)
                    self.dispatch(job)
                replica.poke()

    def run(self, progress: Callable[[float], None] | None = None) -> FleetSimResult:
        self.env.process(self.arrivals(progress))
        if self.cfg.scale_events:
            self.env.process(self.scaling())
        self.env.run()
        self.check_integrity()
        if progress is not None:
            progress(1.0)
        results = sorted((j.result() for j in self.jobs), key=lambda r: r.request_id)
        caches = ({n: r.policy_cache for n, r in self.replicas.items()} if self.cfg.cache_factory is not None
                  else None)
        for replica in self.replicas.values():
            # the run's objects form reference cycles (simpy processes, replica <-> fleet) that only a full garbage
            # collection frees; the caches, its largest part, leave them so they go with the result
            replica.policy_cache = replica.cache = None
        return FleetSimResult(results, self.admissions, self.cfg, caches)

    def check_integrity(self) -> None:
        """Every request finished exactly once; no load, queue or KV left; buckets within budget."""
        assert self.finished == len(self.jobs) and all(j.status for j in self.jobs), "a request never finished"
        for replica in self.replicas.values():
            replica.check_integrity()
            assert not replica.running and len(replica.scheduler) == 0 and not replica.inbox
        assert all(self.router.load(r) == 0 for r in self.router.replicas)
        for bucket in self.buckets.values():
            bucket.check_integrity(self.env.now)


def check_request(r: FleetRequest) -> None:
    """Refuse, before anything runs, a request the simulation could not finish in any sane time or whose sizes are
    not token counts: ``input_length`` / ``output_length`` must be ints in [0, :data:`serve.traces.limits.
    MAX_INPUT_TOKENS`] / [0, :data:`serve.traces.limits.MAX_OUTPUT_TOKENS`] (the limits every trace loader applies;
    a 10^12-token output was "completed" some 200 years of simulated time later, and every request behind it
    waited), ``arrival_ms`` a finite number. Raises ValueError naming the request, the field and the limit."""
    for name, value, limit in (("input_length", r.input_length, MAX_INPUT_TOKENS),
                               ("output_length", r.output_length, MAX_OUTPUT_TOKENS)):
        if isinstance(value, bool) or not isinstance(value, Integral) or not 0 <= value <= limit:
            raise ValueError(f"request {r.request_id}: {name} must be an int in [0, {limit:,}] tokens (the limit every "
                             f"trace loader applies to one request), got {value!r}: refused before the simulation runs")
    if not isinstance(r.arrival_ms, Real) or not math.isfinite(r.arrival_ms):
        raise ValueError(f"request {r.request_id}: arrival_ms must be a finite number of ms, got {r.arrival_ms!r}")


def simulate(requests: Sequence[FleetRequest], cfg: FleetConfig,
             progress: Callable[[float], None] | None = None) -> FleetSimResult:
    """Run the fleet simulation; ``progress(fraction)`` is called as arrivals are processed.

    Raises ValueError for duplicate request ids, a request outside the limits (:func:`check_request`, before
    anything runs) or an invalid config; RuntimeError if the bookkeeping breaks (a request finishing twice)."""
    return FleetSim(requests, cfg).run(progress)
