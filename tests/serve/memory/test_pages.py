"""serve.memory.pages: a request's hybrid cache in pool pages, as the engine reads and writes it.

Decode with every cache byte in the pool equals decode with plain tensors, bitwise (fp32), under both
page-size policies and several group counts; state round trips through poisoned pages of every size;
checkpoint copies are deep; bad layouts are refused.
"""
import pytest
import torch

from kda_core.config import PRESETS
from kda_core.layer import KDACache
from kda_core.model import HybridCache, HybridLM, cache_equal
from serve.memory.layout import CacheLayout
from serve.memory.pages import copy_state, read_kv, read_state, write_kv, write_state, zero_state
from serve.memory.pool import PageKind, PagePool

CFG = PRESETS["demo-tiny"]  # H=2, K=16, V=12 (K != V), KDA layers 0, 1, 2; MLA layer 3


@pytest.fixture(scope="module")
def model():
    return HybridLM(CFG)


def _state_pages(lay, pool, owner):
    flat = pool.alloc(PageKind.KDA_STATE, lay.state_pages, owner)
    out = []
    for g in range(lay.num_groups):
        out.append(flat[: lay.group_pages(g)])
        flat = flat[lay.group_pages(g):]
    return out


def _load(lay, pool, state, table, num_tokens):
    """The engine's gather: KDA states from the state pages, latents from the page table."""
    kda = read_state(lay, pool, state)
    lat = read_kv(lay, pool, table, num_tokens)
    mla = {i: lat[m] for m, i in enumerate(CFG.mla_layers)}
    return HybridCache(tuple(kda[i] if i in kda else mla[i] for i in range(CFG.num_layers)), num_tokens)


def _store(lay, pool, state, table, cache, start):
    """The engine's scatter: grow the page table, write the new latents and the state."""
    need = -(-cache.num_tokens // lay.block_size) - len(table)
    table += pool.alloc(PageKind.MLA_KV, need, "req")
    write_state(lay, pool, state, {i: cache.layers[i] for i in CFG.kda_layers})
    write_kv(lay, pool, table, start, [cache.layers[i][:, start:] for i in CFG.mla_layers])


@pytest.mark.parametrize("policy, bs, G, T", [
    pytest.param("unified", 8, 1, 37, id="unified-G1-T37"),
    pytest.param("unified", 4, 3, 20, id="unified-G3-T20"),
    pytest.param("multi_page", 5, 1, 23, id="multi-bs5-G1-T23"),
    pytest.param("multi_page", 16, 2, 40, id="multi-bs16-G2-T40"),
])
def test_decode_from_pool_is_bitwise(model, policy, bs, G, T):
    lay = CacheLayout.for_policy(CFG, bs, G, policy)
    assert (lay.state_pages == G) == (policy == "unified")
    pool = PagePool(64, lay.page_bytes, poison=True)
    state, table = _state_pages(lay, pool, "req"), []
    zero_state(lay, pool, state)
    prompt = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(T))
    logits, plain = model.prefill(prompt)
    logits_pool, cache = model.prefill(prompt, _load(lay, pool, state, table, 0))
    _store(lay, pool, state, table, cache, 0)
    assert torch.equal(logits, logits_pool)
    tok = logits[:, -1].argmax(-1)
    for _ in range(12):
        n = plain.num_tokens
        step, plain = model.decode_step(tok, plain)
        step_pool, cache = model.decode_step(tok, _load(lay, pool, state, table, n))
        _store(lay, pool, state, table, cache, n)
        pool.check_integrity()
        assert torch.equal(step, step_pool)
        tok = step.argmax(-1)
    assert cache_equal(_load(lay, pool, state, table, plain.num_tokens), plain)
    pool.decref([p for grp in state for p in grp] + table, "req")
    pool.check_integrity()
    assert pool.num_free == pool.num_pages


def _random_states(gen):
    return {i: KDACache(torch.randn(1, CFG.num_heads, CFG.head_k_dim, CFG.head_v_dim, generator=gen),
                        torch.randn(1, CFG.conv_dim, CFG.conv_kernel - 1, generator=gen)) for i in CFG.kda_layers}


@pytest.mark.parametrize("page_bytes", [6400, 2048, 1024, 320], ids=lambda b: f"page{b}")
@pytest.mark.parametrize("G", [1, 3])
def test_state_roundtrip_in_poisoned_pages(page_bytes, G):
    lay = CacheLayout(CFG, 1, G, page_bytes)
    pool = PagePool(256, page_bytes, poison=True)
    state = _state_pages(lay, pool, "r")
    assert len(state) == G and sum(map(len, state)) == lay.state_pages
    assert all(c.recurrent.isnan().all() for c in read_state(lay, pool, state).values())  # never written
    states = _random_states(torch.Generator().manual_seed(page_bytes + G))
    write_state(lay, pool, state, states)
    got = read_state(lay, pool, state)
    assert all(torch.equal(got[i].recurrent, s.recurrent) and torch.equal(got[i].conv, s.conv)
               for i, s in states.items())
    got[0].recurrent.zero_()                                        # reads are copies: the pool is unchanged
    assert torch.equal(read_state(lay, pool, state)[0].recurrent, states[0].recurrent)
    zero_state(lay, pool, state)
    assert all((c.recurrent == 0).all() and (c.conv == 0).all() for c in read_state(lay, pool, state).values())


def test_copy_state_is_deep_and_checked():
    lay = CacheLayout(CFG, 1, 3, 1024)
    pool = PagePool(64, 1024, poison=True)
    a, ckpt = _state_pages(lay, pool, "a"), _state_pages(lay, pool, "ckpt")
    before = _random_states(torch.Generator().manual_seed(0))
    write_state(lay, pool, a, before)
    copy_state(pool, a, ckpt)                                       # publish a checkpoint
    write_state(lay, pool, a, _random_states(torch.Generator().manual_seed(1)))
    assert torch.equal(read_state(lay, pool, ckpt)[2].conv, before[2].conv)
    copy_state(pool, ckpt, a)                                       # restore it
    assert torch.equal(read_state(lay, pool, a)[0].recurrent, before[0].recurrent)
    with pytest.raises(ValueError, match="state page counts differ"):
        copy_state(pool, a, [grp[:-1] for grp in ckpt])


def test_kv_roundtrip_and_layout_checks():
    lay = CacheLayout(CFG, 3, 1, CacheLayout.page_bytes_for(CFG, 3, 1, "multi_page"))
    pool = PagePool(8, lay.page_bytes, poison=True)
    table = pool.alloc(PageKind.MLA_KV, 3, "r")
    lat = torch.randn(1, 8, CFG.latent_dim)
    write_kv(lay, pool, table, 0, [lat[:, :5]])
    write_kv(lay, pool, table, 5, [lat[:, 5:]])                    # starts inside block 1
    assert torch.equal(read_kv(lay, pool, table, 8)[0], lat) and read_kv(lay, pool, table, 0)[0].shape == (1, 0, 24)
    assert read_kv(lay, pool, table, 9)[0][0, 8].isnan().all()     # the unwritten slot stays poisoned
    with pytest.raises(ValueError, match="page table holds 3 blocks, 4 needed"):
        read_kv(lay, pool, table, 10)
    bf16 = CacheLayout(CFG, 3, 1, lay.page_bytes, kv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="layout must store fp32"):
        read_kv(bf16, pool, table, 8)
    with pytest.raises(ValueError, match="differs from the pool's"):
        write_kv(CacheLayout(CFG, 3, 1, lay.page_bytes + 64), pool, table, 0, [lat])
