"""Numbers behind page 10: a measured KCP run as flat rows, a projection to more ranks built from the
measured per-phase costs, and bytes per rank vs context for KCP against an MLA all-gather;
:func:`kcp_experiment` returns all of them for the page in one call (:class:`KcpExperiment`).

Projection model (clearly a model, not a measurement): with N ranks and blocks of ``L = ceil(T / N)``
tokens, per-token costs ``c_prepare, c_summary, c_scan, c_output`` (ms/token, measured) and a fold cost
``c_fold`` per predecessor (ms, measured), a link of ``bandwidth_gbps`` GB/s (1 GB = 1e9 bytes) and no
latency term:

- allgather: ``L (c_prepare + c_summary + c_scan + c_output) + (N - 1) c_fold + (N - 1) P / bw``,
  P = ``B H K (K + V) 4`` bytes (each rank receives N - 1 payloads);
- ring: ``L c_prepare + N L c_scan + (N - 1) S / bw + L c_output``, S = ``B H K V 4`` bytes (each
  hop waits for the previous rank's scan).

It assumes one free core per rank; the measured run on this machine may oversubscribe its cores.

Fair baselines: every rank runs one torch thread, so the speedup is taken against one rank with one
thread (the same threads per rank) and, on request, against one rank at one thread and at every core of
the host timed interleaved (:func:`one_rank_baselines`). The speedup shown is against the FASTEST
one-rank configuration measured (:func:`speedup_vs_best`): a one-rank run with more threads than free
cores is oversubscribed, and dividing by it would inflate the ratio. Every time is the median of :data:`REPEATS` timed repeats after a warm-up
(inside the ranks: :class:`serve.parallel.run.KCPConfig` ``repeats``), with the spread of the per-repeat
totals (:class:`lab.timing.Timing`); :func:`phase_gap` sets the slowest rank's measured phases against
what the one-rank per-token costs predict for its block, which is where measured and projected differ.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import pandas as pd
import torch

from kda_core.chunk import kda_chunk
from kda_core.config import PRESETS, ModelConfig, mla_kv_bytes_per_token
from lab.timing import Conditions, Timing, conditions, measure, summarize
from serve.errors import check_int, check_positive
from serve.parallel.comm import PHASES
from serve.parallel.halo import halo_bytes
from serve.parallel.host import host_limits
from serve.parallel.inputs import initial_state, kda_inputs
from serve.parallel.kcp import block_bounds, check_variant, exchange_bytes
from serve.parallel.memory import FORK_OVERHEAD_BYTES, rank_bytes
from serve.parallel.run import KCPConfig, KCPRun, run_kcp

REPEATS = 5          # timed repeats of every run on the page (after a warm-up)


class RankRow(NamedTuple):
    """One rank of a measured run (times in ms, bytes in bytes, errors as max |delta|, NaN if unchecked)."""

    rank: int
    start: int
    end: int
    prepare_ms: float
    summary_ms: float
    exchange_ms: float
    fold_ms: float
    scan_ms: float
    output_ms: float
    total_ms: float
    sent_bytes: int
    received_bytes: int
    max_abs_err_o: float
    max_abs_err_state: float


def rank_rows(run: KCPRun) -> list[RankRow]:
    """Flatten a run's per-rank results (errors as the ranks measured them, NaN if unchecked)."""
    return [RankRow(r.rank, r.start, r.end, *r.times, r.total_ms, r.sent_bytes, r.received_bytes,
                    r.max_abs_err_o, r.max_abs_err_state) for r in run.ranks]


def single_rank(cfg: KCPConfig) -> KCPRun:
    """The one-rank run of ``cfg`` with its outputs: the baseline time and the reference outputs (one
    rank runs exactly :func:`kda_core.chunk.kda_chunk`, bitwise; tests/serve/parallel/test_kcp.py).

    Raises:
        ValueError: if ``cfg.world_size`` is not 1.
    """
    if cfg.world_size != 1:
        raise ValueError(f"single_rank needs world_size = 1, got {cfg.world_size}")
    return run_kcp(dataclasses.replace(cfg, return_outputs=True, check=False))


