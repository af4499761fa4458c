"""The replay's metrics, defined once for the measured engine and the simulator's prediction (same clock).

Per request (times in ms on the replay's clock, :mod:`serve.fleet.engine_replay.clock`): ``arrival_ms`` (the
trace's arrival), ``first_token_ms`` (the end of the step that emitted its first token), ``finish_ms`` (the end
of the step that emitted its last), ``output_tokens`` n. Definitions (vLLM's ``benchmarks/benchmark_serving.py``):
TTFT = first − arrival; TPOT = (finish − first) / (n − 1), for n > 1 only; E2E = finish − arrival; request
throughput = completed requests / (last finish − first arrival) × 1000 (requests/s on the clock).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p50_ms", "e2e_mean_ms", "request_throughput_rps")


class RequestTimes(NamedTuple):
    """One completed request on the replay's clock (ms): see the module docstring."""

    arrival_ms: float
    first_token_ms: float
    finish_ms: float
    output_tokens: int


def replay_metrics(times: Sequence[RequestTimes]) -> dict[str, float]:
    """The :data:`METRICS` of ``times`` (percentiles by linear interpolation, numpy's default). TPOT is NaN
    when no request has more than one token. Raises ValueError for no request, or a request whose first token
    comes before its arrival or after its finish (a broken clock)."""
    if not times:
        raise ValueError("replay_metrics needs at least one completed request")
    bad = [t for t in times if not t.arrival_ms <= t.first_token_ms <= t.finish_ms or t.output_tokens < 1]
    if bad:
        raise ValueError(f"request times out of order (arrival <= first token <= finish, >= 1 token): {bad[0]}")
    ttft = np.array([t.first_token_ms - t.arrival_ms for t in times])
    tpot = np.array([(t.finish_ms - t.first_token_ms) / (t.output_tokens - 1) for t in times if t.output_tokens > 1])
    span_ms = max(t.finish_ms for t in times) - min(t.arrival_ms for t in times)
    return dict(ttft_p50_ms=float(np.percentile(ttft, 50)), ttft_p99_ms=float(np.percentile(ttft, 99)),
                tpot_mean_ms=float(tpot.mean()) if len(tpot) else float("nan"),
                tpot_p50_ms=float(np.percentile(tpot, 50)) if len(tpot) else float("nan"),
                e2e_mean_ms=float(np.mean([t.finish_ms - t.arrival_ms for t in times])),
                request_throughput_rps=len(times) / span_ms * 1000.0)


def abs_pct_error(predicted: dict, measured: dict) -> dict[str, float]:
    """|predicted − measured| / measured × 100 per metric of :data:`METRICS`."""
    return {m: abs(predicted[m] - measured[m]) / measured[m] * 100.0 for m in METRICS}
