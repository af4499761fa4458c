"""The fused C form of :mod:`kda_core.decode` (``csrc/kda_decode_cpu.c``): building and loading the library, the
layer's weights as the kernel reads them, and one call of each entry point (``kda_decode_layer``: a KDA layer's
token-by-token part for B rows x T tokens by slot; ``kda_decode_replay``: its state updates from their records;
``kda_decode_exp``: its decay). :mod:`kda_core.decode` chooses between it and the torch form and checks it.

Shapes: B rows, T tokens per row, S slots, H heads, K key dim, V value dim, C = 2HK + HV conv channels, W conv
width, RF / RG the ranks of the forget / output gate projections.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
from pathlib import Path

import torch

from kda_core import cpu_invariant
from kda_core.cpu_build import build, default_isa, open_library

SOURCE = Path(__file__).parent / "csrc" / "kda_decode_cpu.c"
FLAGS = ("-ffp-contract=off",      # only the explicit fmaf fuse: the state update stays a product then an add
         "-fno-trapping-math")     # lets the exp / log loops vectorise (no value changes: no FP traps are used)
PAD_SLOT = -1

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_lock = threading.Lock()
_lib: list = []                    # [the loaded library, or why there is none] (set once)
_WEIGHTS_ATTR = "_kda_decode_weights"
_BLOCK_ATTR = "_kda_decode_block"     # on the layer: its _Block (the packed addresses refreshed per call)
_F32 = torch.float32


class _Weights(ctypes.Structure):
    """KdaWeights of the C source."""

    _fields_ = [("H", _I), ("K", _I), ("V", _I), ("C", _I), ("W", _I), ("RF", _I), ("RG", _I),
                ("lower_bound", _F), ("rms_eps", _F), ("scale", _F),
                ("conv_w", _P), ("f_bt", _P), ("A_log", _P), ("dt_bias", _P), ("g_bt", _P), ("o_norm", _P)]


class _Aux(ctypes.Structure):
    """KdaAux of the C source: optional per-token outputs (NULL: not written)."""

    _fields_ = [(name, _P) for name in ("q", "k", "v", "g", "beta", "u", "states")]


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
                    isa = default_isa()
                    lib = open_library(build(isa, SOURCE, FLAGS), isa, "kda_decode_vector_bits")
                    lib.kda_decode_layer.restype = _I
                    lib.kda_decode_layer.argtypes = ([_P, _I, _I] + [_P, _L] * 6 + [_P] + [_P, _L] * 2 + [_P, _P])
                    lib.kda_decode_replay.restype = _I
                    lib.kda_decode_replay.argtypes = [_I] * 5 + [_P] * 5
                    lib.kda_decode_block.restype = _I
                    lib.kda_decode_block.argtypes = ([_P, _P, _I, _P, _L, _P, _F] + [_P, _L] * 2 + [_P]
                                                     + [_P, _L] * 2 + [_P, _I])
                    lib.kda_write_slots.restype = None
                    lib.kda_write_slots.argtypes = [_I, _I] + [_P] * 5
                    lib.kda_decode_exp.restype = None
                    lib.kda_decode_exp.argtypes = [_L, _P, _P]
                    _lib.append(lib)
                except Exception as exc:        # no compiler, no x86-64, turned off: the torch form runs
                    _lib.append(str(exc) or type(exc).__name__)
    return _lib[0]


def gather(pool, slot_idx, live, slots):
    """The rows' states ``[B, ...]`` fp32 read by slot (a 16-bit pool upcast exactly); pad rows NaN."""
    rows = pool.new_full((slot_idx.shape[0],) + tuple(pool.shape[1:]), float("nan"), dtype=torch.float32)
    rows[live] = pool.index_select(0, slots).float()
    return rows


