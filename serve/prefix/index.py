"""Chained block keys and the prefix index: which blocks and checkpoints are cached, and their LRU order.

The index holds metadata only (no tensors), so the page-backed :class:`serve.prefix.cache.PrefixCache`
and the trace simulator :mod:`serve.prefix.sim` share one implementation of the rules:

- a **block** node per cached MLA KV block, keyed by the *chained* key of its prefix (so one key
  names the whole prefix and a node's parent is the previous block of the same prefix);
- **checkpoints** hang off a node: per group ``g`` in ``range(num_groups)``, the KDA state after
  exactly ``depth * block_size`` tokens. A boundary is *complete* when every group has it;
- **two-phase lookup**: :meth:`PrefixIndex.kv_run` (phase 1, leading blocks present) then
  :meth:`PrefixIndex.checkpoint_run` (phase 2, deepest complete checkpoint within that run);
- **LRU**: one ordered list over both kinds of entries (a block key, or ``(key, group)`` for a
  checkpoint). :meth:`PrefixIndex.touch` refreshes only what a hit consumed -- the checkpoint used and
  the block path up to it -- deepest first, so a parent is always more recent than its children and
  the oldest block entry is a leaf. Pinned entries (in use by a request) are never evicted. Evicting a
  checkpoint leaves its block; evicting a block also drops that node's checkpoints.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np

ROOT = None  # parent of the first block


def block_keys(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Chained keys of the full blocks of ``tokens``.

    Key i = SHA-256(key i-1 || int32 little-endian bytes of tokens[i*N:(i+1)*N]) (key -1 = b""), so
    equal keys mean equal whole prefixes. A trailing partial block gets no key.

    Args: tokens: token ids ``[T]`` (list, tuple, numpy array or 1-D tensor of ints);
        block_size: N > 0 tokens per block.
    Returns: ``T // N`` keys of 32 bytes.
    Raises: ValueError for a non-positive block size or tokens that are not a 1-D integer sequence.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    arr = np.asarray(tokens.tolist() if hasattr(tokens, "tolist") else tokens)
    if arr.size == 0:
        return []
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}")
    raw = arr.astype("<i4").tobytes()
    step = 4 * block_size                       # bytes per block
    keys, prev = [], b""
    for i in range(len(arr) // block_size):
        prev = hashlib.sha256(prev + raw[i * step: (i + 1) * step]).digest()
        keys.append(prev)
    return keys


def checkpoint_boundaries(num_tokens: int, block_size: int, interval: int) -> list[int]:
    """Where a prefill of ``num_tokens`` (L) writes checkpoints, in tokens, ascending: every multiple of
    the interval C up to L, the replay boundary floor((L - 1) / N) N (where an identical prompt's
    lookup stops, since one token must be computed) and the end of the prompt floor(L / N) N."""
    N, L = block_size, num_tokens
    marks = set(range(interval, L + 1, interval)) | {(L - 1) // N * N, L // N * N}
    return sorted(b for b in marks if b > 0)


class Evicted(NamedTuple):
    """One entry removed by :meth:`PrefixIndex.evict_one` or a cascade.

    kind "kv" (a block; group None) or "ckpt"; key: the node's chained key; payload: what the owner
    stored (page ids for the real cache, None in the simulator); depth: blocks in the prefix.
    """

    kind: str
    key: Hashable
    group: int | None
    payload: Any
    depth: int


class _Node:
    __slots__ = ("key", "parent", "depth", "children", "pins", "payload", "ckpts")

    def __init__(self, key, parent, depth, payload):
        self.key, self.parent, self.depth, self.payload = key, parent, depth, payload
        self.children = 0
        self.pins = 0
        self.ckpts: dict[int, _Ckpt] = {}


class _Ckpt:
    __slots__ = ("pins", "payload", "written_at")

    def __init__(self, payload, written_at):
        self.pins, self.payload, self.written_at = 0, payload, written_at


class PrefixIndex:
    """Blocks and checkpoints by chained key, with a kind-aware LRU. Metadata only.

    Args: num_groups: G >= 1, groups that must all hold a checkpoint for it to be complete.
    Keys are any hashable except tuples (tuples name checkpoint entries in the LRU list).
    """

    def __init__(self, num_groups: int = 1):
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
            raise ValueError(f"num_groups must be an int >= 1, got {num_groups!r}")
        self.num_groups = num_groups
        self.nodes: dict[Hashable, _Node] = {}
        self.lru: OrderedDict = OrderedDict()   # oldest first; entry = key or (key, group)
        self.num_checkpoints = 0

    # ---- lookup (pure) ----------------------------------------------------------------------------
    def kv_run(self, keys: Sequence[Hashable], limit: int | None = None) -> int:
        """Phase 1: number of leading ``keys`` with a cached block, at most ``limit``."""
        nodes, n = self.nodes, len(keys) if limit is None else min(limit, len(keys))
        run = 0
        while run < n and keys[run] in nodes:
            run += 1
        return run

    def checkpoint_run(self, keys: Sequence[Hashable], limit: int) -> int:
        """Phase 2: largest j <= ``limit`` whose node ``keys[j-1]`` has a complete checkpoint (0 if none).
        ``keys[:limit]`` must all be cached (a phase-1 run)."""
        nodes, g = self.nodes, self.num_groups
        for j in range(limit, 0, -1):
            if len(nodes[keys[j - 1]].ckpts) == g:
                return j
        return 0

    def is_complete(self, key: Hashable) -> bool:
        """True when the block ``key`` is cached and every group has a checkpoint there."""
        node = self.nodes.get(key)
        return node is not None and len(node.ckpts) == self.num_groups

    def node(self, key: Hashable) -> _Node:
        """The node of a cached block (KeyError if absent)."""
        return self.nodes[key]

    # ---- refresh and pins -------------------------------------------------------------------------
    def touch(self, keys: Sequence[Hashable], num_blocks: int, with_checkpoint: bool = True) -> None:
        """Refresh what a hit consumed: the checkpoint at ``keys[num_blocks-1]`` (all groups, if
        ``with_checkpoint``), then the blocks ``keys[num_blocks-1] .. keys[0]``, deepest first."""
        move, nodes = self.lru.move_to_end, self.nodes
        if num_blocks and with_checkpoint:
            key = keys[num_blocks - 1]
            for g in sorted(nodes[key].ckpts):
                move((key, g))
        for j in range(num_blocks - 1, -1, -1):
            move(keys[j])

    def pin_blocks(self, keys: Sequence[Hashable], delta: int = 1) -> None:
        """Add ``delta`` (+1 pin / -1 unpin) to each cached block in ``keys``. Pinned blocks are never
        evicted. Raises KeyError for an absent block, ValueError for an unpin below 0 (nothing changes)."""
        nodes = [self.nodes[k] for k in keys]
        if delta < 0 and any(n.pins + delta < 0 for n in nodes):
            raise ValueError("unpin of a block that is not pinned")
        for n in nodes:
            n.pins += delta

    def pin_checkpoint(self, key: Hashable, groups: Sequence[int], delta: int = 1) -> None:
        """Add ``delta`` to the checkpoints of ``groups`` at block ``key`` (see :meth:`pin_blocks`)."""
        node = self.nodes[key]
        cks = [node.ckpts[g] for g in groups]
        if delta < 0 and any(c.pins + delta < 0 for c in cks):
            raise ValueError("unpin of a checkpoint that is not pinned")
        for c in cks:
            c.pins += delta

    # ---- insertion --------------------------------------------------------------------------------
    def add_block(self, key: Hashable, parent: Hashable | None, payload: Any = None) -> bool:
        """Insert block ``key`` under ``parent`` (ROOT for the first block) as the most recent entry.

        Returns False (and changes nothing) if the block is already cached.
        Raises ValueError if ``parent`` is not cached or ``key`` is a tuple."""
        if key in self.nodes:
            return False
        if isinstance(key, tuple):
            raise ValueError("block keys must not be tuples")
        if parent is ROOT:
            depth = 1
        else:
            pnode = self.nodes.get(parent)
            if pnode is None:
                raise ValueError("parent block is not cached (a block is inserted after its prefix)")
            pnode.children += 1
            depth = pnode.depth + 1
        self.nodes[key] = _Node(key, parent, depth, payload)
        self.lru[key] = None
        return True

    def add_checkpoint(self, key: Hashable, group: int, payload: Any, written_at: int) -> None:
        """Attach group ``group``'s checkpoint to block ``key`` (most recent entry).

        Raises ValueError if the block is absent, the group is out of range or already present."""
        node = self.nodes.get(key)
        if node is None:
            raise ValueError("checkpoint on a block that is not cached")
        if not 0 <= group < self.num_groups:
            raise ValueError(f"group must be in [0, {self.num_groups}), got {group}")
        if group in node.ckpts:
            raise ValueError(f"group {group} already has a checkpoint at this block")
        node.ckpts[group] = _Ckpt(payload, written_at)
        self.lru[(key, group)] = None
        self.num_checkpoints += 1

    # ---- removal ----------------------------------------------------------------------------------
    def remove_checkpoint(self, key: Hashable, group: int) -> Evicted:
        """Drop one group's checkpoint at block ``key``. Raises ValueError if absent or pinned."""
        node = self.nodes.get(key)
        ck = None if node is None else node.ckpts.get(group)
        if ck is None:
            raise ValueError(f"no checkpoint of group {group} at this block")
        if ck.pins:
            raise ValueError(f"checkpoint of group {group} is pinned by {ck.pins} request(s)")
        del node.ckpts[group]
        del self.lru[(key, group)]
        self.num_checkpoints -= 1
        return Evicted("ckpt", key, group, ck.payload, node.depth)

    def _remove_block(self, node: _Node) -> list[Evicted]:
        lru, key, depth = self.lru, node.key, node.depth
        out = []
        for g, ck in node.ckpts.items():
            del lru[(key, g)]
            out.append(Evicted("ckpt", key, g, ck.payload, depth))
        self.num_checkpoints -= len(node.ckpts)
        del self.nodes[key]
        del lru[key]
        if node.parent is not ROOT:
            self.nodes[node.parent].children -= 1
        out.append(Evicted("kv", key, None, node.payload, depth))
        return out

    def evict_one(self, checkpoints_only: bool = False) -> list[Evicted]:
        """Evict the least recently used unpinned entry: a checkpoint, or a leaf block together with
        its checkpoints (not with ``checkpoints_only``). Returns what was removed ([] if nothing is
        evictable)."""
        nodes = self.nodes
        for entry in self.lru:
            if type(entry) is tuple:
                if nodes[entry[0]].ckpts[entry[1]].pins == 0:
                    return [self.remove_checkpoint(*entry)]
            elif not checkpoints_only:
                node = nodes[entry]
                if node.pins == 0 and node.children == 0 and not any(c.pins for c in node.ckpts.values()):
                    return self._remove_block(node)
        return []

    # ---- inspection -------------------------------------------------------------------------------
    def checkpoint_items(self):
        """Yield ``(key, depth, group, pins, written_at, payload)`` for every stored checkpoint."""
        for node in self.nodes.values():
            for g, ck in sorted(node.ckpts.items()):
                yield node.key, node.depth, g, ck.pins, ck.written_at, ck.payload

    def check_integrity(self, block_size: int | None = None) -> None:
        """Assert the index invariants (AssertionError names the first broken one): parents cached with
        depth - 1; child counts exact; the LRU list holds exactly the blocks and checkpoints; pins >= 0;
        every node more recent than its children; with ``block_size``, every checkpoint written at
        ``depth * block_size`` tokens."""
        nodes = self.nodes
        children: dict = {}
        for key, node in nodes.items():
            assert node.key == key, "node stored under another key"
            if node.parent is ROOT:
                assert node.depth == 1, f"root child with depth {node.depth}"
            else:
                assert node.parent in nodes, "orphan block: its parent is not cached"
                assert nodes[node.parent].depth == node.depth - 1, "depth is not parent depth + 1"
                children[node.parent] = children.get(node.parent, 0) + 1
            assert node.pins >= 0 and all(c.pins >= 0 for c in node.ckpts.values()), "negative pin count"
            assert all(0 <= g < self.num_groups for g in node.ckpts), "checkpoint group out of range"
            if block_size is not None:
                for g, ck in node.ckpts.items():
                    assert ck.written_at == node.depth * block_size, (
                        f"checkpoint of group {g} at boundary {node.depth * block_size} written at {ck.written_at}")
        for key, node in nodes.items():
            assert node.children == children.get(key, 0), "child count out of date"
        expected = len(nodes) + sum(len(n.ckpts) for n in nodes.values())
        assert len(self.lru) == expected, f"LRU holds {len(self.lru)} entries, index {expected}"
        assert self.num_checkpoints == expected - len(nodes), "checkpoint counter out of date"
        pos = {}
        for i, entry in enumerate(self.lru):
            if type(entry) is tuple:
                assert entry[0] in nodes and entry[1] in nodes[entry[0]].ckpts, "LRU names a missing checkpoint"
            else:
                assert entry in nodes, "LRU names a missing block"
                pos[entry] = i
        for key, node in nodes.items():
            if node.parent is not ROOT:
                assert pos[node.parent] > pos[key], "a parent is older than its child in the LRU list"
