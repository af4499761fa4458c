"""Collectives of one rank that count the bytes of the tensors they pass, and the phase clock.

Byte convention (per rank): ``sent_bytes`` = bytes of the tensors this rank hands to a collective
(its all-gather contribution, the state it sends); ``received_bytes`` = bytes of the tensors it gets
from other ranks (the W - 1 other all-gather slots, the state it receives). Counted from the actual
tensors, not from a formula; gloo's wire traffic can differ (a ring all-gather relays payloads).
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.distributed as dist

PHASES = ("prepare", "summary", "exchange", "fold", "scan", "output")


class PhaseTimes(NamedTuple):
    """Wall time of each phase on one rank, in ms (perf_counter).

    prepare: intra-chunk WY work (shared by the summary and the local chunk run); summary: chaining
    ``(M, S_ext)``; exchange: the collective or the send/receive, including waiting for peers; fold:
    predecessors' summaries -> true initial state; scan: the local chunk-state scan; output: outputs.
    """

    prepare_ms: float = 0.0
    summary_ms: float = 0.0
    exchange_ms: float = 0.0
    fold_ms: float = 0.0
    scan_ms: float = 0.0
    output_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return float(sum(self))


class PhaseClock:
    """Accumulates wall time per phase: ``with clock("scan"): ...``."""

    def __init__(self):
        self.ms = dict.fromkeys(PHASES, 0.0)
        self._phase = None

    def __call__(self, phase: str) -> PhaseClock:
        if phase not in self.ms:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self._phase = phase
        return self

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.ms[self._phase] += (time.perf_counter() - self._t0) * 1e3
        return False

    def times(self) -> PhaseTimes:
        return PhaseTimes(*(self.ms[p] for p in PHASES))


class Comm:
    """The default process group seen from one rank (rank 0 of 1 when torch.distributed is not
    initialised), with byte counters. ``device``: where payloads are staged for the backend
    ("cpu" for gloo, the rank's GPU for nccl); results always come back on the CPU."""

    def __init__(self, device: str = "cpu"):
        self.initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.initialized else 0
        self.world_size = dist.get_world_size() if self.initialized else 1
        self.device = device
        self.sent_bytes = 0
        self.received_bytes = 0

    def reset(self) -> None:
        self.sent_bytes = self.received_bytes = 0

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on all ranks), index = rank."""
        if self.world_size == 1:
            return [tensor]
        t = tensor.contiguous().to(self.device)
        slots = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(slots, t)
        self.sent_bytes += t.nbytes
        self.received_bytes += sum(s.nbytes for i, s in enumerate(slots) if i != self.rank)
        return [s.cpu() for s in slots]

    def isend(self, tensor: torch.Tensor, dst: int):
        """Start sending ``tensor`` to rank ``dst``; returns a work handle (call ``.wait()``)."""
        t = tensor.contiguous().to(self.device)
        self.sent_bytes += t.nbytes
        return dist.isend(t, dst)

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        """Receive a tensor shaped and typed like ``like`` from rank ``src``."""
        buf = torch.empty_like(like, device=self.device)
        dist.recv(buf, src)
        self.received_bytes += buf.nbytes
        return buf.cpu()

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()
