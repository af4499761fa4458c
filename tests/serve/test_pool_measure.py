"""The measurement helpers behind bench.pool and pages 05/06 measure what they claim."""
import pytest
import torch

from serve.paged_cache import PageKind, PagePool
from serve.paged_mla import PagedMLACache
from serve.pool_measure import NaiveListPool, alloc_free_throughput, call_latencies_ns, gather_timing, one_thread


def test_naive_pool_is_a_free_list():
    pool = NaiveListPool(4)
    a = pool.alloc(PageKind.MLA_KV, 3, "r")
    assert a == [0, 1, 2] and pool.free_list == [3]
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.alloc(PageKind.MLA_KV, 2, "r")
    with pytest.raises(ValueError, match="not owned"):
        pool.decref(a, "x")
    pool.decref(a, "r")
    assert sorted(pool.free_list) == [0, 1, 2, 3] and not pool.meta


def test_gather_into_buffer_equals_gather():
    pool = PagePool(8, 3 * 5 * 4)
    cache = PagedMLACache(pool, "r", 1, 5, 3)
    lat = torch.randn(1, 7, 5)
    cache.append(lat)
    buf = torch.full((3, 3, 5), float("nan"))
    assert torch.equal(cache.gather(0, out=buf), lat[0]) and torch.equal(cache.gather(0), lat[0])
    cache.append(lat[:, :3])                                  # table grows: the cached index is rebuilt
    assert torch.equal(cache.gather(0), torch.cat([lat[0], lat[0, :3]]))
    with pytest.raises(ValueError, match="out must be"):
        cache.gather(0, out=buf)


def test_measurements_shapes_and_thread_restore():
    before = torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    t = alloc_free_throughput(8, num_pages=64, loops=3, repeats=1)
    assert t.batch_pages == 8 and t.pool_ops_s > 0 and t.naive_ops_s > 0
    with pytest.raises(ValueError, match="batch_pages"):
        alloc_free_throughput(40, num_pages=64)
    lat = call_latencies_ns(2, samples=10, num_pages=16)
    assert len(lat["alloc"]) == len(lat["free"]) == 10 and min(lat["alloc"]) > 0
    g = gather_timing(40, 16, latent_dim=12, kv_lora_rank=8, repeats=1)
    assert g.context_tokens == 40 and min(g[2:]) > 0
    with pytest.raises(ValueError, match="latent_dim > kv_lora_rank"):
        gather_timing(40, 16, latent_dim=8, kv_lora_rank=8)
