"""The routing-only replay on policy caches at real bytes (pages 11 and 12): the same routing as with block
caches, and per replica exactly what driving its own PolicyReplicaCache by hand gives, across a scale event."""
from __future__ import annotations

import numpy as np

from serve.fleet.routing.hashing import routing_key
from serve.fleet.routing.policy_cache import PolicyReplicaCache
from serve.fleet.routing.registry import make_router, replica_names
from serve.fleet.routing.replay import ScaleEvent, replay_routing
from serve.fleet.routing.router import RouteQuery
from serve.scale.policies import OursPolicy, ReplicaBytes, SGLangNoBuffer
from serve.traces.mooncake import synthesize

KIMI = "kimi-linear-48b-a3b"
BUDGET = 4e9   # bytes per replica: small enough that the replicas evict within the trace


def _policies():
    return {"ours": lambda: OursPolicy(KIMI, 2048, tp_size=8),
            "sglang no_buffer": lambda: SGLangNoBuffer(ReplicaBytes.for_preset(KIMI, 8))}


def test_policy_replay_matches_hand_driven_caches():
    trace = synthesize(num_requests=300, duration_s=90, seed=4)
    event = ScaleEvent(150, "add", "replica-4")
    for name, make in _policies().items():
        replay = replay_routing(trace, make_router("ring", replica_names(4), vnodes=40), 2, events=(event,),
                                cache_factory=lambda make=make: PolicyReplicaCache(make(), BUDGET))
        lru = replay_routing(trace, make_router("ring", replica_names(4), vnodes=40), 2, events=(event,))
        assert replay.replica == lru.replica, name                   # the cache does not change the routing
        router, caches = make_router("ring", replica_names(4), vnodes=40), {}
        hits, lost = [], []
        for i, req in enumerate(trace):
            if i == event.at_request:
                router.add_replica(event.replica)
            replica = router.route(RouteQuery(routing_key(req.hash_ids, 2), req.hash_ids))
            cache = caches.setdefault(replica, PolicyReplicaCache(make(), BUDGET))
            before = cache.lost_to_missing_state
            hit = cache.start(req)
            cache.finish(req, hit)
            hits.append(hit)
            lost.append(cache.lost_to_missing_state - before)
        assert replay.hit_tokens.tolist() == hits and replay.lost_tokens.tolist() == lost, name
        assert np.array_equal(replay.hit_blocks, replay.hit_tokens // 512)
        assert replay.lost_tokens.sum() == sum(c.lost_to_missing_state for c in replay.caches.values())
        assert (replay.hit_tokens + replay.lost_tokens <= lru.hit_tokens).all(), name   # within the block LRU's
        assert any(c.policy.bytes_by_kind()["kv"] > 0 for c in replay.caches.values())
        for c in replay.caches.values():
            c.check_integrity()
    assert replay_routing(trace, make_router("ring", replica_names(4)), 2).lost_tokens.sum() == 0
