"""vLLM's prefix caching for hybrid attention + mamba (KDA) models: ``mamba_cache_mode`` none / align / all.

Sources (vllm-project/vllm):
- block size: ``Platform._align_hybrid_block_size`` (``vllm/platforms/interface.py``; earlier
  ``HybridAttentionMambaModelConfig`` in ``vllm/model_executor/models/config.py``), per layer and TP
  rank. none / align: ``block = align * cdiv(mamba_page, align * attn_page_1_token)`` with
  ``align = max(min kernel block size, cache_config.block_size)`` (:func:`serve.memory.vllm_block.vllm_block_pick`);
  all: ``chunk = lcm(mamba_chunk_size, align)``, ``block = chunk * cdiv(cdiv(mamba_page,
  attn_page_1_token), chunk)``. The mamba page is padded to the attention page. ``mamba_chunk_size`` for
  KDA is taken as the 64-token FLA chunk (not confirmed in vLLM's Kimi-Linear model code).
- KV-cache groups (``_get_kv_cache_groups_uniform_page_size`` in ``vllm/v1/core/kv_cache_utils.py``):
  the layers of each kind are split into groups of ``group_size`` layers, ``group_size`` = the fewest
  layers of one kind (the most, when that is < 1.25 x the fewest); the last group of a kind is padded
  with empty layers. Memory is ``group_size`` tensors, each shared by one layer of every group, so one
  block of any group takes one page in each of them: a state (one block in each mamba group) costs
  ``cdiv(kda_layers, group_size) * group_size`` pages, a KV block ``cdiv(mla_layers, group_size) *
  group_size`` pages (:func:`vllm_group_pages`). Kimi-Linear (7 MLA, 20 KDA layers): group 7, a state
  is 21 pages; Kimi K3 (24 MLA, 69 KDA): group 24, a state is 72 pages.
- lookup: ``MambaManager.find_longest_cache_hit`` (``vllm/v1/core/single_type_kv_cache_manager.py``)
  scans right to left for the deepest block whose mamba state is cached, within the attention hit;
  every lookup is capped at ``num_tokens - 1`` (``get_computed_blocks``); hits are whole blocks.
- align: ``MambaManager.allocate_new_blocks`` keeps one running-state block per prefill chunk and fills
  the blocks in between with null blocks, so only a chunk's final aligned boundary caches a state (PR
  #43628's description of issue #43587); ``Scheduler._mamba_block_aligned_split`` cuts chunks to whole
  blocks with a mandatory stop at ``last_cache_position = L - L % block_size``. **Shared prefix**
  (PR #37898, merged, "Marconi-style admission policy for hybrid cache"; its test
  ``test_hybrid_cache_mamba_align_shared_prefix_detection`` in ``tests/v1/core/test_prefix_caching.py``):
  ``HybridKVCacheCoordinator.find_longest_cache_hit`` sets ``num_uncached_common_prefix_tokens`` =
  attention hit - reconciled (state) hit, and when it is >= one block and the first chunk is longer,
  ``_mamba_block_aligned_split`` ends the first chunk there (floored to the block), so the state where
  the shared prefix ends is cached and the next request sharing it hits it. PR #50409 (open) adds the
  replay boundary ``(L - 1) // block_size * block_size`` as another stop (``replay_stop``), without
  which a prompt of an exact multiple of the block caches its only state at L, where no identical
  prompt can hit it (issue #50235). The running request holds two state blocks (the previous step's,
  copied from, and the current one; ``last_state_block_idx``).
- all: a state is cached for every full block (``cache_blocks`` over the mamba group's blocks). **Not
  available for Kimi models**: ``KimiLinearForCausalLM`` (``vllm/model_executor/models/kimi_linear.py``)
  declares ``HasInnerState, SupportsPP, MixtureOfExperts, IsHybrid`` but not
  ``SupportsMambaPrefixCaching``, so vLLM serves Kimi in align; ``all`` on a Kimi preset is a
  counterfactual (``counterfactual`` is True), kept to show what per-block states would cost.
- none: no prefix caching for the hybrid model; one state slot per running request.

KV bytes are counted at trace-block granularity (the tokens of full vLLM blocks of the prompt); evicting
a KV block drops the states on it (a state without its KV cannot be hit). vLLM's block pool evicts any
freed block in LRU order; here KV blocks go leaves first (the tail is freed first in vLLM too).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kda_core.config import PRESETS
from serve.errors import check_choice, check_int
from serve.memory.vllm_block import vllm_block_pick
from serve.scale.policies.base import ReplicaBytes
from serve.scale.policies.state_tree import StateTree, TreeCounters
from serve.traces.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest

MODES = ("none", "align", "all")
MAMBA_CHUNK = 64
# Presets whose vLLM model class declares SupportsMambaPrefixCaching (needed for mamba_cache_mode="all"):
# none of ours (KimiLinearForCausalLM does not; see the module docstring).
ALL_MODE_PRESETS: frozenset = frozenset()


class GroupPages(NamedTuple):
    """vLLM's KV-cache groups for a hybrid (``_get_kv_cache_groups_uniform_page_size``): ``group_size``
    layers per group; ``state_pages`` pages one sequence's state takes (one block in each mamba group,
    padding included); ``kv_pages`` pages one KV block takes (one block in each attention group)."""

    group_size: int
    state_pages: int
    kv_pages: int


def vllm_group_pages(num_mla_layers: int, num_kda_layers: int) -> GroupPages:
    """The KV-cache grouping of a model with ``num_mla_layers`` attention and ``num_kda_layers`` mamba layers,
    as ``_get_kv_cache_groups_uniform_page_size`` (``vllm/v1/core/kv_cache_utils.py``) does it: group size =
    the fewest layers of one kind, or the most when that is < 1.25 x the fewest; each kind padded up to whole
    groups. Raises ValueError for a count < 1."""
    check_int("num_mla_layers", num_mla_layers)
    check_int("num_kda_layers", num_kda_layers)
    lo, hi = min(num_mla_layers, num_kda_layers), max(num_mla_layers, num_kda_layers)
    g = hi if hi < lo * 1.25 else lo
    return GroupPages(g, -(-num_kda_layers // g) * g, -(-num_mla_layers // g) * g)


def vllm_block_size(preset: str, mode: str, kernel_block_size: int = 64, tp_size: int = 1,
                    mamba_chunk_size: int = MAMBA_CHUNK) -> int:
    """vLLM's attention (and mamba) block size in tokens for ``preset`` under ``mode`` (module docstring)."""
    check_choice("mode", mode, MODES)
    cfg = PRESETS[preset]
    pick = vllm_block_pick(cfg, kernel_block_size, tp_size=tp_size)
    if mode != "all":
        return pick.block_size
    attn_1 = pick.attn_page_bytes // pick.block_size
    chunk = math.lcm(mamba_chunk_size, pick.align)
    tokens_per_state = -(-pick.state_bytes // attn_1)             # cdiv(mamba_page, attn_page_1_token)
    return chunk * -(-tokens_per_state // chunk)


class VLLMMambaPolicy(TreeCounters):
    """One ``mamba_cache_mode`` of vLLM on a real preset and TP size (see the module docstring).

    Args: preset; mode: "none" | "align" | "all"; tp_size: TP ranks of the replica; kernel_block_size:
    the MLA backend's smallest kernel block (FlashMLA 64); max_num_batched_tokens: prefill chunk budget;
    replay_stop: PR #50409's extra mandatory stop (align); block_size: override vLLM's pick (tests);
    trace_block_size: tokens per hash id.
    Bytes: ``state_bytes`` = one state's pages (:func:`vllm_group_pages`, padding included) x one padded
    mamba page (= one attention page of ``block_size`` tokens, one layer) x ``tp_size``; ``kv_bytes_per_token``
    likewise with the attention groups' pages. ``counterfactual``: True for ``all`` on a preset whose vLLM
    model class does not support it (every Kimi preset: vLLM serves them in align).
    Raises ValueError for an unknown mode or non-positive sizes.
    """

    def __init__(self, preset: str, mode: str, tp_size: int = 1, kernel_block_size: int = 64,
                 max_num_batched_tokens: int = 8192, replay_stop: bool = False, block_size: int | None = None,
                 trace_block_size: int = MOONCAKE_BLOCK_TOKENS):
        check_choice("mode", mode, MODES)
        check_int("max_num_batched_tokens", max_num_batched_tokens)
        self.replica = ReplicaBytes.for_preset(preset, tp_size)
        cfg = PRESETS[preset]
        B = block_size if block_size is not None else vllm_block_size(preset, mode, kernel_block_size, tp_size)
        check_int("block_size", B)
        self.mode, self.vllm_block, self.replay_stop = mode, B, replay_stop
        self.max_num_batched_tokens = max_num_batched_tokens
        self.name = f"vllm {mode}" + (" +replay stop" if replay_stop else "")
        self.running_state_slots = 1 if mode == "none" else 2
        self.counterfactual = mode == "all" and preset not in ALL_MODE_PRESETS
        self.groups = vllm_group_pages(cfg.num_mla_layers, cfg.num_kda_layers)
        latent_bytes = cfg.latent_dim * torch.empty((), dtype=torch.bfloat16).element_size()  # one token, one layer
        attn_page = B * latent_bytes                                   # one page: one layer, one rank
        self.state_bytes = self.groups.state_pages * attn_page * tp_size      # padded mamba pages, all ranks
        self.kv_bytes_per_token = self.groups.kv_pages * latent_bytes * tp_size  # latent replicated per rank
        self.block_size = check_int("trace_block_size", trace_block_size)
        self.tree = StateTree(trace_block_size, self.kv_bytes_per_token, self.state_bytes,
                              two_pools=False, prune_stateless_leaves=False)
        self._last: tuple = (None, 0, 0)

    def lookup(self, r: TraceRequest) -> tuple[int, int]:
        """(hit, KV-reusable tokens): whole vLLM blocks within min(cached KV, L - 1); the hit is the deepest
        of them with a cached state. Pure."""
        if self._last[0] is r:
            return self._last[1], self._last[2]
        if self.mode == "none":
            return 0, 0
        ids, L, B = r.hash_ids, r.input_length, self.vllm_block
        kv = min(self.tree.shared_tokens(ids, L), max(L - 1, 0)) // B * B
        hit = self.tree.deepest_state(ids, kv)
        self._last = (r, hit, kv)
        return hit, kv

    def state_positions(self, hit: int, L: int, kv: int | None = None) -> list[int]:
        """Where a prefill of L tokens from ``hit`` caches states (ascending). ``kv``: the attention hit
        (whole blocks, <= L - 1; None = ``hit``): in align mode, when it passes the state hit by at least one
        block, the first chunk ends at it (PR #37898's shared-prefix cut, ``num_uncached_common_prefix_tokens``
        = kv - hit), so a state is cached where the shared prefix ends."""
        B = self.vllm_block
        last = L - L % B                                          # last_cache_position
        if self.mode == "all":
            return list(range(hit + B, last + 1, B))
        if self.mode == "none":
            return []
        stops = {last}
        if self.replay_stop:
            stops.add(min((L - 1) // B * B, last))
        common = 0 if kv is None else kv - hit                    # num_uncached_common_prefix_tokens
        step = max(self.max_num_batched_tokens // B, 1) * B       # whole blocks per chunk
        out, s = [], hit
        while s < L:
            e = min(s + step, L)
            e = min([e] + [p for p in stops if s < p < e])
            if s == hit and common >= B and e - s > common:       # the first chunk stops at the shared prefix
                e = s + common // B * B
            if e % B == 0 and e <= last:
                out.append(e)
            s = e
        return out

    def admit(self, r: TraceRequest, hit: int) -> None:
        """Cache the KV of the prompt's full vLLM blocks and the states at :meth:`state_positions`."""
        if self.mode == "none":
            return
        hit_now, kv = self.lookup(r)
        ids, L, B = r.hash_ids, r.input_length, self.vllm_block
        tree = self.tree
        tree.touch(ids, hit_now, hit_now)
        last = L - L % B
        self._last = (None, 0, 0)                          # the cache changes: forget the memo
        if last:
            tree.insert_kv(ids, L, last)
        tree.add_states(ids, self.state_positions(hit_now, L, kv))

    def evict_to(self, cache_bytes: float) -> None:
        """One block pool: the older of the KV and state LRU heads goes first."""
        self._last = (None, 0, 0)
        self.tree.evict_to(cache_bytes, 0.0)

    def check_integrity(self) -> None:
        self.tree.check_integrity()
        B = self.vllm_block
        assert all(pos % B == 0 for _, pos in self.tree.states), "a vLLM state off its block grid"
