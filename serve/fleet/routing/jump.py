"""Jump consistent hash (Lamping & Veach, 2014, arXiv:1406.2294): bucket in [0, n) from a 64-bit key
with no state; going from n to n+1 buckets moves exactly the keys that land in the new bucket (1/(n+1)
in expectation).

Buckets are indices, so only the *last* replica can leave without extra movement. Removing replica i
≠ last moves the last replica's name into slot i: the removed replica's keys are then served by the
renamed bucket and the last bucket's keys spread over the rest — about 2/n of keys move (documented
limitation of jump hash for arbitrary removals).
"""

from __future__ import annotations

import numpy as np

from serve.errors import check_int
from serve.fleet.routing.hashing import MASK64
from serve.fleet.routing.router import RouteQuery, Router

_LCG = 2862933555777941757  # multiplier from the paper's reference code


def jump_bucket(key: int, num_buckets: int) -> int:
    """Reference (scalar) jump hash of a 64-bit ``key`` into ``num_buckets`` buckets."""
    check_int("num_buckets", num_buckets)
    b, j = -1, 0
    key &= MASK64
    while j < num_buckets:
        b = j
        key = (key * _LCG + 1) & MASK64
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


def jump_bucket_np(keys: np.ndarray, num_buckets: int) -> np.ndarray:
    """Vectorised :func:`jump_bucket` (same float64 arithmetic, so bit-identical buckets)."""
    key = np.asarray(keys, dtype=np.uint64).copy()
    b = np.full(key.shape, -1, dtype=np.int64)
    j = np.zeros(key.shape, dtype=np.int64)
    active = j < num_buckets
    while active.any():
        b[active] = j[active]
        with np.errstate(over="ignore"):
            key[active] = key[active] * np.uint64(_LCG) + np.uint64(1)
        ratio = float(1 << 31) / ((key[active] >> np.uint64(33)).astype(np.float64) + 1.0)
        j[active] = ((b[active] + 1).astype(np.float64) * ratio).astype(np.int64)
        active = j < num_buckets
    return b


class JumpHashRouter(Router):
    """Jump consistent hash over the replica list (bucket i = ``replicas[i]``)."""

    name = "jump"

    def route(self, query: RouteQuery) -> str:
        return self._replicas[jump_bucket(query.key, len(self._replicas))]

    def assign(self, keys: np.ndarray) -> np.ndarray:
        return jump_bucket_np(keys, len(self._replicas))

    def _take_out(self, replica: str) -> None:
        i = self._replicas.index(replica)
        last = self._replicas.pop()
        if last != replica:
            self._replicas[i] = last
