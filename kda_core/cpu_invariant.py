"""The C forms of :mod:`kda_core.invariant`'s row-invariant ops (fp32, CPU): the GEMM of ``linear`` and the RMSNorm
of ``rmsnorm``, ``csrc/invariant_cpu.c``, built with the system's C compiler (:mod:`kda_core.cpu_build`, the same
vector paths as the chunk kernel) and loaded with :mod:`ctypes`.

Every output ``out[m, n]`` is one accumulator that takes ``x[m, k] * W[n, k]`` for k = 0 .. K-1 in that order,
each step a fused multiply-add: no split of K, no reassociation. An FMA is exactly rounded, so every tile size,
the masked tails, the AVX-512 and AVX2 paths and the scalar ``fmaf`` loop (:meth:`CInvariant.reference`) give the
same bits, and row m's result never depends on how many rows the call holds, with no padding (MKL's sgemm
switches kernels below 16 rows, so the torch form pads every call to 16 rows). The weight is packed once into
16-column panels (:meth:`CInvariant.packed`: cached on the weight, repacked when it is written in place). An
in-place write is seen through autograd's version counter (``copy_``, ``mul_``, ``load_state_dict``, optimizers);
a write that bypasses it (through ``w.data`` or a NumPy view) is not, and must be followed by :func:`forget`.

The RMSNorm sums each row's squares in a fixed order (16 fmaf lanes, then a fixed tree), one row at a time:
row-invariant too, and one call where the torch form takes five ops plus the padding of ``pointwise``.

Chosen once per process (:func:`backend`, on the first ``linear`` call or by start-up code), never switched:
a checkpoint computed on one path and reused on the other would not be bitwise. It needs x86-64 with AVX2 and
FMA, a C compiler, and neither ``KDA_CPU_GEMM=0`` nor ``KDA_CPU_KERNEL=0``; then, and when the self-check
passes, it runs every fp32 CPU ``linear`` and ``rmsnorm``; else the torch form does and :func:`reason` says why.

Shapes: M rows, N output features (``D_out``), K input features (``D_in``); panels ``NP = ceil(N / 16)``.
"""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from kda_core.cpu_build import ISAS, build, default_isa, open_library

SOURCE = Path(__file__).parent / "csrc" / "invariant_cpu.c"
FLAGS = ("-ffp-contract=off",)     # the scalar reference's fmaf stays one FMA; nothing else is contracted
ENV = "KDA_CPU_GEMM"               # "0": the torch form (padded MKL) in this process
PANEL = 16                         # output columns per packed panel
_CACHE_ATTR = "_kda_gemm_packed"   # on the weight's base tensor: {(data_ptr, shape): (version, packed)}
_EXPERTS_ATTR = "_kda_gemm_experts"  # on an expert stack: ((data_ptr, version), C array of its packed addresses)

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
_lock = threading.Lock()
_chosen: list = []                 # [the CInvariant, or why there is none] (set once per process)
_forgets = [0]                     # calls of forget() so far: part of the key of every C form's cached weights


_threads = torch.get_num_threads


