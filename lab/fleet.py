"""Page-sized experiments for the fleet pages (11–14): each returns plain data (DataFrames) from one
call, so a page only caches the call and draws.

Published anchors used by the pages live in :data:`ANCHORS` with their sources.
"""

from __future__ import annotations

import inspect
import pickle
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from lab.threads import one_thread
from lab.timing import MIN_REPEATS, Conditions, measure
from serve.errors import check_int
from serve.fleet.real_replica import fitting_tps as fitting_tps  # re-exported: the pages' replica widgets
from serve.fleet.routing.hashing import random_keys
from serve.fleet.routing.policy_cache import PolicyReplicaCache
from serve.fleet.routing.registry import ROUTERS, make_router, options_for, replica_names
from serve.fleet.routing.replay import ScaleEvent, replay_routing
from serve.fleet.routing.ring import ConsistentHashRouter
from serve.fleet.routing.router import RouteQuery
from serve.fleet.scaling.keys_moved import scaling_table
from serve.fleet.sim.service_model import ServiceModel
from serve.fleet.sim.simulation import simulate
from serve.fleet.sim.types import FleetConfig, FleetSimResult, ScaleAt, percentile, requests_from_trace
from serve.traces.limits import LoadedTrace
from serve.traces.mooncake import TraceRequest, ideal_hit_ratio, named_bytes, read_mooncake, synthesize

ANCHORS = {
    "maglev_balance": ("Maglev (Eisenbud et al., NSDI'16): M > 100·N keeps every backend's share of the "
                       "hash space within 1 % of the others"),
    "ring_moves": "Consistent hashing (Karger et al., STOC'97): adding the (n+1)-th node moves ~1/(n+1) of keys",
    "jump_moves": "Jump hash (Lamping & Veach, 2014): exactly the keys of the new bucket move, 1/(n+1) on average",
    "mod_n_moves": "mod-N: a key stays only if k mod n = k mod (n+1), so ~n/(n+1) of keys move",
    "ring_spread": "A node's share of the ring with V vnodes has relative spread ≈ 1/√V",
    "mooncake_cache": ("Mooncake tech report (arXiv 2407.00079, §4.2, on its 2024 trace): a global LRU cache of "
                       "1,000 → 50,000 blocks lifts the hit ratio from 30 % to 50 %"),
    "vtc": ("VTC artifact (Ying1123/VTC-artifact, OSDI'24; S-LoRA, Llama-7B, one A10G), on_off_less suite; the "
            "paper does not print these P99s: they are computed from the artifact's raw per-request files "
            "(fair_bench/{FCFS,VTC}/all_results_on_off_less.jsonl)"),
}

# Mooncake (Qin et al., FAST'25), Table 2: the "cache ratio" of the two released traces
# (kvcache-ai/Mooncake FAST25-release/traces/{conversation,synthetic}_trace.jsonl). The paper gives no
# formula for it; the block ideal of serve.traces.mooncake.ideal_hit_ratio on the same files is a different count
# (hash ids in a request's leading run seen before / all hash ids), computed by tests/serve/traces/test_mooncake_ratios.py.
MOONCAKE_TABLE2_CACHE_RATIO = {"conversation": 0.40, "synthetic": 0.66}

# What the pages show for the routers' code names (legends, axes, tables).
DISPLAY_NAMES = {"round_robin": "round robin", "least_loaded": "least loaded", "mod_n": "mod-N",
                 "ring": "ring (consistent hashing)", "jump": "jump hash", "rendezvous": "rendezvous hashing",
                 "maglev": "Maglev", "bounded_load": "bounded loads", "cache_aware": "cache-aware",
                 "precise_kv": "precise, KV only", "precise_state": "precise, state-aware"}


def display_name(code: str) -> str:
    """The readable name of a router's code name (:data:`DISPLAY_NAMES`); an unknown name is returned as is."""
    return DISPLAY_NAMES.get(code, code)


# The replica cache of the routing-only replays (pages 11, 12): label -> code.
REPLICA_CACHES = {"policy model at real bytes": "policy", "block LRU (512-token blocks)": "block_lru"}


