"""Chained block keys and the prefix index: which blocks and checkpoints are cached, and their LRU order.

The index holds metadata only (no tensors), so the page-backed :class:`serve.prefix.cache.PrefixCache`
and the trace simulator :mod:`serve.prefix.sim` share one implementation of the rules:

- a **block** node per cached MLA KV block, keyed by the *chained* key of its prefix (so one key
  names the whole prefix and a node's parent is the previous block of the same prefix);
- **checkpoints** hang off a node: per group ``g`` in ``range(num_groups)``, the KDA state after
  exactly ``depth * block_size`` tokens. A boundary is *complete* when every group has it;
- **two-phase lookup**: :meth:`PrefixIndex.walk`, the one implementation of the lookup rule
  (phase 1 :meth:`PrefixIndex.kv_run`, leading blocks present, capped at L - 1 tokens; phase 2
  :meth:`PrefixIndex.checkpoint_run`, deepest complete checkpoint within that run), optionally
  recording each step for page 07;
- **LRU**: one ordered list over both kinds of entries, the index's own records
  (:class:`BlockNode`, :class:`Checkpoint`), each typed by its ``kind`` (:class:`EntryKind`).
  :meth:`PrefixIndex.touch` refreshes only what a hit consumed -- the checkpoint used and
  the block path up to it -- deepest first, so a parent is always more recent than its children and
  the oldest block entry is a leaf. Pinned entries (in use by a request) are never evicted. Evicting a
  checkpoint leaves its block; evicting a block also drops that node's checkpoints.
"""
from __future__ import annotations

import enum
import hashlib
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np

from serve.errors import check_int
from serve.prefix.hit import LookupStep

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
    check_int("block_size", block_size)
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


class EntryKind(enum.IntEnum):
    """What an LRU entry (and an :class:`Evicted` record) names: a KV block or one group's checkpoint."""

    BLOCK = 0
    CHECKPOINT = 1


class Walk(NamedTuple):
    """The outcome of :meth:`PrefixIndex.walk`: ``kv_tokens`` (phase 1: cached KV tokens, capped at
    L - 1) and ``hit_blocks`` j (phase 2: the restore boundary is j N tokens; 0 = nothing usable)."""

    kv_tokens: int
    hit_blocks: int


class Evicted(NamedTuple):
    """One entry removed by :meth:`PrefixIndex.evict_one` or a cascade.

    kind: :attr:`EntryKind.BLOCK` (group None) or :attr:`EntryKind.CHECKPOINT`; key: the node's
    chained key; payload: what the owner stored (page ids for the real cache, None in the trace
    replay); depth: blocks in the prefix.
    """

    kind: EntryKind
    key: Hashable
    group: int | None
    payload: Any
    depth: int


class BlockNode:
    """A cached block (an LRU entry of kind BLOCK): chained ``key``, ``parent`` key (ROOT for the first
    block), ``depth`` (blocks in the prefix), ``children`` cached, ``pins``, the owner's ``payload`` and
    ``ckpts`` by group."""

    __slots__ = ("key", "parent", "depth", "children", "pins", "payload", "ckpts")
    kind = EntryKind.BLOCK
    group = None

    def __init__(self, key, parent, depth, payload):
        self.key, self.parent, self.depth, self.payload = key, parent, depth, payload
        self.children = 0
        self.pins = 0
        self.ckpts: dict[int, Checkpoint] = {}


class Checkpoint:
    """One group's checkpoint at block ``key`` (an LRU entry of kind CHECKPOINT): ``pins``, the owner's
    ``payload`` and ``written_at`` (tokens the state had consumed)."""

    __slots__ = ("key", "group", "pins", "payload", "written_at")
    kind = EntryKind.CHECKPOINT

    def __init__(self, key, group, payload, written_at):
        self.key, self.group = key, group
        self.pins, self.payload, self.written_at = 0, payload, written_at


