"""Router interface and the load-only routers (round-robin, least-loaded, mod-N).

Every router answers ``route(query) -> replica name`` for a :class:`RouteQuery` (the request's 64-bit
routing key and its chained block ids). Replicas are named strings; the router keeps their order.
In-flight load (requests routed and not yet finished) is tracked through ``on_start`` / ``on_finish``,
which the simulator calls; load-aware routers read it. ``route`` itself never changes load.

Key-based (static) routers also offer ``assign(keys) -> indices`` over a ``uint64`` array, vectorised
with numpy and checked against the scalar ``route`` in the tests (scalar = reference).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class RouteQuery(NamedTuple):
    """What a router sees of a request: ``key`` (64-bit routing key, see ``hashing.routing_key``)
    and ``block_ids`` (the prompt's chained block ids, used by the cache-aware router); ``request``: the
    request (``serve.fleet.routing.prefix_score`` asks each replica what it would serve of it)."""

    key: int
    block_ids: tuple[int, ...] = ()
    request: object = None          # the request itself (a FleetRequest), for routers that ask the replicas


class Router(ABC):
    """Base router: replica list, in-flight load per replica, add/remove.

    Mutates: ``add_replica`` / ``remove_replica`` change the replica set; ``on_start`` / ``on_finish``
    change loads. Raises ValueError for duplicate or unknown replica names, an empty replica set, or
    a finish without a matching start.
    """

    name = "router"

    def __init__(self, replicas: Sequence[str]):
        if len(replicas) == 0:
            raise ValueError("replicas must name at least one replica")
        if len(set(replicas)) != len(replicas):
            raise ValueError(f"replica names must be unique, got {list(replicas)}")
        self._replicas: list[str] = [str(r) for r in replicas]
        self._load: dict[str, int] = {r: 0 for r in self._replicas}

    @property
    def replicas(self) -> list[str]:
        """Current replica names, in router order (a copy)."""
        return list(self._replicas)

    def load(self, replica: str) -> int:
        """In-flight requests on ``replica`` (0 for a replica that left with nothing in flight)."""
        return self._load.get(replica, 0)

    @abstractmethod
    def route(self, query: RouteQuery) -> str:
        """Replica that should serve ``query`` (does not change loads)."""

    def on_start(self, replica: str) -> None:
        """A request routed to ``replica`` is now in flight."""
        self._load[replica] = self._load.get(replica, 0) + 1

    def on_finish(self, replica: str) -> None:
        """A request on ``replica`` finished (completed or aborted)."""
        if self._load.get(replica, 0) <= 0:
            raise ValueError(f"on_finish('{replica}') without a request in flight there")
        self._load[replica] -= 1
        if replica not in self._replicas and self._load[replica] == 0:
            del self._load[replica]

    def add_replica(self, replica: str) -> None:
        """Add a replica at the end of the router order."""
        if replica in self._replicas:
            raise ValueError(f"replica '{replica}' already present")
        self._replicas.append(replica)
        self._load.setdefault(replica, 0)
        self._rebuild()

    def remove_replica(self, replica: str) -> None:
        """Remove a replica; requests in flight there keep their load entry until they finish."""
        if replica not in self._replicas:
            raise ValueError(f"replica '{replica}' not present (have {self._replicas})")
        if len(self._replicas) == 1:
            raise ValueError("cannot remove the last replica")
        self._take_out(replica)
        if self._load.get(replica, 0) == 0:
            self._load.pop(replica, None)
        self._rebuild()

    def _take_out(self, replica: str) -> None:
        """Drop ``replica`` from the router order (jump hash moves the last one into its slot instead)."""
        self._replicas.remove(replica)

    def _rebuild(self) -> None:  # noqa: B027 -- a hook, empty for the routers that keep no derived structure
        """Recompute derived structures after a membership change (hash routers override this)."""

    def assign(self, keys: np.ndarray) -> np.ndarray:
        """Replica index (into ``replicas``) for each ``uint64`` key; default loops over ``route``."""
        index = {r: i for i, r in enumerate(self._replicas)}
        return np.array([index[self.route(RouteQuery(int(k)))] for k in keys], dtype=np.int64)

    def check_integrity(self) -> None:
        """Replica names unique and non-empty; loads non-negative; every current replica has a load entry."""
        assert self._replicas and len(set(self._replicas)) == len(self._replicas)
        assert all(v >= 0 for v in self._load.values())
        assert all(r in self._load for r in self._replicas)


class RoundRobinRouter(Router):
    """Cycle through the replicas in order, ignoring the key."""

    name = "round_robin"

    def __init__(self, replicas: Sequence[str]):
        super().__init__(replicas)
        self._next = 0

    def route(self, query: RouteQuery) -> str:
        replica = self._replicas[self._next % len(self._replicas)]
        self._next += 1
        return replica


class LeastLoadedRouter(Router):
    """Replica with the fewest requests in flight (ties: first in router order), ignoring the key."""

    name = "least_loaded"

    def route(self, query: RouteQuery) -> str:
        return min(self._replicas, key=lambda r: self._load.get(r, 0))


class ModNRouter(Router):
    """``replicas[key mod n]`` — the naive hash that moves ~n/(n+1) of keys when one replica is added."""

    name = "mod_n"

    def route(self, query: RouteQuery) -> str:
        return self._replicas[query.key % len(self._replicas)]

    def assign(self, keys: np.ndarray) -> np.ndarray:
        return (np.asarray(keys, dtype=np.uint64) % np.uint64(len(self._replicas))).astype(np.int64)
