"""Fleet layer: routing requests to replicas, scaling, budgets, and a discrete-event simulation.

Concept → file → main type:
- stable hashes, routing key ............ hashing.py ....... ``routing_key``, ``stable_hash64``
- router interface, round-robin, least-loaded, mod-N ... router.py ... ``Router``, ``RouteQuery``
- ketama ring (V vnodes) ................ ring.py .......... ``ConsistentHashRouter``
- bounded loads (factor c) .............. bounded_load.py .. ``BoundedLoadRouter``
- jump hash ............................. jump.py .......... ``JumpHashRouter``
- rendezvous (HRW) ...................... rendezvous.py .... ``RendezvousRouter``
- Maglev ................................ maglev.py ........ ``MaglevRouter``
- cache-aware (SGLang-router-like) ...... cache_aware.py ... ``CacheAwareRouter``
- precise prefix routers (KV / KDA state) prefix_score.py .. ``PrefixScoreRouter`` (``precise_kv``, ``precise_state``)
- per-replica prefix cache (blocks, LRU)  block_cache.py ... ``BlockLRUCache``
- per-replica policy cache (real bytes) . policy_cache.py .. ``PolicyReplicaCache`` (over serve.scale.policies)
- routing-only trace replay ............. replay.py ........ ``replay_routing``
- keys moved / scale events ............. scaling.py ....... ``keys_moved``
- token buckets, classes ................ budgets.py ....... ``TokenBucket``, ``PriorityClass``
- FCFS / VTC schedulers ................. scheduler.py ..... ``FCFSScheduler``, ``VTCScheduler``
- service-time model, calibration ....... service_model.py . ``ServiceModel``
- service times from the roofline ....... roofline_service.py ``RooflineService``
- simulation inputs / outputs ........... sim_types.py ..... ``FleetConfig``, ``FleetRequest``, ``FleetSimResult``,
  ``FleetRequestResult``, ``fresh_block_requests`` (the one bounded builder of unshared block ids)
- one replica (simpy process) ........... replica.py ....... ``Replica``
- simpy fleet simulation ................ simulation.py .... ``simulate``
- step-by-step reference simulation ..... sim_reference.py . ``reference_simulate``
- VTC artifact replay ................... vtc.py ........... ``replay_vtc_suite``, ``replay_on_off_less``

The pages' experiments on this layer (budget scenario, routing load, policy runs) live in ``lab/budgets.py`` and
``lab/fleet.py``. Tests: ``tests/serve/fleet/test_fleet_routers.py``, ``test_fleet_simulation.py``,
``test_fleet_policy_cache.py``, ``test_replay_policy_cache.py``, ``test_replay_refresh.py``; lab:
``tests/lab/test_fleet.py``, ``test_budgets.py``; traces: ``tests/serve/traces/test_traces.py``, upload limits:
``tests/serve/traces/test_traces_limits.py``, ``tests/serve/traces/test_traces_fuzz.py``; bench: ``python -m bench.fleet``.
"""

from __future__ import annotations

from collections.abc import Sequence

from serve.fleet.bounded_load import BoundedLoadRouter
from serve.fleet.cache_aware import CacheAwareRouter
from serve.fleet.jump import JumpHashRouter
from serve.fleet.maglev import MaglevRouter
from serve.fleet.rendezvous import RendezvousRouter
from serve.fleet.ring import ConsistentHashRouter
from serve.fleet.router import LeastLoadedRouter, ModNRouter, RoundRobinRouter, RouteQuery, Router

ROUTERS: dict[str, type[Router]] = {
    "round_robin": RoundRobinRouter,
    "least_loaded": LeastLoadedRouter,
    "mod_n": ModNRouter,
    "ring": ConsistentHashRouter,
    "jump": JumpHashRouter,
    "rendezvous": RendezvousRouter,
    "maglev": MaglevRouter,
    "bounded_load": BoundedLoadRouter,
    "cache_aware": CacheAwareRouter,
}
KEY_ROUTERS = ("mod_n", "ring", "jump", "rendezvous", "maglev")  # static: a key always maps the same way

_PARAMS = {
    "ring": ("vnodes",),
    "bounded_load": ("vnodes", "c"),
    "maglev": ("table_size",),
    "cache_aware": ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold", "tree_capacity_blocks"),
}


def replica_names(n: int) -> list[str]:
    """Default replica names ``replica-0 .. replica-{n-1}``."""
    if n < 1:
        raise ValueError(f"number of replicas must be >= 1, got {n}")
    return [f"replica-{i}" for i in range(n)]


def make_router(name: str, replicas: Sequence[str], **params) -> Router:
    """Build router ``name`` (a key of ``ROUTERS``) over ``replicas``; parameters a router does not
    take are ignored (so one parameter dict can configure every policy). Raises ValueError for an
    unknown name."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router '{name}', expected one of {sorted(ROUTERS)}")
    accepted = {k: v for k, v in params.items() if k in _PARAMS.get(name, ())}
    return ROUTERS[name](list(replicas), **accepted)


__all__ = ["ROUTERS", "KEY_ROUTERS", "Router", "RouteQuery", "make_router", "replica_names"]
