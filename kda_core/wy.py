"""The WY / UT quantities of each chunk of :func:`kda_core.chunk.kda_chunk`, per chunk-head unit.

A unit is one (chunk, batch row, head): C tokens of one head. For every unit, from its gates g, keys k,
queries q, values v and betas (``[n, C, *]``, n units):

- ``G`` the in-chunk cumulative log decay (``G_i = g_0 + ... + g_i``, per key dim, ``<= 0``);
- ``Akk[i, j] = sum_d k_i k_j exp(G_i - G_j)`` (j < i), ``Aqk`` the same with q_i (j <= i);
- ``A = (I + diag(beta) Akk)^{-1} diag(beta)``, ``w = A (k exp(G))``, ``u = A v`` (the UT transform);
- ``qg = q exp(G)``, ``kd = k exp(G_C - G)`` (keys decayed to the chunk end), ``decay_last = exp(G_C)``.

(fla ``naive_chunk_kda`` and ``chunk_kda``, fla-org/flash-linear-attention ``fla/ops/kda/``; Kimi Linear,
arXiv:2510.26692, the chunkwise algorithm.) Two exact forms, chosen per unit:

- :func:`wy_fast` factors ``exp(G_i - G_j) = exp(G_i) exp(-G_j)`` about the chunk's start, so that
  ``[k exp(G); q exp(G)]`` (also ``w``'s and the output's left factors) times ``(k exp(-G))^T`` is one
  matmul per unit. ``exp(-G_j)`` stays finite while the chunk decays by at most ``MAX_CHUNK_DECAY``
  nats in every key dim; the cumulative sum is one matmul with a lower-triangular ones matrix.
- :func:`wy_safe` (any decay, also ``g = -inf``, full forgetting) takes the in-chunk products from
  :func:`kda_core.intra_chunk.intra_chunk_products` (sub-chunk references, recursive halving).

:func:`wy_units` runs each unit through the form its own gates allow, so a unit's result never depends
on the other units of the call (the chunk-grid bitwise facts rely on that).
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

from kda_core.intra_chunk import MAX_SUB_CHUNK_DECAY, intra_chunk_products, stack_kq, sub_chunks
from kda_core.intra_chunk import masked_exp as _decay

MAX_CHUNK_DECAY = MAX_SUB_CHUNK_DECAY  # nats per chunk for wy_fast: exp(60) ~ 1.1e26 < fp32 max ~ exp(88.7)


class WY(NamedTuple):
    """Per-unit results, each ``[n, ...]`` contiguous in the compute dtype: qg ``[n, C, K]``,
    Aqk ``[n, C, C]`` (lower incl. the diagonal), w ``[n, C, K]``, u ``[n, C, V]``, kd ``[n, C, K]``,
    decay_last ``[n, K]``."""

    qg: torch.Tensor
    Aqk: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    kd: torch.Tensor
    decay_last: torch.Tensor


@lru_cache(maxsize=8)
def _constants(C: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(lower-triangular ones incl. the diagonal, identity), each ``[C, C]``: made once per (C, dtype,
    device), never written to."""
    return torch.ones(C, C, dtype=dtype, device=device).tril(), torch.eye(C, dtype=dtype, device=device)


