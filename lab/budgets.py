"""Budget-isolation scenario for page 13: steady classes plus a burst, run with and without isolation.

Traffic (seeded): each class in ``steady`` is a Poisson stream (rate, prompt and output lengths
jittered ±25 %); the burst adds ``burst_requests`` requests of ``burst_class`` spread over
``burst_duration_s`` starting at ``burst_start_s`` — either uniformly at random ("generator") or
following the arrival pattern and lengths of the Azure 2023 code trace (its first requests, time
rescaled into the burst window). Prompts share no prefix (block ids are fresh).

"Without isolation" = FCFS, no buckets. "With isolation" = the classes' token buckets at admission
and the VTC scheduler with the classes' weights on every replica.

:func:`budget_page` assembles page 13's scenario from its widgets in one call. The scenario's fixed numbers
are below, each named; they are this lab's choices (not measurements), except the replica service model,
which is the VTC artifact's A10G calibration (:func:`serve.fleet.vtc.on_off_less_service`) sped up by
assumed factors that the page states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd

from lab.fleet import PAGE_TRACE_BLOCKS, default_service, results_frame
from serve.azure_trace import read_azure_csv
from serve.fleet.budgets import PriorityClass
from serve.fleet.service_model import ServiceModel
from serve.fleet.sim_types import FleetConfig, FleetRequest, FleetSimResult, fresh_block_requests, percentile
from serve.fleet.simulation import simulate
from serve.fleet.vtc import on_off_less_service, replay_on_off_less
from serve.traces import TraceRequest, named_bytes


class Stream(NamedTuple):
    """Steady Poisson traffic of one class: ``rate_rps``, mean ``prompt_tokens`` / ``output_tokens``."""

    klass: str
    rate_rps: float
    prompt_tokens: int
    output_tokens: int


class BudgetRun(NamedTuple):
    """The two runs on identical traffic."""

    without: FleetSimResult
    with_isolation: FleetSimResult
    requests: list[FleetRequest]


class BudgetTraffic(NamedTuple):
    """The scenario's ``requests`` (sorted by arrival, ids 0..N-1), the number of ``burst_requests``
    actually in them, and ``note``: "" or a sentence saying why the burst is smaller than asked."""

    requests: list[FleetRequest]
    burst_requests: int
    note: str


def budget_traffic(steady: Sequence[Stream], duration_s: float, burst_class: str, burst_requests: int,
                   burst_start_s: float, burst_duration_s: float, burst_prompt_tokens: int,
                   burst_output_tokens: int, seed: int = 0, azure: Sequence[TraceRequest] | None = None,
                   block_size: int = 512) -> BudgetTraffic:
    """Requests of the scenario (see module doc). With ``azure``, the burst is its first
    ``burst_requests`` requests — fewer when the trace is shorter, which ``note`` then says.
    Raises ValueError for non-positive durations or negative counts, or prompts over the limits of
    :func:`serve.fleet.sim_types.fresh_block_requests`."""
    if duration_s <= 0 or burst_duration_s <= 0 or burst_requests < 0:
        raise ValueError("durations must be > 0 and burst_requests >= 0")
    rng = np.random.default_rng(seed)
    raw: list[tuple[float, int, int, str]] = []
    for s in steady:
        n = rng.poisson(s.rate_rps * duration_s)
        for t in rng.uniform(0, duration_s * 1000.0, size=n):
            raw.append((float(t), _jitter(rng, s.prompt_tokens), _jitter(rng, s.output_tokens), s.klass))
    start_ms, span_ms = burst_start_s * 1000.0, burst_duration_s * 1000.0
    note = ""
    if azure is not None:
        picked = list(azure[:burst_requests])
        t_end = max(picked[-1].timestamp_ms, 1) if picked else 1
        for r in picked:
            raw.append((start_ms + r.timestamp_ms / t_end * span_ms, max(1, r.input_length),
                        max(1, r.output_length), burst_class))
        if len(picked) < burst_requests:
            note = (f"The burst has {len(picked):,} {burst_class} requests, not the {burst_requests:,} asked for: "
                    f"the Azure trace gave only {len(picked):,}.")
        burst = len(picked)
    else:
        for t in rng.uniform(start_ms, start_ms + span_ms, size=burst_requests):
            raw.append((float(t), _jitter(rng, burst_prompt_tokens), _jitter(rng, burst_output_tokens), burst_class))
        burst = burst_requests
    raw.sort(key=lambda x: x[0])
    return BudgetTraffic(fresh_block_requests(raw, block_size), burst, note)


def _jitter(rng: np.random.Generator, mean: int) -> int:
    return max(1, int(round(mean * rng.uniform(0.75, 1.25))))


def run_budget_scenario(requests: Sequence[FleetRequest], classes: Sequence[PriorityClass],
                        base: FleetConfig) -> BudgetRun:
    """Run ``requests`` twice on ``base``: FCFS without buckets, then VTC with ``classes``' weights
    and buckets."""
    plain = tuple(PriorityClass(c.name, 1.0) for c in classes)
    without = simulate(requests, FleetConfig(**{**base.__dict__, "scheduler": "fcfs", "classes": plain}))
    isolated = simulate(requests, FleetConfig(**{**base.__dict__, "scheduler": "vtc", "classes": tuple(classes)}))
    return BudgetRun(without, isolated, list(requests))


def budget_frames(run: BudgetRun, classes: Sequence[PriorityClass]):
    """DataFrames for page 13: (per-request TTFT of completed requests with an ``isolation`` column,
    per-class P50/P99 TTFT for both runs, cumulative admitted tokens vs each bucket's budget line)."""
    frames = []
    for label, sim in (("without isolation", run.without), ("with isolation", run.with_isolation)):
        df = results_frame(sim)
        df.insert(0, "isolation", label)
        frames.append(df)
    per_request = pd.concat(frames, ignore_index=True)
    done = per_request[per_request.status == "completed"]
    summary = []
    for (label, klass), g in done.groupby(["isolation", "klass"], sort=False):
        summary.append({"isolation": label, "class": klass, "completed": len(g),
                        "ttft_p50_ms": percentile(g.ttft_ms.to_numpy(), 50),
                        "ttft_p99_ms": percentile(g.ttft_ms.to_numpy(), 99)})
    budget_rows = []
    for c in classes:
        if not c.has_bucket:
            continue
        admitted = 0
        for adm in run.with_isolation.admissions:
            if adm.klass == c.name:
                admitted += adm.tokens
                budget_rows.append({"class": c.name, "time_s": adm.time_ms / 1000.0, "admitted_tokens": admitted,
                                    "budget_tokens": c.burst_tokens + c.rate_tokens_per_s * adm.time_ms / 1000.0})
    return per_request, pd.DataFrame(summary), pd.DataFrame(budget_rows)


# The scenario of page 13 (lab choices: a latency-sensitive small class, a standard class and a batch class
# with long prompts; lengths in tokens, rates in requests/s).
DURATION_S = 120.0  # simulated traffic (s)
BURST_START_S = 30.0  # the burst starts after 30 s of steady traffic, so the "before" state is settled
VIP_TOKENS = (256, 64)  # VIP prompt / output tokens: short interactive requests
STANDARD_TOKENS = (1024, 128)  # standard prompt / output tokens; also a burst request's
BATCH = Stream("batch", 0.5, 2048, 256)  # steady batch traffic: long prompts, long outputs
BATCH_WEIGHT = 0.5  # VTC weight of the batch class (half a standard request's share)
BATCH_RATE_TOKENS_PER_S = 3000.0  # batch bucket: refill rate (prompt + output tokens per s) ...
BATCH_BURST_TOKENS = 20000.0  # ... and depth (tokens)
STANDARD_BURST_S = 5.0  # standard bucket depth = 5 s of its refill rate
# Replicas: the VTC artifact's A10G FCFS calibration sped up by ASSUMED factors (prefill x8, decode x5) so a
# few replicas carry the steady load, with KV room for 400,000 tokens (a larger GPU); the page says so.
PREFILL_SPEEDUP, DECODE_SPEEDUP, KV_CAPACITY_TOKENS = 8.0, 5.0, 400_000
ROUTER = "least_loaded"  # no prefix is shared (fresh block ids), so routing is by load only
BURST_CLASSES = ("standard", "batch", "vip")


def budget_classes(vip_weight: float, standard_rate_tokens_per_s: float) -> tuple[PriorityClass, ...]:
    """The three classes: VIP (weight ``vip_weight``, no bucket), standard (weight 1, a bucket of
    ``standard_rate_tokens_per_s`` refilled, :data:`STANDARD_BURST_S` seconds deep), batch (see above)."""
    return (PriorityClass("vip", float(vip_weight)),
            PriorityClass("standard", 1.0, rate_tokens_per_s=float(standard_rate_tokens_per_s),
                          burst_tokens=STANDARD_BURST_S * standard_rate_tokens_per_s),
            PriorityClass("batch", BATCH_WEIGHT, rate_tokens_per_s=BATCH_RATE_TOKENS_PER_S,
                          burst_tokens=BATCH_BURST_TOKENS))


def budget_service() -> ServiceModel:
    """One replica of the scenario (see :data:`PREFILL_SPEEDUP`)."""
    return default_service(on_off_less_service(), PREFILL_SPEEDUP, DECODE_SPEEDUP, KV_CAPACITY_TOKENS)


@dataclass(frozen=True)
class BudgetPage:
    """Everything page 13 draws.

    per_request / summary / budget: :func:`budget_frames` (ms, tokens, s); service_source: what the replicas
    are calibrated on; num_requests: all requests; burst_requests: burst requests actually in them; note:
    what an Azure file's budget cut or why the burst is smaller ("" if nothing); duration_s /
    burst_start_s: the scenario's times; vtc: the VTC artifact comparison, one row per (scheduler, client)
    with P50/P99 TTFT measured and ours (s) and a readable ``client``; vtc_throughput_measured /
    vtc_throughput_ours: req/s per scheduler."""

    per_request: pd.DataFrame
    summary: pd.DataFrame
    budget: pd.DataFrame
    service_source: str
    num_requests: int
    burst_requests: int
    note: str
    vtc: pd.DataFrame
    vtc_throughput_measured: dict
    vtc_throughput_ours: dict
    duration_s: float = DURATION_S
    burst_start_s: float = BURST_START_S


def vtc_frame() -> tuple[pd.DataFrame, dict, dict]:
    """The VTC artifact's on_off_less suite against our simulator (:func:`serve.fleet.vtc.replay_on_off_less`)."""
    cmp = replay_on_off_less()
    vdf = pd.DataFrame([r._asdict() for r in cmp.rows])
    vdf["client"] = vdf.client.map(lambda c: "light (0.5 req/s, on/off)" if c == cmp.light_client else "heavy (2 req/s)")
    return vdf, dict(cmp.measured_throughput_rps), dict(cmp.ours_throughput_rps)


def budget_page(vip_rate: float, standard_rate: float, vip_weight: float, standard_budget_tokens_per_s: float,
                burst_class: str, burst_requests: int, burst_duration_s: float, num_replicas: int,
                azure: bytes | None = None, azure_name: str = "uploaded file") -> BudgetPage:
    """Page 13's scenario: steady VIP / standard / batch traffic, a burst of ``burst_requests`` of
    ``burst_class`` from :data:`BURST_START_S` (uniform, or shaped by an Azure LLM trace CSV ``azure``), run
    with and without isolation on ``num_replicas`` replicas; plus the VTC artifact comparison.

    Raises: ValueError for an unknown burst class, bad rates or sizes, or a bad Azure file
    (TraceFormatError naming the file and line)."""
    if burst_class not in BURST_CLASSES:
        raise ValueError(f"burst_class must be one of {BURST_CLASSES}, got {burst_class!r}")
    classes = budget_classes(vip_weight, standard_budget_tokens_per_s)
    steady = [Stream("vip", vip_rate, *VIP_TOKENS), Stream("standard", standard_rate, *STANDARD_TOKENS), BATCH]
    shape, cut = None, ""
    if azure is not None:
        shape, cut, _ = read_azure_csv(named_bytes(azure, azure_name), max_requests=max(1, burst_requests),
                                       max_total_blocks=PAGE_TRACE_BLOCKS)
    traffic = budget_traffic(steady, DURATION_S, burst_class, burst_requests, BURST_START_S, float(burst_duration_s),
                             *STANDARD_TOKENS, azure=shape)
    service = budget_service()
    run = run_budget_scenario(traffic.requests, classes, FleetConfig(service=service, num_replicas=num_replicas,
                                                                     router=ROUTER, cache_capacity_blocks=0))
    notes = (cut if burst_requests else "", traffic.note)  # with no burst the file is only checked: nothing "cut"
    vdf, tp_measured, tp_ours = vtc_frame()
    return BudgetPage(*budget_frames(run, classes), service.source, len(traffic.requests), traffic.burst_requests,
                      " ".join(filter(None, notes)), vdf, tp_measured, tp_ours)
