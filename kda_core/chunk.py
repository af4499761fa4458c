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

from kda_core import cpu_kernel
from kda_core.kda import NonFiniteError, _check_inputs, _compute_dtype, check_gates, check_scale
from kda_core.wy import MAX_CHUNK_DECAY, wy_safe, wy_units

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
    Tensors are fp32 (fp64 for fp64 input), views in this order of chunk-major (``[NT, B, H, ...]``) tensors.
    The six tensors are :class:`kda_core.wy.WY`'s per-unit ``[NT*B*H, ...]`` results in the chunk API's shapes
    (kd transposed, decay_last with a trailing 1): the API KCP and the block summaries consume, kept apart from
    the unit layout the kernel computes in.
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
    (T = 4,096, H = 4, K = V = 128, one thread, interleaved medians of 9: 256-token pieces took 62 ms of
    CPU time, 512-token 66 ms, 1,024-token 68 ms, one 4,096-token piece ~90 ms).
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


def _fused(dt: torch.dtype, device: torch.device, tensors=()) -> bool:
    """Whether this call runs the fused C form (:mod:`kda_core.cpu_kernel`): fp32 compute on the CPU, no
    autograd recording through ``tensors``, and the kernel available here."""
    if dt != torch.float32 or device.type != "cpu":
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    return cpu_kernel.available()


def _kernel_inputs(q, k, v, g, beta) -> list:
    """The inputs as the fused kernel reads them: fp32, q, k, v, g with a contiguous last dim (views when they are)."""
    xs = [x.to(torch.float32) for x in (q, k, v, g)]
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs] + [beta.to(torch.float32)]


