"""Fleet replicas on policy models at real bytes with roofline step times, and the precise prefix routers."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from serve.fleet.routing.policy_cache import PolicyReplicaCache
from serve.fleet.routing.prefix_score import PrefixScoreRouter
from serve.fleet.routing.router import RouteQuery
from serve.fleet.sim.roofline_service import RooflineService
from serve.fleet.sim.service_model import ServiceModel
from serve.fleet.sim.simulation import simulate
from serve.fleet.sim.types import FleetConfig, FleetRequest, requests_from_trace
from serve.scale.hardware import hardware
from serve.scale.model_shape import preset
from serve.scale.policies import OursPolicy, all_policies, replay
from serve.scale.roofline import checkpoint_restore_time, decode_time, prefill_time
from serve.scale.validation import fit_prefill
from serve.traces.mooncake import load_mooncake

torch.set_num_threads(1)
KIMI = "kimi-linear-48b-a3b"
TRACE = Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
GAP_MS = 1e6                       # arrivals this far apart: each request ends before the next arrives (checked)


def spaced(trace, n):
    """The first ``n`` trace requests, one at a time (no two on a replica at once)."""
    return [r._replace(arrival_ms=i * GAP_MS) for i, r in enumerate(requests_from_trace(trace[:n]))]


@pytest.fixture(scope="module")
def conversation():
    return load_mooncake(TRACE)


def test_roofline_step_times_by_hand():
    """A prefill step = per request: attention-kind roofline time x alpha + the rest x beta, + one checkpoint
    restore when it hits; a decode step = the roofline TPOT at the given context. Computed here from the
    roofline pieces, not through the service's own helper."""
    svc = RooflineService(KIMI, "H200", 8)
    shape, hw, fit = preset(KIMI), hardware("H200"), fit_prefill()   # the report setup's factors

    def by_hand(new, cached):
        step = prefill_time(shape, hw, 8, new, cached)
        attn = step.kind("mla").time_s
        restore = checkpoint_restore_time(shape, hw, 8) if cached else 0.0
        return 1e3 * (fit.alpha * attn + fit.beta * (step.total_s - attn) + restore)

    parts = [(3000, 0), (500, 8192), (1, 4095)]
    assert svc.prefill_batch_ms(parts) == pytest.approx(sum(by_hand(n, c) for n, c in parts), rel=1e-12)
    assert svc.prefill_batch_ms([(500, 8192)]) < svc.prefill_batch_ms([(8692, 0)])   # a hit saves time
    assert svc.decode_step_ms(16, 20000) == pytest.approx(1e3 * decode_time(shape, hw, 8, 16, 20000).total_s,
                                                          rel=1e-12)
    assert svc.decode_step_ms(16, 40000) > svc.decode_step_ms(16, 20000)
    with pytest.raises(ValueError, match="tp"):
        RooflineService(KIMI, "H200", 0)


def test_service_model_batch_prefill_counts_new_tokens_only():
    svc = ServiceModel(prefill_tokens_per_s=2000, decode_step_base_ms=30, prefill_overhead_ms=5)
    assert svc.prefill_batch_ms([(100, 900), (300, 0)]) == svc.prefill_ms(400) == 5 + 200.0
    assert svc.decode_step_ms(3, 12345) == svc.decode_step_ms(3)


@pytest.mark.parametrize("index", range(7), ids=[p.name for p in all_policies(KIMI, 8)])
def test_one_replica_one_request_at_a_time_equals_the_replay(conversation, index):
    """One replica fed one request at a time is the timeless replay: the same hit for every request (ours:
    the fleet drives ReplayCache request by request, the replay its own loop), the same peak bytes, and
    each TTFT is exactly that request's roofline prefill after its hit. The budget forces evictions."""
    requests = spaced(conversation, 400)
    budget = 40e9
    ref = replay(conversation[:400], all_policies(KIMI, 8)[index], budget)
    svc = RooflineService(KIMI, "H200", 8)
    cfg = FleetConfig(service=svc, num_replicas=1, router="round_robin",
                      cache_factory=lambda: PolicyReplicaCache(all_policies(KIMI, 8)[index], budget, deep_checks=True))
    sim = simulate(requests, cfg)
    got = np.array([r.hit_tokens for r in sim.results])
    assert got.tolist() == ref.request_hit_tokens.tolist()
    cache = sim.replica_caches["replica-0"]
    assert cache.peak_bytes == ref.peak_bytes
    assert cache.held_at_peak == ref.held_at_peak          # bytes by kind when KV + states peaked: within budget
    assert sum(cache.held_at_peak.values()) <= budget
    if ref.hit_tokens:
        assert ref.kv_evicted_tokens > 0, "the budget should force evictions"
    ttft = np.array([r.ttft_ms for r in sim.results])
    want = [svc.request_prefill_ms(max(1, r.input_length - int(h)), int(h)) for r, h in zip(requests, got)]
    assert all(a.finish_ms < b.arrival_ms for a, b in zip(sim.results, sim.results[1:]))
    # absolute times reach 4e8 ms: float64 rounds them to ~6e-8 ms, so TTFT (a difference) to 1e-6 ms
    np.testing.assert_allclose(ttft, want, rtol=0, atol=1e-6)


