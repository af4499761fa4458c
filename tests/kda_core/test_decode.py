"""kda_core.decode: the fused C decode step equals the torch form bitwise (outputs, records, both pools), by slot
in place, on dense pools and on strided views of an arena; pad rows (-1) are never read or written; bad
arguments are refused; a failed self-check, a turned-off kernel or an unsupported call runs the torch form."""
from dataclasses import replace

import pytest
import torch

from kda_core import decode
from kda_core.config import PRESETS
from kda_core.decode import PAD_SLOT, fused_decode, kda_decode, torch_decode
from kda_core.layer import KDALayer

# skipped only where the library cannot be built or loaded (no compiler, not x86-64): a kernel that builds but
# fails its self-check makes these tests fail, not skip
needs_fused = pytest.mark.skipif(isinstance(decode.load(), str), reason="the fused decode cannot be built here")


def make_layer(**cfg):
    return KDALayer(replace(PRESETS["demo"], **cfg), torch.Generator().manual_seed(1))


def inputs(layer, B, seed):
    cfg, gen = layer.cfg, torch.Generator().manual_seed(seed)
    H, K = cfg.num_heads, cfg.head_k_dim
    return torch.randn(B, cfg.conv_dim, generator=gen), -torch.rand(B, H, K, generator=gen), torch.rand(B, H, generator=gen)


def pools(layer, S, seed, spare=0):
    """rec [S, H, K, V] and conv [S, C, W-1] as views of one arena row per slot (``spare`` words after them)."""
    cfg = layer.cfg
    n_rec = cfg.num_heads * cfg.head_k_dim * cfg.head_v_dim
    n_conv = cfg.conv_dim * (cfg.conv_kernel - 1)
    arena = torch.randn(S, n_rec + n_conv + spare, generator=torch.Generator().manual_seed(seed)) * 0.3
    return (arena[:, :n_rec].view(S, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim),
            arena[:, n_rec: n_rec + n_conv].view(S, cfg.conv_dim, cfg.conv_kernel - 1))


def clone(p):
    return tuple(t.clone() for t in p)


def assert_same(got, want, live):
    for name in ("o", "k", "u", "g"):
        assert torch.equal(getattr(got, name)[live], getattr(want, name)[live]), name


@needs_fused
@pytest.mark.parametrize("shape", [
    pytest.param({}, id="demo-H4-K32-V32"),
    pytest.param(dict(num_heads=2, head_k_dim=80, head_v_dim=64), id="H2-K80-V64"),
    pytest.param(dict(num_heads=3, head_k_dim=48, head_v_dim=32, conv_kernel=3), id="H3-K48-V32-W3"),
])
@pytest.mark.parametrize("spare", [pytest.param(0, id="dense"), pytest.param(13, id="strided")])
def test_fused_decode_equals_torch_bitwise(shape, spare):
    layer = make_layer(**shape)
    if shape and decode.reason(layer) is not None:     # the shipped shape must run fused wherever the library loads
        pytest.skip(f"ATen sums this shape in another order here: {decode.reason(layer)}")
    slot_idx = torch.tensor([4, PAD_SLOT, 0, 2])
    p_fused = pools(layer, 6, 0, spare)
    p_torch = clone(p_fused)
    for step in range(3):                                                  # three tokens: the window shifts
        raw, g, beta = inputs(layer, 4, step)
        raw[1] = float("nan")                                               # the pad row: NaN, as in the engine
        got = kda_decode(layer, raw, g, beta, *p_fused, slot_idx, backend="fused")
        want = kda_decode(layer, raw, g, beta, *p_torch, slot_idx, backend="torch")
        assert_same(got, want, [0, 2, 3])
        for a, b in zip(p_fused, p_torch):
            assert torch.equal(a, b)


