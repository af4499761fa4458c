"""The chunked (WY / UT) form of KDA: prefill in chunks of C tokens, with per-chunk states for
checkpoints and KCP (prepare / states / outputs split), and full forgetting (g = -inf) handled as in
:func:`kda_core.kda.kda_recurrent`.

Shapes as in :mod:`kda_core.kda`; NT = number of chunks.

The form a call runs in is chosen in one place, :func:`_choose`, at each entry point: the fused C backend
(:class:`kda_core.cpu_kernel.FusedChunk`, fp32 on the CPU without autograd, where it is built and passed its
self-check) or the torch backend (:class:`kda_core.chunk_torch.TorchChunk`, everything else, and the
reference); both implement prepare / states / outputs / forward on the chunk-major unit layout, and this
module validates the inputs and gives their results the API's shapes. ``backend="torch"`` / ``"fused"``
asks for one form (A/B benchmarks, tests). Importing this module builds and loads nothing.

The chunk form rejects NaN / inf in q, k, v and the initial state, and g or beta outside the gates' domain
(:func:`kda_core.kda.check_gates`: g in [-inf, 0], beta in [0, 1]), with a ValueError naming the tensor (a chunk
mixes its tokens, so a NaN would also corrupt the tokens before it).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kda_core import cpu_kernel
from kda_core.chunk_torch import TORCH
from kda_core.cpu_build import ISAS
from kda_core.kda import NonFiniteError, _check_inputs, _compute_dtype, check_gates, check_scale
from kda_core.wy import WY

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
    the unit layout the backends compute in.
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


BACKENDS = ("auto", "torch", "fused", *(f"fused-{isa}" for isa in ISAS))   # "fused-avx512", "fused-avx2"


def _choose(backend: str, dt: torch.dtype | None, device: torch.device, tensors=()):
    """The backend a call runs in, chosen here and nowhere else: the fused C backend for fp32 compute (``dt``;
    None: operands of mixed dtypes) on the CPU with no autograd recording through ``tensors`` (``backend`` "auto"
    where :func:`kda_core.cpu_kernel.backend` is available, "fused" always, "fused-<path>" on that vector path),
    else the torch backend. Raises ValueError for an unknown ``backend`` or a fused one on a call it cannot run,
    RuntimeError for a fused one that is unavailable here."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return TORCH
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if dt != torch.float32 or device.type != "cpu" or grad:
        if backend != "auto":
            raise ValueError(f"backend={backend!r} runs fp32 on the CPU without autograd; this call computes in "
                             f"{dt or 'mixed dtypes'} on {device.type}{' with autograd' if grad else ''}")
        return TORCH
    if backend.startswith("fused-"):
        return cpu_kernel.load(backend.removeprefix("fused-"))
    fused = cpu_kernel.backend()
    if fused is None and backend == "fused":
        raise RuntimeError(f"the fused C form is unavailable here: {cpu_kernel.reason()}")
    return fused or TORCH


