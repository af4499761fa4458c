"""kda_core.decode: the fused C form of a KDA layer's token-by-token part agrees with the torch form within
``decode.TOLERANCE`` (outputs, records, both pools; both gates; dense pools and strided views of an arena), and is
bitwise equal to itself wherever the engine needs it: a row batched == the row alone, T tokens in one call == T
calls of one token, ``KDALayer.forward(mode="recurrent")`` == the engine's decode rows. Pad rows (-1) are never
read or written; bad arguments are refused; a failed self-check or a turned-off kernel runs the torch form."""
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kda_core import decode, decode_cpu
from kda_core.config import PRESETS
from kda_core.decode import PAD_SLOT, TOLERANCE, fused_decode, kda_decode, torch_decode
from kda_core.layer import KDALayer

# skipped only where the library cannot be built or loaded (no compiler, not x86-64): a kernel that builds but
# fails its self-check makes these tests fail, not skip
needs_fused = pytest.mark.skipif(isinstance(decode.load(), str), reason="the fused decode cannot be built here")
FIELDS = ("y", "k", "u", "g")


def make_layer(preset="demo", **cfg):
    return KDALayer(replace(PRESETS[preset], **cfg), torch.Generator().manual_seed(1))


def inputs(layer, B, seed, T=1):
    """raw, f_low, b, g_low ``[B, T, *]``: what ``project_inputs`` gives."""
    cfg, gen = layer.cfg, torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, T, n, generator=gen) for n in
                 (cfg.conv_dim, layer.f_b.shape[1], cfg.num_heads, layer.g_b.shape[1]))


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


def pad(ins, row):
    for t in ins:
        t[row] = float("nan")                                              # a pad row's input: NaN, as the engine's
    return ins


def assert_close(got, want, live):
    for name in FIELDS:
        torch.testing.assert_close(getattr(got, name)[live], getattr(want, name)[live], **TOLERANCE, msg=name)


def assert_same(got, want, live, fields=FIELDS):
    for name in fields:
        assert torch.equal(getattr(got, name)[live], getattr(want, name)[live]), name


@needs_fused
@pytest.mark.parametrize("shape", [
    pytest.param(("demo", {}), id="demo-H4-K32-V32-softplus"),
    pytest.param(("demo-k3gate", {}), id="demo-lower-bound-gate"),
    pytest.param(("demo", dict(num_heads=2, head_k_dim=80, head_v_dim=64)), id="H2-K80-V64"),
    pytest.param(("demo", dict(num_heads=3, head_k_dim=48, head_v_dim=32, conv_kernel=3)), id="H3-K48-V32-W3"),
])
@pytest.mark.parametrize("spare", [pytest.param(0, id="dense"), pytest.param(13, id="strided")])
def test_fused_decode_agrees_with_torch(shape, spare):
    """64 tokens (one at a time, then 5 in one call) from random states: every output, record and state of the live
    rows within TOLERANCE of the torch form; measured <= 1.5e-6 on the demo shape."""
    layer = make_layer(shape[0], **shape[1])
    assert decode.reason(layer) is None
    slot_idx = torch.tensor([4, PAD_SLOT, 0, 2])
    p_fused = pools(layer, 6, 0, spare)
    p_torch = clone(p_fused)
    for step in range(64):
        ins = pad(inputs(layer, 4, step, T=5 if step == 63 else 1), 1)
        got = kda_decode(layer, *ins, *p_fused, slot_idx, backend="fused", aux=True)
        want = kda_decode(layer, *ins, *p_torch, slot_idx, backend="torch", aux=True)
        assert_close(got, want, [0, 2, 3])
        for a, b in zip(p_fused, p_torch):
            torch.testing.assert_close(a, b, **TOLERANCE)
    for name in ("q", "v", "beta", "states"):
        torch.testing.assert_close(getattr(got, name)[[0, 2, 3]], getattr(want, name)[[0, 2, 3]], **TOLERANCE)


@needs_fused
def test_the_gate_formula_is_kda_gate():
    """The C gate is :func:`kda_core.kda.kda_gate` for both forms: g of the fused call within TOLERANCE of the torch
    form's g for large and small f (the softplus threshold at 20, the lower bound's saturation)."""
    for preset in ("demo", "demo-k3gate"):
        layer = make_layer(preset)
        raw, f_low, b, g_low = inputs(layer, 3, 7, T=2)
        f_low = f_low * torch.tensor([30.0, 1.0, 0.01]).view(3, 1, 1)      # f far past the threshold, near 0
        p = pools(layer, 3, 1)
        got = kda_decode(layer, raw, f_low, b, g_low, *clone(p), torch.arange(3), backend="fused")
        want = kda_decode(layer, raw, f_low, b, g_low, *clone(p), torch.arange(3), backend="torch")
        torch.testing.assert_close(got.g, want.g, **TOLERANCE)
        assert bool((got.g <= 0).all())