def compare_with(cfg: KCPConfig, reference: KCPRun, with_run: bool = False):
    """Run ``cfg`` and measure every rank's max |delta| against the one-rank ``reference`` run of the
    same inputs: outputs of its block, and (last rank) the final state; NaN for the states of other
    ranks (their block ends are not in the reference). No reference is recomputed inside the ranks.

    Raises:
        ValueError: if ``reference`` is not a one-rank run with outputs of the same inputs.
    """
    ref = reference.config
    same = ("seq_len", "batch", "num_heads", "head_k_dim", "head_v_dim", "level", "with_initial_state",
            "hidden_size", "dtype", "chunk_size", "seed")
    if ref.world_size != 1 or reference.ranks[0].o is None or any(getattr(ref, f) != getattr(cfg, f) for f in same):
        raise ValueError("reference must be single_rank() of a config with the same inputs "
                         f"({', '.join(same)})")
    run = run_kcp(dataclasses.replace(cfg, return_outputs=True, check=False))
    o_ref, s_ref = reference.ranks[0].o, reference.ranks[0].final_state
    rows = []
    for row, r in zip(rank_rows(run), run.ranks):
        err_o = float((r.o.double() - o_ref[:, r.start:r.end].double()).abs().max())
        err_s = float((r.final_state.double() - s_ref.double()).abs().max()) if r.rank == cfg.world_size - 1 \
            else float("nan")
        rows.append(row._replace(max_abs_err_o=err_o, max_abs_err_state=err_s))
    return (rows, run) if with_run else rows


class PhaseCosts(NamedTuple):
    """Unit costs measured on this CPU: ms per token per phase, and ms per predecessor for the fold."""

    prepare_ms_per_token: float
    summary_ms_per_token: float
    scan_ms_per_token: float
    output_ms_per_token: float
    fold_ms_per_rank: float


def phase_costs(single: list[RankRow], multi: list[RankRow]) -> PhaseCosts:
    """Prepare, scan and output from the one-rank run; summary and fold from a run with >= 2 ranks.

    Raises:
        ValueError: if ``single`` is not a one-rank run or ``multi`` has fewer than 2 ranks.
    """
    if len(single) != 1:
        raise ValueError(f"single must be a one-rank run, got {len(single)} ranks")
    if len(multi) < 2:
        raise ValueError(f"multi must be a run with >= 2 ranks (the summary and fold costs), got {len(multi)}")
    one = single[0]
    T = one.end - one.start
    tokens = sum(r.end - r.start for r in multi)
    return PhaseCosts(one.prepare_ms / T, sum(r.summary_ms for r in multi) / tokens, one.scan_ms / T,
                      one.output_ms / T, max(r.fold_ms / r.rank for r in multi[1:]))


class Projection(NamedTuple):
    """Projected run time on ``world_size`` ranks (ms): compute (incl. fold) and transfer, and the
    speedup vs the measured one-rank time."""

    world_size: int
    compute_ms: float
    transfer_ms: float
    total_ms: float
    speedup: float


def project(costs: PhaseCosts, single_ms: float, seq_len: int, world_sizes: list[int], variant: str,
            batch: int, num_heads: int, head_k_dim: int, head_v_dim: int, bandwidth_gbps: float) -> list[Projection]:
    """The model in the module doc for each N in ``world_sizes``; N = 1 is the measured ``single_ms``.

    Raises:
        ValueError: bad variant, bandwidth <= 0, or N larger than T.
    """
    check_variant(variant)
    check_positive("bandwidth_gbps", bandwidth_gbps)
    out = []
    for n in world_sizes:
        block_bounds(seq_len, n)
        if n == 1:
            out.append(Projection(1, single_ms, 0.0, single_ms, 1.0))
            continue
        L = math.ceil(seq_len / n)
        sent, _ = exchange_bytes(batch, num_heads, head_k_dim, head_v_dim, n, variant, 0)
        hop_ms = sent / (bandwidth_gbps * 1e9) * 1e3                   # one payload over the link
        if variant == "allgather":
            compute = L * (costs.prepare_ms_per_token + costs.summary_ms_per_token + costs.scan_ms_per_token
                           + costs.output_ms_per_token) + (n - 1) * costs.fold_ms_per_rank
        else:
            compute = L * (costs.prepare_ms_per_token + n * costs.scan_ms_per_token + costs.output_ms_per_token)
        total = compute + (n - 1) * hop_ms
        out.append(Projection(n, compute, (n - 1) * hop_ms, total, single_ms / total))
    return out


class BytesRow(NamedTuple):
    """Bytes one rank receives for one prompt of ``num_tokens`` (the rank that receives most), whole model:
    kcp_bytes: KDA layers (state summaries + conv halo, fp32 as this code sends them); mla_bytes: MLA
    layers' latent KV all-gather (each rank receives the other ranks' tokens, ``kv_dtype``)."""

    num_tokens: int
    kcp_bytes: int
    mla_bytes: int


