"""SGLang's ``MambaRadixCache`` for hybrid (linear-attention + full-attention) models, two strategies.

Sources (sgl-project/sglang):
- ``python/sglang/srt/mem_cache/mamba_radix_cache.py``: ``_match_prefix_helper`` (the hit is the
  deepest node on the matched path that holds a mamba value); ``_match_post_processor`` (the
  *branching point* ``mamba_branching_seqlen`` = matched KV length floored to
  ``mamba_cache_chunk_size`` when the KV match is longer than the state match); ``_split_node`` (a
  split node has no state: a tombstone); ``cache_finished_req`` / ``cache_unfinished_req`` (no_buffer:
  the request's state is copied in at the request end and at each chunk end; extra_buffer: only
  ``mamba_last_track_seqlen`` tokens are cached, the KV beyond is freed); two LRU lists
  (``full_lru_list``, ``mamba_lru_list``), ``evict_mamba`` (an internal node becomes a tombstone, a
  leaf is deleted) and ``_iteratively_delete_tombstone_leaf``; no_buffer asserts ``page_size == 1``.
- ``python/sglang/srt/managers/schedule_batch.py`` ``_mamba_radix_cache_v2_req_prepare_for_extend``
  (extra_buffer, PR #14792): each prefill extend tracks one state, at
  ``prefix + floor(extend / mamba_cache_chunk_size) * mamba_cache_chunk_size`` when the extend has at
  least one chunk, or at the branching point instead when it lies inside the extend on the chunk grid;
  ping-pong track slots (``mamba_ping_pong_track_buffer``, two per request) beside the working slot;
  in decode a state is tracked every ``mamba_track_interval`` tokens (default 256, a multiple of the
  page size), which a prompt-only replay never reaches (outputs are not modelled, see
  :mod:`serve.scale.policies.base`).
- Server-args defaults seen in public launch logs: ``mamba_scheduler_strategy='no_buffer'``,
  ``mamba_track_interval=256``, ``mamba_full_memory_ratio=0.9``; ``mamba_cache_chunk_size`` = 64 (the
  FLA chunk). The lookup cap of ``len(prompt) - 1`` tokens is ``Req._compute_max_prefix_len``.

Branching-point caching is an ``extra_buffer`` feature: SGLang PR #14792 ("support branching point
caching ... enable with --mamba-scheduler-strategy extra_buffer"); in ``no_buffer`` the match still computes
``mamba_branching_seqlen`` but only extra_buffer's extend (``_mamba_radix_cache_v2_req_prepare_for_extend``)
consumes it. So :class:`SGLangNoBuffer` caches no state at the branching point; ``branch_split=True`` is a
**what-if** (no_buffer as if its scheduler ended a chunk there), off by default and named so.

Not confirmed in the code read (stated, not invented): how ``mamba_full_memory_ratio`` splits the memory
(modelled as state pool : KV pool = ratio : 1).
"""
from __future__ import annotations

import math

from serve.errors import check_int, check_positive
from serve.scale.policies.base import ReplicaBytes, running_bytes
from serve.scale.policies.state_tree import StateTree, TreeCounters
from serve.traces.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest

FLA_CHUNK = 64            # mamba_cache_chunk_size
MAMBA_FULL_MEMORY_RATIO = 0.9


class _SGLangBase(TreeCounters):
    """Shared by both strategies: page size 1 (token positions), two pools, tombstone-leaf pruning."""

    name = ""
    running_state_slots = 1

    def __init__(self, replica: ReplicaBytes, block_size: int = MOONCAKE_BLOCK_TOKENS,
                 chunked_prefill_size: int = 8192, chunk: int = FLA_CHUNK,
                 mamba_full_memory_ratio: float = MAMBA_FULL_MEMORY_RATIO):
        check_int("chunked_prefill_size", chunked_prefill_size)
        check_int("chunk", chunk)
        if chunked_prefill_size % chunk:
            raise ValueError(f"chunked_prefill_size must be a multiple of chunk={chunk}, got {chunked_prefill_size}")
        check_positive("mamba_full_memory_ratio", mamba_full_memory_ratio)
        if not math.isfinite(mamba_full_memory_ratio):
            raise ValueError(f"mamba_full_memory_ratio must be a finite number > 0, got {mamba_full_memory_ratio!r}")
        check_int("block_size", block_size)
        self.replica, self.block_size = replica, block_size
        self.state_bytes = replica.state_bytes              # one state slot (SGLang's mamba pool is unpadded)
        self.chunked_prefill_size, self.chunk = chunked_prefill_size, chunk
        self.state_share = mamba_full_memory_ratio / (1 + mamba_full_memory_ratio)
        self.tree = StateTree(block_size, replica.kv_bytes_per_token, replica.state_bytes,
                              two_pools=True, prune_stateless_leaves=True)
        self._last: tuple = (None, 0, 0)

    def _match(self, r: TraceRequest) -> tuple[int, int]:
        """(hit, matched KV tokens M): M = cached KV capped at L - 1; hit = deepest state <= M."""
        if self._last[0] is r:
            return self._last[1], self._last[2]
        ids, L = r.hash_ids, r.input_length
        M = min(self.tree.shared_tokens(ids, L), max(L - 1, 0))
        hit = self.tree.deepest_state(ids, M)
        self._last = (r, hit, M)
        return hit, M

    def lookup(self, r: TraceRequest) -> tuple[int, int]:
        """(hit tokens, KV-reusable tokens M) of a prompt; pure."""
        return self._match(r)

    def branching_point(self, hit: int, matched: int) -> int | None:
        """``mamba_branching_seqlen``: M floored to the chunk when the KV match is longer than the hit."""
        if matched <= hit:
            return None
        b = matched // self.chunk * self.chunk
        return b if b > 0 else None

    def evict_to(self, cache_bytes: float) -> None:
        """Two pools: the state pool holds ``ratio / (1 + ratio)`` of the budget minus the running request's
        slots (taken out by :func:`replay`), the KV pool the rest."""
        running = running_bytes(self)
        total = cache_bytes + running
        state_cap = max(total * self.state_share - running, 0.0)
        self._last = (None, 0, 0)
        self.tree.evict_to(cache_bytes - state_cap, state_cap)


