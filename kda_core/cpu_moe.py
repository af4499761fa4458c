"""The C form of :class:`kda_core.moe.MoE`'s forward (``csrc/moe_cpu.c``): router, top-k, routed SwiGLU experts,
weighted combine and shared experts of M rows in one call, on the row-invariant GEMM of
:mod:`kda_core.cpu_invariant` (its ``linear_f32`` and its packed weights), built with :mod:`kda_core.cpu_build`.

Its GEMMs, products and sums are those of the torch form (:meth:`kda_core.moe.MoE.forward_torch`, in the same
order); its sigmoid and SiLU use a Cephes ``exp`` where ATen uses SLEEF, so the two forms agree within
:data:`RTOL` / :data:`ATOL` (and choose the same experts but where two of a row's biased scores are within a few
ulp of each other), not bitwise. A row's bits never depend on the other rows of the call, and every fp32 CPU
no-grad MoE forward of the process runs this form (prefill rows, decode rows, the model's own forward, verify
rows), so everything that must be bitwise equal is.

Chosen once per process (:func:`backend`): where :func:`kda_core.cpu_invariant.backend` runs the C GEMM and this
library builds and passes :func:`self_check`; else None (the torch form runs) and :func:`reason` says why.

Shapes: M rows, D hidden size, E experts, k experts per token, F expert width, Fs shared experts' width.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from kda_core import cpu_invariant
from kda_core.cpu_build import build, open_library

SOURCE = Path(__file__).parent / "csrc" / "moe_cpu.c"
FLAGS = ("-ffp-contract=off",)     # every product rounded before it is added, as the torch form's mul then add
RTOL = 1e-5                        # C form vs torch form on outputs of order 1 (sigmoid / SiLU a few ulp apart,
ATOL = 1e-5                        # then sums of D or F products that cancel: a few ulp of the largest term)
ACT_RTOL = 4e-7                    # the activations alone: sigmoid, silu(v) * up (~2 ulp of fp32)

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_lock = threading.Lock()
_chosen: list = []                 # [the CMoE, or why there is none] (set once per process)
_MODULE_ATTR = "_kda_moe_block"    # on the MoE module: ([(id, address, version) of its weights, forgets], _Block)


class _Block(ctypes.Structure):
    """``struct moe_block`` of the source: a MoE module's sizes and packed weights."""

    _fields_ = [(n, _I) for n in ("D", "E", "k", "F", "Fs", "G", "topk_group", "renorm")] + [
        ("scale", _F), ("rs", _P), ("bias", _P), ("gu", _P), ("dn", _P), ("sdown", _P), ("linear", _P)]