def routing_load(trace: Sequence[TraceRequest], algorithm: str, num_replicas: int, k: int,
                 cache_factory: Callable[[], PolicyReplicaCache] | None = None, **params) -> pd.DataFrame:
    """Requests and prompt tokens per replica when ``trace`` is routed by ``algorithm`` on its first
    ``k`` blocks (routing-only replay; unlimited block LRU caches, or ``cache_factory()`` per replica:
    :meth:`serve.fleet.real_replica.RealReplica.cache`). Columns: replica, requests, tokens, hit_tokens, lost_tokens (KV held on the
    replica, no state to reuse it; 0 with block caches)."""
    replay = replay_routing(trace, make_router(algorithm, replica_names(num_replicas), **options_for(algorithm, params)), k,
                            cache_factory=cache_factory)
    df = pd.DataFrame({"replica": replay.replica, "tokens": replay.input_tokens, "hit_tokens": replay.hit_tokens,
                       "lost_tokens": replay.lost_tokens})
    out = df.groupby("replica", sort=False).agg(requests=("tokens", "size"), tokens=("tokens", "sum"),
                                               hit_tokens=("hit_tokens", "sum"), lost_tokens=("lost_tokens", "sum"))
    out = out.reindex(replica_names(num_replicas), fill_value=0).reset_index()
    return out


def ring_balance_vs_vnodes(num_replicas: int, vnode_counts: Sequence[int]) -> pd.DataFrame:
    """Exact max/mean share and relative spread (std/mean) of a ketama ring for each V; with 1/√V."""
    rows = []
    for v in vnode_counts:
        shares = np.array(list(ConsistentHashRouter(replica_names(num_replicas), vnodes=v).arc_shares().values()))
        rows.append({"vnodes": v, "max_over_mean": shares.max() / shares.mean(),
                     "relative_spread": shares.std() / shares.mean(), "one_over_sqrt_v": 1 / np.sqrt(v)})
    return pd.DataFrame(rows)


LOOKUP_KEYS = 2000     # keys routed per timed run of one router: a run of ~1-10 ms, well above the clock's resolution


def measure_lookup_us(num_replicas: int, vnodes: int, num_keys: int = LOOKUP_KEYS,
                      repeats: int = MIN_REPEATS) -> tuple[pd.DataFrame, Conditions]:
    """µs per scalar ``route`` call for every router on this CPU (keys random, seeded), timed with
    :func:`lab.timing.measure`: one case per router routing all ``num_keys`` keys, ``repeats`` interleaved
    rounds after a warm-up. Returns a DataFrame (algorithm, us_per_key = median, q1_us, q3_us, min_us,
    max_us; every figure is the run's time ÷ ``num_keys``) and the :class:`~lab.timing.Conditions`.
    Raises ValueError for ``num_keys`` < 1 or ``repeats`` < :data:`lab.timing.MIN_REPEATS`."""
    check_int("num_keys", num_keys)
    keys = random_keys(num_keys, seed=3)
    queries = [RouteQuery(int(k), (int(k) % 997, int(k) % 13)) for k in keys]

    def route_all(router) -> Callable[[], None]:
        def run() -> None:
            for q in queries:
                router.route(q)
        return run

    cases = {name: route_all(make_router(name, replica_names(num_replicas), **options_for(name, {"vnodes": vnodes}))) for name in ROUTERS}
    with one_thread():                    # as every measured run (the stamp reports 1 torch thread)
        timings, cond = measure(cases, repeats=repeats, warmup=1)
    per_key_us = 1e6 / num_keys
    return pd.DataFrame([{"algorithm": t.label, "us_per_key": t.median_s * per_key_us, "q1_us": t.q1_s * per_key_us,
                          "q3_us": t.q3_s * per_key_us, "min_us": t.min_s * per_key_us, "max_us": t.max_s * per_key_us}
                         for t in timings]), cond


def keys_moved_table(num_replicas: int, action: str, num_keys: int, vnodes: int) -> pd.DataFrame:
    """Fraction of keys moved per algorithm for one scale step (``action`` "add" or "remove")."""
    keys = random_keys(num_keys, seed=0)
    n_after = num_replicas + 1 if action == "add" else num_replicas - 1
    rows = scaling_table(num_replicas, n_after, keys, vnodes=vnodes)
    return pd.DataFrame([r._asdict() for r in rows])


