"""The C form of the absorbed MLA decode attention (:meth:`kda_core.layer.MLALayer.attend_absorbed`,
``csrc/mla_cpu.c``): Q queries (decode and verify tokens), each over its own run of latents, in one call: the
absorption of ``q_nope`` through ``W_uk``, the scores, the softmax, the latent output and its projection through
``W_uv``. Its GEMMs are the row-invariant GEMM of :mod:`kda_core.cpu_invariant` (bitwise
:meth:`MLALayer.absorb_queries` / :meth:`MLALayer.absorbed_output`); its scores, softmax and weighted sum are
fixed-order FMA chains with a Cephes ``exp``, within :data:`RTOL` / :data:`ATOL` of the torch form
(:func:`kda_core.layer.latent_attention`), not bitwise. A query's bits depend on its own query and latents only, and
every absorbed attention of the process (the engine's decode and verify rows, the model's ``forward(mode=
"recurrent")``) runs this form where it runs, so those agree bitwise.

Chosen once per process (:func:`backend`): where :func:`kda_core.cpu_invariant.backend` runs the C GEMM and this
library builds; else None (the torch form runs) and :func:`reason` says why.

Shapes: Q queries, Hm heads, dq = nope + rope query width, r latent rank, R = r + rope latent width, vd value dim.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from kda_core import cpu_invariant
from kda_core.cpu_build import build, open_library

SOURCE = Path(__file__).parent / "csrc" / "mla_cpu.c"
FLAGS = ("-ffp-contract=off",)     # products outside the FMA chains rounded on their own
RTOL = 1e-5                        # C form vs torch form on outputs of order 1 (exp a few ulp apart, then sums)
ATOL = 1e-5

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_lock = threading.Lock()
_chosen: list = []                 # [the CMLA, or why there is none] (set once per process)
_MODULE_ATTR = "_kda_mla_block"    # on the MLA layer: ([(id, address, version) of its weights, forgets], _Block)


class _Block(ctypes.Structure):
    """``struct mla_block`` of the source: an MLA layer's sizes and packed absorption weights."""

    _fields_ = [(n, _I) for n in ("Hm", "nope", "rope", "r", "vd")] + [
        ("scale", _F), ("uk", _P), ("uv", _P), ("linear", _P), ("D", _I), ("eps", _F), ("proj", _P), ("norm", _P),
        ("o", _P), ("rmsnorm", _P)]


