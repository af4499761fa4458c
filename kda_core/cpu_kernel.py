"""The fused C backend of :mod:`kda_core.chunk` (fp32, CPU, no autograd): ``csrc/kda_chunk_cpu.c``, built with the
system's C compiler (:mod:`kda_core.cpu_build`), loaded with :mod:`ctypes` and checked against the torch form
before it is used.

The torch form runs each step of the chunk algorithm as a separate op over every unit (chunk, batch row,
head), so most of its time goes to elementwise passes and layout copies between matmuls. The C form
computes a unit's WY / UT quantities in one pass over data that stays in cache (cumsum, both exps, the
scaled keys and queries, the two in-chunk products, the triangular solve, ``w`` and ``u``), and the scan
writes each chunk's outputs straight into ``o``; its matmuls are register-blocked tiles (8 x 32 on AVX-512's
zmm registers, 6 x 16 on AVX2's ymm: the path is chosen when the library is built, and both give the same
bits) that skip the zero blocks of triangular factors. Same algorithm and unit layout as :mod:`kda_core.wy`:
units that decay by more than ``MAX_CHUNK_DECAY`` nats (or hold ``g = -inf``) are flagged by the C pass
and computed by :func:`kda_core.wy.wy_safe`.

The C and torch forms agree to fp32 rounding, not bitwise (different summation orders and exp); each is bitwise
self-consistent (a unit's result never depends on where it sits in a call or on the thread count), so every
chunk-grid fact holds for either.

Life cycle: nothing happens on import. :func:`backend` (the path :func:`kda_core.cpu_build.default_isa` picks:
the widest this CPU runs, or ``$KDA_CPU_ISA``) and :func:`load` (any path) build the library (once per machine
and path: cached), load it and run :func:`self_check`, once per process, the first time they are called: by the
app's and the server's start-up (ahead of the first request), else by the first ``kda_chunk`` call that can use
it. It needs x86-64 with AVX2 and FMA (AVX-512F for the wider path), a C compiler (``$CC`` or ``cc``) and
``KDA_CPU_KERNEL`` not ``0``; where any is missing, or the self-check fails, :func:`backend` is None,
:func:`reason` says why and the torch form runs.
"""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from kda_core.chunk_torch import TORCH, units
from kda_core.cpu_build import ISAS, build, cpu_flags, default_isa, open_library
from kda_core.wy import MAX_CHUNK_DECAY, WY, wy_safe

SELF_CHECK_TOL = dict(rtol=1e-4, atol=1e-5)   # fp32, two summation orders (tests/kda_core/test_cpu_kernel.py)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_lock = threading.Lock()          # one loader at a time; the others wait for its result
_loaded: dict = {}                # path name (None: backend()'s) -> its FusedChunk, or why it has none (set once)


def kernel_inputs(q, k, v, g, beta) -> list:
    """The inputs as the C kernel reads them: fp32, q, k, v, g with a contiguous last dim (views when they are)."""
    xs = [x.to(torch.float32) for x in (q, k, v, g)]
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs] + [beta.to(torch.float32)]


def _strides(*ts) -> ctypes.Array:
    """The B, T, H strides (elements) of ``[B, T, H, *]`` tensors, as the C kernel reads them."""
    return (ctypes.c_long * (3 * len(ts)))(*[s for t in ts for s in t.stride()[:3]])