def hit_ratio_across_scale_event(trace: Sequence[TraceRequest], algorithms: Sequence[str], num_replicas: int,
                                 k: int, action: str, at_fraction: float, window: int,
                                 capacity_blocks: int | None, vnodes: int, routers: dict | None = None,
                                 event: bool = True,
                                 cache_factory: Callable[[], PolicyReplicaCache] | None = None) -> pd.DataFrame:
    """Windowed token hit ratio over the trace with one scale event at ``at_fraction`` of the requests;
    per-replica block LRU caches of ``capacity_blocks`` (None = unlimited) or, with ``cache_factory``, a fresh
    ``cache_factory()`` per replica (:meth:`serve.fleet.real_replica.RealReplica.cache`; ``capacity_blocks`` unused).
    ``routers``: optional freshly built routers by algorithm name (over ``num_replicas`` replicas), used as
    prototypes (copied through pickle, never mutated) so several traces share one Maglev table build. ``event=False``:
    the same replay without the scale event (the paired baseline).
    Columns: algorithm, request (window start index), hit_ratio, lost_ratio (the window's prompt tokens
    whose KV the replica held but no state let it reuse, as a fraction; 0 with block caches), and the window's
    sums tokens, hit_tokens, lost_tokens (prompt tokens)."""
    if window < 1:
        raise ValueError(f"window must be >= 1 request, got {window}")
    at = int(len(trace) * at_fraction)
    replica = f"replica-{num_replicas}" if action == "add" else f"replica-{num_replicas - 1}"
    frames = []
    for name in algorithms:
        router = pickle.loads(pickle.dumps(routers[name])) if routers and name in routers else \
            make_router(name, replica_names(num_replicas), **options_for(name, {"vnodes": vnodes}))
        replay = replay_routing(trace, router, k, capacity_blocks=capacity_blocks,
                                events=(ScaleEvent(at, action, replica),) if event else (), cache_factory=cache_factory)
        w = pd.DataFrame({"tokens": replay.input_tokens, "hit_tokens": replay.hit_tokens,
                          "lost_tokens": replay.lost_tokens}).groupby(np.arange(len(trace)) // window).sum()
        w = w.assign(algorithm=name, request=w.index * window, hit_ratio=w.hit_tokens / w.tokens.clip(lower=1),
                     lost_ratio=w.lost_tokens / w.tokens.clip(lower=1))
        frames.append(w[["algorithm", "request", "hit_ratio", "lost_ratio", "tokens", "hit_tokens", "lost_tokens"]])
    return pd.concat(frames, ignore_index=True)


def simulate_policies(trace: Sequence[TraceRequest], policies: Sequence[str], base: FleetConfig,
                      class_of: Callable[[int], str] | None = None,
                      progress: Callable[[float], None] | None = None,
                      on_run: Callable[[str, FleetSimResult], None] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run the fleet simulation once per routing policy on ``trace`` (same config otherwise).

    Returns (per-request results with a ``policy`` column, per-policy × class summary with hit ratio,
    TTFT P50/P99, queue wait P99, max/mean requests per replica and throughput). ``on_run(policy, sim)``: called
    after each run with its :class:`FleetSimResult` (its replica caches' counters); keep only what you need: the
    caches hold every cached block, and a run's are freed before the next starts."""
    requests = requests_from_trace(trace)
    if class_of is not None:
        requests = [r._replace(klass=class_of(r.request_id)) for r in requests]
    frames, summary = [], []
    for i, policy in enumerate(policies):
        def sub_progress(f, i=i):
            if progress is not None:
                progress((i + f) / len(policies))

        cfg = FleetConfig(**{**base.__dict__, "router": policy, "router_params": options_for(policy, base.router_params)})
        sim = simulate(requests, cfg, progress=sub_progress)
        if on_run is not None:
            on_run(policy, sim)
        df = results_frame(sim)
        df.insert(0, "policy", policy)
        frames.append(df)
        summary.extend(summarize(sim, policy))
        del sim                    # its caches go (on_run kept what it needs) before the next run fills its own
    return pd.concat(frames, ignore_index=True), pd.DataFrame(summary)


def results_frame(sim: FleetSimResult) -> pd.DataFrame:
    """Per-request results with derived queue_wait_ms, ttft_ms, e2e_ms."""
    df = pd.DataFrame([r._asdict() for r in sim.results])
    df["queue_wait_ms"] = df.start_ms - df.arrival_ms
    df["ttft_ms"] = df.first_token_ms - df.arrival_ms
    df["e2e_ms"] = df.finish_ms - df.arrival_ms
    return df


def summarize(sim: FleetSimResult, label: str) -> list[dict]:
    """One row per class (and "all"): hit ratio, TTFT P50/P99, queue wait P99, balance, throughput."""
    done = [r for r in sim.results if r.status == "completed"]
    counts = np.array(list(Counter(r.replica for r in done).values()) or [0])
    balance = float(counts.max() / counts.mean()) if counts.mean() > 0 else float("nan")
    rows = []
    for klass in [None] + sorted({r.klass for r in sim.results}):
        ttft = sim.column("ttft_ms", klass=klass)
        wait = sim.column("queue_wait_ms", klass=klass)
        hits = sim.column("hit_tokens", klass=klass)
        tokens = sim.column("input_length", klass=klass)
        rows.append({"policy": label, "class": klass or "all", "completed": len(ttft),
                     "hit_ratio": float(hits.sum() / max(1.0, tokens.sum())),
                     "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
                     "queue_wait_p99_ms": percentile(wait, 99), "max_over_mean_requests": balance,
                     "throughput_rps": sim.throughput_rps()})
    return rows


def ideal_ratio(trace: Sequence[TraceRequest]) -> float:
    """Token hit ratio of one infinite shared cache (upper bound for any routing)."""
    return ideal_hit_ratio(trace).token_hit_ratio


def scale_events_for(num_replicas: int, action: str | None, time_ms: float) -> tuple[ScaleAt, ...]:
    """A single add/remove event at ``time_ms`` (None → no event)."""
    if action is None:
        return ()
    name = f"replica-{num_replicas}" if action == "add" else f"replica-{num_replicas - 1}"
    return (ScaleAt(time_ms, action, name),)


def default_service(base: ServiceModel, prefill_x: float, decode_x: float, kv_capacity_tokens: int,
                    max_prefill_tokens_per_step: int | None = None) -> ServiceModel:
    """The calibrated A10G preset sped up by assumed factors (labelled as such on every page)."""
    svc = base.scaled(prefill_x, decode_x, kv_capacity_tokens=kv_capacity_tokens, max_batch_requests=256)
    return svc if max_prefill_tokens_per_step is None else \
        ServiceModel(**{**svc.__dict__, "max_prefill_tokens_per_step": max_prefill_tokens_per_step})


SYNTHETIC_RATE_RPS = 3.4  # page_trace's synthetic arrival rate: the Mooncake conversation trace's
PAGE_TRACE_BLOCKS = 131_072  # blocks of an upload pages 11, 12 and 14 replay (serve/traces/README.md)
PREFIX_SIM_TRACE_BLOCKS = 49_152  # page 09 replays its trace 16 times through serve.prefix.sim


def page_trace(upload: bytes | None, num_requests: int, seed: int = 0, name: str = "uploaded file",
               max_total_blocks: int = PAGE_TRACE_BLOCKS) -> LoadedTrace:
    """The pages' trace: the leading requests of an uploaded Mooncake JSONL file within
    ``num_requests`` requests and ``max_total_blocks`` blocks, or, without one (``upload`` is None),
    ``synthesize(num_requests, ...)`` over num_requests / 3.4 seconds (the conversation trace's
    3.4 req/s). An uploaded file is never silently replaced by the synthetic trace.

    Returns a :class:`LoadedTrace`: ``requests`` and ``note`` (what the budget cut, for ``st.info``).
    Raises TraceFormatError (ValueError) naming the file ``name`` and the line for a malformed, empty
    (0 bytes or no requests), out-of-limit or non-UTF-8 upload."""
    if upload is not None:
        return read_mooncake(named_bytes(upload, name), max_requests=num_requests, max_total_blocks=max_total_blocks)
    return LoadedTrace(synthesize(num_requests=num_requests, duration_s=num_requests / SYNTHETIC_RATE_RPS, seed=seed),
                       "", 0)


def synthetic_trace_description(num_requests: int) -> str:
    """How :func:`page_trace` generates its synthetic trace, in one paragraph (markdown), with
    :func:`serve.traces.mooncake.synthesize`'s own default parameters."""
    d = {k: v.default for k, v in inspect.signature(synthesize).parameters.items()}
    return (f"`serve.traces.mooncake.synthesize` (Mooncake's schema, {d['block_size']}-token blocks): {num_requests:,} Poisson "
            f"arrivals at {SYNTHETIC_RATE_RPS} req/s (the Mooncake conversation trace's rate). Each request opens a new "
            f"session with probability {d['new_session_prob']}, else continues a uniformly chosen earlier one. Every "
            f"prompt starts with {d['system_prompt_blocks']} shared system block(s); a new session's prompt is "
            f"lognormal around {d['median_first_prompt_tokens']:,.0f} tokens; a follow-up turn is the previous prompt + "
            f"the previous output (lognormal around {d['median_output_tokens']:,.0f} tokens) + a new message "
            f"(lognormal around {d['median_turn_tokens']:,.0f} tokens), so it repeats the previous prompt's full "
            "blocks. Upload a Mooncake trace to replay real traffic.")
