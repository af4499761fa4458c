"""The chunked (WY / UT) form of KDA: prefill in chunks of C tokens, with per-chunk states for
checkpoints and KCP (prepare / states / outputs split), and full forgetting (g = -inf) handled as in
:func:`kda_core.kda.kda_recurrent`.

Shapes as in :mod:`kda_core.kda`; NT = number of chunks. The chunk form rejects NaN / inf in q, k, v
and the initial state, and g or beta outside the gates' domain (:func:`kda_core.kda.check_gates`: g in
[-inf, 0], beta in [0, 1]), with a ValueError naming the tensor (a chunk mixes its tokens, so a NaN
would also corrupt the tokens before it).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kda_core.intra_chunk import intra_chunk_products, stack_kq, sub_chunks
from kda_core.intra_chunk import masked_exp as _decay
from kda_core.kda import NonFiniteError, _check_inputs, _compute_dtype, check_gates, check_scale

CHUNK_SIZE = 64  # C of the chunked kernel (fla's chunk_kda uses BT = 64); the prefill grid of the layers
PIECE_BYTES = 512 * 1024   # a piece's [B, H, piece, K] temporaries stay below this (see piece_tokens_for)
MIN_PIECE_CHUNKS = 4       # ... but a piece holds at least this many chunks (per-piece Python overhead)


class ChunkOutput(NamedTuple):
    """Result of :func:`kda_chunk`.

    o: ``[B, T, H, V]`` outputs (v's dtype). final_state: ``[B, H, K, V]`` state after all T tokens.
    h: ``[B, NT, H, K, V]``, ``h[:, j]`` = state *before* chunk j (``h[:, 0]`` = initial state).
    """

    o: torch.Tensor
    final_state: torch.Tensor
    h: torch.Tensor


def _check_finite(tensors: dict) -> None:
    """Raise :class:`kda_core.kda.NonFiniteError` (a ValueError) naming the first tensor of ``tensors`` holding NaN or +-inf.

    One ``sum`` per tensor (a non-finite element always makes the sum non-finite; ~0.4 % of a
    T = 4096 ``kda_chunk`` here); the exact element check runs only when a sum is not finite.
    """
    for name, t in tensors.items():
        if t is not None and not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
            raise NonFiniteError(f"{name} must be finite, got {int((~torch.isfinite(t)).sum())} NaN/inf element(s); "
                             "the chunk form would spread them to earlier tokens of their chunk")

class ChunkPrep(NamedTuple):
    """The intra-chunk part of :func:`kda_chunk` (everything before the sequential scan over chunks).

    qg ``[B, H, NT, C, K]`` q times ``exp(G)``; Aqk ``[B, H, NT, C, C]`` in-chunk query-key
    products (lower triangle incl. diagonal), both without the scale; w ``[B, H, NT, C, K]`` and u ``[B, H, NT, C, V]`` the WY
    form; kd ``[B, H, NT, K, C]`` keys decayed to the chunk end, transposed (``K~_c^T``); decay_last
    ``[B, H, NT, K, 1]`` = ``exp(G_C)``, the whole-chunk decay; num_tokens: T before padding;
    out_dtype: v's dtype; scale: the query scale, applied to the outputs.
    Tensors are fp32 (fp64 for fp64 input).
    """

    qg: torch.Tensor
    Aqk: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    kd: torch.Tensor
    decay_last: torch.Tensor
    num_tokens: int
    out_dtype: torch.dtype
    scale: float


class ChunkStates(NamedTuple):
    """Result of :func:`kda_chunk_states`: h ``[B, NT, H, K, V]`` (state before chunk j), v_new
    ``[B, H, NT, C, V]`` (``u - w h``), final_state ``[B, H, K, V]``."""

    h: torch.Tensor
    v_new: torch.Tensor
    final_state: torch.Tensor


def piece_tokens_for(B: int, H: int, K: int, V: int, chunk_size: int = CHUNK_SIZE) -> int:
    """Default piece length (tokens) of :func:`kda_chunk`: the largest multiple of ``chunk_size`` whose
    ``[B, H, piece, max(K, V)]`` fp32 tensors fit ``PIECE_BYTES``, at least ``MIN_PIECE_CHUNKS`` chunks.

    Here (glibc malloc, 2 MiB L2 per core) a temporary over ~1 MiB is mmap-ed afresh and page-faulted
    on every use: an out-of-place op on 2 MiB ran 3x slower than in place, on 512 KiB 1.3x
    (T = 4,096, H = 4, K = V = 128, one thread: 256-token pieces took 72 ms of CPU time, 1,024-token
    pieces 83 ms).
    """
    per_token = B * H * max(K, V) * 4                      # bytes of one token's row in a [.., K] tensor
    return max(MIN_PIECE_CHUNKS, PIECE_BYTES // (per_token * chunk_size)) * chunk_size


def _check_chunk_size(chunk_size) -> None:
    if not (isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size > 0 and chunk_size & (chunk_size - 1) == 0):
        raise ValueError(f"chunk_size must be a positive power of two, got {chunk_size!r}")


def kda_chunk_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> ChunkPrep:
    """Intra-chunk part of :func:`kda_chunk` (no state involved; parallel over chunks).

    Args/Raises: as :func:`kda_chunk` (without ``initial_state``). Returns: :class:`ChunkPrep`.
    """
    return _prepare(q, k, v, g, beta, scale, chunk_size, _validate(q, k, v, g, beta, None, scale, chunk_size))


def _validate(q, k, v, g, beta, initial_state, scale, chunk_size) -> bool:
    """Every input check of :func:`kda_chunk` but the initial state's values; returns whether g holds -inf."""
    _check_inputs(q, k, v, g, beta, initial_state, has_time=True, state_name="initial_state")
    _check_chunk_size(chunk_size)
    check_scale(scale)
    _check_finite(dict(q=q, k=k, v=v))
    return check_gates(g, beta)                      # g in [-inf, 0], beta in [0, 1], no NaN


def _prepare(q, k, v, g, beta, scale, chunk_size, may_forget: bool) -> ChunkPrep:
    """:func:`kda_chunk_prepare` on validated inputs. ``may_forget``: g may hold -inf (the -inf handling
    is a no-op on chunks without it, bitwise, so a whole call's flag serves each of its pieces)."""
    dt = _compute_dtype(v)
    B, T, H, K = q.shape
    C = chunk_size
    if scale is None:
        scale = K ** -0.5
    NT = max(1, -(-T // C))
    pad = NT * C - T

    def prep(x):  # pad the T dim (dim 1) with zeros: exact no-op tokens
        x = x.to(dt)
        return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x

    # [B, T, H, D] -> [B, H, NT, C, D]
    def chunks(x):
        return x.reshape(B, NT, C, H, -1).permute(0, 3, 1, 2, 4)  # [B, H, NT, C, D]

    nS, s = sub_chunks(C)

    def sub(x):  # [B, H, NT, C, D] -> [B, H, NT, nS, s, D], a view
        return x.unflatten(-2, (nS, s))

    kq = stack_kq(chunks(prep(k)), chunks(prep(q)))   # [B, H, NT, nS, 2, s, K]; q unscaled (see outputs)
    kc, qc = kq.unbind(-3)                            # [B, H, NT, nS, s, K] views (one backward op)
    vc = chunks(prep(v)).contiguous()                 # [B, H, NT, C, V]
    G = chunks(prep(g))                               # [B, H, NT, C, K] (per-token g here; a view)
    seg = None
    if may_forget:  # g = -inf (full forgetting): cumulate the finite steps, count the -inf ones
        forget = torch.isneginf(G)                    # [B, H, NT, C, K]
        seg = forget.to(torch.int32).cumsum(-2)       # [B, H, NT, C, K] -inf steps in [0, i]
        G = G.masked_fill(forget, 0.0)
    G = G.cumsum(-2)                                  # [B, H, NT, C, K], contiguous
    bc = prep(beta).reshape(B, NT, C, H).permute(0, 3, 1, 2).unsqueeze(-1)  # [B, H, NT, C, 1]

    Akk, Aqk = intra_chunk_products(G, kq, seg)              # [B, H, NT, C, C] strictly lower / lower
    eye = torch.eye(C, dtype=dt, device=v.device)
    Lmat = torch.addcmul(eye, Akk, bc)                       # I + diag(beta) Akk, unit lower   [B, H, NT, C, C]
    Tinv = torch.linalg.solve_triangular(Lmat, eye.expand_as(Lmat), upper=False, unitriangular=True)
    A = Tinv * bc.transpose(-1, -2)                          # (I + L)^{-1} diag(beta)   [B, H, NT, C, C]
    eG = sub(_decay(G, None if seg is None else seg == 0))   # [B, H, NT, nS, s, K]
    w = A @ (kc * eG).flatten(-3, -2)                        # [B, H, NT, C, K]
    u = A @ vc                                               # [B, H, NT, C, V]
    Glast = G[..., -1:, :]                                   # [B, H, NT, 1, K]
    seg_last = None if seg is None else seg[..., -1:, :]     # [B, H, NT, 1, K]
    kd = (kc * sub(_decay(Glast - G, None if seg is None else seg == seg_last))).flatten(-3, -2).transpose(-1, -2)  # [B, H, NT, K, C]
    decay_last = _decay(Glast, None if seg is None else seg_last == 0).squeeze(-2).unsqueeze(-1)  # [B, H, NT, K, 1]
    return ChunkPrep((qc * eG).flatten(-3, -2), Aqk, w, u, kd, decay_last, T, v.dtype, float(scale))


def _initial_state(initial_state, B, H, K, V, dt, device) -> torch.Tensor:
    """The scan's starting state ``[B*H, K, V]`` (a copy; zeros for None); ValueError on a wrong shape or NaN / inf."""
    if initial_state is None:
        return torch.zeros(B * H, K, V, dtype=dt, device=device)
    if not isinstance(initial_state, torch.Tensor) or initial_state.shape != (B, H, K, V):
        got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
        raise ValueError(f"initial_state must have shape [B, H, K, V] = {(B, H, K, V)}, got {got}")
    _check_finite(dict(initial_state=initial_state))
    return initial_state.to(dt).reshape(B * H, K, V).clone()


def kda_chunk_states(prep: ChunkPrep, initial_state: torch.Tensor | None = None) -> ChunkStates:
    """The sequential part of :func:`kda_chunk`: scan the chunk states from ``initial_state``.

    ``v_new = u - w S``; ``S <- diag(exp(G_C)) S + K~^T v_new`` per chunk. initial_state
    ``[B, H, K, V]`` or None (zeros). Raises ValueError on a state of the wrong shape or with NaN / inf.
    """
    B, H, NT, C, K = prep.w.shape
    V = prep.u.shape[-1]
    S = _initial_state(initial_state, B, H, K, V, prep.w.dtype, prep.w.device)  # [B*H, K, V]
    # 3-D views [B*H, ...] of chunk j for baddbmm (B, H are adjacent: no copy)
    # per-chunk views [B*H, ...]; unbind, not indexing: its backward is one stack, not a zero-filled
    # full-size gradient per chunk
    w, u, kd, decay_last = (t.flatten(0, 1).unbind(1) for t in (prep.w, prep.u, prep.kd, prep.decay_last))
    # Per-chunk results are collected and stacked, never written into a preallocated tensor: the state
    # update reads v_new of chunk j, and an in-place write of chunk j + 1 would invalidate what autograd
    # saved for it (training backpropagates through this scan).
    hs, vs = [], []
    for j in range(NT):                                      # sequential only over chunks
        hs.append(S)
        vn = torch.baddbmm(u[j], w[j], S, alpha=-1.0)        # u - w S       [B*H, C, V]
        vs.append(vn)
        S = torch.baddbmm(S * decay_last[j], kd[j], vn)      # [B*H, K, V]
    h = torch.stack(hs, 1).view(B, H, NT, K, V).transpose(1, 2)     # [B, NT, H, K, V] (a view)
    return ChunkStates(h, torch.stack(vs, 1).view(B, H, NT, C, V), S.view(B, H, K, V))


def kda_chunk_outputs(prep: ChunkPrep, states: ChunkStates) -> torch.Tensor:
    """Outputs of :func:`kda_chunk` from the scanned states: ``o = scale ((q exp(G)) h + Aqk v_new)``,
    all chunks at once. Returns o ``[B, T, H, V]`` in v's dtype."""
    B, H, NT, C, K = prep.qg.shape
    V = prep.u.shape[-1]
    hs = states.h.transpose(1, 2).reshape(B * H * NT, K, V)            # [B*H*NT, K, V]
    av = prep.Aqk.reshape(-1, C, C) @ states.v_new.reshape(-1, C, V)   # [B*H*NT, C, V]
    o = torch.baddbmm(av, prep.qg.reshape(-1, C, K), hs, beta=prep.scale, alpha=prep.scale)  # [B*H*NT, C, V]
    o = o.view(B, H, NT * C, V).transpose(1, 2)[:, :prep.num_tokens]   # [B, T, H, V]
    return o.to(prep.out_dtype).contiguous()


def _scan_with_outputs(prep: ChunkPrep, S: torch.Tensor, o_out: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """:func:`kda_chunk_states` and :func:`kda_chunk_outputs` in one pass, for calls without autograd.

    Writes chunk j's outputs into ``o_out`` ``[B, T_piece, H, V]`` and its starting state into
    ``h_out`` ``[B, NT, H, K, V]`` (views of the caller's result tensors: no stacking or concatenation)
    and returns the final state ``[B*H, K, V]``. Every product is the same per-matrix op as in the
    two-pass form, so the results are bitwise equal (``tests/kda_core/test_intra_chunk.py``).
    """
    B, H, NT, C, K = prep.w.shape
    V = prep.u.shape[-1]
    w, u, kd, qg, Aqk, decay_last = (t.flatten(0, 1).unbind(1) for t in (
        prep.w, prep.u, prep.kd, prep.qg, prep.Aqk, prep.decay_last))  # per chunk [B*H, ...]
    h_rows, o_rows = h_out.unbind(1), o_out.split(C, 1)                 # NT x [B, H, K, V]; [B, <= C, H, V]
    for j in range(NT):
        h_rows[j].copy_(S.view(B, H, K, V))
        vn = torch.baddbmm(u[j], w[j], S, alpha=-1.0)                   # u - w S            [B*H, C, V]
        o = torch.baddbmm(Aqk[j] @ vn, qg[j], S, beta=prep.scale, alpha=prep.scale)  # [B*H, C, V]
        S = torch.baddbmm(S * decay_last[j], kd[j], vn)                 # [B*H, K, V]
        if j < len(o_rows) and (n := o_rows[j].shape[1]):                # real (unpadded) tokens of chunk j
            o = o.view(B, H, C, V)
            o_rows[j].copy_((o if n == C else o[:, :, :n]).transpose(1, 2))  # [B, n, H, V]
    return S


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = CHUNK_SIZE,
    piece_tokens: int | None = None,
) -> ChunkOutput:
    """Chunked KDA (WY / UT-transform form), equal to :func:`kda_recurrent` up to rounding.

    Within a chunk of C tokens: ``L[i, j] = beta_i sum_d k_i k_j exp(G_i - G_j)`` (j < i),
    ``A = (I + L)^{-1} diag(beta)``, ``w = A (exp(G) * k)``, ``u = A v``; across chunks
    ``v' = u - w S``, ``o = (q exp(G)) S + Aqk v'``, ``S <- diag(exp(G_C)) S + (k exp(G_C - G))^T v'``
    (fla ``naive_chunk_kda``; Kimi Linear paper, section on the chunkwise algorithm). In-chunk decays
    never overflow: :mod:`kda_core.intra_chunk` factors ``exp(G_i - G_j)`` about references inside the
    chunk, within a bound per 16-token sub-chunk, else by recursive halving (per chunk).
    Without autograd the scan writes each chunk's outputs and state straight into the results; with
    autograd (training) it stacks them; both are bitwise equal.
    Any T works: the tail is padded with exact no-op tokens (g = 0, beta = 0, k = 0).

    Args:
        q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H, K]``; beta ``[B, T, H]``;
        initial_state ``[B, H, K, V]`` or None; scale defaults to ``K ** -0.5``;
        chunk_size C: a power of two (default 64);
        piece_tokens: inputs longer than this run in pieces of this many tokens (a multiple of C),
            the state carried between pieces; same maths, smaller working set, and bitwise the same
            result: every op is per chunk, so only the chunk grid (C from the first token) matters.
            None: :func:`piece_tokens_for` (a piece's ``[B, H, piece, max(K, V)]`` tensors stay
            within ``PIECE_BYTES``).

    Returns:
        :class:`ChunkOutput` (o ``[B, T, H, V]``, final_state ``[B, H, K, V]``,
        h ``[B, NT, H, K, V]`` with ``h[:, j]`` the state before chunk j).

    Raises:
        ValueError: on shape mismatch, a zero B, H, K or V (T = 0 gives no outputs and the initial state),
            a chunk_size that is not a positive power of two (a bool is not), a piece_tokens that is
            not a positive multiple of chunk_size, a scale that is not None or a finite number > 0,
            non-finite q, k, v or initial_state, or g / beta outside the gates' domain
            (:func:`kda_core.kda.check_gates`: g in [-inf, 0], ``-inf`` being full forgetting with
            the recurrent result; beta in [0, 1]).

    It is :func:`kda_chunk_prepare` (intra-chunk, parallel), :func:`kda_chunk_states` (the sequential
    scan) and :func:`kda_chunk_outputs`; context parallel (``serve.parallel.kcp``) runs them apart.
    """
    may_forget = _validate(q, k, v, g, beta, initial_state, scale, chunk_size)
    if piece_tokens is None:
        piece_tokens = piece_tokens_for(q.shape[0], q.shape[2], q.shape[3], v.shape[-1], chunk_size)
    if not (isinstance(piece_tokens, int) and not isinstance(piece_tokens, bool) and piece_tokens >= chunk_size and piece_tokens % chunk_size == 0):
        raise ValueError(f"piece_tokens must be a positive multiple of chunk_size={chunk_size}, got {piece_tokens!r}")
    T = q.shape[1]
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)):
        return _kda_chunk_autograd(q, k, v, g, beta, initial_state, scale, chunk_size, piece_tokens, may_forget)
    B, _, H, K = q.shape
    V, C = v.shape[-1], chunk_size
    dt = _compute_dtype(v)
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)              # [B, T, H, V]
    h = torch.empty(B, max(1, -(-T // C)), H, K, V, dtype=dt, device=v.device)  # [B, NT, H, K, V]
    S = _initial_state(initial_state, B, H, K, V, dt, v.device)             # [B*H, K, V]
    for s in range(0, max(T, 1), piece_tokens):
        part = slice(s, s + piece_tokens)
        prep = _prepare(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], scale, chunk_size, may_forget)
        S = _scan_with_outputs(prep, S, o[:, part], h[:, s // C: s // C + prep.w.shape[2]])
    return ChunkOutput(o, S.view(B, H, K, V), h)


def _kda_chunk_autograd(q, k, v, g, beta, initial_state, scale, chunk_size, piece_tokens, may_forget) -> ChunkOutput:
    """:func:`kda_chunk` when autograd records (training): the two-pass form, each result a new tensor
    (stacked and concatenated, never written in place into a tensor autograd saved)."""
    T = q.shape[1]
    if T <= piece_tokens:
        prep = _prepare(q, k, v, g, beta, scale, chunk_size, may_forget)
        states = kda_chunk_states(prep, initial_state)
        return ChunkOutput(kda_chunk_outputs(prep, states), states.final_state, states.h)
    outs, hs, state = [], [], initial_state
    # split, not slicing per piece: the backward of one split is one concatenation, that of each slice a
    # zero-filled full-length gradient added up (quadratic in the number of pieces)
    for piece in zip(*(t.split(piece_tokens, dim=1) for t in (q, k, v, g, beta))):
        o, state, h = _kda_chunk_autograd(*piece, state, scale, chunk_size, piece_tokens, may_forget)
        outs.append(o)
        hs.append(h)
    return ChunkOutput(torch.cat(outs, 1), state, torch.cat(hs, 1))
