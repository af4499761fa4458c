"""Rendezvous / highest-random-weight hashing (Thaler & Ravishankar, 1998): each key goes to the
replica with the highest score ``mix64(key XOR seed(replica))``, seed = ``stable_hash64(name)``.
Adding a replica moves exactly the keys it now wins (1/(n+1) in expectation); removing one moves only
its own keys. Cost: O(n) per lookup.
"""

from __future__ import annotations

import numpy as np

from serve.fleet.routing.hashing import mix64, mix64_np, stable_hash64
from serve.fleet.routing.router import RouteQuery, Router


class RendezvousRouter(Router):
    """Highest random weight; ties (probability ~2^-64) go to the first replica in order."""

    name = "rendezvous"

    def __init__(self, replicas):
        super().__init__(replicas)
        self._rebuild()

    def _rebuild(self) -> None:
        self._seeds = [stable_hash64(f"hrw:{r}") for r in self._replicas]
        self._seeds_np = np.array(self._seeds, dtype=np.uint64)

    def route(self, query: RouteQuery) -> str:
        scores = [mix64(query.key ^ s) for s in self._seeds]
        return self._replicas[scores.index(max(scores))]

    def assign(self, keys: np.ndarray) -> np.ndarray:
        k = np.asarray(keys, dtype=np.uint64)[:, None]  # [N_keys, 1]
        return np.argmax(mix64_np(k ^ self._seeds_np[None, :]), axis=1).astype(np.int64)  # [N_keys]
