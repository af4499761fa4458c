"""A block of KDA tokens as one affine map of the state: the summary that context parallel exchanges.

Every KDA step is affine in the key-first state ``S [K, V]`` (per batch row and head):
``S_t = A_t S_{t-1} + B_t`` with ``A_t = (I - beta_t k_t k_t^T) diag(alpha_t)`` (``alpha = exp(g)``)
and ``B_t = beta_t k_t v_t^T``; both act on the K dim. A block of tokens therefore collapses to one
pair ``(M, S_ext)``: ``M = A_L ... A_1`` ``[K, K]`` and ``S_ext`` ``[K, V]``, the state reached from a
zero start, so that ``S_end = M S_start + S_ext``. Pairs compose associatively; ranks exchange them.

The fast form works per 64-token chunk from the WY quantities of :func:`kda_core.chunk.kda_chunk_prepare`:
``M_c = diag(gamma_c) - K~_c^T W_c`` (``gamma_c = exp(G_C)``, the whole-chunk decay; ``K~_c`` keys
decayed to the chunk end; ``W_c`` the WY keys), chained over chunks in fp32 (fp64 for fp64 input).
Source: fla ``fla/ops/cp/KCP.md`` (pre-process forward, stages 1-2) and LASP-2 (arXiv:2502.07563).
:func:`naive_summary` is the per-token product of the affine maps, the reference the tests compare with.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kda_core.chunk import ChunkPrep, kda_chunk_prepare


class BlockSummary(NamedTuple):
    """One block as an affine map of the state: ``S_end = M @ S_start + S_ext``.

    M: ``[B, H, K, K]`` transition; S_ext: ``[B, H, K, V]`` state reached from a zero start.
    fp32 (fp64 for fp64 inputs).
    """

    M: torch.Tensor
    S_ext: torch.Tensor


def summary_from_prep(prep: ChunkPrep) -> BlockSummary:
    """Chain the per-chunk maps of an already prepared block (shares the intra-chunk work with the
    local chunk run). ``M_c = diag(exp(G_C)) - K~_c^T W_c``; ``M <- M_c M``; ``S <- M_c S + K~_c^T U_c``."""
    B, H, NT, C, K = prep.w.shape
    Mc = torch.diag_embed(prep.decay_last.squeeze(-1)) - prep.kd @ prep.w   # [B, H, NT, K, K]
    Bc = prep.kd @ prep.u                                                  # [B, H, NT, K, V]
    M = torch.eye(K, dtype=Mc.dtype).expand(B, H, K, K).contiguous()       # [B, H, K, K]
    S = torch.zeros_like(Bc[:, :, 0])                                      # [B, H, K, V]
    for j in range(NT):                                                    # chained, chunk by chunk
        M = Mc[:, :, j] @ M
        S = Mc[:, :, j] @ S + Bc[:, :, j]
    return BlockSummary(M, S)


def chunk_summary(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  chunk_size: int = 64) -> BlockSummary:
    """Summary ``(M, S_ext)`` of one block of tokens, computed in the chunked form.

    Args:
        k ``[B, T, H, K]`` (L2-normalised keys); v ``[B, T, H, V]``; g ``[B, T, H, K]`` log decay
        (``<= 0``); beta ``[B, T, H]``; chunk_size C: a power of two (default 64).

    Returns:
        :class:`BlockSummary` (M ``[B, H, K, K]``, S_ext ``[B, H, K, V]``), fp32 (fp64 for fp64 v).

    Raises:
        ValueError: on shape mismatch (names the argument) or a bad chunk_size.
    """
    # q only enters the outputs (qg, Aqk), never M or S_ext: pass k in its place.
    return summary_from_prep(kda_chunk_prepare(k, k, v, g, beta, chunk_size=chunk_size))


def naive_summary(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> BlockSummary:
    """Reference: the per-token product of the affine maps, ``A_t = (I - beta k k^T) diag(exp(g))``,
    ``B_t = beta k v^T``; ``M <- A_t M``, ``S <- A_t S + B_t``. Same shapes and dtypes as
    :func:`chunk_summary` (computed in fp32, or fp64 for fp64 v). O(T K^2 (K + V)): tests only."""
    chunk_summary(k[:, :1], v[:, :1], g[:, :1], beta[:, :1], chunk_size=1)   # same argument checks
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    k, v, g, beta = (x.to(dt) for x in (k, v, g, beta))
    B, T, H, K = k.shape
    eye = torch.eye(K, dtype=dt)
    M = eye.expand(B, H, K, K).clone()                                     # [B, H, K, K]
    S = torch.zeros(B, H, K, v.shape[-1], dtype=dt)                        # [B, H, K, V]
    for t in range(T):
        kt, bt = k[:, t], beta[:, t, :, None, None]                        # [B, H, K], [B, H, 1, 1]
        A = (eye - bt * kt[..., :, None] * kt[..., None, :]) * g[:, t].exp()[..., None, :]  # [B, H, K, K]
        M = A @ M
        S = A @ S + bt * kt[..., :, None] * v[:, t][..., None, :]
    return BlockSummary(M, S)


def compose(first: BlockSummary, second: BlockSummary) -> BlockSummary:
    """The summary of ``first`` followed by ``second``: ``(M2 M1, M2 S1 + S2)`` (associative)."""
    return BlockSummary(second.M @ first.M, second.M @ first.S_ext + second.S_ext)


def apply_summary(summary: BlockSummary, state: torch.Tensor) -> torch.Tensor:
    """State after the block, starting from ``state`` ``[B, H, K, V]``: ``M state + S_ext``."""
    return summary.M @ state.to(summary.M.dtype) + summary.S_ext


def fold_state(summaries: list[BlockSummary], initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """State after all ``summaries`` in order, from ``initial_state`` (zeros if None):
    ``S <- M_r S + S_ext_r``. Returns ``[B, H, K, V]``.

    Raises:
        ValueError: on an empty list or an initial state of the wrong shape.
    """
    if not summaries:
        raise ValueError("summaries must hold at least one BlockSummary, got an empty list")
    S = torch.zeros_like(summaries[0].S_ext) if initial_state is None else initial_state
    if S.shape != summaries[0].S_ext.shape:
        raise ValueError(f"initial_state must have shape [B, H, K, V] = {tuple(summaries[0].S_ext.shape)}, "
                         f"got {tuple(S.shape)}")
    for s in summaries:
        S = apply_summary(s, S)
    return S