def bytes_vs_context(cfg: ModelConfig, seq_lens: list[int], world_size: int, variant: str,
                     kv_dtype: torch.dtype = torch.bfloat16) -> list[BytesRow]:
    """KCP's received bytes per rank (flat in T) against an MLA latent-KV all-gather (grows with T)."""
    H, K, V = cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
    kcp = max(exchange_bytes(1, H, K, V, world_size, variant, r)[1] for r in range(world_size))
    kcp += halo_bytes(1, cfg.conv_dim, cfg.conv_kernel, world_size)[1]
    kv = mla_kv_bytes_per_token(cfg, kv_dtype)                     # whole model, per token
    return [BytesRow(T, cfg.num_kda_layers * kcp, (T - min(e - s for s, e in block_bounds(T, world_size))) * kv)
            for T in seq_lens]                                     # T - smallest block: tokens of the other ranks


def one_rank_baselines(seq_len: int, num_heads: int, head_k_dim: int, head_v_dim: int, with_initial_state: bool,
                       thread_counts: Sequence[int], repeats: int = REPEATS) -> tuple[list[Timing], Conditions]:
    """One rank at each of ``thread_counts`` torch threads: :func:`kda_core.chunk.kda_chunk` on the seeded
    inputs of the :class:`KCPConfig` with these sizes (what its one-rank run computes, bitwise), in this
    process, timed by :func:`lab.timing.measure`: every thread count once per round, in rotating order
    (interleaved), ``repeats`` >= 5 rounds after one warm-up. The thread count is restored after.
    Returns one :class:`Timing` (s) per distinct thread count, labelled ``"1 rank in this process, <n>
    thread(s)"``, and the :class:`Conditions` (``torch_threads``: the largest count).

    Raises ValueError for a bad size (:class:`KCPConfig`), no thread counts, a count < 1 or repeats < 5."""
    if not thread_counts:
        raise ValueError("thread_counts must name at least one thread count")
    for n in thread_counts:
        check_int("threads", n)
    cfg = KCPConfig(seq_len=seq_len, world_size=1, num_heads=num_heads, head_k_dim=head_k_dim,
                    head_v_dim=head_v_dim, with_initial_state=with_initial_state)
    x = kda_inputs(cfg.batch, num_heads, head_k_dim, head_v_dim, 0, seq_len, cfg.seed, cfg.dtype)
    s0 = initial_state(cfg.batch, num_heads, head_k_dim, head_v_dim, cfg.seed, cfg.dtype) \
        if with_initial_state else None

    def case(threads: int):
        def run() -> None:
            torch.set_num_threads(threads)
            kda_chunk(*x, s0, chunk_size=cfg.chunk_size)
        return run

    prev = torch.get_num_threads()
    try:
        with torch.no_grad():
            cases = {f"1 rank in this process, {n} thread(s)": case(n) for n in dict.fromkeys(thread_counts)}
            timings, cond = measure(cases, repeats=repeats, warmup=1)
    finally:
        torch.set_num_threads(prev)
    return timings, cond._replace(torch_threads=max(thread_counts))


class Speedup(NamedTuple):
    """A parallel run against the fastest one-rank baseline measured (ratios of times, ×).

    baseline: the :class:`Timing` of the fastest baseline (smallest median); speedup: its median / the
    parallel run's median; iqr_low / iqr_high: baseline q1 / parallel q3 and baseline q3 / parallel q1
    (the spread of the ratio from the two interquartile ranges); worst / best: min / max pairing of the
    samples (baseline min / parallel max, baseline max / parallel min); baselines: how many were compared."""

    baseline: Timing
    speedup: float
    iqr_low: float
    iqr_high: float
    worst: float
    best: float
    baselines: int


def speedup_vs_best(baselines: Sequence[Timing], parallel: Timing) -> Speedup:
    """The speedup of ``parallel`` against the FASTEST of ``baselines`` (one-rank runs of the same inputs
    measured in the same session), never against a slower one: a one-rank baseline given more threads
    than free cores is oversubscribed and slow, and dividing by it inflates the ratio.

    Raises ValueError for no baselines or a non-positive time."""
    if not baselines:
        raise ValueError("baselines must hold at least one one-rank timing")
    for t in (*baselines, parallel):
        if not t.min_s > 0:
            raise ValueError(f"{t.label}: times must be > 0 s, got min {t.min_s!r}")
    best = min(baselines, key=lambda t: t.median_s)
    p = parallel
    return Speedup(best, best.median_s / p.median_s, best.q1_s / p.q3_s, best.q3_s / p.q1_s, best.min_s / p.max_s,
                   best.max_s / p.min_s, len(baselines))


