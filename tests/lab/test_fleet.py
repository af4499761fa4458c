"""Page-facing experiments (pages 11–14): the page-13 headline, scale-event dip, CPU calibration."""

from __future__ import annotations

import re

import numpy as np
import pytest

from lab.budgets import Stream, budget_frames, budget_traffic, run_budget_scenario
from lab.fleet import (
    default_service,
    hit_ratio_across_scale_event,
    keys_moved_table,
    page_trace,
    ring_balance_vs_vnodes,
    routing_load,
    simulate_policies,
)
from serve.fleet.scaling.budgets import PriorityClass
from serve.fleet.sim.service_model import EngineRates, cpu_engine_preset, measure_cpu_engine
from serve.fleet.sim.types import FleetConfig
from serve.fleet.sim.vtc import on_off_less_service
from serve.traces.mooncake import TraceFormatError, dump_mooncake, synthesize


def _page13_a10g_scenario():
    """Page 13's former default scenario (fixed rates on the sped-up A10G replica): the simulator's check."""
    classes = (PriorityClass("vip", 4.0), PriorityClass("standard", 1.0, rate_tokens_per_s=8000.0, burst_tokens=40000.0),
               PriorityClass("batch", 0.5, rate_tokens_per_s=3000.0, burst_tokens=20000.0))
    steady = [Stream("vip", 1.0, 256, 64), Stream("standard", 3.0, 1024, 128), Stream("batch", 0.5, 2048, 256)]
    requests = budget_traffic(steady, 120.0, "standard", 1500, 30.0, 30.0, 1024, 128).requests
    cfg = FleetConfig(service=default_service(on_off_less_service(), 8, 5, 400_000), num_replicas=2,
                      router="least_loaded", cache_capacity_blocks=0)
    return run_budget_scenario(requests, classes, cfg), classes


def test_page13_a10g_scenario_headline():
    """Under a standard-class burst: VIP P99 TTFT < 200 ms with isolation, > 800 ms without."""
    run, classes = _page13_a10g_scenario()
    vip_with = run.with_isolation.column("ttft_ms", klass="vip")
    vip_without = run.without.column("ttft_ms", klass="vip")
    assert np.percentile(vip_with, 99) < 200.0
    assert np.percentile(vip_without, 99) > 800.0
    per_request, summary, budget = budget_frames(run, classes)
    assert set(summary["class"]) == {"vip", "standard", "batch"}
    assert (budget.admitted_tokens <= budget.budget_tokens + 1e-6).all()
    assert len(per_request) == 2 * len(run.requests)


def test_budget_traffic_is_seeded_and_sorted():
    steady = [Stream("a", 2.0, 100, 10)]
    a = budget_traffic(steady, 60.0, "b", 50, 10.0, 5.0, 200, 20, seed=1).requests
    assert a == budget_traffic(steady, 60.0, "b", 50, 10.0, 5.0, 200, 20, seed=1).requests
    assert [r.arrival_ms for r in a] == sorted(r.arrival_ms for r in a)
    burst = [r for r in a if r.klass == "b"]
    assert len(burst) == 50 and all(10_000 <= r.arrival_ms <= 15_000 for r in burst)
    with pytest.raises(ValueError, match="durations"):
        budget_traffic(steady, 0.0, "b", 1, 1.0, 1.0, 1, 1)


def test_routing_load():
    trace = synthesize(num_requests=800, duration_s=200, seed=4)
    one = routing_load(trace, "ring", 8, 1, vnodes=160)
    assert one.requests.max() == len(trace) and len(one) == 8  # k = 1: shared system block → one replica
    two = routing_load(trace, "ring", 8, 2, vnodes=160)
    assert two.requests.max() < len(trace) / 3 and two.requests.sum() == len(trace)


