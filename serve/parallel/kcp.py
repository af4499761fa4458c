"""KDA context parallel (KCP): one long prompt split across real ``torch.distributed`` ranks.

Each rank holds a contiguous block of tokens (rank order = token order). Every KDA step is affine in
the state, so a block collapses to a summary ``(M, S_ext)`` (:mod:`serve.parallel.summary`). Two
exchange variants, run by :func:`kcp_kda` on every rank:

- ``allgather`` (fla's KCP, LASP-2): every rank summarises its block, the summaries are all-gathered
  (one collective; payload ``B H K (K + V) s`` bytes per rank), each rank folds its predecessors'
  summaries into its true initial state, then runs the ordinary chunk scan and outputs.
- ``ring`` (LASP-1 style): rank r waits for rank r - 1's final state, scans its block from it, sends
  its own final state on (``B H K V s`` bytes per hop) and then computes its outputs: W - 1 serial hops.

An initial state (a prefix-cache hit) seeds rank 0, which folds it into what it sends. Outputs and
final state equal single-rank :func:`kda_core.chunk.kda_chunk` up to rounding; the bytes exchanged do
not depend on the sequence length. Sources: fla ``fla/ops/cp/KCP.md``; SGLang PR #34059; LASP-2
(arXiv:2502.07563); LASP-1 (arXiv:2404.02882).

Run it: ``python -m serve.parallel --seq-len 65536 --world-size 2`` (starts local ranks) or
``torchrun --nproc-per-node 2 -m serve.parallel --seq-len 65536`` (one process per rank, any
number of machines). The in-app runner is :func:`serve.parallel.run.run_kcp`.
"""
from __future__ import annotations

from functools import reduce
from itertools import accumulate
from typing import NamedTuple

import torch

from kda_core.chunk import kda_chunk_outputs, kda_chunk_prepare, kda_chunk_states
from serve.errors import check_choice, check_int
from serve.parallel.comm import Comm, PhaseClock, PhaseTimes
from serve.parallel.summary import BlockSummary, apply_summary, compose, fold_state, summary_from_prep

VARIANTS = ("allgather", "ring")


class KCPOutput(NamedTuple):
    """What :func:`kcp_kda` returns on one rank.

    o: ``[B, L, H, V]`` outputs of this rank's L tokens; final_state: ``[B, H, K, V]`` the true state
    after this rank's block (after the whole sequence on the last rank); times: :class:`PhaseTimes`;
    sent_bytes / received_bytes: bytes of the tensors this call passed to / got from collectives.
    """

    o: torch.Tensor
    final_state: torch.Tensor
    times: PhaseTimes
    sent_bytes: int
    received_bytes: int


def check_variant(variant: str) -> None:
    check_choice("variant", variant, VARIANTS)


def piece_bounds(num_tokens: int, piece_tokens: int | None, chunk_size: int) -> list[tuple[int, int]]:
    """Half-open token ranges ``[start, end)`` of the pieces a block is processed in: one piece when
    ``piece_tokens`` is None, else pieces of ``piece_tokens`` (a positive multiple of ``chunk_size``,
    so no chunk straddles two pieces) and a shorter last one. Raises ValueError otherwise."""
    if piece_tokens is None:
        return [(0, num_tokens)]
    if not isinstance(piece_tokens, int) or piece_tokens <= 0 or piece_tokens % chunk_size:
        raise ValueError(f"piece_tokens must be None or a positive multiple of chunk_size = {chunk_size}, "
                         f"got {piece_tokens!r}")
    return [(s, min(s + piece_tokens, num_tokens)) for s in range(0, num_tokens, piece_tokens)]


