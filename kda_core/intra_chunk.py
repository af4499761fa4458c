"""In-chunk products with pairwise decay: the part of :func:`kda_core.chunk.kda_chunk` that needs
``exp(G_i - G_j)`` for every token pair (i, j) of a chunk.

``Akk[i, j] = sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])`` (i > j) and ``Aqk[i, j]`` the same with q_i
(i >= j), G the in-chunk cumulative log decay (non-increasing in i). Factoring ``exp(G_i - G_j)`` as
``exp(G_i) * exp(-G_j)`` turns each into one matmul, but ``exp(-G_j)`` overflows fp32 once a chunk
decays by more than ~88 nats (trained gates reach 150-270 nats in 64 tokens, measured on the shipped
weights). Two exact forms avoid that, chosen per chunk:

- :func:`sub_chunk_products` (fast): the factoring above about the first token f of each sub-chunk
  of ``SUB_CHUNK`` tokens, ``exp(G_i - G_j) = exp(G_i - G_fI) exp(G_fI - G_fJ) exp(G_fJ - G_j)``
  (i in sub-chunk I, j in J <= I): the first two factors are <= 1, the last <= exp(range of J),
  bounded by ``MAX_SUB_CHUNK_DECAY``. The references are those of fla's ``chunk_kda`` intra-chunk
  kernel (fla-org/flash-linear-attention, ``fla/ops/kda/chunk_intra.py``: sub-chunks of 16, the row
  sub-chunk's first-token gate ``b_gn`` as reference), here also used inside the diagonal blocks, so
  a chunk's products are four matmuls (one per row block) and no per-token loop.
- :func:`halving_products` (always safe, also with ``g = -inf``): recursive halving, every exponent
  <= 0; about 2x slower here (64 chunk-heads of C = 64, K = 128: 9.5 vs 4.5 ms CPU time, one thread).

:func:`intra_chunk_products` runs the fast form on every chunk and the safe form on the chunks (per
batch row and head) whose sub-chunk decay range exceeds the bound or that hold a ``-inf`` gate, so a
chunk's result depends only on its own inputs (the prefill-grid bitwise facts rely on that).
"""
from __future__ import annotations

import torch

SUB_CHUNK = 16               # tokens per sub-chunk (fla chunk_kda's BC = 16)
MAX_SUB_CHUNK_DECAY = 60.0   # nats: largest factor exp(60) ~ 1.1e26, fp32 max ~ 3.4e38 (exp(88.7))


def masked_exp(diff: torch.Tensor, same: torch.Tensor | None) -> torch.Tensor:
    """``exp(diff)``, zeroed where ``same`` is False (a full-forgetting step, g = -inf, lies between the
    two tokens: the true exponent is -inf). ``same`` None: no such step anywhere."""
    return diff.exp() if same is None else diff.exp().masked_fill_(~same, 0.0)


def halving_products(G, k, q, seg=None):
    """Strictly lower-triangular ``(Akk, Aqk)`` by recursive halving; every exponent used is ``<= 0``.

    G, k, q: ``[..., C, K]``, C a power of two. For a right half R and its left sibling L with boundary
    token r (first of R), ``exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j)`` for i in R, j in L, both
    factors pairwise decays between ordered tokens (each <= 1): the boundary-reference trick of fla's
    ``chunk_intra`` sub-chunk kernel, applied at every level. ``seg`` (optional, ``[..., C, K]`` int):
    full-forgetting steps (g = -inf) so far in the chunk, G then summing only the finite steps; a factor
    is zero where the segments of its two tokens differ, so ``exp(-inf - -inf)`` never forms.

    Returns: (Akk, Aqk), each ``[..., C, C]`` with zeros on and above the diagonal.
    """
    *lead, C, K = G.shape
    A = G.new_zeros(2, *lead, C, C)                          # [2, ..., C, C]: Akk, Aqk
    kq = torch.stack((k, q))                                 # [2, ..., C, K], stacked once
    m = C // 2
    while m >= 1:
        nb = C // (2 * m)
        Gv = G.reshape(*lead, nb, 2, m, K)                    # [..., nb, 2, m, K]
        kqv = kq.reshape(2, *lead, nb, 2, m, K)               # [2, ..., nb, 2, m, K]
        Gr = Gv[..., 1, :1, :]                               # boundary r   [..., nb, 1, K]
        same_r = same_l = None
        if seg is not None:
            sv = seg.reshape(*lead, nb, 2, m, K)                # [..., nb, 2, m, K]
            same_r = sv[..., 1, :, :] == sv[..., 1, :1, :]       # [..., nb, m, K]
            same_l = sv[..., 1, :1, :] == sv[..., 0, :, :]       # [..., nb, m, K]
        e_row = masked_exp(Gv[..., 1, :, :] - Gr, same_r)    # i in R       [..., nb, m, K]
        col = kqv[0, ..., 0, :, :] * masked_exp(Gr - Gv[..., 0, :, :], same_l)  # j in L [..., nb, m, K]
        rows = kqv[..., 1, :, :] * e_row                     # [2, ..., nb, m, K]
        blk = rows @ col.transpose(-1, -2)                   # [2, ..., nb, m, m]
        Av = A.view(2, *lead, nb, 2, m, nb, 2, m).diagonal(dim1=-6, dim2=-3)  # [2, ..., 2, m, 2, m, nb]
        Av[..., 1, :, 0, :, :] = blk.movedim(-3, -1)
        m //= 2
    return A[0], A[1]


