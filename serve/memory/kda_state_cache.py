"""``KDAStateCache``: one request's KDA recurrent and conv states in KDA_STATE pool pages.

Per group (a set of KDA layers whose states travel together, :func:`serve.memory.page_policy.kda_groups`)
the states are packed back to back, 16-byte aligned, layer by layer: recurrent ``[H, K, V]`` then
conv ``[2HK + HV, W-1]``. A group fits one page under the unified page-size policy -- then
:meth:`KDAStateCache.read` returns views *into the pool* and decode runs against the pool -- or spans
``ceil(group_bytes / page_bytes)`` pages under the multi-page policy, where a tensor that straddles
pages is read by concatenating the page slices (a copy) and written back slice by slice.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch

from kda_core.config import ModelConfig
from kda_core.layer import KDACache
from serve.memory.page_policy import kda_groups
from serve.memory.pool import PageKind, PagePool

ALIGN_BYTES = 16


class StateSlot(NamedTuple):
    """Where one state tensor sits in its group's bytes: byte offset, shape (no batch dim), dtype."""

    offset_bytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _align(x: int) -> int:
    return -(-x // ALIGN_BYTES) * ALIGN_BYTES


class KDAStateCache:
    """Per-request KDA state pages: ``pages[g]`` are group g's KDA_STATE pages.

    Args:
        pool: the :class:`PagePool`. owner: holder of the page references. cfg: the model config.
        groups: KDA layer indices per group (default: one group of every KDA layer).
        state_dtype / conv_dtype: stored dtypes (fp32 keeps decode bitwise equal to plain tensors).
    Allocates every group's pages in one all-or-nothing call (raises PoolExhausted, nothing held).
    The pages hold no valid state until written (NaN in a poisoned pool).
    Raises ValueError if ``groups`` is not a partition of a subset of ``cfg.kda_layers``.
    """

    def __init__(self, pool: PagePool, owner: Hashable, cfg: ModelConfig,
                 groups: Sequence[Sequence[int]] | None = None,
                 state_dtype: torch.dtype = torch.float32, conv_dtype: torch.dtype = torch.float32):
        groups = kda_groups(cfg, 1) if groups is None else tuple(tuple(g) for g in groups)
        flat = [i for g in groups for i in g]
        if not groups or any(not g for g in groups) or len(set(flat)) != len(flat) or \
                any(i not in cfg.kda_layers for i in flat):
            raise ValueError(f"groups must be non-empty disjoint sets of KDA layers {cfg.kda_layers}, got {groups}")
        self.pool, self.owner, self.cfg, self.groups = pool, owner, cfg, groups
        H, K, V = cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
        self.slots: dict[int, tuple[StateSlot, StateSlot]] = {}
        self.group_of: dict[int, int] = {}
        self.group_bytes: list[int] = []
        for g, layers in enumerate(groups):
            off = 0
            for i in layers:
                rec = StateSlot(off, (H, K, V), state_dtype)
                conv = StateSlot(_align(off + rec.nbytes), (cfg.conv_dim, cfg.conv_kernel - 1), conv_dtype)
                self.slots[i], self.group_of[i] = (rec, conv), g
                off = _align(conv.offset_bytes + conv.nbytes)
            self.group_bytes.append(off)
        self.pages_per_group = [-(-b // pool.page_bytes) for b in self.group_bytes]
        flat_pages = pool.alloc(PageKind.KDA_STATE, sum(self.pages_per_group), owner)
        self.pages: list[list[int]] = []
        for n in self.pages_per_group:
            self.pages.append(flat_pages[:n])
            flat_pages = flat_pages[n:]

    @property
    def in_place(self) -> bool:
        """True when every group fits one page, so :meth:`read` returns views into the pool."""
        return all(n == 1 for n in self.pages_per_group)

    @property
    def num_pages(self) -> int:
        return sum(self.pages_per_group)

    def waste_bytes(self) -> int:
        """Allocated but unused bytes over all groups (padding / tail of the last page)."""
        return self.num_pages * self.pool.page_bytes - sum(self.group_bytes)

    def _pieces(self, g: int, slot: StateSlot):
        """(page, start, end) byte ranges covering ``slot`` in group g's pages, in order."""
        pb, start, end = self.pool.page_bytes, slot.offset_bytes, slot.offset_bytes + slot.nbytes
        while start < end:
            k, off = divmod(start, pb)
            n = min(pb - off, end - start)
            yield self.pages[g][k], off, off + n
            start += n

    def _tensor(self, layer: int, which: int) -> torch.Tensor:
        if layer not in self.slots:
            raise ValueError(f"layer {layer} is not a KDA layer of this cache (layers {sorted(self.slots)})")
        g, slot = self.group_of[layer], self.slots[layer][which]
        pieces = list(self._pieces(g, slot))
        if len(pieces) == 1:                      # in place: a typed view of the page bytes
            page, a, _ = pieces[0]
            return self.pool.view(page, slot.dtype, slot.shape, offset_bytes=a)
        raw = torch.cat([self.pool.arena[p, a:b] for p, a, b in pieces])  # [nbytes] uint8 (a copy)
        return raw.view(slot.dtype).view(slot.shape)

    def read(self, layer: int) -> KDACache:
        """Layer ``layer``'s state as a :class:`KDACache` (recurrent ``[1, H, K, V]``, conv ``[1, C, W-1]``).

        Tensors are views into the pool when the slot lies in one page (they change when the pool is
        written), otherwise copies. Raises ValueError for a layer outside the cache's groups.
        """
        return KDACache(self._tensor(layer, 0).unsqueeze(0), self._tensor(layer, 1).unsqueeze(0))

    def write(self, layer: int, cache: KDACache) -> None:
        """Write ``cache`` (recurrent ``[1, H, K, V]``, conv ``[1, C, W-1]``, converted to the stored
        dtypes) into layer ``layer``'s slots. Mutates the pool pages only. Raises ValueError on shapes."""
        for which, src in enumerate((cache.recurrent, cache.conv)):
            slot = self.slots[layer][which] if layer in self.slots else None
            if slot is None or tuple(src.shape) != (1, *slot.shape):
                want = "unknown layer" if slot is None else (1, *slot.shape)
                raise ValueError(f"layer {layer}: state {which} must have shape {want}, got {tuple(src.shape)}")
            flat = src.reshape(-1).to(slot.dtype).view(torch.uint8)       # [nbytes] uint8
            pos = 0
            for p, a, b in self._pieces(self.group_of[layer], slot):
                self.pool.arena[p, a:b].copy_(flat[pos: pos + b - a])
                pos += b - a

    def copy_from(self, other: KDAStateCache, groups: Sequence[int] | None = None) -> None:
        """Copy the bytes of ``other``'s groups (default all) into this cache's pages (restore a
        checkpoint into private pages). Raises ValueError if the layouts differ."""
        if other.groups != self.groups or other.slots != self.slots or other.pool is not self.pool:
            raise ValueError("copy_from needs a cache with the same pool, groups and slot layout")
        for g in range(len(self.groups)) if groups is None else groups:
            for src, dst in zip(other.pages[g], self.pages[g]):
                self.pool.copy_page(src, dst)

    def clone(self, new_owner: Hashable) -> KDAStateCache:
        """A new cache for ``new_owner`` with freshly allocated pages holding a copy of these states
        (a checkpoint snapshot). Raises PoolExhausted (nothing allocated) when pages run out."""
        dtypes = next(iter(self.slots.values()))
        twin = KDAStateCache(self.pool, new_owner, self.cfg, self.groups, dtypes[0].dtype, dtypes[1].dtype)
        twin.copy_from(self)
        return twin

    def free(self) -> None:
        """Drop this cache's reference to every page."""
        self.pool.decref([p for pages in self.pages for p in pages], self.owner)
        self.pages = [[] for _ in self.groups]

    def check_integrity(self) -> None:
        """Assert: each live group has its page count, every page KDA_STATE and held by ``owner``."""
        for g, pages in enumerate(self.pages):
            assert len(pages) in (0, self.pages_per_group[g]), f"group {g}: {len(pages)} pages"
            for p in pages:
                assert self.pool.kind(p) is PageKind.KDA_STATE, f"page {p} is {self.pool.kind(p).name}"
                assert self.pool.holders(p).get(self.owner, 0) > 0, f"page {p} not held by {self.owner!r}"
