"""Live measurements of the page pool on this CPU (``bench/pool.py``, pages 05 and 06).

- Page alloc + free throughput of :class:`PagePool` in single-page and batched calls, against a naive
  baseline in the same run: :class:`NaiveListPool`, a Python list free list that pops the head one
  page at a time and keeps a dict of metadata per page.
- Per-call latency samples (ns) of ``alloc`` and ``decref`` -- p50 vs p99 is the jitter -- and
  :func:`latency_histogram`, their log-spaced histogram (a linear-bin histogram drawn on a log axis
  loses its first bin, which starts at 0 ns, i.e. most of the data).
- Reading a request's MLA latents the way the engine does (:func:`serve.memory.pages.read_kv`: one
  index over the page table) against a contiguous copy (``copy_``, the floor for moving those bytes)
  and a naive ``torch.cat`` of per-token tensors, each into a buffer allocated and written before the
  timing (:func:`gather_cases`: a new >= 1 MiB tensor per call would time the allocator's page faults,
  not the copy); plus absorbed decode attention (:func:`kda_core.layer.latent_attention`) over
  contiguous latents vs read-then-attend.

Every timing goes through :func:`lab.timing.measure`: a warm-up, then ``repeats`` interleaved rounds in a
rotating order; times are medians, ratios are the ratio of two medians measured in the same call, and their
spread is the interquartile range of the per-round ratio (both contenders ran in the same round). Torch ops
run single-threaded during a measurement (:func:`one_thread`): on a shared 2-core machine a two-thread copy
waits for a descheduled worker (8 ms stalls) and the figure would measure the scheduler, not the copy.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from kda_core.config import PRESETS
from kda_core.layer import latent_attention
from lab.threads import one_thread
from lab.timing import Timing, measure
from serve.errors import check_int
from serve.memory.layout import CacheLayout
from serve.memory.pages import read_kv, write_kv
from serve.memory.pool import PageKind, PagePool


class NaiveListPool:
    """Naive reference: a Python list free list, one page per operation, metadata in a dict."""

    def __init__(self, num_pages: int):
        self.free_list = list(range(num_pages))
        self.meta: dict[int, tuple] = {}

    def alloc(self, kind: PageKind, n: int, owner) -> list[int]:
        if n > len(self.free_list):
            raise RuntimeError(f"naive pool exhausted: need {n}, {len(self.free_list)} free")
        pages = []
        for _ in range(n):
            p = self.free_list.pop(0)
            self.meta[p] = (kind, owner, 1)
            pages.append(p)
        return pages

    def decref(self, pages: list[int], owner) -> None:
        for p in pages:
            kind, own, ref = self.meta[p]
            if own != owner:
                raise ValueError(f"page {p} is not owned by {owner!r}")
            del self.meta[p]
            self.free_list.append(p)


class RatioSpread(NamedTuple):
    """``num`` / ``den`` of two timings of one :func:`lab.timing.measure` call: ``ratio`` of their medians,
    ``q1`` / ``q3`` the quartiles of the per-round ratio (sample r of each ran in round r)."""

    ratio: float
    q1: float
    q3: float


def ratio_spread(num: Timing, den: Timing) -> RatioSpread:
    """The :class:`RatioSpread` of ``num`` over ``den``. Raises ValueError for different sample counts."""
    if len(num.samples_s) != len(den.samples_s):
        raise ValueError(f"num and den must have one sample per round each, got {len(num.samples_s)} "
                         f"and {len(den.samples_s)}")
    q1, q3 = np.percentile(np.asarray(num.samples_s) / np.asarray(den.samples_s), [25, 75])
    return RatioSpread(num.median_s / den.median_s, float(q1), float(q3))


class Throughput(NamedTuple):
    """Page alloc + free operations per second (one op = one page allocated and freed again)."""

    batch_pages: int
    pool_ops_s: float
    naive_ops_s: float

    @property
    def speedup(self) -> float:
        """pool_ops_s / naive_ops_s (> 1: the pool is faster)."""
        return self.pool_ops_s / self.naive_ops_s


def alloc_free_throughput(batch_pages: int, num_pages: int = 4096, occupied: float = 0.5,
                          loops: int = 200, repeats: int = 5) -> Throughput:
    """Alloc ``batch_pages`` pages then free them, ``loops`` times, on a pool ``occupied`` full.

    Returns a :class:`Throughput` for :class:`PagePool` and :class:`NaiveListPool` (median of ``repeats``
    interleaved rounds after a warm-up, :func:`lab.timing.measure`). Raises ValueError if the batch does
    not fit the free part of the pool or ``repeats`` < :data:`lab.timing.MIN_REPEATS`.
    """
    held = int(num_pages * occupied)
    if not 1 <= batch_pages <= num_pages - held:
        raise ValueError(f"batch_pages must be in [1, {num_pages - held}], got {batch_pages}")
    cases = {}
    for name, pool in (("pool", PagePool(num_pages, 64)), ("naive", NaiveListPool(num_pages))):
        pool.alloc(PageKind.KDA_STATE, held, "background")

        def run(pool=pool):
            for _ in range(loops):
                pool.decref(pool.alloc(PageKind.MLA_KV, batch_pages, "r"), "r")

        cases[name] = run
    pool_t, naive_t = measure(cases, repeats=repeats)[0]
    return Throughput(batch_pages, loops * batch_pages / pool_t.median_s, loops * batch_pages / naive_t.median_s)


def call_latencies_ns(batch_pages: int = 1, samples: int = 2000, num_pages: int = 4096,
                      occupied: float = 0.5, seed: int = 0) -> dict[str, list[int]]:
    """Per-call latency (ns) of ``PagePool.alloc`` and ``decref`` of ``batch_pages`` pages each, on a pool
    ``occupied`` full with a random mix of live requests (seeded). Returns ``{"alloc": [...], "free": [...]}``."""
    pool = PagePool(num_pages, 64)
    gen = torch.Generator().manual_seed(seed)
    pool.alloc(PageKind.KDA_STATE, int(num_pages * occupied), "background")
    out: dict[str, list[int]] = {"alloc": [], "free": []}
    clock = time.perf_counter_ns
    for i in range(samples):
        kind = PageKind.MLA_KV if int(torch.randint(0, 2, (1,), generator=gen)) else PageKind.KDA_STATE
        t0 = clock()
        pages = pool.alloc(kind, batch_pages, i)
        t1 = clock()
        pool.decref(pages, i)
        t2 = clock()
        out["alloc"].append(t1 - t0)
        out["free"].append(t2 - t1)
    return out


class LatencyHistogram(NamedTuple):
    """Log-spaced histogram of per-call latencies, one set of bins shared by every call kind.

    edges_ns: NB + 1 bin edges (ns), ``bins_per_decade`` bins per factor of 10, from at or below the
    smallest sample to at or above the largest; bin i is ``[edges_ns[i], edges_ns[i + 1])``, the last
    one closed. counts: per call kind, NB sample counts. p50_ns / p99_ns: per call kind, the 50th / 99th
    percentile (ns, linear interpolation, as ``numpy.percentile``)."""

    edges_ns: list[float]
    counts: dict[str, list[int]]
    p50_ns: dict[str, float]
    p99_ns: dict[str, float]


def latency_histogram(samples_ns: dict[str, list[int]], bins_per_decade: int = 10) -> LatencyHistogram:
    """Histogram ``{call: [latency_ns, ...]}`` (e.g. :func:`call_latencies_ns` or the page-05 workload)
    on log-spaced bins, so a 1,000x outlier does not squash the bulk into one bin starting at 0 ns.
    Samples of 0 ns (a clock tick coarser than the call) fall in the first bin, whose lower edge is
    then at most 0.5 ns. Raises ValueError on no samples, an empty or negative sample list, or
    ``bins_per_decade`` < 1."""
    check_int("bins_per_decade", bins_per_decade)
    if not samples_ns or any(len(v) == 0 for v in samples_ns.values()):
        raise ValueError(f"samples_ns needs at least one sample per call, got sizes "
                         f"{ {k: len(v) for k, v in samples_ns.items()} }")
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in samples_ns.items()}
    lo = min(float(a.min()) for a in arrays.values())
    hi = max(float(a.max()) for a in arrays.values())
    if lo < 0:
        raise ValueError(f"latencies must be >= 0 ns, got a minimum of {lo}")
    lo, hi = max(lo, 0.5), max(hi, 0.5)                                  # 0 ns samples go to the first bin
    k_lo = int(np.floor(np.log10(lo) * bins_per_decade))                # edge i = 10 ** (i / bins_per_decade)
    k_hi = max(int(np.ceil(np.log10(hi) * bins_per_decade)), k_lo + 1)
    edges = 10.0 ** (np.arange(k_lo, k_hi + 1) / bins_per_decade)        # [NB + 1]
    edges[0], edges[-1] = min(edges[0], lo), max(edges[-1], hi)          # guard against float round-off
    counts = {k: np.histogram(np.maximum(a, lo), edges)[0].tolist() for k, a in arrays.items()}
    pct = {k: np.percentile(a, [50, 99]) for k, a in arrays.items()}
    return LatencyHistogram(edges.tolist(), counts, {k: float(p[0]) for k, p in pct.items()},
                            {k: float(p[1]) for k, p in pct.items()})


GATHER_CASES = ("contiguous", "paged", "naive_cat", "attn_contiguous", "attn_paged")


class GatherTiming(NamedTuple):
    """Microseconds to materialise one MLA layer's latents ``[L, D]`` of one request: the median of the
    interleaved rounds of :func:`gather_timing` per case, and every case's :class:`lab.timing.Timing` (s)."""

    context_tokens: int
    block_size: int
    contiguous_us: float      # buffer.copy_(lat): one copy of the bytes (into a preallocated buffer, as all gathers)
    paged_us: float           # serve.memory.pages.read_kv(out=buffer): one index over the page table
    naive_cat_us: float       # torch.cat(out=buffer) of L per-token [D] tensors
    attn_contiguous_us: float  # latent_attention over the contiguous latents
    attn_paged_us: float      # read_kv + latent_attention
    timings: dict[str, Timing]  # per case in GATHER_CASES: median, quartiles, min / max and samples (s)

    @property
    def gather_ratio(self) -> float:
        """paged_us / contiguous_us (ratio of the medians)."""
        return self.paged_us / self.contiguous_us

    @property
    def attention_ratio(self) -> float:
        """attn_paged_us / attn_contiguous_us (ratio of the medians)."""
        return self.attn_paged_us / self.attn_contiguous_us

    def spread(self, num: str = "paged", den: str = "contiguous") -> RatioSpread:
        """``num`` / ``den`` (case names of :data:`GATHER_CASES`) with the IQR of the per-round ratio."""
        return ratio_spread(self.timings[num], self.timings[den])


