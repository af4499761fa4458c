"""Page 14 in one call: the whole fleet chain (router -> replica scheduler -> prefix cache -> continuous
batching) on one trace, once per routing policy (:func:`fleet_simulation`).

Replicas (``service_model``): "roofline" (default) = a real Kimi model on ``tp`` x ``gpu`` per replica,
step times from the roofline (:class:`serve.fleet.sim.roofline_service.RooflineService`) and a prefix cache
that is a production policy model at real bytes (:class:`serve.fleet.routing.policy_cache.PolicyReplicaCache`
over :func:`lab.real_scale.make_policy`) under ``budget_fraction`` of the HBM the weights leave; the
running requests' KV has the rest. "a10g" = the VTC artifact's calibration (the validated setup that
reproduces the VTC measurements), "cpu" = our engine timed on this CPU; both with a block LRU cache of
``capacity`` blocks and the stated (assumed) speed-up. The offered load is an arrival rate (``arrival_rps``):
the trace re-timed (:func:`retime`); :func:`load_sweep` runs one setup at several rates (TTFT against load)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from lab.fleet import (
    ANCHORS,
    default_service,
    ideal_ratio,
    page_trace,
    scale_events_for,
    simulate_policies,
)
from lab.real_scale import BUDGET_FRACTIONS, HARDWARE, MODELS, TP_SIZES, policy_title, preset_title  # noqa: F401  (re-exported: the replica widgets' choices)
from serve.errors import check_choice, check_positive
from serve.fleet.real_replica import RealReplica  # re-exported too: the pages build it
from serve.fleet.routing.prefix_score import PREFIX_SCORE_ROUTERS
from serve.fleet.routing.registry import ROUTERS
from serve.fleet.scaling.budgets import PriorityClass
from serve.fleet.sim.service_model import cpu_engine_preset, measure_cpu_engine
from serve.fleet.sim.types import FleetConfig
from serve.fleet.sim.vtc import on_off_less_service
from serve.scale.policies import CACHE_POLICIES
from serve.traces.mooncake import TraceRequest

ROUTING_POLICIES = tuple(ROUTERS) + tuple(PREFIX_SCORE_ROUTERS)
SERVICE_MODELS = {"real model · roofline, policy cache at real bytes": "roofline",
                  "A10G · Llama-7B (VTC artifact, measured)": "a10g",
                  "this CPU · our KDA demo engine (measured now)": "cpu"}
REAL_DEFAULTS = dataclasses.asdict(RealReplica())   # the replica widgets' defaults, by field
BUDGET_OPTIONS = tuple(BUDGET_FRACTIONS)
CAPACITIES = ("0", "500", "2000", "8000", "unlimited")  # cache per replica options (512-token blocks)
SCALE_EVENTS = ("none", "add", "remove")  # at half the trace's duration
SCHEDULERS = ("fcfs", "vtc")
# Offered load: the trace re-timed to this many requests per second across the fleet (its own timestamps: None).
# At the synthetic trace's own 3.4 req/s, 8 real-model replicas hold ~0.2 requests each and every routing policy
# gives the same TTFT up to its cache hits; from ~40 req/s queues form and balance starts to matter.
ARRIVAL_RATES = (5, 10, 20, 30, 40, 50, 60, 80, 100, 150, 200)   # requests / s, fleet-wide
DEFAULT_ARRIVAL_RPS = 50   # where the policies' TTFTs part (8 Kimi-Linear replicas on 8 x H200 serve ~55-70 req/s)
SWEEP_RATES = (10, 20, 40, 50, 60, 100)   # the load sweep's arrival rates (requests / s): slider values, the default among them
DECODE_SHARE = 5 / 8  # decode speed-up = this share of the prefill speed-up (as page 13's assumed 8x / 5x)
KV_CAPACITY_TOKENS = 400_000  # KV room per replica (tokens), as page 13
VNODES = 160  # ring virtual nodes per replica (ketama's default)
CLASSES = (PriorityClass("vip", 4.0), PriorityClass("standard", 1.0))  # VTC weights of the two classes
# What the page shows for the code names (the frames keep the code names; routers: lab.fleet.DISPLAY_NAMES).
CLASS_LABELS = {"vip": "VIP", "standard": "Standard", "all": "All"}
SCHEDULER_LABELS = {"fcfs": "FCFS", "vtc": "VTC (fair share)"}
CACHE_POLICY_LABELS = {p: policy_title(p) for p in CACHE_POLICIES}   # as each engine spells its policy


def replica_title(replica: RealReplica, cache: bool = True) -> str:
    """A real-scale replica as a reader names it, e.g. "ours cache on Kimi-Linear-48B-A3B, 8 × H200" (the cache
    part only with ``cache``)."""
    named = f"{CACHE_POLICY_LABELS[replica.cache_policy]} cache on " if cache else ""
    return f"{named}{preset_title(replica.model)}, {replica.tp} × {replica.gpu}"


BOUND_C = 1.25  # load bound factor c of serve.fleet.routing.bounded_load.BoundedLoadRouter (its default, used here)


@dataclass(frozen=True)
class FleetSimulation:
    """Everything page 14 draws.

    per_request: one row per (policy, request) with queue_wait_ms, ttft_ms, e2e_ms; summary: per (policy,
    class and "all"): hit ratio, TTFT P50/P99 (ms), queue wait P99 (ms), max/mean requests per replica,
    throughput (req/s); in_flight: per policy, the in-flight load each request met when routed
    (:func:`in_flight_at_routing`); ideal_ratio: token hit ratio of one infinite shared cache; num_requests: trace
    length; service_source: what the replicas are calibrated on; note: what the budget cut from an upload;
    anchors: published figures with sources. With policy caches ("roofline"), kda: one row per policy:
    ``hit_ratio``, ``ideal_ratio`` (block ideal), ``lost_to_missing_state`` (prompt tokens whose KV the
    serving replica held but no state let it reuse, fraction of prompt tokens), ``state_gb`` / ``kv_gb``
    (held at the replica's peak, mean over replicas), ``ttft_p50_ms`` / ``ttft_p99_ms`` (all classes),
    ``throughput_rps``; replica_bytes: one row per (policy, replica): ``kv_gb``, ``state_gb``,
    ``running_gb`` held when the replica's cached KV + states peaked (they add up to at most ``budget_gb``,
    the replica's cache budget; :attr:`serve.fleet.routing.policy_cache.PolicyReplicaCache.held_at_peak`). None
    otherwise."""

    per_request: pd.DataFrame
    summary: pd.DataFrame
    in_flight: pd.DataFrame
    ideal_ratio: float
    num_requests: int
    service_source: str
    note: str
    anchors: dict | None = None
    kda: pd.DataFrame | None = None
    replica_bytes: pd.DataFrame | None = None


def fleet_simulation(policies: Sequence[str], num_requests: int, num_replicas: int, k: int, capacity: str,
                     scheduler: str, vip_percent: int, scale: str, speedup: float, service_model: str,
                     upload: bytes | None = None, upload_name: str = "uploaded file",
                     progress: Callable[[float], None] | None = None, replica: RealReplica = RealReplica(),
                     arrival_rps: float | None = None) -> FleetSimulation:
    """Simulate the page trace (``upload`` or the synthetic one) once per policy in ``policies``:
    ``num_replicas`` replicas of ``service_model`` (module docstring; "roofline": ``replica``, its step times
    and its prefix cache, :class:`serve.fleet.real_replica.RealReplica`; "a10g" / "cpu": prefill
    ``speedup`` x and decode ``speedup * DECODE_SHARE`` x (at least 1), ``capacity`` blocks of cache each
    (:data:`CAPACITIES`)), every ``100 / vip_percent``-th request VIP, and an optional scale event at half
    time. ``arrival_rps`` (requests / s, fleet-wide): the offered load, the trace re-timed to that mean rate
    (:func:`retime`); None keeps the trace's own timestamps. ``progress(fraction)`` is called as the runs advance.

    Raises: ValueError for no, unknown or repeated policies (each policy's rows are keyed by its name), an unknown
    option, a non-positive ``arrival_rps``, or a bad upload (TraceFormatError)."""
    if not policies or any(p not in ROUTING_POLICIES for p in policies):
        raise ValueError(f"policies must be a non-empty subset of {ROUTING_POLICIES}, got {list(policies)}")
    repeated = sorted({p for p in policies if list(policies).count(p) > 1})
    if repeated:
        raise ValueError(f"policies must not repeat a policy, got {', '.join(map(repr, repeated))} more than once")
    for name, value, allowed in (("capacity", capacity, CAPACITIES), ("scheduler", scheduler, SCHEDULERS),
                                 ("scale", scale, SCALE_EVENTS), ("service_model", service_model,
                                                                  tuple(SERVICE_MODELS.values()))):
        check_choice(name, value, allowed)
    if not 0 <= vip_percent <= 100:
        raise ValueError(f"vip_percent must be in [0, 100], got {vip_percent}")
    if arrival_rps is not None:
        check_positive("arrival_rps", arrival_rps)
    trace, note, _ = page_trace(upload, num_requests, name=upload_name)
    if arrival_rps is not None:
        trace = retime(trace, arrival_rps)
    cache_factory = None
    if service_model == "roofline":
        service, cache_factory = replica.service(), replica.cache
    else:
        base = on_off_less_service() if service_model == "a10g" else cpu_engine_preset(measure_cpu_engine())
        service = default_service(base, float(speedup), max(1.0, speedup * DECODE_SHARE), KV_CAPACITY_TOKENS)
    cfg = FleetConfig(service=service, num_replicas=num_replicas, routing_k=k, scheduler=scheduler,
                      router_params={"vnodes": VNODES},
                      cache_capacity_blocks=None if capacity == "unlimited" else int(capacity), classes=CLASSES,
                      scale_events=scale_events_for(num_replicas, None if scale == "none" else scale,
                                                    trace[-1].timestamp_ms / 2), cache_factory=cache_factory)
    every = round(100 / vip_percent) if vip_percent else 0

    def class_of(i: int) -> str:
        return "vip" if every and i % every == 0 else "standard"

    counters: dict[str, tuple] = {}
    per_request, summary = simulate_policies(trace, list(policies), cfg, class_of, progress=progress,
                                             on_run=lambda policy, sim: counters.update({policy: cache_counters(sim)})
                                             if cache_factory else None)
    kda, replica_bytes = kda_metrics(counters, summary, trace) if cache_factory else (None, None)
    events = cfg.scale_events
    before = frozenset(f"replica-{i}" for i in range(num_replicas))
    after = before if not events else (before | {events[0].replica} if events[0].action == "add"
                                       else before - {events[0].replica})

    def replicas_at(t_ms: float) -> frozenset[str]:
        return after if events and t_ms >= events[0].time_ms else before

    from_ms = events[0].time_ms if events and events[0].action == "remove" else -math.inf
    in_flight = pd.concat([in_flight_at_routing(g, replicas_at, from_ms=from_ms).assign(policy=name)
                           for name, g in per_request.groupby("policy", sort=False)], ignore_index=True)
    return FleetSimulation(per_request=per_request, summary=summary, in_flight=in_flight,
                           ideal_ratio=ideal_ratio(trace), num_requests=len(trace), service_source=service.source,
                           note=note, anchors=dict(ANCHORS), kda=kda, replica_bytes=replica_bytes)


def retime(trace: Sequence[TraceRequest], rate_rps: float) -> list[TraceRequest]:
    """``trace`` (sorted by ``timestamp_ms``) with its arrivals scaled in time so that its mean rate, (requests - 1)
    over the span from first to last arrival, is ``rate_rps`` requests / s: the gaps keep their relative sizes
    (bursts stay bursts) and the first arrival moves to 0 ms. Prompts, outputs and block ids are unchanged, so the
    cache hits a routing policy can reach are the same at every load. A trace of one request, or one whose arrivals
    all share one instant, comes back at 0 ms.

    Raises ValueError for a non-positive ``rate_rps``."""
    if not math.isfinite(check_positive("rate_rps", rate_rps)):
        raise ValueError(f"rate_rps must be finite, got {rate_rps!r}")
    if not trace:
        return []
    t0, span = trace[0].timestamp_ms, trace[-1].timestamp_ms - trace[0].timestamp_ms
    factor = (len(trace) - 1) / rate_rps * 1000 / span if span > 0 else 0.0
    return [r._replace(timestamp_ms=round((r.timestamp_ms - t0) * factor)) for r in trace]


def load_sweep(policies: Sequence[str], rates_rps: Sequence[float], *args,
               progress: Callable[[float], None] | None = None, **kwargs) -> pd.DataFrame:
    """TTFT against offered load: :func:`fleet_simulation` (``policies``, then ``args`` / ``kwargs`` as it takes
    them) once per arrival rate in ``rates_rps`` (requests / s, fleet-wide), the same trace re-timed each time.

    Returns one row per (policy, rate): ``rate_rps``, ``ttft_p50_ms`` / ``ttft_p99_ms`` (all classes, ms),
    ``hit_ratio``, ``throughput_rps`` (completed requests ÷ (last finish − first arrival), requests / s: below the
    offered rate even with no queue, by the drain tail of a finite run), ``drain_s`` (that tail: last finish − last
    arrival, s), ``mean_in_flight`` (the fleet's in-flight requests per replica at routing time, mean over
    requests: the load the replicas really held), ``wait_first_ms`` / ``wait_last_ms`` (median queue wait of the
    first / last quarter of requests by arrival, ms) and ``saturated`` (:func:`queue_growing`). Raises ValueError as
    :func:`fleet_simulation` does, and for no or non-positive rates."""
    if not rates_rps:
        raise ValueError("rates_rps must name at least one arrival rate")
    rows = []
    for i, rate in enumerate(rates_rps):
        sub = None if progress is None else (lambda f, i=i: progress((i + f) / len(rates_rps)))
        run = fleet_simulation(policies, *args, progress=sub, arrival_rps=rate, **kwargs)
        overall = run.summary[run.summary["class"] == "all"].set_index("policy")
        load = run.in_flight.set_index("policy")
        for policy in policies:
            o = overall.loc[policy]
            done = run.per_request[(run.per_request.policy == policy) & np.isfinite(run.per_request.finish_ms)]
            done = done.sort_values("arrival_ms")
            quarter = max(1, len(done) // 4)
            first, last = (float(done.queue_wait_ms.iloc[s].median()) for s in (slice(None, quarter),
                                                                                 slice(-quarter, None)))
            rows.append({"policy": policy, "rate_rps": float(rate), "ttft_p50_ms": float(o.ttft_p50_ms),
                         "ttft_p99_ms": float(o.ttft_p99_ms), "hit_ratio": float(o.hit_ratio),
                         "throughput_rps": float(o.throughput_rps),
                         "drain_s": float(done.finish_ms.max() - done.arrival_ms.max()) / 1000,
                         "mean_in_flight": float(load.loc[policy, "mean_in_flight"]),
                         "wait_first_ms": first, "wait_last_ms": last, "saturated": queue_growing(first, last)})
    return pd.DataFrame(rows)


QUEUE_GROWTH_MS = 100.0   # queue_growing: the least rise of the median queue wait (ms) that counts as growth


def queue_growing(wait_first_ms: float, wait_last_ms: float) -> bool:
    """Whether a run is saturated, judged by its queue: the median queue wait of the last quarter of arrivals is
    over twice the first quarter's and over :data:`QUEUE_GROWTH_MS` above it. Below saturation the wait is
    stationary (the same early and late); above it, the backlog and so the wait grow for the whole run. (The
    completed rate is no criterion on a finite run: it falls below the offered one by the drain tail alone.)"""
    return wait_last_ms > 2 * wait_first_ms and wait_last_ms - wait_first_ms > QUEUE_GROWTH_MS


def cache_counters(sim) -> tuple[int, dict[str, tuple[dict, int, float]]]:
    """What :func:`kda_metrics` needs of one policy-cache run (not its caches: they hold every cached block):
    (prompt tokens of its completed requests, {replica: (bytes by kind held when its cached KV + states peaked,
    tokens lost to a missing state, its budget in bytes)})."""
    prompt = sum(r.input_length for r in sim.results if r.status == "completed")
    return prompt, {replica: (dict(c.held_at_peak), c.lost_to_missing_state, c.budget_bytes)
                    for replica, c in sim.replica_caches.items()}


def kda_metrics(counters: dict[str, tuple], summary: pd.DataFrame, trace) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The KDA view of policy-cache runs (:class:`FleetSimulation`'s ``kda`` and ``replica_bytes``) from each routing
    policy's :func:`cache_counters`."""
    ideal = ideal_ratio(trace)
    rows, per_replica = [], []
    overall = summary[summary["class"] == "all"].set_index("policy")
    for name, (prompt, caches) in counters.items():
        for replica, (held, _, budget) in caches.items():
            per_replica.append({"policy": name, "replica": replica, "kv_gb": held["kv"] / 1e9,
                                "state_gb": held["state"] / 1e9, "running_gb": held["running"] / 1e9,
                                "budget_gb": budget / 1e9})
        lost = sum(lost for _, lost, _ in caches.values())
        o = overall.loc[name]
        rows.append({"policy": name, "hit_ratio": float(o.hit_ratio), "ideal_ratio": ideal,
                     "lost_to_missing_state": lost / max(1, prompt),
                     "kv_gb": float(np.mean([held["kv"] for held, _, _ in caches.values()])) / 1e9,
                     "state_gb": float(np.mean([held["state"] for held, _, _ in caches.values()])) / 1e9,
                     "ttft_p50_ms": float(o.ttft_p50_ms), "ttft_p99_ms": float(o.ttft_p99_ms),
                     "throughput_rps": float(o.throughput_rps)})
    return pd.DataFrame(rows), pd.DataFrame(per_replica)


def in_flight_at_routing(per_request: pd.DataFrame, replicas_at: Callable[[float], frozenset[str]],
                         c: float = BOUND_C, from_ms: float = -math.inf) -> pd.DataFrame:
    """What consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018) bounds: the
    in-flight requests (routed at ``admitted_ms``, not finished by ``finish_ms``) of the replica each request is
    routed to, counting itself, against the cap ceil(c x in-flight on the serving replicas / their number), as
    :meth:`serve.fleet.routing.bounded_load.BoundedLoadRouter.capacity` computes it. ``per_request``: one policy's rows
    (:func:`lab.fleet.results_frame` columns); ``replicas_at(t_ms)``: the names of the replicas serving at t.
    Routings at the same instant are taken in request order (``request_id``, else the rows' order), as the simulator
    routes them; a finish at the same instant as a routing is counted first. Only routings at or after ``from_ms`` are
    judged: when a replica is removed, pass the removal time (requests drained from it are routed again then,
    and the frame only has their final replica, so loads before the removal are not known exactly).

    Returns one row: requests (judged), over_cap_share (fraction of them routed to a replica above the cap),
    p99_over_mean / max_over_mean (P99 / max over requests of the replica's in-flight ÷ mean in-flight; at light
    load a request alone in the fleet gives the replica count), p99_in_flight (P99 of the chosen replica's in-flight,
    requests), mean_in_flight (the fleet's in-flight per serving replica at routing, mean over requests)."""
    rows = per_request[np.isfinite(per_request.admitted_ms) & np.isfinite(per_request.finish_ms)]
    order = rows.request_id if "request_id" in rows else range(len(rows))   # same-instant routings: request order
    events = sorted([(t, 0, 0, r) for t, r in zip(rows.finish_ms, rows.replica)] +
                    [(t, 1, i, r) for t, i, r in zip(rows.admitted_ms, order, rows.replica)])   # finishes (0) first
    load: dict[str, int] = {}
    over, ratios, chosen, means = 0, [], [], []
    for t, is_start, _, replica in events:
        load[replica] = load.get(replica, 0) + (1 if is_start else -1)
        if is_start and t >= from_ms:
            serving = replicas_at(t)
            total = sum(load.get(r, 0) for r in serving)
            over += load[replica] > math.ceil(c * total / len(serving))
            ratios.append(load[replica] * len(serving) / max(1, total))
            chosen.append(load[replica])
            means.append(total / len(serving))
    judged = len(ratios)
    ratios = np.array(ratios or [float("nan")])
    return pd.DataFrame([{"requests": judged, "over_cap_share": over / max(1, judged),
                          "p99_over_mean": float(np.percentile(ratios, 99)), "max_over_mean": float(ratios.max()),
                          "p99_in_flight": float(np.percentile(chosen or [float("nan")], 99)),
                          "mean_in_flight": float(np.mean(means or [float("nan")]))}])