def test_lost_to_missing_state_counts_kv_without_a_state():
    """ours with C = 2 blocks: a prompt of 3 blocks + 1 token caches checkpoints at blocks 2 (C) and 3 (the
    replay boundary / prompt end); a later prompt sharing only its first block hits nothing and has one block
    of KV without a checkpoint: 512 tokens lost to the missing state."""
    pol = OursPolicy(KIMI, 1024, tp_size=8)
    cache = PolicyReplicaCache(pol, 1e15)
    first = FleetRequest(0, 0.0, 3 * 512 + 1, 1, (1, 2, 3, 4))
    second = FleetRequest(1, 1.0, 2 * 512, 1, (1, 9))
    cache.finish(first, cache.start(first))
    assert cache.start(second) == 0 and cache.lost_to_missing_state == 512
    again = FleetRequest(2, 2.0, 3 * 512 + 1, 1, (1, 2, 3, 5))       # diverges in its last (partial) block
    assert cache.start(again) == 3 * 512 and cache.lost_to_missing_state == 512


def test_policy_cache_rejects_a_budget_below_the_running_slots():
    pol = OursPolicy(KIMI, 2048, tp_size=8)
    with pytest.raises(ValueError, match="state slots"):
        PolicyReplicaCache(pol, pol.replica.state_bytes - 1)
    with pytest.raises(ValueError, match="max_running"):
        PolicyReplicaCache(pol, 1e12, max_running=0)
    for bad in ("40e9", None, float("nan"), float("inf"), True):      # a string was a raw TypeError
        with pytest.raises(ValueError, match="budget_bytes"):
            PolicyReplicaCache(pol, bad)


def test_bytes_held_at_the_peak_stay_within_the_budget():
    """vLLM align on one replica, 1,000 conversation requests under a budget that forces evictions: KV and
    states peak at different requests, so the per-kind peaks stacked pass the budget while the bytes held at
    the peak total (what page 14 stacks) do not, and they are the bytes held after that request."""
    from serve.scale.policies import VLLMMambaPolicy
    requests = spaced(load_mooncake(TRACE), 1000)
    budget = 20e9
    cache = PolicyReplicaCache(VLLMMambaPolicy(KIMI, "align", 8), budget)
    totals = []
    for r in requests:
        cache.finish(r, cache.start(r))
        b = cache.policy.bytes_by_kind()
        totals.append((b["kv"] + b["state"], b["kv"], b["state"]))
    peak_total = max(t for t, _, _ in totals)
    first = next(t for t in totals if t[0] == peak_total)
    assert (cache.held_at_peak["kv"], cache.held_at_peak["state"]) == first[1:]
    assert cache.held_at_peak["running"] == cache.peak_bytes["running"] > 0
    assert sum(cache.held_at_peak.values()) <= budget
    assert sum(cache.peak_bytes.values()) > budget, "the kinds should peak at different times here"