@pytest.mark.parametrize("backend", [pytest.param("torch"), pytest.param("fused", marks=needs_fused)])
def test_pad_rows_are_never_read_or_written(backend):
    """Unused slots hold NaN and stay NaN; a pad row (-1, NaN input) changes no slot, and slot 0 (a live row's)
    is not touched by it: -1 is not clamped to 0. Each live row is bitwise its row alone."""
    layer = make_layer()
    rec, conv = pools(layer, 5, 0)
    rec[[1, 3]], conv[[1, 3]] = float("nan"), float("nan")
    ins = pad(inputs(layer, 3, 1), 0)
    alone = [clone((rec, conv)) for _ in range(2)]
    outs_alone = [kda_decode(layer, *(t[i: i + 1] for t in ins), *alone[j], torch.tensor([s]), backend=backend)
                  for j, (i, s) in enumerate(((1, 0), (2, 4)))]
    before = clone((rec, conv))
    out = kda_decode(layer, *ins, rec, conv, torch.tensor([PAD_SLOT, 0, 4]), backend=backend)
    for pool, old in zip((rec, conv), before):
        assert pool[[1, 3]].isnan().all()                                  # never written
        assert torch.equal(pool[2], old[2])
    assert torch.equal(rec[0], alone[0][0][0]) and torch.equal(conv[0], alone[0][1][0])
    assert torch.equal(rec[4], alone[1][0][4]) and torch.equal(conv[4], alone[1][1][4])
    assert torch.equal(out.y[1], outs_alone[0].y[0]) and torch.equal(out.y[2], outs_alone[1].y[0])
    assert torch.isfinite(rec[[0, 4]]).all() and torch.isfinite(out.y[1:]).all()


@needs_fused
def test_non_finite_input_stays_in_its_row():
    """A NaN / inf in one live row's input reaches that row's outputs and slot only."""
    layer = make_layer()
    ins = inputs(layer, 3, 2)
    v0 = 2 * layer.cfg.num_heads * layer.cfg.head_k_dim                    # first v channel: reaches the state
    ins[0][1, 0, v0 + 5] = float("nan")
    ins[0][2, 0, 0] = float("inf")                                         # a q channel: the output only
    rec, conv = pools(layer, 3, 3)
    got = kda_decode(layer, *ins, rec, conv, torch.tensor([0, 1, 2]), backend="fused")
    assert torch.isfinite(got.y[0]).all() and torch.isfinite(rec[0]).all()
    assert not torch.isfinite(got.y[1]).all() and not torch.isfinite(rec[1]).all()
    assert not torch.isfinite(got.y[2]).all() and torch.isfinite(rec[2]).all()


@pytest.mark.parametrize("bad,match", [
    (lambda a: a.update(raw=a["raw"][..., :-1]), "raw must have shape"),
    (lambda a: a.update(raw=a["raw"][None]), "raw must have shape"),
    (lambda a: a.update(raw=a["raw"][:, 0]), "f_low must have shape"),
    (lambda a: a.update(f_low=a["f_low"][..., :-1]), "f_low must have shape"),
    (lambda a: a.update(b=a["b"][:1]), "b must have shape"),
    (lambda a: a.update(g_low=a["g_low"][:, :0]), "g_low must have shape"),
    (lambda a: a.update(rec=a["rec"][..., :-1]), "rec must have shape"),
    (lambda a: a.update(conv=a["conv"][1:]), "same S slots"),
    (lambda a: a.update(slot_idx=torch.tensor([0, 3])), r"slots in \[0, 3\)"),
    (lambda a: a.update(slot_idx=torch.tensor([1, 1])), "live slot twice"),
    (lambda a: a.update(slot_idx=torch.tensor([0, -2])), r"slots in \[0, 3\)"),
    (lambda a: a.update(slot_idx=torch.tensor([0, 1], dtype=torch.int32)), "int64"),
    (lambda a: a.update(backend="gpu"), "backend must be one of"),
], ids=["raw", "raw-4d", "raw-2d-alone", "f_low", "b", "g_low", "rec", "S", "range", "twice", "minus2", "int32", "backend"])
def test_bad_arguments_are_refused(bad, match):
    layer = make_layer()
    raw, f_low, b, g_low = inputs(layer, 2, 0)
    rec, conv = pools(layer, 3, 0)
    args = dict(raw=raw, f_low=f_low, b=b, g_low=g_low, rec=rec, conv=conv, slot_idx=torch.tensor([0, 1]),
                backend="auto")
    bad(args)
    before = clone((rec, conv))
    with pytest.raises(ValueError, match=match):
        kda_decode(layer, **args)
    assert torch.equal(rec, before[0]) and torch.equal(conv, before[1])