class PrefixIndex:
    """Blocks and checkpoints by chained key, with a kind-aware LRU. Metadata only.

    Args: num_groups: G >= 1, groups that must all hold a checkpoint for it to be complete (a
    :class:`serve.config.ServeConfig`'s ``num_groups``). Keys are any hashable (chained block keys).
    """

    def __init__(self, num_groups: int = 1):
        check_int("num_groups", num_groups)
        self._num_groups = num_groups
        self.nodes: dict[Hashable, BlockNode] = {}
        self.lru: OrderedDict[BlockNode | Checkpoint, None] = OrderedDict()   # oldest first; each has a .kind
        self.num_checkpoints = 0

    @property
    def num_groups(self) -> int:
        """G, fixed at construction."""
        return self._num_groups

    # ---- lookup (pure) ----------------------------------------------------------------------------
    def kv_run(self, keys: Sequence[Hashable], limit: int | None = None) -> int:
        """Phase 1: number of leading ``keys`` with a cached block, at most ``limit``."""
        nodes, n = self.nodes, len(keys) if limit is None else min(limit, len(keys))
        run = 0
        while run < n and keys[run] in nodes:
            run += 1
        return run

    def checkpoint_run(self, keys: Sequence[Hashable], limit: int, steps: list | None = None,
                       block_size: int = 0) -> int:
        """Phase 2: largest j <= ``limit`` whose node ``keys[j-1]`` has a complete checkpoint (0 if none).
        ``keys[:limit]`` must all be cached (a phase-1 run). With ``steps``, appends one phase-2
        :class:`LookupStep` per boundary examined (boundaries in tokens need ``block_size``)."""
        nodes, G = self.nodes, self._num_groups
        for j in range(limit, 0, -1):
            ckpts = nodes[keys[j - 1]].ckpts
            complete = len(ckpts) == G
            if steps is not None:
                groups = tuple(sorted(ckpts))
                note = "hit: complete checkpoint" if complete else (
                    "no checkpoint here" if not groups else f"incomplete: groups {groups} of {G}")
                steps.append(LookupStep(2, j - 1, j * block_size, complete, groups, note))
            if complete:
                return j
        return 0

    def walk(self, keys: Sequence[Hashable], num_tokens: int, block_size: int, steps: list | None = None) -> Walk:
        """THE two-phase lookup of a prompt of L = ``num_tokens`` tokens whose full blocks have ``keys``
        (``L // block_size`` of them): phase 1 takes the leading cached blocks, capped so at least one
        token is left to compute (kv_tokens <= L - 1); phase 2 takes the deepest complete checkpoint
        within them. With ``steps``, appends a :class:`LookupStep` per block and boundary examined,
        with the reason each phase stops (page 07). Pure: refreshes nothing. Raises ValueError for
        L < 1."""
        check_int("num_tokens", num_tokens)
        N = block_size
        cap = (num_tokens - 1) // N                     # blocks that end at or before token L - 1
        seen = self.kv_run(keys, cap + 1)               # block `cap` cached too: the cap, not a miss, stops
        run = min(seen, cap)
        kv_tokens = num_tokens - 1 if seen > cap else run * N
        if steps is not None:
            steps += [LookupStep(1, i, (i + 1) * N, True, (), "KV block cached") for i in range(run)]
            if run < len(keys):
                if run == cap:
                    note = "stop: cap at len - 1 (one token must be computed for the logits)"
                    steps.append(LookupStep(1, run, (run + 1) * N, seen > cap, (), note))
                else:
                    steps.append(LookupStep(1, run, (run + 1) * N, False, (), "stop: no KV block"))
            elif len(keys) * N < num_tokens:
                steps.append(LookupStep(1, len(keys), num_tokens, False, (), "stop: partial block (below one block)"))
        return Walk(kv_tokens, self.checkpoint_run(keys, run, steps, N))

    def missing_groups(self, key: Hashable) -> list[int]:
        """Groups without a checkpoint at cached block ``key`` (what publishing there would add)."""
        ckpts = self.nodes[key].ckpts
        if len(ckpts) == self._num_groups:
            return []
        return [g for g in range(self._num_groups) if g not in ckpts]

    def node(self, key: Hashable) -> BlockNode:
        """The node of a cached block (KeyError if absent)."""
        return self.nodes[key]

    # ---- refresh and pins -------------------------------------------------------------------------
    def touch(self, keys: Sequence[Hashable], num_blocks: int, with_checkpoint: bool = True) -> None:
        """Refresh what a hit consumed: the checkpoint at ``keys[num_blocks-1]`` (all groups, if
        ``with_checkpoint``), then the blocks ``keys[num_blocks-1] .. keys[0]``, deepest first."""
        move, nodes = self.lru.move_to_end, self.nodes
        if num_blocks and with_checkpoint:
            key = keys[num_blocks - 1]
            ckpts = nodes[key].ckpts
            for g in sorted(ckpts):
                move(ckpts[g])
        for j in range(num_blocks - 1, -1, -1):
            move(nodes[keys[j]])

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
        Raises ValueError if ``parent`` is not cached."""
        if key in self.nodes:
            return False
        if parent is ROOT:
            depth = 1
        else:
            pnode = self.nodes.get(parent)
            if pnode is None:
                raise ValueError("parent block is not cached (a block is inserted after its prefix)")
            pnode.children += 1
            depth = pnode.depth + 1
        node = self.nodes[key] = BlockNode(key, parent, depth, payload)
        self.lru[node] = None
        return True

    def add_path(self, keys: Sequence[Hashable], start: int, payloads: Sequence[Any] | None = None) -> int:
        """Insert the blocks ``keys[start:]`` (each under the one before it; ``keys[start - 1]`` cached
        when ``start`` > 0), then refresh the whole path ``keys`` deepest first: the same index as
        :meth:`add_block` for each (already-cached ones skipped) followed by
        ``touch(keys, len(keys), with_checkpoint=False)``, in one pass per block instead of two calls.
        ``payloads[i]`` is block ``keys[start + i]``'s payload (None if omitted). Returns the blocks added.
        Raises ValueError (nothing changed) if ``keys[start - 1]`` is not cached."""
        nodes, lru = self.nodes, self.lru
        if start > 0 and keys[start - 1] not in nodes:
            raise ValueError("parent block is not cached (a block is inserted after its prefix)")
        fresh = []
        for i in range(start, len(keys)):
            key = keys[i]
            if key in nodes:
                continue
            if i == 0:
                parent, depth = ROOT, 1
            else:
                parent = keys[i - 1]
                pnode = nodes[parent]
                pnode.children += 1
                depth = pnode.depth + 1
            node = nodes[key] = BlockNode(key, parent, depth, None if payloads is None else payloads[i - start])
            fresh.append(node)
        for node in fresh:                  # add_block's order (oldest first), then the touch moves all
            lru[node] = None
        move = lru.move_to_end
        for j in range(len(keys) - 1, -1, -1):
            move(nodes[keys[j]])
        return len(fresh)

    def add_checkpoint(self, key: Hashable, group: int, payload: Any, written_at: int) -> None:
        """Attach group ``group``'s checkpoint to block ``key`` (most recent entry).

        Raises ValueError if the block is absent, the group is out of range or already present."""
        node = self.nodes.get(key)
        if node is None:
            raise ValueError("checkpoint on a block that is not cached")
        if not 0 <= group < self._num_groups:
            raise ValueError(f"group must be in [0, {self._num_groups}), got {group}")
        if group in node.ckpts:
            raise ValueError(f"group {group} already has a checkpoint at this block")
        ck = node.ckpts[group] = Checkpoint(key, group, payload, written_at)
        self.lru[ck] = None
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
        del self.lru[ck]
        self.num_checkpoints -= 1
        return Evicted(EntryKind.CHECKPOINT, key, group, ck.payload, node.depth)

    def remove_block(self, node: BlockNode, records: bool = True) -> list[Evicted]:
        """Drop ``node`` (a cached block) and its checkpoints, whatever their LRU place; returns what went
        (``[]`` with ``records=False``, for callers that only count). The caller keeps the tree a tree:
        only a leaf (no cached children) may go."""
        assert node.children == 0, f"block {node.key!r} still has {node.children} cached children"
        lru, key, depth, ckpts = self.lru, node.key, node.depth, node.ckpts
        out = []
        if ckpts:
            for g, ck in ckpts.items():
                del lru[ck]
                if records:
                    out.append(Evicted(EntryKind.CHECKPOINT, key, g, ck.payload, depth))
            self.num_checkpoints -= len(ckpts)
        del self.nodes[key]
        del lru[node]
        if node.parent is not ROOT:
            self.nodes[node.parent].children -= 1
        if records:
            out.append(Evicted(EntryKind.BLOCK, key, None, node.payload, depth))
        return out

    def evict_one(self, checkpoints_only: bool = False) -> list[Evicted]:
        """Evict the least recently used unpinned entry: a checkpoint, or a leaf block together with
        its checkpoints (not with ``checkpoints_only``). Returns what was removed ([] if nothing is
        evictable)."""
        for entry in self.lru:
            if entry.kind is EntryKind.CHECKPOINT:
                if entry.pins == 0:
                    return [self.remove_checkpoint(entry.key, entry.group)]
            elif not checkpoints_only:
                node = entry
                if node.pins == 0 and node.children == 0 and not any(c.pins for c in node.ckpts.values()):
                    return self.remove_block(node)
        return []

    def evict_to_bytes(self, cap: float, kv_used: float, st_used: float, block_bytes: float,
                       group_bytes: Sequence[float]) -> tuple[float, float, int, int]:
        """Repeat :meth:`evict_one` while ``kv_used + st_used > cap`` (bytes), charging ``block_bytes`` per
        block and ``group_bytes[g]`` per checkpoint of group g, in the same order as the evicted records
        (a block's checkpoints, then the block) -- without building them. Stops early if nothing is
        evictable. Returns ``(kv_used, st_used, blocks_evicted, checkpoints_evicted)``."""
        lru, nodes, CK = self.lru, self.nodes, EntryKind.CHECKPOINT
        n_blocks = n_ckpts = 0
        while kv_used + st_used > cap:
            for entry in lru:
                if entry.kind is CK:
                    if entry.pins == 0:
                        node = nodes[entry.key]
                        del node.ckpts[entry.group]
                        del lru[entry]
                        self.num_checkpoints -= 1
                        st_used -= group_bytes[entry.group]
                        n_ckpts += 1
                        break
                elif entry.pins == 0 and entry.children == 0 and not (
                        entry.ckpts and any(c.pins for c in entry.ckpts.values())):
                    ckpts = entry.ckpts
                    if ckpts:
                        for g, ck in ckpts.items():
                            del lru[ck]
                            st_used -= group_bytes[g]
                        n_ckpts += len(ckpts)
                        self.num_checkpoints -= len(ckpts)
                    del nodes[entry.key]
                    del lru[entry]
                    if entry.parent is not ROOT:
                        nodes[entry.parent].children -= 1
                    kv_used -= block_bytes
                    n_blocks += 1
                    break
            else:
                break
        return kv_used, st_used, n_blocks, n_ckpts

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
        children = Counter(node.parent for node in nodes.values() if node.parent is not ROOT)
        for key, node in nodes.items():
            assert node.key == key, "node stored under another key"
            if node.parent is ROOT:
                assert node.depth == 1, f"root child with depth {node.depth}"
            else:
                assert node.parent in nodes, "orphan block: its parent is not cached"
                assert nodes[node.parent].depth == node.depth - 1, "depth is not parent depth + 1"
            assert node.pins >= 0 and all(c.pins >= 0 for c in node.ckpts.values()), "negative pin count"
            assert all(0 <= g < self._num_groups for g in node.ckpts), "checkpoint group out of range"
            if block_size is not None:
                for g, ck in node.ckpts.items():
                    assert ck.written_at == node.depth * block_size, (
                        f"checkpoint of group {g} at boundary {node.depth * block_size} written at {ck.written_at}")
        for key, node in nodes.items():
            assert node.children == children[key], "child count out of date"
        expected = len(nodes) + sum(len(n.ckpts) for n in nodes.values())
        assert len(self.lru) == expected, f"LRU holds {len(self.lru)} entries, index {expected}"
        assert self.num_checkpoints == expected - len(nodes), "checkpoint counter out of date"
        pos = {}
        for i, entry in enumerate(self.lru):
            key = entry.key
            if entry.kind is EntryKind.CHECKPOINT:
                assert key in nodes and nodes[key].ckpts.get(entry.group) is entry, "LRU names a missing checkpoint"
            else:
                assert nodes.get(key) is entry, "LRU names a missing block"
                pos[key] = i
        for key, node in nodes.items():
            if node.parent is not ROOT:
                assert pos[node.parent] > pos[key], "a parent is older than its child in the LRU list"