@needs_fused
@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_pad_rows_are_never_read_or_written(backend):
    """Unused slots hold NaN and stay NaN; a pad row (-1, NaN input) changes no slot, and slot 0 (a live row's)
    is not touched by it: -1 is not clamped to 0. Each live row is bitwise its row alone."""
    layer = make_layer()
    rec, conv = pools(layer, 5, 0)
    rec[[1, 3]], conv[[1, 3]] = float("nan"), float("nan")
    raw, g, beta = inputs(layer, 3, 1)
    raw[0] = float("nan")
    alone = [clone((rec, conv)) for _ in range(2)]
    outs_alone = [kda_decode(layer, raw[i: i + 1], g[i: i + 1], beta[i: i + 1], *alone[j],
                             torch.tensor([s]), backend=backend) for j, (i, s) in enumerate(((1, 0), (2, 4)))]
    before = clone((rec, conv))
    out = kda_decode(layer, raw, g, beta, rec, conv, torch.tensor([PAD_SLOT, 0, 4]), backend=backend)
    for pool, old in zip((rec, conv), before):
        assert pool[[1, 3]].isnan().all()                                  # never written
        assert torch.equal(pool[2], old[2])
    assert torch.equal(rec[0], alone[0][0][0]) and torch.equal(conv[0], alone[0][1][0])
    assert torch.equal(rec[4], alone[1][0][4]) and torch.equal(conv[4], alone[1][1][4])
    assert torch.equal(out.o[1], outs_alone[0].o[0]) and torch.equal(out.o[2], outs_alone[1].o[0])
    assert torch.isfinite(rec[[0, 4]]).all()


@needs_fused
def test_non_finite_input_stays_in_its_row():
    """A NaN / inf in one live row's input reaches that row's outputs and slot only, in both forms alike."""
    layer = make_layer()
    raw, g, beta = inputs(layer, 3, 2)
    v0 = 2 * layer.cfg.num_heads * layer.cfg.head_k_dim                    # first v channel: reaches the state
    raw[1, v0 + 5] = float("nan")
    raw[2, 0] = float("inf")                                               # a q channel: the output only
    p_fused = pools(layer, 3, 3)
    p_torch = clone(p_fused)
    got = kda_decode(layer, raw, g, beta, *p_fused, torch.tensor([0, 1, 2]), backend="fused")
    want = kda_decode(layer, raw, g, beta, *p_torch, torch.tensor([0, 1, 2]), backend="torch")
    assert torch.isfinite(got.o[0]).all() and torch.isfinite(p_fused[0][0]).all()
    assert not torch.isfinite(got.o[1]).all() and not torch.isfinite(p_fused[0][1]).all()
    assert not torch.isfinite(got.o[2]).all() and torch.isfinite(p_fused[0][2]).all()
    for a, b in [(got.o, want.o), (got.u, want.u), *zip(p_fused, p_torch)]:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("bad,match", [
    (lambda a: a.update(raw=a["raw"][:, :-1]), "raw must have shape"),
    (lambda a: a.update(g=a["g"][..., :-1]), "g must have shape"),
    (lambda a: a.update(beta=a["beta"][:1]), "beta must have shape"),
    (lambda a: a.update(rec=a["rec"][..., :-1]), "rec must have shape"),
    (lambda a: a.update(conv=a["conv"][1:]), "same S slots"),
    (lambda a: a.update(slot_idx=torch.tensor([0, 3])), r"slots in \[0, 3\)"),
    (lambda a: a.update(slot_idx=torch.tensor([1, 1])), "live slot twice"),
    (lambda a: a.update(slot_idx=torch.tensor([0, -2])), r"slots in \[0, 3\)"),
    (lambda a: a.update(slot_idx=torch.tensor([0, 1], dtype=torch.int32)), "int64"),
    (lambda a: a.update(backend="gpu"), "backend must be one of"),
], ids=["raw", "g", "beta", "rec", "S", "range", "twice", "minus2", "int32", "backend"])
def test_bad_arguments_are_refused(bad, match):
    layer = make_layer()
    raw, g, beta = inputs(layer, 2, 0)
    rec, conv = pools(layer, 3, 0)
    args = dict(raw=raw, g=g, beta=beta, rec=rec, conv=conv, slot_idx=torch.tensor([0, 1]), backend="auto")
    bad(args)
    before = clone((rec, conv))
    with pytest.raises(ValueError, match=match):
        kda_decode(layer, **args)
    assert torch.equal(rec, before[0]) and torch.equal(conv, before[1])


