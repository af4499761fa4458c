"""Routing: which replica serves a request, and what each replica's prefix cache holds when routing alone is replayed.

Concept → file → main type → test (``tests/serve/fleet/``):
- stable hashes, routing key ............ hashing.py ....... ``routing_key``, ``stable_hash64`` → ``test_fleet_routers.py``
- router interface, round-robin, least-loaded, mod-N ... router.py ... ``Router``, ``RouteQuery``
- the routers by name, building one ..... registry.py ...... ``ROUTERS``, ``KEY_ROUTERS``, ``make_router``, ``options_for``
- ketama ring (V vnodes) ................ ring.py .......... ``ConsistentHashRouter``
- bounded loads (factor c) .............. bounded_load.py .. ``BoundedLoadRouter``
- jump hash ............................. jump.py .......... ``JumpHashRouter``
- rendezvous (HRW) ...................... rendezvous.py .... ``RendezvousRouter``
- Maglev ................................ maglev.py ........ ``MaglevRouter``
- cache-aware (SGLang-router-like) ...... cache_aware.py ... ``CacheAwareRouter``
- precise prefix routers (KV / KDA state) prefix_score.py .. ``PrefixScoreRouter`` (``precise_kv``, ``precise_state``)
  → ``test_fleet_policy_cache.py``
- per-replica prefix cache (blocks, LRU)  block_cache.py ... ``BlockLRUCache``
- per-replica policy cache (real bytes) . policy_cache.py .. ``PolicyReplicaCache`` (over serve.scale.policies)
  → ``test_fleet_policy_cache.py``
- routing-only trace replay ............. replay.py ........ ``replay_routing`` → ``test_replay_policy_cache.py``,
  ``test_replay_refresh.py``
"""
