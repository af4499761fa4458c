"""Inputs and outputs of the fleet simulation (``simulation.py``) and its reference (``reference.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from serve.errors import check_int, check_positive
from serve.fleet.routing.registry import check_options
from serve.fleet.scaling.budgets import PriorityClass
from serve.fleet.sim.service_model import ServiceModel
from serve.traces.limits import MAX_INPUT_TOKENS, MAX_TRACE_BLOCKS
from serve.traces.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest

if TYPE_CHECKING:
    from serve.fleet.routing.policy_cache import PolicyReplicaCache


class FleetRequest(NamedTuple):
    """One request entering the fleet. ``arrival_ms``; ``klass`` names a :class:`PriorityClass`;
    ``abort_ms`` (absolute time) makes the client cancel it then if it has not finished."""

    request_id: int
    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    klass: str = "standard"
    abort_ms: float | None = None


class ScaleAt(NamedTuple):
    """At ``time_ms``, ``action`` ("add" / "remove") replica ``replica``."""

    time_ms: float
    action: str
    replica: str


@dataclass(frozen=True)
class FleetConfig:
    """A fleet: ``num_replicas`` named ``replica-i``, a router (``router`` name + ``router_params``)
    on the first ``routing_k`` blocks, a per-replica ``scheduler`` ("fcfs" / "vtc"), a ``service``
    model, per-replica block caches of ``cache_capacity_blocks`` (None = unlimited, 0 = no cache),
    priority ``classes`` (weights and token buckets) and ``scale_events``. ``cache_factory``: when set,
    each replica's cache is ``cache_factory()`` (a policy model at real bytes,
    :class:`serve.fleet.routing.policy_cache.PolicyReplicaCache`) instead of the block LRU. ``service``: a
    :class:`ServiceModel` or :class:`serve.fleet.sim.roofline_service.RooflineService`."""

    service: ServiceModel
    num_replicas: int = 8
    router: str = "ring"
    router_params: dict = field(default_factory=dict)
    routing_k: int = 2
    scheduler: str = "fcfs"
    classes: tuple[PriorityClass, ...] = ()
    cache_capacity_blocks: int | None = None
    block_size: int = MOONCAKE_BLOCK_TOKENS
    scale_events: tuple[ScaleAt, ...] = ()
    cache_factory: Callable[[], PolicyReplicaCache] | None = None

    def __post_init__(self):
        check_options(self.router, self.router_params, "router_params")
        check_int("num_replicas", self.num_replicas)
        if self.routing_k < 1:
            raise ValueError(f"routing_k must be >= 1 block, got {self.routing_k}")
        if self.scheduler not in ("fcfs", "vtc"):
            raise ValueError(f"scheduler must be 'fcfs' or 'vtc', got '{self.scheduler}'")
        if self.cache_capacity_blocks is not None and self.cache_capacity_blocks < 0:
            raise ValueError("cache_capacity_blocks must be >= 0 or None")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"class names must be unique, got {names}")
        for e in self.scale_events:
            if e.action not in ("add", "remove"):
                raise ValueError(f"scale event action must be 'add' or 'remove', got '{e.action}'")

    @property
    def weights(self) -> dict[str, float]:
        return {c.name: c.weight for c in self.classes}


class FleetRequestResult(NamedTuple):
    """Outcome of one request (times in ms, absolute; NaN when the stage never happened).

    ``status``: "completed", "aborted" or "rejected" (larger than its class bucket). ``replica`` is
    where it ran ("" if never dispatched). ``admitted_ms`` = passed its class bucket; ``start_ms`` =
    its prefill step began; ``hit_tokens`` = prompt tokens served from the replica's cache.
    """

    request_id: int
    klass: str
    replica: str
    status: str
    arrival_ms: float
    admitted_ms: float
    start_ms: float
    first_token_ms: float
    finish_ms: float
    hit_tokens: int
    input_length: int
    output_length: int

    @property
    def queue_wait_ms(self) -> float:
        return self.start_ms - self.arrival_ms

    @property
    def ttft_ms(self) -> float:
        return self.first_token_ms - self.arrival_ms

    @property
    def e2e_ms(self) -> float:
        return self.finish_ms - self.arrival_ms


class Admission(NamedTuple):
    """A class bucket let ``tokens`` through at ``time_ms``."""

    time_ms: float
    klass: str
    tokens: int


class FleetSimResult(NamedTuple):
    """``results`` in request-id order; ``admissions`` (bucket log); the ``config`` that produced them;
    ``replica_caches``: each replica's policy cache (its counters and peak bytes) when the config has a
    ``cache_factory``, else None."""

    results: list[FleetRequestResult]
    admissions: list[Admission]
    config: FleetConfig
    replica_caches: dict | None = None     # replica name -> PolicyReplicaCache (policy-model runs)

    def column(self, name: str, status: str | None = "completed", klass: str | None = None) -> np.ndarray:
        """Array of one field or property over the results, filtered by status and class."""
        return np.array([getattr(r, name) for r in self.results
                         if (status is None or r.status == status) and (klass is None or r.klass == klass)],
                        dtype=float)

    def throughput_rps(self) -> float:
        """Completed requests / (last finish − first arrival), requests per second."""
        done = [r for r in self.results if r.status == "completed"]
        if not done:
            return 0.0
        span = max(r.finish_ms for r in done) - min(r.arrival_ms for r in self.results)
        return len(done) / (span / 1000.0) if span > 0 else float("inf")

    def token_hit_ratio(self) -> float:
        done = [r for r in self.results if r.status == "completed"]
        return sum(r.hit_tokens for r in done) / max(1, sum(r.input_length for r in done))


def percentile(values: np.ndarray, q: float) -> float:
    """``q``-th percentile (linear interpolation, numpy default); NaN for an empty array."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def requests_from_trace(trace: Sequence[TraceRequest], klass: str = "standard", time_scale: float = 1.0,
                        max_requests: int | None = None, id_offset: int = 0) -> list[FleetRequest]:
    """Turn trace requests into fleet requests of one class; ``time_scale`` stretches (>1) or
    compresses (<1) arrival times; ``max_requests`` keeps the first ones."""
    check_positive("time_scale", time_scale)
    picked = trace[:max_requests] if max_requests is not None else trace
    return [FleetRequest(id_offset + i, r.timestamp_ms * time_scale, r.input_length, r.output_length,
                         r.hash_ids, klass) for i, r in enumerate(picked)]