def test_fused_refuses_what_it_cannot_run_and_auto_runs_torch():
    """fp64 pools, or a slot whose state is not contiguous: "fused" raises, "auto" gives the torch form."""
    layer = make_layer()
    raw, g, beta = inputs(layer, 2, 0)
    rec, conv = pools(layer, 3, 0)
    wide = torch.randn(3, *rec.shape[1:-1], 2 * rec.shape[-1])[..., ::2]   # [S, H, K, V] with stride 2 in V
    for r in (rec.double(), wide):
        with pytest.raises(RuntimeError, match="does not run this call"):
            kda_decode(layer, raw, g, beta, r, conv.clone(), torch.tensor([0, 1]), backend="fused")
    r1, c1 = wide.clone(), conv.clone()
    got = kda_decode(layer, raw, g, beta, wide, conv, torch.tensor([0, 1]))
    want = torch_decode(layer, raw, g, beta, r1, c1, torch.tensor([0, 1]))
    assert_same(got, want, [0, 1])
    assert torch.equal(wide, r1)


@needs_fused
def test_failing_self_check_runs_the_torch_form(monkeypatch):
    """A C form whose bits differ from the torch form fails its self-check: "auto" runs torch, "fused" raises."""
    monkeypatch.setattr(decode, "_shapes", {})
    real = decode.fused_decode

    def off_by_one_ulp(*args):
        out = real(*args)
        return out._replace(o=torch.nextafter(out.o, torch.full_like(out.o, float("inf"))))

    monkeypatch.setattr(decode, "fused_decode", off_by_one_ulp)
    layer = make_layer()
    assert "self-check failed: o differs" in decode.reason(layer)
    assert decode.backend(layer) == "torch"
    raw, g, beta = inputs(layer, 2, 0)
    p = pools(layer, 2, 0)
    want = torch_decode(layer, raw, g, beta, *clone(p), torch.tensor([1, 0]))
    assert_same(kda_decode(layer, raw, g, beta, *p, torch.tensor([1, 0])), want, [0, 1])
    with pytest.raises(RuntimeError, match="self-check failed"):
        kda_decode(layer, raw, g, beta, *p, torch.tensor([1, 0]), backend="fused")


def test_turned_off_runs_the_torch_form(monkeypatch):
    monkeypatch.setattr(decode, "_shapes", {})
    monkeypatch.setattr(decode, "_lib", [])
    monkeypatch.setenv("KDA_CPU_KERNEL", "0")
    layer = make_layer()
    assert decode.reason(layer) == "turned off by KDA_CPU_KERNEL=0" and decode.backend(layer) == "torch"


@needs_fused
def test_fused_decode_is_row_invariant():
    """Each row of a batch of 9 (permuted slots) is bitwise the same row decoded alone."""
    layer = make_layer()
    raw, g, beta = inputs(layer, 9, 4)
    slots = torch.randperm(12, generator=torch.Generator().manual_seed(0))[:9]
    p = pools(layer, 12, 5)
    singles = clone(p)
    out = fused_decode(layer, raw, g, beta, *p, slots)
    for i in range(9):
        one = fused_decode(layer, raw[i: i + 1], g[i: i + 1], beta[i: i + 1], *singles, slots[i: i + 1])
        assert torch.equal(out.o[i], one.o[0]) and torch.equal(out.u[i], one.u[0])
    assert all(torch.equal(a, b) for a, b in zip(p, singles))


