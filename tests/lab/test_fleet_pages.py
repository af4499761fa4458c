"""lab.fleet_hashing / fleet_scaling / fleet_simulation: pages 11, 12 and 14 in one call each."""
import inspect

import numpy as np
import pandas as pd
import pytest

from lab.fleet import hit_ratio_across_scale_event, measure_lookup_us, page_trace
from lab.fleet_hashing import VNODES, fleet_hashing, lookup_cost
from lab.fleet_scaling import TRACE_SEEDS, fleet_scaling, paired_dip
from lab.fleet_simulation import BOUND_C, RealReplica, fleet_simulation, in_flight_at_routing
from serve.fleet.routing.bounded_load import BoundedLoadRouter
from serve.fleet.routing.registry import KEY_ROUTERS, ROUTERS


def test_fleet_hashing_landing():
    run = fleet_hashing("ring", 8, 2, 160, 300)
    trace = page_trace(None, 300).requests
    assert run.num_requests == len(trace) == 300 and run.load.requests.sum() == 300
    landing = run.landing.assign(prefix=run.landing.request.map(lambda i: trace[i].hash_ids[:2]))
    assert list(landing.request) == [i for i in range(300) for _ in KEY_ROUTERS]
    assert list(landing.algorithm[:len(KEY_ROUTERS)]) == list(KEY_ROUTERS) and (landing.prefix_blocks == 2).all()
    by_prefix = landing.groupby(["algorithm", "prefix"])
    assert (by_prefix.replica.nunique() == 1).all()           # a shared prefix lands on one replica
    assert (by_prefix.requests_sharing_prefix.first() == by_prefix.size()).all()
    assert list(run.balance.vnodes) == list(VNODES)
    assert 0 <= run.hit_ratio <= run.ideal_ratio + 1e-12
    with pytest.raises(ValueError, match="algorithm"):
        fleet_hashing("nope", 8, 2, 160, 300)


def test_lookup_cost_is_a_repeated_interleaved_measurement():
    """Page 11's lookup timing goes through lab.timing.measure: every router, >= 5 repeats after a warm-up,
    the median inside its quartiles and min / max; fewer repeats are refused."""
    cost = lookup_cost(4, 10)
    t = cost.table
    assert list(t.algorithm) == list(ROUTERS)
    assert cost.conditions.repeats >= 5 and cost.conditions.warmup >= 1 and cost.conditions.torch_threads == 1
    assert ((t.min_us <= t.q1_us) & (t.q1_us <= t.us_per_key) & (t.us_per_key <= t.q3_us)
            & (t.q3_us <= t.max_us) & (t.min_us > 0)).all(), t
    with pytest.raises(ValueError, match="repeats"):
        measure_lookup_us(4, 10, num_keys=10, repeats=3)


def test_fleet_scaling_one_call():
    run = fleet_scaling(8, "add", 10_000, 160, 600, 2, 0.5, 100, "unlimited")
    assert run.replicas_after == 9 and run.at_request == 300 and run.routing_keys > 1
    mod_n = run.moved.set_index("algorithm").moved_fraction["mod_n"]
    assert mod_n > 0.8 and (run.moved.set_index("algorithm").moved_fraction.drop("mod_n") < 0.3).all()
    assert set(run.recovery.algorithm) == set(run.dip.algorithm)
    with pytest.raises(ValueError, match="capacity"):
        fleet_scaling(8, "add", 10_000, 160, 600, 2, 0.5, 100, "7")


def test_fleet_scaling_averages_seeds_against_a_no_event_replay():
    run = fleet_scaling(8, "add", 10_000, 160, 600, 2, 0.5, 100, "unlimited", replica_cache="block_lru")
    assert run.seeds == TRACE_SEEDS > 1
    before, after = run.dip[run.dip.request < run.at_request], run.dip[run.dip.request >= run.at_request]
    assert (before.change == 0).all() and (before.change_lo == 0).all() and (before.change_hi == 0).all()
    assert (run.dip.lo <= run.dip.hit_ratio + 1e-12).all() and (run.dip.hit_ratio <= run.dip.hi + 1e-12).all()
    # the mean is the mean of the seeds' own replays (seed 0 .. TRACE_SEEDS - 1)
    curves = [hit_ratio_across_scale_event(page_trace(None, 600, seed=s).requests, KEY_ROUTERS, 8, 2, "add", 0.5, 100,
                                           None, 160) for s in range(TRACE_SEEDS)]
    mean = pd.concat(curves).groupby(["algorithm", "request"], sort=False).hit_ratio.mean().reset_index()
    assert np.allclose(mean.hit_ratio, run.dip.hit_ratio, rtol=0, atol=1e-12)
    assert (after.groupby("algorithm").change.mean()["mod_n"] < after.groupby("algorithm").change.mean().drop("mod_n")).all()
    assert run.recovery.set_index("algorithm").hit_ratio_lost["mod_n"] > 0


