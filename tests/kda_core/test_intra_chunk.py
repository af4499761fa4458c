"""kda_core.intra_chunk: the sub-chunk form of the in-chunk products equals the always-safe halving form,
chunks past its decay bound (or with g = -inf) take the safe form chunk by chunk, and kda_chunk's torch
form without autograd (the in-place scan) is bitwise the autograd run (the fused C form agrees to rounding:
tests/kda_core/test_cpu_kernel.py)."""
import math

import pytest
import torch
import torch.nn.functional as F

import kda_core.intra_chunk as intra
from kda_core.chunk import kda_chunk, piece_tokens_for
from kda_core.intra_chunk import (
    MAX_SUB_CHUNK_DECAY,
    halving_products,
    intra_chunk_products,
    stack_kq,
    sub_chunk_products,
)
from kda_core.kda import kda_recurrent

C, K = 64, 8


def _chunks(per_token_decay, n=3, dtype=torch.float64, seed=0):
    """G, k, q ``[n, C, K]``: per-token log decay ``-per_token_decay`` (one value per chunk) times U(0.5, 1.5)."""
    gen = torch.Generator().manual_seed(seed)
    rate = torch.as_tensor(per_token_decay, dtype=dtype).reshape(-1, 1, 1)
    g = -rate * (0.5 + torch.rand(n, C, K, generator=gen, dtype=dtype))
    k = F.normalize(torch.randn(n, C, K, generator=gen, dtype=dtype), dim=-1)
    q = F.normalize(torch.randn(n, C, K, generator=gen, dtype=dtype), dim=-1)
    return g.cumsum(-2), k, q


def _halving(G, k, q):
    kk, qk = halving_products(G, k, q)
    return kk, qk + torch.diag_embed((q * k).sum(-1))


def test_sub_chunk_form_equals_halving_form_within_its_bound():
    # 16-token sub-chunks decaying by up to 15 * 1.5 * 2.6 = 58.5 nats < 60: all within the bound
    G, k, q = _chunks([0.01, 0.5, 2.6])
    kk, qk, ok = sub_chunk_products(G, stack_kq(k, q))
    assert ok.all()
    ref_kk, ref_qk = _halving(G, k, q)
    torch.testing.assert_close(kk, ref_kk, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(qk, ref_qk, rtol=1e-12, atol=1e-14)


def test_chunks_past_the_bound_take_the_safe_form():
    # 8 nats per token: a 16-token sub-chunk decays by ~120 nats, exp(120) overflows fp32
    G, k, q = _chunks([0.1, 8.0, 0.1], dtype=torch.float32)
    assert sub_chunk_products(G, stack_kq(k, q))[2].tolist() == [True, False, True]
    kk, qk = intra_chunk_products(G, stack_kq(k, q))
    ref_kk, ref_qk = _halving(G.double(), k.double(), q.double())
    assert torch.isfinite(kk).all() and torch.isfinite(qk).all()
    assert (kk.double() - ref_kk).abs().max() <= 1e-6 and (qk.double() - ref_qk).abs().max() <= 1e-6


def test_the_bound_is_what_keeps_fp32_finite(monkeypatch):
    """With the bound lifted the fast form takes the 120-nat chunk and overflows: the bound is load-bearing."""
    monkeypatch.setattr(intra, "MAX_SUB_CHUNK_DECAY", math.inf)
    G, k, q = _chunks([8.0], n=1, dtype=torch.float32)
    kk, _ = intra_chunk_products(G, stack_kq(k, q))
    assert not torch.isfinite(kk).all()


def test_a_chunks_products_do_not_depend_on_its_neighbours():
    """Bitwise: a chunk's products are the same computed alone or beside chunks that take the other form
    (what keeps warm == cold on the 64-token grid)."""
    G, k, q = _chunks([0.1, 8.0, 2.0, 30.0], n=4, dtype=torch.float32)
    kk, qk = intra_chunk_products(G, stack_kq(k, q))
    for i in range(4):
        one = intra_chunk_products(G[i:i + 1], stack_kq(k[i:i + 1], q[i:i + 1]))
        assert torch.equal(one[0][0], kk[i]) and torch.equal(one[1][0], qk[i])


@pytest.mark.parametrize("rate", [3.5, 4.5], ids=["under-bound", "over-bound"])
def test_kda_chunk_near_the_bound_matches_recurrent(rate):
    """Per-token decay ~rate nats (16 tokens: ~56 vs ~72 nats, either side of the 60-nat bound), fp32."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, V = 1, 150, 2, 6
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v, beta = torch.randn(B, T, H, V, generator=gen), torch.rand(B, T, H, generator=gen)
    g = torch.full((B, T, H, K), -rate)
    assert (15 * rate <= MAX_SUB_CHUNK_DECAY) == (rate == 3.5)
    o_r, s_r = kda_recurrent(q, k, v, g, beta)
    o_c, s_c, _ = kda_chunk(q, k, v, g, beta)
    assert (o_c - o_r).abs().max() <= 1e-5 and (s_c - s_r).abs().max() <= 1e-5


@pytest.mark.parametrize("T,piece", [(150, None), (150, 64), (64, None)])
def test_no_grad_run_is_bitwise_the_autograd_run(T, piece):
    """kda_chunk's torch form without autograd scans and writes outputs in one pass; with autograd it stacks
    per chunk. Same per-matrix ops: o, final_state and h are bitwise equal. (Without autograd the fused C
    form runs where it is available: it agrees with this to fp32 rounding, tested in test_cpu_kernel.py.)"""
    gen = torch.Generator().manual_seed(4)
    B, H, V = 2, 2, 6
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v, beta = torch.randn(B, T, H, V, generator=gen), torch.rand(B, T, H, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * torch.tensor([0.1, 9.0]).view(1, 1, H, 1)  # head 1: safe form
    s0 = torch.randn(B, H, K, V, generator=gen)
    with torch.no_grad():
        plain = kda_chunk(q, k, v, g, beta, s0, piece_tokens=piece, backend="torch")
    tracked = kda_chunk(q.requires_grad_(True), k, v, g, beta, s0, piece_tokens=piece)
    assert tracked.o.grad_fn is not None and plain.o.grad_fn is None
    for a, b in zip(plain, tracked):
        assert torch.equal(a, b.detach())


def test_piece_tokens_for():
    assert piece_tokens_for(1, 4, 128, 128) == 256      # 2 KiB per token: 512 KiB pieces
    assert piece_tokens_for(1, 4, 32, 32) == 1024       # the demo model's KDA heads
    assert piece_tokens_for(64, 4, 128, 128) == 256     # never under 4 chunks


def test_a_chunk_without_forgetting_is_bitwise_the_same_beside_one_with_it():
    """g = -inf in the second chunk only: the first chunk's outputs and states are bitwise those of a
    call on the first chunk alone (the -inf handling is a no-op elsewhere; the call-wide flag is safe)."""
    gen = torch.Generator().manual_seed(5)
    B, T, H, V = 1, 128, 2, 6
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v, beta = torch.randn(B, T, H, V, generator=gen), torch.rand(B, T, H, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * 0.1
    g[:, 100, 0, :3] = -math.inf
    both = kda_chunk(q, k, v, g, beta, piece_tokens=64)
    first = kda_chunk(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64])
    assert torch.equal(both.o[:, :64], first.o) and torch.equal(both.h[:, 1], first.final_state)