@pytest.mark.parametrize("B,T", [(1, 1), (3, 1), (2, 70)])
def test_split_qkv_normalises_q_and_k_as_two_calls(B, T):
    """q and k normalised in one call over their 2H heads: bitwise the two separate L2 norms (each head's sum and
    rsqrt depend on that head alone), q from the first HK channels, k from the next HK, v the rest."""
    from kda_core.invariant import pointwise
    from kda_core.layer import l2norm
    layer = make_layer()
    H, K, V = layer.cfg.num_heads, layer.cfg.head_k_dim, layer.cfg.head_v_dim
    y = torch.randn(B, T, layer.cfg.conv_dim, generator=torch.Generator().manual_seed(B * T))
    q, k, v = layer.split_qkv(y)
    act = pointwise(torch.nn.functional.silu, y)
    assert torch.equal(q, l2norm(act[..., : H * K].reshape(B, T, H, K)))
    assert torch.equal(k, l2norm(act[..., H * K: 2 * H * K].reshape(B, T, H, K)))
    assert torch.equal(v, act[..., 2 * H * K:].reshape(B, T, H, V))


def test_a_conv_width_the_kernel_refuses_runs_the_torch_form(monkeypatch):
    """The C conv takes windows up to 64; a wider one fails the self-check and the torch form runs."""
    monkeypatch.setattr(decode, "_shapes", {})
    layer = make_layer(conv_kernel=65)
    if isinstance(decode.load(), str):
        pytest.skip(decode.load())
    assert "bad sizes" in decode.reason(layer) and decode.backend(layer) == "torch"


@pytest.mark.parametrize("backend", [pytest.param("torch"), pytest.param("fused", marks=needs_fused)])
@pytest.mark.parametrize("spare", [pytest.param(0, id="dense"), pytest.param(13, id="strided")])
def test_out_leaves_the_pools_untouched_and_holds_what_in_place_writes(backend, spare):
    """With ``out`` (the engine's mode: the step's states are written by slot when it commits) the pools are only
    read, each live row's new states land in its row of ``out`` bitwise as the in-place call writes them at its
    slot, the outputs are the same bits, and a pad row's ``out`` row is left as it was."""
    layer = make_layer()
    slot_idx = torch.tensor([4, PAD_SLOT, 0, 2])
    live = slot_idx != PAD_SLOT
    raw, g, beta = inputs(layer, 4, 3)
    read_only, in_place = pools(layer, 6, 0, spare), pools(layer, 6, 0, spare)
    before = clone(read_only)
    cfg = layer.cfg
    out = (torch.full((4, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim), 7.0),
           torch.full((4, cfg.conv_dim, cfg.conv_kernel - 1), 7.0))
    got = kda_decode(layer, raw, g, beta, *read_only, slot_idx, backend=backend, out=out)
    want = kda_decode(layer, raw, g, beta, *in_place, slot_idx, backend=backend)
    assert_same(got, want, live)
    assert all(torch.equal(a, b) for a, b in zip(read_only, before)), "a pool was written"
    slots = slot_idx[live]
    assert torch.equal(out[0][live], in_place[0][slots]) and torch.equal(out[1][live], in_place[1][slots])
    assert bool((out[0][~live] == 7.0).all()) and bool((out[1][~live] == 7.0).all()), "a pad row's out was written"


def test_a_sixteen_bit_pool_is_upcast_when_read():
    """A bf16 state pool (a 16-bit stored state) runs the torch form on its exact fp32 upcast."""
    layer = make_layer()
    slot_idx = torch.tensor([1, 0])
    raw, g, beta = inputs(layer, 2, 4)
    rec, conv = pools(layer, 3, 1)
    rec16 = rec.to(torch.bfloat16)
    cfg = layer.cfg
    out = (torch.empty(2, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim), torch.empty(2, cfg.conv_dim, cfg.conv_kernel - 1))
    got = kda_decode(layer, raw, g, beta, rec16, conv, slot_idx, out=out)
    want = kda_decode(layer, raw, g, beta, rec16.float(), conv.clone(), slot_idx, backend="torch")
    assert_same(got, want, torch.ones(2, dtype=torch.bool))