def weights(layer) -> _Weights:
    """The layer's weights for the C form (f_b and g_b transposed), cached on the layer and rebuilt when a weight is
    replaced (also under the same Parameter, ``p.data = new``: its address moves) or written in place (autograd's
    version counter; a write through ``.data`` is not seen until :func:`kda_core.cpu_invariant.forget` runs)."""
    p = layer._parameters
    ws = (p["conv_weight"], p["f_b"], p["A_log"], p["dt_bias"], p["g_b"], p["o_norm"])
    key = tuple((id(w), w.data_ptr(), w._version) for w in ws) + (cpu_invariant.forgets(),)
    got = layer.__dict__.get(_WEIGHTS_ATTR)
    if got is not None and got[0] == key:
        return got[1]
    cfg = layer.cfg
    keep = [w.detach().float().contiguous() for w in ws]                  # the struct points into these
    keep[1], keep[4] = keep[1].T.contiguous(), keep[4].T.contiguous()     # [RF, H K], [RG, H V]
    s = _Weights(cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.conv_dim, cfg.conv_kernel, layer.f_b.shape[1],
                 layer.g_b.shape[1], cfg.lower_bound if cfg.gate == "lower_bound" else 0.0, cfg.rms_norm_eps,
                 cfg.head_k_dim ** -0.5, *(w.data_ptr() for w in keep))
    s._keep = keep, ws                                                    # ws: the ids in the key stay theirs
    layer.__dict__[_WEIGHTS_ATTR] = (key, s)                              # not an nn.Module attribute
    return s


class _Block(ctypes.Structure):
    """KdaBlock of the C source: the layer's packed input and o_proj GEMMs and the GEMM / RMSNorm it calls."""

    _fields_ = [("D", _I), ("NP", _I), ("proj", _P), ("o_proj", _P), ("linear", _P), ("rmsnorm", _P)]


def block_runs(rec: torch.Tensor, conv: torch.Tensor):
    """The C GEMM (:func:`kda_core.cpu_invariant.backend`) where :func:`block` can run on these pools (fp32, each
    slot contiguous), else None."""
    gemm = cpu_invariant.backend()
    if gemm is None or rec.dtype is not _F32 or conv.dtype is not _F32 or not _slots_contiguous(rec, conv):
        return None
    return gemm


def block(gemm, layer, x, norm, eps, rec, conv, slot_idx, out, records) -> tuple:
    """One ``kda_decode_block`` call: ``x [B, D] += o_proj(layer(rmsnorm(x, norm, eps)))`` in place for one decode
    token per row (B rows, x fp32 with contiguous rows), bitwise :func:`kda_core.invariant.rmsnorm`,
    :meth:`KDALayer.project_inputs`, :func:`run` (same pools, slot_idx, out, records), the o_proj
    :func:`kda_core.invariant.linear` and torch's add. Returns the records (k, u, g) as :func:`run` does (None when
    not asked). Unchecked; needs :func:`load` and :func:`block_runs`. Raises ValueError if the kernel refuses the
    sizes (or is out of memory: x then unwritten)."""
    p = layer._parameters                                                 # (not nn.Module.__getattr__: µs)
    o_proj = p["o_proj"]
    B, D = x.shape
    s = layer.__dict__.get(_BLOCK_ATTR)
    if s is None:
        s = layer.__dict__[_BLOCK_ATTR] = _Block(linear=ctypes.cast(gemm.lib.linear_f32, _P).value,
                                                 rmsnorm=ctypes.cast(gemm.lib.rmsnorm_f32, _P).value)
    s.proj = gemm.packed_cat((p["qkv_proj"], p["f_a"], p["b_proj"], p["g_a"]))[1]   # the GEMMs' caches: repacked
    s.o_proj = gemm.packed(o_proj)[1]                                     # on a write, dropped by forget()
    s.D, s.NP = D, p["qkv_proj"].shape[0] + p["f_a"].shape[0] + p["b_proj"].shape[0] + p["g_a"].shape[0]
    cfg = layer.cfg
    H, K, V = cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
    rec_out = (x.new_empty(B, H, K), x.new_empty(B, H, V), x.new_empty(B, H, K)) if records else (None,) * 3
    a = ctypes.byref(_Aux(k=rec_out[0].data_ptr(), u=rec_out[1].data_ptr(), g=rec_out[2].data_ptr())) \
        if records else None
    rc = _lib[0].kda_decode_block(ctypes.byref(weights(layer)), ctypes.byref(s), B, x.data_ptr(), x.stride(0),
                                  norm.data_ptr(), eps, rec.data_ptr(), rec.stride(0), conv.data_ptr(), conv.stride(0),
                                  slot_idx.data_ptr(),
                                  None if out is None else out[0].data_ptr(), 0 if out is None else out[0].stride(0),
                                  None if out is None else out[1].data_ptr(), 0 if out is None else out[1].stride(0),
                                  a, torch.get_num_threads())
    if rc:
        raise ValueError(f"kda_decode_block: {'out of memory' if rc == -2 else 'bad sizes'}")
    return rec_out


