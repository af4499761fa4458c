"""What page 06 shows about MLA paging, computed on the real pool and caches.

- :func:`page_table_demo`: two requests on a pool churned by other requests; B shares A's first
  ``shared_tokens`` tokens by reference count and appends its own (its shared partial block is copied
  on write). Returns both page tables and which pages are shared.
- :func:`fragmentation_vs_block_size`: internal fragmentation (allocated but unwritten token slots in
  each request's last block) and page-table entries, vs block size, for a set of context lengths.
- :func:`prefix_sharing_bytes`: MLA_KV bytes held by N requests that share a prefix through reference
  counts vs the same requests with private copies, measured as pages in use in the pool.
- :func:`gather_grid`: the engine's paged read vs a contiguous copy, measured (:func:`lab.pool_timing.gather_timings`);
  a call of its own, so a page can cache (and re-measure) it apart from the rest.
- :func:`page06`: page 06's one call for everything that is not a timing, as plain data.
Every cache is the engine's: :class:`serve.memory.layout.CacheLayout` of the demo model (2 MLA layers x
(64 + 16) fp32 per token, multi-page policy: a page is one block), bytes moved by
:mod:`serve.memory.pages` through :class:`serve.memory.paged_mla.PagedMLACache`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from kda_core.config import PRESETS
from lab.pool_timing import gather_timings, ratio_spread
from lab.threads import one_thread
from lab.timing import Conditions, conditions, summarize
from serve.memory.layout import CacheLayout
from serve.memory.paged_mla import PagedMLACache
from serve.memory.pool import PageKind, PagePool

DEMO = PRESETS["demo"]
DEMO_LAYERS, DEMO_LATENT = DEMO.num_mla_layers, DEMO.latent_dim
KIMI = PRESETS["kimi-linear-48b-a3b"]


class PageTableDemo(NamedTuple):
    """Page tables (logical block -> physical page) of requests A and B, the pool size, the pages both
    reference (reference count 2), and each page's role: "A", "B", "shared", "other" or "free"."""

    block_size: int
    num_pages: int
    table_a: list[int]
    table_b: list[int]
    shared_pages: list[int]
    tokens_a: int
    tokens_b: int
    page_roles: list[str]


def demo_layout(block_size: int) -> CacheLayout:
    """The demo model's engine layout with one KV block per page (multi-page policy)."""
    return CacheLayout.for_policy(DEMO, block_size, 1, "multi_page")