def fresh_block_requests(raw: Iterable[tuple[float, int, int, str]],
                         block_size: int = MOONCAKE_BLOCK_TOKENS) -> list[FleetRequest]:
    """Fleet requests with ids 0..N-1 in the given order from ``(arrival_ms, prompt_tokens, output_tokens,
    klass)`` tuples; every prompt gets ceil(prompt_tokens / block_size) fresh block ids (nothing shared).

    Raises ValueError (before building anything) for a prompt outside [0, ``MAX_INPUT_TOKENS``] tokens
    or more than ``MAX_TRACE_BLOCKS`` blocks in all: the ids are materialised, so their count is bounded."""
    raw = list(raw)
    total = 0
    for i, (_, prompt, _, _) in enumerate(raw):
        if not 0 <= prompt <= MAX_INPUT_TOKENS:
            raise ValueError(f"request {i}: prompt of {prompt:,} tokens is outside [0, {MAX_INPUT_TOKENS:,}]")
        total += -(-prompt // block_size)
    if total > MAX_TRACE_BLOCKS:
        raise ValueError(f"{len(raw):,} requests need {total:,} blocks, more than the limit of {MAX_TRACE_BLOCKS:,}")
    out, next_id = [], 0
    for i, (t, prompt, output, klass) in enumerate(raw):
        n = -(-prompt // block_size)
        out.append(FleetRequest(i, t, prompt, output, tuple(range(next_id, next_id + n)), klass))
        next_id += n
    return out
