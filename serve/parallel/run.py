"""One KCP run: its configuration, the job every rank executes, and the launcher the app and bench use.

:func:`run_kcp` starts ``world_size`` ranks (:func:`serve.parallel.launch.run_ranks`); each rank makes
its own block of seeded inputs (:mod:`serve.parallel.inputs`), warms up on one chunk (untimed), waits
at a barrier, runs :func:`serve.parallel.kcp.kcp_kda` (or the layer prefill with the conv halo) ``repeats`` times, and
reports per-phase wall times (medians), the bytes it passed to collectives, and, with ``check``, the
max |delta| of its outputs and final state against a single-rank run of its token prefix ``[0, end)``
(computed after the timed runs). Process start-up is not in any timing.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kda_core.chunk import kda_chunk
from kda_core.config import PRESETS
from kda_core.layer import KDACache, KDALayer
from serve.errors import check_choice, check_int
from serve.parallel.comm import Comm, PhaseTimes
from serve.parallel.halo import kcp_layer_prefill
from serve.parallel.inputs import DTYPES, initial_state, kda_inputs, layer_inputs
from serve.parallel.kcp import block_bounds, check_variant, kcp_kda, piece_bounds
from serve.parallel.launch import START_METHODS, check_backend, check_timeout, run_ranks
from serve.parallel.memory import check_rank_memory, rank_bytes

LEVELS = ("kernel", "layer")


@dataclass(frozen=True)
class KCPConfig:
    """A KCP run. Frozen; validated in ``__post_init__``.

    seq_len: T tokens of one prompt; world_size: ranks; batch, num_heads, head_k_dim, head_v_dim:
    B, H, K, V; variant: "allgather" or "ring"; level: "kernel" (kda_chunk inputs) or "layer" (a
    KDALayer with hidden_size, conv halo on unless ``halo=False``); with_initial_state: seed rank 0
    with a non-zero state (a prefix-cache hit; at layer level also a conv state); dtype: "float32" or
    "float64" (kernel only); chunk_size: C; piece_tokens: None (each rank's chunk kernel on its whole
    block) or a multiple of C (the block in pieces, state carried; see :func:`kcp_kda`); seed;
    repeats: timed runs per rank (medians reported); check: compare with a single-rank run; return_outputs: send outputs back to the caller;
    threads_per_rank: torch intra-op threads in each rank; backend: "gloo" | "nccl";
    start_method: "spawn" | "forkserver" | "fork"; timeout_s: deadline of the whole run.
    Raises ValueError for bad fields, or when the ranks on this machine would need more memory than
    it has available (:mod:`serve.parallel.memory`).
    """

    seq_len: int
    world_size: int = 2
    batch: int = 1
    num_heads: int = 4
    head_k_dim: int = 128
    head_v_dim: int = 128
    variant: str = "allgather"
    level: str = "kernel"
    with_initial_state: bool = False
    halo: bool = True
    hidden_size: int = 128
    dtype: str = "float32"
    chunk_size: int = 64
    piece_tokens: int | None = None
    seed: int = 0
    repeats: int = 1
    check: bool = False
    return_outputs: bool = False
    threads_per_rank: int = 1
    backend: str = "gloo"
    start_method: str = "spawn"
    timeout_s: float = 300.0

    def __post_init__(self):
        for name in ("seq_len", "world_size", "batch", "num_heads", "head_k_dim", "head_v_dim", "hidden_size",
                     "chunk_size", "repeats", "threads_per_rank"):
            check_int(name, getattr(self, name))
        block_bounds(self.seq_len, self.world_size)          # T >= world_size
        check_variant(self.variant)
        check_backend(self.backend)
        check_choice("level", self.level, LEVELS)
        check_choice("dtype", self.dtype, list(DTYPES))
        if self.level == "layer" and self.dtype != "float32":
            raise ValueError(f"dtype must be 'float32' at level 'layer' (KDALayer is fp32), got {self.dtype!r}")
        if self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"chunk_size must be a power of two, got {self.chunk_size}")
        piece_bounds(self.seq_len, self.piece_tokens, self.chunk_size)
        check_choice("start_method", self.start_method, START_METHODS)
        check_timeout("timeout_s", self.timeout_s)
        check_rank_memory(self.rank_bytes, self.world_size, self.seq_len)   # before any rank starts

    @property
    def rank_bytes(self) -> int:
        """Upper estimate of the largest rank's memory in bytes (:func:`serve.parallel.memory.rank_bytes`)."""
        return rank_bytes(self.seq_len, self.world_size, self.batch, self.num_heads, self.head_k_dim,
                          self.head_v_dim, self.elem_bytes, self.chunk_size, self.piece_tokens, self.repeats,
                          self.check, self.hidden_size if self.level == "layer" else None)

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """Half-open token range of each rank."""
        return block_bounds(self.seq_len, self.world_size)

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    def layer(self) -> KDALayer:
        """The KDA layer of a layer-level run (same seeded weights in every process)."""
        cfg = dataclasses.replace(PRESETS["demo"], name="kcp-layer", num_heads=self.num_heads,
                                  head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim,
                                  hidden_size=self.hidden_size, seed=self.seed, source="KCP layer-level run")
        return KDALayer(cfg, torch.Generator().manual_seed(self.seed))


