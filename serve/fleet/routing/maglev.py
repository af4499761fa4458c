"""Maglev hashing (Eisenbud et al., NSDI'16, §3.4): a lookup table of prime size M filled round-robin
from each replica's permutation ``(offset + j · skip) mod M``; a key goes to ``table[key mod M]``.

offset = h1(name) mod M, skip = h2(name) mod (M − 1) + 1 (h1, h2 = blake2b with distinct prefixes).
Balance: every replica owns ⌊M/n⌋ or ⌈M/n⌉ entries — the paper picks M > 100 · n so the hash-space
difference between replicas stays under 1 %. Disruption on a membership change is a little above the
minimal 1/(n+1) because the table is refilled.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from serve.fleet.routing.hashing import stable_hash64
from serve.fleet.routing.router import RouteQuery, Router


def is_prime(m: int) -> bool:
    """Deterministic trial division (M is at most a few million here)."""
    if m < 2:
        return False
    if m % 2 == 0:
        return m == 2
    f = 3
    while f * f <= m:
        if m % f == 0:
            return False
        f += 2
    return True


def next_prime(m: int) -> int:
    """Smallest prime >= m."""
    while not is_prime(m):
        m += 1
    return m


def maglev_table(replicas: Sequence[str], table_size: int) -> list[int]:
    """Maglev population (the paper's Pseudocode 1): entry → replica index (a new list per call)."""
    return list(_population(tuple(replicas), table_size))


@functools.lru_cache(maxsize=4)   # a scale event rebuilds the tables of the same few replica sets again and again
def _population(replicas: tuple, table_size: int) -> tuple:
    m = table_size
    offsets = [stable_hash64(f"maglev-offset:{r}") % m for r in replicas]
    skips = [stable_hash64(f"maglev-skip:{r}") % (m - 1) + 1 for r in replicas]
    nexts = [0] * len(replicas)
    table = [-1] * m
    filled = 0
    while True:
        for i in range(len(replicas)):
            off, skip, j = offsets[i], skips[i], nexts[i]
            c = (off + j * skip) % m
            while table[c] >= 0:
                j += 1
                c = (off + j * skip) % m
            table[c] = i
            nexts[i] = j + 1
            filled += 1
            if filled == m:
                return tuple(table)


class MaglevRouter(Router):
    """Maglev lookup table; ``table_size`` must be prime and ≥ 100 × replicas (ValueError otherwise;
    the default picks the smallest prime ≥ max(65,537, 100 × replicas))."""

    name = "maglev"

    def __init__(self, replicas: Sequence[str], table_size: int | None = None):
        self._fixed_size = table_size
        super().__init__(replicas)
        self._rebuild()

    def _rebuild(self) -> None:
        n = len(self._replicas)
        m = self._fixed_size if self._fixed_size is not None else next_prime(max(65537, 100 * n))
        if not is_prime(m):
            raise ValueError(f"table_size must be prime, got {m}")
        if m < 100 * n:
            raise ValueError(f"table_size must be >= 100 x replicas = {100 * n}, got {m}")
        self.table_size = m
        self._table_np = np.array(maglev_table(self._replicas, m), dtype=np.int64)
        self._table = self._table_np.tolist()

    def route(self, query: RouteQuery) -> str:
        return self._replicas[self._table[query.key % self.table_size]]

    def assign(self, keys: np.ndarray) -> np.ndarray:
        return self._table_np[(np.asarray(keys, dtype=np.uint64) % np.uint64(self.table_size)).astype(np.int64)]

    def entry_shares(self) -> dict[str, float]:
        """Fraction of table entries per replica (the load for uniformly random keys)."""
        counts = np.bincount(self._table_np, minlength=len(self._replicas))
        return {r: counts[i] / self.table_size for i, r in enumerate(self._replicas)}

    def check_integrity(self) -> None:
        super().check_integrity()
        counts = np.bincount(self._table_np, minlength=len(self._replicas))
        assert counts.sum() == self.table_size and counts.max() - counts.min() <= 1, "Maglev table unbalanced"
