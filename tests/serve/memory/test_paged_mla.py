"""PagedMLACache: paged latents equal contiguous latents; prefix sharing and copy-on-write."""
import pytest
import torch

from kda_core.config import PRESETS
from kda_core.layer import MLALayer
from serve.memory.paged_mla import PagedMLACache, paged_latent_attention
from serve.memory.pool import PageKind, PagePool, PoolExhausted

ATOL = 1e-6


def _cache(pool, owner, Lm, D, bs):
    c = PagedMLACache(pool, owner, Lm, D, bs)
    c.check_integrity()
    return c


def _pool_for(Lm, D, bs, num_pages=64):
    return PagePool(num_pages, Lm * bs * D * 4 + 8, poison=True)  # 8 spare bytes per page


def _append_in_chunks(cache, lat, gen):
    pos = 0
    while pos < lat.shape[1]:
        n = int(torch.randint(1, 9, (1,), generator=gen))
        cache.append(lat[:, pos: pos + n])
        cache.check_integrity()
        cache.pool.check_integrity()
        pos += n


@pytest.mark.parametrize("bs, L", [pytest.param(bs, L, id=f"bs{bs}-L{L}")
                                   for bs, L in [(1, 5), (3, 17), (8, 8), (16, 33), (5, 61)]])
def test_gather_equals_contiguous(bs, L):
    gen = torch.Generator().manual_seed(bs * 100 + L)
    Lm, D = 2, 12
    lat = torch.randn(Lm, L, D, generator=gen)                           # [Lm, L, D]
    pool = _pool_for(Lm, D, bs)
    cache = _cache(pool, "r", Lm, D, bs)
    _append_in_chunks(cache, lat, gen)
    assert cache.num_blocks == -(-L // bs)
    assert torch.equal(cache.gather(), lat)
    for layer in range(Lm):
        assert torch.equal(cache.gather(layer), lat[layer])
    frag = (cache.num_blocks * bs - L) * Lm * D * 4 + cache.num_blocks * 8
    assert cache.internal_fragmentation_bytes() == frag
    if L % bs:  # unwritten slots of the last block stay poisoned
        assert cache.block_view(cache.num_blocks - 1)[:, L % bs:].isnan().all()


@pytest.mark.parametrize("seed", range(6))
def test_paged_attention_equals_contiguous(seed):
    gen = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(1, 40, (1,), generator=gen))
    L = int(torch.randint(1, 300, (1,), generator=gen))
    Hm, r, rope, Lm = 4, 24, 8, 2
    lat = torch.randn(Lm, L, r + rope, generator=gen)                   # unit scale, like RMS-normed c_kv
    q = torch.randn(Hm, r + rope, generator=gen)
    pool = _pool_for(Lm, r + rope, bs, num_pages=-(-L // bs) + 1)
    cache = _cache(pool, "r", Lm, r + rope, bs)
    _append_in_chunks(cache, lat, gen)
    scale = 0.17
    for layer in range(Lm):
        c = lat[layer]                                                   # [L, r + rope]
        ref = torch.softmax((q @ c.T) * scale, dim=-1) @ c[:, :r]        # [Hm, r]
        out = paged_latent_attention(q, cache, layer, r, scale)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_mla_decode_over_gathered_pages_is_bitwise():
    cfg = PRESETS["demo-tiny"]
    layer = MLALayer(cfg, torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 23, cfg.hidden_size, generator=gen)
    _, lat = layer(x)                                                     # [1, 23, r + rope]
    pool = _pool_for(1, cfg.latent_dim, 5)
    cache = _cache(pool, "r", 1, cfg.latent_dim, 5)
    cache.append(lat)
    x1 = torch.randn(1, 1, cfg.hidden_size, generator=gen)
    assert torch.equal(layer.decode_absorbed(x1, cache.gather(0).unsqueeze(0)), layer.decode_absorbed(x1, lat))


def test_fork_shares_prefix_and_copies_partial_block_on_write():
    Lm, D, bs = 1, 4, 4
    pool = _pool_for(Lm, D, bs, num_pages=8)
    parent = _cache(pool, "p", Lm, D, bs)
    base = torch.arange(10.0).view(1, 10, 1).expand(1, 10, D)           # [1, 10, D]
    parent.append(base)
    child = parent.fork("c")
    assert child.block_table == parent.block_table and all(pool.refcount(p) == 2 for p in parent.block_table)
    child.append(torch.full((1, 3, D), -1.0))                            # fills the shared partial block
    pool.check_integrity()
    child.check_integrity()
    assert child.block_table[:2] == parent.block_table[:2]              # full blocks still shared
    assert child.block_table[2] != parent.block_table[2]                # partial block copied on write
    assert torch.equal(parent.gather(), base)
    assert torch.equal(child.gather(), torch.cat([base, torch.full((1, 3, D), -1.0)], dim=1))
    used_before = pool.num_used()
    parent.append(torch.full((1, 1, D), 7.0))                            # parent's last block is private now
    assert pool.num_used() == used_before
    short = parent.fork("s", num_tokens=4)
    assert short.block_table == parent.block_table[:1] and short.num_tokens == 4
    for c in (parent, child, short):
        c.free()
        pool.check_integrity()
    assert pool.num_free == pool.num_pages


def test_from_pages_and_errors():
    Lm, D, bs = 2, 4, 4
    pool = _pool_for(Lm, D, bs, num_pages=4)
    a = _cache(pool, "a", Lm, D, bs)
    a.append(torch.randn(Lm, 6, D))
    b = PagedMLACache.from_pages(pool, "b", a.block_table, 6, Lm, D, bs)
    assert torch.equal(b.gather(), a.gather()) and pool.refcount(a.block_table[0]) == 2
    with pytest.raises(ValueError, match="need 2 pages"):
        PagedMLACache.from_pages(pool, "x", a.block_table[:1], 6, Lm, D, bs)
    (st,) = pool.alloc(PageKind.KDA_STATE, 1, "s")
    with pytest.raises(ValueError, match="expected MLA_KV"):
        PagedMLACache.from_pages(pool, "x", [st], 3, Lm, D, bs)
    with pytest.raises(ValueError, match="latents must have shape"):
        a.append(torch.randn(Lm, 2, D + 1))
    snapshot = (list(a.block_table), a.num_tokens, pool.page_table())
    with pytest.raises(PoolExhausted):
        a.append(torch.randn(Lm, 7, D))                                  # COW of shared tail + 2 blocks > 1 free
    assert (list(a.block_table), a.num_tokens, pool.page_table()) == snapshot
    with pytest.raises(ValueError, match="block_size"):
        PagedMLACache(pool, "z", Lm, D, 0)
    with pytest.raises(ValueError, match="does not fit"):
        PagedMLACache(pool, "z", Lm, D, bs + 1)
    with pytest.raises(ValueError, match="at least one"):
        paged_latent_attention(torch.zeros(1, D), PagedMLACache(pool, "z", Lm, D, bs), 0, 2, 1.0)