class CInvariant:
    """One loaded library of path ``isa`` (:data:`kda_core.cpu_build.ISAS`). Raises RuntimeError when the
    library was not built for it (its vector width differs)."""

    def __init__(self, path: Path, isa: str):
        lib = open_library(path, isa, "linear_vector_bits")
        lib.linear_pack_f32.restype = None
        lib.linear_pack_f32.argtypes = [_I, _I, _P, _L, _P]
        lib.linear_ref_f32.restype = None
        lib.linear_ref_f32.argtypes = [_I, _I, _I, _P, _L, _P, _L, _P, _L]
        lib.linear_f32.restype = _I
        lib.linear_f32.argtypes = [_I, _I, _I, _P, _L, _P, _P, _L, _I]
        lib.rmsnorm_f32.restype = None
        lib.rmsnorm_f32.argtypes = [_I, _I, _P, _L, _P, ctypes.c_float, _P, _L]
        self._rms = lib.rmsnorm_f32
        self.lib, self.path, self.isa = lib, path, isa
        self._run = lib.linear_f32
        self.name = f"C GEMM ({ISAS[isa].label})"

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        """w ``[N, K]`` fp32 -> packed ``[NP, K, 16]``: ``packed[p, k, j] = w[16 p + j, k]``, 0 past N."""
        w = w if w.stride(-1) == 1 else w.contiguous()
        N, K = w.shape
        packed = torch.empty(-(-N // PANEL), K, PANEL)                      # [NP, K, 16]
        self.lib.linear_pack_f32(N, K, w.data_ptr(), w.stride(0), packed.data_ptr())
        return packed

    def packed(self, w: torch.Tensor) -> tuple:
        """(packed ``[NP, K, 16]`` = :meth:`pack` of w, its address), cached on w's base tensor (views of one
        parameter, e.g. an expert's slice, share it) by (address, shape, strides) and repacked when the
        tensor's version counter moved (an in-place write)."""
        base = w._base
        owner = w if base is None else base
        cache = owner.__dict__.get(_CACHE_ATTR)
        if cache is None:
            cache = owner.__dict__[_CACHE_ATTR] = {}
        key = (w.data_ptr(), w.shape, w.stride())
        hit = cache.get(key)
        if hit is None or hit[0] != w._version:
            packed = self.pack(w)
            hit = cache[key] = (w._version, packed, packed.data_ptr())
        return hit[1], hit[2]

    def packed_cat(self, ws: tuple) -> tuple:
        """:meth:`packed` of the weights ``ws`` concatenated along their output dim (``[sum N, K]``), cached on
        the first weight's base tensor by every weight's (address, shape, strides), repacked when any of their
        version counters moved."""
        w0 = ws[0]
        owner = w0 if w0._base is None else w0._base
        cache = owner.__dict__.get(_CACHE_ATTR)
        if cache is None:
            cache = owner.__dict__[_CACHE_ATTR] = {}
        key = tuple((w.data_ptr(), w.shape, w.stride()) for w in ws)
        versions = tuple(w._version for w in ws)
        hit = cache.get(key)
        if hit is None or hit[0] != versions:
            packed = self.pack(torch.cat(ws))
            hit = cache[key] = (versions, packed, packed.data_ptr())
        return hit[1], hit[2]

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        """x ``[..., K]`` @ w ``[N, K]``^T -> ``[..., N]``, fp32; w may be a tuple of weights ``[N_i, K]``, read as
        their concatenation (``N = sum N_i``: one call; each output's bits are those of its own weight's call).
        ``[M, K]`` and ``[1, M, K]`` inputs with a row stride are read in place. Unchecked: the caller checks
        shapes and dtypes."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        shape = x.shape
        if x.dim() == 2 or x.dim() == 3 and shape[0] == 1:
            M, ldx = shape[-2], x.stride(-2)
        else:
            x = x.reshape(-1, shape[-1])                                    # [M, K]
            M, ldx = x.shape[0], x.stride(0)
        single = isinstance(w, torch.Tensor)
        _, packed_ptr = self.packed(w) if single else self.packed_cat(w)
        N = w.shape[0] if single else sum(t.shape[0] for t in w)
        out = x.new_empty((*shape[:-1], N))                                 # [..., N]
        self._run(M, N, shape[-1], x.data_ptr(), ldx, packed_ptr, out.data_ptr(), N, _threads())
        return out

    def packed_experts(self, ws: torch.Tensor) -> ctypes.Array:
        """The packed copies (:meth:`packed`) of each ``ws[e]`` of an expert stack ``ws [E, N, K]``, as a C array
        of their addresses, cached on ``ws`` and rebuilt when its version counter moved."""
        hit = ws.__dict__.get(_EXPERTS_ATTR)
        if hit is None or hit[0] != (ws.data_ptr(), ws._version):
            ptrs = (_L * ws.shape[0])(*(self.packed(ws[e])[1] for e in range(ws.shape[0])))
            hit = ws.__dict__[_EXPERTS_ATTR] = ((ws.data_ptr(), ws._version), ptrs)
        return hit[1]

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x ``[..., D]`` fp32 with weight ``[D]`` fp32 -> ``[..., D]`` (unchecked)."""
        D = x.shape[-1]
        if not weight.is_contiguous():
            weight = weight.contiguous()
        if x.is_contiguous():                                               # read in place: no reshape, no view
            out = x.new_empty(x.shape)                                      # [..., D]
            self._rms(x.numel() // D if D else 0, D, x.data_ptr(), D, weight.data_ptr(), eps, out.data_ptr(), D)
            return out
        rows = x.reshape(-1, D)                                             # [M, D]
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = rows.new_empty(rows.shape)                                    # [M, D]
        self._rms(rows.shape[0], D, rows.data_ptr(), rows.stride(0), weight.data_ptr(), eps, out.data_ptr(), D)
        return out.view(x.shape)

    def reference(self, rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The scalar form: one ``fmaf`` per step in the same order (tests and the self-check). rows ``[M, K]``,
        w ``[N, K]`` fp32 with contiguous last dims -> ``[M, N]``."""
        out = torch.empty(rows.shape[0], w.shape[0])
        self.lib.linear_ref_f32(rows.shape[0], w.shape[0], rows.shape[1], rows.data_ptr(), rows.stride(0),
                                w.data_ptr(), w.stride(0), out.data_ptr(), w.shape[0])
        return out


def self_check(gemm: CInvariant) -> None:
    """``gemm`` against its scalar form, bitwise, on sizes that reach every tile and tail (M 1..13, N not a
    multiple of 16, K odd), each row alone against the whole call, and its RMSNorm against the torch form
    (fp32 rounding). Raises RuntimeError when they differ."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(13, 37, generator=gen), torch.randn(75, 37, generator=gen)
    full = gemm.linear(x, w)
    if not torch.equal(full, gemm.reference(x, w)):
        raise RuntimeError("self-check failed: the C GEMM differs from its scalar fmaf form")
    for m in range(1, 13):
        if not torch.equal(gemm.linear(x[m - 1: m], w), full[m - 1: m]) or not torch.equal(gemm.linear(x[:m], w),
                                                                                            full[:m]):
            raise RuntimeError(f"self-check failed: rows of a {m}-row call differ from the 13-row call's")
    norm_w = torch.rand(37, generator=gen) + 0.5
    ref = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm_w
    normed = gemm.rmsnorm(x, norm_w, 1e-6)
    if not torch.allclose(normed, ref, rtol=1e-5, atol=1e-6):
        raise RuntimeError("self-check failed: the C RMSNorm differs from the torch form")
    if not all(torch.equal(gemm.rmsnorm(x[m - 1: m], norm_w, 1e-6), normed[m - 1: m]) for m in range(1, 13)):
        raise RuntimeError("self-check failed: the C RMSNorm of a row alone differs from the 13-row call's")


def load(isa: str, check: bool = True) -> CInvariant:
    """Build (when not cached), load and (``check``) self-check the C GEMM of path ``isa`` (a new object each
    call: tests and benches compare paths; tests load unchecked, to see a wrong kernel fail rather than skip).
    Raises RuntimeError saying why it cannot run."""
    if isa not in ISAS:
        raise RuntimeError(f"unknown path {isa!r} (one of {sorted(ISAS)})")
    gemm = CInvariant(build(isa, SOURCE, FLAGS), isa)
    if check:
        self_check(gemm)
    return gemm


def backend() -> CInvariant | None:
    """The C GEMM every fp32 CPU :func:`kda_core.invariant.linear` call of this process runs, chosen on the first
    call (later calls return the same answer): path :func:`kda_core.cpu_build.default_isa`; None where it is
    turned off (``KDA_CPU_GEMM=0`` or ``KDA_CPU_KERNEL=0``) or cannot run (:func:`reason` says why)."""
    if not _chosen:
        with _lock:
            if not _chosen:
                try:
                    if os.environ.get(ENV, "1") == "0" or os.environ.get("KDA_CPU_KERNEL", "1") == "0":
                        raise RuntimeError(f"turned off by {ENV}=0 or KDA_CPU_KERNEL=0")
                    got = load(default_isa())
                except Exception as exc:          # any failure: the torch form runs, and the reason is kept
                    got = str(exc) or type(exc).__name__
                _chosen.append(got)
    got = _chosen[0]
    return None if isinstance(got, str) else got


def form_on_gemm(chosen: list, lock: threading.Lock, load):
    """A C form built on this GEMM (:mod:`kda_core.cpu_moe`, :mod:`kda_core.cpu_mla`), chosen once per process:
    ``load(gemm)`` on the first call, its result (or why it failed: the torch form then runs) kept in ``chosen``
    (a one-item list owned by that module) under ``lock``; None where :func:`backend` is None or ``load`` raised."""
    if not chosen:
        with lock:
            if not chosen:
                gemm = backend()
                try:
                    if gemm is None:
                        raise RuntimeError(f"no C GEMM: {reason()}")
                    got = load(gemm)
                except Exception as exc:          # any failure: the torch form runs, and the reason is kept
                    got = str(exc) or type(exc).__name__
                chosen.append(got)
    got = chosen[0]
    return None if isinstance(got, str) else got


def forget(*tensors: torch.Tensor) -> None:
    """Drop the packed copies cached for ``tensors`` (weights, or any view of them: the cache lives on the base
    tensor), so the next call packs them again. Needed only after a write that autograd's version counter does not
    see (``w.data.copy_(...)``, a NumPy view). Weights packed together (one GEMM over several projections) are cached
    on the first of them, so pass all of a module's: ``forget(*model.parameters())``. Every C form's own cache of
    a module's weights (:mod:`kda_core.cpu_moe`'s and :mod:`kda_core.cpu_mla`'s blocks, which point into the
    packed copies; :mod:`kda_core.decode_cpu`'s transposed gates) keys on :func:`forgets`, so each is rebuilt on
    its next use."""
    _forgets[0] += 1
    for t in tensors:
        for u in (t, t._base) if t._base is not None else (t,):
            u.__dict__.pop(_CACHE_ATTR, None)
            u.__dict__.pop(_EXPERTS_ATTR, None)


def forgets() -> int:
    """How many times :func:`forget` has run in this process (a cache keyed on it is rebuilt after each)."""
    return _forgets[0]


def reason() -> str | None:
    """Why :func:`backend` is None (None when it is not); chooses first, as :func:`backend` does."""
    backend()
    return _chosen[0] if isinstance(_chosen[0], str) else None