def test_precise_routers_by_hand():
    """Replica a holds 3,000 tokens of KV but a state only at 1,000; b holds 2,000 of KV with its state at
    the end. KV-only routing picks a, checkpoint-aware routing picks b; below 30 % of the prompt (or when the
    loads are imbalanced) both take the least-loaded replica."""
    reported = {"a": (1000, 3000), "b": (2000, 2000), "c": (0, 0)}
    req = FleetRequest(0, 0.0, 4000, 1, ())
    picks = {}
    for use_state in (False, True):
        router = PrefixScoreRouter(["a", "b", "c"], lambda name, r: reported[name], use_state)
        picks[use_state] = router.route(RouteQuery(0, (), req))
        router.on_start("a")
        short = req._replace(input_length=20000)            # 2,000 / 20,000 < 30 %
        assert router.route(RouteQuery(0, (), short)) == "b"  # least loaded: a has one in flight, b first of b, c
    assert picks == {False: "a", True: "b"}
    with pytest.raises(TypeError, match="scorer"):  # the scorer is a constructor argument, never set later
        PrefixScoreRouter(["a", "b", "c"])  # type: ignore[call-arg]


@pytest.mark.slow
def test_fleet_of_eight_on_the_real_trace(conversation):
    """8 replicas, KV-only vs checkpoint-aware precise routing on 2,000 conversation requests: budgets hold,
    every hit is within what the serving replica cached, and no run beats the block ideal."""
    from serve.traces.mooncake import ideal_hit_ratio
    requests = requests_from_trace(conversation[:2000])
    ideal = ideal_hit_ratio(conversation[:2000]).token_hit_ratio
    for router in ("precise_kv", "precise_state", "cache_aware"):
        cfg = FleetConfig(service=RooflineService(KIMI, "H200", 8, kv_capacity_tokens=1_000_000), num_replicas=8,
                          router=router,
                          cache_factory=lambda: PolicyReplicaCache(OursPolicy(KIMI, 2048, tp_size=8), 100e9,
                                                                   deep_checks=True))
        sim = simulate(requests, cfg)
        caches = sim.replica_caches
        hit = sum(c.hit_tokens_total for c in caches.values())
        assert hit == sum(r.hit_tokens for r in sim.results)
        assert 0 < sim.token_hit_ratio() <= ideal
        assert (hit + sum(c.lost_to_missing_state for c in caches.values())) / sum(
            r.input_length for r in sim.results) <= ideal + 1e-12


def test_replica_reports_hit_then_kv_to_the_precise_routers():
    """What a replica reports to a precise router: (hit tokens, KV tokens) of its policy, in that order; the
    block-LRU replica reports its leading run twice (no states)."""
    from serve.fleet.sim.simulation import FleetSim
    first = FleetRequest(0, 0.0, 3 * 512 + 1, 1, (1, 2, 3, 4))
    second = FleetRequest(1, 1.0, 2 * 512, 1, (1, 9))
    cfg = FleetConfig(service=RooflineService(KIMI, "H200", 8), num_replicas=1, router="precise_state",
                      cache_factory=lambda: PolicyReplicaCache(OursPolicy(KIMI, 1024, tp_size=8), 1e15))
    replica = FleetSim([first, second], cfg).replicas["replica-0"]
    replica.policy_cache.finish(first, replica.policy_cache.start(first))
    assert replica.prefix_tokens(second) == (0, 512)
    lru = FleetSim([first, second], FleetConfig(service=RooflineService(KIMI, "H200", 8), num_replicas=1,
                                                 router="precise_kv")).replicas["replica-0"]
    lru.cache.insert(first.hash_ids)
    assert lru.prefix_tokens(second) == (512, 512)


def test_a_runs_caches_go_with_its_result():
    """A run's objects form reference cycles (suspended simpy processes, replica <-> fleet) that only a full garbage
    collection frees; the replica caches, the run's largest part, must not wait for it: they go when the result
    goes (with the collector off, as between two of a page's runs)."""
    import gc
    import weakref
    requests = [FleetRequest(i, float(i), 3 * 512, 4, (i % 3, 7, i)) for i in range(12)]
    cfg = FleetConfig(service=RooflineService(KIMI, "H200", 8), num_replicas=2, router="ring",
                      cache_factory=lambda: PolicyReplicaCache(OursPolicy(KIMI, 1024, tp_size=8), 1e15))
    gc.disable()
    try:
        sim = simulate(requests, cfg)
        refs = [weakref.ref(c) for c in sim.replica_caches.values()]
        assert all(r() is not None for r in refs) and sum(r().peak_bytes["kv"] for r in refs) > 0   # they cached
        del sim
        assert all(r() is None for r in refs), "a replica cache outlived its run's result"
    finally:
        gc.enable()
