"""Decode of HybridLM with every cache in the pool equals decode with plain tensors, bitwise."""
import pytest
import torch

from kda_core.config import PRESETS
from kda_core.model import HybridLM, cache_equal
from serve.memory.page_policy import kda_groups, page_layout
from serve.memory.pool import PagePool, PoolExhausted
from serve.memory.pooled_cache import PooledHybridCache

FP32 = dict(kv_dtype=torch.float32, state_dtype=torch.float32, conv_dtype=torch.float32)


@pytest.fixture(scope="module")
def model():
    return HybridLM(PRESETS["demo-tiny"])


@pytest.mark.parametrize("policy, bs, G, T", [
    pytest.param("unified", 8, 1, 37, id="unified-G1-T37"),
    pytest.param("unified", 4, 3, 20, id="unified-G3-T20"),
    pytest.param("multi_page", 5, 1, 23, id="multi-bs5-G1-T23"),
    pytest.param("multi_page", 16, 2, 40, id="multi-bs16-G2-T40"),
])
def test_decode_from_pool_is_bitwise(model, policy, bs, G, T):
    cfg = model.cfg
    lay = page_layout(cfg, policy, bs, G, block_align=4, **FP32)
    pool = PagePool(64, lay.page_bytes, poison=True)
    pc = PooledHybridCache(pool, "req", cfg, lay.block_size, kda_groups(cfg, G))
    assert pc.kda.in_place == (policy == "unified")
    prompt = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(T))
    logits, plain = model.prefill(prompt)
    logits_pool, cache = model.prefill(prompt, pc.load())
    pc.store(cache)
    assert torch.equal(logits, logits_pool)
    tok = logits[:, -1].argmax(-1)
    for _ in range(12):
        step, plain = model.decode_step(tok, plain)
        step_pool, cache = model.decode_step(tok, pc.load())
        pc.store(cache)
        pc.check_integrity()
        pool.check_integrity()
        assert torch.equal(step, step_pool)
        tok = step.argmax(-1)
    assert cache_equal(pc.load(), plain)
    pc.free()
    pool.check_integrity()
    assert pool.num_free == pool.num_pages


def test_store_errors_leave_pool_unchanged(model):
    cfg = model.cfg
    lay = page_layout(cfg, "unified", 4, 1, block_align=4, **FP32)
    pool = PagePool(3, lay.page_bytes)                       # 1 state page + 2 KV blocks
    pc = PooledHybridCache(pool, "req", cfg, 4)
    _, cache = model.prefill(torch.arange(8).unsqueeze(0), pc.load())
    pc.store(cache)
    _, longer = model.prefill(torch.arange(3).unsqueeze(0), cache)
    snapshot = pool.arena.clone()
    with pytest.raises(PoolExhausted):
        pc.store(longer)
    assert pc.num_tokens == 8 and torch.equal(pool.arena, snapshot)
    with pytest.raises(ValueError, match="fewer than"):
        pc.store(model.empty_cache())
