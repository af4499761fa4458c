"""Budget-isolation scenario for page 13: steady classes plus a burst, run with and without isolation.

Traffic (seeded): each class in ``steady`` is a Poisson stream (rate, prompt and output lengths
jittered ±25 %); the burst adds ``burst_requests`` requests of ``burst_class`` spread over
``burst_duration_s`` starting at ``burst_start_s`` — either uniformly at random ("generator") or
following the arrival pattern and lengths of the Azure 2023 code trace (its first requests, time
rescaled into the burst window). Prompts share no prefix (block ids are fresh).

"Without isolation" = FCFS, no buckets. "With isolation" = the classes' token buckets at admission
and the VTC scheduler with the classes' weights on every replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from serve.fleet.budgets import PriorityClass
from serve.fleet.sim_types import FleetConfig, FleetRequest, SimResult
from serve.fleet.simulation import simulate
from serve.traces import TraceRequest


class Stream(NamedTuple):
    """Steady Poisson traffic of one class: ``rate_rps``, mean ``prompt_tokens`` / ``output_tokens``."""

    klass: str
    rate_rps: float
    prompt_tokens: int
    output_tokens: int


class BudgetRun(NamedTuple):
    """The two runs on identical traffic."""

    without: SimResult
    with_isolation: SimResult
    requests: list[FleetRequest]


def budget_traffic(steady: Sequence[Stream], duration_s: float, burst_class: str, burst_requests: int,
                   burst_start_s: float, burst_duration_s: float, burst_prompt_tokens: int,
                   burst_output_tokens: int, seed: int = 0, azure: Sequence[TraceRequest] | None = None,
                   block_size: int = 512) -> list[FleetRequest]:
    """Requests of the scenario (see module doc), sorted by arrival, ids 0..N-1.
    Raises ValueError for non-positive durations or negative counts."""
    if duration_s <= 0 or burst_duration_s <= 0 or burst_requests < 0:
        raise ValueError("durations must be > 0 and burst_requests >= 0")
    rng = np.random.default_rng(seed)
    raw: list[tuple[float, int, int, str]] = []
    for s in steady:
        n = rng.poisson(s.rate_rps * duration_s)
        for t in rng.uniform(0, duration_s * 1000.0, size=n):
            raw.append((float(t), _jitter(rng, s.prompt_tokens), _jitter(rng, s.output_tokens), s.klass))
    start_ms, span_ms = burst_start_s * 1000.0, burst_duration_s * 1000.0
    if azure:
        picked = list(azure[:burst_requests])
        t_end = max(picked[-1].timestamp_ms, 1) if picked else 1
        for r in picked:
            raw.append((start_ms + r.timestamp_ms / t_end * span_ms, max(1, r.input_length),
                        max(1, r.output_length), burst_class))
    else:
        for t in rng.uniform(start_ms, start_ms + span_ms, size=burst_requests):
            raw.append((float(t), _jitter(rng, burst_prompt_tokens), _jitter(rng, burst_output_tokens), burst_class))
    raw.sort(key=lambda x: x[0])
    out, next_id = [], 0
    for i, (t, prompt, output, klass) in enumerate(raw):
        n = math.ceil(prompt / block_size)
        out.append(FleetRequest(i, t, prompt, output, tuple(range(next_id, next_id + n)), klass))
        next_id += n
    return out


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
    import pandas as pd

    from serve.fleet.experiments import results_frame
    from serve.fleet.sim_types import percentile

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
