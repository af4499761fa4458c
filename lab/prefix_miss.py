"""Page 09 in one call: a miss on the demo engine and what it leaves behind, then one trace replayed through
capacity-limited prefix caches (:mod:`serve.prefix.sim`, the engine's own lookup rules) at a real preset's
byte sizes.

The trace replays (``1 + len(CAPACITY_FRACTIONS) + 2 * len(INTERVALS)`` = 16 runs, each distinct one run
once): the unlimited cache at the chosen interval; caches at :data:`serve.prefix.sim.CAPACITY_FRACTIONS` of
what that run peaked at; every interval in :data:`INTERVALS` unlimited, and at the middle capacity. One hash id
= one 512-token KV block (Mooncake's block size, :data:`serve.traces.mooncake.MOONCAKE_BLOCK_TOKENS`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from kda_core.config import REAL_PRESETS, preset_title  # noqa: F401  (preset_title re-exported: page 09's labels)
from lab.fleet import MOONCAKE_TABLE2_CACHE_RATIO, PREFIX_SIM_TRACE_BLOCKS, page_trace
from lab.prefix import Comparison, miss_then_hit
from serve.config import ServeConfig
from serve.errors import check_choice
from serve.prefix.sim import CAPACITY_FRACTIONS, MISS_CAUSES, capacity_points, replay_row
from serve.traces.mooncake import MOONCAKE_BLOCK_TOKENS, IdealHitRatio, ideal_hit_ratio

INTERVALS = tuple(MOONCAKE_BLOCK_TOKENS * k for k in (1, 2, 4, 8, 16))  # checkpoint intervals C compared (tokens)
TRADE_CAPACITY = 2  # index into the capacity points of the interval trade-off's limited cache (0.1 of the peak)
MODELS = REAL_PRESETS  # the real models whose byte sizes the replays use


@dataclass(frozen=True)
class PrefixMiss:
    """Everything page 09 draws.

    Part 1: miss / hit: the engine rows (:func:`lab.prefix.miss_then_hit`: tokens, ms, bytes) of the cold
    request and of the next one; written: the checkpoints the miss left (boundary, group, written_at, pages);
    check: the next output vs the cache-off run; next_shared: tokens the next request shares.
    Part 2: capacity: one :func:`serve.prefix.sim.replay_row` per capacity point (GB, hit ratios, ``miss_<cause>``
    fractions); free / limited: one row per interval in :data:`INTERVALS`, unlimited and at the capacity
    ``limited.capacity_gb``; ideal: the trace's ideal block and token hit ratios; num_requests: trace length;
    note: what the block budget cut from an upload ("" if nothing); all part-2 fields are None when the trace
    replay was not asked for (``replay=False``: the page runs it behind a button); miss_causes: the ``miss_<cause>`` names;
    intervals: :data:`INTERVALS`; paper_ratios: Mooncake FAST'25 Table 2 "cache ratio" per trace."""

    miss: dict
    written: pd.DataFrame
    hit: dict
    check: Comparison
    next_shared: int
    capacity: pd.DataFrame | None
    free: pd.DataFrame | None
    limited: pd.DataFrame | None
    ideal: IdealHitRatio | None
    num_requests: int | None
    note: str | None
    miss_causes: tuple = MISS_CAUSES
    intervals: tuple = INTERVALS
    paper_ratios: dict | None = None


def prefix_miss(prompt_tokens: int, next_shared: int, block_size: int, interval: int, num_groups: int,
                preset: str, every_blocks: int, trace_groups: int, num_requests: int,
                upload: bytes | None = None, upload_name: str = "uploaded file",
                progress: Callable[[int, int], None] | None = None, replay: bool = True) -> PrefixMiss:
    """Part 1 on the demo engine (``next_shared`` is capped at ``prompt_tokens``), then part 2: the page trace
    (``upload`` or the synthetic one, :func:`lab.fleet.page_trace`) replayed with ``preset``'s bytes at a
    checkpoint every ``every_blocks`` 512-token blocks and ``trace_groups`` groups. ``progress(done, total)``
    is called after each replay. ``replay`` False: part 1 only (16 trace replays take seconds of CPU).

    Raises: ValueError for bad sizes, an unknown preset, or a malformed upload (TraceFormatError)."""
    check_choice("preset", preset, MODELS)
    shared = min(next_shared, prompt_tokens)
    run = miss_then_hit(prompt_tokens, shared, ServeConfig(block_size, interval, num_groups))
    if not replay:
        return PrefixMiss(run.miss, pd.DataFrame(run.written), run.hit, run.check, shared, None, None, None, None,
                          None, None, paper_ratios=dict(MOONCAKE_TABLE2_CACHE_RATIO))
    trace, note, _ = page_trace(upload, num_requests, name=upload_name, max_total_blocks=PREFIX_SIM_TRACE_BLOCKS)
    chosen = MOONCAKE_BLOCK_TOKENS * every_blocks
    total = 1 + len(CAPACITY_FRACTIONS) + 2 * len(INTERVALS)
    rows: dict = {}  # (interval, capacity) -> row: a run asked for twice is replayed once
    done = 0

    def replay(c: int, capacity: float | None) -> dict:
        nonlocal done
        if (c, capacity) not in rows:
            rows[c, capacity] = replay_row(trace, preset, c, trace_groups, capacity)
        done += 1
        if progress is not None:
            progress(done, total)
        return rows[c, capacity]

    points = capacity_points(replay(chosen, None))
    capacity = pd.DataFrame([replay(chosen, c) for c in points])
    free = pd.DataFrame([replay(c, None) for c in INTERVALS])
    limited = pd.DataFrame([replay(c, points[TRADE_CAPACITY]) for c in INTERVALS])
    return PrefixMiss(run.miss, pd.DataFrame(run.written), run.hit, run.check, shared, capacity, free, limited,
                      ideal_hit_ratio(trace), len(trace), note, paper_ratios=dict(MOONCAKE_TABLE2_CACHE_RATIO))