def one_mla_layout(block_size: int, latent_dim: int = 576, kv_lora_rank: int = 512) -> CacheLayout:
    """The engine's layout (fp32, multi-page) for one MLA layer of Kimi-Linear's shape with latent width
    ``latent_dim`` = ``kv_lora_rank`` + rope (the model keeps one KDA layer: a layout needs one).
    Raises ValueError for a rope width that is not positive and even."""
    cfg = dataclasses.replace(PRESETS["kimi-linear-48b-a3b"], name="one MLA layer", num_layers=2, mla_layers=(1,),
                              kv_lora_rank=kv_lora_rank, qk_rope_head_dim=latent_dim - kv_lora_rank)
    return CacheLayout.for_policy(cfg, block_size, 1, "multi_page")


class GatherCases(NamedTuple):
    """What :func:`gather_timing` times: ``fns`` one callable per case of :data:`GATHER_CASES`; ``buffers`` the
    preallocated output of each gather case (``contiguous`` ``[1, L, D]``, ``paged`` ``[1, NB * N, D]``,
    ``naive_cat`` ``[L * D]``, ``attn_paged`` ``[1, NB * N, D]``: the latents read before attending), every one
    allocated and written before any timing. Each gather writes into its buffer instead of a new tensor: a new
    tensor of >= 1 MiB is a fresh mmap under the server's threshold (:func:`serve.process_memory.fix_mmap_threshold`),
    and its page faults would dominate the copy being measured."""

    fns: dict[str, Callable[[], torch.Tensor]]
    buffers: dict[str, torch.Tensor]