def test_policy_cache_replays_stay_within_the_block_ideal():
    """Pages 11 and 12 on policy caches at real bytes (vLLM align: it leaves KV without states): hit ratio plus
    the KV held without a state never beats one infinite shared block cache, per trace and on average; the
    no-event figures of page 12 are those of the page-11 style replay of the same trace."""
    from lab.fleet import routing_load
    replica = RealReplica(cache_policy="vllm align", budget_fraction=1 / 16)
    setup = dict(replica=replica)
    run = fleet_hashing("ring", 8, 2, 160, 400, **setup)
    assert run.budget_gb == pytest.approx(replica.cache().budget_bytes / 1e9)
    assert 0 < run.hit_ratio and 0 < run.lost_ratio and run.hit_ratio + run.lost_ratio <= run.ideal_ratio + 1e-12
    lru = fleet_hashing("ring", 8, 2, 160, 400, replica_cache="block_lru")
    assert run.hit_ratio < lru.hit_ratio <= lru.ideal_ratio + 1e-12 and lru.lost_ratio == 0 and lru.budget_gb is None
    scaled = fleet_scaling(8, "add", 10_000, 160, 400, 2, 0.5, 50, "unlimited", algorithms=("ring", "mod_n"),
                           seeds=2, **setup)
    rec = scaled.recovery.set_index("algorithm")
    assert list(rec.index) == ["ring", "mod_n"] and scaled.seeds == 2
    assert ((rec.hit_ratio_no_event + rec.lost_no_event) <= scaled.ideal_ratio + 1e-12).all()
    assert (rec.lost_no_event > 0).all() and rec.hit_ratio_lost["mod_n"] > rec.hit_ratio_lost["ring"] > 0
    one = fleet_scaling(8, "add", 10_000, 160, 400, 2, 0.5, 50, "unlimited", algorithms=("ring",), seeds=1, **setup)
    load = routing_load(page_trace(None, 400).requests, "ring", 8, 2, vnodes=160,
                        cache_factory=replica.cache)
    row = one.recovery.iloc[0]
    assert row.hit_ratio_no_event == pytest.approx(load.hit_tokens.sum() / load.tokens.sum(), abs=1e-12)
    assert row.lost_no_event == pytest.approx(load.lost_tokens.sum() / load.tokens.sum(), abs=1e-12)


def test_policy_cache_setup_errors_are_clear():
    """An unknown setup: ValueError naming what to change, from both pages' calls (a bad replica is refused when
    it is built: tests/serve/fleet/test_real_replica.py)."""
    with pytest.raises(ValueError, match="replica_cache"):
        fleet_hashing("ring", 8, 2, 160, 200, replica_cache="lfu")
    for kwargs, what in (({"algorithms": ("round_robin",)}, "algorithms"), ({"algorithms": ()}, "algorithms"),
                         ({"seeds": 0}, "seeds"), ({"replica_cache": "lfu"}, "replica_cache")):
        with pytest.raises(ValueError, match=what):
            fleet_scaling(8, "add", 10_000, 160, 200, 2, 0.5, 50, "unlimited", **kwargs)


def test_fitting_tps_and_display_names():
    from lab.fleet import DISPLAY_NAMES, display_name, fitting_tps
    from lab.real_scale import TP_SIZES
    assert fitting_tps("kimi-linear-48b-a3b", "H200") == TP_SIZES
    assert fitting_tps("kimi-k3", "H200") == (16,) and fitting_tps("kimi-k3", "A100") == ()
    assert set(ROUTERS) <= set(DISPLAY_NAMES) and display_name("mod_n") == "mod-N"
    assert all("_" not in name for name in DISPLAY_NAMES.values())