class CMoE:
    """The loaded library of path ``isa`` over the C GEMM ``gemm``. Raises RuntimeError when the library was not
    built for that path."""

    def __init__(self, path: Path, gemm: cpu_invariant.CInvariant):
        lib = open_library(path, gemm.isa, "moe_vector_bits")
        lib.moe_forward_f32.restype = _I
        lib.moe_forward_f32.argtypes = [_I, _P, _L, _P, _L, _P, _P, _I]
        lib.moe_dense_f32.restype = _I
        lib.moe_dense_f32.argtypes = [_I, _I, _I, _P, _L, _P, _P, _P, _L, _P, _I]
        lib.moe_residual_f32.restype = _I
        lib.moe_residual_f32.argtypes = [_I, _I, _P, _L, _P, _F, _P, _P, _I, _P, _P, _P, _I]
        for name in ("moe_sigmoid_f32", "moe_silu_mul_f32"):
            getattr(lib, name).restype = None
        lib.moe_sigmoid_f32.argtypes = [_I, _P, _P]
        lib.moe_silu_mul_f32.argtypes = [_I, _P, _P, _P]
        self.lib, self.path, self.gemm = lib, path, gemm
        self._run, self._dense, self._residual = lib.moe_forward_f32, lib.moe_dense_f32, lib.moe_residual_f32
        self._linear = ctypes.cast(gemm.lib.linear_f32, _P).value    # the GEMM every linear() call runs
        self._rmsnorm = ctypes.cast(gemm.lib.rmsnorm_f32, _P).value  # the RMSNorm every rmsnorm() call runs

    def sigmoid(self, v: torch.Tensor) -> torch.Tensor:
        """The C form's sigmoid of v (fp32, contiguous) -> v's shape."""
        out = torch.empty_like(v)
        self.lib.moe_sigmoid_f32(v.numel(), v.data_ptr(), out.data_ptr())
        return out

    def silu_mul(self, v: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The C form's ``silu(v) * up`` (fp32, contiguous, one shape) -> that shape."""
        out = torch.empty_like(v)
        self.lib.moe_silu_mul_f32(v.numel(), v.data_ptr(), up.data_ptr(), out.data_ptr())
        return out

    def _block(self, moe) -> _Block:
        """``moe``'s :class:`_Block`, cached on the module and rebuilt when any of its weights (or the router bias)
        was replaced or written in place (address or version counter moved: the GEMM's caches repack then) or
        :func:`kda_core.cpu_invariant.forget` was called. Keeps the packed copies it points to alive through the
        GEMM's caches on the weights themselves."""
        params, shared = moe._parameters, moe._modules.get("shared")       # (not nn.Module.__getattr__: µs)
        ws = (params["router"], moe._buffers["router_bias"], params["experts_gate_up"], params["experts_down"])
        if shared is not None:
            ws += (shared._parameters["gate_up"], shared._parameters["down"])
        key = [(id(w), w.data_ptr(), w._version) for w in ws] + [cpu_invariant.forgets()]
        hit = moe.__dict__.get(_MODULE_ATTR)
        if hit is not None and hit[0] == key:
            return hit[1]
        cfg, g = moe.cfg, self.gemm
        bias = moe.router_bias
        if bias.dtype is not torch.float32 or not bias.is_contiguous():
            raise ValueError(f"router_bias must be a contiguous fp32 tensor, got {bias.dtype}")
        if cfg.num_experts_per_token > cfg.topk_group * (cfg.num_experts // cfg.num_expert_group):
            raise ValueError(f"num_experts_per_token ({cfg.num_experts_per_token}) must be <= the experts of the "
                             f"topk_group ({cfg.topk_group}) groups kept")
        gu, dn = g.packed_experts(moe.experts_gate_up), g.packed_experts(moe.experts_down)
        block = _Block(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size,
                       shared.down.shape[1] if shared is not None else 0, cfg.num_expert_group, cfg.topk_group,
                       int(cfg.moe_renormalize), cfg.routed_scaling_factor,
                       g.packed_cat((moe.router, shared.gate_up))[1] if shared is not None else g.packed(moe.router)[1],
                       bias.data_ptr(), ctypes.addressof(gu), ctypes.addressof(dn),
                       g.packed(shared.down)[1] if shared is not None else None, self._linear)
        block._keep = (gu, dn)                                              # the address arrays it points to
        moe.__dict__[_MODULE_ATTR] = (key, block)
        return block

    def forward(self, moe, x: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """``moe``'s output ``[..., D]`` for x ``[..., D]`` fp32 (read in place when contiguous); the chosen experts
        of its M rows written to ``idx [M, k]`` int64 (contiguous) when given. Unchecked shapes and dtypes (the
        caller checks); raises RuntimeError when the call fails (out of memory)."""
        if not x.is_contiguous():
            x = x.contiguous()
        D = x.shape[-1]
        out = x.new_empty(x.shape)                                          # [..., D]
        rc = self._run(x.numel() // D, x.data_ptr(), D, out.data_ptr(), D, None if idx is None else idx.data_ptr(),
                       ctypes.byref(self._block(moe)), _threads())
        if rc:
            raise RuntimeError(f"moe_forward_f32 failed with code {rc}")
        return out


    def dense(self, mlp, x: torch.Tensor) -> torch.Tensor:
        """The dense SwiGLU MLP ``mlp`` (:class:`kda_core.moe.DenseMLP`) of x ``[..., D]`` fp32 -> ``[..., D]``:
        ``down(silu(gate x) * up x)`` in one call, each row on its own. Unchecked shapes and dtypes (the caller
        checks); raises RuntimeError when the call fails (out of memory)."""
        if not x.is_contiguous():
            x = x.contiguous()
        params = mlp._parameters                                            # (not nn.Module.__getattr__: µs)
        gate_up, down = params["gate_up"], params["down"]
        D = x.shape[-1]
        out = x.new_empty(x.shape)                                          # [..., D]
        rc = self._dense(x.numel() // D, D, down.shape[1], x.data_ptr(), D, self.gemm.packed(gate_up)[1],
                         self.gemm.packed(down)[1], out.data_ptr(), D, self._linear, _threads())
        if rc:
            raise RuntimeError(f"moe_dense_f32 failed with code {rc}")
        return out


    def residual(self, ffn, x: torch.Tensor, norm: torch.Tensor, eps: float) -> None:
        """``x += ffn(rmsnorm(x, norm, eps))`` in place in one call (a decoder layer's post-attention sublayer), ffn a
        :class:`kda_core.moe.MoE` (:meth:`forward`) or a :class:`kda_core.moe.DenseMLP` (:meth:`dense`): bitwise
        :func:`kda_core.invariant.rmsnorm`, that call and torch's add. x ``[M, D]`` fp32 with a contiguous last dim,
        norm ``[D]`` fp32 contiguous. Unchecked shapes and dtypes (the caller checks); raises RuntimeError when the
        call fails (out of memory; x is then unchanged)."""
        M, D = x.shape
        params = ffn._parameters                                            # (not nn.Module.__getattr__: µs)
        if "router" in params:
            rc = self._residual(M, D, x.data_ptr(), x.stride(0), norm.data_ptr(), eps, self._rmsnorm,
                                ctypes.byref(self._block(ffn)), 0, None, None, self._linear, _threads())
        else:
            gate_up, down = params["gate_up"], params["down"]
            rc = self._residual(M, D, x.data_ptr(), x.stride(0), norm.data_ptr(), eps, self._rmsnorm, None,
                                down.shape[1], self.gemm.packed(gate_up)[1], self.gemm.packed(down)[1], self._linear,
                                _threads())
        if rc:
            raise RuntimeError(f"moe_residual_f32 failed with code {rc}")


_threads = torch.get_num_threads


def self_check(moe: CMoE) -> None:
    """The C sigmoid and ``silu(v) * up`` against torch's (within :data:`ACT_RTOL`) on values across the range
    a router or an expert sees, each element's bits independent of its position (the 8-lane tail). Raises
    RuntimeError when they differ."""
    gen = torch.Generator().manual_seed(0)
    v = torch.cat([torch.linspace(-30, 30, 997), torch.randn(1000, generator=gen) * 4])
    up = torch.randn(v.shape, generator=gen)
    if not torch.allclose(moe.sigmoid(v), torch.sigmoid(v), rtol=ACT_RTOL, atol=1e-12):
        raise RuntimeError("self-check failed: the C sigmoid differs from torch's")
    got = moe.silu_mul(v, up)
    if not torch.allclose(got, F.silu(v) * up, rtol=2 * ACT_RTOL, atol=1e-12):
        raise RuntimeError("self-check failed: the C SiLU differs from torch's")
    if not all(torch.equal(moe.silu_mul(v[i: i + 3], up[i: i + 3]), got[i: i + 3]) for i in range(9)):
        raise RuntimeError("self-check failed: an element's C SiLU depends on its position")


def load(gemm: cpu_invariant.CInvariant, check: bool = True) -> CMoE:
    """Build (when not cached), load and (``check``) self-check the library for ``gemm``'s path. Raises
    RuntimeError saying why it cannot run."""
    got = CMoE(build(gemm.isa, SOURCE, FLAGS), gemm)
    if check:
        self_check(got)
    return got


def backend() -> CMoE | None:
    """The C form every fp32 CPU no-grad :meth:`kda_core.moe.MoE.forward` of this process runs, chosen on the first
    call (later calls return the same answer); None where the C GEMM does not run (``KDA_CPU_GEMM=0``,
    ``KDA_CPU_KERNEL=0``, no compiler) or this library fails (:func:`reason` says why)."""
    return cpu_invariant.form_on_gemm(_chosen, _lock, load)


def reason() -> str | None:
    """Why :func:`backend` is None (None when it is not); chooses first, as :func:`backend` does."""
    backend()
    return _chosen[0] if isinstance(_chosen[0], str) else None