def test_fused_refuses_what_it_cannot_run_and_auto_runs_torch():
    """fp64 inputs or autograd: "fused" raises, "auto" gives the torch form."""
    layer = make_layer()
    ins = inputs(layer, 2, 0)
    p = pools(layer, 3, 0)
    wide = tuple(t.double() for t in ins)
    with pytest.raises(RuntimeError, match="does not run this call"):
        kda_decode(layer, *wide, *clone(p), torch.tensor([0, 1]), backend="fused")
    grad = (ins[0].clone().requires_grad_(),) + ins[1:]
    with pytest.raises(RuntimeError, match="needs no autograd"):
        kda_decode(layer, *grad, *clone(p), torch.tensor([0, 1]), backend="fused")
    got = kda_decode(layer, *grad, *clone(p), torch.tensor([0, 1]))
    want = torch_decode(layer, *ins, *clone(p), torch.tensor([0, 1]))
    assert got.y.requires_grad
    assert_same(got, want, [0, 1])


@needs_fused
def test_failing_self_check_runs_the_torch_form(monkeypatch):
    """A C form off the torch form by more than TOLERANCE fails its self-check: "auto" runs torch, "fused" raises."""
    monkeypatch.setattr(decode, "_shapes", {})
    real = decode.fused_decode

    def off(*args, **kw):
        out = real(*args, **kw)
        return out._replace(y=out.y * 1.001)

    monkeypatch.setattr(decode, "fused_decode", off)
    layer = make_layer()
    assert "self-check failed: y differs" in decode.reason(layer)
    assert decode.backend(layer) == "torch"
    ins = inputs(layer, 2, 0)
    p = pools(layer, 2, 0)
    want = torch_decode(layer, *ins, *clone(p), torch.tensor([1, 0]))
    assert_same(kda_decode(layer, *ins, *p, torch.tensor([1, 0])), want, [0, 1])
    with pytest.raises(RuntimeError, match="self-check failed"):
        kda_decode(layer, *ins, *p, torch.tensor([1, 0]), backend="fused")


def test_turned_off_runs_the_torch_form(monkeypatch):
    monkeypatch.setattr(decode, "_shapes", {})
    monkeypatch.setattr(decode_cpu, "_lib", [])
    monkeypatch.setenv("KDA_CPU_KERNEL", "0")
    layer = make_layer()
    assert decode.reason(layer) == "turned off by KDA_CPU_KERNEL=0" and decode.backend(layer) == "torch"
    g = torch.tensor([-0.3, -1.7])
    assert torch.equal(decode.decay(layer.cfg, g), g.exp())


@needs_fused
def test_fused_decode_is_row_invariant():
    """Each row of a batch of 9 (permuted slots) is bitwise the same row decoded alone."""
    layer = make_layer()
    ins = inputs(layer, 9, 4)
    slots = torch.randperm(12, generator=torch.Generator().manual_seed(0))[:9]
    p = pools(layer, 12, 5)
    singles = clone(p)
    out = fused_decode(layer, *ins, *p, slots)
    for i in range(9):
        one = fused_decode(layer, *(t[i: i + 1] for t in ins), *singles, slots[i: i + 1])
        for name in FIELDS:
            assert torch.equal(getattr(out, name)[i], getattr(one, name)[0]), (name, i)
    assert all(torch.equal(a, b) for a, b in zip(p, singles))


@pytest.mark.parametrize("backend", [pytest.param("torch"), pytest.param("fused", marks=needs_fused)])
def test_tokens_in_one_call_equal_one_call_per_token(backend):
    """T = 6 tokens of 2 rows in one call (a verify row's form, with every token's state) are bitwise 6 calls of
    one token each (the decode rows' form): outputs, records and states."""
    layer = make_layer()
    ins = pad(inputs(layer, 3, 5, T=6), 1)
    slot_idx = torch.tensor([2, PAD_SLOT, 0])
    whole, steps = pools(layer, 3, 6), pools(layer, 3, 6)
    got = kda_decode(layer, *ins, *whole, slot_idx, backend=backend, aux=True)
    for t in range(6):
        one = kda_decode(layer, *(x[:, t: t + 1] for x in ins), *steps, slot_idx, backend=backend)
        for name in FIELDS:
            assert torch.equal(getattr(got, name)[[0, 2], t], getattr(one, name)[[0, 2], 0]), (name, t)
        assert torch.equal(got.states[0, t], steps[0][2]) and torch.equal(got.states[2, t], steps[0][0])
    assert all(torch.equal(a, b) for a, b in zip(whole, steps))