def test_paired_dip_by_hand():
    # one algorithm, windows of 100, event at 200: loss 0.4, 0.4, 0.2, 0.1, 0.0, 0.0 over the windows after it
    change = [0, 0, -0.4, -0.4, -0.2, -0.1, 0.0, 0.0]
    dip = pd.DataFrame({"algorithm": "a", "request": [100 * i for i in range(8)], "hit_ratio": [0.5] * 8,
                        "change": change})
    row = paired_dip(dip, 200, windows_after=2).iloc[0]
    assert row.hit_ratio_lost == pytest.approx(0.4)
    # 3-window loss means from 200: 0.333, 0.233, 0.1 <= 0.2 at request 400 -> 200 requests after the event
    assert row.requests_to_recover == 200 and row.hit_ratio_before == 0.5
    flat = dip.assign(change=0.0)
    assert paired_dip(flat, 200).iloc[0].requests_to_recover == 0
    with pytest.raises(ValueError, match="windows_after"):
        paired_dip(dip, 200, windows_after=0)


def test_fleet_simulation_policies_and_progress():
    seen = []
    run = fleet_simulation(["ring", "round_robin"], 300, 4, 2, "8000", "vtc", 10, "none", 8, "a10g",
                           progress=seen.append)
    assert list(run.summary[run.summary["class"] == "all"].policy) == ["ring", "round_robin"]
    assert set(run.per_request.policy) == {"ring", "round_robin"} and len(run.per_request) == 600
    assert seen == sorted(seen) and seen[-1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="policies"):
        fleet_simulation([], 300, 4, 2, "8000", "vtc", 10, "none", 8, "a10g")
    with pytest.raises(ValueError, match="policies must not repeat a policy, got 'round_robin' more than once"):
        fleet_simulation(["round_robin", "ring", "round_robin"], 300, 4, 2, "8000", "vtc", 10, "none", 8, "roofline")


def test_bounded_load_never_routes_above_its_in_flight_cap():
    run = fleet_simulation(["ring", "bounded_load"], 600, 4, 2, "8000", "vtc", 10, "add", 8, "a10g")
    over = run.in_flight.set_index("policy").over_cap_share
    assert over["bounded_load"] == 0.0 and over["ring"] > 0.0
    assert inspect.signature(BoundedLoadRouter).parameters["c"].default == BOUND_C
    # a removal drains queued requests onto the others: judged from the removal on, still never above the cap
    run = fleet_simulation(["bounded_load"], 2000, 2, 2, "8000", "vtc", 10, "remove", 1, "a10g")
    row = run.in_flight.iloc[0]
    assert row.over_cap_share == 0.0 and 0 < row.requests < 2000


def test_in_flight_at_routing_by_hand():
    # 2 replicas; a on r0 [0, 10), b on r0 [1, 5), c on r1 [5, 6) (b's finish at 5 counts first)
    df = pd.DataFrame({"replica": ["r0", "r0", "r1"], "admitted_ms": [0.0, 1.0, 5.0], "finish_ms": [10.0, 5.0, 6.0]})
    row = in_flight_at_routing(df, lambda t: frozenset({'r0', 'r1'}), c=1.25).iloc[0]
    # a: load 1, cap ceil(1.25 * 1 / 2) = 1 ok; b: load 2, cap ceil(1.25 * 2 / 2) = 2 ok; c: load 1, cap 2 ok
    assert row.over_cap_share == 0 and row.max_over_mean == pytest.approx(2 * 2 / 2)
    # the chosen replica's in-flight at a, b, c: 1, 2, 1; the fleet's per replica: 1/2, 2/2, 2/2
    assert row.p99_in_flight == pytest.approx(np.percentile([1, 2, 1], 99))
    assert row.mean_in_flight == pytest.approx((0.5 + 1 + 1) / 3)
    row = in_flight_at_routing(df.assign(replica="r0"), lambda t: frozenset({'r0', 'r1'}), c=1.25).iloc[0]
    # c now lands on r0 with a: load 2 > cap ceil(1.25 * 2 / 2) = 2? no; b: 2 <= 2 -> none over at c = 1.25
    assert row.over_cap_share == 0
    row = in_flight_at_routing(df.assign(replica="r0"), lambda t: frozenset({'r0', 'r1', 'r2', 'r3'}), c=1.25).iloc[0]
    # 4 replicas: b meets load 2 > ceil(1.25 * 2 / 4) = 1, c meets 2 > 1: two of three over
    assert row.over_cap_share == pytest.approx(2 / 3)