def _prepare(q, k, v, g, beta, scale, chunk_size, may_forget: bool) -> ChunkPrep:
    """:func:`kda_chunk_prepare` on validated inputs. ``may_forget``: g may hold -inf (a unit without it
    gets the same result either way, so a whole call's flag serves each of its pieces).

    The units (chunk, batch row, head) are laid out chunk-major, ``[NT, B, H, ...]``: chunk j of every
    row and head is one contiguous block for the sequential scan; the fields are views in the
    documented ``[B, H, NT, ...]`` order. The fused C form computes every unit within the chunk-level
    bound; the others (and every unit under autograd or in fp64) go through :func:`kda_core.wy.wy_units`.
    """
    dt = _compute_dtype(v)
    B, T, H, K = q.shape
    V, C = v.shape[-1], chunk_size
    if scale is None:
        scale = K ** -0.5
    NT = max(1, -(-T // C))
    pad = NT * C - T

    def units(x):  # [B, T, H, D] -> [NT, B, H, C, D], a view; the T dim padded with exact no-op tokens
        x = x.to(dt)
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.view(B, NT, C, H, -1).permute(1, 0, 3, 2, 4)

    if _fused(dt, q.device, (q, k, v, g, beta)):
        n = NT * B * H
        xs = _kernel_inputs(q, k, v, g, beta)
        wy = tuple(torch.empty(n, *shape, dtype=dt) for shape in ((C, K), (C, C), (C, K), (C, V), (C, K), (K,)))
        slow = cpu_kernel.prepare(*xs, C, MAX_CHUNK_DECAY, wy)
        if bool(slow.any()):                         # beyond the chunk-level bound, or g = -inf: the safe form
            idx = slow.nonzero().squeeze(1)
            flat = [units(x).reshape(n, C, -1)[idx] for x in (g, k, q, v, beta.unsqueeze(-1))]
            for buf, part in zip(wy, wy_safe(*flat, may_forget)):
                buf.index_copy_(0, idx, part)
    else:
        wy = wy_units(units(g), units(k), units(q), units(v), units(beta.unsqueeze(-1)), may_forget)
    qg, Aqk, w, u, kd, decay_last = wy

    def fields(x):  # [NT*B*H, a, b] -> [B, H, NT, a, b] (a view)
        return x.view(NT, B, H, *x.shape[1:]).permute(1, 2, 0, 3, 4)

    return ChunkPrep(fields(qg), fields(Aqk), fields(w), fields(u), fields(kd).transpose(-1, -2),
                     fields(decay_last.unsqueeze(-1)), T, v.dtype, float(scale))


def _unit_tensors(prep: ChunkPrep) -> tuple:
    """The six WY fields of ``prep`` as the fused kernel's chunk-major unit tensors (qg, Aqk, w, u ``[NT, B,
    H, C, *]``, kd ``[NT, B, H, C, K]``, decay_last ``[NT, B, H, K]``), contiguous: views for a prep of
    :func:`_prepare`, copies otherwise."""
    five = (prep.qg, prep.Aqk, prep.w, prep.u, prep.kd.transpose(-1, -2))
    return (*(t.permute(2, 0, 1, 3, 4).contiguous() for t in five),
            prep.decay_last.squeeze(-1).permute(2, 0, 1, 3).contiguous())


def _chunk_major(x: torch.Tensor) -> torch.Tensor:
    """A ``[B, H, NT, a, b]`` field as ``[NT, B*H, a, b]`` (a view for :func:`_prepare`'s fields)."""
    B, H, NT = x.shape[:3]
    return x.permute(2, 0, 1, 3, 4).reshape(NT, B * H, *x.shape[3:])


def _initial_state(initial_state, B, H, K, V, dt, device) -> torch.Tensor:
    """The scan's starting state ``[B*H, K, V]`` (a copy; zeros for None); ValueError on a wrong shape or NaN / inf."""
    if initial_state is None:
        return torch.zeros(B * H, K, V, dtype=dt, device=device)
    if not isinstance(initial_state, torch.Tensor) or initial_state.shape != (B, H, K, V):
        got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
        raise ValueError(f"initial_state must have shape [B, H, K, V] = {(B, H, K, V)}, got {got}")
    _check_finite(dict(initial_state=initial_state))
    return initial_state.to(dt).reshape(B * H, K, V).clone()


def _scan_into(prep: ChunkPrep, h: torch.Tensor) -> torch.Tensor:
    """The scan without autograd, in place: h ``[NT + 1, B*H, K, V]`` holds the starting state in
    ``h[0]`` and receives the state before each later chunk and the final one in ``h[NT]``.
    Returns v_new ``[NT, B*H, C, V]``."""
    w, u, kd, decay_last = (_chunk_major(t).unbind(0) for t in (prep.w, prep.u, prep.kd, prep.decay_last))
    v_new = prep.u.new_empty(len(u), *u[0].shape)            # [NT, B*H, C, V]
    hs, vs = h.unbind(0), v_new.unbind(0)                    # per-chunk views, made once
    for j in range(len(u)):                                  # sequential only over chunks
        torch.baddbmm(u[j], w[j], hs[j], alpha=-1.0, out=vs[j])     # u - w S   [B*H, C, V]
        torch.mul(hs[j], decay_last[j], out=hs[j + 1])
        hs[j + 1].baddbmm_(kd[j], vs[j])                    # diag(exp(G_C)) S + K~^T v_new
    return v_new


def kda_chunk_states(prep: ChunkPrep, initial_state: torch.Tensor | None = None) -> ChunkStates:
    """The sequential part of :func:`kda_chunk`: scan the chunk states from ``initial_state``.

    ``v_new = u - w S``; ``S <- diag(exp(G_C)) S + K~^T v_new`` per chunk. initial_state
    ``[B, H, K, V]`` or None (zeros). Raises ValueError on a state of the wrong shape or with NaN / inf.
    Without autograd every chunk's state and v_new are written in place into one tensor each; with
    autograd (training) they are stacked (an in-place write would invalidate what autograd saved); both
    run the same products and are bitwise equal.
    """
    B, H, NT, C, K = prep.w.shape
    V = prep.u.shape[-1]
    S = _initial_state(initial_state, B, H, K, V, prep.w.dtype, prep.w.device)  # [B*H, K, V]
    tensors = (S, prep.w, prep.u, prep.kd, prep.decay_last)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        w, u, kd, decay_last = (_chunk_major(t) for t in tensors[1:])
        hs, vs = [], []
        for j in range(NT):
            hs.append(S)
            vn = torch.baddbmm(u[j], w[j], S, alpha=-1.0)
            vs.append(vn)
            S = torch.baddbmm(S * decay_last[j], kd[j], vn)
        h, v_new, final = torch.stack(hs), torch.stack(vs), S
    else:
        h = S.new_empty(NT + 1, B * H, K, V)
        h[0] = S
        if _fused(S.dtype, S.device):
            v_new = S.new_empty(NT, B * H, C, V)
            cpu_kernel.scan_outputs(NT, B, H, K, V, C, 0, prep.scale, _unit_tensors(prep), h, v_new, None, True)
        else:
            v_new = _scan_into(prep, h)
        final, h = h[NT].clone(), h[:NT]
    return ChunkStates(h.view(NT, B, H, K, V).transpose(0, 1), v_new.view(NT, B, H, C, V).permute(1, 2, 0, 3, 4),
                       final.view(B, H, K, V))


def _output_units(prep: ChunkPrep, h: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
    """``scale ((q exp(G)) h + Aqk v_new)`` of every unit, ``[NT*B*H, C, V]``, from h ``[NT, B, H, K, V]``
    and v_new ``[NT, B*H, C, V]`` (chunk-major; views)."""
    B, H, NT, C, K = prep.qg.shape
    n = NT * B * H
    qg, Aqk = (_chunk_major(t).reshape(n, *t.shape[3:]) for t in (prep.qg, prep.Aqk))
    av = torch.bmm(Aqk, v_new.reshape(n, C, -1))
    return torch.baddbmm(av, qg, h.reshape(n, K, -1), beta=prep.scale, alpha=prep.scale)


def _token_major(o: torch.Tensor, B: int, H: int, num_tokens: int) -> torch.Tensor:
    """``[NT*B*H, C, V]`` unit outputs as a ``[B, num_tokens, H, V]`` view (padding dropped)."""
    n, C, V = o.shape
    return o.view(-1, B, H, C, V).permute(1, 0, 3, 2, 4).flatten(1, 2)[:, :num_tokens]


def kda_chunk_outputs(prep: ChunkPrep, states: ChunkStates) -> torch.Tensor:
    """Outputs of :func:`kda_chunk` from the scanned states: ``o = scale ((q exp(G)) h + Aqk v_new)``,
    all chunks at once. Returns o ``[B, T, H, V]`` in v's dtype."""
    B, H, NT, C, K = prep.qg.shape
    tensors = (prep.qg, prep.Aqk, states.h, states.v_new)
    if _fused(prep.qg.dtype, prep.qg.device, tensors) and all(t.dtype == prep.qg.dtype for t in tensors):
        V = states.v_new.shape[-1]
        o = prep.qg.new_empty(B, prep.num_tokens, H, V)
        cpu_kernel.scan_outputs(NT, B, H, K, V, C, prep.num_tokens, prep.scale, _unit_tensors(prep),
                                states.h.transpose(0, 1).contiguous(), _chunk_major(states.v_new).contiguous(), o, False)
        return o.to(prep.out_dtype)
    o = _output_units(prep, states.h.transpose(0, 1), _chunk_major(states.v_new))
    return _token_major(o, B, H, prep.num_tokens).to(prep.out_dtype).contiguous()


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
    never overflow: :mod:`kda_core.wy` factors ``exp(G_i - G_j)`` about the chunk's start when the chunk
    decays by at most 60 nats in every key dim, else about references inside the chunk
    (:mod:`kda_core.intra_chunk`), unit by unit (chunk, batch row, head).
    Units are laid out chunk-major; without autograd the scan writes each chunk's state straight into
    the result ``h`` and the outputs go to ``o`` piece by piece; with autograd (training) the scan
    stacks them; both are bitwise equal.
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
        h ``[B, NT, H, K, V]`` with ``h[:, j]`` the state before chunk j: a view of a chunk-major
        ``[NT, B, H, K, V]`` tensor).

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
    NT = max(1, -(-T // C))
    fused = _fused(dt, v.device)
    o = torch.empty(B, T, H, V, dtype=dt if fused else v.dtype, device=v.device)   # [B, T, H, V]
    h = torch.empty(NT + 1, B, H, K, V, dtype=dt, device=v.device)          # chunk-major; h[NT] = final state
    h[0] = _initial_state(initial_state, B, H, K, V, dt, v.device).view(B, H, K, V)
    start = 0
    if fused:                                       # one C pass; chunks from the first unit beyond the bound on below
        xs = _kernel_inputs(q, k, v, g, beta)
        start = C * cpu_kernel.forward(*xs, C, MAX_CHUNK_DECAY, K ** -0.5 if scale is None else scale, h, o)
    for s in range(start, max(T, 1), piece_tokens):
        part = slice(s, s + piece_tokens)
        prep = _prepare(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], scale, chunk_size, may_forget)
        j, nt = s // C, prep.w.shape[2]
        if fused:                                   # scan and outputs in one C pass, o written in place
            v_new = h.new_empty(nt, B * H, C, V)
            cpu_kernel.scan_outputs(nt, B, H, K, V, C, prep.num_tokens, prep.scale, _unit_tensors(prep),
                                    h[j: j + nt + 1], v_new, o[:, part], True)
            continue
        v_new = _scan_into(prep, h[j: j + nt + 1].view(nt + 1, B * H, K, V))
        o[:, part] = _token_major(_output_units(prep, h[j: j + nt], v_new), B, H, prep.num_tokens)
    return ChunkOutput(o.to(v.dtype), h[NT].clone(), h[:NT].transpose(0, 1))


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


def kernel_in_use() -> str:
    """The form :func:`kda_chunk` runs in fp32 without autograd here: ``"fused C"`` (:mod:`kda_core.cpu_kernel`)
    or ``"torch form"`` (see ``cpu_kernel.reason()``)."""
    return "fused C" if cpu_kernel.available() else "torch form"


def kernel_self_check() -> None:
    """The fused C form against the torch form on a small call with a partial last chunk, a unit beyond the
    chunk-level bound and K, V not multiples of 16 (every code path of the kernel), to fp32 rounding; raises
    RuntimeError when they disagree (:mod:`kda_core.cpu_kernel` then keeps the torch form)."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 150, 2, 24, 20
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * 0.5
    g[0, 70:80, 1] = -8.0                           # one unit beyond the chunk-level bound
    beta = torch.rand(B, T, H, generator=gen)
    with torch.no_grad():
        fused = kda_chunk(q, k, v, g, beta)
        with cpu_kernel.disabled():
            ref = kda_chunk(q, k, v, g, beta)
    for a, b in zip(fused, ref):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            raise RuntimeError(f"self-check failed: max |diff| {float((a - b).abs().max()):.3g}")


cpu_kernel.register_self_check(kernel_self_check)
cpu_kernel.prebuild()      # compile the fused form in the background (once per machine; cached)
