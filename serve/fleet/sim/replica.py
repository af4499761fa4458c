"""One replica of the fleet simulation: its scheduler queue, running batch, KV reservation and prefix
cache (a block LRU, or a policy model at real bytes: ``policy_cache.py``), driven as a ``simpy`` process (the step model is in ``service_model.py``).

Speed: decode steps are not simulated one by one. With b running requests every step lasts
``decode_step_ms(b)``, so the replica sleeps until the next completion (k steps) — or until the VTC
scheduler's pick would change as counters grow — unless woken by an arrival, in which case it
resumes at the next step boundary ⌈elapsed / step⌉: the same schedule as the step-by-step reference
(``reference.py``; the tests compare them). New arrivals reach the scheduler at step boundaries.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import simpy

from serve.fleet.routing.block_cache import BlockLRUCache
from serve.fleet.scaling.scheduler import SCHEDULERS
from serve.fleet.sim.types import FleetConfig, FleetRequest, FleetRequestResult

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

    def result(self) -> FleetRequestResult:
        r = self.req
        return FleetRequestResult(
            request_id=r.request_id, klass=r.klass, replica=self.replica, status=self.status, arrival_ms=r.arrival_ms,
            admitted_ms=self.admitted_ms, start_ms=self.start_ms, first_token_ms=self.first_token_ms,
            finish_ms=self.finish_ms, hit_tokens=self.hit_tokens, input_length=r.input_length,
            output_length=r.output_length)


class Replica:
    """One replica process in ``env``: scheduler queue, running batch, KV reservation, block cache, as ``cfg``
    says; ``finish(job, status)`` is called once per request that ends here (the fleet's bookkeeping)."""

    def __init__(self, env: simpy.Environment, cfg: FleetConfig, name: str, finish: Callable[[Job, str], None]):
        self.env, self.cfg, self.name, self.finish = env, cfg, name, finish
        self.service = cfg.service
        cap = cfg.cache_capacity_blocks
        # a policy model at real bytes (cache_factory) or the block LRU of cache_capacity_blocks
        self.policy_cache = cfg.cache_factory() if cfg.cache_factory is not None else None
        self.cache = BlockLRUCache(cap) if cap != 0 and self.policy_cache is None else None
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

    def prefix_tokens(self, req) -> tuple[int, int]:
        """(hit tokens, tokens whose KV is cached) this replica holds of ``req``'s prompt now (pure): the
        policy's lookup, or the block LRU's leading run (the two agree: a block cache has no states)."""
        if self.policy_cache is not None:
            return self.policy_cache.policy.lookup(req)
        if self.cache is None:
            return 0, 0
        t = min(self.cache.lookup(req.hash_ids) * self.cfg.block_size, req.input_length)
        return t, t

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
            uncached = max(1, job.input_length - self.prefix_tokens(job.req)[0])
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
                self.finish(job, "aborted")
            admitted = self._admit()
            if admitted:
                parts = []
                for job in admitted:
                    job.state, job.start_ms = "prefill", env.now
                    job.hit_tokens = (self.policy_cache.start(job.req) if self.policy_cache is not None
                                      else self.prefix_tokens(job.req)[0])
                    if self.cache is not None:
                        self.cache.touch(job.req.hash_ids[: job.hit_tokens // self.cfg.block_size])
                    parts.append((max(1, job.input_length - job.hit_tokens), job.hit_tokens))
                decoding = list(self.running) if getattr(svc, "mixed_steps", False) else []   # rows sharing the step
                if decoding:
                    ctx = sum(j.input_length + j.req.output_length - j.remaining for j in decoding) // len(decoding)
                    yield env.timeout(svc.mixed_step_ms(parts, len(decoding), ctx))
                else:
                    yield env.timeout(svc.prefill_batch_ms(parts))
                for job in decoding:
                    if job not in self.running:
                        continue
                    job.remaining -= 1
                    self.scheduler.on_decode(job.klass, 1)
                    if job.remaining == 0:
                        self.running.remove(job)
                        self._release(job)
                        self.finish(job, "completed")
                for job in admitted:
                    if self.cache is not None:
                        self.cache.insert(job.req.hash_ids)
                    if self.policy_cache is not None:
                        self.policy_cache.finish(job.req, job.hit_tokens)
                    if job.abort_requested:
                        self._release(job)
                        self.finish(job, "aborted")
                        continue
                    job.first_token_ms = env.now
                    job.remaining = job.req.output_length - 1
                    if job.remaining <= 0:
                        self._release(job)
                        self.finish(job, "completed")
                    else:
                        job.state = "running"
                        self.running.append(job)
                continue
            if self.running:
                context = sum(j.input_length + j.req.output_length - j.remaining for j in self.running)
                step = svc.decode_step_ms(len(self.running), context // len(self.running))
                k = min(j.remaining for j in self.running)
                if len(self.scheduler):  # a fair scheduler's pick can change as counters grow
                    growth: dict[str, float] = {}
                    for job in self.running:
                        growth[job.klass] = growth.get(job.klass, 0.0) + self.scheduler_output_price
                    flip = self.scheduler.steps_until_pick_changes(
                        {c: g / self.cfg.weights.get(c, 1.0) for c, g in growth.items()})
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
                        self.finish(job, "completed")
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
        if self.policy_cache is not None:
            self.policy_cache.check_integrity()
