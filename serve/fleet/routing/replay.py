"""Routing-only replay of a trace: route each request in trace order, look up and insert its blocks
in the chosen replica's :class:`BlockLRUCache` (or, with ``cache_factory``, the replica's prefix-cache
policy model at real bytes, :class:`serve.fleet.routing.policy_cache.PolicyReplicaCache`: ``start`` then
``finish``, one request at a time). No timing: a request's blocks are cached as soon as it is routed, and "load" for load-aware routers is the number of requests routed so far (nothing
finishes). This isolates what routing does to hit ratio; ``simulation.py`` adds time and queues.

Scale events (``ScaleEvent``) apply before the request with that index: ``add`` creates a replica
with an empty cache; ``remove`` drops a replica and its cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from serve.fleet.routing.block_cache import BlockLRUCache
from serve.fleet.routing.hashing import routing_key
from serve.fleet.routing.policy_cache import PolicyReplicaCache
from serve.fleet.routing.router import RouteQuery, Router
from serve.traces.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest


class ScaleEvent(NamedTuple):
    """Before request ``at_request`` (index in trace order), ``action`` ("add"/"remove") ``replica``."""

    at_request: int
    action: str
    replica: str


class RoutingReplay(NamedTuple):
    """Per-request arrays (length = requests): ``replica`` names, ``hit_blocks``, ``hit_tokens``,
    ``input_tokens``; totals ``token_hit_ratio`` / ``block_hit_ratio``; ``requests_per_replica``;
    ``lost_tokens``: prompt tokens whose KV the replica held but no state let it reuse (policy caches'
    ``lost_to_missing_state`` per request; all 0 for block LRU caches, where any cached block is usable);
    ``caches``: the replicas' caches at the end (a removed replica's is gone)."""

    replica: list[str]
    hit_blocks: np.ndarray
    hit_tokens: np.ndarray
    input_tokens: np.ndarray
    token_hit_ratio: float
    block_hit_ratio: float
    requests_per_replica: dict[str, int]
    lost_tokens: np.ndarray | None = None
    caches: dict | None = None


def replay_routing(
    trace: Sequence[TraceRequest], router: Router, k: int, capacity_blocks: int | None = None,
    block_size: int = MOONCAKE_BLOCK_TOKENS, events: Sequence[ScaleEvent] = (),
    cache_factory: Callable[[], PolicyReplicaCache] | None = None,
) -> RoutingReplay:
    """Route ``trace`` with ``router`` (routing key = first ``k`` blocks), per-replica LRU caches of
    ``capacity_blocks`` (None = unlimited), or with ``cache_factory`` a fresh ``cache_factory()`` per
    replica (``capacity_blocks`` unused; a request's ``hit_blocks`` is then its hit tokens // ``block_size``).
    Hit tokens are capped at ``input_length``. Raises ValueError for an unknown event action."""

    def new_cache():
        return cache_factory() if cache_factory is not None else BlockLRUCache(capacity_blocks)

    caches = {r: new_cache() for r in router.replicas}
    pending = sorted(events, key=lambda e: e.at_request)
    n = len(trace)
    replicas: list[str] = []
    hit_blocks = np.zeros(n, dtype=np.int64)
    hit_tokens = np.zeros(n, dtype=np.int64)
    input_tokens = np.zeros(n, dtype=np.int64)
    lost_tokens = np.zeros(n, dtype=np.int64)
    total_blocks = 0
    ev = 0
    for i, req in enumerate(trace):
        while ev < len(pending) and pending[ev].at_request <= i:
            e = pending[ev]
            if e.action == "add":
                router.add_replica(e.replica)
                caches[e.replica] = new_cache()
            elif e.action == "remove":
                router.remove_replica(e.replica)
                caches.pop(e.replica)
            else:
                raise ValueError(f"ScaleEvent.action must be 'add' or 'remove', got '{e.action}'")
            ev += 1
        replica = router.route(RouteQuery(routing_key(req.hash_ids, k), req.hash_ids))
        router.on_start(replica)
        cache = caches[replica]
        if cache_factory is not None:
            lost = cache.lost_to_missing_state
            hit = cache.start(req)
            cache.finish(req, hit)
            lost_tokens[i] = cache.lost_to_missing_state - lost
            run = hit // block_size
        else:
            run = cache.lookup(req.hash_ids)
            cache.insert(req.hash_ids)  # refreshes every block, the hit run included (a touch first changes nothing)
            hit = run * block_size
        replicas.append(replica)
        hit_blocks[i] = run
        hit_tokens[i] = min(hit, req.input_length)
        input_tokens[i] = req.input_length
        total_blocks += len(req.hash_ids)
    return RoutingReplay(
        replicas, hit_blocks, hit_tokens, input_tokens,
        float(hit_tokens.sum() / max(1, input_tokens.sum())),
        float(hit_blocks.sum() / max(1, total_blocks)), dict(Counter(replicas)), lost_tokens, caches,
    )