@pytest.mark.parametrize("backend", [pytest.param("torch"), pytest.param("fused", marks=needs_fused)])
def test_one_token_rows_without_a_T_dim(backend):
    """Inputs ``[B, *]`` (the engine's decode rows, no T dim) give bitwise the ``[B, 1, *]`` call without its T dim;
    ``records=False`` leaves out k, u, g and changes nothing else."""
    layer = make_layer()
    ins = pad(inputs(layer, 3, 12), 2)
    slot_idx = torch.tensor([1, 0, PAD_SLOT])
    p3, p2 = pools(layer, 2, 13), pools(layer, 2, 13)
    want = kda_decode(layer, *ins, *p3, slot_idx, backend=backend)
    got = kda_decode(layer, *(t[:, 0] for t in ins), *p2, slot_idx, backend=backend, records=False)
    assert got.y.shape == (3, layer.cfg.num_heads * layer.cfg.head_v_dim) and got.k is got.u is got.g is None
    assert torch.equal(got.y[:2], want.y[:2, 0]) and all(torch.equal(a, b) for a, b in zip(p2, p3))


@pytest.mark.parametrize("backend", [pytest.param("torch"), pytest.param("fused", marks=needs_fused)])
@pytest.mark.parametrize("spare", [pytest.param(0, id="dense"), pytest.param(13, id="strided")])
def test_out_leaves_the_pools_untouched_and_holds_what_in_place_writes(backend, spare):
    """With ``out`` (the engine's mode: the step's states are written by slot when it commits) the pools are only
    read, each live row's new states land in its row of ``out`` bitwise as the in-place call writes them at its
    slot, the outputs are the same bits, and a pad row's ``out`` row is left as it was."""
    layer = make_layer()
    slot_idx = torch.tensor([4, PAD_SLOT, 0, 2])
    live = slot_idx != PAD_SLOT
    ins = inputs(layer, 4, 3, T=2)
    read_only, in_place = pools(layer, 6, 0, spare), pools(layer, 6, 0, spare)
    before = clone(read_only)
    cfg = layer.cfg
    out = (torch.full((4, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim), 7.0),
           torch.full((4, cfg.conv_dim, cfg.conv_kernel - 1), 7.0))
    got = kda_decode(layer, *ins, *read_only, slot_idx, backend=backend, out=out)
    want = kda_decode(layer, *ins, *in_place, slot_idx, backend=backend)
    assert_same(got, want, live)
    assert all(torch.equal(a, b) for a, b in zip(read_only, before)), "a pool was written"
    slots = slot_idx[live]
    assert torch.equal(out[0][live], in_place[0][slots]) and torch.equal(out[1][live], in_place[1][slots])
    assert bool((out[0][~live] == 7.0).all()) and bool((out[1][~live] == 7.0).all()), "a pad row's out was written"


@pytest.mark.parametrize("backend", [pytest.param("torch"), pytest.param("fused", marks=needs_fused)])
def test_a_sixteen_bit_pool_is_upcast_when_read(backend):
    """A bf16 state pool runs the same form on its exact fp32 upcast, and is written rounded to nearest."""
    layer = make_layer()
    slot_idx = torch.tensor([1, PAD_SLOT, 0])
    ins = pad(inputs(layer, 3, 4), 1)
    rec, conv = pools(layer, 3, 1)
    rec16 = rec.to(torch.bfloat16)
    rec32 = rec16.float()
    got = kda_decode(layer, *ins, rec16, conv.clone(), slot_idx, backend=backend)
    want = kda_decode(layer, *ins, rec32, conv.clone(), slot_idx, backend=backend)
    assert_same(got, want, [0, 2])
    assert torch.equal(rec16, rec32.to(torch.bfloat16))


@needs_fused
def test_decay_replays_the_records_bitwise():
    """Folding a fused step's records with :func:`decode.decay` (``S exp(g)``, then ``+ k u^T``) gives bitwise the
    state the step wrote: a ReplaySSM replay needs the step's own exp."""
    layer = make_layer()
    ins = inputs(layer, 2, 8, T=4)
    rec, conv = pools(layer, 2, 9)
    S0 = rec.clone()
    out = kda_decode(layer, *ins, rec, conv, torch.tensor([1, 0]), backend="fused")
    S = S0[[1, 0]]
    for t in range(4):
        S = S * decode.decay(layer.cfg, out.g[:, t]).unsqueeze(-1)
        S = S + out.k[:, t].unsqueeze(-1) * out.u[:, t].unsqueeze(-2)
    assert torch.equal(S, rec[[1, 0]])