class RankResult(NamedTuple):
    """One rank's report.

    rank; start, end: its token range ``[start, end)``; times: per-phase medians over the repeats (ms);
    total_ms: median of the per-repeat totals; sent_bytes / received_bytes: state exchange of one run;
    halo_sent_bytes / halo_received_bytes: conv halo (layer level, else 0); max_abs_err_o /
    max_abs_err_state: max |delta| of outputs / state after the block vs a single-rank run (NaN unless
    check); o: ``[B, L, H, V]`` (kernel) or y ``[B, L, D]`` (layer) and final_state ``[B, H, K, V]``
    (None unless return_outputs); pid: the rank's process id; total_samples_ms: the total of every timed
    repeat, in run order (ms; the spread behind ``total_ms``).
    """

    rank: int
    start: int
    end: int
    times: PhaseTimes
    total_ms: float
    sent_bytes: int
    received_bytes: int
    halo_sent_bytes: int
    halo_received_bytes: int
    max_abs_err_o: float
    max_abs_err_state: float
    o: torch.Tensor | None
    final_state: torch.Tensor | None
    pid: int
    total_samples_ms: tuple[float, ...] = ()


@dataclass(frozen=True)
class KCPRun:
    """A finished run: config, one :class:`RankResult` per rank, and the rank pids (all exited)."""

    config: KCPConfig
    ranks: tuple[RankResult, ...]
    pids: tuple[int, ...]

    @property
    def wall_ms(self) -> float:
        """Time of the run: the slowest rank (all ranks start the clock after one barrier)."""
        return max(r.total_ms for r in self.ranks)

    @property
    def max_abs_err(self) -> float:
        """Largest |delta| vs the single-rank run over all ranks' outputs and states (NaN unless check)."""
        return max(max(r.max_abs_err_o, r.max_abs_err_state) for r in self.ranks)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())


def _kernel_data(cfg: KCPConfig, start: int, end: int, with_state: bool):
    x = kda_inputs(cfg.batch, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim, start, end, cfg.seed, cfg.dtype)
    s0 = initial_state(cfg.batch, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.seed, cfg.dtype) \
        if with_state else None
    return x, s0


def initial_layer_cache(cfg: KCPConfig, layer: KDALayer) -> KDACache:
    """The seeded cache of a layer-level run with ``with_initial_state``: recurrent state and conv state."""
    s0 = initial_state(cfg.batch, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.seed)
    conv = layer_inputs(cfg.batch, layer.cfg.conv_dim, 0, layer.cfg.conv_kernel - 1, cfg.seed + 1).transpose(1, 2)
    return KDACache(s0, conv.contiguous())                                  # conv [B, D, W-1]