def test_in_flight_at_routing_takes_simultaneous_routings_in_request_order():
    """Two requests arriving at the same millisecond are routed in request order (the simulator sorts by arrival,
    then request id), not in the order of their replicas' names: at load, same-ms arrivals are common, and judging
    request 1 (on "r0") before request 0 (on "r1") put bounded loads above its own cap (0.5 % of 200 requests)."""
    # 2 replicas; request 0 -> r1 and request 1 -> r0, both at 5 ms; r0 already holds one request from 0 ms
    df = pd.DataFrame({"request_id": [2, 0, 1], "replica": ["r0", "r1", "r0"], "admitted_ms": [0.0, 5.0, 5.0],
                       "finish_ms": [100.0, 100.0, 100.0]})
    row = in_flight_at_routing(df, lambda t: frozenset({"r0", "r1"}), c=1.25).iloc[0]
    # in request order: 0 -> r1 (loads 1, 1; cap ceil(1.25 * 2 / 2) = 2); 1 -> r0 (2, 1; cap ceil(1.25 * 3 / 2) = 2)
    assert row.over_cap_share == 0
    # judged by replica name, 1 -> r0 would come first on 3 replicas: load 2 > cap ceil(1.25 * 2 / 3) = 1
    row = in_flight_at_routing(df, lambda t: frozenset({"r0", "r1", "r2"}), c=1.25).iloc[0]
    # request order: 0 -> r1: cap ceil(1.25 * 2 / 3) = 1, load 1 ok; 1 -> r0: cap ceil(1.25 * 3 / 3) = 2, load 2 ok
    assert row.over_cap_share == 0


def test_bounded_load_stays_under_its_cap_under_load():
    run = fleet_simulation(["bounded_load"], 200, 8, 2, "8000", "vtc", 10, "none", 8, "roofline", arrival_rps=50)
    assert run.in_flight.over_cap_share.iloc[0] == 0.0 and run.in_flight.mean_in_flight.iloc[0] > 1


def test_fleet_simulation_on_real_replicas():
    """Kimi-Linear on 8 x H200 per replica with a policy cache: the KDA view per routing policy is consistent
    with the summary, within the block ideal, per replica within the budget; K3 on 8 x H200 is refused."""
    from lab.real_scale import free_bytes
    from serve.scale.hardware import hardware
    run = fleet_simulation(["cache_aware", "precise_kv", "precise_state"], 600, 4, 2, "8000", "vtc", 10, "none", 8,
                           "roofline", replica=RealReplica(cache_policy="vllm align", budget_fraction=1 / 16))
    kda = run.kda.set_index("policy")
    overall = run.summary[run.summary["class"] == "all"].set_index("policy")
    assert list(kda.index) == ["cache_aware", "precise_kv", "precise_state"]
    assert (kda.hit_ratio == overall.hit_ratio).all()
    assert ((kda.hit_ratio + kda.lost_to_missing_state) <= run.ideal_ratio + 1e-12).all()
    assert (kda.lost_to_missing_state > 0).any()          # vLLM align leaves KV without states
    budget = free_bytes("kimi-linear-48b-a3b", hardware("H200"), 8) / 16
    per = run.replica_bytes
    assert len(per) == 12 and (per.budget_gb * 1e9).tolist() == pytest.approx([budget] * 12, rel=1e-12)
    # bytes by kind held when the replica's KV + states peaked: their stack stays under the budget (here each
    # kind's own peak, reached at different times, stacked above it on 6 of the 12 replicas)
    held = (per.kv_gb + per.state_gb + per.running_gb) * 1e9
    assert (held <= budget * (1 + 1e-12)).all(), (held / budget).tolist()
    assert (per.kv_gb > 0).all() and (per.state_gb > 0).all() and (per.running_gb > 0).all()
    assert "roofline" in run.service_source
    assert run.kda is not None and fleet_simulation(["ring"], 300, 4, 2, "8000", "vtc", 10, "none", 8, "a10g").kda is None
    with pytest.raises(ValueError, match="do not fit"):
        RealReplica("kimi-k3", "H200", 8, "ours", 1 / 8)


