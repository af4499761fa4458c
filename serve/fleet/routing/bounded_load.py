"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA'18; the scheme used
by Google Cloud Pub/Sub and HAProxy's ``hash-balance-factor``).

Each replica may hold at most ``capacity = ceil(c · (m + 1) / n)`` in-flight requests, where m is the
number in flight before this one and n the replica count. A key walks the ring clockwise from its
position and takes the first replica below capacity. Guarantee (the paper's): no replica ever holds
more than ``ceil(c · m / n)``; keys move little when loads change. ``c`` must be > 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from serve.fleet.routing.ring import ConsistentHashRouter
from serve.fleet.routing.router import RouteQuery


class BoundedLoadRouter(ConsistentHashRouter):
    """Ring (ketama points, ``vnodes`` per replica) with the load bound ``c``."""

    name = "bounded_load"

    def __init__(self, replicas: Sequence[str], vnodes: int = 160, c: float = 1.25):
        if not c > 1.0:
            raise ValueError(f"c (load bound factor) must be > 1, got {c}")
        self.c = c
        super().__init__(replicas, vnodes=vnodes)

    def capacity(self) -> int:
        """Max in-flight requests a replica may hold after admitting one more request."""
        in_flight = sum(self._load.get(r, 0) for r in self._replicas)
        return math.ceil(self.c * (in_flight + 1) / len(self._replicas))

    def route(self, query: RouteQuery) -> str:
        cap = self.capacity()
        start = self.ring_index(query.key)
        n = len(self._points)
        for step in range(n):
            replica = self._owners[(start + step) % n]
            if self._load.get(replica, 0) < cap:
                return replica
        raise RuntimeError("bounded-load ring found no replica below capacity (cannot happen for c > 1)")

    def assign(self, keys):
        raise TypeError("bounded-load routing depends on loads; route keys one by one with on_start")
