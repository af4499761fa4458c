"""Per-replica prefix cache at block granularity, LRU, for the fleet simulation.

Model (the engine's prefix-cache rules, ``serve/prefix/cache.py``, reduced to one block = one unit):
- Entries are chained block ids (one per ``block_size`` tokens; a Mooncake ``hash_id``). Because ids
  are chained, a request's hit is the *leading run* of its ids present in the cache.
- ``lookup`` returns that run; only a ``touch`` refreshes recency, and only for the consumed run
  (the hit path), never for blocks past it.
- ``insert`` adds every block of a prompt (after its prefill), refreshing existing ones.
- Recency is refreshed deepest-first, so within one path the root is the most recent: LRU evicts
  leaves before their ancestors and never leaves an unreachable suffix behind an evicted parent
  of the same path.
- ``capacity_blocks=None`` means unlimited.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from serve.traces.mooncake import leading_run


class BlockLRUCache:
    """LRU set of block ids with capacity in blocks.

    Raises ValueError for a capacity < 1. ``evictions`` counts blocks evicted so far.
    """

    def __init__(self, capacity_blocks: int | None = None):
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1 or None (unlimited), got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # least recent first
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._lru

    def lookup(self, block_ids: Sequence[int]) -> int:
        """Number of leading ``block_ids`` cached (no recency change)."""
        return leading_run(block_ids, self._lru)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Refresh recency of the given (cached) blocks, deepest first."""
        for b in reversed(block_ids):
            if b in self._lru:
                self._lru.move_to_end(b)

    def insert(self, block_ids: Sequence[int]) -> int:
        """Insert/refresh all ``block_ids`` (deepest first), evicting LRU blocks over capacity.

        Returns the number of blocks evicted by this call. A prompt longer than the capacity keeps
        only its leading ``capacity_blocks`` blocks (the deeper ones are evicted first).
        """
        lru = self._lru
        for b in reversed(block_ids):
            if b in lru:
                lru.move_to_end(b)
            else:
                lru[b] = None                # a new key goes last: the most recent
        return self._evict()

    def _evict(self) -> int:
        evicted = 0
        if self.capacity_blocks is not None:
            while len(self._lru) > self.capacity_blocks:
                self._lru.popitem(last=False)
                evicted += 1
        self.evictions += evicted
        return evicted

    def blocks(self) -> Iterable[int]:
        """Cached block ids, least recent first."""
        return iter(self._lru)

    def check_integrity(self) -> None:
        """Size within capacity; eviction count non-negative."""
        assert self.capacity_blocks is None or len(self._lru) <= self.capacity_blocks
        assert self.evictions >= 0


class ReferenceBlockCache:
    """Obviously-correct oracle: a list of ids, most recent last, same refresh and eviction rules."""

    def __init__(self, capacity_blocks: int | None = None):
        self.capacity_blocks = capacity_blocks
        self.order: list[int] = []

    def lookup(self, block_ids: Sequence[int]) -> int:
        run = 0
        while run < len(block_ids) and block_ids[run] in self.order:
            run += 1
        return run

    def touch(self, block_ids: Sequence[int]) -> None:
        for b in reversed(block_ids):
            if b in self.order:
                self.order.remove(b)
                self.order.append(b)

    def insert(self, block_ids: Sequence[int]) -> int:
        for b in reversed(block_ids):
            if b in self.order:
                self.order.remove(b)
            self.order.append(b)
        evicted = 0
        while self.capacity_blocks is not None and len(self.order) > self.capacity_blocks:
            self.order.pop(0)
            evicted += 1
        return evicted
