"""Fleet benchmark: routing lookups per second, the whole Mooncake conversation trace through the
simulation (8 replicas, target < 10 s), the fidelity figures next to the published anchors, and the
prefix-cache policy models at real scale (Kimi-Linear-48B-A3B on an H200 x TP8 replica): the whole
conversation trace through each policy in one replica's timeless replay, and through a fleet of 8 such
replicas with the policy as each replica's cache and roofline step times (target <= 5 s per policy), and
page 15's sweep of 6 budgets x 5 policies (target <= 30 s on the whole conversation trace; also the page's
default trace and the sweep with its interval replays). Every timed figure is given with its ratio to the
goal (< 1 = within it) and the 1-minute load average when it was taken.

Run: ``python -m bench.fleet`` (writes ``bench/results/fleet.json``). Timings are medians of repeats;
lookup rates are also given relative to round-robin (the cheapest router), measured in the same run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from lab.real_scale import BUDGET_FRACTIONS, RealReplica, free_bytes, policy_view
from serve.fleet.routing.hashing import random_keys
from serve.fleet.routing.registry import KEY_ROUTERS, ROUTERS, make_router, options_for, replica_names
from serve.fleet.routing.replay import replay_routing
from serve.fleet.routing.ring import ConsistentHashRouter
from serve.fleet.routing.router import RouteQuery
from serve.fleet.scaling.keys_moved import scaling_table
from serve.fleet.sim.simulation import simulate
from serve.fleet.sim.types import FleetConfig, percentile, requests_from_trace
from serve.fleet.sim.vtc import replay_vtc_suite
from serve.scale.hardware import hardware
from serve.scale.policies import CACHE_POLICIES, all_policies, replay
from serve.traces.mooncake import ideal_hit_ratio, load_mooncake

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"
PARAMS = {"vnodes": 160, "table_size": 65537}


def _median_time(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def lookup_rates(num_keys: int = 20_000, vector_keys: int = 1_000_000) -> dict:
    """Scalar ``route`` lookups/s (every router) and vectorised ``assign`` keys/s (key routers)."""
    keys = random_keys(num_keys, seed=1)
    queries = [RouteQuery(int(k), (int(k) % 1000, int(k) % 7)) for k in keys]
    out = {}
    for name in ROUTERS:
        router = make_router(name, replica_names(8), **options_for(name, PARAMS))

        def run(router=router):
            for q in queries:
                router.route(q)

        out[name] = {"scalar_lookups_per_s": num_keys / _median_time(run)}
    vkeys = random_keys(vector_keys, seed=2)
    for name in KEY_ROUTERS:
        router = make_router(name, replica_names(8), **options_for(name, PARAMS))
        out[name]["vector_keys_per_s"] = vector_keys / _median_time(lambda router=router: router.assign(vkeys), 3)
    base = out["round_robin"]["scalar_lookups_per_s"]
    for name in out:
        out[name]["scalar_vs_round_robin"] = out[name]["scalar_lookups_per_s"] / base
    return out


def conversation_simulation(service) -> dict:
    """Whole conversation trace (12,031 requests), 8 replicas, unlimited caches, per policy."""
    trace = load_mooncake(TRACES / "mooncake_conversation_trace.jsonl")
    requests = requests_from_trace(trace)
    out = {"ideal_token_hit_ratio": ideal_hit_ratio(trace).token_hit_ratio}
    for policy in ("ring", "round_robin", "cache_aware", "bounded_load", "least_loaded"):
        holder = {}

        def run(policy=policy, holder=holder):
            holder["sim"] = simulate(requests, FleetConfig(service=service, num_replicas=8, router=policy,
                                                           router_params=options_for(policy, PARAMS)))

        wall = _median_time(run, 3)
        sim = holder["sim"]
        ttft = sim.column("ttft_ms")
        per_replica = np.bincount([int(r.replica.split("-")[1]) for r in sim.results], minlength=8)
        out[policy] = {"wall_s": wall, "token_hit_ratio": sim.token_hit_ratio(),
                       "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
                       "max_over_mean_requests": float(per_replica.max() / per_replica.mean()),
                       "throughput_rps": sim.throughput_rps()}
    return out


SCALE_SETUP = ("kimi-linear-48b-a3b", "H200", 8)   # model, GPU, TP of the real-scale replays
FLEET_GOAL_S, SWEEP_GOAL_S = 5.0, 30.0              # per policy through 8 replicas; 6 budgets x 5 policies
FLEET_BUDGET_FRACTION = 1 / 8                       # of the HBM the weights leave, per replica


def _load() -> float:
    return os.getloadavg()[0]


def policy_fleet(router: str = "cache_aware") -> dict:
    """The whole conversation trace through 8 replicas (``SCALE_SETUP``), each a policy of page 15's sweep at
    ``FLEET_BUDGET_FRACTION`` of the free HBM with roofline step times, routed by ``router``: wall seconds
    per policy (one run each) against ``FLEET_GOAL_S``, and the KDA figures of the run."""
    model, gpu, tp = SCALE_SETUP
    trace = load_mooncake(TRACES / "mooncake_conversation_trace.jsonl")
    requests = requests_from_trace(trace)
    out = {"router": router, "budget_fraction": FLEET_BUDGET_FRACTION, "goal_s": FLEET_GOAL_S,
           "ideal_token_hit_ratio": ideal_hit_ratio(trace).token_hit_ratio}
    for name in CACHE_POLICIES:
        replica = RealReplica(model, gpu, tp, name, FLEET_BUDGET_FRACTION)
        service, factory = replica.service(), replica.cache
        load = _load()
        t0 = time.perf_counter()
        sim = simulate(requests, FleetConfig(service=service, num_replicas=8, router=router, router_params=options_for(router, PARAMS),
                                             cache_factory=factory))
        wall = time.perf_counter() - t0
        caches = sim.replica_caches.values()
        ttft = sim.column("ttft_ms")
        out[name] = {"wall_s": wall, "ratio_to_goal": wall / FLEET_GOAL_S, "load_1min": load,
                     "token_hit_ratio": sim.token_hit_ratio(),
                     "lost_to_missing_state": sum(c.lost_to_missing_state for c in caches)
                     / sum(r.input_length for r in sim.results),
                     "peak_kv_gb_mean": float(np.mean([c.peak_bytes["kv"] for c in caches])) / 1e9,
                     "peak_state_gb_mean": float(np.mean([c.peak_bytes["state"] for c in caches])) / 1e9,
                     "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
                     "throughput_rps": sim.throughput_rps()}
    return out


def policy_replays() -> dict:
    """The whole conversation trace through each policy of ``all_policies`` at the budget the H200 x TP8
    replica leaves after the weights (one replay each: wall time, hit ratio, peak GB by kind)."""
    model, gpu, tp = SCALE_SETUP
    trace = load_mooncake(TRACES / "mooncake_conversation_trace.jsonl")
    budget = free_bytes(model, hardware(gpu), tp)
    out = {"budget_gb": budget / 1e9, "requests": len(trace)}
    for pol in all_policies(model, tp):
        t0 = time.perf_counter()
        res = replay(trace, pol, budget)
        out[pol.name] = {"wall_s": time.perf_counter() - t0, "token_hit_ratio": res.token_hit_ratio,
                         "ideal_hit_ratio": res.ideal_hit_tokens / res.total_tokens,
                         "peak_gb": {k: v / 1e9 for k, v in res.peak_bytes.items()},
                         "states_evicted": res.states_evicted}
    return out


def policy_sweep() -> dict:
    """Page 15's sweep (6 budgets x 5 policies, plus its 2 x 5 interval replays) timed end to end: on the
    page's default trace (synthetic, 3,000 requests) and on the whole conversation trace."""
    model, gpu, tp = SCALE_SETUP
    out = {"budgets": len(BUDGET_FRACTIONS), "goal_s": SWEEP_GOAL_S}
    whole = load_mooncake(TRACES / "mooncake_conversation_trace.jsonl")
    for name, kw in (("page_default_3000", {"num_requests": 3000}),
                     ("conversation_whole_6x5", {"num_requests": 0, "requests": whole, "intervals": ()}),
                     ("conversation_whole", {"num_requests": 0, "requests": whole})):
        load = _load()
        t0 = time.perf_counter()
        view = policy_view(RealReplica(model, gpu, tp), **kw)
        b = view.budgets
        wall = time.perf_counter() - t0
        out[name] = {"wall_s": wall, "ratio_to_goal": wall / SWEEP_GOAL_S, "load_1min": load,
                     "replays": len(b) + len(view.intervals),
                     "budget_sweep_replay_s": float(b.replay_s.sum()),
                     "interval_sweep_replay_s": float(view.intervals.replay_s.sum()) if len(view.intervals) else 0.0,
                     "ideal_hit_ratio": view.ideal_hit_ratio,
                     "hit_at_largest_budget": b[b.budget_gb == b.budget_gb.max()].set_index("policy")
                     .token_hit_ratio.to_dict()}
    return out