def kcp_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            initial_state: torch.Tensor | None = None, *, variant: str = "allgather", chunk_size: int = 64,
            piece_tokens: int | None = None, comm: Comm | None = None) -> KCPOutput:
    """KDA over this rank's block, exact across ranks. Call it on every rank of the default group.

    Args:
        q, k ``[B, L, H, K]``; v ``[B, L, H, V]``; g ``[B, L, H, K]``; beta ``[B, L, H]``: this rank's
        tokens (rank r holds the r-th block of the sequence); initial_state ``[B, H, K, V]``: state
        before the sequence, given on rank 0 only (None = zeros); variant: "allgather" or "ring";
        chunk_size: C; piece_tokens: None runs the block's chunk kernel in one piece (one rank is then
        exactly ``kda_chunk``); a multiple of C processes the block in pieces of that many tokens,
        carrying the state (same maths, smaller working set: on this CPU the whole-block intra-chunk
        step costs ~2-3x more per token at 65K tokens than in 4K pieces);
        comm: the rank's :class:`Comm` (default: a new one on the default group).

    Returns:
        :class:`KCPOutput`.

    Raises:
        ValueError: bad shapes, variant or piece_tokens, or an initial_state on a rank other than 0.
    """
    check_variant(variant)
    comm = comm or Comm()
    r, W = comm.rank, comm.world_size
    if initial_state is not None and r != 0:
        raise ValueError(f"initial_state seeds rank 0 only (it is folded into what rank 0 sends); got it on rank {r}")
    pieces = piece_bounds(q.shape[1], piece_tokens, chunk_size)
    sent0, recv0 = comm.sent_bytes, comm.received_bytes
    clock = PhaseClock()
    with clock("prepare"):
        preps = [kda_chunk_prepare(*(t[:, s:e] for t in (q, k, v, g, beta)), chunk_size=chunk_size) for s, e in pieces]
    B, H, _, _, K = preps[0].w.shape
    V = preps[0].u.shape[-1]
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(f"initial_state must have shape [B, H, K, V] = {(B, H, K, V)}, got {tuple(initial_state.shape)}")
    S_in = initial_state
    send = None
    if W > 1 and variant == "allgather":
        with clock("summary"):
            summ = reduce(compose, map(summary_from_prep, preps))     # the pieces' summaries, in order
            if initial_state is not None:          # rank 0 sends the state after its block, seeded
                summ = BlockSummary(summ.M, apply_summary(summ, initial_state))
        with clock("exchange"):
            slots = comm.all_gather(torch.cat([summ.M, summ.S_ext], dim=-1))  # W x [B, H, K, K + V]
        with clock("fold"):
            if r > 0:
                S_in = fold_state([BlockSummary(s[..., :K], s[..., K:]) for s in slots[:r]])
    elif W > 1 and r > 0:                          # ring: wait for the predecessor's final state
        with clock("exchange"):
            S_in = comm.recv(preps[0].u.new_empty(B, H, K, V), src=r - 1)
    states = []
    with clock("scan"):
        for prep in preps:
            states.append(kda_chunk_states(prep, S_in if not states else states[-1].final_state))
    final_state = states[-1].final_state
    if W > 1 and variant == "ring" and r < W - 1:
        with clock("exchange"):
            send = comm.isend(final_state, dst=r + 1)
    with clock("output"):
        outs = [kda_chunk_outputs(prep, st) for prep, st in zip(preps, states)]
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)           # [B, L, H, V]
    if send is not None:
        with clock("exchange"):
            send.wait()
    return KCPOutput(o, final_state, clock.times(), comm.sent_bytes - sent0, comm.received_bytes - recv0)


def exchange_bytes(batch: int, num_heads: int, head_k_dim: int, head_v_dim: int, world_size: int,
                   variant: str, rank: int, elem_bytes: int = 4) -> tuple[int, int]:
    """(sent, received) bytes of :func:`kcp_kda` on ``rank`` (formula; tests check it equals the
    count). allgather: sent ``B H K (K + V) s``, received ``(W - 1)`` times that; ring: ``B H K V s``
    sent by ranks < W - 1 and received by ranks > 0. Zero for W = 1. Independent of T."""
    check_variant(variant)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if world_size == 1:
        return 0, 0
    if variant == "allgather":
        payload = batch * num_heads * head_k_dim * (head_k_dim + head_v_dim) * elem_bytes  # M | S_ext
        return payload, (world_size - 1) * payload
    state = batch * num_heads * head_k_dim * head_v_dim * elem_bytes                     # S
    return (state if rank < world_size - 1 else 0), (state if rank > 0 else 0)


def block_bounds(seq_len: int, world_size: int) -> list[tuple[int, int]]:
    """Half-open token range ``[start, end)`` of each rank: contiguous, sizes differ by at most 1
    (the first ``T mod W`` ranks get one more token). Raises ValueError if ``T < W``."""
    check_int("world_size", world_size)
    if not isinstance(seq_len, int) or seq_len < world_size:
        raise ValueError(f"seq_len must be an int >= world_size = {world_size} (every rank needs a token), got {seq_len!r}")
    base, extra = divmod(seq_len, world_size)
    ends = list(accumulate(base + (r < extra) for r in range(world_size)))
    return list(zip([0, *ends[:-1]], ends))