class CMLA:
    """The loaded library for the C GEMM ``gemm``'s path. Raises RuntimeError when it was not built for it."""

    def __init__(self, path: Path, gemm: cpu_invariant.CInvariant):
        lib = open_library(path, gemm.isa, "mla_vector_bits")
        lib.mla_absorbed_f32.restype = _I
        lib.mla_absorbed_f32.argtypes = [_I, _P, _L, _P, _L, _I, _L, _L, _P, _L, _P, _L, _L, _P, _P, _L, _P, _I]
        lib.mla_decode_f32.restype = _I
        lib.mla_decode_f32.argtypes = [_I, _P, _L, _P, _L, _I, _L, _L, _P, _L, _P, _P, _L, _P, _I]
        self.lib, self.path, self.gemm = lib, path, gemm
        self._run = lib.mla_absorbed_f32
        self._linear = ctypes.cast(gemm.lib.linear_f32, _P).value
        self._rmsnorm = ctypes.cast(gemm.lib.rmsnorm_f32, _P).value        # the RMSNorm every rmsnorm() call runs
        self._decode = lib.mla_decode_f32
        lib.mla_decode_residual_f32.restype = _I
        lib.mla_decode_residual_f32.argtypes = [_I, _P, _L, _P, _F, _P, _L, _I, _L, _L, _P, _L, _P, _P, _I]
        self._residual = lib.mla_decode_residual_f32

    def _block(self, m) -> _Block:
        """``m``'s :class:`_Block`, cached on the layer, rebuilt when a weight was replaced or written in place or
        :func:`kda_core.cpu_invariant.forget` was called."""
        params = m._parameters                                              # (not nn.Module.__getattr__: µs)
        ws = (params["kv_b"], params["kv_a"], params["q_proj"], params["kv_norm"], params["o_proj"])
        key = [(id(w), w.data_ptr(), w._version) for w in ws] + [cpu_invariant.forgets()]
        hit = m.__dict__.get(_MODULE_ATTR)
        if hit is not None and hit[0] == key:
            return hit[1]
        cfg, g = m.cfg, self.gemm
        kv_b, kv_a, q_proj, kv_norm, o_proj = ws
        Hm, nope, vd, r = cfg.num_mla_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        wkv = kv_b.view(Hm, nope + vd, r)                                   # [Hm, nope + vd, r]
        uk = (_L * Hm)(*(g.packed(wkv[h, :nope].T)[1] for h in range(Hm)))  # W_uk[h]^T [r, nope], as absorb_queries
        uv = (_L * Hm)(*(g.packed(wkv[h, nope:])[1] for h in range(Hm)))    # W_uv[h] [vd, r], as absorbed_output
        norm = kv_norm if kv_norm.is_contiguous() else kv_norm.contiguous()
        block = _Block(Hm, nope, cfg.qk_rope_head_dim, r, vd, m.scale, ctypes.addressof(uk), ctypes.addressof(uv),
                       self._linear, cfg.hidden_size, cfg.rms_norm_eps, g.packed_cat((kv_a, q_proj))[1],
                       norm.data_ptr(), g.packed(o_proj)[1], self._rmsnorm)
        block._keep = (uk, uv, norm)                                        # what it points to, beyond the caches
        m.__dict__[_MODULE_ATTR] = (key, block)
        return block

    def attend(self, m, q: torch.Tensor, lat: torch.Tensor, first: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Absorbed attention of MLA layer ``m``: queries q ``[Q, Hm, dq]`` fp32 over latents lat ``[N_lat, R]`` fp32,
        query i over rows ``[first[i], first[i] + lens[i])`` (first, lens ``[Q]`` int64) -> ``[Q, Hm vd]``.

        Raises ValueError for a latent run that is empty or outside lat; shapes and dtypes are the caller's."""
        zeros = torch.zeros_like(first)
        return self.attend_paged(m, q, lat, torch.stack([zeros, zeros, first, lens]), None, None)

    def attend_paged(self, m, q: torch.Tensor, lat: torch.Tensor, qm: torch.Tensor, cache: torch.Tensor | None,
                     pages: torch.Tensor | None) -> torch.Tensor:
        """:meth:`attend` with each query's first latents read in place from a paged cache: query i reads
        ``qm[3, i]`` latents, the first ``qm[1, i]`` of them from cache ``[num_pages, NB, R]`` (any page stride;
        latent j in page ``pages[qm[0, i] + j // NB]`` at offset ``j % NB``), the rest the rows ``[qm[2, i], ...)``
        of lat ``[N_lat, R]``. qm ``[4, Q]`` int64 (contiguous), pages ``[n]`` int64 -> ``[Q, Hm vd]``.

        Raises ValueError for a run that is empty, a page outside the cache or rows outside lat."""
        if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
            q = q.contiguous()
        if lat.stride(-1) != 1:
            lat = lat.contiguous()
        Q = q.shape[0]
        out = q.new_empty((Q, m.cfg.num_mla_heads * m.cfg.v_head_dim))    # [Q, Hm vd]
        if cache is None:
            page = (None, 0, 1, 0, 0, None, 0)
        else:
            if cache.stride(-1) != 1:
                raise ValueError("cache must have a contiguous last dim")
            page = (cache.data_ptr(), cache.stride(0), cache.shape[1], cache.stride(1), cache.shape[0],
                    pages.data_ptr(), pages.shape[0])
        rc = self._run(Q, q.data_ptr(), q.stride(0), *page[:5], page[5], page[6], lat.data_ptr(), lat.stride(0),
                       lat.shape[0], qm.data_ptr(), out.data_ptr(), out.shape[1], ctypes.byref(self._block(m)),
                       _threads())
        if rc == 3:
            raise ValueError(f"every query needs a non-empty run of latents inside its storage (lat has "
                             f"{lat.shape[0]} rows), got (table start, cached, first, length) {qm.T.tolist()}")
        if rc:
            raise RuntimeError(f"mla_absorbed_f32 failed with code {rc}")
        return out


    def decode(self, m, h: torch.Tensor, cache: torch.Tensor, qm: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """The whole MLA layer ``m`` for Q decode tokens (one per row) of hidden states h ``[Q, D]`` fp32, as
        ``MLALayer.forward(mode="recurrent")`` computes a token (bitwise: the same GEMMs, RMSNorm and attention):
        projections, the new latent written in place to cache ``[num_pages, NB, R]`` at page ``qm[4, i]``, offset
        ``qm[5, i]`` (page < 0: not written), the absorbed attention of query i over the run ``qm[0:4, i]`` of
        :meth:`attend_paged` (its new latents: the ones just formed, row i of them), ``o_proj``. qm ``[6, Q]`` int64
        (contiguous) -> y ``[Q, D]``.

        Raises ValueError for a bad run, page or offset (nothing written then), or for a layer with rotary
        embedding (``mla_use_nope`` false: this call rotates nothing)."""
        if not m.cfg.mla_use_nope:
            raise ValueError("decode runs MLA layers without rotary embedding (mla_use_nope) only")
        if h.stride(-1) != 1:
            h = h.contiguous()
        if cache.stride(-1) != 1:
            raise ValueError("cache must have a contiguous last dim")
        Q, D = h.shape
        y = h.new_empty((Q, D))                                             # [Q, D]
        rc = self._decode(Q, h.data_ptr(), h.stride(0), cache.data_ptr(), cache.stride(0), cache.shape[1],
                          cache.stride(1), cache.shape[0], pages.data_ptr(), pages.shape[0], qm.data_ptr(), y.data_ptr(),
                          D, ctypes.byref(self._block(m)), _threads())
        if rc == 3:
            raise ValueError(f"every query needs a non-empty run of latents inside its storage and a write inside the "
                             f"cache, got (table start, cached, first, length, page, offset) {qm.T.tolist()}")
        if rc:
            raise RuntimeError(f"mla_decode_f32 failed with code {rc}")
        return y


    def decode_residual(self, m, x: torch.Tensor, norm: torch.Tensor, eps: float, cache: torch.Tensor,
                        qm: torch.Tensor, pages: torch.Tensor) -> None:
        """The MLA sublayer for Q decode tokens in place: ``x [Q, D] += decode(m, rmsnorm(x, norm, eps), ...)`` in
        one call, bitwise :func:`kda_core.invariant.rmsnorm`, :meth:`decode` (same cache, qm, pages) and torch's add.
        x fp32 with contiguous rows, norm ``[D]`` fp32 contiguous. Raises as :meth:`decode` (x then unchanged)."""
        if not m.cfg.mla_use_nope:
            raise ValueError("decode runs MLA layers without rotary embedding (mla_use_nope) only")
        if cache.stride(-1) != 1:
            raise ValueError("cache must have a contiguous last dim")
        rc = self._residual(x.shape[0], x.data_ptr(), x.stride(0), norm.data_ptr(), eps, cache.data_ptr(),
                            cache.stride(0), cache.shape[1], cache.stride(1), cache.shape[0], pages.data_ptr(),
                            pages.shape[0], qm.data_ptr(), ctypes.byref(self._block(m)), _threads())
        if rc == 3:
            raise ValueError(f"every query needs a non-empty run of latents inside its storage and a write inside the "
                             f"cache, got (table start, cached, first, length, page, offset) {qm.T.tolist()}")
        if rc:
            raise RuntimeError(f"mla_decode_residual_f32 failed with code {rc}")


_threads = torch.get_num_threads


def load(gemm: cpu_invariant.CInvariant) -> CMLA:
    """Build (when not cached) and load the library for ``gemm``'s path. Raises RuntimeError saying why it cannot."""
    return CMLA(build(gemm.isa, SOURCE, FLAGS), gemm)


def backend() -> CMLA | None:
    """The C form every fp32 CPU no-grad absorbed MLA attention of this process runs, chosen on the first call
    (later calls return the same answer); None where the C GEMM does not run (``KDA_CPU_GEMM=0``,
    ``KDA_CPU_KERNEL=0``, no compiler) or this library fails (:func:`reason` says why)."""
    return cpu_invariant.form_on_gemm(_chosen, _lock, load)


def reason() -> str | None:
    """Why :func:`backend` is None (None when it is not); chooses first, as :func:`backend` does."""
    backend()
    return _chosen[0] if isinstance(_chosen[0], str) else None


def runs(*tensors: torch.Tensor) -> CMLA | None:
    """:func:`backend` where it runs ``tensors`` (all fp32 CPU, no autograd), else None (the torch form runs)."""
    c = backend()
    if c is None or any(t.dtype is not torch.float32 or not t.is_cpu for t in tensors) or \
            torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return c
