"""kda_core.wy: the chunk-level form of a unit's WY quantities equals the sub-chunk / halving form within
its decay bound, units past the bound (or with g = -inf) take the safe form unit by unit, a unit's result
does not depend on its neighbours, and autograd through the chunk-level form stays finite up to the bound."""
import math

import pytest
import torch
import torch.nn.functional as F

import kda_core.wy as wy
from kda_core.chunk import kda_chunk
from kda_core.kda import kda_recurrent

C, K, V = 64, 8, 6


def _units(rates, dtype=torch.float64, seed=0):
    """g, k, q ``[n, C, K]``, v ``[n, C, V]``, b ``[n, C, 1]``: unit i decays by about ``rates[i]`` nats
    per token (times U(0.5, 1.5) per element)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(rates)
    rate = torch.as_tensor(rates, dtype=dtype).reshape(-1, 1, 1)
    g = -rate * (0.5 + torch.rand(n, C, K, generator=gen, dtype=dtype))
    k, q = (F.normalize(torch.randn(n, C, K, generator=gen, dtype=dtype), dim=-1) for _ in range(2))
    v = torch.randn(n, C, V, generator=gen, dtype=dtype)
    b = torch.rand(n, C, 1, generator=gen, dtype=dtype)
    return g, k, q, v, b


def test_cumulative_decay_is_the_cumsum():
    g = _units([0.3, 2.0])[0]
    torch.testing.assert_close(wy.cumulative_decay(g), g.cumsum(-2), rtol=1e-12, atol=1e-12)


def test_chunk_level_form_equals_the_safe_form_within_its_bound():
    # chunks decaying by up to 64 * 1.5 * 0.6 = 57.6 nats < 60: within the bound
    g, k, q, v, b = _units([0.01, 0.3, 0.6])
    G = wy.cumulative_decay(g)
    assert (G[:, -1] >= -wy.MAX_CHUNK_DECAY).all()
    fast = wy.wy_fast(G, k, q, v, b, grad=False)
    safe = wy.wy_safe(g, k, q, v, b, may_forget=False)
    for name, a, s in zip(wy.WY._fields, fast, safe):
        torch.testing.assert_close(a, s, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_units_past_the_bound_take_the_safe_form():
    g, k, q, v, b = _units([0.1, 3.0, 0.1, 30.0], dtype=torch.float32)
    out = wy.wy_units(g, k, q, v, b, may_forget=False)
    ref = wy.wy_safe(*(t.double() for t in (g, k, q, v, b)), may_forget=False)
    for name, a, s in zip(wy.WY._fields, out, ref):
        assert torch.isfinite(a).all(), name
        assert (a.double() - s).abs().max() <= 1e-5, name


def test_the_bound_is_what_keeps_fp32_finite(monkeypatch):
    """With the bound lifted the chunk-level form takes a ~190-nat chunk and exp(-G) overflows."""
    monkeypatch.setattr(wy, "MAX_CHUNK_DECAY", math.inf)
    g, k, q, v, b = _units([3.0], dtype=torch.float32)
    out = wy.wy_units(g, k, q, v, b, may_forget=False)
    assert not all(torch.isfinite(t).all() for t in out)


@pytest.mark.parametrize("may_forget", [False, True])
def test_a_units_result_does_not_depend_on_its_neighbours(may_forget):
    """Bitwise: each unit alone equals the same unit beside units of the other form (and beside a unit
    with g = -inf), what keeps a prefill split on the 64-token grid bitwise the unsplit one."""
    g, k, q, v, b = _units([0.1, 3.0, 0.5, 30.0, 0.2], dtype=torch.float32)
    if may_forget:
        g[4, 10, 2] = -math.inf
    every = wy.wy_units(g, k, q, v, b, may_forget)
    for i in range(5):
        one = wy.wy_units(*(t[i:i + 1] for t in (g, k, q, v, b)), may_forget)
        for name, a, s in zip(wy.WY._fields, every, one):
            assert torch.equal(a[i], s[0]), (i, name)


@pytest.mark.parametrize("rate", [0.85, 1.0], ids=["under-bound", "over-bound"])
def test_kda_chunk_near_the_chunk_bound_matches_recurrent(rate):
    """A constant decay of ~0.85 vs ~1.0 nats per token: 64-token chunks decay by ~54 vs ~64 nats,
    either side of the 60-nat bound, fp32."""
    gen = torch.Generator().manual_seed(3)
    B, T, H = 1, 150, 2
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v, beta = torch.randn(B, T, H, V, generator=gen), torch.rand(B, T, H, generator=gen)
    g = torch.full((B, T, H, K), -rate)
    o_r, s_r = kda_recurrent(q, k, v, g, beta)
    o_c, s_c, _ = kda_chunk(q, k, v, g, beta)
    assert (o_c - o_r).abs().max() <= 1e-5 and (s_c - s_r).abs().max() <= 1e-5


def test_gradients_stay_finite_up_to_the_bound():
    """fp32 autograd through a chunk that decays by ~59 nats (the chunk-level form): every gradient is
    finite and close to the fp64 recurrent one (``1 / exp(G)`` in place of ``exp(-G)`` would need
    ``exp(G)^2 ~ e^-118``, zero in fp32, in its gradient)."""
    gen = torch.Generator().manual_seed(6)
    B, T, H = 1, 64, 1
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v, beta = torch.randn(B, T, H, V, generator=gen), torch.rand(B, T, H, generator=gen)
    g = torch.full((B, T, H, K), -59.0 / 64)
    w_o = torch.randn(B, T, H, V, generator=gen)
    grads = {}
    for name, fn, dt in (("chunk", lambda *a: kda_chunk(*a)[0], torch.float32),
                         ("recurrent", lambda *a: kda_recurrent(*a)[0], torch.float64)):
        leaves = [t.to(dt).clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        (fn(*leaves) * w_o.to(dt)).sum().backward()
        grads[name] = [t.grad for t in leaves]
    for name, a, r in zip("q k v g beta".split(), grads["chunk"], grads["recurrent"]):
        assert torch.isfinite(a).all(), name
        assert (a.double() - r).abs().max() <= 1e-3 * max(1.0, r.abs().max().item()), name
