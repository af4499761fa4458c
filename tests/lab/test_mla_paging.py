"""Page 06's data: page tables under sharing, fragmentation vs block size, bytes saved by sharing."""
import numpy as np
import pytest
import torch

from lab.mla_paging import (
    GATHER_BLOCKS,
    demo_layout,
    fragmentation_vs_block_size,
    gather_grid,
    page06,
    page_table_demo,
    prefix_sharing_bytes,
)
from serve.memory.pages import read_kv, write_kv
from serve.memory.pool import PageKind, PagePool


@pytest.mark.parametrize("tokens", [1, 37, 48], ids=lambda t: f"L{t}")
def test_read_kv_into_a_buffer(tokens):
    """read_kv(out=) (the gathers page 06 times) equals read_kv into a new tensor bitwise for every MLA layer, and
    aliases the buffer; a buffer of the wrong shape is refused by name."""
    lay = demo_layout(16)                                                # 2 MLA layers: M = 2
    M, N, R = lay.kv_block_shape
    nb = -(-tokens // N)
    pool = PagePool(2 * nb + 1, lay.page_bytes)
    pool.alloc(PageKind.MLA_KV, 1, "other")                              # the table does not start at page 0
    table = pool.alloc(PageKind.MLA_KV, nb, "r")[::-1]                   # and runs backwards
    gen = torch.Generator().manual_seed(0)
    write_kv(lay, pool, table, 0, [torch.randn(1, tokens, R, generator=gen) for _ in range(M)])
    out = torch.full((M, nb * N, R), float("nan"))
    got, want = read_kv(lay, pool, table, tokens, out=out), read_kv(lay, pool, table, tokens)
    for m in range(M):
        assert torch.equal(got[m], want[m]) and got[m].data_ptr() == out[m].data_ptr()
    with pytest.raises(ValueError, match="out must be"):
        read_kv(lay, pool, table, tokens, out=torch.empty(M, nb * N + 1, R))


@pytest.mark.parametrize("bs, a, shared, own", [(16, 100, 40, 30), (4, 37, 37, 0), (8, 64, 0, 9), (1, 20, 7, 3)],
                         ids=lambda v: str(v))
def test_page_table_demo(bs, a, shared, own):
    d = page_table_demo(bs, a, shared, own, seed=1)
    assert len(d.table_a) == -(-a // bs) and len(d.table_b) == -(-(shared + own) // bs)
    assert len(set(d.table_a)) == len(d.table_a) and len(set(d.table_b)) == len(d.table_b)
    full_shared = shared // bs                       # whole blocks stay shared
    partial_shared = shared % bs != 0 and own == 0   # a partial block is shared until B writes into it
    assert d.table_b[:full_shared] == d.table_a[:full_shared]
    assert d.shared_pages == sorted(d.table_a[: full_shared + partial_shared])
    assert d.tokens_b == shared + own
    assert [p for p, r in enumerate(d.page_roles) if r == "shared"] == d.shared_pages
    assert {d.page_roles[p] for p in d.table_a} <= {"A", "shared"} and "other" in d.page_roles


def test_fragmentation_formula():
    rows = fragmentation_vs_block_size([1, 16, 64], [100, 1000, 37])
    assert rows[0].mean_unused_tokens == 0 and rows[0].mean_table_entries == pytest.approx(379)
    assert rows[1].mean_unused_tokens == pytest.approx((12 + 8 + 11) / 3)
    assert rows[2].unused_fraction == pytest.approx((28 + 24 + 27) / (128 + 1024 + 64))
    with pytest.raises(ValueError):
        fragmentation_vs_block_size([0], [5])


@pytest.mark.parametrize("prefix, unique, bs", [(100, 10, 16), (96, 0, 16), (0, 20, 8), (37, 5, 1)])
def test_prefix_sharing_bytes(prefix, unique, bs):
    rows = prefix_sharing_bytes(5, prefix, unique, bs)
    page = 2 * bs * 80 * 4
    full = prefix // bs                              # shared whole blocks
    own = -(-(prefix + unique) // bs) - full         # per-request blocks (COW of the partial one)
    for r in rows:
        if prefix % bs and unique == 0:              # nobody writes into the partial block: it stays shared
            assert r.shared_bytes == (full + 1) * page
        else:
            assert r.shared_bytes == (full + r.num_requests * own) * page
        assert r.private_bytes == r.num_requests * (full + own) * page
    assert rows[0].saved_bytes == 0


@pytest.mark.parametrize("args, match", [
    ((0, 1, 1, 1), "max_requests must be >= 1, got 0"), ((1, -1, 1, 1), "prefix_tokens must be >= 0"),
    ((1, 1, -1, 1), "unique_tokens must be >= 0"), ((1, 1, 1, 0), "block_size must be >= 1"),
    # regression: page 06 with both sliders at 0 showed "max_requests > 0 ... got 1, 16, 0, 0"
    ((1, 0, 0, 16), r"prefix_tokens \+ unique_tokens must be >= 1 .*got prefix_tokens=0, unique_tokens=0"),
])
def test_prefix_sharing_bytes_errors(args, match):
    with pytest.raises(ValueError, match=match):
        prefix_sharing_bytes(*args)


@pytest.mark.parametrize("args, match", [
    ((0, 10, 0, 0), "block_size must be >= 1"), ((4, 0, 0, 0), "tokens_a must be >= 1"),
    ((4, 10, 11, 0), "shared_tokens must be <= tokens_a"), ((4, 10, 2, -1), "tokens_b_own must be >= 0"),
])
def test_page_table_demo_errors(args, match):
    with pytest.raises(ValueError, match=match):
        page_table_demo(*args)


def test_page06_is_one_call_of_plain_data():
    r = page06(8, 40, 20, 5, 3, 64, 16)
    assert r.demo == page_table_demo(8, 40, 20, 5, seed=0) and r.sharing_block_size == 16
    assert list(r.sharing.num_requests) == [1, 2, 3] and list(r.fragmentation.block_size) == [2 ** i for i in range(11)]
    assert page06(8, 40, 20, 5, 3, 0, 0).sharing is None       # page 06 explains this case itself


def test_gather_grid_sets_up_once_per_block_size(monkeypatch):
    """Page 06's grid writes one request per block size and times every context on its first L tokens (the set-up
    was per cell: 20 writes at the default 2,048 tokens, ~35 % of the page's script time); rows stay context-major."""
    import lab.pool_timing as pool_timing
    written, engine_write_kv = [], pool_timing.write_kv

    def write_kv(layout, pool, table, start, latents):
        written.append((layout.kv_block_shape[1], latents[0].shape[1]))
        return engine_write_kv(layout, pool, table, start, latents)

    monkeypatch.setattr(pool_timing, "write_kv", write_kv)
    rows = gather_grid(512, repeats=5).rows
    assert written == [(b, 512) for b in GATHER_BLOCKS]
    assert list(zip(rows.context_tokens, rows.block_size)) == [(L, b) for L in (256, 512) for b in GATHER_BLOCKS]


def test_gather_grid_medians_ratios_and_conditions():
    """Page 06's gathers follow the measurement rule: medians of interleaved repeats after a warm-up, a ratio
    of medians with the quartiles of the per-round ratio, one thread, and the conditions for the stamp (the
    old grid was the minimum of 5 rounds, cached for the process lifetime, without conditions)."""
    g = gather_grid(256, repeats=5)
    rows = g.rows
    assert sorted(set(rows.context_tokens)) == [256] and list(rows.block_size) == list(GATHER_BLOCKS)
    assert np.allclose(rows.gather_ratio, rows.paged_us / rows.contiguous_us)
    assert np.allclose(rows.naive_ratio, rows.naive_cat_us / rows.contiguous_us)
    for col in ("gather_ratio", "naive_ratio", "attention_ratio"):
        assert (rows[f"{col}_q1"] <= rows[f"{col}_q3"]).all() and (rows[f"{col}_q1"] > 0).all()
    assert list(g.naive.context_tokens) == [256] and list(g.naive.rounds) == [5 * len(GATHER_BLOCKS)]
    assert g.conditions.repeats == 5 and g.conditions.warmup == 1 and g.conditions.torch_threads == 1
    assert gather_grid(256, repeats=5).conditions.measured_at >= g.conditions.measured_at   # measured again
    with pytest.raises(ValueError, match="max_ctx"):
        gather_grid(255)
    with pytest.raises(ValueError, match="repeats"):
        gather_grid(256, repeats=3)