def sub_chunks(C: int) -> tuple[int, int]:
    """(number of sub-chunks nS, tokens per sub-chunk s) of a chunk of C tokens (s = min(SUB_CHUNK, C))."""
    s = min(SUB_CHUNK, C)
    return C // s, s


def stack_kq(k: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """k and q ``[..., C, K]`` (any strides) in one tensor ``[..., nS, 2, s, K]``: sub-chunk I's key rows
    then its query rows, so that row block I of both products is one matmul. One copy, which also
    makes the chunk layout contiguous; ``kq[..., 0, :, :]`` / ``kq[..., 1, :, :]`` give k / q back
    as ``[..., nS, s, K]`` views."""
    nS, s = sub_chunks(k.shape[-2])
    return torch.stack((k.unflatten(-2, (nS, s)), q.unflatten(-2, (nS, s))), -3)


def sub_chunk_products(G, kq):
    """``(Akk, Aqk, ok)`` by sub-chunk references (see the module docstring); exact where ``ok``.

    G ``[..., C, K]`` (C a power of two); kq ``[..., nS, 2, s, K]`` from :func:`stack_kq`.
    Returns Akk ``[..., C, C]`` strictly lower, Aqk ``[..., C, C]`` lower incl. the diagonal
    (``q_i . k_i``), and ok ``[...]`` bool: False where some sub-chunk decays by more than
    ``MAX_SUB_CHUNK_DECAY`` nats in some key dim. There the exponents were clamped and the products are
    wrong but finite (values and gradients), so a caller can overwrite them.
    """
    *lead, C, K = G.shape
    nS, s = sub_chunks(C)
    Gs = G.reshape(*lead, nS, s, K)                                  # [..., nS, s, K]
    Gf = Gs[..., :1, :]                                              # first token of each sub-chunk
    ok = ((Gf.squeeze(-2) - Gs[..., -1, :]) <= MAX_SUB_CHUNK_DECAY).flatten(-2).all(-1)  # [...]
    D = Gs - Gf                                                      # G_i - G_fI <= 0, [..., nS, s, K]
    if not bool(ok.all()):                                           # no-op on the chunks that are ok
        D = D.clamp_min(-MAX_SUB_CHUNK_DECAY)
    rows = (kq * D.exp().unsqueeze(-3)).reshape(*lead, nS, 2 * s, K)  # x_i exp(G_i - G_fI) [..., nS, 2s, K]
    kap = kq.select(-3, 0) * D.neg().exp()                           # k_j exp(G_fJ - G_j)  [..., nS, s, K]
    gf = Gf.squeeze(-2)                                              # [..., nS, K]
    c = (gf.unsqueeze(-2) - gf.unsqueeze(-3)).clamp_max(0.0).exp()  # exp(G_fI - G_fJ) [..., I, J, K]
    A = G.new_zeros(*lead, 2, C, C)                                  # [..., (Akk, Aqk), C, C]
    rows = rows.unbind(-3)                                           # nS x [..., 2s, K]
    for i in range(nS):                                              # row block I: columns of sub-chunks J <= I
        cols = (kap[..., :i + 1, :, :] * c[..., i, :i + 1, None, :]).reshape(*lead, (i + 1) * s, K)
        A[..., i * s:(i + 1) * s, :(i + 1) * s] = (rows[i] @ cols.transpose(-1, -2)).unflatten(
            -2, (2, s))                                              # [..., 2, s, (I+1)s]
    lower = torch.ones(C, C, dtype=G.dtype, device=G.device).tril()  # [C, C] incl. the diagonal
    A.mul_(torch.stack((lower.tril(-1), lower)))                     # Akk strictly lower, Aqk lower
    return A[..., 0, :, :], A[..., 1, :, :], ok


def intra_chunk_products(G, kq, seg=None):
    """``(Akk, Aqk)`` of every chunk: :func:`sub_chunk_products`, with :func:`halving_products` on the
    chunks it cannot take (``ok`` False, or a ``-inf`` gate: ``seg`` not None and non-zero there).

    G ``[..., C, K]``; kq ``[..., nS, 2, s, K]`` (:func:`stack_kq`); seg ``[..., C, K]`` int or None
    (see :func:`halving_products`). Returns Akk ``[..., C, C]`` strictly lower and Aqk ``[..., C, C]``
    lower incl. the diagonal.
    """
    Akk, Aqk, ok = sub_chunk_products(G, kq)
    if seg is not None:
        ok = ok & (seg[..., -1, :] == 0).all(-1)                     # seg counts -inf steps up to each token
    bad = (~ok).flatten().nonzero().squeeze(-1)                      # chunks for the safe form
    if bad.numel():
        C, K = G.shape[-2:]
        kq_bad = kq.flatten(0, -5)[bad]                              # [n_bad, nS, 2, s, K]
        k, q = (kq_bad[:, :, i].reshape(-1, C, K) for i in (0, 1))   # [n_bad, C, K]
        kk, qk = halving_products(G.flatten(0, -3)[bad], k, q, None if seg is None else seg.flatten(0, -3)[bad])
        qk = qk + torch.diag_embed((k * q).sum(-1))                  # diagonal: exp(0) = 1
        Akk = Akk.flatten(0, -3).index_copy(0, bad, kk).view(Akk.shape)
        Aqk = Aqk.flatten(0, -3).index_copy(0, bad, qk).view(Aqk.shape)
    return Akk, Aqk
