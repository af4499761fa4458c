"""Row-invariant linear layer: row i of ``x @ W^T`` does not depend on how many rows are computed.

Why: speculative decoding verifies ``1 + n`` tokens in one call and must be *bitwise* equal to
decoding them one at a time, and a warm prefill from a prefix-cache hit on the 64-token chunk grid
must be bitwise the cache-off prefill of the same rows (``kda_core.layer``).

Two forms, one chosen per process (:func:`kda_core.cpu_invariant.backend`, on the first call):

- the C GEMM (:mod:`kda_core.cpu_invariant`, fp32 on the CPU): each output accumulates its K products in order
  with fused multiply-adds, so it is row-invariant by construction for any number of rows;
- the torch form (no compiler, ``KDA_CPU_GEMM=0``, other dtypes or devices): MKL's sgemm picks a different
  kernel (with a different summation order) for fewer than 16 rows, so ``linear(x[:1])`` and
  ``linear(x)[:1]`` would differ in the last bits (measured up to ~1e-4 at d = 2304); padding the row
  count to at least ``MIN_ROWS`` makes every call take the same GEMM path.

``tests/kda_core/test_invariant.py`` asserts the property of both forms for 1..600 rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kda_core import cpu_invariant

MIN_ROWS = 16
_F32 = torch.float32
_GEMM: list = []      # [cpu_invariant.backend()], read on every call once it is chosen


def _choose():
    _GEMM.append(cpu_invariant.backend())
    return _GEMM[0]


class _CLinear(torch.autograd.Function):
    """The C GEMM forward with torch's backward (``dx = dy W``, ``dW = dy^T x``): training sees the same
    forward bits as inference."""

    @staticmethod
    def forward(ctx, rows, weight):                                       # rows [M, D_in], weight [D_out, D_in]
        ctx.save_for_backward(rows, weight)
        return cpu_invariant.backend().linear(rows, weight)                    # [M, D_out]

    @staticmethod
    def backward(ctx, dy):                                                # dy [M, D_out]
        rows, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None             # [M, D_in]
        dw = dy.T @ rows if ctx.needs_input_grad[1] else None             # [D_out, D_in]
        return dx, dw


def torch_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The torch form: rows ``[M, D_in]`` -> ``[M, D_out]``, every call on the same GEMM path whatever the rows are.

    MKL's sgemm picks its kernel and summation order from the shapes and the operands' alignment, so three things
    are padded (with zeros: a zero product adds +0 to a sum, which changes no value) before ``F.linear``: the row
    count to at least ``MIN_ROWS`` (below 16 rows another kernel runs), ``D_in`` to a multiple of 16 in a fresh
    64-byte-aligned copy whenever it is not one or the rows do not start on 64 bytes (else a row's bits depend on
    where it sits: a request's rows packed at an odd offset of a batch differ from the same rows alone), and
    ``D_out`` to at least 16 (one output feature runs MKL's GEMV, whose order depends on the row count)."""
    m, d_in = rows.shape
    d_out = weight.shape[0]
    pad_k = -d_in % 16
    if pad_k or rows.data_ptr() % 64 or (m > 1 and rows.stride(0) % 16) or rows.stride(-1) != 1 or m < MIN_ROWS:
        x = rows.new_zeros(max(m, MIN_ROWS), d_in + pad_k)                    # [M', D_in'] aligned rows
        x[:m, :d_in] = rows
    else:
        x = rows
    w = weight
    if pad_k or d_out < MIN_ROWS:
        w = weight.new_zeros(max(d_out, MIN_ROWS), d_in + pad_k)             # [D_out', D_in']
        w[:d_out, :d_in] = weight
    out = F.linear(x, w)                                                    # [M', D_out']
    return out[:m, :d_out] if out.shape != (m, d_out) else out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` with results independent of the number of rows.

    Args:
        x: ``[..., D_in]``; weight: ``[D_out, D_in]`` (same dtype).

    Returns:
        ``[..., D_out]``.

    Raises:
        ValueError: if weight is not 2-D or the last dim of x is not ``D_in``.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [D_out, D_in], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x must have last dim D_in = {weight.shape[-1]}, got shape {tuple(x.shape)}")
    gemm = _GEMM[0] if _GEMM else _choose()
    grad = (x.requires_grad or weight.requires_grad) and torch.is_grad_enabled()
    if gemm is not None and not grad and x.dtype is _F32 and weight.dtype is _F32 and x.is_cpu and weight.is_cpu:
        return gemm.linear(x, weight)                        # [..., D_out], no reshape op
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [M, D_in]
    if gemm is None or x.dtype is not _F32 or weight.dtype is not _F32 or not x.is_cpu or not weight.is_cpu:
        out = torch_linear(rows, weight)                     # [M, D_out]
    else:
        out = _CLinear.apply(rows, weight)                   # [M, D_out]
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.shape[0])


class _CRmsNorm(torch.autograd.Function):
    """The C RMSNorm forward with the torch form's backward (recomputed): training sees the inference bits."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return cpu_invariant.backend().rmsnorm(x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
            dx, dw = torch.autograd.grad(torch_rmsnorm(x, weight, ctx.eps), (x, weight), dy)
        return dx, dw, None


def torch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch form of :func:`rmsnorm` (its rsqrt through :func:`pointwise`)."""
    return x * pointwise(torch.rsqrt, (x * x).mean(-1) + eps).unsqueeze(-1) * weight


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, each row on its own: ``x / sqrt(mean x^2 + eps) * weight``.

    Args: x ``[..., D]``; weight ``[D]``; eps: the config's ``rms_norm_eps``. Returns ``[..., D]``.
    Runs the C form where :func:`linear` runs the C GEMM (fp32 CPU tensors), else :func:`torch_rmsnorm`.
    """
    gemm = _GEMM[0] if _GEMM else _choose()
    if gemm is None or x.dtype is not _F32 or weight.dtype is not _F32 or not x.is_cpu or not weight.is_cpu \
            or weight.shape != x.shape[-1:]:
        return torch_rmsnorm(x, weight, eps)
    if (x.requires_grad or weight.requires_grad) and torch.is_grad_enabled():
        return _CRmsNorm.apply(x, weight, eps)
    return gemm.rmsnorm(x, weight, eps)


def linear_cat(x: torch.Tensor, weights: tuple) -> tuple:
    """``linear(x, w)`` for each weight of ``weights`` from one GEMM over their concatenation (fewer calls per
    step: a KDA layer's four input projections, an MLA layer's latent and query projections).

    Args: x ``[..., D_in]``; weights: ``[D_out_i, D_in]`` each. Returns a tuple of ``[..., D_out_i]`` views of
    one ``[..., sum D_out_i]`` tensor. Each is bitwise ``linear(x, w_i)`` (the C GEMM computes every output
    column alone; the torch form runs the separate calls). Raises ValueError like :func:`linear`.
    """
    D = x.shape[-1]
    for w in weights:
        if w.shape[-1] != D:
            raise ValueError(f"x must have last dim D_in = {w.shape[-1]}, got shape {tuple(x.shape)}")
    gemm = _GEMM[0] if _GEMM else _choose()
    if gemm is None or x.dtype is not _F32 or not x.is_cpu or torch.is_grad_enabled() and (
            x.requires_grad or any(w.requires_grad for w in weights)) or \
            any(w.dtype is not _F32 or not w.is_cpu for w in weights):
        return tuple(linear(x, w) for w in weights)
    out = gemm.linear(x, tuple(weights))                     # [..., sum D_out_i]
    return tuple(out.split([w.shape[0] for w in weights], dim=-1))


VEC_ROW = 32          # 2 x AVX-512 float lanes: ATen's vectorised loop step
MAX_BLOCK = 16384     # elements per call: below ATen's parallel grain (32768), so no thread split


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """Apply an elementwise ``fn`` (exp, sigmoid, softplus, silu, rsqrt, cos, ...) row-invariantly.

    ATen evaluates transcendental functions with a SIMD approximation in its vectorised loop and a
    scalar libm call for the tail, and the two differ in the last bit. Which elements fall in the
    tail depends on the tensor's total size, so ``fn(x[:1])`` and ``fn(x)[:1]`` can differ. Here the
    last dim is padded to a multiple of ``VEC_ROW`` and the rows are processed in blocks below the
    parallel grain, so every element always takes the vectorised path.

    Args: fn: elementwise function; x: ``[..., n]``. Returns ``fn(x)`` with x's shape.
    """
    n = x.shape[-1]
    if n % VEC_ROW == 0 and 0 < x.numel() <= MAX_BLOCK:     # one block, no padding: the same call, fewer ops
        return fn(x.contiguous())
    rows = x.reshape(-1, n)                                  # [R, n]
    n_pad = -(-n // VEC_ROW) * VEC_ROW
    if n_pad != n:
        rows = F.pad(rows, (0, n_pad - n))                   # [R, n_pad]
    rows = rows.contiguous()
    step = max(1, MAX_BLOCK // n_pad)
    # split, not a loop of slices: the same blocks, but autograd's backward is one cat, where each slice's
    # backward would write a zero tensor of the whole input (quadratic in the number of blocks when training)
    out = torch.cat([fn(r) for r in rows.split(step)]) if rows.shape[0] > step else fn(rows)
    return out[:, :n].reshape(x.shape)
