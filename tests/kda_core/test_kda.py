"""kda_core.kda: recurrent vs chunk, fla's naive oracle, the h convention, gates, validation."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kda_core.chunk import kda_chunk
from kda_core.kda import NonFiniteError, kda_gate, kda_recurrent, kda_step, kda_step_with_correction

B, H, K, V = 2, 3, 16, 12  # K != V so a transposed state cannot pass


def _inputs(T, dtype, regime, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    f = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    if regime == "mild":
        g = -torch.rand(B, T, H, K, generator=gen, dtype=dtype) * 0.1
    elif regime == "softplus":  # strong decay: A = 16, dt_bias = +3
        g = kda_gate(f, torch.full((H,), math.log(16.0), dtype=dtype), torch.full((H * K,), 3.0, dtype=dtype))
    else:  # lower bound pinned at -5 for the whole chunk
        g = torch.full((B, T, H, K), -5.0, dtype=dtype)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    s0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return q, k, v, g.to(dtype), beta, s0


@pytest.mark.parametrize("regime", ["mild", "softplus", "lowerbound"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 150], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
def test_chunk_matches_recurrent(T, regime, dtype, tol):
    q, k, v, g, beta, s0 = _inputs(T, dtype, regime)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, s0)
    o_c, s_c, _ = kda_chunk(q, k, v, g, beta, s0)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert (o_r - o_c).abs().max() <= tol
    assert (s_r - s_c).abs().max() <= tol
    assert o_c.dtype == dtype


def _fla_naive():
    import fla  # fla-core: importing fla.ops needs triton, so load naive.py by file path
    path = Path(fla.__file__).parent / "ops" / "kda" / "naive.py"
    spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("T", [64, 128], ids=lambda t: f"T{t}")
def test_against_fla_naive(T):
    naive = _fla_naive()
    q, k, v, g, beta, s0 = _inputs(T, torch.float32, "mild")
    o_ref, s_ref = naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o_ch, s_ch = naive.naive_chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, s0)
    o_c, s_c, _ = kda_chunk(q, k, v, g, beta, s0)
    for ours in (o_r, o_c):
        assert (ours - o_ref).abs().max() <= 1e-5
        assert (ours - o_ch).abs().max() <= 1e-5
    for ours in (s_r, s_c):
        assert (ours - s_ref).abs().max() <= 1e-5


@pytest.mark.parametrize("T", [192, 128])
def test_h_convention(T):
    q, k, v, g, beta, s0 = _inputs(T, torch.float64, "mild")
    _, _, states = kda_recurrent(q, k, v, g, beta, s0, output_states=True)
    _, final, h = kda_chunk(q, k, v, g, beta, s0)
    assert h.shape == (B, T // 64, H, K, V)
    assert torch.equal(h[:, 0], s0)
    for j in range(1, T // 64):
        assert (h[:, j] - states[:, 64 * j - 1]).abs().max() <= 1e-10
    assert (final - states[:, -1]).abs().max() <= 1e-10
    assert not torch.allclose(final, h[:, -1])


def test_step_matches_formula_and_is_pure():
    q, k, v, g, beta, s0 = _inputs(1, torch.float64, "mild")
    s_copy = s0.clone()
    o, s = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
    assert torch.equal(s0, s_copy)
    Sd = torch.exp(g[:, 0]).unsqueeze(-1) * s0
    u = beta[:, 0, :, None] * (v[:, 0] - torch.einsum("bhkv,bhk->bhv", Sd, k[:, 0]))
    S = Sd + torch.einsum("bhk,bhv->bhkv", k[:, 0], u)
    assert torch.allclose(s, S, atol=1e-12)
    assert torch.allclose(o, torch.einsum("bhkv,bhk->bhv", S, q[:, 0] * K ** -0.5), atol=1e-12)
    o2, s2, u2 = kda_step_with_correction(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
    assert torch.equal(s2, s) and torch.allclose(u2, u, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 52])   # 52: a draw where the sigmoid saturates
def test_gates(seed):
    """The gate's range is [lower_bound, 0]: mathematically open, but sigmoid rounds to exactly 1 in float64 for
    arguments above ~37 (A_log.exp() up to e^3 times f + dt up to ~6 reaches it), so the bound itself is reached.
    Regression: the test asserted lb > -5.0 on unseeded inputs and failed when an earlier test left the global RNG
    where the draw saturated."""
    gen = torch.Generator().manual_seed(seed)
    f = torch.randn(2, 5, H, K, dtype=torch.float64, generator=gen)
    A_log = torch.randn(H, dtype=torch.float64, generator=gen)
    dt = torch.randn(H * K, dtype=torch.float64, generator=gen)
    g = kda_gate(f, A_log, dt)
    ref = -A_log.exp().view(H, 1) * F.softplus(f + dt.view(H, K))
    assert torch.allclose(g, ref, atol=1e-12) and (g <= 0).all()
    lb = kda_gate(f, A_log, dt, lower_bound=-5.0)
    ref = -5.0 * torch.sigmoid(A_log.exp().view(H, 1) * (f + dt.view(H, K)))
    assert torch.allclose(lb, ref, atol=1e-12) and (lb >= -5.0).all() and (lb <= 0).all()


def test_outputs_keep_v_dtype():
    q, k, v, g, beta, s0 = _inputs(10, torch.float32, "mild")
    o, _ = kda_recurrent(q, k, v.to(torch.bfloat16), g, beta, s0)
    assert o.dtype == torch.bfloat16


@pytest.mark.parametrize("bad,match", [
    (dict(k=torch.zeros(B, 5, H, K + 1)), "k must have shape"),
    (dict(v=torch.zeros(B, 4, H, V)), "v must have shape"),
    (dict(beta=torch.zeros(B, 5, H, 1)), "beta must have shape"),
    (dict(initial_state=torch.zeros(B, H, V, K)), r"initial_state must have shape \[B, H, K, V\]"),
])
def test_validation(bad, match):
    q, k, v, g, beta, s0 = _inputs(5, torch.float32, "mild")
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        kda_chunk(**args)
    with pytest.raises(ValueError, match=match):
        kda_recurrent(**args)


def test_chunk_size_validation():
    q, k, v, g, beta, s0 = _inputs(5, torch.float32, "mild")
    with pytest.raises(ValueError, match="chunk_size"):
        kda_chunk(q, k, v, g, beta, chunk_size=48)


def test_chunk_pieces_equal_one_piece():
    q, k, v, g, beta, s0 = _inputs(300, torch.float64, "softplus")
    whole = kda_chunk(q, k, v, g, beta, s0, piece_tokens=512)
    pieces = kda_chunk(q, k, v, g, beta, s0, piece_tokens=128)
    assert torch.equal(whole.o, pieces.o) and torch.equal(whole.final_state, pieces.final_state)
    assert torch.equal(whole.h, pieces.h) and whole.h.shape[1] == 5
    with pytest.raises(ValueError, match="piece_tokens"):
        kda_chunk(q, k, v, g, beta, piece_tokens=100)


FORGET_AT = {  # (token, head, key dims) where g = -inf (full forgetting); chunk size 16, T = 50
    "token0-all-dims": [(0, 0, slice(None))],
    "mid-chunk-one-dim": [(5, 1, slice(3, 4))],
    "chunk-start": [(16, 2, slice(0, 8))],
    "chunk-end": [(15, 0, slice(None))],
    "twice-in-one-chunk": [(18, 1, slice(None)), (27, 1, slice(2, 9))],
    "every-head-last-token": [(49, h, slice(None)) for h in range(H)],
}


@pytest.mark.parametrize("where", list(FORGET_AT))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
def test_chunk_full_forgetting_matches_recurrent(where, dtype, tol):
    """g = -inf zeroes the decayed state rows: the chunk form must give the recurrent result, never
    exp(-inf - -inf) = NaN (which made the whole output NaN)."""
    q, k, v, g, beta, s0 = _inputs(50, dtype, "softplus")
    for t, h, dims in FORGET_AT[where]:
        g[:, t, h, dims] = -math.inf
    o_r, s_r = kda_recurrent(q, k, v, g, beta, s0)
    assert torch.isfinite(o_r).all()
    for piece_tokens in (1024, 32):               # one piece, and pieces carrying the state
        o_c, s_c, h_c = kda_chunk(q, k, v, g, beta, s0, chunk_size=16, piece_tokens=piece_tokens)
        assert torch.isfinite(o_c).all() and torch.isfinite(h_c).all()
        assert (o_r - o_c).abs().max() <= tol and (s_r - s_c).abs().max() <= tol


def test_chunk_full_forgetting_forgets_the_initial_state():
    """-inf in every key dim at token 0: the initial state must not matter at all."""
    q, k, v, g, beta, s0 = _inputs(20, torch.float64, "mild")
    g[:, 0] = -math.inf
    a = kda_chunk(q, k, v, g, beta, s0, chunk_size=8)
    b = kda_chunk(q, k, v, g, beta, 100 * s0, chunk_size=8)
    assert (a.o - b.o).abs().max() <= 1e-12 and (a.final_state - b.final_state).abs().max() <= 1e-12


@pytest.mark.parametrize("name,value", [("q", math.nan), ("k", math.inf), ("v", math.nan), ("beta", math.nan),
                                        ("g", math.nan), ("g", math.inf), ("initial_state", -math.inf)])
def test_chunk_rejects_non_finite_inputs(name, value):
    """A NaN at token 5 used to poison tokens 0-4 of its chunk (the chunk form mixes a chunk's tokens);
    now it is a ValueError naming the tensor."""
    q, k, v, g, beta, s0 = _inputs(20, torch.float32, "mild")
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0)
    args[name] = args[name].clone()
    args[name].view(-1)[5 * H if name == "beta" else 7] = value
    with pytest.raises(NonFiniteError, match=f"^{name} must be"):   # g / beta: "must be ... in [..]" (their domain)
        kda_chunk(**args)


def _three_forms(q, k, v, g, beta, s0, **kw):
    """kda_chunk, kda_recurrent and kda_step (token 0) on the same inputs: callables for pytest.raises."""
    return [lambda: kda_chunk(q, k, v, g, beta, s0, **kw), lambda: kda_recurrent(q, k, v, g, beta, s0, **kw),
            lambda: kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0, **kw)]


@pytest.mark.parametrize("name, value, match", [
    pytest.param("g", 10.0, r"g must be a log decay in \[-inf, 0\].*1 element\(s\) > 0 \(max 10\)", id="g+10"),
    pytest.param("g", 1e-3, r"g must be a log decay in \[-inf, 0\]", id="g-slightly-positive"),
    pytest.param("g", math.nan, r"g must be a log decay .* and 1 NaN", id="g-nan"),
    pytest.param("beta", 1e6, r"beta must be in \[0, 1\].*1 element\(s\) outside", id="beta-1e6"),
    pytest.param("beta", -0.5, r"beta must be in \[0, 1\]", id="beta-negative"),
    pytest.param("beta", math.nan, r"beta must be in \[0, 1\].* and 1 NaN", id="beta-nan"),
])
def test_gates_outside_their_domain_are_rejected_by_every_form(name, value, match):
    """g = +10 or beta = 1e6 gave silent NaN (and a different NaN count in the chunk form than in the
    loop): the recurrence is no longer a decay there. Every form now refuses the same inputs."""
    q, k, v, g, beta, s0 = _inputs(200, torch.float32, "mild")
    args = dict(g=g.clone(), beta=beta.clone())
    args[name].view(-1)[0] = value                              # token 0, so kda_step sees it too
    for run in _three_forms(q, k, v, args["g"], args["beta"], s0):
        with pytest.raises(ValueError, match=match) as err:
            run()
        assert isinstance(err.value, NonFiniteError) == math.isnan(value)   # the engine aborts on NaN only


def test_gates_on_their_domain_edges_are_accepted():
    """g = 0 (no decay), g = -inf (full forgetting), beta = 0 and beta = 1 are in the domain: the forms agree."""
    q, k, v, g, beta, s0 = _inputs(70, torch.float64, "mild")
    g, beta = g.clone(), beta.clone()
    g[:, 3], g[:, 9], beta[:, 4], beta[:, 5] = 0.0, -math.inf, 0.0, 1.0
    o_c, s_c, _ = kda_chunk(q, k, v, g, beta, s0, chunk_size=16)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, s0)
    assert (o_c - o_r).abs().max() <= 1e-10 and (s_c - s_r).abs().max() <= 1e-10


@pytest.mark.parametrize("dim", ["B", "H", "K", "V"])
def test_a_zero_size_is_rejected(dim):
    """B = 0 / H = 0 raised a reshape RuntimeError, K = 0 a ZeroDivisionError (the default scale)."""
    sizes = dict(B=2, T=5, H=3, K=4, V=3)
    sizes[dim] = 0
    Bz, T, Hz, Kz, Vz = sizes.values()
    q = k = g = torch.zeros(Bz, T, Hz, Kz)
    v, beta, s0 = torch.zeros(Bz, T, Hz, Vz), torch.zeros(Bz, T, Hz), torch.zeros(Bz, Hz, Kz, Vz)
    for run in _three_forms(q, k, v, g, beta, s0):
        with pytest.raises(ValueError, match=f"B, H, K and V must be >= 1, got .*{dim}=0"):
            run()


def test_no_tokens_give_no_outputs_and_the_initial_state():
    *xs, s0 = _inputs(5, torch.float64, "mild")
    q, k, v, g, beta = (t[:, :0] for t in xs)                      # T = 0
    for o, s, *_ in (kda_chunk(q, k, v, g, beta, s0), kda_recurrent(q, k, v, g, beta, s0)):
        assert o.shape == (B, 0, H, V) and torch.equal(s, s0)


@pytest.mark.parametrize("kw, match", [
    pytest.param(dict(scale="x"), "scale must be None", id="scale-str"),
    pytest.param(dict(scale=math.nan), "scale must be None", id="scale-nan"),
    pytest.param(dict(scale=math.inf), "scale must be None", id="scale-inf"),
    pytest.param(dict(scale=True), "scale must be None", id="scale-bool"),
    pytest.param(dict(scale=0.0), "scale must be None", id="scale-0"),
])
def test_bad_scale_is_rejected_by_every_form(kw, match):
    """scale='x' raised a TypeError from torch; NaN / inf gave silent NaN outputs."""
    q, k, v, g, beta, s0 = _inputs(5, torch.float32, "mild")
    for run in _three_forms(q, k, v, g, beta, s0, **kw):
        with pytest.raises(ValueError, match=match):
            run()


@pytest.mark.parametrize("kw", [dict(chunk_size=True), dict(piece_tokens=True)], ids=["chunk-True", "piece-True"])
def test_a_bool_is_not_a_chunk_size(kw):
    """chunk_size=True passed the power-of-two check (True & 0 == 0) and failed in torch.eye."""
    q, k, v, g, beta, s0 = _inputs(5, torch.float32, "mild")
    with pytest.raises(ValueError, match="chunk_size must be|piece_tokens must be"):
        kda_chunk(q, k, v, g, beta, s0, **kw)