class SGLangNoBuffer(_SGLangBase):
    """SGLang ``--mamba-scheduler-strategy no_buffer`` (``MambaRadixCache`` v1, page size 1).

    After a request: KV of the whole prompt; a state at each prefill chunk end (``chunked_prefill_size``
    tokens from the hit, ``cache_unfinished_req`` copies the working state into a new slot) and at the
    request end (``cache_finished_req`` donates the working slot). No state at the branching point (that is
    extra_buffer's feature, module docstring). ``branch_split=True`` is a what-if, not SGLang: a chunk also
    ends at the branching point, which caches a state there for the next request (name "sglang no_buffer
    +branch split (what-if)"). One working slot per running request. On a chat trace the request-end state is
    what the next turn hits in SGLang (its prompt repeats this prompt + output); a prompt-only replay puts that
    state at this prompt's end, which the next turn's block-level match seldom reaches, so the replay's
    no_buffer hits are a lower bound there (:mod:`serve.scale.policies.base`: outputs are not modelled).
    """

    running_state_slots = 1

    def __init__(self, replica: ReplicaBytes, branch_split: bool = False, **kw):
        super().__init__(replica, **kw)
        if not isinstance(branch_split, bool):
            raise ValueError(f"branch_split must be True or False, got {branch_split!r}")
        self.branch_split = branch_split
        self.name = "sglang no_buffer" + (" +branch split (what-if)" if branch_split else "")

    def admit(self, r: TraceRequest, hit: int) -> None:
        """Cache the prompt's KV and the states described in the class docstring."""
        hit_now, M = self._match(r)
        ids, L = r.hash_ids, r.input_length
        tree = self.tree
        tree.touch(ids, M, hit_now)
        stops = set()
        start = hit_now
        b = self.branching_point(hit_now, M) if self.branch_split else None
        if b is not None and b > hit_now:
            stops.add(b)
            start = b
        stops.update(range(start + self.chunked_prefill_size, L, self.chunked_prefill_size))
        if L:
            stops.add(L)
        tree.insert_kv(ids, L, L)
        tree.add_states(ids, sorted(stops))
        self._last = (None, 0, 0)                      # the cache changed: forget the memo


class SGLangExtraBuffer(_SGLangBase):
    """SGLang ``--mamba-scheduler-strategy extra_buffer`` (``MambaRadixCache`` v2, PR #14792).

    Each prefill extend (one chunk of ``chunked_prefill_size``) tracks one state into a ping-pong slot: at
    the extend's last chunk-aligned position, or at the branching point when it falls inside the extend on
    the chunk grid. After the request only the last tracked length is cached (KV beyond it is freed) with
    its state; earlier chunks cached theirs at their chunk end (``cache_unfinished_req``). An extend
    shorter than one chunk tracks nothing. Running slots: the working slot + 2 ping-pong track slots.
    """

    name = "sglang extra_buffer"
    running_state_slots = 3

    def admit(self, r: TraceRequest, hit: int) -> None:
        """Cache the tracked states and the KV up to the last one."""
        hit_now, M = self._match(r)
        ids, L = r.hash_ids, r.input_length
        tree, c, S = self.tree, self.chunk, self.chunked_prefill_size
        tree.touch(ids, M, hit_now)
        b = self.branching_point(hit_now, M)
        tracked = []
        s = hit_now
        while s < L:
            e = min(s + S, L)
            ext = e - s
            if ext >= c:                                   # mamba_track_mask
                t = s + ext // c * c
                if b is not None and s < b < e and (b - s) % c == 0:
                    t = b                                  # the branching point replaces the extend end
                tracked.append(t)
            s = e
        self._last = (None, 0, 0)
        if not tracked:
            return
        tree.insert_kv(ids, L, max(tracked))
        tree.add_states(ids, tracked)