def test_ring_balance_and_keys_moved_tables():
    bal = ring_balance_vs_vnodes(8, [4, 160, 1000])
    assert bal.relative_spread.iloc[0] > bal.relative_spread.iloc[-1]
    moved = keys_moved_table(8, "remove", 20_000, 160)
    row = moved.set_index("algorithm").loc["rendezvous"]
    assert row.moved_fraction == pytest.approx(1 / 8, rel=0.2) and row.n_after == 7


def test_scale_event_dip_mod_n_worse_than_ring():
    trace = synthesize(num_requests=1500, duration_s=450, seed=5)
    df = hit_ratio_across_scale_event(trace, ["ring", "mod_n"], 8, 2, "add", 0.5, 100, None, 160)
    after = df[df.request >= 750].groupby("algorithm")
    assert after.hit_ratio.min()["mod_n"] < after.hit_ratio.min()["ring"]
    first = after.head(5).groupby("algorithm").hit_ratio.mean()   # the windows right after the event
    assert first["mod_n"] < first["ring"]


def test_simulate_policies_and_page_trace_upload():
    trace = synthesize(num_requests=300, duration_s=90, seed=6)
    assert page_trace(dump_mooncake(trace).encode(), 100).requests == trace[:100]
    cfg = FleetConfig(service=default_service(on_off_less_service(), 8, 5, 400_000), num_replicas=4)
    per_request, summary = simulate_policies(trace, ["ring", "round_robin"], cfg,
                                             class_of=lambda i: "vip" if i % 10 == 0 else "standard")
    assert len(per_request) == 600 and set(per_request.policy) == {"ring", "round_robin"}
    all_rows = summary[summary["class"] == "all"].set_index("policy")
    assert all_rows.loc["ring", "hit_ratio"] > all_rows.loc["round_robin", "hit_ratio"]
    assert set(summary["class"]) == {"all", "vip", "standard"}


def test_cpu_engine_calibration_runs_our_engine():
    rates = measure_cpu_engine(prompt_tokens=32, batch_sizes=(1, 2), repeats=1, preset="demo-tiny")
    assert rates.prefill_tokens_per_s > 0 and all(v > 0 for v in rates.decode_step_ms.values())
    svc = cpu_engine_preset(rates)
    # the linear fit passes through one measured point and never under-estimates the other
    gaps = [svc.decode_step_ms(b) - t for b, t in rates.decode_step_ms.items()]
    assert min(gaps) >= -1e-9 and min(abs(g) for g in gaps) < 1e-6
    assert "this CPU" in svc.source


@pytest.mark.parametrize("t1", [5.0, 12.0, 30.0, 100.0], ids=["sub-linear-down", "linear", "super-linear", "noisy"])
def test_cpu_engine_preset_fit_never_underestimates(t1):
    """Regression: with batch-4 timing > 4× batch-1 (a noisy shared CPU) the intercept was clipped
    without refitting the slope, under-estimating both points."""
    rates = EngineRates(300.0, {1: 10.0, 4: t1}, 256)
    svc = cpu_engine_preset(rates)
    gaps = [svc.decode_step_ms(b) - t for b, t in rates.decode_step_ms.items()]
    assert min(gaps) >= -1e-9 and min(abs(g) for g in gaps) < 1e-9
    assert svc.decode_step_base_ms > 0 and svc.decode_step_per_seq_ms >= 0


@pytest.mark.parametrize("content, fragment", [(b"", "is empty (0 bytes)"), (b"\n\n", "has no requests"),
                                               (b"\xff\xfe", "is not UTF-8 text")])
def test_page_trace_reports_an_empty_or_binary_upload(content, fragment):
    """Regression: ``if upload:`` treated a 0-byte upload as "no upload" and the pages silently showed
    the synthetic trace's results. Only None means "no upload"."""
    with pytest.raises(TraceFormatError, match=re.escape(f"file up.jsonl {fragment}")):
        page_trace(content, 100, name="up.jsonl")
    assert len(page_trace(None, 100).requests) == 100  # no upload: the synthetic trace
