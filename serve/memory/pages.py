"""Reading and writing one request's hybrid cache in pool pages, as laid out by
:class:`serve.memory.layout.CacheLayout`: the KDA state per group and the MLA latents per block.

Latents and conv windows are fp32, and so is the recurrent state by default: a write then a read is then
bitwise exact. Under a bf16 / fp16 ``layout.state_dtype`` the recurrent state is rounded to nearest (``.to``)
when written and upcast exactly when read, so a write then a read equals ``x.to(state_dtype).float()``.
Functions here move bytes only; who owns which page is the caller's business (the engine,
:class:`serve.prefix.cache.PrefixCache` and :class:`serve.memory.paged_mla.PagedMLACache`). Every function
raises ValueError for a layout the engine cannot store (:meth:`CacheLayout.check_engine_dtypes`) or whose
``page_bytes`` differs from the pool's.
"""
from __future__ import annotations

import torch

from kda_core.layer import KDACache
from serve.memory.layout import FP32_BYTES, CacheLayout
from serve.memory.pool import PagePool


def _check(layout: CacheLayout, pool: PagePool) -> None:
    layout.check_engine_dtypes()
    if layout.page_bytes != pool.page_bytes:
        raise ValueError(f"layout.page_bytes {layout.page_bytes} differs from the pool's {pool.page_bytes}")


