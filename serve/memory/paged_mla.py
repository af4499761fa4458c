"""``PagedMLACache``: one request's MLA latent KV in pool pages, addressed through a page table.

Logical block i of a request (tokens ``[i * block_size, (i + 1) * block_size)``) lives in physical
MLA_KV page ``block_table[i]``; each page holds that block for every MLA layer, laid out
``[num_mla_layers, block_size, r + rope]`` (r = kv_lora_rank). :meth:`PagedMLACache.gather` rebuilds
the contiguous latents with one ``index_select`` per layer; :func:`paged_latent_attention` reads the
pages block by block with an online softmax (FlashMLA / PagedAttention style) without gathering.
Prefix sharing is by reference count (:meth:`PagedMLACache.fork`); a shared last, partial block is
copied on write before an append.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from serve.memory.pool import PageError, PageKind, PagePool, PoolExhausted


class PagedMLACache:
    """Per-request paged latent cache.

    Args:
        pool: the :class:`PagePool`. owner: who holds this request's page references.
        num_layers: MLA layers Lm. latent_dim: r + rope (D). block_size: tokens per page (> 0).
        dtype: element type of the latents (fp32 for bitwise equality with the demo model).
    Raises ValueError on non-positive sizes and PageError if ``[Lm, block_size, D]`` does not fit or
    align with the pool's pages. Nothing is allocated until :meth:`append`.

    Half-open token ranges: ``[0, num_tokens)`` are written; block i covers
    ``[i * block_size, min((i + 1) * block_size, num_tokens))``; ``[num_tokens, len(block_table) *
    block_size)`` is allocated but unwritten (NaN in a poisoned pool).
    """

    def __init__(self, pool: PagePool, owner: Hashable, num_layers: int, latent_dim: int, block_size: int,
                 dtype: torch.dtype = torch.float32):
        for name, val in (("num_layers", num_layers), ("latent_dim", latent_dim), ("block_size", block_size)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if owner is None:
            raise ValueError("owner must not be None")
        self.pool, self.owner, self.dtype = pool, owner, dtype
        self.num_layers, self.latent_dim, self.block_size = num_layers, latent_dim, block_size
        self.page_shape = (num_layers, block_size, latent_dim)             # [Lm, block_size, D]
        self._arena = pool.typed_arena(dtype, self.page_shape)            # [num_pages, Lm, block_size, D]
        self._layer_arena = tuple(self._arena[:, i] for i in range(num_layers))  # each [num_pages, bs, D]
        self._table_cache: tuple[list[int], torch.Tensor] | None = None
        self.block_table: list[int] = []
        self.num_tokens = 0

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def token_bytes(self) -> int:
        """Latent bytes per token, all MLA layers: Lm * D * itemsize."""
        return self.num_layers * self.latent_dim * self._arena.element_size()

    @property
    def num_blocks(self) -> int:
        return len(self.block_table)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def internal_fragmentation_bytes(self) -> int:
        """Allocated but unused bytes: unwritten slots of the last block + each page's bytes past the block."""
        slots = self.num_blocks * self.block_size - self.num_tokens
        per_page_spare = self.pool.page_bytes - self.block_size * self.token_bytes
        return slots * self.token_bytes + self.num_blocks * per_page_spare

    # ---- writes -----------------------------------------------------------------------------------
    def append(self, latents: torch.Tensor) -> None:
        """Append T tokens of latents ``[Lm, T, D]`` (dtype converted to ``self.dtype``).

        Mutates: pool pages (new blocks allocated all-or-nothing; a shared partial last block copied on
        write first) and ``block_table`` / ``num_tokens``. Raises ValueError on a wrong shape and
        PoolExhausted when pages run out -- then nothing changes.
        """
        if not isinstance(latents, torch.Tensor) or latents.dim() != 3 or \
                latents.shape[0] != self.num_layers or latents.shape[2] != self.latent_dim:
            got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise ValueError(f"latents must have shape [Lm, T, D] = [{self.num_layers}, T, {self.latent_dim}], got {got}")
        T, bs = latents.shape[1], self.block_size
        if T == 0:
            return
        start, end = self.num_tokens, self.num_tokens + T
        new_blocks = self.blocks_for(end) - self.num_blocks
        partial = start % bs != 0                         # the last block already holds tokens
        shared_tail = partial and self.pool.refcount(self.block_table[-1]) > 1
        if new_blocks + shared_tail > self.pool.num_free:  # check before mutating: all-or-nothing
            raise PoolExhausted(PageKind.MLA_KV, new_blocks + shared_tail, self.pool.num_free)
        if shared_tail:
            self.block_table[-1] = self.pool.copy_on_write(self.block_table[-1], self.owner)
        self.block_table += self.pool.alloc(PageKind.MLA_KV, new_blocks, self.owner)
        pos = torch.arange(start, end)                                    # [T] token positions
        pages = self.table_tensor()[pos // bs]                            # [T] physical page per token
        self._arena[pages, :, pos % bs] = latents.to(self.dtype).transpose(0, 1)  # [T, Lm, D] in one scatter
        self.num_tokens = end

    # ---- reads ------------------------------------------------------------------------------------
    def table_tensor(self) -> torch.Tensor:
        """The page table as an int64 tensor ``[num_blocks]`` (rebuilt only when the table changed)."""
        if self._table_cache is None or self._table_cache[0] != self.block_table:
            self._table_cache = (list(self.block_table), torch.tensor(self.block_table, dtype=torch.long))
        return self._table_cache[1]

    def gather(self, layer: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Contiguous latents rebuilt from the pages with ``index_select`` (a copy).

        Returns ``[num_tokens, D]`` for MLA layer index ``layer`` (0-based among MLA layers), or
        ``[Lm, num_tokens, D]`` for all layers when ``layer`` is None. ``out`` (single layer only): a
        preallocated ``[num_blocks, block_size, D]`` buffer to gather into (no allocation); the result
        is then a view of it. Raises ValueError for a bad layer or ``out`` shape.
        """
        idx = self.table_tensor()
        if layer is None:
            if out is not None:
                raise ValueError("out is only supported with a single layer")
            full = self._arena.index_select(0, idx)                      # [NB, Lm, bs, D]
            full = full.transpose(0, 1).reshape(self.num_layers, -1, self.latent_dim)  # [Lm, NB * bs, D]
            return full[:, : self.num_tokens]
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        if out is None:
            out = self._layer_arena[layer].index_select(0, idx)          # [NB, bs, D]
        elif tuple(out.shape) != (self.num_blocks, self.block_size, self.latent_dim) or out.dtype != self.dtype:
            raise ValueError(f"out must be [{self.num_blocks}, {self.block_size}, {self.latent_dim}] "
                             f"{self.dtype}, got {tuple(out.shape)} {out.dtype}")
        else:
            torch.index_select(self._layer_arena[layer], 0, idx, out=out)  # [NB, bs, D]
        return out.view(-1, self.latent_dim)[: self.num_tokens]          # [num_tokens, D]

    def block_view(self, block: int) -> torch.Tensor:
        """In-place view of logical block ``block``: ``[Lm, block_size, D]`` (no copy)."""
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block must be in [0, {self.num_blocks}), got {block}")
        return self._arena[self.block_table[block]]

    # ---- sharing and release ----------------------------------------------------------------------
    def fork(self, new_owner: Hashable, num_tokens: int | None = None) -> PagedMLACache:
        """A cache for ``new_owner`` sharing the pages of the first ``num_tokens`` tokens (default all)
        by reference count. No bytes are copied; the child's first append into a shared partial block
        copies that block. Raises ValueError if num_tokens is out of range."""
        n = self.num_tokens if num_tokens is None else num_tokens
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"num_tokens must be in [0, {self.num_tokens}], got {num_tokens}")
        child = PagedMLACache(self.pool, new_owner, self.num_layers, self.latent_dim, self.block_size, self.dtype)
        child.block_table = self.pool.fork(self.block_table[: self.blocks_for(n)], new_owner)
        child.num_tokens = n
        return child

    @classmethod
    def from_pages(cls, pool: PagePool, owner: Hashable, pages: Sequence[int], num_tokens: int,
                   num_layers: int, latent_dim: int, block_size: int,
                   dtype: torch.dtype = torch.float32) -> PagedMLACache:
        """A cache for ``owner`` over existing pages (e.g. prefix-cache hits), taking one reference on
        each. Requires ``len(pages) == ceil(num_tokens / block_size)``; raises ValueError otherwise and
        PageError if a page is free or not MLA_KV."""
        cache = cls(pool, owner, num_layers, latent_dim, block_size, dtype)
        if len(pages) != cache.blocks_for(num_tokens):
            raise ValueError(f"{num_tokens} tokens need {cache.blocks_for(num_tokens)} pages, got {len(pages)}")
        for p in pages:
            if pool.kind(p) is not PageKind.MLA_KV:
                raise PageError(f"page {p} is {pool.kind(p).name}, expected MLA_KV")
        cache.block_table = pool.fork(pages, owner)
        cache.num_tokens = num_tokens
        return cache

    def free(self) -> None:
        """Drop this request's reference to every page; shared pages stay alive for their other holders."""
        self.pool.decref(self.block_table, self.owner)
        self.block_table, self.num_tokens = [], 0

    def check_integrity(self) -> None:
        """Assert: one page per started block, every page MLA_KV and held by ``owner``."""
        assert self.num_blocks == self.blocks_for(self.num_tokens), \
            f"{self.num_blocks} blocks for {self.num_tokens} tokens of block size {self.block_size}"
        for p in self.block_table:
            assert self.pool.kind(p) is PageKind.MLA_KV, f"page {p} is {self.pool.kind(p).name}"
            assert self.pool.holders(p).get(self.owner, 0) > 0, f"page {p} not held by {self.owner!r}"


def paged_latent_attention(q_cat: torch.Tensor, cache: PagedMLACache, layer: int, kv_lora_rank: int,
                           scale: float) -> torch.Tensor:
    """Absorbed MLA decode over paged latents, block by block with an online softmax (no gather).

    q_cat ``[Hm, r + rope]`` fp32 (q_nope absorbed into the latent space, then q_rope); reads the
    ``cache`` pages of MLA layer ``layer`` in place. Returns ``[Hm, r]`` =
    ``softmax(q . c_j * scale) @ c_j[:r]`` over the ``num_tokens`` cached latents; equal to the
    contiguous form up to fp32 rounding of the rescaled partial sums (the FlashAttention recurrence:
    ``m' = max(m, max_j s_j)``, ``l' = l e^{m - m'} + sum_j e^{s_j - m'}``, ``acc' = acc e^{m - m'} + P V``).
    Raises ValueError on an empty cache.
    """
    if cache.num_tokens == 0:
        raise ValueError("paged_latent_attention needs at least one cached token")
    Hm = q_cat.shape[0]
    m = torch.full((Hm, 1), -math.inf)
    l_sum = torch.zeros(Hm, 1)
    acc = torch.zeros(Hm, kv_lora_rank)
    for blk in range(cache.num_blocks):
        n = min(cache.block_size, cache.num_tokens - blk * cache.block_size)
        c = cache.block_view(blk)[layer, :n]                              # [n, r + rope] (in place)
        s = (q_cat @ c.T) * scale                                         # [Hm, n]
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))                # [Hm, 1]
        p = torch.exp(s - m_new)                                          # [Hm, n]
        alpha = torch.exp(m - m_new)                                      # [Hm, 1]
        l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + p @ c[:, :kv_lora_rank]                       # [Hm, r]
        m = m_new
    return acc / l_sum
