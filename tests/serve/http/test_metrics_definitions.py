"""``ServerMetrics`` definitions, pinned by values on hand-chosen times (the server tests only see that each series
exists): TTFT = first push - arrival; ITL = the gap between consecutive pushes (one observation per push after
the first, however many tokens it carries); TPOT = (last push - first push) / (tokens - 1), per finished request;
e2e = last push - arrival, per finished request; each end counted once as success, never_fits or aborted (a
request aborted before it reached the engine too); prompt tokens and prefix-cache queries only for requests the
engine admitted."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from serve.engine.request import RequestResult, RequestStatus
from serve.http.metrics import ServerMetrics

M = "m"


def result(status: RequestStatus, prompt: int, out: int, prefill: int, hit: int = 0) -> RequestResult:
    return RequestResult(0, status, prompt, tuple(range(out)), None, prefill, hit, hit, 0, 0, 0, {}, None, "")


def serve(metrics: ServerMetrics, arrival: float, pushes, res: RequestResult | None):
    """Feed one request's pushes ``[(time_s, tokens), ...]`` as the engine loop does, then its end."""
    s = SimpleNamespace(arrival_t=arrival, first_t=None, last_t=None, sent=0)
    for t, n in pushes:
        metrics.tokens(s, n, t)
        s.sent += n
    metrics.finished(s, res)
    return s


def value(metrics: ServerMetrics, name: str, **labels) -> float:
    v = metrics.registry.get_sample_value(name, {"model_name": M, **labels})
    assert v is not None, name
    return v


@pytest.fixture
def metrics():
    m = ServerMetrics(M, block_size=16)
    serve(m, 10.0, [(10.5, 1), (10.75, 2), (11.25, 1)], result(RequestStatus.FINISHED, 40, 4, 40))    # 4 tokens
    serve(m, 20.0, [(20.25, 1), (20.5, 1)], result(RequestStatus.FINISHED, 100, 2, 36, hit=64))     # warm
    serve(m, 30.0, [], result(RequestStatus.REJECTED, 5000, 0, 0))                                   # never fits
    serve(m, 40.0, [(41.0, 1)], result(RequestStatus.ABORTED, 8, 1, 8))                               # client left
    serve(m, 50.0, [], None)                                                                          # left queued
    return m


def test_latency_histograms(metrics):
    assert value(metrics, "vllm:time_to_first_token_seconds_count") == 3          # every request with a token
    assert value(metrics, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.5 + 0.25 + 1.0)
    assert value(metrics, "vllm:inter_token_latency_seconds_count") == 3          # one per push after the first
    assert value(metrics, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.25 + 0.5 + 0.25)
    assert value(metrics, "vllm:request_time_per_output_token_seconds_count") == 2  # finished requests only
    assert value(metrics, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.75 / 3 + 0.25 / 1)
    assert value(metrics, "vllm:e2e_request_latency_seconds_count") == 2
    assert value(metrics, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(1.25 + 0.5)


def test_each_end_counted_once_by_kind(metrics):
    assert value(metrics, "vllm:request_success_total", finished_reason="length") == 2
    assert value(metrics, "kda:requests_rejected_total", reason="never_fits") == 1
    assert value(metrics, "kda:requests_rejected_total", reason="queue_full") == 0
    assert value(metrics, "kda:requests_aborted_total") == 2
    assert value(metrics, "vllm:generation_tokens_total") == 4 + 2 + 1


def test_prompt_and_prefix_counters_count_admitted_requests_only(metrics):
    assert value(metrics, "vllm:prompt_tokens_total") == 40 + 100 + 8
    assert value(metrics, "vllm:prefix_cache_queries_total") == 40 + 100 + 8
    assert value(metrics, "vllm:prefix_cache_hits_total") == 64
    assert value(metrics, "sglang:mamba_cache_miss_requests_total") == 0
