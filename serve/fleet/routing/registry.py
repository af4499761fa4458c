"""The routers by name, and the one way to build one: :func:`make_router` (options checked against the router's
constructor, so a misspelt option is an error rather than ignored)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence

from serve.fleet.routing.bounded_load import BoundedLoadRouter
from serve.fleet.routing.cache_aware import CacheAwareRouter
from serve.fleet.routing.jump import JumpHashRouter
from serve.fleet.routing.maglev import MaglevRouter
from serve.fleet.routing.prefix_score import PREFIX_SCORE_ROUTERS
from serve.fleet.routing.rendezvous import RendezvousRouter
from serve.fleet.routing.ring import ConsistentHashRouter
from serve.fleet.routing.router import LeastLoadedRouter, ModNRouter, RoundRobinRouter, Router

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
# each router's options: its constructor's parameters after the replica list (the precise prefix routers: none,
# the simulation builds them with their scorer)
ROUTER_OPTIONS: dict[str, tuple[str, ...]] = {name: tuple(inspect.signature(cls.__init__).parameters)[2:]
                                              for name, cls in ROUTERS.items()} | dict.fromkeys(PREFIX_SCORE_ROUTERS, ())


def check_options(name: str, options: Mapping[str, object], what: str = "options") -> None:
    """ValueError for an unknown router ``name`` (:data:`ROUTER_OPTIONS`) or an option it does not take, naming
    ``what`` (the caller's argument)."""
    if name not in ROUTER_OPTIONS:
        raise ValueError(f"unknown router '{name}', expected one of {sorted(ROUTER_OPTIONS)}")
    unknown = sorted(set(options) - set(ROUTER_OPTIONS[name]))
    if unknown:
        raise ValueError(f"{what}: router '{name}' takes {list(ROUTER_OPTIONS[name])}, got {unknown}")


def replica_names(n: int) -> list[str]:
    """Default replica names ``replica-0 .. replica-{n-1}``."""
    if n < 1:
        raise ValueError(f"number of replicas must be >= 1, got {n}")
    return [f"replica-{i}" for i in range(n)]


def make_router(name: str, replicas: Sequence[str], **options) -> Router:
    """Build router ``name`` (a key of ``ROUTERS``) over ``replicas`` with ``options`` (its
    :data:`ROUTER_OPTIONS`). Raises ValueError for an unknown name or an option the router does not take."""
    if name not in ROUTERS:   # the precise prefix routers are built with their scorer (PrefixScoreRouter)
        raise ValueError(f"unknown router '{name}', expected one of {sorted(ROUTERS)}")
    check_options(name, options)
    return ROUTERS[name](list(replicas), **options)


def options_for(name: str, shared: Mapping[str, object]) -> dict[str, object]:
    """The options of ``shared`` that router ``name`` takes, for one option set configuring several routers
    (e.g. ``vnodes`` for the ring and bounded loads; none for the precise prefix routers, which the simulation
    builds with their scorer). Raises ValueError for an unknown router or an option no router takes."""
    check_options(name, {})
    known = {o for opts in ROUTER_OPTIONS.values() for o in opts}
    if set(shared) - known:
        raise ValueError(f"no router takes the options {sorted(set(shared) - known)}; options: {sorted(known)}")
    return {k: v for k, v in shared.items() if k in ROUTER_OPTIONS[name]}
