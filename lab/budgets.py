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

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from serve.fleet.budgets import PriorityClass
from serve.fleet.sim_types import FleetConfig, FleetRequest, FleetSimResult, fresh_block_requests
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
    import pandas as pd

    from lab.fleet import results_frame
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