def page_table_demo(block_size: int, tokens_a: int, shared_tokens: int, tokens_b_own: int, seed: int = 0,
                    churn_requests: int = 12) -> PageTableDemo:
    """Build A (``tokens_a`` tokens) on a pool scattered by ``churn_requests`` seeded short-lived
    requests, fork B from A's first ``shared_tokens`` tokens and append ``tokens_b_own`` tokens to B.

    Raises ValueError unless ``0 <= shared_tokens <= tokens_a`` and sizes are positive.
    """
    for name, value, least in (("block_size", block_size, 1), ("tokens_a", tokens_a, 1),
                               ("tokens_b_own", tokens_b_own, 0), ("shared_tokens", shared_tokens, 0)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if shared_tokens > tokens_a:
        raise ValueError(f"shared_tokens must be <= tokens_a (B shares a prefix of A), got {shared_tokens} > {tokens_a}")
    rng = np.random.default_rng(seed)
    nb = -(-tokens_a // block_size) + -(-(shared_tokens % block_size + tokens_b_own) // block_size) + 1
    lay = demo_layout(block_size)
    pool = PagePool(2 * nb + churn_requests * 4, lay.page_bytes)
    churn = [pool.alloc(PageKind.MLA_KV, int(rng.integers(1, 4)), f"c{i}") for i in range(churn_requests)]
    for i in rng.permutation(churn_requests)[: churn_requests // 2]:  # free half: holes all over the pool
        pool.decref(churn[i], f"c{i}")
    a = PagedMLACache(lay, pool, "A")
    step = max(1, block_size // 2)
    for start in range(0, tokens_a, step):  # grow A while a churn request also grows: interleaved pages
        a.append(torch.zeros(DEMO_LAYERS, min(step, tokens_a - start), DEMO_LATENT))
        if rng.random() < 0.5:
            pool.alloc(PageKind.MLA_KV, 1, "other")
    b = a.fork("B", shared_tokens)
    b.append(torch.ones(DEMO_LAYERS, tokens_b_own, DEMO_LATENT))
    pool.check_integrity()
    shared = sorted(set(a.block_table) & set(b.block_table))
    roles = ["free" if k is PageKind.FREE else "other" for k, _, _ in pool.page_table()]
    for p in a.block_table:
        roles[p] = "A"
    for p in b.block_table:
        roles[p] = "shared" if roles[p] == "A" else "B"
    return PageTableDemo(block_size, pool.num_pages, list(a.block_table), list(b.block_table), shared,
                         a.num_tokens, b.num_tokens, roles)


class Fragmentation(NamedTuple):
    """One block size over a set of requests: mean unused slots per request (tokens), unused share of
    allocated KV bytes, mean page-table entries per request."""

    block_size: int
    mean_unused_tokens: float
    unused_fraction: float
    mean_table_entries: float


def fragmentation_vs_block_size(block_sizes: list[int], context_tokens: list[int]) -> list[Fragmentation]:
    """Internal fragmentation of the last block: ``ceil(L / bs) * bs - L`` slots per request of L tokens.
    Raises ValueError on an empty or non-positive input."""
    if not block_sizes or not context_tokens or min(block_sizes) <= 0 or min(context_tokens) <= 0:
        raise ValueError("block_sizes and context_tokens must be non-empty lists of positive ints")
    L = np.asarray(context_tokens)
    rows = []
    for bs in block_sizes:
        blocks = -(-L // bs)                                              # ceil(L / bs) per request
        unused = blocks * bs - L
        rows.append(Fragmentation(bs, float(unused.mean()), float(unused.sum() / (blocks * bs).sum()),
                                  float(blocks.mean())))
    return rows


class SharingBytes(NamedTuple):
    """N requests of a shared prefix + private tail: KV bytes in the pool with and without sharing."""

    num_requests: int
    shared_bytes: int
    private_bytes: int

    @property
    def saved_bytes(self) -> int:
        return self.private_bytes - self.shared_bytes


def prefix_sharing_bytes(max_requests: int, prefix_tokens: int, unique_tokens: int,
                         block_size: int) -> list[SharingBytes]:
    """For n = 1..max_requests: fork n requests from one prefill of ``prefix_tokens`` tokens, append
    ``unique_tokens`` to each, and count the MLA_KV pages in use (times page bytes); the private figure
    gives each request its own copy of every block. The prefix's own cache is freed after the forks, so
    only requests hold pages. Raises ValueError naming the argument if ``max_requests`` or ``block_size``
    is < 1, a token count is negative, or ``prefix_tokens + unique_tokens`` is 0."""
    for name, value, least in (("max_requests", max_requests, 1), ("block_size", block_size, 1),
                               ("prefix_tokens", prefix_tokens, 0), ("unique_tokens", unique_tokens, 0)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if prefix_tokens + unique_tokens == 0:
        raise ValueError("prefix_tokens + unique_tokens must be >= 1 (each request holds at least one token), "
                         f"got prefix_tokens={prefix_tokens}, unique_tokens={unique_tokens}")
    lay = demo_layout(block_size)
    page_bytes = lay.page_bytes
    per_req = -(-(prefix_tokens + unique_tokens) // block_size)
    pool = PagePool(per_req * max_requests + 1, page_bytes)
    prefix = PagedMLACache(lay, pool, "prefix")
    prefix.append(torch.zeros(DEMO_LAYERS, prefix_tokens, DEMO_LATENT))
    rows, reqs, held = [], [], set()
    tail = torch.ones(DEMO_LAYERS, unique_tokens, DEMO_LATENT)
    for n in range(1, max_requests + 1):
        req = prefix.fork(f"r{n}")
        req.append(tail)
        reqs.append(req)
        held.update(req.block_table)                                     # pages any request references
        rows.append(SharingBytes(n, len(held) * page_bytes, n * per_req * page_bytes))
    for r in [prefix, *reqs]:
        r.free()
    pool.check_integrity()
    return rows


GATHER_BLOCKS = (1, 4, 16, 64, 256)
GATHER_CONTEXTS = tuple(2 ** i for i in range(8, 15))   # 256 .. 16,384 tokens, every power of two
GATHER_REPEATS = 7


@dataclass(frozen=True)
class GatherGrid:
    """Page 06's measured gathers. rows: one row per (context, block size): the medians (``*_us``), the
    ratios of medians (``gather_ratio`` paged / contiguous, ``naive_ratio`` naive cat / contiguous,
    ``attention_ratio``) and the quartiles of the per-round ratios (``<ratio>_q1`` / ``<ratio>_q3``).
    naive: one row per context: ``naive_ratio`` (ratio of the medians of every cell's naive-cat and
    contiguous samples at that context: both do not depend on the block size) with its per-round quartiles
    ``naive_ratio_q1`` / ``naive_ratio_q3`` and the ``rounds`` they come from. conditions: when and how."""

    rows: pd.DataFrame
    naive: pd.DataFrame
    conditions: Conditions


def gather_grid(max_ctx: int, repeats: int = GATHER_REPEATS) -> GatherGrid:
    """Measure :func:`lab.pool_timing.gather_timing` (Kimi-Linear's latent, ``repeats`` interleaved rounds
    after a warm-up per cell) for contexts :data:`GATHER_CONTEXTS` up to ``max_ctx`` tokens and block sizes
    :data:`GATHER_BLOCKS`; per block size the contexts share one set-up (:func:`lab.pool_timing.gather_timings`).
    Raises ValueError for ``max_ctx`` < 256 or ``repeats`` < 5."""
    ctx = [c for c in GATHER_CONTEXTS if c <= max_ctx]
    if not ctx:
        raise ValueError(f"max_ctx must be >= 256, got {max_ctx}")
    with one_thread():
        cond = conditions(repeats, 1)
    by_block = [gather_timings(ctx, b, KIMI.latent_dim, KIMI.kv_lora_rank, repeats=repeats) for b in GATHER_BLOCKS]
    cells = [by_block[j][i] for i in range(len(ctx)) for j in range(len(GATHER_BLOCKS))]   # context-major rows
    rows = []
    for g in cells:
        paged, naive, attn = g.spread(), g.spread("naive_cat"), g.spread("attn_paged", "attn_contiguous")
        rows.append({**{k: v for k, v in g._asdict().items() if k != "timings"},
                     "gather_ratio": paged.ratio, "gather_ratio_q1": paged.q1, "gather_ratio_q3": paged.q3,
                     "naive_ratio": naive.ratio, "naive_ratio_q1": naive.q1, "naive_ratio_q3": naive.q3,
                     "attention_ratio": attn.ratio, "attention_ratio_q1": attn.q1, "attention_ratio_q3": attn.q3})
    naive_rows = []
    for L in ctx:
        at = [g for g in cells if g.context_tokens == L]
        pooled = [summarize(k, [x for g in at for x in g.timings[k].samples_s]) for k in ("naive_cat", "contiguous")]
        s = ratio_spread(*pooled)
        naive_rows.append({"context_tokens": L, "naive_ratio": s.ratio, "naive_ratio_q1": s.q1,
                           "naive_ratio_q3": s.q3, "rounds": len(pooled[0].samples_s)})
    return GatherGrid(pd.DataFrame(rows), pd.DataFrame(naive_rows), cond)


@dataclass(frozen=True)
class Page06:
    """What page 06 draws apart from the measured gathers (:func:`gather_grid`), from one call of
    :func:`page06`: the page-table demo, fragmentation rows (1,000 seeded log-uniform lengths in [16, 8192])
    and the sharing rows (None when the prefix and the tail are both 0 tokens).
    ``sharing_block_size`` = max(block, 16)."""

    demo: PageTableDemo
    fragmentation: pd.DataFrame
    sharing: pd.DataFrame | None
    sharing_block_size: int


def page06(block_size: int, tokens_a: int, shared_tokens: int, tokens_b_own: int,
           num_requests: int, prefix_tokens: int, unique_tokens: int) -> Page06:
    """Page 06's one call (the gathers are measured by :func:`gather_grid`). Raises ValueError as
    :func:`page_table_demo` and :func:`prefix_sharing_bytes` (except a 0-token prefix + tail, which gives
    ``sharing=None``)."""
    lengths = np.exp(np.random.default_rng(0).uniform(np.log(16), np.log(8192), 1000)).astype(int).tolist()
    frag = pd.DataFrame(fragmentation_vs_block_size([2 ** i for i in range(0, 11)], lengths))
    share_bs = max(block_size, 16)
    sharing = None
    if prefix_tokens + unique_tokens > 0:
        sharing = pd.DataFrame([{**r._asdict(), "saved_bytes": r.saved_bytes} for r in
                                prefix_sharing_bytes(num_requests, prefix_tokens, unique_tokens, share_bs)])
    return Page06(page_table_demo(block_size, tokens_a, shared_tokens, tokens_b_own, seed=0), frag,
                  sharing, share_bs)
