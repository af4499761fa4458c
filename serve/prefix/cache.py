"""Dual-granularity prefix cache for a hybrid KDA/MLA model, stored in a :class:`PagePool`.

A prefix is reusable only at a token boundary b where *every* layer's cached data exists: the MLA
latents of tokens ``[0, b)`` (KV blocks, per token) **and** every group's KDA state after exactly b
tokens (a checkpoint, per sequence). So the cache has two granularities, one MLA_KV page per block of
N tokens and checkpoints of KDA_STATE pages at block boundaries, and a two-phase lookup:

  phase 1  walk the chained block keys left to right while KV blocks exist -> ``kv_tokens``
           (capped at len - 1: at least one token is computed to produce logits);
  phase 2  scan boundaries right to left from there for the largest b with a complete checkpoint
           (every group) -> ``num_tokens`` (may be 0).

Token ranges of a request after a hit (half-open):

  | range                  | what                                                         |
  |------------------------|--------------------------------------------------------------|
  | [0, num_tokens)        | KV pages shared by reference; state restored from checkpoint  |
  | [num_tokens, len)      | computed by prefill (KV written to the request's own pages)  |
  | [0, kv_tokens)         | KV cached (phase 1); [num_tokens, kv_tokens) is recomputed    |

Contract: :meth:`PrefixCache.lookup` is pure. :meth:`PrefixCache.acquire` pins every hit page (KV and
checkpoint) for an owner *before* that owner allocates anything, and adds the owner's page references;
pinned entries are never evicted, so no page is ever both a hit and reallocated. A
:class:`PrefixHit` stays valid while its owner holds it. Eviction is LRU over unpinned entries (see
:mod:`serve.prefix.index`). Publishing a checkpoint is atomic: every missing group's pages are
allocated and written first, then all are published; on allocation failure nothing is published.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from itertools import islice

from kda_core.config import ModelConfig
from serve.config import ServeConfig
from serve.memory.pages import copy_state
from serve.memory.pool import PageError, PageKind, PagePool, PoolExhausted
from serve.prefix.hit import CacheStats, CheckpointError, CheckpointInfo, LookupStep, PrefixHit
from serve.prefix.index import ROOT, EntryKind, PrefixIndex, block_keys

__all__ = ["CacheStats", "CheckpointError", "CheckpointInfo", "LookupStep", "PrefixCache", "PrefixHit"]


class _Holds:
    __slots__ = ("blocks", "ckpt")

    def __init__(self):
        self.blocks: list = []      # keys pinned, always keys[:len(blocks)] of the owner's sequence
        self.ckpt = None            # (key, groups, pages by group) while a checkpoint is pinned


class PrefixCache:
    """Block + checkpoint prefix cache on a page pool.

    Args:
        pool: the :class:`PagePool`; config: the :class:`ServeConfig` (N tokens per KV block, one page
        each; checkpoint interval C, whose placement is the engine's job; G groups of KDA layers);
        cfg: the model config (sizes); max_checkpoints: optional cap on stored checkpoints (counted
        per group).
    The :class:`CacheLayout` is built once here (``config.layout(cfg, pool.page_bytes)``); N, C and G
    are read from ``config`` (stored once).
    Raises ValueError for a bad config or cap, or a pool whose pages cannot hold one KV block.
    """

    def __init__(self, pool: PagePool, config: ServeConfig, *, cfg: ModelConfig, max_checkpoints: int | None = None):
        if not isinstance(config, ServeConfig):
            raise ValueError(f"config must be a ServeConfig, got {type(config).__name__}")
        self.config = config
        self.layout = config.layout(cfg, pool.page_bytes)
        if max_checkpoints is not None and (isinstance(max_checkpoints, bool) or not isinstance(max_checkpoints, int)
                                            or max_checkpoints < config.num_groups):
            raise ValueError(f"max_checkpoints must be None or an int >= num_groups={config.num_groups}, "
                             f"got {max_checkpoints!r}")
        self.pool, self.max_checkpoints = pool, max_checkpoints
        self.owner = ("prefix_cache", id(self))
        self.index = PrefixIndex(config.num_groups)
        self._holds: dict[Hashable, _Holds] = {}
        self._counts = dict(lookups=0, lookup_tokens=0, hit_tokens=0, evicted_blocks=0, evicted_checkpoints=0,
                            published_checkpoints=0, failed_checkpoints=0)

    @property
    def block_size(self) -> int:
        """N tokens per KV block (``config.block_size``)."""
        return self.config.block_size

    @property
    def num_groups(self) -> int:
        """G KDA layer groups (``config.num_groups``)."""
        return self.config.num_groups

    # ---- lookup -----------------------------------------------------------------------------------
    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """Chained keys of the full blocks of ``tokens`` (see :func:`serve.prefix.index.block_keys`)."""
        return block_keys(tokens, self.config.block_size)

    def lookup(self, tokens: Sequence[int]) -> PrefixHit:
        """Two-phase lookup of a prompt ``[T]`` (T >= 1, else ValueError). Pure: refreshes and pins nothing."""
        return self._walk(tokens)

    def explain(self, tokens: Sequence[int]) -> list[LookupStep]:
        """The steps of :meth:`lookup` (the same walk) with the reason each phase stops (page 07). Pure."""
        steps: list[LookupStep] = []
        self._walk(tokens, steps)
        return steps

    def _walk(self, tokens: Sequence[int], steps: list | None = None) -> PrefixHit:
        if len(tokens) < 1:
            raise ValueError("tokens must hold at least one token")
        keys = tuple(self.keys(tokens))
        N, nodes = self.config.block_size, self.index.nodes
        kv_tokens, j = self.index.walk(keys, len(tokens), N, steps)
        kv_pages = tuple(nodes[k].payload for k in keys[:j])
        ck = () if j == 0 else tuple(nodes[keys[j - 1]].ckpts[g].payload for g in range(self.num_groups))
        return PrefixHit(j * N, kv_tokens, len(tokens), keys, kv_pages, ck)

    # ---- pins and references ----------------------------------------------------------------------
    def acquire(self, hit: PrefixHit, owner: Hashable, replaces: PrefixHit | None = None) -> None:
        """Pin the hit (blocks ``[0, b / N)`` and the checkpoint at b) for ``owner`` and give ``owner`` one
        page reference to each; refresh them in the LRU (only what is consumed). Counts a lookup, or,
        with ``replaces`` (the owner's earlier, released hit: a re-match), only the extra hit tokens.
        Raises ValueError if ``owner`` already holds a hit."""
        if owner in self._holds:
            raise ValueError(f"owner {owner!r} already holds a prefix hit")
        j = len(hit.kv_pages)
        holds = self._holds[owner] = _Holds()
        keys = list(hit.keys[:j])
        self.index.pin_blocks(keys)
        holds.blocks = keys
        self.pool.incref(list(hit.kv_pages), owner)
        if j:
            groups = tuple(range(self.num_groups))
            self.index.pin_checkpoint(keys[-1], groups)
            self.pool.incref([p for pages in hit.checkpoint_pages for p in pages], owner)
            holds.ckpt = (keys[-1], groups, hit.checkpoint_pages)
            self.index.touch(keys, j)
        if replaces is None:
            self._counts["lookups"] += 1
            self._counts["lookup_tokens"] += hit.num_prompt_tokens
        self._counts["hit_tokens"] += hit.num_tokens - (0 if replaces is None else replaces.num_tokens)

    def restore(self, hit: PrefixHit, owner: Hashable, dst_pages_by_group) -> int:
        """Copy the pinned checkpoint of ``hit`` into ``dst_pages_by_group`` (the owner's private state
        pages, copy-on-write: its state slot, which the engine then reads and writes in place). Returns the bytes
        restored (the state's bytes, not page padding).
        Raises CheckpointError if a group's checkpoint was written at another length than b."""
        holds = self._holds.get(owner)
        if holds is None or holds.ckpt is None or holds.ckpt[0] != hit.checkpoint_key:
            raise ValueError(f"owner {owner!r} does not hold the checkpoint of this hit")
        node = self.index.node(hit.checkpoint_key)
        for g in range(self.num_groups):
            if node.ckpts[g].written_at != hit.num_tokens:
                raise CheckpointError(f"checkpoint of group {g} at boundary {hit.num_tokens} was written at "
                                      f"{node.ckpts[g].written_at} tokens")
        copy_state(self.pool, hit.checkpoint_pages, dst_pages_by_group)
        return self.layout.state_bytes

    def release_checkpoint(self, owner: Hashable) -> None:
        """Drop ``owner``'s pin and page references on its hit checkpoint (after restore or on abort)."""
        holds = self._holds.get(owner)
        if holds is None or holds.ckpt is None:
            return
        key, groups, pages = holds.ckpt
        holds.ckpt = None
        self.index.pin_checkpoint(key, groups, -1)
        self.pool.decref([p for grp in pages for p in grp], owner)

    def release(self, owner: Hashable) -> None:
        """Drop every pin of ``owner`` (checkpoint and blocks). The owner's KV page references (from
        :meth:`acquire` and its own pages) are its page table's and are dropped by the owner."""
        self.release_checkpoint(owner)
        holds = self._holds.pop(owner, None)
        if holds is not None:
            self.index.pin_blocks(holds.blocks, -1)

    # ---- allocation with eviction -----------------------------------------------------------------
    def _drop(self, evicted, count: bool = True) -> None:
        for ev in evicted:
            block = ev.kind is EntryKind.BLOCK
            self.pool.decref([ev.payload] if block else list(ev.payload), self.owner)
            if count:
                self._counts["evicted_blocks" if block else "evicted_checkpoints"] += 1

    def alloc(self, kind: PageKind, n: int, owner: Hashable) -> list[int]:
        """Allocate ``n`` pages for ``owner``, evicting unpinned cache entries (LRU) as needed.
        Raises PoolExhausted when even an empty cache (minus pinned entries) cannot supply them;
        what was evicted stays evicted."""
        while self.pool.num_free < n:
            evicted = self.index.evict_one()
            if not evicted:
                raise PoolExhausted(kind, n, self.pool.num_free)
            self._drop(evicted)
        return self.pool.alloc(kind, n, owner)

    def alloc_runs(self, kind: PageKind, sizes: Sequence[int], owner: Hashable) -> list[list[int]]:
        """:meth:`PagePool.alloc_runs` (one run of consecutive pages per size: a request's state slot), evicting
        unpinned cache entries (LRU) until the runs fit. Raises PoolExhausted / NoFreeRun when even an empty
        cache (minus pinned entries) cannot supply them, evicting nothing then (an eviction that opens no run only
        empties the cache)."""
        if not self.pool.can_alloc_runs(sizes, self.evictable_page_ids()):
            return self.pool.alloc_runs(kind, sizes, owner)     # raises; nothing evicted
        while not self.pool.can_alloc_runs(sizes):
            evicted = self.index.evict_one()
            if not evicted:
                break
            self._drop(evicted)
        return self.pool.alloc_runs(kind, sizes, owner)

    def evictable_pages(self) -> int:
        """Pages held only by unpinned cache entries (what :meth:`alloc` could free)."""
        nodes = self.index.nodes.values()
        kv = sum(1 for n in nodes if n.pins == 0)
        st = sum(len(c.payload) for n in nodes for c in n.ckpts.values() if c.pins == 0)
        return kv + st

    def evictable_page_ids(self) -> list[int]:
        """The ids of the :meth:`evictable_pages`: what evicting every unpinned entry would free. Pure."""
        nodes = self.index.nodes.values()
        return ([n.payload for n in nodes if n.pins == 0]
                + [p for n in nodes for c in n.ckpts.values() if c.pins == 0 for p in c.payload])

    def clear(self) -> int:
        """Evict every unpinned entry; returns the number of entries removed."""
        removed = 0
        while evicted := self.index.evict_one():
            self._drop(evicted)
            removed += len(evicted)
        return removed

    # ---- publishing -------------------------------------------------------------------------------
    def publish_blocks(self, keys: Sequence[bytes], page_table: Sequence[int], num_blocks: int,
                       owner: Hashable) -> None:
        """Publish the owner's full blocks ``[0, num_blocks)`` (``page_table[i]`` holds block i). A block
        already cached keeps its page (the owner keeps computing on its own copy); a new block's page
        gets a cache reference. Every block is pinned for the owner until :meth:`release`.

        Atomic: everything is validated before anything changes. Raises ValueError if ``num_blocks``
        exceeds ``keys`` or ``page_table``, PageError if a page to publish is not held by ``owner``
        (free, or another owner's); the index, pins and references are then unchanged."""
        holds = self._holds.get(owner)
        done = 0 if holds is None else len(holds.blocks)
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or not 0 <= num_blocks <= min(
                len(keys), len(page_table)):
            raise ValueError(f"num_blocks must be an int in [0, min(len(keys), len(page_table))] = "
                             f"[0, {min(len(keys), len(page_table))}], got {num_blocks!r}")
        index = self.index
        for i in range(done, num_blocks):
            if keys[i] not in index.nodes and self.pool.holders(page_table[i]).get(owner, 0) < 1:
                raise PageError(f"publish_blocks: {owner!r} holds no reference to page {page_table[i]} "
                                f"of block {i}; nothing was published")
        holds = self._holds.setdefault(owner, _Holds())
        for i in range(len(holds.blocks), num_blocks):
            key = keys[i]
            if index.add_block(key, ROOT if i == 0 else keys[i - 1], page_table[i]):
                self.pool.incref([page_table[i]], self.owner)
            index.pin_blocks([key])
            holds.blocks.append(key)
        index.touch(keys, num_blocks, with_checkpoint=False)

    def publish_checkpoint(self, keys: Sequence[bytes], num_blocks: int, state_pages_by_group, written_at: int,
                           owner: Hashable) -> bool:
        """Atomically publish the state after ``num_blocks * N`` tokens for every missing group.

        ``state_pages_by_group``: the owner's private state pages holding that state; ``written_at``: the
        tokens the owner had consumed. Returns True if the boundary is complete afterwards, False if
        allocation failed (nothing published, everything allocated released).
        Raises CheckpointError if ``written_at`` != boundary; ValueError if the owner has not
        published (pinned) the block at the boundary.
        """
        boundary = num_blocks * self.block_size
        if written_at != boundary:
            raise CheckpointError(f"checkpoint at boundary {boundary} written at {written_at} tokens")
        holds = self._holds.get(owner)
        if num_blocks < 1 or holds is None or len(holds.blocks) < num_blocks:
            raise ValueError(f"owner {owner!r} must publish blocks [0, {num_blocks}) before their checkpoint")
        key, index = keys[num_blocks - 1], self.index
        node = index.node(key)
        present = tuple(node.ckpts)
        missing = index.missing_groups(key)
        if not missing:
            index.touch(keys, num_blocks)
            return True
        index.pin_checkpoint(key, present)          # keep the groups we complete
        try:
            if self.max_checkpoints is not None:
                while index.num_checkpoints + len(missing) > self.max_checkpoints:
                    evicted = index.evict_one(checkpoints_only=True)
                    if not evicted:
                        raise PoolExhausted(PageKind.KDA_STATE, len(missing), 0)
                    self._drop(evicted)
            sizes = [self.layout.group_pages(g) for g in missing]
            pages = self.alloc(PageKind.KDA_STATE, sum(sizes), self.owner)
        except PoolExhausted:
            self._counts["failed_checkpoints"] += 1
            return False
        finally:
            index.pin_checkpoint(key, present, -1)
        it = iter(pages)
        split = [tuple(islice(it, n)) for n in sizes]   # the groups' pages, in order
        copy_state(self.pool, [state_pages_by_group[g] for g in missing], split)
        for g, grp in zip(missing, split):          # publish last, all groups together
            index.add_checkpoint(key, g, grp, written_at)
        self._counts["published_checkpoints"] += 1
        return True

    def drop_checkpoint(self, tokens: Sequence[int], boundary: int, group: int) -> None:
        """Remove group ``group``'s checkpoint at ``boundary`` of the prefix ``tokens`` (page 07's "what if").
        Raises ValueError if the boundary is not a positive multiple of N within the tokens, or if no
        such (unpinned) checkpoint exists."""
        N = self.block_size
        if boundary <= 0 or boundary % N or boundary > len(tokens):
            raise ValueError(f"boundary must be a positive multiple of {N} within the {len(tokens)} tokens, "
                             f"got {boundary}")
        key = self.keys(tokens[:boundary])[-1]
        if key not in self.index.nodes:
            raise ValueError(f"no cached block ends at boundary {boundary}")
        self._drop([self.index.remove_checkpoint(key, group)], count=False)

    # ---- inspection -------------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        """Every stored checkpoint, sorted by boundary, key and group."""
        N = self.block_size
        rows = [CheckpointInfo(depth * N, g, key.hex()[:12], written_at, len(pages), pins)
                for key, depth, g, pins, written_at, pages in self.index.checkpoint_items()]
        return sorted(rows)

    def stats(self) -> CacheStats:
        """A :class:`CacheStats` snapshot. Pure."""
        idx = self.index
        complete = sum(1 for n in idx.nodes.values() if len(n.ckpts) == self.num_groups)
        st_pages = sum(len(c.payload) for n in idx.nodes.values() for c in n.ckpts.values())
        c = self._counts
        return CacheStats(len(idx.nodes), idx.num_checkpoints, complete, len(idx.nodes), st_pages,
                          c["lookups"], c["lookup_tokens"], c["hit_tokens"], c["evicted_blocks"],
                          c["evicted_checkpoints"], c["published_checkpoints"], c["failed_checkpoints"])

    def check_integrity(self) -> None:
        """Assert the cache invariants (AssertionError): the index's (each checkpoint written at its
        boundary, complete or not), the pool's, every block one MLA_KV page and every group checkpoint
        ``group_pages(g)`` KDA_STATE pages held once by the cache, no page in two entries, pins equal to
        the owners' holds, and every pinned-checkpoint hold naming a stored checkpoint."""
        idx, pool = self.index, self.pool
        idx.check_integrity(self.block_size)
        pool.check_integrity()
        seen = set()
        for node in idx.nodes.values():
            entries = [(PageKind.MLA_KV, [node.payload])]
            entries += [(PageKind.KDA_STATE, list(c.payload)) for c in node.ckpts.values()]
            for g, c in node.ckpts.items():
                assert len(c.payload) == self.layout.group_pages(g), f"group {g} checkpoint has wrong page count"
            for kind, pages in entries:
                for p in pages:
                    assert pool.kind(p) is kind, f"page {p} is {pool.kind(p).name}, expected {kind.name}"
                    assert pool.holders(p).get(self.owner) == 1, f"page {p}: cache does not hold one reference"
                    assert p not in seen, f"page {p} belongs to two cache entries"
                    seen.add(p)
        pins = Counter(k for holds in self._holds.values() for k in holds.blocks)
        ck_pins = Counter((h.ckpt[0], g) for h in self._holds.values() if h.ckpt is not None for g in h.ckpt[1])
        for key, node in idx.nodes.items():
            assert node.pins == pins.get(key, 0), "block pins differ from the owners' holds"
            for g, c in node.ckpts.items():
                assert c.pins == ck_pins.get((key, g), 0), "checkpoint pins differ from the owners' holds"
        assert all(k in idx.nodes and g in idx.nodes[k].ckpts for k, g in ck_pins), "a hold names a missing checkpoint"
