"""The measurement helpers behind bench.pool and pages 05/06 measure what they claim."""
import time

import numpy as np
import pytest
import torch

from lab.pool_timing import (
    NaiveListPool,
    _round_robin_ns,
    alloc_free_throughput,
    call_latencies_ns,
    gather_timing,
    latency_histogram,
    one_mla_layout,
    one_thread,
)
from serve.memory.pool import PageKind


def test_naive_pool_is_a_free_list():
    pool = NaiveListPool(4)
    a = pool.alloc(PageKind.MLA_KV, 3, "r")
    assert a == [0, 1, 2] and pool.free_list == [3]
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.alloc(PageKind.MLA_KV, 2, "r")
    with pytest.raises(ValueError, match="not owned"):
        pool.decref(a, "x")
    pool.decref(a, "r")
    assert sorted(pool.free_list) == [0, 1, 2, 3] and not pool.meta


def test_measurements_shapes_and_thread_restore():
    before = torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    t = alloc_free_throughput(8, num_pages=64, loops=3, repeats=1)
    assert t.batch_pages == 8 and t.pool_ops_s > 0 and t.naive_ops_s > 0
    with pytest.raises(ValueError, match="batch_pages"):
        alloc_free_throughput(40, num_pages=64)
    lat = call_latencies_ns(2, samples=10, num_pages=16)
    assert len(lat["alloc"]) == len(lat["free"]) == 10 and min(lat["alloc"]) > 0
    g = gather_timing(40, 16, latent_dim=12, kv_lora_rank=8, repeats=1)
    assert g.context_tokens == 40 and min(g[2:]) > 0
    with pytest.raises(ValueError, match="latent_dim > kv_lora_rank"):
        gather_timing(40, 16, latent_dim=8, kv_lora_rank=8)
    lay = one_mla_layout(16, 12, 8)                          # the engine's layout of what is timed
    assert lay.kv_block_shape == (1, 16, 12) and lay.page_bytes == 16 * 12 * 4


def _naive_bin(x: float, edges: list[float]) -> int:
    """Index i with edges[i] <= x < edges[i + 1] (the last bin closed), by a scan."""
    for i in range(len(edges) - 1):
        if edges[i] <= x < edges[i + 1]:
            return i
    assert x == edges[-1]
    return len(edges) - 2


@pytest.mark.parametrize("samples, bpd", [
    pytest.param({"alloc": [841] * 300 + [2_218] * 3, "free": [771] * 280 + [1_326_976]}, 10, id="outlier-1000x"),
    pytest.param({"alloc": [1000, 1000, 1000]}, 4, id="one-value-on-an-edge"),
    pytest.param({"alloc": [0, 1, 7, 640, 53_680], "free": [3_495, 95_780]}, 5, id="zero-ns-tick"),
])
def test_latency_histogram(samples, bpd):
    h = latency_histogram(samples, bins_per_decade=bpd)
    edges = h.edges_ns
    assert edges[0] > 0 and all(b > a for a, b in zip(edges, edges[1:]))     # drawable on a log axis
    ratios = np.diff(np.log10(edges[1:-1]))
    assert np.allclose(ratios, 1 / bpd)                                         # log-spaced
    for call, xs in samples.items():
        expect = [0] * (len(edges) - 1)
        for x in xs:
            expect[_naive_bin(max(x, edges[0]), edges)] += 1
        assert h.counts[call] == expect
        assert h.p50_ns[call] == pytest.approx(float(np.percentile(xs, 50)))
        assert h.p99_ns[call] == pytest.approx(float(np.percentile(xs, 99)))
        assert edges[0] <= max(min(xs), 0.5) and edges[-1] >= max(xs)


def test_latency_histogram_keeps_the_bulk_visible():
    """Regression (page 05): with 60 linear bins, a 1.3 ms outlier put every sub-22 us call into one
    bin starting at 0 ns, which a log axis cannot draw. Log bins keep the bulk in narrow bins."""
    h = latency_histogram({"free": [771] * 280 + [1_326_976]})
    bulk = max(range(len(h.counts["free"])), key=h.counts["free"].__getitem__)
    assert h.counts["free"][bulk] == 280 and 600 < h.edges_ns[bulk] <= 771 < h.edges_ns[bulk + 1] < 1000


@pytest.mark.parametrize("samples, bpd, match", [
    ({}, 10, "at least one sample"), ({"alloc": []}, 10, "at least one sample"),
    ({"alloc": [-5, 3]}, 10, ">= 0 ns"), ({"alloc": [3]}, 0, "bins_per_decade"),
])
def test_latency_histogram_errors(samples, bpd, match):
    with pytest.raises(ValueError, match=match):
        latency_histogram(samples, bins_per_decade=bpd)


def _descheduled_fn():
    """A call that sleeps 0 s on warm-up, then 0, 20, 0, 20, 20 ms: three of five rounds "descheduled"."""
    delays_s = iter([0.0, 0.0, 0.02, 0.0, 0.02, 0.02])
    return lambda: time.sleep(next(delays_s))


def test_round_robin_min_ignores_descheduled_rounds():
    """Page 06 showed a paged gather at 0.12x a contiguous copy: on an overloaded CPU three of five
    rounds of the copy were descheduled and took the median with them. The minimum does not move."""
    median_ns = _round_robin_ns([_descheduled_fn()], 5, "median")[0]
    min_ns = _round_robin_ns([_descheduled_fn()], 5, "min")[0]
    assert median_ns >= 20e6 and min_ns < 5e6
    with pytest.raises(ValueError, match="statistic"):
        _round_robin_ns([lambda: None], 1, "mean")