def copyable(pool: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether :func:`write_slots` can copy ``rows [n, ...]`` into ``pool [S, ...]``: the library loaded, both fp32,
    rows contiguous, each slot of the pool contiguous, the same row shape."""
    return pool.dtype is _F32 and rows.dtype is _F32 and bool(_lib) and not isinstance(_lib[0], str) and \
        rows.is_contiguous() and pool.shape[1:] == rows.shape[1:] and _slot_contiguous(pool)


def write_slots(row_slots: list, pairs: list) -> None:
    """``pool[row_slots[i]] = rows[i]`` for every (pool, rows) of ``pairs`` and every row i whose slot is not -1, in
    one ``kda_write_slots`` call (each pair :func:`copyable`; slots in range, checked by the caller)."""
    L, n = len(pairs), len(row_slots)
    _lib[0].kda_write_slots(L, n, (ctypes.c_long * n)(*row_slots), (_P * L)(*(d.data_ptr() for d, _ in pairs)),
                            (ctypes.c_long * L)(*(d.stride(0) for d, _ in pairs)),
                            (_P * L)(*(s.data_ptr() for _, s in pairs)),
                            (ctypes.c_long * L)(*(s.numel() // n if n else 0 for _, s in pairs)))


def _rows_ok(t: torch.Tensor) -> torch.Tensor:
    """``t [B, T, X]`` or ``[B, X]`` as a tensor whose tokens sit at a uniform stride with X contiguous (a view
    when it is)."""
    if t.stride(-1) == 1 and (t.dim() == 2 or t.shape[0] == 1 or t.shape[1] == 1 or t.stride(0) == t.shape[1] * t.stride(1)):
        return t
    return t.contiguous()


def _token_stride(t: torch.Tensor) -> int:
    return t.stride(1) if t.dim() == 3 and (t.shape[1] > 1 or t.shape[0] == 1) else t.stride(0)


def run(layer, raw, f_low, b, g_low, rec, conv, slot_idx, out=None, aux=False, records=True) -> tuple:
    """One ``kda_decode_layer`` call: the C form of :func:`kda_core.decode.kda_decode` (same arguments), returning
    (y, k, u, g, q, v, beta, states) as :class:`kda_core.decode.DecodeOut` lists them (None where not asked).
    Unchecked; the library must be loaded (:func:`load`). Raises ValueError if the kernel refuses the sizes."""
    if rec.dtype is not _F32 or conv.dtype is not _F32 or not _slots_contiguous(rec, conv):
        return _run_dense(layer, raw, f_low, b, g_low, rec, conv, slot_idx, out, aux, records)
    cfg = layer.cfg
    lead = raw.shape[:-1]                                                 # (B, T) or (B,)
    B, T = raw.shape[0], (lead[1] if raw.dim() == 3 else 1)
    H, K, V = cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
    raw, f_low, b, g_low = _rows_ok(raw), _rows_ok(f_low), _rows_ok(b), _rows_ok(g_low)
    y = raw.new_empty(*lead, H * V)                                       # [B, (T,) H V]
    rec_out = (raw.new_empty(*lead, H, K), raw.new_empty(*lead, H, V), raw.new_empty(*lead, H, K)) if records \
        else (None, None, None)                                           # k, u, g
    extra = (raw.new_empty(*lead, H, K), raw.new_empty(*lead, H, V), raw.new_empty(*lead, H),
             raw.new_empty(*lead, H, K, V)) if aux else None               # q, v, beta, states
    a = None
    if records or aux:
        ptrs = (dict(zip(("k", "u", "g"), rec_out)) if records else {}) | \
            (dict(zip(("q", "v", "beta", "states"), extra)) if aux else {})
        a = ctypes.byref(_Aux(**{name: t.data_ptr() for name, t in ptrs.items()}))
    rc = _lib[0].kda_decode_layer(ctypes.byref(weights(layer)), B, T,
                                  raw.data_ptr(), _token_stride(raw), f_low.data_ptr(), _token_stride(f_low),
                                  b.data_ptr(), _token_stride(b), g_low.data_ptr(), _token_stride(g_low),
                                  rec.data_ptr(), rec.stride(0), conv.data_ptr(), conv.stride(0),
                                  slot_idx.contiguous().data_ptr(),
                                  None if out is None else out[0].data_ptr(), 0 if out is None else out[0].stride(0),
                                  None if out is None else out[1].data_ptr(), 0 if out is None else out[1].stride(0),
                                  y.data_ptr(), a)
    if rc:
        raise ValueError(f"kda_decode_layer: {'out of memory' if rc == -2 else 'bad sizes'}")
    return (y, *rec_out, *(extra or (None,) * 4))


def _run_dense(layer, raw, f_low, b, g_low, rec, conv, slot_idx, out, aux, records) -> tuple:
    """The C form on dense fp32 copies of the live rows' states (a 16-bit pool upcast exactly, written back
    rounded to nearest; or a pool whose slots are not contiguous)."""
    live = (slot_idx != PAD_SLOT).nonzero().flatten()
    slots = slot_idx[live]
    S, W = gather(rec, slot_idx, live, slots), gather(conv, slot_idx, live, slots)
    dense = torch.where(slot_idx == PAD_SLOT, PAD_SLOT, torch.arange(slot_idx.shape[0]))
    res = run(layer, raw, f_low, b, g_low, S, W, dense, None, aux, records)
    if out is None:
        rec.index_copy_(0, slots, S[live].to(rec.dtype))
        conv.index_copy_(0, slots, W[live].to(conv.dtype))
    else:
        out[0][live], out[1][live] = S[live], W[live]
    return res


def _slot_contiguous(t: torch.Tensor) -> bool:
    """Whether each slot ``t[s]`` of a pool ``[S, ...]`` is contiguous (from the strides: no view made)."""
    return _rows_contiguous(t.shape, t.stride())


@functools.lru_cache(maxsize=256)
def _rows_contiguous(shape: tuple, stride: tuple) -> bool:
    want = 1
    for size, step in zip(reversed(shape[1:]), reversed(stride[1:])):
        if size != 1 and step != want:
            return False
        want *= size
    return True


def _slots_contiguous(rec, conv) -> bool:
    return _slot_contiguous(rec) and _slot_contiguous(conv)


def exp(g: torch.Tensor) -> torch.Tensor:
    """``exp(g)`` of fp32 CPU ``g`` (any shape) as ``kda_decode_layer``'s step computes its decay (``exp_f``)."""
    g = g.contiguous()
    out = torch.empty_like(g)
    _lib[0].kda_decode_exp(g.numel(), g.data_ptr(), out.data_ptr())
    return out


def replay(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``kda_decode_replay``: the state after the steps that consumed k, g ``[B, T, H, K]``, v ``[B, T, H, V]``,
    beta ``[B, T, H]`` (used as fp32), from state ``[B, H, K, V]`` (not mutated); returns it fp32. Raises
    ValueError if the kernel refuses the sizes."""
    k, v, g, beta = (t.to(torch.float32).contiguous() for t in (k, v, g, beta))
    S = state.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
    B, T, H, K = k.shape
    if _lib[0].kda_decode_replay(B, T, H, K, v.shape[-1], k.data_ptr(), v.data_ptr(), g.data_ptr(),
                                 beta.data_ptr(), S.data_ptr()):
        raise ValueError("kda_decode_replay: bad sizes")
    return S