def fidelity() -> dict:
    keys = random_keys(100_000, seed=0)
    moved = {r.algorithm: r.moved_fraction for r in scaling_table(8, 9, keys, **PARAMS)}
    ring = ConsistentHashRouter(replica_names(8), vnodes=160)
    arcs = np.array(list(ring.arc_shares().values()))
    maglev = make_router("maglev", replica_names(8), table_size=65537)
    shares = np.array(list(maglev.entry_shares().values()))
    trace = load_mooncake(TRACES / "mooncake_conversation_trace.jsonl")
    ring2 = replay_routing(trace, make_router("ring", replica_names(8), vnodes=160), k=2)
    rr = replay_routing(trace, make_router("round_robin", replica_names(8)), k=2)
    return {
        "keys_moved_8_to_9": moved, "keys_moved_ideal": 1 / 9, "keys_moved_mod_n_expected": 8 / 9,
        "ring_v160_max_over_mean": float(arcs.max() / arcs.mean()),
        "maglev_m65537_max_over_mean": float(shares.max() / shares.mean()),
        "mooncake_ideal_token_hit_ratio": ideal_hit_ratio(trace).token_hit_ratio,
        "mooncake_ring_k2_token_hit_ratio": ring2.token_hit_ratio,
        "mooncake_round_robin_token_hit_ratio": rr.token_hit_ratio,
    }


