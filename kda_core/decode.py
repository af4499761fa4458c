"""One KDA decode token for B rows of a :class:`kda_core.layer.KDALayer`, reading and writing each row's conv
window and recurrent state in place BY SLOT: the torch form (the reference) and a fused C form
(``csrc/kda_decode_cpu.c``) that gives the same bits.

Both forms compute, per live row: the short conv over [window, this token] and the window's shift, SiLU and
the L2 norms (:meth:`KDALayer.split_qkv`), then the delta-rule step of :func:`kda_core.kda._step`. The torch
form gathers the rows' states by slot, runs those ops and scatters them back (:mod:`kda_core.varlen`'s gather
/ scatter). The C form does the conv and the step in two passes over the pools in place (no gather, no
scatter, no per-op dispatch); SiLU, the L2 norms' rsqrt and ``exp(g)`` stay the very torch calls between them.
Its sums run in ATen's order (see the source's header), so its results are bitwise the torch form's: the
model's own ``forward(mode="recurrent")``, verify rows and ReplaySSM replays (all torch) agree bitwise with
an engine that decodes through it.

Chosen once per process and per shape (:func:`backend`): the C form where it is built and its bitwise
self-check on that shape (H, K, V, conv width and window) passed, else the torch form and :func:`reason`
says why. ``KDA_CPU_KERNEL=0`` turns it off. It runs fp32 pools whose per-slot part is contiguous (any slot
stride: strided views of a page arena work); other pools run the torch form.

Shapes: B rows, S slots, H heads, K key dim, V value dim, C = 2HK + HV conv channels, W conv width.
"""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from kda_core.cpu_build import build, default_isa
from kda_core.kda import _step

SOURCE = Path(__file__).parent / "csrc" / "kda_decode_cpu.c"
FLAGS = ("-ffp-contract=off",)     # no fused multiply-add: every product rounded, as ATen's mul then add
PAD_SLOT = -1
BACKENDS = ("auto", "torch", "fused")

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_lock = threading.Lock()
_lib: list = []                    # [the loaded library, or why there is none] (set once)
_shapes: dict = {}                 # (H, K, V, C, W) -> True, or why the C form does not run that shape


class DecodeOut(NamedTuple):
    """o ``[B, H, V]`` fp32 (pad rows: NaN or garbage, to be dropped); the step's ReplaySSM record of each row:
    k ``[B, H, K]``, u ``[B, H, V]`` (``beta (v - S'^T k)``), g ``[B, H, K]`` fp32, bitwise the operands of its
    state update."""

    o: torch.Tensor
    k: torch.Tensor
    u: torch.Tensor
    g: torch.Tensor


def _check(layer, raw, g, beta, rec, conv, slot_idx) -> None:
    cfg = layer.cfg
    B, H, K, V = raw.shape[0], cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
    want = {"raw": (raw, (B, cfg.conv_dim)), "g": (g, (B, H, K)), "beta": (beta, (B, H)),
            "rec": (rec, (rec.shape[0], H, K, V)), "conv": (conv, (conv.shape[0], cfg.conv_dim, cfg.conv_kernel - 1)),
            "slot_idx": (slot_idx, (B,))}
    for name, (t, shape) in want.items():
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape {list(shape)}, got {got}")
    if slot_idx.dtype != torch.long:
        raise ValueError(f"slot_idx must be int64, got {slot_idx.dtype}")
    if rec.shape[0] != conv.shape[0]:
        raise ValueError(f"rec and conv must hold the same S slots, got {rec.shape[0]} and {conv.shape[0]}")
    live = slot_idx[slot_idx != PAD_SLOT]
    if live.numel() and (int(live.min()) < 0 or int(live.max()) >= rec.shape[0]):
        raise ValueError(f"slot_idx must hold slots in [0, {rec.shape[0]}) or {PAD_SLOT} (pad), got {slot_idx.tolist()}")
    if live.unique().numel() != live.numel():
        raise ValueError(f"slot_idx holds a live slot twice: {slot_idx.tolist()}")


def torch_decode(layer, raw, g, beta, rec, conv, slot_idx, out=None) -> DecodeOut:
    """The reference: gather the live rows' states (pad rows read NaN), conv + SiLU + L2 norms
    (:meth:`KDALayer.activate`), :func:`kda_core.kda._step`, then the live rows' new states scattered back by
    slot, or (``out``) written to their rows of ``out``. Unchecked."""
    live = (slot_idx != PAD_SLOT).nonzero().flatten()                     # [B_live]
    slots = slot_idx[live]

    def gather(pool):                                                    # fp32 (a 16-bit pool upcast exactly)
        rows = pool.new_full((slot_idx.shape[0],) + tuple(pool.shape[1:]), float("nan"), dtype=torch.float32)
        rows[live] = pool.index_select(0, slots).float()
        return rows

    q, k, v, conv_new = layer.activate(raw.unsqueeze(1), gather(conv))   # [B, 1, H, K] ...
    q, k, v, g, beta = (x.float().contiguous() for x in (q[:, 0], k[:, 0], v[:, 0], g, beta))
    o, S, u = _step(q, k, v, g, beta, gather(rec), layer.cfg.head_k_dim ** -0.5)
    if out is None:
        rec.index_copy_(0, slots, S[live].to(rec.dtype))
        conv.index_copy_(0, slots, conv_new[live].to(conv.dtype))
    else:
        out[0][live], out[1][live] = S[live], conv_new[live]
    return DecodeOut(o, k, u, g)


