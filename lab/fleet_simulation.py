"""Page 14 in one call: the whole fleet chain (router -> replica scheduler -> prefix cache -> continuous
batching) on one trace, once per routing policy (:func:`fleet_simulation`)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd

from lab.fleet import ANCHORS, default_service, ideal_ratio, page_trace, scale_events_for, simulate_policies
from serve.fleet import ROUTERS
from serve.fleet.budgets import PriorityClass
from serve.fleet.service_model import cpu_engine_preset, measure_cpu_engine
from serve.fleet.sim_types import FleetConfig
from serve.fleet.vtc import on_off_less_service

POLICIES = tuple(ROUTERS)
SERVICE_MODELS = {"A10G · Llama-7B (VTC artifact, measured)": "a10g",
                  "this CPU · our KDA demo engine (measured now)": "cpu"}
CAPACITIES = ("0", "500", "2000", "8000", "unlimited")  # cache per replica options (512-token blocks)
SCALE_EVENTS = ("none", "add", "remove")  # at half the trace's duration
SCHEDULERS = ("fcfs", "vtc")
DECODE_SHARE = 5 / 8  # decode speed-up = this share of the prefill speed-up (as page 13's assumed 8x / 5x)
KV_CAPACITY_TOKENS = 400_000  # KV room per replica (tokens), as page 13
VNODES = 160  # ring virtual nodes per replica (ketama's default)
CLASSES = (PriorityClass("vip", 4.0), PriorityClass("standard", 1.0))  # VTC weights of the two classes


@dataclass(frozen=True)
class FleetSimulation:
    """Everything page 14 draws.

    per_request: one row per (policy, request) with queue_wait_ms, ttft_ms, e2e_ms; summary: per (policy,
    class and "all"): hit ratio, TTFT P50/P99 (ms), queue wait P99 (ms), max/mean requests per replica,
    throughput (req/s); ideal_ratio: token hit ratio of one infinite shared cache; num_requests: trace
    length; service_source: what the replicas are calibrated on; note: what the budget cut from an upload;
    anchors: published figures with sources."""

    per_request: pd.DataFrame
    summary: pd.DataFrame
    ideal_ratio: float
    num_requests: int
    service_source: str
    note: str
    anchors: dict | None = None


def fleet_simulation(policies: Sequence[str], num_requests: int, num_replicas: int, k: int, capacity: str,
                     scheduler: str, vip_percent: int, scale: str, speedup: float, service_model: str,
                     upload: bytes | None = None, upload_name: str = "uploaded file",
                     progress: Callable[[float], None] | None = None) -> FleetSimulation:
    """Simulate the page trace (``upload`` or the synthetic one) once per policy in ``policies``:
    ``num_replicas`` replicas of ``service_model`` ("a10g": the VTC artifact's calibration; "cpu": our engine
    timed on this CPU now) with prefill ``speedup`` x and decode ``speedup * DECODE_SHARE`` x (at least 1),
    ``capacity`` blocks of cache each (:data:`CAPACITIES`), every ``100 / vip_percent``-th request VIP, and
    an optional scale event at half time. ``progress(fraction)`` is called as the runs advance.

    Raises: ValueError for no or unknown policies, an unknown option, or a bad upload (TraceFormatError)."""
    if not policies or any(p not in ROUTERS for p in policies):
        raise ValueError(f"policies must be a non-empty subset of {POLICIES}, got {list(policies)}")
    for name, value, allowed in (("capacity", capacity, CAPACITIES), ("scheduler", scheduler, SCHEDULERS),
                                 ("scale", scale, SCALE_EVENTS), ("service_model", service_model,
                                                                  tuple(SERVICE_MODELS.values()))):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if not 0 <= vip_percent <= 100:
        raise ValueError(f"vip_percent must be in [0, 100], got {vip_percent}")
    trace, note, _ = page_trace(upload, num_requests, name=upload_name)
    base = on_off_less_service() if service_model == "a10g" else cpu_engine_preset(measure_cpu_engine())
    service = default_service(base, float(speedup), max(1.0, speedup * DECODE_SHARE), KV_CAPACITY_TOKENS)
    cfg = FleetConfig(service=service, num_replicas=num_replicas, routing_k=k, scheduler=scheduler,
                      router_params={"vnodes": VNODES},
                      cache_capacity_blocks=None if capacity == "unlimited" else int(capacity), classes=CLASSES,
                      scale_events=scale_events_for(num_replicas, None if scale == "none" else scale,
                                                    trace[-1].timestamp_ms / 2))
    every = round(100 / vip_percent) if vip_percent else 0

    def class_of(i: int) -> str:
        return "vip" if every and i % every == 0 else "standard"

    per_request, summary = simulate_policies(trace, list(policies), cfg, class_of, progress=progress)
    return FleetSimulation(per_request, summary, ideal_ratio(trace), len(trace), service.source, note,
                           anchors=dict(ANCHORS))
