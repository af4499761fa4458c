"""PagedMLACache: a page table over read_kv / write_kv; paged latents equal contiguous latents;
prefix sharing by reference count and copy-on-write of a shared partial block."""
import dataclasses

import pytest
import torch

from kda_core.config import PRESETS
from kda_core.layer import MLALayer
from serve.memory.layout import CacheLayout
from serve.memory.paged_mla import PagedMLACache
from serve.memory.pool import PagePool, PoolExhausted

CFG = PRESETS["demo-tiny"]                                   # one MLA layer, latent 16 + 8
CFG2 = dataclasses.replace(CFG, num_layers=5, mla_layers=(3, 4))  # two MLA layers


def _setup(cfg, bs, num_pages=64, spare=64):
    lay = CacheLayout(cfg, bs, 1, CacheLayout.page_bytes_for(cfg, bs, 1, "multi_page") + spare)
    return lay, PagePool(num_pages, lay.page_bytes, poison=True)


def _cache(lay, pool, owner):
    c = PagedMLACache(lay, pool, owner)
    c.check_integrity()
    return c


@pytest.mark.parametrize("bs, L", [pytest.param(bs, L, id=f"bs{bs}-L{L}")
                                   for bs, L in [(1, 5), (3, 17), (8, 8), (16, 33), (5, 61)]])
def test_gather_equals_contiguous(bs, L):
    gen = torch.Generator().manual_seed(bs * 100 + L)
    lay, pool = _setup(CFG2, bs)
    lat = torch.randn(2, L, CFG2.latent_dim, generator=gen)           # [M, L, r + rope]
    cache = _cache(lay, pool, "r")
    pos = 0
    while pos < L:                                                     # appends of random lengths
        n = int(torch.randint(1, 9, (1,), generator=gen))
        cache.append(lat[:, pos: pos + n])
        cache.check_integrity()
        pool.check_integrity()
        pos += n
    assert cache.num_blocks == -(-L // bs)
    assert all(torch.equal(g[0], lat[m]) for m, g in enumerate(cache.gather()))
    assert lay.kv_page_padding_bytes >= 64


def test_mla_decode_over_gathered_pages_is_bitwise():
    layer = MLALayer(CFG, torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 23, CFG.hidden_size, generator=gen)
    _, lat = layer(x)                                                  # [1, 23, r + rope]
    lay, pool = _setup(CFG, 5)
    cache = _cache(lay, pool, "r")
    cache.append(lat)
    x1 = torch.randn(1, 1, CFG.hidden_size, generator=gen)
    assert torch.equal(layer.decode_absorbed(x1, cache.gather()[0]), layer.decode_absorbed(x1, lat))


def test_fork_shares_prefix_and_copies_partial_block_on_write():
    lay, pool = _setup(CFG, 4, num_pages=8)
    D = CFG.latent_dim
    parent = _cache(lay, pool, "p")
    base = torch.arange(10.0).view(1, 10, 1).expand(1, 10, D)         # [1, 10, D]
    parent.append(base)
    child = parent.fork("c")
    assert child.block_table == parent.block_table and all(pool.refcount(p) == 2 for p in parent.block_table)
    child.append(torch.full((1, 3, D), -1.0))                          # fills the shared partial block
    pool.check_integrity()
    child.check_integrity()
    assert child.block_table[:2] == parent.block_table[:2]             # full blocks still shared
    assert child.block_table[2] != parent.block_table[2]               # partial block copied on write
    assert torch.equal(parent.gather()[0], base)
    assert torch.equal(child.gather()[0], torch.cat([base, torch.full((1, 3, D), -1.0)], dim=1))
    used_before = pool.num_used()
    parent.append(torch.full((1, 1, D), 7.0))                          # parent's last block is private now
    assert pool.num_used() == used_before
    short = parent.fork("s", num_tokens=4)
    assert short.block_table == parent.block_table[:1] and short.num_tokens == 4
    for c in (parent, child, short):
        c.free()
        pool.check_integrity()
    assert pool.num_free == pool.num_pages


def test_errors_leave_everything_unchanged():
    lay, pool = _setup(CFG, 4, num_pages=4)
    a = _cache(lay, pool, "a")
    a.append(torch.randn(1, 6, CFG.latent_dim))
    a.fork("b")                                                        # the partial last block is shared
    with pytest.raises(ValueError, match=r"latents must have shape \[M, T, r \+ rope\] = \[1, T, 24\]"):
        a.append(torch.randn(1, 2, CFG.latent_dim + 1))
    snapshot = (list(a.block_table), a.num_tokens, pool.page_table(), pool.arena.clone())
    with pytest.raises(PoolExhausted):
        a.append(torch.randn(1, 7, CFG.latent_dim))                    # COW of the shared tail + 2 blocks > 2 free
    assert (list(a.block_table), a.num_tokens, pool.page_table()) == snapshot[:3]
    assert torch.equal(pool.arena.nan_to_num(), snapshot[3].nan_to_num())
    with pytest.raises(ValueError, match=r"num_tokens must be an int in \[0, 6\]"):
        a.fork("x", 7)
    with pytest.raises(ValueError, match="owner must not be None"):
        PagedMLACache(lay, pool, None)
    with pytest.raises(ValueError, match="layout must be fp32 with the pool's page_bytes"):
        PagedMLACache(CacheLayout(CFG, 4, 1, lay.page_bytes + 64), pool, "z")