def kda_chunk_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = CHUNK_SIZE,
    backend: str = "auto",
) -> ChunkPrep:
    """Intra-chunk part of :func:`kda_chunk` (no state involved; parallel over chunks).

    Args/Raises: as :func:`kda_chunk` (without ``initial_state``). Returns: :class:`ChunkPrep`.
    """
    may_forget = _validate(q, k, v, g, beta, None, scale, chunk_size)
    form = _choose(backend, _compute_dtype(v), q.device, (q, k, v, g, beta))
    B, T, H, K = q.shape
    NT = max(1, -(-T // chunk_size))
    qg, Aqk, w, u, kd, decay_last = form.prepare(q, k, v, g, beta, chunk_size, may_forget)

    def fields(x):  # [NT*B*H, a, b] -> [B, H, NT, a, b] (a view)
        return x.view(NT, B, H, *x.shape[1:]).permute(1, 2, 0, 3, 4)

    return ChunkPrep(fields(qg), fields(Aqk), fields(w), fields(u), fields(kd).transpose(-1, -2),
                     fields(decay_last.unsqueeze(-1)), T, v.dtype, float(K ** -0.5 if scale is None else scale))


def _validate(q, k, v, g, beta, initial_state, scale, chunk_size) -> bool:
    """Every input check of :func:`kda_chunk` but the initial state's values; returns whether g holds -inf."""
    _check_inputs(q, k, v, g, beta, initial_state, has_time=True, state_name="initial_state")
    _check_chunk_size(chunk_size)
    check_scale(scale)
    _check_finite(dict(q=q, k=k, v=v))
    return check_gates(g, beta)                      # g in [-inf, 0], beta in [0, 1], no NaN


def _units(prep: ChunkPrep) -> WY:
    """The six fields of ``prep`` as the backends' contiguous chunk-major unit tensors (qg, Aqk, w, u, kd
    ``[NT*B*H, C, *]``, decay_last ``[NT*B*H, K]``): views for a prep of :func:`kda_chunk_prepare`, copies
    otherwise."""
    five = (prep.qg, prep.Aqk, prep.w, prep.u, prep.kd.transpose(-1, -2))
    return WY(*(t.permute(2, 0, 1, 3, 4).contiguous().flatten(0, 2) for t in five),
              prep.decay_last.squeeze(-1).permute(2, 0, 1, 3).contiguous().flatten(0, 2))


def _initial_state(initial_state, B, H, K, V, dt, device) -> torch.Tensor:
    """The scan's starting state ``[B*H, K, V]`` (a copy; zeros for None); ValueError on a wrong shape or NaN / inf."""
    if initial_state is None:
        return torch.zeros(B * H, K, V, dtype=dt, device=device)
    if not isinstance(initial_state, torch.Tensor) or initial_state.shape != (B, H, K, V):
        got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
        raise ValueError(f"initial_state must have shape [B, H, K, V] = {(B, H, K, V)}, got {got}")
    _check_finite(dict(initial_state=initial_state))
    return initial_state.to(dt).reshape(B * H, K, V).clone()


def kda_chunk_states(prep: ChunkPrep, initial_state: torch.Tensor | None = None, backend: str = "auto") -> ChunkStates:
    """The sequential part of :func:`kda_chunk`: scan the chunk states from ``initial_state``.

    ``v_new = u - w S``; ``S <- diag(exp(G_C)) S + K~^T v_new`` per chunk. initial_state
    ``[B, H, K, V]`` or None (zeros). Raises ValueError on a state of the wrong shape or with NaN / inf, and as
    :func:`kda_chunk` for ``backend``.
    Without autograd every chunk's state and v_new are written in place into one tensor each; with
    autograd (training) they are stacked (an in-place write would invalidate what autograd saved); both
    run the same products and are bitwise equal.
    """
    B, H, NT, C, K = prep.w.shape
    V = prep.u.shape[-1]
    S = _initial_state(initial_state, B, H, K, V, prep.w.dtype, prep.w.device)  # [B*H, K, V]
    form = _choose(backend, S.dtype, S.device, (S, prep.w, prep.u, prep.kd, prep.decay_last))
    h, v_new, final = form.states(_units(prep), B, H, S)
    return ChunkStates(h.view(NT, B, H, K, V).transpose(0, 1), v_new.view(NT, B, H, C, V).permute(1, 2, 0, 3, 4),
                       final.view(B, H, K, V))


def kda_chunk_outputs(prep: ChunkPrep, states: ChunkStates, backend: str = "auto") -> torch.Tensor:
    """Outputs of :func:`kda_chunk` from the scanned states: ``o = scale ((q exp(G)) h + Aqk v_new)``,
    all chunks at once. Returns o ``[B, T, H, V]`` in v's dtype. Raises as :func:`kda_chunk` for ``backend``."""
    B, H, NT, C, K = prep.qg.shape
    tensors = (prep.qg, prep.Aqk, states.h, states.v_new)
    same = all(t.dtype == prep.qg.dtype for t in tensors)
    form = _choose(backend, prep.qg.dtype if same else None, prep.qg.device, tensors)
    h = states.h.transpose(0, 1).reshape(NT, B * H, K, -1)                             # [NT, B*H, K, V]
    v_new = states.v_new.permute(2, 0, 1, 3, 4).reshape(NT, B * H, C, -1)              # [NT, B*H, C, V]
    o = form.outputs(_units(prep), h, v_new, B, H, prep.num_tokens, prep.scale)
    return o.to(prep.out_dtype).contiguous()


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
    backend: str = "auto",
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
        backend: the form to run (:data:`BACKENDS`): "auto" (the fused C form where the call can use it,
            else the torch form), "torch", "fused" (this host's widest vector path) or "fused-avx512" /
            "fused-avx2" (that path; A/B benchmarks, tests); a fused one raises RuntimeError where it is
            unavailable here.

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
            the recurrent result; beta in [0, 1]), an unknown backend, or backend "fused" for a call it
            cannot run (autograd, not fp32, not on the CPU).
        RuntimeError: a fused backend that is unavailable here (``cpu_kernel.reason()``).

    It is :func:`kda_chunk_prepare` (intra-chunk, parallel), :func:`kda_chunk_states` (the sequential
    scan) and :func:`kda_chunk_outputs`; context parallel (``serve.parallel.kcp``) runs them apart.
    """
    may_forget = _validate(q, k, v, g, beta, initial_state, scale, chunk_size)
    if piece_tokens is None:
        piece_tokens = piece_tokens_for(q.shape[0], q.shape[2], q.shape[3], v.shape[-1], chunk_size)
    if not (isinstance(piece_tokens, int) and not isinstance(piece_tokens, bool) and piece_tokens >= chunk_size and piece_tokens % chunk_size == 0):
        raise ValueError(f"piece_tokens must be a positive multiple of chunk_size={chunk_size}, got {piece_tokens!r}")
    B, T, H, K = q.shape
    V, dt = v.shape[-1], _compute_dtype(v)
    form = _choose(backend, dt, v.device, (q, k, v, g, beta, initial_state))
    scale = float(K ** -0.5 if scale is None else scale)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)):
        return _kda_chunk_autograd(form, q, k, v, g, beta, initial_state, scale, chunk_size, piece_tokens, may_forget)
    NT = max(1, -(-T // chunk_size))
    h = torch.empty(NT + 1, B, H, K, V, dtype=dt, device=v.device)          # chunk-major; h[NT] = final state
    h[0] = _initial_state(initial_state, B, H, K, V, dt, v.device).view(B, H, K, V)
    o = form.forward(q, k, v, g, beta, h, scale, chunk_size, piece_tokens, may_forget)   # [B, T, H, V]
    return ChunkOutput(o.to(v.dtype), h[NT].clone(), h[:NT].transpose(0, 1))


def _kda_chunk_autograd(form, q, k, v, g, beta, initial_state, scale, chunk_size, piece_tokens, may_forget) -> ChunkOutput:
    """:func:`kda_chunk` when autograd records (training; ``form`` is the torch backend): prepare, states and
    outputs, each result a new tensor (stacked and concatenated, never written in place into a tensor autograd
    saved), piece by piece."""
    B, T, H, K = q.shape
    if T <= piece_tokens:
        NT = max(1, -(-T // chunk_size))
        wy = form.prepare(q, k, v, g, beta, chunk_size, may_forget)
        S = _initial_state(initial_state, B, H, K, v.shape[-1], wy.w.dtype, v.device)     # [B*H, K, V]
        h, v_new, final = form.states(wy, B, H, S)
        o = form.outputs(wy, h, v_new, B, H, T, scale)
        return ChunkOutput(o.to(v.dtype).contiguous(), final.view(B, H, K, -1), h.view(NT, B, H, K, -1).transpose(0, 1))
    outs, hs, state = [], [], initial_state
    # split, not slicing per piece: the backward of one split is one concatenation, that of each slice a
    # zero-filled full-length gradient added up (quadratic in the number of pieces)
    for piece in zip(*(t.split(piece_tokens, dim=1) for t in (q, k, v, g, beta))):
        o, state, h = _kda_chunk_autograd(form, *piece, state, scale, chunk_size, piece_tokens, may_forget)
        outs.append(o)
        hs.append(h)
    return ChunkOutput(torch.cat(outs, 1), state, torch.cat(hs, 1))


def kernel_in_use() -> str:
    """The name of the form :func:`kda_chunk` runs in fp32 on the CPU without autograd here (the fused C backend
    is loaded by this call if it was not yet): ``"fused C (AVX-512)"``, ``"fused C (AVX2)"`` or ``"torch form"``
    (``cpu_kernel.reason()`` says why)."""
    return _choose("auto", torch.float32, torch.device("cpu")).name