def fused_decode(layer, raw, g, beta, rec, conv, slot_idx, out=None) -> DecodeOut:
    """The C form (same contract as :func:`torch_decode`, same bits). Unchecked; needs :func:`runs`."""
    lib = _lib[0]
    cfg = layer.cfg
    B, H, K, V = raw.shape[0], cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
    raw = raw if raw.stride(-1) == 1 else raw.contiguous()
    slot_idx = slot_idx.contiguous()
    y = raw.new_empty(B, cfg.conv_dim)                                    # [B, C] conv output
    if lib.kda_decode_conv(B, cfg.conv_dim, cfg.conv_kernel, raw.data_ptr(), raw.stride(0),
                           layer.conv_weight.data_ptr(), conv.data_ptr(), conv.stride(0), slot_idx.data_ptr(),
                           y.data_ptr(), None if out is None else out[1].data_ptr(),
                           0 if out is None else out[1].stride(0)):
        raise ValueError("kda_decode_conv: bad sizes")
    q, k, v = layer.split_qkv(y.unsqueeze(1))                             # [B, 1, H, K] ...
    q, k, v, g, beta = (x.contiguous() for x in (q[:, 0], k[:, 0], v[:, 0], g, beta))
    decay = g.exp()                                                       # [B, H, K], as _step's
    o, u = v.new_empty(B, H, V), v.new_empty(B, H, V)
    scratch = v.new_empty(K * V)
    if lib.kda_decode_step(B, H, K, V, K ** -0.5, q.data_ptr(), k.data_ptr(), v.data_ptr(), decay.data_ptr(),
                           beta.data_ptr(), rec.data_ptr(), rec.stride(0), slot_idx.data_ptr(), o.data_ptr(),
                           u.data_ptr(), scratch.data_ptr(), None if out is None else out[0].data_ptr(),
                           0 if out is None else out[0].stride(0)):
        raise ValueError("kda_decode_step: bad sizes")
    return DecodeOut(o, k, u, g)


