"""Page 11: where a trace's requests land under each routing algorithm, load per replica, the token hit ratio
of the replicas' caches (by default Kimi-Linear's prefix-cache policy model at real bytes on 8 x H200, or block
LRU caches) and the ring's balance against virtual nodes (:func:`fleet_hashing`, one call); the lookup cost
measured on this CPU (:func:`lookup_cost`, a separate call so a page can cache and re-measure it on its own)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import pandas as pd

from lab.fleet import (
    ANCHORS,
    REPLICA_CACHES,
    ideal_ratio,
    measure_lookup_us,
    page_trace,
    ring_balance_vs_vnodes,
    routing_load,
)
from lab.timing import Conditions
from serve.errors import check_choice
from serve.fleet.real_replica import RealReplica
from serve.fleet.routing.hashing import routing_key
from serve.fleet.routing.registry import KEY_ROUTERS, ROUTERS, make_router, options_for, replica_names
from serve.fleet.routing.router import RouteQuery
from serve.traces.mooncake import TraceRequest

ALGORITHMS = tuple(ROUTERS)
VNODES = (1, 4, 10, 40, 100, 160, 400, 1000)  # virtual nodes per replica compared in the balance chart


@dataclass(frozen=True)
class FleetHashing:
    """Everything page 11 draws.

    load: requests, prompt tokens, hit tokens and lost tokens per replica (:func:`lab.fleet.routing_load`);
    hit_ratio: token hit ratio of the per-replica caches; ideal_ratio: of one shared infinite block cache (the
    block ideal); lost_ratio: share of prompt tokens whose KV the serving replica held but no KDA state let it
    reuse (0 with block LRU caches); budget_gb: each replica's cache budget (GB; None with block LRU caches,
    which are unlimited here); balance: the ring's
    exact shares per V in :data:`VNODES`; landing: one row per
    (request, key-based algorithm): request index, algorithm, replica, routing key, prefix blocks, requests
    sharing that prefix; num_requests: trace length; note: what the budget cut from an upload; anchors: published figures with their sources."""

    load: pd.DataFrame
    hit_ratio: float
    ideal_ratio: float
    balance: pd.DataFrame
    landing: pd.DataFrame
    num_requests: int
    note: str
    anchors: dict | None = None
    lost_ratio: float = 0.0
    budget_gb: float | None = None


def prefix_landing(trace: Sequence[TraceRequest], num_replicas: int, k: int, vnodes: int) -> pd.DataFrame:
    """For every request: its routing key (blake2b chained over its first ``k`` block ids), the replica each
    key-based algorithm picks, and how many trace requests share those blocks (they land on the same
    replica). Columns request, algorithm, replica, routing_key (16 hex digits), prefix_blocks,
    requests_sharing_prefix; request-major."""
    sharing = Counter(r.hash_ids[:k] for r in trace)
    routers = {name: make_router(name, replica_names(num_replicas), **options_for(name, {"vnodes": vnodes})) for name in KEY_ROUTERS}
    rows = []
    for i, req in enumerate(trace):
        key = routing_key(req.hash_ids, k)
        for name, router in routers.items():
            rows.append({"request": i, "algorithm": name, "replica": router.route(RouteQuery(key, req.hash_ids)),
                         "routing_key": f"{key:016x}", "prefix_blocks": len(req.hash_ids[:k]),
                         "requests_sharing_prefix": sharing[req.hash_ids[:k]]})
    return pd.DataFrame(rows)


def fleet_hashing(algorithm: str, num_replicas: int, k: int, vnodes: int, num_requests: int,
                  upload: bytes | None = None, upload_name: str = "uploaded file", replica_cache: str = "policy",
                  replica: RealReplica = RealReplica()) -> FleetHashing:
    """Route the page trace (``upload`` or the synthetic one, :func:`lab.fleet.page_trace`) with
    ``algorithm`` on its first ``k`` blocks; add the ring's balance for ``num_replicas``. ``replica_cache``
    ("policy" or "block_lru", :data:`lab.fleet.REPLICA_CACHES`): each replica's cache is ``replica``'s
    prefix-cache policy at real bytes (:meth:`serve.fleet.real_replica.RealReplica.cache`), or an unlimited block
    LRU cache.

    Raises: ValueError for an unknown algorithm or replica cache, or bad sizes; TraceFormatError (ValueError) for a bad upload."""
    if algorithm not in ROUTERS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    check_choice("replica_cache", replica_cache, tuple(REPLICA_CACHES.values()))
    factory = replica.cache if replica_cache == "policy" else None
    trace, note, _ = page_trace(upload, num_requests, name=upload_name)
    load = routing_load(trace, algorithm, num_replicas, k, cache_factory=factory, vnodes=vnodes)
    tokens = max(1, int(load.tokens.sum()))
    return FleetHashing(load, float(load.hit_tokens.sum() / tokens), ideal_ratio(trace),
                        ring_balance_vs_vnodes(num_replicas, VNODES),
                        prefix_landing(trace, num_replicas, k, vnodes), len(trace), note, anchors=dict(ANCHORS),
                        lost_ratio=float(load.lost_tokens.sum() / tokens),
                        budget_gb=replica.budget_bytes / 1e9 if factory else None)


class LookupCost(NamedTuple):
    """Page 11's lookup timing: ``table`` one row per algorithm (us_per_key = median µs per ``route`` call,
    q1_us, q3_us, min_us, max_us) and the ``conditions`` it was measured under."""

    table: pd.DataFrame
    conditions: Conditions


def lookup_cost(num_replicas: int, vnodes: int) -> LookupCost:
    """Time one scalar ``route`` call of every algorithm for ``num_replicas`` replicas (``vnodes`` per replica
    on the ring) on this CPU (:func:`lab.fleet.measure_lookup_us`). Raises ValueError for bad sizes."""
    return LookupCost(*measure_lookup_us(num_replicas, vnodes))