class FusedChunk:
    """The fused C form of one loaded library, built for path ``isa`` (:data:`kda_core.cpu_build.ISAS`): the four
    steps of :mod:`kda_core.chunk_torch` (fp32, CPU, no autograd) and the three C entry points they are made of
    (``c_prepare``, ``c_scan_outputs``, ``c_forward``). ``name``: "fused C (AVX-512)" or "fused C (AVX2)".
    Raises RuntimeError when the library was not built for ``isa`` (its vector width differs)."""

    def __init__(self, path: Path, isa: str):
        lib = open_library(path, isa, "kda_vector_bits")
        lib.kda_prepare.restype = _I
        lib.kda_prepare.argtypes = [_I] * 6 + [_F] + [_P] * 6 + [_P] * 7 + [_I]
        lib.kda_forward.restype = _I
        lib.kda_forward.argtypes = [_I] * 6 + [_F, _F] + [_P] * 6 + [_P] * 3 + [_I]
        lib.kda_scan_outputs.restype = None
        lib.kda_scan_outputs.argtypes = [_I] * 7 + [_F] + [_P] * 6 + [_P] * 4 + [_I, _I, _I]
        self.lib, self.path, self.isa = lib, path, isa
        self.name = f"fused C ({ISAS[isa].label})"

    # ---- the C entry points ----
    def c_prepare(self, q, k, v, g, beta, C: int, max_decay: float, out: tuple) -> torch.Tensor:
        """Fill ``out`` = (qg ``[n, C, K]``, Aqk ``[n, C, C]``, w ``[n, C, K]``, u ``[n, C, V]``, kd ``[n, C, K]``,
        decay_last ``[n, K]``; n = NT B H, chunk-major, contiguous fp32) from fp32 q, k, g ``[B, T, H, K]``,
        v ``[B, T, H, V]``, beta ``[B, T, H]`` (last dim contiguous). Returns the bool ``[n]`` mask of units
        left to the safe form (their rows of ``out`` are not written). Raises MemoryError when the kernel
        cannot allocate its scratch."""
        B, T, H, K = q.shape
        slow = torch.zeros(out[0].shape[0], dtype=torch.uint8)
        nslow = self.lib.kda_prepare(B, T, H, K, v.shape[-1], C, float(max_decay),
                                     *(t.data_ptr() for t in (q, k, v, g, beta)), _strides(q, k, v, g, beta),
                                     *(t.data_ptr() for t in out), slow.data_ptr(), torch.get_num_threads())
        if nslow < 0:
            raise MemoryError("kda_chunk: the fused kernel could not allocate its scratch")
        return slow.bool()

    def c_scan_outputs(self, NT: int, B: int, H: int, C: int, T: int, scale: float, wy: WY, h: torch.Tensor,
                       v_new: torch.Tensor, o: torch.Tensor | None, scan: bool) -> None:
        """The scan (``scan``: v_new and h[1:] written from h[0]) and / or the outputs (``o`` not None: its
        first T tokens written, o ``[B, T, H, V]`` fp32 with contiguous last dim) of NT chunks; wy: contiguous
        chunk-major unit tensors (:meth:`c_prepare`), h ``[NT + 1 (scan) or NT, B*H, K, V]`` and v_new
        ``[NT, B*H, C, V]`` contiguous fp32."""
        K, V = wy.w.shape[-1], wy.u.shape[-1]
        so = (ctypes.c_long * 3)(*(o.stride()[:3] if o is not None else (0, 0, 0)))
        self.lib.kda_scan_outputs(NT, B, H, K, V, C, T, float(scale), *(t.data_ptr() for t in wy), h.data_ptr(),
                                  v_new.data_ptr(), o.data_ptr() if o is not None else None, so, int(scan),
                                  int(o is not None), torch.get_num_threads())

    def c_forward(self, q, k, v, g, beta, C: int, max_decay: float, scale: float, h: torch.Tensor,
                  o: torch.Tensor) -> int:
        """The whole forward in one C pass, chunk by chunk (each unit's WY quantities, scan step and outputs
        while its data is in cache): inputs as :meth:`c_prepare`, h ``[NT + 1, B, H, K, V]`` contiguous fp32
        with ``h[0]`` the initial state, o ``[B, T, H, V]`` fp32 (contiguous last dim). Returns the index of the
        first chunk it did not finish (NT when done): a chunk with a unit beyond the chunk-level bound, run
        from there on by :meth:`forward` through :meth:`prepare` and :meth:`c_scan_outputs`."""
        B, T, H, K = q.shape
        so = (ctypes.c_long * 3)(*o.stride()[:3])
        j = self.lib.kda_forward(B, T, H, K, v.shape[-1], C, float(max_decay), float(scale),
                                 *(t.data_ptr() for t in (q, k, v, g, beta)), _strides(q, k, v, g, beta),
                                 h.data_ptr(), o.data_ptr(), so, torch.get_num_threads())
        if j < 0:
            raise MemoryError("kda_chunk: the fused kernel could not allocate its scratch")
        return j

    # ---- the four steps of a backend ----
    def prepare(self, q, k, v, g, beta, C: int, may_forget: bool) -> WY:
        """Every unit within the chunk-level bound in C; the others by :func:`kda_core.wy.wy_safe`."""
        B, T, H, K = q.shape
        n, V = max(1, -(-T // C)) * B * H, v.shape[-1]
        wy = WY(*(torch.empty(n, *shape) for shape in ((C, K), (C, C), (C, K), (C, V), (C, K), (K,))))
        slow = self.c_prepare(*kernel_inputs(q, k, v, g, beta), C, MAX_CHUNK_DECAY, wy)
        if bool(slow.any()):                         # beyond the chunk-level bound, or g = -inf: the safe form
            idx = slow.nonzero().squeeze(1)
            flat = [units(x, C, torch.float32).reshape(n, C, -1)[idx] for x in (g, k, q, v, beta.unsqueeze(-1))]
            for buf, part in zip(wy, wy_safe(*flat, may_forget)):
                buf.index_copy_(0, idx, part)
        return wy

    def states(self, wy: WY, B: int, H: int, S: torch.Tensor) -> tuple:
        """The scan in C, in place into one ``[NT + 1, B*H, K, V]`` tensor."""
        n, C, _ = wy.w.shape
        NT = n // (B * H)
        h = S.new_empty(NT + 1, *S.shape)
        h[0] = S
        v_new = S.new_empty(NT, B * H, C, wy.u.shape[-1])
        self.c_scan_outputs(NT, B, H, C, 0, 1.0, wy, h, v_new, None, True)
        return h[:NT], v_new, h[NT].clone()

    def outputs(self, wy: WY, h: torch.Tensor, v_new: torch.Tensor, B: int, H: int, T: int, scale: float):
        """The outputs in C, into a new ``[B, T, H, V]`` tensor."""
        n, C, _ = wy.qg.shape
        o = wy.qg.new_empty(B, T, H, wy.u.shape[-1])
        self.c_scan_outputs(n // (B * H), B, H, C, T, scale, wy, h.contiguous(), v_new.contiguous(), o, False)
        return o

    def forward(self, q, k, v, g, beta, h: torch.Tensor, scale: float, C: int, piece_tokens: int,
                may_forget: bool) -> torch.Tensor:
        """One C pass (:meth:`c_forward`); from the first chunk beyond the chunk-level bound on, piece by piece:
        :meth:`prepare` and the scan and outputs in one C pass, o written in place. o ``[B, T, H, V]`` fp32."""
        B, T, H, K = q.shape
        V = v.shape[-1]
        o = torch.empty(B, T, H, V)                                           # [B, T, H, V]
        start = C * self.c_forward(*kernel_inputs(q, k, v, g, beta), C, MAX_CHUNK_DECAY, scale, h, o)
        for s in range(start, max(T, 1), piece_tokens):
            part = slice(s, s + piece_tokens)
            wy = self.prepare(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], C, may_forget)
            j, nt = s // C, len(wy.w) // (B * H)
            v_new = h.new_empty(nt, B * H, C, V)
            self.c_scan_outputs(nt, B, H, C, min(T - s, piece_tokens), scale, wy, h[j: j + nt + 1], v_new,
                                o[:, part], True)
        return o


def self_check(fused: FusedChunk) -> None:
    """``fused`` against the torch form on a small call with a partial last chunk, a unit beyond the chunk-level
    bound and K, V not multiples of 16 (every code path of the kernel): the whole forward and the three steps
    apart, to fp32 rounding (:data:`SELF_CHECK_TOL`). Raises RuntimeError when they disagree."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V, C = 2, 150, 2, 24, 20, 64
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * 0.5
    g[0, 70:80, 1] = -8.0                           # one unit beyond the chunk-level bound (chunk 1 of 3)
    beta = torch.rand(B, T, H, generator=gen)
    S = torch.randn(B * H, K, V, generator=gen) * 0.3
    got, want = {}, {}
    with torch.no_grad():
        for form, res in ((fused, got), (TORCH, want)):
            h = torch.empty(4, B, H, K, V)
            h[0] = S.view(B, H, K, V)
            res["o"] = form.forward(q, k, v, g, beta, h, K ** -0.5, C, 128, False)
            res["h"] = h
            wy = form.prepare(q, k, v, g, beta, C, False)
            hs, v_new, res["final"] = form.states(wy, B, H, S)
            res["o_split"] = form.outputs(wy, hs, v_new, B, H, T, K ** -0.5)
    for name in want:
        if not torch.allclose(got[name], want[name], **SELF_CHECK_TOL):
            diff = float((got[name] - want[name]).abs().max())
            raise RuntimeError(f"self-check failed: {name} differs from the torch form by up to {diff:.3g}")


def load(isa: str) -> FusedChunk:
    """The fused backend of path ``isa`` (:data:`kda_core.cpu_build.ISAS`), built (when not cached), loaded and
    self-checked on the first call in this process; calls from other threads meanwhile wait for it, later calls
    return the same object. Raises RuntimeError saying why it cannot run (turned off by ``KDA_CPU_KERNEL=0``,
    a CPU without the path's instructions, no compiler, a failed self-check), the same on every call."""
    if isa not in _loaded:
        with _lock:
            if isa not in _loaded:
                try:
                    if os.environ.get("KDA_CPU_KERNEL", "1") == "0":
                        raise RuntimeError("turned off by KDA_CPU_KERNEL=0")
                    if isa not in ISAS:
                        raise RuntimeError(f"unknown path {isa!r} (one of {sorted(ISAS)})")
                    missing = ISAS[isa].needs - cpu_flags()
                    if missing:
                        raise RuntimeError(f"the {ISAS[isa].label} path needs a CPU with {' '.join(sorted(missing))}")
                    fused = FusedChunk(build(isa), isa)
                    self_check(fused)
                    _loaded[isa] = fused
                except Exception as exc:          # any failure: the torch form runs, and the reason is kept
                    _loaded[isa] = str(exc) or type(exc).__name__
    got = _loaded[isa]
    if isinstance(got, str):
        raise RuntimeError(got)
    return got


def backend() -> FusedChunk | None:
    """The fused backend ``kda_chunk`` uses here: path :func:`kda_core.cpu_build.default_isa` (the widest this
    CPU runs, or ``$KDA_CPU_ISA``) through :func:`load`, chosen on the first call in this process (later calls
    are a dict lookup: every ``kda_chunk`` call asks); None where it cannot run (:func:`reason` says why).
    Start-up code calls it ahead of the first request."""
    if None not in _loaded:
        try:
            got = load(default_isa())
        except RuntimeError as exc:
            got = str(exc)
        _loaded.setdefault(None, got)     # threads racing here got the same result from load()
    got = _loaded[None]
    return None if isinstance(got, str) else got


def load_in_background() -> threading.Thread:
    """Start :func:`backend` in a daemon thread and return it: a start-up whose first request comes after other
    slow work (the app's imports) overlaps the build with it; a ``kda_chunk`` call meanwhile waits for the result."""
    thread = threading.Thread(target=backend, name="kda-kernel-load", daemon=True)
    thread.start()
    return thread


def reason() -> str | None:
    """Why :func:`backend` is None (None when it is not); loads the backend first, as :func:`backend` does."""
    backend()
    got = _loaded[None]
    return got if isinstance(got, str) else None


def available() -> bool:
    """Whether :func:`kda_core.chunk.kda_chunk` runs the fused C form here (fp32, CPU, no autograd)."""
    return backend() is not None
