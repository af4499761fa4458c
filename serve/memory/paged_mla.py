"""``PagedMLACache``: one request's page table of MLA_KV blocks, with prefix sharing by reference count.

The bytes are laid out by :class:`serve.memory.layout.CacheLayout` (one ``[M, N, r + rope]`` fp32 block
per page) and moved by :func:`serve.memory.pages.write_kv` / :func:`serve.memory.pages.read_kv`, the
engine's own functions; this class adds what a request's table needs around them: allocation on
append, a fork that shares blocks by reference count (vLLM PagedAttention, Kwon et al., SOSP 2023),
copy-on-write of a shared partial last block, and release.

Half-open token ranges: ``[0, num_tokens)`` are written; block i covers
``[i N, min((i + 1) N, num_tokens))``; ``[num_tokens, len(block_table) N)`` is allocated but
unwritten (NaN in a poisoned pool).
"""
from __future__ import annotations

from collections.abc import Hashable

import torch

from serve.memory.layout import CacheLayout
from serve.memory.pages import read_kv, write_kv
from serve.memory.pool import PageKind, PagePool, PoolExhausted


class PagedMLACache:
    """Per-request paged latent cache.

    Args: layout: the :class:`CacheLayout` (fp32 latents, ``page_bytes`` equal to the pool's); pool: the
    :class:`PagePool`; owner: who holds this request's page references (not None).
    Raises ValueError for a None owner or a layout that does not match the pool. Nothing is
    allocated until :meth:`append`.
    """

    def __init__(self, layout: CacheLayout, pool: PagePool, owner: Hashable):
        if owner is None:
            raise ValueError("owner must not be None")
        if layout.kv_dtype != torch.float32 or layout.page_bytes != pool.page_bytes:
            raise ValueError(f"layout must be fp32 with the pool's page_bytes {pool.page_bytes}, got "
                             f"{layout.kv_dtype} and {layout.page_bytes}")
        self.layout, self.pool, self.owner = layout, pool, owner
        self.block_table: list[int] = []
        self.num_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_table)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy: ceil(num_tokens / N)."""
        return -(-num_tokens // self.layout.block_size)

    def append(self, latents: torch.Tensor) -> None:
        """Append T tokens of latents ``[M, T, r + rope]`` (converted to fp32).

        Mutates: pool pages (new blocks allocated all-or-nothing; a shared partial last block copied on
        write first), ``block_table`` and ``num_tokens``. Raises ValueError on a wrong shape and
        PoolExhausted when pages run out -- then nothing changes.
        """
        M, N, R = self.layout.kv_block_shape
        if not isinstance(latents, torch.Tensor) or latents.dim() != 3 or latents.shape[0] != M \
                or latents.shape[2] != R:
            got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise ValueError(f"latents must have shape [M, T, r + rope] = [{M}, T, {R}], got {got}")
        T = latents.shape[1]
        if T == 0:
            return
        start = self.num_tokens
        new_blocks = self.blocks_for(start + T) - self.num_blocks
        shared_tail = start % N != 0 and self.pool.refcount(self.block_table[-1]) > 1
        if new_blocks + shared_tail > self.pool.num_free:  # check before mutating: all-or-nothing
            raise PoolExhausted(PageKind.MLA_KV, new_blocks + shared_tail, self.pool.num_free)
        if shared_tail:
            self.block_table[-1] = self.pool.copy_on_write(self.block_table[-1], self.owner)
        self.block_table += self.pool.alloc(PageKind.MLA_KV, new_blocks, self.owner)
        lat = latents.to(torch.float32)
        write_kv(self.layout, self.pool, self.block_table, start, [lat[m: m + 1] for m in range(M)])
        self.num_tokens = start + T

    def gather(self) -> list[torch.Tensor]:
        """The latents, per MLA layer ``[1, num_tokens, r + rope]`` fp32: :func:`serve.memory.pages.read_kv`
        over this table (one index over the page table, a copy)."""
        return read_kv(self.layout, self.pool, self.block_table, self.num_tokens)

    def fork(self, new_owner: Hashable, num_tokens: int | None = None) -> PagedMLACache:
        """A cache for ``new_owner`` sharing the pages of the first ``num_tokens`` tokens (default all)
        by reference count. No bytes are copied; the child's first append into a shared partial block
        copies that block. Raises ValueError if num_tokens is out of range."""
        n = self.num_tokens if num_tokens is None else num_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.num_tokens:
            raise ValueError(f"num_tokens must be an int in [0, {self.num_tokens}], got {num_tokens!r}")
        child = PagedMLACache(self.layout, self.pool, new_owner)
        child.block_table = self.pool.fork(self.block_table[: self.blocks_for(n)], new_owner)
        child.num_tokens = n
        return child

    def free(self) -> None:
        """Drop this request's reference to every page; shared pages stay alive for their other holders."""
        self.pool.decref(self.block_table, self.owner)
        self.block_table, self.num_tokens = [], 0

    def check_integrity(self) -> None:
        """Assert: one page per started block, every page MLA_KV and held by ``owner``."""
        assert self.num_blocks == self.blocks_for(self.num_tokens), \
            f"{self.num_blocks} blocks for {self.num_tokens} tokens of block size {self.layout.block_size}"
        for p in self.block_table:
            assert self.pool.kind(p) is PageKind.MLA_KV, f"page {p} is {self.pool.kind(p).name}"
            assert self.pool.holders(p).get(self.owner, 0) > 0, f"page {p} not held by {self.owner!r}"