def _flat_pages(pool: PagePool, pages) -> torch.Tensor:
    arena = pool.typed_arena(torch.float32, (pool.page_bytes // FP32_BYTES,))  # [num_pages, E]
    return arena[torch.as_tensor(list(pages), dtype=torch.long)].reshape(-1)  # [len(pages) * E]


def stored_words(recurrent: torch.Tensor, state_dtype: torch.dtype) -> torch.Tensor:
    """The recurrent state(s) ``[..., H, K, V]`` fp32 as stored: rounded to nearest into ``state_dtype``, as fp32
    words ``[prod(...) * H K V s_state / 4]`` (one flat copy; H K V even for a 16-bit dtype)."""
    return recurrent.reshape(-1).to(state_dtype).view(torch.float32)


def read_state(layout: CacheLayout, pool: PagePool, pages_by_group) -> dict[int, KDACache]:
    """Read every group's state pages into ``{layer: KDACache}`` (recurrent ``[1, H, K, V]``, conv
    ``[1, 2HK + HV, W-1]``, fp32 copies; a 16-bit recurrent state upcast exactly)."""
    _check(layout, pool)
    cfg = layout.cfg
    rec_shape = (1, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim)
    conv_shape = (1, cfg.conv_dim, cfg.conv_kernel - 1)
    w_rec, w_conv = layout.state_words()
    out = {}
    for layers, pages in zip(layout.groups, pages_by_group):
        flat = _flat_pages(pool, pages)[: len(layers) * (w_rec + w_conv)]   # the group's layers, in order (words)
        parts = iter(flat.split([w_rec, w_conv] * len(layers)))             # recurrent, conv, recurrent, ...
        out |= {i: KDACache(rec.view(layout.state_dtype).to(torch.float32).view(rec_shape),  # [1, H, K, V]
                            conv.view(conv_shape))                          # [1, 2HK + HV, W-1]
                for i, rec, conv in zip(layers, parts, parts)}
    return out


def write_state(layout: CacheLayout, pool: PagePool, pages_by_group, caches: dict[int, KDACache]) -> None:
    """Write ``{layer: KDACache}`` (batch 1, fp32) into every group's state pages, in place; the recurrent state
    rounded to nearest into ``layout.state_dtype``."""
    _check(layout, pool)
    per_page = pool.page_bytes // FP32_BYTES
    for layers, pages in zip(layout.groups, pages_by_group):
        flat = torch.cat([t for i in layers for t in (stored_words(caches[i].recurrent, layout.state_dtype),
                                                      caches[i].conv.reshape(-1))])   # [group words]
        for j, p in enumerate(pages):
            chunk = flat[j * per_page: (j + 1) * per_page]
            pool.view(p, torch.float32, (chunk.numel(),)).copy_(chunk)


def slot_views(layout: CacheLayout, pool: PagePool, group: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The pool's arena as state slots of ``group``, for reading and writing states in place by slot (vLLM's
    ``ssm_state_indices``): slot s is the group state that starts at page s and spans the
    ``n = layout.group_pages(group)`` consecutive pages ``[s, s + n)`` (one page under "unified"; a run of
    pages from :meth:`PagePool.alloc_run` under "multi_page"), so a request's slot is its first state page.

    Returns ``{layer: (recurrent [S, H, K, V] in layout.state_dtype, conv [S, 2HK + HV, W-1] fp32)}`` for the
    group's layers, S = num_pages - n + 1 (every page a run can start at): strided views of the pool's arena
    (stride(0) = one page), so ``view[s]`` aliases layer's state in the run starting at page s, exactly where
    :func:`read_state` / :func:`write_state` put it over the pages ``(s, ..., s + n - 1)``. Slots of
    overlapping runs alias each other: only the first page of a KDA_STATE run of ``group`` is a slot. Valid for
    the pool's life (the arena is never reallocated). Raises ValueError for a layout the engine cannot store,
    whose page size differs from the pool's, or whose group state needs more pages than the pool has."""
    _check(layout, pool)
    n = layout.group_pages(group)
    if n > pool.num_pages:
        raise ValueError(f"group {group}'s state spans {n} pages, the pool has {pool.num_pages}")
    cfg, S, E = layout.cfg, pool.num_pages - n + 1, pool.page_bytes // FP32_BYTES
    w_rec, w_conv = layout.state_words()
    words = pool.arena.view(torch.float32).view(-1)                          # [P E] fp32 words
    per = FP32_BYTES // layout.state_dtype.itemsize                          # stored elements per word
    elems = pool.arena.view(layout.state_dtype).view(-1)                     # [P E per] stored elements
    H, K, V, C, W1 = cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.conv_dim, cfg.conv_kernel - 1
    out = {}
    for j, layer in enumerate(layout.groups[group]):
        a = j * (w_rec + w_conv)                                           # layer j: recurrent, then conv window
        out[layer] = (elems.as_strided((S, H, K, V), (E * per, K * V, V, 1), a * per),   # [S, H, K, V]
                      words.as_strided((S, C, W1), (E, W1, 1), a + w_rec))             # [S, 2HK + HV, W-1]
    return out


def zero_state(layout: CacheLayout, pool: PagePool, pages_by_group) -> None:
    """Write the empty-sequence state (all zeros) into every group's state pages."""
    _check(layout, pool)
    for g, pages in enumerate(pages_by_group):
        remaining = layout.group_state_bytes(g) // FP32_BYTES
        for p in pages:
            n = min(remaining, pool.page_bytes // FP32_BYTES)
            pool.view(p, torch.float32, (n,)).zero_()
            remaining -= n


def copy_state(pool: PagePool, src_by_group, dst_by_group) -> None:
    """Copy a state page by page (a checkpoint into a request's private pages, or back)."""
    for src, dst in zip(src_by_group, dst_by_group):
        if len(src) != len(dst):
            raise ValueError(f"state page counts differ: {len(src)} vs {len(dst)}")
        for s, d in zip(src, dst):
            pool.copy_page(s, d)


def read_kv(layout: CacheLayout, pool: PagePool, page_table, num_tokens: int,
            out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The first ``num_tokens`` latents of a request, per MLA layer ``[1, num_tokens, r + rope]``
    (one gather over the page table). ``out``: an optional fp32 buffer ``[M, NB * N, r + rope]`` (M MLA
    layers, NB = ceil(num_tokens / N) blocks of N tokens) gathered into instead of a new tensor, so a
    caller reading again and again allocates nothing; the returned views then alias it. Raises ValueError
    for an ``out`` of another shape or dtype, or not contiguous."""
    _check(layout, pool)
    M, N, R = layout.kv_block_shape
    nb = -(-num_tokens // N)
    if nb > len(page_table):
        raise ValueError(f"page table holds {len(page_table)} blocks, {nb} needed for {num_tokens} tokens")
    if out is not None and (out.shape != (M, nb * N, R) or out.dtype != torch.float32 or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous fp32 tensor of shape {(M, nb * N, R)}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if nb == 0:
        return [torch.zeros(1, 0, R) for _ in range(M)]
    arena = pool.typed_arena(torch.float32, (M, N, R))                    # [num_pages, M, N, R]
    idx = torch.as_tensor(list(page_table[:nb]), dtype=torch.long)       # [nb]
    if out is None:
        # index_select, not arena[idx]: advanced indexing of the strided arena view is ~3x slower here
        blocks = arena.index_select(0, idx)                               # [nb, M, N, R]
        lat = blocks.permute(1, 0, 2, 3).reshape(M, nb * N, R)[:, :num_tokens]  # [M, num_tokens, R]
    else:
        for m in range(M):
            torch.index_select(arena[:, m], 0, idx, out=out[m].view(nb, N, R))  # [nb, N, R]
        lat = out[:, :num_tokens]                                         # [M, num_tokens, R]
    return [lat[m: m + 1] for m in range(M)]


def write_kv(layout: CacheLayout, pool: PagePool, page_table, start: int, latents) -> None:
    """Write per-MLA-layer latents ``[1, T, r + rope]`` of tokens ``[start, start + T)`` into the pages."""
    _check(layout, pool)
    M, N, R = layout.kv_block_shape
    T = latents[0].shape[1]
    pos = start
    while pos < start + T:
        b, off = divmod(pos, N)
        n = min(N - off, start + T - pos)
        page = pool.view(page_table[b], torch.float32, (M, N, R))        # [M, N, R]
        for m in range(M):
            page[m, off: off + n].copy_(latents[m][0, pos - start: pos - start + n])
        pos += n