def _solve_ut(Akk: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``A = (I + diag(b) Akk)^{-1} diag(b)`` ``[n, C, C]`` from Akk (only its strict lower triangle is
    read: the solve is unit lower-triangular) and b ``[n, C, 1]``."""
    C = Akk.shape[-1]
    eye = _constants(C, Akk.dtype, Akk.device)[1]
    # X (I + L) = I: the same inverse as (I + L) X = I, ~1.7x faster here (left=False suits the row-major layout)
    Tinv = torch.linalg.solve_triangular(Akk * b, eye.expand(Akk.shape), upper=False, unitriangular=True, left=False)
    return Tinv * b.transpose(-1, -2)


def cumulative_decay(g: torch.Tensor) -> torch.Tensor:
    """``G = cumsum(g)`` over the C tokens of each unit, g ``[n, C, K]`` finite (one batched matmul with
    a lower-triangular ones matrix; a loop-free cumsum over a middle dim is ~3x slower here)."""
    n, C, _ = g.shape
    tril = _constants(C, g.dtype, g.device)[0]
    return torch.bmm(tril.expand(n, C, C), g)


def wy_fast(G, k, q, v, b, grad: bool) -> WY:
    """:class:`WY` of units decaying by at most ``MAX_CHUNK_DECAY`` nats (see the module docstring).

    G ``[n, C, K]`` (:func:`cumulative_decay`; overwritten without autograd); k, q ``[*U, C, K]``, v ``[*U, C, V]``, b ``[*U, C, 1]``
    in any layout (prod(U) = n); grad: autograd records (new tensors instead of in-place writes; the
    values are bitwise the same).
    """
    n, C, K = G.shape
    U = k.shape[:-2]
    eG = G.exp()                                                       # exp(G) <= 1   [n, C, K]
    eGu = eG.view(*U, C, K)
    # exp(-G) <= e^60 (not 1 / exp(G): its gradient needs exp(G)^2, 0 in fp32); in G's place without autograd
    eGn = (torch.exp(G.neg()) if grad else G.neg_().exp_()).view(*U, C, K)
    if grad:                                                           # new tensors (autograd)
        kq = torch.stack((k * eGu, q * eGu), -3).reshape(n, 2, C, K)
        cols = (k * eGn).reshape(n, C, K)
    else:                                                              # written straight into unit-major layout
        kq = G.new_empty(*U, 2, C, K)
        torch.mul(k, eGu, out=kq.select(-3, 0))
        torch.mul(q, eGu, out=kq.select(-3, 1))
        kq = kq.view(n, 2, C, K)
        cols = G.new_empty(*U, C, K)
        torch.mul(k, eGn, out=cols)
        cols = cols.view(n, C, K)
    # kq [n, 2, C, K]: k exp(G) (w's right factor), q exp(G) (the outputs' left factor); cols k exp(-G) <= k e^60
    A2 = torch.bmm(kq.view(n, 2 * C, K), cols.transpose(1, 2))         # [Akk; Aqk] unmasked [n, 2C, C]
    lower = _constants(C, G.dtype, G.device)[0]
    Aqk = A2[:, C:] * lower                                            # lower incl. the diagonal
    bn = b.reshape(n, C, 1)
    A = _solve_ut(A2[:, :C], bn)                                       # [n, C, C]
    kg = kq[:, 0]
    w = torch.bmm(A, kg)                                               # [n, C, K]
    u = torch.bmm(A, v.reshape(n, C, -1))                              # [n, C, V]
    eG_last = eG[:, -1:]                                               # exp(G_C)   [n, 1, K]
    kd = cols * eG_last if grad else cols.mul_(eG_last)                # k exp(G_C - G)
    return WY(kq[:, 1], Aqk, w, u, kd, eG_last.squeeze(1))


def wy_safe(g, k, q, v, b, may_forget: bool) -> WY:
    """:class:`WY` of any units, g ``[n, C, K]`` in ``[-inf, 0]`` (``-inf``: full forgetting, the
    in-chunk sums then skip it and every factor across it is zero), k, q ``[n, C, K]``, v ``[n, C, V]``,
    b ``[n, C, 1]``. ``may_forget`` False: g holds no ``-inf`` (skips the masks)."""
    n, C, K = g.shape
    G, seg = g, None
    if may_forget:
        forget = torch.isneginf(G)
        seg = forget.to(torch.int32).cumsum(-2)                        # -inf steps in [0, i]  [n, C, K]
        G = G.masked_fill(forget, 0.0)
    G = G.cumsum(-2)
    nS, s = sub_chunks(C)

    def sub(x):
        return x.unflatten(-2, (nS, s))

    kq = stack_kq(k, q)                                                # [n, nS, 2, s, K]
    kc, qc = kq.unbind(-3)
    Akk, Aqk = intra_chunk_products(G, kq, seg)
    A = _solve_ut(Akk, b)
    eG = sub(_decay(G, None if seg is None else seg == 0))             # [n, nS, s, K]
    w = A @ (kc * eG).flatten(-3, -2)
    u = A @ v
    Glast = G[..., -1:, :]
    seg_last = None if seg is None else seg[..., -1:, :]
    kd = (kc * sub(_decay(Glast - G, None if seg is None else seg == seg_last))).flatten(-3, -2)
    decay_last = _decay(Glast, None if seg is None else seg_last == 0).squeeze(-2)
    return WY((qc * eG).flatten(-3, -2), Aqk, w, u, kd, decay_last)


def wy_units(g, k, q, v, b, may_forget: bool) -> WY:
    """:class:`WY` of every unit, each by the form its own gates allow.

    g, k, q ``[*U, C, K]``, v ``[*U, C, V]``, b ``[*U, C, 1]``: any layout (e.g. a permuted view of
    ``[B, T, H, *]`` inputs), in the compute dtype; may_forget: g may hold ``-inf``.
    Returns :class:`WY`, units in the order of U flattened.
    """
    C, K = g.shape[-2:]
    n = g[..., 0, 0].numel()
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (g, k, q, v, b))
    gn = g.reshape(n, C, K)
    if may_forget:                                   # -inf sums to -inf: such a unit is never fast
        G = None
        fast = (gn.sum(-2) >= -MAX_CHUNK_DECAY).all(-1)
    else:
        G = cumulative_decay(gn)
        if bool(G[:, -1].min() >= -MAX_CHUNK_DECAY):  # every unit within the bound (one reduction)
            return wy_fast(G, k, q, v, b, grad)
        fast = (G[:, -1] >= -MAX_CHUNK_DECAY).all(-1)  # [n]
    if bool(fast.all()):
        return wy_fast(cumulative_decay(gn) if G is None else G, k, q, v, b, grad)
    flat = [t.reshape(n, C, t.shape[-1]) for t in (k, q, v, b)]
    if not bool(fast.any()):
        return wy_safe(gn, *flat, may_forget)
    idx_fast, idx_safe = fast.nonzero().squeeze(1), (~fast).nonzero().squeeze(1)
    part_fast = wy_fast(cumulative_decay(gn[idx_fast]) if G is None else G[idx_fast],
                        *(t[idx_fast] for t in flat), grad)
    part_safe = wy_safe(gn[idx_safe], *(t[idx_safe] for t in flat), may_forget)
    merged = []
    for a, s in zip(part_fast, part_safe):
        out = a.new_empty(n, *a.shape[1:])
        if grad:
            merged.append(out.index_copy(0, idx_fast, a).index_copy(0, idx_safe, s))
        else:
            merged.append(out.index_copy_(0, idx_fast, a).index_copy_(0, idx_safe, s))
    return WY(*merged)