def _rows(section: dict):
    """A results section's per-policy rows (name, dict), skipping its scalar fields (requests, budget, ...)."""
    return ((name, r) for name, r in section.items() if isinstance(r, dict))


def main() -> None:
    vtc = replay_vtc_suite(TRACES / "vtc_artifact", "on_off_less")
    light = vtc.light_client
    service = vtc.service.scaled(8, 5, kv_capacity_tokens=400_000, max_batch_requests=256)
    results = {
        "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine()},
        "lookups": lookup_rates(),
        "conversation_simulation": conversation_simulation(service),
        "conversation_service_model": service.source,
        "fidelity": fidelity(),
        "policy_replays": policy_replays(),
        "policy_sweep": policy_sweep(),
        "policy_fleet": policy_fleet(),
        "vtc_on_off_less": {
            "light_client": light,
            "light_p99_ttft_s": {"FCFS": {"measured": vtc.p99("FCFS", light, "measured"), "ours": vtc.p99("FCFS", light)},
                                 "VTC": {"measured": vtc.p99("VTC", light, "measured"), "ours": vtc.p99("VTC", light)}},
            "throughput_rps": {"measured": vtc.measured_throughput_rps, "ours": vtc.ours_throughput_rps},
        },
    }
    out = REPO / "bench" / "results" / "fleet.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print("routing lookups (8 replicas):")
    for name, r in results["lookups"].items():
        vec = f", vectorised {r['vector_keys_per_s'] / 1e6:6.1f} M keys/s" if "vector_keys_per_s" in r else ""
        print(f"  {name:13s} {r['scalar_lookups_per_s'] / 1e3:8.0f} k/s scalar ({r['scalar_vs_round_robin']:.2f}x round-robin){vec}")
    sim = results["conversation_simulation"]
    print(f"conversation trace, 8 replicas ({service.source}); ideal hit {sim['ideal_token_hit_ratio']:.4f}:")
    for policy, r in _rows(sim):
        print(f"  {policy:13s} {r['wall_s']:5.2f} s wall  hit {r['token_hit_ratio']:.4f}  TTFT P50 {r['ttft_p50_ms']:7.0f} ms"
              f"  P99 {r['ttft_p99_ms']:7.0f} ms  max/mean req {r['max_over_mean_requests']:.2f}")
    print("fidelity:", json.dumps(results["fidelity"], indent=1))
    pr = results["policy_replays"]
    print(f"prefix-cache policies, whole conversation trace ({pr['requests']:,} requests), {' x '.join(map(str, SCALE_SETUP))},"
          f" budget {pr['budget_gb']:,.0f} GB per replica:")
    for name, r in _rows(pr):
        print(f"  {name:24s} {r['wall_s']:5.2f} s  hit {r['token_hit_ratio']:.4f} (ideal {r['ideal_hit_ratio']:.4f})"
              f"  KV {r['peak_gb']['kv']:7.1f} GB  states {r['peak_gb']['state']:7.1f} GB")
    for name, r in _rows(results["policy_sweep"]):
        print(f"page 15 sweep, {name}: {r['wall_s']:5.1f} s for {r['replays']} replays = {r['ratio_to_goal']:.2f} x "
              f"the {SWEEP_GOAL_S:.0f} s goal (load {r['load_1min']:.1f}; 6 x 5 budget sweep "
              f"{r['budget_sweep_replay_s']:.1f} s of replay)")
    pf = results["policy_fleet"]
    print(f"whole conversation trace through 8 replicas ({' x '.join(map(str, SCALE_SETUP))}, {pf['router']}, cache "
          f"{pf['budget_fraction']:g} of free HBM, roofline); block ideal {pf['ideal_token_hit_ratio']:.4f}:")
    for name, r in _rows(pf):
        print(f"  {name:22s} {r['wall_s']:5.2f} s = {r['ratio_to_goal']:.2f} x goal (load {r['load_1min']:.1f})  "
              f"hit {r['token_hit_ratio']:.4f}  KV w/o state {r['lost_to_missing_state']:.4f}  "
              f"KV {r['peak_kv_gb_mean']:6.1f} GB  states {r['peak_state_gb_mean']:6.1f} GB  "
              f"TTFT P50 {r['ttft_p50_ms']:6.0f} P99 {r['ttft_p99_ms']:6.0f} ms")
    print("VTC on_off_less:", json.dumps(results["vtc_on_off_less"], indent=1))
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
