"""Cache-aware router, after SGLang's router ``cache_aware`` policy (sgl-router; the same algorithm
and defaults in vllm-router): the router keeps an approximate per-replica prefix tree of what it sent
where, and

1. if the load is imbalanced — ``max_load − min_load > balance_abs_threshold`` **and**
   ``max_load > balance_rel_threshold × min_load`` — it sends the request to the least-loaded replica;
2. otherwise it sends it to the replica with the longest cached prefix when the match ratio
   (matched blocks / prompt blocks) exceeds ``cache_threshold``;
3. otherwise to the replica whose tree is smallest (most free cache).

Defaults 0.3 / 64 / 1.5 are sgl-router's. Differences from SGLang: match at block granularity
(SGLang matches characters/tokens), and the tree is a :class:`BlockLRUCache` per replica (capacity
``tree_capacity_blocks``, unlimited by default) updated when a request is routed.
"""

from __future__ import annotations

from collections.abc import Sequence

from serve.errors import check_fraction
from serve.fleet.routing.block_cache import BlockLRUCache
from serve.fleet.routing.router import RouteQuery, Router


class CacheAwareRouter(Router):
    """SGLang-router-like cache-aware policy (see module docstring)."""

    name = "cache_aware"

    def __init__(self, replicas: Sequence[str], cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5,
                 tree_capacity_blocks: int | None = None):
        check_fraction("cache_threshold", cache_threshold)
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree_capacity_blocks = tree_capacity_blocks
        super().__init__(replicas)
        self._trees = {r: BlockLRUCache(tree_capacity_blocks) for r in self._replicas}
        self.decisions = {"balance": 0, "cache": 0, "smallest_tree": 0}

    def route(self, query: RouteQuery) -> str:
        loads = [self._load.get(r, 0) for r in self._replicas]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            replica = self._replicas[loads.index(lo)]
            self.decisions["balance"] += 1
        else:
            matches = [self._trees[r].lookup(query.block_ids) for r in self._replicas]
            best = max(matches)
            if query.block_ids and best / len(query.block_ids) > self.cache_threshold:
                replica = self._replicas[matches.index(best)]
                self.decisions["cache"] += 1
            else:
                replica = min(self._replicas, key=lambda r: len(self._trees[r]))
                self.decisions["smallest_tree"] += 1
        self._trees[replica].insert(query.block_ids)
        return replica

    def add_replica(self, replica: str) -> None:
        super().add_replica(replica)
        self._trees[replica] = BlockLRUCache(self.tree_capacity_blocks)

    def remove_replica(self, replica: str) -> None:
        super().remove_replica(replica)
        del self._trees[replica]

    def check_integrity(self) -> None:
        super().check_integrity()
        assert set(self._trees) == set(self._replicas)
        for tree in self._trees.values():
            tree.check_integrity()
