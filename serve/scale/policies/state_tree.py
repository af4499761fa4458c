"""Cached KV at trace-block granularity plus KDA states at token positions, with LRU eviction.

The production engines place states where ours cannot (SGLang at any token, vLLM at its own block
size), so their policy models share this structure instead of :class:`serve.prefix.index.PrefixIndex`'s
per-block checkpoints. It sits beside the index and uses it for the KV part:

- **KV**: one :class:`PrefixIndex` node per trace block (chained id = key); the node's payload is the
  number of that block's tokens the engine keeps (an engine may keep only part of a block, e.g. vLLM
  only full engine blocks, SGLang ``extra_buffer`` only up to the tracked length). A node with children
  keeps its whole block. LRU over blocks, leaves first (the index's order).
- **states**: ``(key, pos)`` = one sequence's KDA state after ``pos`` tokens, anchored on the block that
  holds token ``pos - 1``; its own LRU list (SGLang's ``mamba_lru_list`` beside ``full_lru_list``).
- **eviction**: ``two_pools`` (SGLang: the KV pool and the mamba pool are sized separately, each evicts
  its own LRU) or one pool (vLLM: one block pool, the older of the two LRU heads goes first). Evicting a
  block drops the states anchored on it. With ``prune_stateless_leaves`` (SGLang's invariant "a leaf is
  never a mamba tombstone", ``MambaRadixCache._iteratively_delete_tombstone_leaf``) a leaf block left
  without a state is deleted too, up the path.

A request with ids ``h`` shares ``shared_tokens`` with the cache: the payloads of its leading run of
cached blocks, stopping after the first block kept only in part.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from serve.errors import check_int
from serve.prefix.index import ROOT, PrefixIndex
from serve.scale.policies.base import step_replay


class StateTree:
    """KV blocks + token-position states. Metadata only; byte sizes in ``kv_bytes_per_token`` and
    ``state_bytes`` (one state). Raises ValueError for non-positive sizes."""

    def __init__(self, block_size: int, kv_bytes_per_token: int, state_bytes: int, two_pools: bool,
                 prune_stateless_leaves: bool):
        self.block_size = check_int("block_size", block_size)
        self.kv_bytes_per_token = check_int("kv_bytes_per_token", kv_bytes_per_token)
        self.state_bytes = check_int("state_bytes", state_bytes)
        self.two_pools, self.prune = two_pools, prune_stateless_leaves
        self.idx = PrefixIndex(1)
        self.states: OrderedDict = OrderedDict()     # (key, pos) -> stamp, oldest first
        self.node_states: dict = {}                  # key -> set of pos
        self.kv_stamp: dict = {}                     # key -> stamp of its last touch (one pool only)
        self.clock = 0
        self.kv_tokens = 0
        self.states_written = self.states_evicted = self.kv_evicted_tokens = 0

    # ---- lookup (pure) ----------------------------------------------------------------------------
    def shared_tokens(self, ids: Sequence[int], length: int) -> int:
        """Tokens of a prompt (``ids``, ``length`` tokens) whose KV is cached, from its start."""
        nodes, N = self.idx.nodes, self.block_size
        shared = 0
        for j, h in enumerate(ids):
            node = nodes.get(h)
            if node is None:
                break
            own = min(N, length - j * N)                 # this request's tokens in block j
            shared += min(node.payload, own)
            if node.payload < own:
                break
        return shared

    def deepest_state(self, ids: Sequence[int], limit: int) -> int:
        """Largest ``pos <= limit`` with a cached state on this prompt's path (0 if none). ``limit`` must
        not exceed :meth:`shared_tokens`."""
        N, node_states = self.block_size, self.node_states
        for j in range(-(-limit // N), 0, -1):
            pos = node_states.get(ids[j - 1])
            if pos:
                best = max((p for p in pos if p <= limit), default=0)
                if best:
                    return best
        return 0

    # ---- refresh and insertion --------------------------------------------------------------------
    def touch(self, ids: Sequence[int], tokens: int, state_pos: int = 0) -> None:
        """Refresh the blocks holding the first ``tokens`` tokens (deepest first) and the state at
        ``state_pos`` (if > 0) on this path."""
        nblk = -(-tokens // self.block_size)
        if nblk:
            self.idx.touch(ids, nblk, with_checkpoint=False)
            self.clock += 1
            if not self.two_pools:                   # two pools never compare a block with a state
                stamp, clock = self.kv_stamp, self.clock
                for j in range(nblk):
                    stamp[ids[j]] = clock
        if state_pos:
            entry = (ids[-(-state_pos // self.block_size) - 1], state_pos)
            self.clock += 1
            self.states[entry] = self.clock
            self.states.move_to_end(entry)

    def insert_kv(self, ids: Sequence[int], length: int, upto: int) -> None:
        """Keep the KV of the first ``upto`` tokens of a prompt of ``length`` tokens (most recent)."""
        N, nodes = self.block_size, self.idx.nodes
        for j in range(-(-upto // N)):
            tokens = min(N, upto - j * N, length - j * N)
            node = nodes.get(ids[j])
            if node is None:
                self.idx.add_block(ids[j], ROOT if j == 0 else ids[j - 1], tokens)
                self.kv_tokens += tokens
            elif node.payload < tokens:
                self.kv_tokens += tokens - node.payload
                node.payload = tokens
        self.touch(ids, upto)

    def add_states(self, ids: Sequence[int], positions: Sequence[int]) -> None:
        """Cache a state after each of ``positions`` tokens of this prompt, in order (one call per prompt;
        its KV must be kept up to each position)."""
        N, states, node_states = self.block_size, self.states, self.node_states
        clock, written = self.clock, 0
        for pos in positions:
            key = ids[-(-pos // N) - 1]
            entry = (key, pos)
            clock += 1
            if entry in states:
                states[entry] = clock
                states.move_to_end(entry)
                continue
            held = node_states.get(key)
            if held is None:
                node_states[key] = {pos}
            else:
                held.add(pos)
            written += 1
            states[entry] = clock                   # a new key goes to the end (most recent)
        self.clock = clock
        self.states_written += written

    # ---- eviction ---------------------------------------------------------------------------------
    def bytes_by_kind(self) -> dict:
        """``{"kv": bytes, "state": bytes}`` held."""
        return {"kv": self.kv_tokens * self.kv_bytes_per_token, "state": len(self.states) * self.state_bytes}

    def _drop_state(self, entry) -> None:
        del self.states[entry]
        key, pos = entry
        left = self.node_states[key]
        left.discard(pos)
        if not left:
            del self.node_states[key]
            if self.prune:
                self._prune_from(key)
        self.states_evicted += 1

    def _remove_leaf(self, key) -> None:
        node = self.idx.nodes[key]
        positions = self.node_states.pop(key, ())
        for pos in positions:
            del self.states[(key, pos)]
        self.states_evicted += len(positions)
        self.idx.remove_block(node, records=False)
        self.kv_stamp.pop(key, None)
        self.kv_tokens -= node.payload
        self.kv_evicted_tokens += node.payload
        if self.prune and node.parent is not ROOT:
            self._prune_from(node.parent)

    def _prune_from(self, key) -> None:
        """Delete ``key`` and its ancestors while each is a leaf without a state."""
        nodes = self.idx.nodes
        while key is not ROOT and key in nodes and nodes[key].children == 0 and key not in self.node_states:
            parent = nodes[key].parent
            node = nodes[key]
            self.idx.remove_block(node, records=False)
            self.kv_stamp.pop(key, None)
            self.kv_tokens -= node.payload
            self.kv_evicted_tokens += node.payload
            key = parent

    def _oldest_leaf(self):
        entry = next(iter(self.idx.lru), None)     # the index keeps its oldest block a leaf
        return None if entry is None else entry.key

    def evict_to(self, kv_cap: float, state_cap: float) -> None:
        """Evict until KV bytes <= ``kv_cap`` and state bytes <= ``state_cap`` (two pools), or until their
        sum <= ``kv_cap + state_cap`` oldest first (one pool)."""
        kvb, stb = self.kv_bytes_per_token, self.state_bytes
        if self.two_pools:
            while len(self.states) * stb > state_cap:
                self._drop_state(next(iter(self.states)))
            while self.kv_tokens * kvb > kv_cap:
                self._remove_leaf(self._oldest_leaf())
            return
        cap = kv_cap + state_cap
        states, lru, kv_stamp = self.states, self.idx.lru, self.kv_stamp
        while self.kv_tokens * kvb + len(states) * stb > cap:
            head = next(iter(lru), None)              # the index keeps its oldest block a leaf
            st = next(iter(states), None)
            if st is not None and (head is None or states[st] < kv_stamp[head.key]):
                self._drop_state(st)
            else:
                self._remove_leaf(head.key)

    # ---- inspection -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert the invariants (AssertionError names the first broken one): the index's own; payloads in
        (0, N], full under a child; token total; every state anchored on a cached block holding its
        position; state sets equal to the LRU list; with pruning, no stateless leaf."""
        N, nodes = self.block_size, self.idx.nodes
        self.idx.check_integrity()
        assert set(self.kv_stamp) == (set() if self.two_pools else set(nodes)), "KV stamps out of step with the blocks"
        total = 0
        for key, node in nodes.items():
            assert 0 < node.payload <= N, f"block keeps {node.payload} tokens"
            assert node.children == 0 or node.payload == N, "a block with children is kept only in part"
            total += node.payload
            if self.prune and node.children == 0:
                assert key in self.node_states, "a leaf block without a state (SGLang tombstone leaf)"
        assert total == self.kv_tokens, f"KV token counter {self.kv_tokens} != {total}"
        from_sets = {(k, p) for k, ps in self.node_states.items() for p in ps}
        assert from_sets == set(self.states), "state sets out of step with the state LRU list"
        assert all(ps for ps in self.node_states.values()), "empty state set kept"
        for key, pos in self.states:
            node = nodes.get(key)
            assert node is not None, "state on a block that is not cached"
            start = (node.depth - 1) * N
            assert start < pos <= start + node.payload, f"state at {pos} outside its block's kept tokens"


class TreeCounters:
    """The counters :func:`serve.scale.policies.base.replay` reads, for a policy whose cache is a
    :class:`StateTree` held as ``self.tree``: states written and evicted, KV tokens evicted; the tree's
    bytes by kind and integrity check; and its replay, one request at a time (:func:`step_replay`)."""

    tree: StateTree

    def replay_trace(self, requests, budget_bytes: float, check_every: int = 0):
        return step_replay(requests, self, budget_bytes, check_every)

    def bytes_by_kind(self) -> dict:
        return self.tree.bytes_by_kind()

    def check_integrity(self) -> None:
        self.tree.check_integrity()

    @property
    def states_written(self) -> int:
        return self.tree.states_written

    @property
    def states_evicted(self) -> int:
        return self.tree.states_evicted

    @property
    def kv_evicted_tokens(self) -> int:
        return self.tree.kv_evicted_tokens
