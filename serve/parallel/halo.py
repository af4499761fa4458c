"""KCP at layer level: a :class:`kda_core.layer.KDALayer` prefill split across ranks, with the conv halo.

Besides the recurrent state, the short causal conv (width W = 4) couples neighbouring blocks: the
first W - 1 outputs of rank r read raw pre-conv q|k|v inputs of the tokens just before its block.
Each rank all-gathers a *tail* ``[B, D, W-1]`` (D = 2HK + HV): rank 0 sends its new conv state
(seeded by the cache's conv state), rank p > 0 its last ``min(L_p, W-1)`` raw inputs, right-aligned.
Rank r rebuilds its conv state by appending the predecessors' tails in order and keeping the last
W - 1 columns, which is exact even for blocks shorter than W - 1. Halo bytes per rank:
``B D (W-1) s`` sent and ``(W-1)`` times that received (rank count W here is the world size).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kda_core.layer import KDACache, KDALayer
from serve.parallel.comm import Comm, PhaseClock, PhaseTimes
from serve.parallel.kcp import kcp_kda


class KCPLayerOutput(NamedTuple):
    """One rank's share of a layer prefill.

    y ``[B, L, D_model]``; cache: :class:`KDACache` after this rank's block (the sequence's cache on
    the last rank); times: :class:`PhaseTimes` (projections and conv count as prepare, o_proj as output);
    state_sent_bytes / state_received_bytes: the KDA state exchange; halo_sent_bytes /
    halo_received_bytes: the conv halo.
    """

    y: torch.Tensor
    cache: KDACache
    times: PhaseTimes
    state_sent_bytes: int
    state_received_bytes: int
    halo_sent_bytes: int
    halo_received_bytes: int


def fold_halo(tails: list[torch.Tensor], block_lengths: list[int], rank: int) -> torch.Tensor:
    """Conv state ``[B, D, W-1]`` before block ``rank`` from the gathered tails (see module doc)."""
    conv = tails[0]
    width = conv.shape[-1]
    for p in range(1, rank):
        n = min(block_lengths[p], width)
        conv = torch.cat([conv, tails[p][..., width - n:]], dim=-1)[..., -width:]  # [B, D, W-1]
    return conv


def kcp_layer_prefill(layer: KDALayer, x: torch.Tensor, cache: KDACache | None = None, *,
                      block_lengths: list[int], variant: str = "allgather", halo: bool = True,
                      chunk_size: int = 64, piece_tokens: int | None = None, comm: Comm | None = None
                      ) -> KCPLayerOutput:
    """Prefill this rank's block of a KDA layer; equal to ``layer(x_full, cache)`` up to rounding.

    Args:
        layer: the same weights on every rank; x ``[B, L, D_model]`` fp32, this rank's tokens;
        cache: the cache before the sequence, rank 0 only (None = empty);
        block_lengths: every rank's token count (all ranks know the split, like fla's cu_seqlens);
        variant: "allgather" or "ring" (state exchange; the halo is always one all-gather);
        halo: False drops the conv halo (wrong on purpose; the tests show the error it causes);
        chunk_size, piece_tokens: as :func:`serve.parallel.kcp.kcp_kda`.

    Raises:
        ValueError: bad shapes, a cache on a rank other than 0, or block_lengths that do not match.
    """
    d = layer.cfg.hidden_size
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != d or x.dtype != torch.float32:
        got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a float32 tensor [B, L, D] with D = {d}, got {got}")
    comm = comm or Comm()
    r, W = comm.rank, comm.world_size
    if len(block_lengths) != W or block_lengths[r] != x.shape[1]:
        raise ValueError(f"block_lengths must list {W} token counts with entry {r} = {x.shape[1]} "
                         f"(this rank's tokens), got {block_lengths}")
    if cache is not None and r != 0:
        raise ValueError(f"cache seeds rank 0 only; got it on rank {r}")
    clock = PhaseClock()
    with clock("prepare"):
        raw, g, beta, out_gate = layer.project(x)                               # raw [B, L, D]
        start = cache.conv if cache is not None else layer.empty_cache(x.shape[0]).conv  # [B, D, W-1]
        width = start.shape[-1]
        tail = torch.cat([start, raw.transpose(1, 2)], dim=-1)[..., -width:]    # [B, D, W-1]
    sent0, recv0 = comm.sent_bytes, comm.received_bytes
    conv = start
    if halo and W > 1:
        with clock("exchange"):
            tails = comm.all_gather(tail)
        with clock("fold"):
            if r > 0:
                conv = fold_halo(tails, block_lengths, r)
    halo_sent, halo_recv = comm.sent_bytes - sent0, comm.received_bytes - recv0
    with clock("prepare"):
        q, k, v, new_conv = layer.activate(raw, conv)
    out = kcp_kda(q, k, v, g, beta, cache.recurrent if cache is not None else None,
                  variant=variant, chunk_size=chunk_size, piece_tokens=piece_tokens, comm=comm)
    with clock("output"):
        y = layer.output(out.o, out_gate)
    times = PhaseTimes(*(a + b for a, b in zip(clock.times(), out.times)))
    return KCPLayerOutput(y, KDACache(out.final_state, new_conv), times, out.sent_bytes, out.received_bytes,
                          halo_sent, halo_recv)


def halo_bytes(batch: int, conv_dim: int, conv_kernel: int, world_size: int, elem_bytes: int = 4) -> tuple[int, int]:
    """(sent, received) halo bytes per rank: ``B D (W-1) s`` and ``(world - 1)`` times that; 0 for one rank."""
    if world_size == 1:
        return 0, 0
    tail = batch * conv_dim * (conv_kernel - 1) * elem_bytes
    return tail, (world_size - 1) * tail