def run_timing(label: str, run: KCPRun) -> Timing:
    """The spread of a run's wall time over its timed repeats: per repeat, the slowest rank's total (every
    rank starts a repeat after one barrier). Raises ValueError if the ranks report no per-repeat totals."""
    per_rank = [r.total_samples_ms for r in run.ranks]
    if not per_rank or any(len(s) != len(per_rank[0]) or not s for s in per_rank):
        raise ValueError("every rank must report its per-repeat totals")
    return summarize(label, [max(col) / 1e3 for col in zip(*per_rank)])


class PhaseGap(NamedTuple):
    """One phase of the slowest KCP rank: ``measured_ms`` (median over repeats) against ``one_rank_ms``,
    what the one-rank run's per-token cost gives for the rank's ``L`` tokens (0 for summary, exchange and
    fold, which one rank never runs)."""

    phase: str
    one_rank_ms: float
    measured_ms: float


def phase_gap(single: list[RankRow], ranks: list[RankRow]) -> list[PhaseGap]:
    """Where the slowest rank's time goes against the one-rank per-token costs (see :class:`PhaseGap`).

    Raises ValueError if ``single`` is not a one-rank run or ``ranks`` is empty."""
    if len(single) != 1 or not ranks:
        raise ValueError(f"need a one-rank run and >= 1 ranks, got {len(single)} and {len(ranks)}")
    one, slow = single[0], max(ranks, key=lambda r: r.total_ms)
    share = (slow.end - slow.start) / (one.end - one.start)
    return [PhaseGap(p, getattr(one, f"{p}_ms") * share, getattr(slow, f"{p}_ms")) for p in PHASES]


VARIANTS = {"all-gather (one collective)": "allgather", "ring (W−1 serial hops)": "ring"}
# page 10's default: at the 2 ranks a small host offers, the ring's one hop costs less than the all-gather's summary
# (chaining K x K transitions per chunk, several times a scan), so it is the variant the projection favours there
DEFAULT_VARIANT = "ring (W−1 serial hops)"
MODELS = {"Kimi-Linear-48B-A3B": "kimi-linear-48b-a3b", "Kimi K3": "kimi-k3"}  # byte comparison models
BANDWIDTHS_GBPS = (1, 5, 10, 25, 50, 100, 200, 400)  # interconnect options of the projection (GB/s)
PROJECTED_WORLD_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
BYTES_CONTEXTS = tuple(2 ** i for i in range(10, 21))  # prompt lengths of the byte comparison (tokens)
TOLERANCE = 1e-5  # max |Δ| allowed vs the one-rank run: fp32 sums taken in another order across ranks
RUN_TIMEOUT_S = 120  # deadline of one multi-process run on the page


@dataclass(frozen=True)
class KcpExperiment:
    """Everything page 10 draws for one measured configuration.

    single / ranks: :class:`RankRow` tuples of the one-rank baseline and of the ``world_size``-rank run
    (errors vs the baseline); worst_error: max |Δ| over outputs and final state (fp32); single_ms /
    slowest_ms / speedup: baseline time, slowest rank, their ratio; bytes: :class:`BytesRow` columns plus
    ``model`` for every :data:`MODELS` value at ``max(world_size, 2)`` ranks (``bytes_world_size``);
    models: the :class:`ModelConfig` of each; formula_sent / formula_received: the exchange bytes of the last
    rank from :func:`serve.parallel.kcp.exchange_bytes` for the measured H, K, V; costs: the measured
    :class:`PhaseCosts` (None with one rank); projection: :class:`Projection` columns plus ``bandwidth_gbps``
    for every :data:`BANDWIDTHS_GBPS` (empty with one rank). single_timing / kcp_timing:
    :class:`lab.timing.Timing` (s) of the one-thread baseline and of the KCP run (per repeat, its slowest
    rank); gap: :class:`PhaseGap` columns of the slowest rank; conditions: when and under which load the
    ranks were timed (``torch_threads`` = threads per rank)."""

    config: KCPConfig
    single: tuple
    ranks: tuple
    worst_error: float
    single_ms: float
    slowest_ms: float
    speedup: float
    bytes: pd.DataFrame
    bytes_world_size: int
    models: dict
    formula_sent: int
    formula_received: int
    costs: PhaseCosts | None
    projection: pd.DataFrame
    single_timing: Timing
    kcp_timing: Timing
    gap: pd.DataFrame
    conditions: Conditions
    phases: tuple = PHASES
    tolerance: float = TOLERANCE


