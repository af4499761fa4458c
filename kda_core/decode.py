"""A :class:`kda_core.layer.KDALayer`'s token-by-token part for B rows of T tokens, reading and writing each row's
conv window and recurrent state BY SLOT: everything between the layer's input GEMM (:meth:`KDALayer.project_inputs`:
q|k|v, f_a, b, g_a) and its o_proj GEMM. Two forms:

- the torch form (the reference): :meth:`KDALayer.gates` (f_b GEMM, :func:`kda_core.kda.kda_gate`, sigmoid beta,
  g_b GEMM), :meth:`KDALayer.activate` (conv, SiLU, L2 norms), a loop of :func:`kda_core.kda._step`,
  :meth:`KDALayer.gated_norm`;
- the fused C form (``csrc/kda_decode_cpu.c``, bound in :mod:`kda_core.decode_cpu`): all of it in ONE call per layer, the f_b / g_b GEMMs included
  (each output one fmaf chain in index order, as the row-invariant GEMM), in place by slot.

The C form's transcendentals are its own (Cephes' exp / log polynomials), not ATen's SLEEF forms, and its sums
run in another fixed order, so it
agrees with the torch form within :data:`TOLERANCE`, not bitwise. Every path that must be bitwise equal to an
engine's decode rows therefore runs the same form: the engine's decode and verify rows (:mod:`kda_core.varlen`)
and ``KDALayer.forward(mode="recurrent")`` (fp32, no autograd) all call :func:`kda_decode`, and a ReplaySSM
replay takes its decay from :func:`decay`. Training (autograd) runs the torch form.

Chosen once per process and per shape (:func:`backend`): the C form where it is built and its self-check on that
shape (against the torch form, within :data:`TOLERANCE`) passed, else the torch form and :func:`reason` says why;
``KDA_CPU_KERNEL=0`` turns it off (the whole engine then runs the torch form). Both gates (softplus and lower
bound) run in C. A 16-bit pool is read upcast exactly into a dense fp32 copy and written rounded to nearest.

Shapes: B rows, T tokens per row, S slots, H heads, K key dim, V value dim, C = 2HK + HV conv channels, W conv
width, RF / RG the ranks of the forget / output gate projections.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kda_core import decode_cpu
from kda_core.decode_cpu import PAD_SLOT, gather, load
from kda_core.kda import _step, check_gates, kda_recurrent

__all__ = ["BACKENDS", "PAD_SLOT", "TOLERANCE", "DecodeOut", "backend", "decay", "fused_decode", "kda_decode", "load",
           "reason", "replay", "runs", "self_check", "torch_decode", "why_not"]

BACKENDS = ("auto", "torch", "fused")
# fused vs torch form, per element, absolute and relative: the C exp / log (Cephes polynomials) and sqrtf are within
# ~1 ulp of ATen's SLEEF forms, and the fmaf sums skip roundings the torch sums make. Measured over 256 tokens from
# random states (demo shape, both gates): y <= 1.4e-6, u <= 1e-6, g <= 5e-7, state <= 7.5e-7; the demo model's
# recurrent logits stay 1.9e-5 from its chunk form over 200 tokens (1.6e-5 with the torch form); at K = V = 128 over
# 300 tokens the worst element used 6% of this tolerance. A formula off by 1e-4 relative (the gated norm scaled by
# 1.0001) already fails it; 1e-4 did not catch that.
TOLERANCE = {"rtol": 2e-5, "atol": 2e-5}

_shapes: dict = {}                 # (H, K, V, C, W, RF, RG, gate) -> True, or why the C form does not run it
_RUNS_ATTR = "_kda_decode_runs"
_F32 = torch.float32


class DecodeOut(NamedTuple):
    """What :func:`kda_decode` returns; pad rows hold NaN (to be dropped). y ``[B, T, H V]`` fp32: o_proj's input
    (the gated RMSNorm of the step's output). The ReplaySSM record of each token (with ``records``, else None): k
    ``[B, T, H, K]``, u ``[B, T, H, V]`` (``beta (v - S'^T k)``), g ``[B, T, H, K]`` (log decay), bitwise the
    operands of its state update. With
    ``aux``: q ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]`` and states ``[B, T, H, K, V]`` (the state
    after each token); else None."""

    y: torch.Tensor
    k: torch.Tensor | None
    u: torch.Tensor | None
    g: torch.Tensor | None
    q: torch.Tensor | None = None
    v: torch.Tensor | None = None
    beta: torch.Tensor | None = None
    states: torch.Tensor | None = None


def _check(layer, raw, f_low, b, g_low, rec, conv, slot_idx) -> None:
    cfg = layer.cfg
    if not isinstance(raw, torch.Tensor) or raw.dim() not in (2, 3):
        raise ValueError(f"raw must have shape [B, T, {cfg.conv_dim}] or [B, {cfg.conv_dim}], got "
                         f"{tuple(raw.shape) if isinstance(raw, torch.Tensor) else type(raw).__name__}")
    lead = tuple(raw.shape[:-1])                                          # (B, T) or (B,)
    B, T, H, K, V = raw.shape[0], lead[-1] if len(lead) == 2 else 1, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
    want = {"raw": (raw, lead + (cfg.conv_dim,)), "f_low": (f_low, lead + (layer.f_b.shape[1],)),
            "b": (b, lead + (H,)), "g_low": (g_low, lead + (layer.g_b.shape[1],)), "rec": (rec, (rec.shape[0], H, K, V)),
            "conv": (conv, (conv.shape[0], cfg.conv_dim, cfg.conv_kernel - 1)), "slot_idx": (slot_idx, (B,))}
    for name, (t, shape) in want.items():
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape {list(shape)}, got {got}")
    if T < 1:
        raise ValueError(f"raw must hold at least one token per row (T >= 1), got {tuple(raw.shape)}")
    if slot_idx.dtype != torch.long:
        raise ValueError(f"slot_idx must be int64, got {slot_idx.dtype}")
    if rec.shape[0] != conv.shape[0]:
        raise ValueError(f"rec and conv must hold the same S slots, got {rec.shape[0]} and {conv.shape[0]}")
    live = slot_idx[slot_idx != PAD_SLOT]
    if live.numel() and (int(live.min()) < 0 or int(live.max()) >= rec.shape[0]):
        raise ValueError(f"slot_idx must hold slots in [0, {rec.shape[0]}) or {PAD_SLOT} (pad), got {slot_idx.tolist()}")
    if live.unique().numel() != live.numel():
        raise ValueError(f"slot_idx holds a live slot twice: {slot_idx.tolist()}")


def torch_decode(layer, raw, f_low, b, g_low, rec, conv, slot_idx, out=None, aux=False, records=True) -> DecodeOut:
    """The reference (same contract as :func:`kda_decode`): :meth:`KDALayer.gates`, the live rows' states gathered
    by slot (pad rows read NaN), :meth:`KDALayer.activate`, :func:`kda_core.kda._step` per token,
    :meth:`KDALayer.gated_norm`; new states scattered back by slot or written to ``out``. Unchecked."""
    if raw.dim() == 2:                                                    # one token per row: [B, *]
        res = torch_decode(layer, *(t.unsqueeze(1) for t in (raw, f_low, b, g_low)), rec, conv, slot_idx, out, aux,
                           records)
        return DecodeOut(*(None if t is None else t[:, 0] for t in res))
    B, T = raw.shape[:2]
    live = (slot_idx != PAD_SLOT).nonzero().flatten()                     # [B_live]
    slots = slot_idx[live]
    g, beta, out_gate = layer.gates(f_low, b, g_low)                      # [B, T, H, K], [B, T, H], [B, T, H, V]
    q, k, v, conv_new = layer.activate(raw, gather(conv, slot_idx, live, slots))   # [B, T, H, K] ...
    S = gather(rec, slot_idx, live, slots)                               # [B, H, K, V]
    o, u = v.new_empty(v.shape), v.new_empty(v.shape)                     # [B, T, H, V]
    states = S.new_empty((B, T) + tuple(S.shape[1:])) if aux else None    # [B, T, H, K, V]
    scale = layer.cfg.head_k_dim ** -0.5
    for t in range(T):                                                    # as kda_core.kda.kda_recurrent
        o[:, t], S, u[:, t] = _step(*(x[:, t].contiguous() for x in (q, k, v, g, beta)), S, scale)
        if aux:
            states[:, t] = S
    y = layer.gated_norm(o, out_gate).reshape(B, T, -1)                   # [B, T, H V]
    if out is None:
        rec.index_copy_(0, slots, S[live].to(rec.dtype))
        conv.index_copy_(0, slots, conv_new[live].to(conv.dtype))
    else:
        out[0][live], out[1][live] = S[live], conv_new[live]
    return DecodeOut(y, *((k, u, g) if records else (None,) * 3), *((q, v, beta, states) if aux else ()))


def fused_decode(layer, raw, f_low, b, g_low, rec, conv, slot_idx, out=None, aux=False, records=True) -> DecodeOut:
    """The C form (same contract as :func:`torch_decode`; :func:`kda_core.decode_cpu.run`). Unchecked; needs
    :func:`runs`."""
    return DecodeOut(*decode_cpu.run(layer, raw, f_low, b, g_low, rec, conv, slot_idx, out, aux, records))


def kda_decode(layer, raw: torch.Tensor, f_low: torch.Tensor, b: torch.Tensor, g_low: torch.Tensor,
               rec: torch.Tensor, conv: torch.Tensor, slot_idx: torch.Tensor, backend: str = "auto",
               check: bool = True, out: tuple[torch.Tensor, torch.Tensor] | None = None,
               aux: bool = False, records: bool = True) -> DecodeOut:
    """T tokens of ``layer`` (a :class:`KDALayer`) for each of B rows, token by token, from the outputs of its input
    GEMM to o_proj's input; states read by slot and written in place by slot (or to ``out``).

    Args:
        raw ``[B, T, C]`` the q|k|v projections (pre-conv); f_low ``[B, T, RF]`` (f_a's output); b ``[B, T, H]``
        (b_proj's, pre-sigmoid); g_low ``[B, T, RG]`` (g_a's): :meth:`KDALayer.project_inputs`, views of its GEMM's
        output welcome. rec ``[S, H, K, V]`` and conv ``[S, C, W-1]`` the layer's state pools (fp32, or 16-bit:
        read upcast exactly, written rounded; any slot stride), mutated at the live rows' slots only. slot_idx
        ``[B]`` int64, ``-1`` = pad row (its states are neither read nor written; its outputs are NaN and to be
        dropped). backend: "auto" (:func:`backend`), "torch" or "fused" (the C form or RuntimeError). check:
        validate the arguments (callers that did it pass False). out: None writes the new states (after the T
        tokens) into the pools at the slots; else ``(recurrent [B, H, K, V], conv [B, C, W-1])`` fp32 contiguous
        that receive row b's new states (pad rows untouched), and the pools are only read (an engine that writes a
        step's states when it commits it passes these). aux: also return q, v, beta and every token's state.
        records: return the ReplaySSM records k, u, g (False: None, not computed into tensors).
        Inputs of shape ``[B, *]`` (no T) are one token per row: every output then lacks the T dim too.

    Returns:
        :class:`DecodeOut`. Each live row is bitwise what the same form computes for the row alone, and token t of
        a T-token call bitwise the same token decoded in a call of its own (so verify == decode).

    Raises:
        ValueError: bad shapes or slots (out of range, a live slot twice), an unknown backend.
        RuntimeError: backend "fused" where the C form does not run this call (:func:`reason` says why).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if check:
        _check(layer, raw, f_low, b, g_low, rec, conv, slot_idx)
    if backend == "torch":
        return torch_decode(layer, raw, f_low, b, g_low, rec, conv, slot_idx, out, aux, records)
    why = why_not(layer, raw, f_low, b, g_low)
    if why is None:
        return fused_decode(layer, raw, f_low, b, g_low, rec, conv, slot_idx, out, aux, records)
    if backend == "fused":
        raise RuntimeError(f"the fused decode does not run this call: {why}")
    return torch_decode(layer, raw, f_low, b, g_low, rec, conv, slot_idx, out, aux, records)


def why_not(layer, *inputs: torch.Tensor) -> str | None:
    """None when the C form runs ``layer`` on these inputs (fp32 CPU tensors, no autograd; the shape checked once),
    else why not. The pools take any dtype and layout (:func:`kda_decode`)."""
    for t in inputs:
        if t.dtype is not _F32 or not t.is_cpu:
            return "needs fp32 CPU inputs"
    if torch.is_grad_enabled() and (any(t.requires_grad for t in inputs) or
                                    any(p.requires_grad for p in layer.parameters())):
        return "needs no autograd"
    got = layer.__dict__.get(_RUNS_ATTR)                                 # runs(layer), cached on the layer
    if got is None or got[0] is not _shapes:
        got = (_shapes, runs(layer))
        layer.__dict__[_RUNS_ATTR] = got
    return got[1]


def _cfg_key(cfg) -> tuple:
    return (cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.conv_dim, cfg.conv_kernel, cfg.gate)


def _shape_key(layer) -> tuple:
    """A layer's shape and gate; its gate ranks must be the config's (V: :class:`KDALayer` builds them so), so that
    :func:`decay` can tell from a config alone which form ran."""
    if layer.f_b.shape[1] != layer.cfg.head_v_dim or layer.g_b.shape[1] != layer.cfg.head_v_dim:
        return _cfg_key(layer.cfg) + (layer.f_b.shape[1], layer.g_b.shape[1])
    return _cfg_key(layer.cfg)


def runs(layer) -> str | None:
    """None when the C form runs ``layer``'s shape here (built, loaded, and :func:`self_check` passed on that
    shape and gate, once per process), else why not."""
    key = _shape_key(layer)
    if key not in _shapes:
        lib = load()
        if isinstance(lib, str):
            got = lib
        else:
            try:
                self_check(layer)
                got = True
            except (RuntimeError, ValueError) as exc:      # out of tolerance, or sizes the kernel refuses
                got = str(exc)
        _shapes.setdefault(key, got)
    got = _shapes[key]
    return None if got is True else got


def self_check(layer) -> None:
    """The C form against the torch form on ``layer`` (its shape, gate and weights): 3 rows (one pad) in permuted
    slots of a strided pool, three tokens, first as one call of T = 3 with ``aux``, then token by token: every
    output, record and state within :data:`TOLERANCE`, the pad row's NaN kept out of every slot, and the two calls
    bitwise equal. Raises RuntimeError when they differ (then the torch form runs this shape)."""
    cfg = layer.cfg
    gen = torch.Generator().manual_seed(0)
    H, K, V, C, W1 = cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.conv_dim, cfg.conv_kernel - 1
    arena = torch.randn(5, H * K * V + C * W1 + 7, generator=gen) * 0.3          # 7 spare words: a strided view
    rec = arena[:, : H * K * V].view(5, H, K, V)
    conv = arena[:, H * K * V: H * K * V + C * W1].view(5, C, W1)
    slot_idx = torch.tensor([3, PAD_SLOT, 0])
    ins = [torch.randn(3, 3, n, generator=gen) for n in (C, layer.f_b.shape[1], H, layer.g_b.shape[1])]
    for t in ins:
        t[1] = float("nan")                                                      # the pad row
    pools = {"torch": (rec.clone(), conv.clone()), "fused": (rec.clone(), conv.clone()), "steps": (rec, conv)}
    with torch.no_grad():
        want = torch_decode(layer, *ins, *pools["torch"], slot_idx, aux=True)
        got = fused_decode(layer, *ins, *pools["fused"], slot_idx, aux=True)
        steps = [fused_decode(layer, *(x[:, t: t + 1] for x in ins), *pools["steps"], slot_idx) for t in range(3)]
    live = [0, 2]
    for name in DecodeOut._fields:
        a, b = getattr(got, name)[live], getattr(want, name)[live]
        if not torch.allclose(a, b, **TOLERANCE):
            raise RuntimeError(f"self-check failed: {name} differs from the torch form by up to "
                               f"{float((a - b).abs().max()):.3g} (tolerance {TOLERANCE})")
    for name, a, b in (("rec", pools["fused"][0], pools["torch"][0]), ("conv", pools["fused"][1], pools["torch"][1])):
        if not (a.isfinite().all() and torch.allclose(a, b, **TOLERANCE)):
            raise RuntimeError(f"self-check failed: the {name} pool differs from the torch form")
    for name in ("y", "k", "u", "g"):
        whole, alone = getattr(got, name)[live], torch.cat([getattr(s, name) for s in steps], dim=1)[live]
        if not torch.equal(whole, alone):
            raise RuntimeError(f"self-check failed: {name} of a 3-token call differs from 3 one-token calls")
    if not (torch.equal(pools["steps"][0], pools["fused"][0]) and torch.equal(pools["steps"][1], pools["fused"][1])):
        raise RuntimeError("self-check failed: the states of a 3-token call differ from 3 one-token calls")


def decay(cfg, g: torch.Tensor) -> torch.Tensor:
    """``exp(g)`` as :func:`kda_decode`'s step computes it for the KDA layers of ``cfg`` (a
    :class:`kda_core.config.ModelConfig`): the C form's exp where a layer of that shape runs the C form in this
    process (its self-check passed: :func:`runs`; records come from a forward, which checked it) and g is fp32 on
    the CPU, else ATen's exp. Folding a step's records ``(k, u, g)`` with it (a ReplaySSM replay: ``S exp(g)``, then
    ``+ k u^T``, a rounded product then a rounded add, as the step) rebuilds the step's states bitwise. g any
    shape; returns its shape."""
    if g.dtype != torch.float32 or not g.is_cpu or _shapes.get(_cfg_key(cfg)) is not True:
        return g.exp()
    return decode_cpu.exp(g)


def replay(layer, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor) -> torch.Tensor:
    """The state after replaying T steps of ``layer`` from what they consumed (a projection-replay commit): bitwise
    the state :func:`kda_decode` wrote after those tokens, in the form it runs (:func:`backend`).

    Args: k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]`` (any float dtype, used as fp32); state
    ``[B, H, K, V]`` before them (not mutated). Returns the new state ``[B, H, K, V]`` fp32.
    Raises ValueError (:class:`kda_core.kda.NonFiniteError` for NaN) for g or beta outside their domain
    (:func:`kda_core.kda.check_gates`): a poisoned record is refused, not folded in."""
    check_gates(g, beta)
    if runs(layer) is not None or not all(t.is_cpu for t in (k, v, g, beta, state)):
        q = torch.zeros_like(k)                                           # the state does not depend on q
        return kda_recurrent(q, k, v, g, beta, state)[1]
    return decode_cpu.replay(k, v, g, beta, state)


def backend(layer) -> str:
    """The form :func:`kda_decode` runs ``layer`` in with ``backend="auto"``: "fused C" or "torch"."""
    return "fused C" if runs(layer) is None else "torch"


def reason(layer) -> str | None:
    """Why the C form does not run ``layer`` here (None when it does)."""
    return runs(layer)
