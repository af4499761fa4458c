"""Discrete-event simulation of a fleet with ``simpy``: class buckets → router → replicas.

Flow of one request: arrival → its class's token bucket (FIFO wait; rejected if larger than the
bucket) → ``router.route`` (routing key = first ``routing_k`` blocks) → the replica's scheduler queue
(FCFS or VTC) → a prefill step (uncached tokens only; the prompt's blocks enter the replica's
:class:`BlockLRUCache` when it ends; first token) → decode steps → done. The step model is in
``service_model.py``.

Speed: decode steps are not simulated one by one. With b running requests every step lasts
``decode_step_ms(b)``, so the replica sleeps until the next completion (k steps) unless woken by an
arrival, in which case it resumes at the next step boundary ⌈elapsed / step⌉ — the same schedule as
the step-by-step reference (``sim_reference.py``; the tests compare them).

Scale events: "add" starts an empty replica; "remove" takes a replica out of the router, re-routes
its queued (not yet started) requests and lets its running ones finish. Aborts (``abort_ms``) remove
a request wherever it is (bucket queue, replica queue, or at the next step boundary if running).
Every request ends exactly once (``check_integrity``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

import simpy

from serve.fleet import make_router
from serve.fleet.block_cache import BlockLRUCache
from serve.fleet.budgets import TokenBucket
from serve.fleet.hashing import routing_key
from serve.fleet.router import RouteQuery
from serve.fleet.scheduler import SCHEDULERS
from serve.fleet.sim_types import Admission, FleetConfig, FleetRequest, RequestResult, SimResult

NAN = float("nan")


class Job:
    """Mutable state of one request during the simulation."""

    __slots__ = ("req", "request_id", "klass", "input_length", "replica", "status", "admitted_ms", "start_ms",
                 "first_token_ms", "finish_ms", "hit_tokens", "remaining", "abort_requested", "state")

    def __init__(self, req: FleetRequest):
        self.req = req
        self.request_id = req.request_id
        self.klass = req.klass
        self.input_length = req.input_length
        self.replica = ""
        self.status = ""
        self.admitted_ms = self.start_ms = self.first_token_ms = self.finish_ms = NAN
        self.hit_tokens = 0
        self.remaining = 0
        self.abort_requested = False
        self.state = "new"  # new → gate → queued → prefill → running → done

    def result(self) -> RequestResult:
        r = self.req
        return RequestResult(r.request_id, r.klass, self.replica, self.status, r.arrival_ms, self.admitted_ms,
                             self.start_ms, self.first_token_ms, self.finish_ms, self.hit_tokens,
                             r.input_length, r.output_length)


class Replica:
    """One replica process: scheduler queue, running batch, KV reservation, block cache."""

    def __init__(self, fleet: FleetSim, name: str):
        self.fleet, self.name, self.env = fleet, name, fleet.env
        cfg = fleet.cfg
        self.service = cfg.service
        cap = cfg.cache_capacity_blocks
        self.cache = BlockLRUCache(cap) if cap != 0 else None
        self.scheduler = SCHEDULERS[cfg.scheduler](cfg.weights)
        self.scheduler_output_price = getattr(self.scheduler, "OUTPUT_PRICE", 0.0)
        self.running: list[Job] = []
        self.inbox: list[Job] = []  # arrived since the last step boundary (the scheduler sees them there)
        self.kv_used = 0
        self.accepting = True
        self.wake = self.env.event()
        self.env.process(self.run())

    def submit(self, job: Job) -> None:
        job.state = "queued"
        self.inbox.append(job)
        self.poke()

    def remove_queued(self, job: Job) -> bool:
        """Take a queued (not started) request out (abort); returns whether it was queued here."""
        if job in self.inbox:
            self.inbox.remove(job)
            return True
        return self.scheduler.remove(job)

    def drain_queued(self) -> list[Job]:
        """Take every queued request out (replica removal), in arrival order."""
        jobs = self.scheduler.drain() + self.inbox
        self.inbox = []
        return sorted(jobs, key=lambda j: (j.req.arrival_ms, j.request_id))

    def poke(self) -> None:
        if not self.wake.triggered:
            self.wake.succeed()

    def _hit_tokens(self, job: Job) -> int:
        if self.cache is None:
            return 0
        return min(self.cache.lookup(job.req.hash_ids) * self.fleet.cfg.block_size, job.input_length)

    def _admit(self) -> list[Job]:
        svc = self.service
        batch: list[Job] = []
        batch_tokens = 0

        def fits(job: Job) -> bool:
            nonlocal batch_tokens
            if len(self.running) + len(batch) >= svc.max_batch_requests:
                return False
            need = job.req.input_length + job.req.output_length
            alone = not self.running and not batch  # an oversized request still runs alone
            if svc.kv_capacity_tokens is not None and self.kv_used + need > svc.kv_capacity_tokens and not alone:
                return False
            uncached = max(1, job.input_length - self._hit_tokens(job))
            if svc.max_prefill_tokens_per_step is not None and batch and \
                    batch_tokens + uncached > svc.max_prefill_tokens_per_step:
                return False
            batch.append(job)
            batch_tokens += uncached
            self.kv_used += need
            return True

        self.scheduler.pop_admissible(fits)
        return batch

    def _release(self, job: Job) -> None:
        self.kv_used -= job.req.input_length + job.req.output_length

    def run(self):
        env, svc = self.env, self.service
        while True:
            if self.wake.triggered:
                self.wake = env.event()
            for job in self.inbox:  # step boundary: the scheduler sees new arrivals now
                self.scheduler.push(job)
            self.inbox.clear()
            for job in [j for j in self.running if j.abort_requested]:
                self.running.remove(job)
                self._release(job)
                self.fleet.finish(job, "aborted")
            admitted = self._admit()
            if admitted:
                uncached = 0
                for job in admitted:
                    job.state, job.start_ms = "prefill", env.now
                    job.hit_tokens = self._hit_tokens(job)
                    if self.cache is not None:
                        self.cache.touch(job.req.hash_ids[: job.hit_tokens // self.fleet.cfg.block_size])
                    uncached += max(1, job.input_length - job.hit_tokens)
                yield env.timeout(svc.prefill_ms(uncached))
                for job in admitted:
                    if self.cache is not None:
                        self.cache.insert(job.req.hash_ids)
                    if job.abort_requested:
                        self._release(job)
                        self.fleet.finish(job, "aborted")
                        continue
                    job.first_token_ms = env.now
                    job.remaining = job.req.output_length - 1
                    if job.remaining <= 0:
                        self._release(job)
                        self.fleet.finish(job, "completed")
                    else:
                        job.state = "running"
                        self.running.append(job)
                continue
            if self.running:
                step = svc.decode_step_ms(len(self.running))
                k = min(j.remaining for j in self.running)
                if len(self.scheduler):  # a fair scheduler's pick can change as counters grow
                    growth: dict[str, float] = {}
                    for job in self.running:
                        growth[job.klass] = growth.get(job.klass, 0.0) + self.scheduler_output_price
                    flip = self.scheduler.steps_until_pick_changes(
                        {c: g / self.fleet.cfg.weights.get(c, 1.0) for c, g in growth.items()})
                    k = min(k, flip) if flip is not None else k
                start, end = env.now, env.now + k * step
                yield env.timeout(k * step) | self.wake
                if env.now >= end:
                    steps = k
                else:
                    steps = min(k, math.ceil((env.now - start) / step))
                    if steps > 0 and start + steps * step > env.now:
                        yield env.timeout(start + steps * step - env.now)
                if steps:
                    for job in self.running:
                        job.remaining -= steps
                        self.scheduler.on_decode(job.klass, steps)
                    for job in [j for j in self.running if j.remaining == 0]:
                        self.running.remove(job)
                        self._release(job)
                        self.fleet.finish(job, "completed")
                continue
            if not self.accepting and len(self.scheduler) == 0 and not self.inbox:
                return
            yield self.wake

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        assert self.kv_used == sum(j.req.input_length + j.req.output_length for j in self.running)
        assert len(self.running) <= self.service.max_batch_requests
        if self.cache is not None:
            self.cache.check_integrity()


class FleetSim:
    """Builds the simpy environment for one run; use :func:`simulate`."""

    def __init__(self, requests: Sequence[FleetRequest], cfg: FleetConfig):
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request_id values must be unique")
        self.cfg = cfg
        self.env = simpy.Environment()
        names = [f"replica-{i}" for i in range(cfg.num_replicas)]
        self.router = make_router(cfg.router, names, **cfg.router_params)
        self.replicas = {n: Replica(self, n) for n in names}
        self.jobs = [Job(r) for r in sorted(requests, key=lambda r: (r.arrival_ms, r.request_id))]
        classes = {c.name: c for c in cfg.classes}
        self.buckets = {c.name: TokenBucket(c.rate_tokens_per_s, c.burst_tokens) for c in cfg.classes if c.has_bucket}
        self.gate_queues: dict[str, deque[Job]] = {k: deque() for k in self.buckets}
        self.gate_busy: dict[str, bool] = dict.fromkeys(self.buckets, False)
        self.admissions: list[Admission] = []
        self.finished = 0
        self._classes = classes

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
        query = RouteQuery(routing_key(job.req.hash_ids, self.cfg.routing_k), job.req.hash_ids)
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
                self.replicas[event.replica] = Replica(self, event.replica)
            else:
                self.router.remove_replica(event.replica)
                replica = self.replicas[event.replica]
                replica.accepting = False
                for job in replica.drain_queued():
                    self.router.on_finish(event.replica)
                    self.dispatch(job)
                replica.poke()

    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        self.env.process(self.arrivals(progress))
        if self.cfg.scale_events:
            self.env.process(self.scaling())
        self.env.run()
        self.check_integrity()
        if progress is not None:
            progress(1.0)
        results = sorted((j.result() for j in self.jobs), key=lambda r: r.request_id)
        return SimResult(results, self.admissions, self.cfg)

    def check_integrity(self) -> None:
        """Every request finished exactly once; no load, queue or KV left; buckets within budget."""
        assert self.finished == len(self.jobs) and all(j.status for j in self.jobs), "a request never finished"
        for replica in self.replicas.values():
            replica.check_integrity()
            assert not replica.running and len(replica.scheduler) == 0 and not replica.inbox
        assert all(self.router.load(r) == 0 for r in self.router.replicas)
        for bucket in self.buckets.values():
            bucket.check_integrity(self.env.now)


def simulate(requests: Sequence[FleetRequest], cfg: FleetConfig,
             progress: Callable[[float], None] | None = None) -> SimResult:
    """Run the fleet simulation; ``progress(fraction)`` is called as arrivals are processed.

    Raises ValueError for duplicate request ids or an invalid config; RuntimeError if the
    bookkeeping breaks (a request finishing twice)."""
    return FleetSim(requests, cfg).run(progress)
