"""KDAStateCache: states written and read through pool views, in place or across pages."""
import pytest
import torch

from kda_core.config import PRESETS
from kda_core.layer import KDACache
from serve.memory.kda_state_cache import KDAStateCache
from serve.memory.page_policy import kda_groups
from serve.memory.pool import PageKind, PagePool, PoolExhausted

CFG = PRESETS["demo-tiny"]  # H=2, K=16, V=12 (K != V), KDA layers 0, 1, 2


def _random_state(gen):
    return KDACache(torch.randn(1, CFG.num_heads, CFG.head_k_dim, CFG.head_v_dim, generator=gen),
                    torch.randn(1, CFG.conv_dim, CFG.conv_kernel - 1, generator=gen))


@pytest.mark.parametrize("page_bytes", [6400, 2048, 1000, 96], ids=lambda b: f"page{b}")
@pytest.mark.parametrize("G", [1, 3])
def test_write_read_roundtrip(page_bytes, G):
    pool = PagePool(256, page_bytes, poison=True)
    cache = KDAStateCache(pool, "r", CFG, kda_groups(CFG, G))
    cache.check_integrity()
    pool.check_integrity()
    assert cache.num_pages == sum(-(-b // page_bytes) for b in cache.group_bytes)
    assert cache.waste_bytes() == cache.num_pages * page_bytes - sum(cache.group_bytes)
    assert cache.read(0).recurrent.isnan().any()           # never written: poisoned
    gen = torch.Generator().manual_seed(page_bytes + G)
    states = {i: _random_state(gen) for i in CFG.kda_layers}
    for i, s in states.items():
        cache.write(i, s)
    for i, s in states.items():
        got = cache.read(i)
        assert torch.equal(got.recurrent, s.recurrent) and torch.equal(got.conv, s.conv)
    if cache.in_place:  # a view: writing the pool changes what was read
        view = cache.read(CFG.kda_layers[0]).recurrent
        cache.write(CFG.kda_layers[0], KDACache(torch.zeros_like(view), states[CFG.kda_layers[0]].conv))
        assert (view == 0).all()
    cache.free()
    pool.check_integrity()
    assert pool.num_free == 256


def test_clone_and_copy_from_are_deep():
    pool = PagePool(16, 4096, poison=True)
    gen = torch.Generator().manual_seed(0)
    a = KDAStateCache(pool, "a", CFG)
    for i in CFG.kda_layers:
        a.write(i, _random_state(gen))
    snap = a.clone("ckpt")
    assert set(snap.pages[0]).isdisjoint(a.pages[0])
    before = a.read(0).recurrent.clone()
    a.write(0, _random_state(gen))
    assert torch.equal(snap.read(0).recurrent, before)
    b = KDAStateCache(pool, "b", CFG)
    b.copy_from(snap)
    assert torch.equal(b.read(0).recurrent, before) and torch.equal(b.read(2).conv, snap.read(2).conv)
    other = KDAStateCache(pool, "o", CFG, kda_groups(CFG, 3))
    with pytest.raises(ValueError, match="same pool, groups"):
        b.copy_from(other)
    for c in (a, snap, b, other):
        c.free()
    pool.check_integrity()
    assert pool.num_free == 16


def test_errors():
    pool = PagePool(3, 1024)
    with pytest.raises(ValueError, match="groups must be"):
        KDAStateCache(pool, "r", CFG, [(0, 3)])                 # layer 3 is MLA
    with pytest.raises(ValueError, match="groups must be"):
        KDAStateCache(pool, "r", CFG, [(0, 1), (1, 2)])         # overlap
    with pytest.raises(PoolExhausted):
        KDAStateCache(pool, "r", CFG)                           # needs 7 pages of 1 KiB
    assert pool.num_free == 3
    cache = KDAStateCache(PagePool(1, 8192), "r", CFG)
    with pytest.raises(ValueError, match="must have shape"):
        cache.write(0, KDACache(torch.zeros(1, 2, 2, 2), torch.zeros(1, CFG.conv_dim, 3)))
    with pytest.raises(ValueError, match="not a KDA layer"):
        cache.read(3)
    assert cache.pool.kind(cache.pages[0][0]) is PageKind.KDA_STATE