def rank_job(rank: int, world_size: int, cfg: KCPConfig) -> RankResult:
    """What every rank runs (under :func:`run_kcp` or torchrun); the process group is already up."""
    if world_size != cfg.world_size:
        raise ValueError(f"config world_size = {cfg.world_size} but the process group has {world_size} ranks")
    device = "cpu"
    if cfg.backend == "nccl":       # compute stays on the CPU (kda_core); payloads go through this rank's GPU
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    comm = Comm(device)
    start, end = cfg.bounds[rank]
    seeded = cfg.with_initial_state and rank == 0
    layer = cfg.layer() if cfg.level == "layer" else None
    s0 = cache = None
    if layer is None:
        x, s0 = _kernel_data(cfg, start, end, seeded)
    else:
        x = layer_inputs(cfg.batch, cfg.hidden_size, start, end, cfg.seed)
        cache = initial_layer_cache(cfg, layer) if seeded else None
    lengths = [e - s for s, e in cfg.bounds]

    def once(block_lengths: list[int]):
        n = block_lengths[rank]
        with torch.no_grad():
            if layer is None:
                return kcp_kda(*(t[:, :n] for t in x), s0, variant=cfg.variant, chunk_size=cfg.chunk_size,
                               piece_tokens=cfg.piece_tokens, comm=comm)
            return kcp_layer_prefill(layer, x[:, :n], cache, block_lengths=block_lengths, variant=cfg.variant,
                                     halo=cfg.halo, chunk_size=cfg.chunk_size, piece_tokens=cfg.piece_tokens,
                                     comm=comm)

    once([min(n, cfg.chunk_size) for n in lengths])   # untimed warm-up on one chunk: first-call costs out
    runs = []
    for _ in range(cfg.repeats):
        comm.barrier()
        comm.reset()
        runs.append(once(lengths))
    last = runs[-1]
    out, state = (last.o, last.final_state) if layer is None else (last.y, last.cache.recurrent)
    err_o = err_s = float("nan")
    if cfg.check:
        with torch.no_grad():
            if layer is None:
                xr, sr = _kernel_data(cfg, 0, end, cfg.with_initial_state)
                ref = kda_chunk(*xr, sr, chunk_size=cfg.chunk_size)
                ref_o, ref_s = ref.o, ref.final_state
            else:
                xr = layer_inputs(cfg.batch, cfg.hidden_size, 0, end, cfg.seed)
                ref_o, ref_cache = layer(xr, initial_layer_cache(cfg, layer) if cfg.with_initial_state else None)
                ref_s = ref_cache.recurrent
        err_o, err_s = _max_err(out, ref_o[:, start:end]), _max_err(state, ref_s)
    times = PhaseTimes(*(statistics.median(col) for col in zip(*(r.times for r in runs))))
    halo = (0, 0) if layer is None else (last.halo_sent_bytes, last.halo_received_bytes)
    sent, recv = (last.sent_bytes, last.received_bytes) if layer is None else \
        (last.state_sent_bytes, last.state_received_bytes)
    keep = cfg.return_outputs
    return RankResult(rank, start, end, times, statistics.median(r.times.total_ms for r in runs), sent, recv,
                      *halo, err_o, err_s, out if keep else None, state if keep else None, os.getpid(),
                      tuple(float(r.times.total_ms) for r in runs))


def run_kcp(cfg: KCPConfig) -> KCPRun:
    """Start ``cfg.world_size`` local ranks, run :func:`rank_job` on each, return the :class:`KCPRun`.

    Raises:
        ValueError: bad config. RuntimeError: a rank failed (names it). TimeoutError: past ``timeout_s``.
    """
    if not isinstance(cfg, KCPConfig):
        raise ValueError(f"cfg must be a KCPConfig, got {type(cfg).__name__}")
    res = run_ranks(rank_job, cfg.world_size, (cfg,), timeout_s=cfg.timeout_s, backend=cfg.backend,
                    start_method=cfg.start_method, threads_per_rank=cfg.threads_per_rank)
    return KCPRun(cfg, tuple(res.results), tuple(res.pids))