def kda_decode(layer, raw: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, rec: torch.Tensor,
               conv: torch.Tensor, slot_idx: torch.Tensor, backend: str = "auto", check: bool = True,
               out: tuple[torch.Tensor, torch.Tensor] | None = None) -> DecodeOut:
    """One decode token of ``layer`` (a :class:`KDALayer`) for B rows, states read by slot and written in place by
    slot (or to ``out``).

    Args:
        raw ``[B, C]`` the rows' q|k|v projections (pre-conv); g ``[B, H, K]`` log decay; beta ``[B, H]``;
        rec ``[S, H, K, V]`` and conv ``[S, C, W-1]`` the layer's state pools (fp32; any slot stride), mutated
        at the live rows' slots only; slot_idx ``[B]`` int64, ``-1`` = pad row (its states are neither read
        nor written; its outputs are to be dropped). backend: "auto" (:func:`backend`), "torch" or "fused"
        (the C form or RuntimeError). check: validate the arguments (callers that did it pass False).
        out: None writes the new states into the pools at the slots; else ``(recurrent [B, H, K, V], conv
            [B, C, W-1])`` fp32 contiguous that receive row b's new states (pad rows untouched) and the pools are
            only read: what an engine that writes a step's states when it commits it (and never after a
            failed forward) passes. A 16-bit pool runs the torch form, upcast exactly when read.

    Returns:
        :class:`DecodeOut`. Each live row is bitwise what the row alone computes (``KDALayer.forward(mode=
        "recurrent")`` of one token from the same cache), in either form.

    Raises:
        ValueError: bad shapes or slots (out of range, a live slot twice), an unknown backend.
        RuntimeError: backend "fused" where the C form does not run this call (:func:`reason` says why).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if check:
        _check(layer, raw, g, beta, rec, conv, slot_idx)
    if backend == "torch":
        return torch_decode(layer, raw, g, beta, rec, conv, slot_idx, out)
    why = _why_not(layer, raw, rec, conv)
    if why is None:
        return fused_decode(layer, raw, g, beta, rec, conv, slot_idx, out)
    if backend == "fused":
        raise RuntimeError(f"the fused decode does not run this call: {why}")
    return torch_decode(layer, raw, g, beta, rec, conv, slot_idx, out)


def _why_not(layer, raw, rec, conv) -> str | None:
    """None when the C form runs this call, else why not (checked per call: dtypes and layouts; per shape: once)."""
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (raw, rec, conv)):
        return "needs fp32 CPU tensors"
    if torch.is_grad_enabled() and (raw.requires_grad or layer.conv_weight.requires_grad):
        return "needs no autograd"
    if rec.shape[0] and not rec[0].is_contiguous() or conv.shape[0] and not conv[0].is_contiguous():
        return "needs each slot's state contiguous"
    return runs(layer)


def load():
    """Build (once per machine: cached) and load the C library, once per process; returns it, or a string saying
    why there is none (no compiler, not x86-64, ``KDA_CPU_KERNEL=0``). Start-up code may call it ahead of the first
    request; else the first decode that can use it does. Importing this module builds nothing."""
    if not _lib:
        with _lock:
            if not _lib:
                try:
                    if os.environ.get("KDA_CPU_KERNEL", "1") == "0":
                        raise RuntimeError("turned off by KDA_CPU_KERNEL=0")
                    lib = ctypes.CDLL(str(build(default_isa(), SOURCE, FLAGS)))
                    lib.kda_decode_conv.restype = _I
                    lib.kda_decode_conv.argtypes = [_I] * 3 + [_P, _L, _P, _P, _L, _P, _P, _P, _L]
                    lib.kda_decode_step.restype = _I
                    lib.kda_decode_step.argtypes = [_I] * 4 + [_F] + [_P] * 6 + [_L] + [_P] * 5 + [_L]
                    _lib.append(lib)
                except Exception as exc:        # no compiler, no x86-64, turned off: the torch form runs
                    _lib.append(str(exc) or type(exc).__name__)
    return _lib[0]


def runs(layer) -> str | None:
    """None when the C form runs ``layer``'s shape here (built, loaded, and :func:`self_check` passed on that
    shape, once per process), else why not."""
    cfg = layer.cfg
    shape = (cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.conv_dim, cfg.conv_kernel)
    if shape not in _shapes:
        lib = load()
        if isinstance(lib, str):
            got = lib
        else:
            try:
                self_check(layer)
                got = True
            except (RuntimeError, ValueError) as exc:      # bits differ, or a size the kernel refuses (W > 64)
                got = str(exc)
        _shapes.setdefault(shape, got)
    got = _shapes[shape]
    return None if got is True else got


def self_check(layer) -> None:
    """The C form against the torch form on ``layer``'s shape: 3 rows (one pad) in permuted slots of a strided
    pool, two tokens in a row; every output, record and state must be bitwise equal. Raises RuntimeError
    when they differ (then the torch form runs this shape)."""
    cfg = layer.cfg
    gen = torch.Generator().manual_seed(0)
    H, K, V, C, W1 = cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.conv_dim, cfg.conv_kernel - 1
    arena = torch.randn(5, H * K * V + C * W1 + 7, generator=gen) * 0.3          # 7 spare words: a strided view
    rec = arena[:, : H * K * V].view(5, H, K, V)
    conv = arena[:, H * K * V: H * K * V + C * W1].view(5, C, W1)
    slot_idx = torch.tensor([3, PAD_SLOT, 0])
    pools = {"torch": (rec.clone(), conv.clone()), "fused": (rec, conv)}
    with torch.no_grad():
        for step in range(2):
            raw = torch.randn(3, C, generator=gen)
            g = -torch.rand(3, H, K, generator=gen)
            beta = torch.rand(3, H, generator=gen)
            want = torch_decode(layer, raw, g, beta, *pools["torch"], slot_idx)
            got = fused_decode(layer, raw, g, beta, *pools["fused"], slot_idx)
            for name, a, b in (("o", got.o, want.o), ("u", got.u, want.u), ("k", got.k, want.k)):
                if not torch.equal(a[[0, 2]], b[[0, 2]]):
                    raise RuntimeError(f"self-check failed: {name} differs from the torch form at step {step} "
                                       f"(by up to {float((a[[0, 2]] - b[[0, 2]]).abs().max()):.3g})")
            for name, a, b in (("rec", pools["fused"][0], pools["torch"][0]), ("conv", pools["fused"][1], pools["torch"][1])):
                if not torch.equal(a, b):
                    raise RuntimeError(f"self-check failed: the {name} pool differs from the torch form at step {step}")


def backend(layer) -> str:
    """The form :func:`kda_decode` runs ``layer`` in with ``backend="auto"``: "fused C" or "torch"."""
    return "fused C" if runs(layer) is None else "torch"


def reason(layer) -> str | None:
    """Why the C form does not run ``layer`` here (None when it does)."""
    return runs(layer)