@pytest.mark.parametrize("backend", [pytest.param("torch"), pytest.param("fused", marks=needs_fused)])
def test_replay_from_what_the_steps_consumed_is_bitwise(backend, monkeypatch):
    """:func:`decode.replay` of the k, v, g, beta a T = 5 call consumed (``aux``) rebuilds the state it wrote,
    bitwise, in the form that ran (the projection-replay commit of speculative decoding)."""
    if backend == "torch":
        monkeypatch.setattr(decode, "_shapes", {decode._shape_key(make_layer()): "forced torch"})
    layer = make_layer()
    ins = inputs(layer, 2, 10, T=5)
    rec, conv = pools(layer, 2, 11)
    S0 = rec.clone()
    out = kda_decode(layer, *ins, rec, conv, torch.tensor([0, 1]), aux=True)
    assert decode.backend(layer) == ("fused C" if backend == "fused" else "torch")
    assert torch.equal(decode.replay(layer, out.k, out.v, out.g, out.beta, S0), rec)
    assert torch.equal(decode.replay(layer, out.k[:, :3], out.v[:, :3], out.g[:, :3], out.beta[:, :3], S0),
                       out.states[:, 2])


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


@needs_fused
def test_recurrent_forward_runs_the_fused_decode():
    """``KDALayer.forward(mode="recurrent")`` (fp32, no autograd) is bitwise the fused decode of its rows through
    o_proj; with autograd (training) it runs the torch form, within TOLERANCE of it, and gives gradients."""
    from kda_core.invariant import linear
    layer = make_layer()
    x = torch.randn(2, 7, layer.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    cache = layer.empty_cache(2)
    with torch.no_grad():
        out = layer(x, cache, mode="recurrent", output_aux=True)
        rec, conv = clone(cache)
        res = kda_decode(layer, *layer.project_inputs(x), rec, conv, torch.arange(2), backend="fused", aux=True)
    assert torch.equal(out.y, linear(res.y, layer.o_proj))
    assert torch.equal(out.cache.recurrent, rec) and torch.equal(out.cache.conv, conv)
    assert torch.equal(out.aux.states, res.states) and torch.equal(out.aux.u, res.u)
    layer.o_proj.requires_grad_(True)
    trained = layer(x, cache, mode="recurrent")
    trained.y.sum().backward()
    assert layer.o_proj.grad is not None
    torch.testing.assert_close(trained.y.detach(), out.y, **TOLERANCE)
    assert not torch.equal(trained.y.detach(), out.y)                      # the torch form, not the C one


def test_model_recurrent_forward_equals_engine_decode_steps():
    """``HybridLM.forward(mode="recurrent")`` over 5 tokens (a verify's form) from a prefilled cache gives bitwise
    the logits and KDA states of 5 engine decode steps (``forward_batch``, one token each, states by slot), in
    whichever form runs here (``KDA_CPU_KERNEL=0``: the torch form throughout)."""
    from kda_core.model import HybridLM
    from kda_core.varlen import SlotPools, forward_batch, make_meta
    model = HybridLM.from_pretrained(Path(__file__).resolve().parents[2] / "weights" / "kda-demo")
    cfg, NB = model.cfg, 16
    seq = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(0))
    cache = model.forward(seq[:12].unsqueeze(0), mode="chunk").cache
    with torch.no_grad():
        ver = model.forward(seq[12:].unsqueeze(0), cache, mode="recurrent")
    kda = {i: (cache.layers[i].recurrent.clone(), cache.layers[i].conv.clone()) for i in cfg.kda_layers}
    pools = SlotPools(kda, torch.full((2, len(cfg.mla_layers), NB, cfg.latent_dim), float("nan")))
    for j, i in enumerate(cfg.mla_layers):
        pools.kv_cache[0, j, :12] = cache.layers[i][0]
    for t in range(5):
        meta = make_meta([1], 1, [0], [True], [12 + t], [[0, 1]])
        out = forward_batch(model, seq[12 + t: 13 + t], meta, pools)
        assert torch.equal(out.logits[0], ver.logits[0, t]), f"token {t}"
    for i in cfg.kda_layers:
        assert torch.equal(kda[i][0], ver.cache.layers[i].recurrent) and torch.equal(kda[i][1], ver.cache.layers[i].conv)