def kcp_experiment(seq_len: int, world_size: int, num_heads: int, head_k_dim: int, head_v_dim: int,
                   variant: str, with_initial_state: bool, start_method: str = "forkserver",
                   timeout_s: float = RUN_TIMEOUT_S, repeats: int = REPEATS) -> KcpExperiment:
    """Run the one-rank baseline and the ``world_size``-rank run of the same seeded inputs (fresh processes,
    one thread each, ``repeats`` timed repeats after a warm-up), compare them, and add the byte comparison,
    the projection (see the module doc; its inputs are the medians of the repeats) and the phase gap. The
    multi-thread baselines are a separate call (:func:`one_rank_baselines`): with several threads on a shared
    host it can take seconds, so page 10 runs it on request.

    Raises: ValueError for a bad config or variant (:class:`KCPConfig`); RuntimeError if a rank fails or
    the run passes ``timeout_s``."""
    cfg = KCPConfig(seq_len=seq_len, world_size=world_size, num_heads=num_heads, head_k_dim=head_k_dim,
                    head_v_dim=head_v_dim, variant=variant, with_initial_state=with_initial_state,
                    start_method=start_method, timeout_s=timeout_s, repeats=repeats)
    cond = conditions(repeats, 1)._replace(torch_threads=cfg.threads_per_rank)
    ref = single_rank(dataclasses.replace(cfg, world_size=1, variant="allgather"))
    single = rank_rows(ref)
    ranks, kcp = compare_with(cfg, ref, with_run=True)
    single_timing = run_timing("1 rank, 1 thread", ref)
    kcp_timing = run_timing(f"{world_size} ranks, 1 thread each", kcp)
    worst = max(v for r in ranks for v in (r.max_abs_err_o, r.max_abs_err_state) if not math.isnan(v))
    single_ms, slowest_ms = single[0].total_ms, max(r.total_ms for r in ranks)
    w_bytes = max(world_size, 2)
    bytes_frame = pd.concat([pd.DataFrame(bytes_vs_context(PRESETS[m], list(BYTES_CONTEXTS), w_bytes, variant))
                             .assign(model=m) for m in MODELS.values()], ignore_index=True)
    sent, received = exchange_bytes(1, num_heads, head_k_dim, head_v_dim, world_size, variant, world_size - 1)
    costs, projection = None, pd.DataFrame(columns=[*Projection._fields, "bandwidth_gbps"])
    if world_size >= 2:
        costs = phase_costs(single, ranks)
        ns = [n for n in PROJECTED_WORLD_SIZES if n <= seq_len]
        projection = pd.concat([pd.DataFrame(project(costs, single_ms, seq_len, ns, variant, 1, num_heads, head_k_dim,
                                                     head_v_dim, float(bw))).assign(bandwidth_gbps=bw)
                                for bw in BANDWIDTHS_GBPS], ignore_index=True)
    return KcpExperiment(cfg, tuple(single), tuple(ranks), worst, single_ms, slowest_ms, single_ms / slowest_ms,
                         bytes_frame, w_bytes, {m: PRESETS[m] for m in MODELS.values()}, sent, received, costs,
                         projection, single_timing, kcp_timing, pd.DataFrame(phase_gap(single, ranks)), cond)


SERVER_RESERVE_MIB = 500   # the app's server after a tour of every page (python -m bench.app) stays below this


class KcpLimits(NamedTuple):
    """What page 10 may offer on this host: ``cores``, ``memory_bytes`` and where that figure came from
    (``memory_source``: cgroup limit, ``KDA_LAB_MEMORY_MIB`` or MemAvailable), ``max_world`` (one rank per
    core, at most 4) and ``seq_options`` (the T whose estimated rank peak at H = 4, K = V = 128 fits in what
    is left after ``SERVER_RESERVE_MIB`` for the server)."""

    cores: int
    memory_bytes: int
    memory_source: str
    max_world: int
    seq_options: tuple[int, ...]


def kcp_limits() -> KcpLimits:
    """The host limits of page 10 (:func:`serve.parallel.host.host_limits`,
    :func:`serve.parallel.memory.rank_bytes` of a forked rank). Raises ValueError for a malformed ``KDA_LAB_MEMORY_MIB``."""
    limits = host_limits()
    budget = limits.memory_bytes - SERVER_RESERVE_MIB * 2 ** 20      # what the ranks may add to the server
    seq = tuple(t for t in (512, 1024, 2048, 4096, 8192)     # one forked fp32 rank, B = 1, C = 64, whole block
                if rank_bytes(t, 1, 1, 4, 128, 128, 4, 64, None, base_bytes=FORK_OVERHEAD_BYTES) <= budget) or (512,)
    return KcpLimits(limits.cores, limits.memory_bytes, limits.memory_source, min(4, limits.cores), seq)