def test_retime_sets_the_mean_rate_and_keeps_the_requests():
    from lab.fleet_simulation import retime
    trace = page_trace(None, 200)[0]
    fast = retime(trace, 50.0)
    assert [(r.input_length, r.output_length, r.hash_ids) for r in fast] == \
        [(r.input_length, r.output_length, r.hash_ids) for r in trace]
    assert fast[0].timestamp_ms == 0 and all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(fast, fast[1:]))
    assert (len(fast) - 1) / (fast[-1].timestamp_ms / 1000) == pytest.approx(50.0, rel=1e-3)
    gaps = np.diff([r.timestamp_ms for r in trace]), np.diff([r.timestamp_ms for r in fast])
    assert np.corrcoef(*gaps)[0, 1] > 0.999                     # the gaps scaled, not redrawn: bursts stay bursts
    assert retime(trace[:1], 5.0)[0].timestamp_ms == 0 and retime([], 5.0) == []
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rate_rps"):
            retime(trace, bad)
    with pytest.raises(ValueError, match="arrival_rps"):
        fleet_simulation(["ring"], 300, 4, 2, "8000", "vtc", 10, "none", 8, "a10g", arrival_rps=0)


def test_offered_load_is_where_routing_decides_ttft():
    """At the trace's own 3.4 req/s eight real-model replicas hold ~0.2 requests each, so the policies differ only by
    their hits; at the page's default load queues form: more in flight, and round robin (which scatters sessions
    and loses their hits) has a P50 TTFT well above cache-aware routing's."""
    from lab.fleet_simulation import DEFAULT_ARRIVAL_RPS, load_sweep
    args = (["round_robin", "cache_aware"], 800, 8, 2, "8000", "vtc", 10, "none", 8, "roofline")
    idle, busy = (fleet_simulation(*args, arrival_rps=rate) for rate in (None, DEFAULT_ARRIVAL_RPS))
    assert idle.in_flight.mean_in_flight.max() < 0.5 < 1.0 < busy.in_flight.mean_in_flight.min()
    p50 = busy.summary[busy.summary["class"] == "all"].set_index("policy").ttft_p50_ms
    assert p50["round_robin"] > 1.3 * p50["cache_aware"]
    seen = []
    sweep = load_sweep(args[0], (10, 80), *args[1:], progress=seen.append)
    assert list(sweep.columns[:2]) == ["policy", "rate_rps"] and len(sweep) == 4
    assert (sweep.ttft_p99_ms >= sweep.ttft_p50_ms).all() and seen[-1] == pytest.approx(1.0)
    by = sweep.set_index(["policy", "rate_rps"])
    for policy in args[0]:      # the same trace re-timed: more load, more wait, the same reachable hits
        assert by.loc[(policy, 80.0)].ttft_p99_ms > by.loc[(policy, 10.0)].ttft_p99_ms
        assert by.loc[(policy, 80.0)].mean_in_flight > by.loc[(policy, 10.0)].mean_in_flight
    with pytest.raises(ValueError, match="rates_rps"):
        load_sweep(args[0], (), *args[1:])


def test_the_load_sweep_runs_at_values_the_rate_slider_offers():
    """Page 14's sweep points are loads a link or the slider can ask for (``?p14_rate=120`` was refused while the
    sweep drew 120), and the default load is one of them."""
    from lab.fleet_simulation import ARRIVAL_RATES, DEFAULT_ARRIVAL_RPS, SWEEP_RATES

    assert set(SWEEP_RATES) <= set(ARRIVAL_RATES) and DEFAULT_ARRIVAL_RPS in SWEEP_RATES


def test_load_sweep_judges_saturation_by_queue_growth_not_the_completed_rate():
    """Completed = completed ÷ (last finish − first arrival) sits below offered by the drain tail of a finite run:
    ring hashing at 40 req/s on 8 real-model replicas completes ~34 req/s with a queue wait under a millisecond
    throughout (not saturated); at 100 req/s the late arrivals wait far longer than the early ones (saturated)."""
    from lab.fleet_simulation import load_sweep, queue_growing
    n = 600
    sweep = load_sweep(["ring"], (40, 100), n, 8, 2, "8000", "vtc", 10, "none", 8, "roofline").set_index("rate_rps")
    calm, hot = sweep.loc[40.0], sweep.loc[100.0]
    assert calm.throughput_rps < 0.9 * 40 and not calm.saturated and calm.wait_last_ms < 10
    assert calm.throughput_rps == pytest.approx(n / ((n - 1) / 40 + calm.drain_s), rel=1e-3)   # the drain tail
    assert hot.saturated and hot.wait_last_ms > 2 * hot.wait_first_ms
    assert not queue_growing(0.0, 99.0) and queue_growing(0.0, 101.0) and not queue_growing(100.0, 199.0)