def gather_cases(context_tokens: int, block_size: int, latent_dim: int = 576, kv_lora_rank: int = 512,
                 num_heads: int = 8, seed: int = 0, scatter: bool = True) -> GatherCases:
    """The :class:`GatherCases` of :func:`gather_timing` over one request's seeded latents ``[1, L, D]`` written into
    a pool through its page table (``scatter``: every other page, as :func:`gather_timing`)."""
    return gather_cases_by_context([context_tokens], block_size, latent_dim, kv_lora_rank, num_heads, seed,
                                   scatter)[0]


def gather_cases_by_context(contexts: Sequence[int], block_size: int, latent_dim: int = 576, kv_lora_rank: int = 512,
                            num_heads: int = 8, seed: int = 0, scatter: bool = True) -> list[GatherCases]:
    """One :class:`GatherCases` per context L in ``contexts``, over the first L tokens of one request of max(L)
    seeded latents written once into a pool through its page table (``scatter``: every other page); the cases
    of every context share the buffers (views of their first elements), allocated and written here."""
    lay = one_mla_layout(block_size, latent_dim, kv_lora_rank)
    gen = torch.Generator().manual_seed(seed)
    top = max(contexts)
    lat_all = torch.randn(1, top, latent_dim, generator=gen)             # [1, L_max, D]
    nb_top = -(-top // block_size)
    pool = PagePool(2 * nb_top if scatter else nb_top, lay.page_bytes)
    if scatter:  # hold every page, release every other one: our blocks land on every other page
        held = pool.alloc(PageKind.MLA_KV, 2 * nb_top, "other")
        pool.decref(held[1::2], "other")
    table = pool.alloc(PageKind.MLA_KV, nb_top, "r")
    write_kv(lay, pool, table, 0, [lat_all])
    q = torch.randn(1, num_heads, latent_dim, generator=gen)
    scale = latent_dim ** -0.5
    flat = {case: torch.full((nb_top * block_size * latent_dim,), float("nan"))   # full(): allocated and written now
            for case in ("contiguous", "paged", "naive_cat", "attn_paged")}

    def cases(L: int) -> GatherCases:
        lat = lat_all[:, :L]                                              # [1, L, D], contiguous
        tokens = lat[0].unbind(0)                                         # L views [D], one per token
        padded = -(-L // block_size) * block_size                         # NB * N
        buf = {"contiguous": flat["contiguous"][: L * latent_dim].view(1, L, latent_dim),        # [1, L, D]
               "paged": flat["paged"][: padded * latent_dim].view(1, padded, latent_dim),        # [1, NB * N, D]
               "naive_cat": flat["naive_cat"][: L * latent_dim],                                  # [L * D]
               "attn_paged": flat["attn_paged"][: padded * latent_dim].view(1, padded, latent_dim)}

        def attn_paged():
            return latent_attention(q, read_kv(lay, pool, table, L, out=buf["attn_paged"])[0], kv_lora_rank, scale)

        fns = {"contiguous": lambda: buf["contiguous"].copy_(lat),
               "paged": lambda: read_kv(lay, pool, table, L, out=buf["paged"])[0],
               "naive_cat": lambda: torch.cat(tokens, out=buf["naive_cat"]),
               "attn_contiguous": lambda: latent_attention(q, lat, kv_lora_rank, scale),
               "attn_paged": attn_paged}
        return GatherCases({case: fns[case] for case in GATHER_CASES}, buf)

    return [cases(L) for L in contexts]


def gather_timing(context_tokens: int, block_size: int, latent_dim: int = 576, kv_lora_rank: int = 512,
                  num_heads: int = 8, repeats: int = 7, seed: int = 0, scatter: bool = True) -> GatherTiming:
    """Time the engine's paged read (:func:`serve.memory.pages.read_kv`) vs a contiguous copy vs a naive
    per-token ``torch.cat`` of ``context_tokens`` latents of width ``latent_dim`` (default Kimi's 512 + 64,
    one MLA layer, :func:`one_mla_layout`) in fp32, and decode attention over them. Every gather writes into
    its own buffer, allocated and written before the timing (:func:`gather_cases`).

    ``scatter=True`` allocates the request's pages interleaved with another request's, so the page
    table is not one consecutive run (the realistic case). Each case runs once untimed, then ``repeats``
    interleaved rounds (:func:`lab.timing.measure`), single-threaded. Raises ValueError on non-positive
    sizes or ``repeats`` < :data:`lab.timing.MIN_REPEATS`.
    """
    return gather_timings([context_tokens], block_size, latent_dim, kv_lora_rank, num_heads, repeats, seed,
                          scatter)[0]


def gather_timings(contexts: Sequence[int], block_size: int, latent_dim: int = 576, kv_lora_rank: int = 512,
                   num_heads: int = 8, repeats: int = 7, seed: int = 0, scatter: bool = True) -> list[GatherTiming]:
    """:func:`gather_timing` at each context of ``contexts`` (in order, each measured on its own), set up once:
    the contexts read the first L tokens of one request of max(L) tokens (:func:`gather_cases_by_context`).
    Raises ValueError as :func:`gather_timing`, or for no contexts."""
    if not len(contexts) or min(contexts) <= 0 or block_size <= 0 or latent_dim <= kv_lora_rank:
        raise ValueError(f"need contexts > 0 (at least one), block_size > 0, latent_dim > kv_lora_rank; got "
                         f"{list(contexts)}, {block_size}, {latent_dim}, {kv_lora_rank}")
    out = []
    with one_thread():   # the set-up too: a two-thread copy of one page stalls for ms on the shared cores
        for L, cases in zip(contexts, gather_cases_by_context(contexts, block_size, latent_dim, kv_lora_rank,
                                                              num_heads, seed, scatter)):
            timings, _ = measure(cases.fns, repeats=repeats)
            out.append(GatherTiming(L, block_size, *(t.median_s * 1e6 for t in timings), {t.label: t for t in timings}))
    return out
