"""Page 05's workload on real pools: deterministic, conserving, and the split pool pays for a mix shift."""
import pytest

from kda_core.config import PRESETS
from lab.pool import WorkloadConfig, call_latency, page05, simulate_workload, static_kv_share
from serve.memory.layout import CacheLayout


def _outcomes(res):
    return {(d["variant"], d["phase"], d["outcome"]): d["requests"] for d in res.outcomes}


@pytest.mark.parametrize("policy", ["unified", "multi_page"])
@pytest.mark.parametrize("arrival", ["steady", "bursty"])
def test_simulate_conserves_requests_and_pages(policy, arrival):
    cfg = WorkloadConfig(pool_mib=8, policy=policy, arrival=arrival, long_share=0.3, seed=3, num_steps=60)
    res = simulate_workload(cfg, snapshot_step=30)
    o = _outcomes(res)
    for ph in (1, 2):  # both variants see the same arrivals
        assert o[("unified", ph, "admitted")] + o[("unified", ph, "rejected")] == \
            o[("static split", ph, "admitted")] + o[("static split", ph, "rejected")]
    for row in res.timeline:
        assert row["mla_kv_pages"] + row["kda_state_pages"] + row["free_pages"] == res.num_pages
    assert len(res.snapshot) == res.num_pages and res.latency_ns["alloc"] and res.latency_ns["free"]
    assert res.waste["used_bytes"] > 0
    again = simulate_workload(cfg, snapshot_step=30)
    assert again.timeline == res.timeline and again.outcomes == res.outcomes and again.snapshot == res.snapshot


def test_unified_pool_absorbs_a_mix_shift():
    cfg = WorkloadConfig(pool_mib=32, long_share=0.0, seed=0)   # all short, then all long
    o = _outcomes(simulate_workload(cfg))
    assert o[("unified", 2, "rejected")] < o[("static split", 2, "rejected")]
    assert 0 < static_kv_share(cfg) < static_kv_share(WorkloadConfig(long_share=1.0)) < 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(pool_mib=0), "pool_mib"), (dict(policy="x"), "policy"), (dict(long_share=1.5), "long_share"),
    (dict(arrival="x"), "arrival"), (dict(preset="x"), "preset"), (dict(short_tokens=(5, 1)), "short_tokens"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WorkloadConfig(**kwargs)


def test_simulate_errors():
    with pytest.raises(ValueError, match="need >= 2"):
        simulate_workload(WorkloadConfig(pool_mib=0.1))
    with pytest.raises(ValueError, match="snapshot_step"):
        simulate_workload(WorkloadConfig(num_steps=10), snapshot_step=10)


@pytest.mark.parametrize("policy", ["unified", "multi_page"])
def test_waste_is_the_engine_layouts_padding(policy):
    cfg = WorkloadConfig(pool_mib=8, policy=policy, num_groups=2, seed=1, num_steps=40)
    lay = cfg.layout
    assert lay == CacheLayout.for_policy(PRESETS["demo"], 16, 2, policy)   # the engine's own layout (fp32)
    res = simulate_workload(cfg)
    kv_pages = sum(r["mla_kv_pages"] for r in res.timeline if r["variant"] == "unified")
    assert res.waste["kv_padding_bytes"] == pytest.approx(kv_pages * lay.kv_page_padding_bytes / 40)
    assert (res.waste["kv_padding_bytes"] > 0) == (policy == "unified")
    state_pages = sum(r["kda_state_pages"] for r in res.timeline if r["variant"] == "unified")
    assert res.waste["state_waste_bytes"] == pytest.approx(state_pages / lay.state_pages * lay.state_waste_bytes / 40)


def test_page05_is_one_call_of_plain_data():
    r = page05(8.0, "multi_page", 0.2, "steady", 2, 0, 30)
    assert r.layout == WorkloadConfig(pool_mib=8, policy="multi_page", num_groups=2).layout
    assert len(r.snapshot) == r.num_pages and set(r.timeline.variant) == {"unified", "static split"}
    assert sorted(set(r.waste.policy)) == ["multi_page", "unified"] and len(r.waste) == 6
    assert set(r.real.model) == {"Kimi-Linear-48B-A3B", "Kimi K3"} and len(r.real) == 4 and len(r.vllm) == 6


def test_call_latency_repeats_runs_after_a_warmup():
    """Page 05's latencies follow the measurement rule: ``repeats`` runs after a warm-up, each percentile the
    median over the runs with its spread, and the conditions for the stamp (it was one run's samples)."""
    lat = call_latency(8.0, "multi_page", 0.2, "steady", 2, 0, repeats=5)
    one_run = simulate_workload(WorkloadConfig(pool_mib=8.0, policy="multi_page", long_share=0.2, num_groups=2))
    calls = {k: len(v) for k, v in one_run.latency_ns.items()}
    assert {k: sum(c) for k, c in lat.histogram.counts.items()} == {k: 5 * n for k, n in calls.items()}
    qs = lat.percentiles
    assert list(zip(qs.call, qs.percentile)) == [("alloc", 50), ("alloc", 99), ("free", 50), ("free", 99)]
    assert (qs.runs == 5).all()
    assert ((qs.min_ns <= qs.q1_ns) & (qs.q1_ns <= qs.median_ns) & (qs.median_ns <= qs.q3_ns)
            & (qs.q3_ns <= qs.max_ns)).all()
    assert lat.conditions.repeats == 5 and lat.conditions.warmup == 1
    with pytest.raises(ValueError, match="repeats"):
        call_latency(8.0, "multi_page", 0.2, "steady", 2, 0, repeats=4)
    with pytest.raises(ValueError, match="warmup"):
        call_latency(8.0, "multi_page", 0.2, "steady", 2, 0, warmup=-1)
