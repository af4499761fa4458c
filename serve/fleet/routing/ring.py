"""Consistent-hash ring with V virtual nodes per replica, ketama-compatible (Karger et al., STOC'97;
libketama / ``uhashring``).

Points: for replica ``name`` and ``w = 0 .. ceil(V/4)-1``, md5(f"{name}-{w}") gives 4 points (bytes
4i..4i+3, little-endian), the first V of them are kept (V = 160 → 40 digests, ketama's default).
A key's position is its top 32 bits (``key >> 32``); it goes to the first point strictly above it,
wrapping to the first point (``bisect_right``, as ``uhashring``). On a point collision the replica
inserted later owns it (as ``uhashring``'s dict does).
Load balance: each replica owns the sum of V random arcs, relative spread ≈ 1/√V.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from serve.errors import check_int
from serve.fleet.routing.hashing import ketama_hash
from serve.fleet.routing.router import RouteQuery, Router


def ketama_points(replica: str, vnodes: int) -> list[int]:
    """The ``vnodes`` 32-bit ring points of ``replica`` (ketama order)."""
    points: list[int] = []
    for w in range((vnodes + 3) // 4):
        for i in range(4):
            points.append(ketama_hash(f"{replica}-{w}", i))
    return points[:vnodes]


class ConsistentHashRouter(Router):
    """Ketama-style ring; ``vnodes`` points per replica. Raises ValueError if ``vnodes < 1``."""

    name = "ring"

    def __init__(self, replicas: Sequence[str], vnodes: int = 160):
        check_int("vnodes", vnodes)
        self.vnodes = vnodes
        super().__init__(replicas)
        self._rebuild()

    def _rebuild(self) -> None:
        owner: dict[int, str] = {}
        for replica in self._replicas:
            for p in ketama_points(replica, self.vnodes):
                owner[p] = replica
        self._points = sorted(owner)
        self._owners = [owner[p] for p in self._points]
        index = {r: i for i, r in enumerate(self._replicas)}
        self._points_np = np.array(self._points, dtype=np.uint64)
        self._owner_idx_np = np.array([index[o] for o in self._owners], dtype=np.int64)

    def ring_index(self, key: int) -> int:
        """Index into the sorted points of the first point serving ``key``."""
        i = bisect_right(self._points, key >> 32)
        return i if i < len(self._points) else 0

    def route(self, query: RouteQuery) -> str:
        return self._owners[self.ring_index(query.key)]

    def assign(self, keys: np.ndarray) -> np.ndarray:
        pos = np.asarray(keys, dtype=np.uint64) >> np.uint64(32)
        i = np.searchsorted(self._points_np, pos, side="right") % len(self._points)
        return self._owner_idx_np[i]

    def arc_shares(self) -> dict[str, float]:
        """Exact fraction of the 2^32 ring each replica owns (the load for uniformly random keys)."""
        shares = {r: 0 for r in self._replicas}
        prev = self._points[-1] - (1 << 32)
        for p, o in zip(self._points, self._owners):
            shares[o] += p - prev  # the arc (prev, p] goes to the owner of p
            prev = p
        return {r: s / float(1 << 32) for r, s in shares.items()}

    def check_integrity(self) -> None:
        super().check_integrity()
        assert all(a < b for a, b in zip(self._points, self._points[1:])), "ring points not strictly sorted"
        assert set(self._owners) <= set(self._replicas)
