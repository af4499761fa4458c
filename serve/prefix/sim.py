"""Block-granularity replay of a request trace through a capacity-limited dual-granularity prefix cache.

The engine's policy, not a copy of it: the same :class:`serve.prefix.index.PrefixIndex` as
:class:`serve.prefix.cache.PrefixCache` (the lookup walk :meth:`PrefixIndex.walk`, the kind-aware LRU),
the same placement rule (:meth:`serve.config.ServeConfig.prefill_checkpoints`) and the same "publish the
missing groups" step, with byte budgets instead of pages: one hash
id = one KV block of ``block_size`` tokens (the trace's ids are chained, so they serve as block keys),
and checkpoints cost a real preset's KDA state bytes. Requests are instantaneous (nothing stays
pinned); after each request the cache evicts LRU entries until it fits its capacity.

Two measures per request (L = input_length, ids = hash_ids, full = L // N full blocks):
- **block level** (the trace's view, comparable with :func:`serve.traces.mooncake.ideal_hit_ratio`): hit blocks
  = the phase-2 hit over the cached full blocks (no token cap), plus the trailing partial id when it is
  cached and the hit reaches it;
- **token level** (the engine's rules): phase 1 capped at L - 1 tokens, phase 2 at full-block
  boundaries. Missed tokens are split by cause: ``no_kv_block`` (never seen before), ``evicted`` (seen,
  KV no longer cached), ``kv_no_checkpoint`` (KV cached, no complete checkpoint at or beyond),
  ``below_one_block`` (the partial tail and the last-token cap).

Only prompt blocks are inserted (a trace does not say which blocks outputs would fill).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import NamedTuple

import torch

from kda_core.config import PRESETS, mla_kv_bytes_per_token
from serve.config import ServeConfig
from serve.errors import check_choice
from serve.memory.layout import group_layers, group_state_bytes
from serve.prefix.index import PrefixIndex
from serve.traces.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest, leading_run

MISS_CAUSES = ("no_kv_block", "evicted", "kv_no_checkpoint", "below_one_block")


@dataclass(frozen=True)
class TraceReplayConfig:
    """A simulated cache. Frozen; validated in ``__post_init__``.

    serving: the :class:`ServeConfig` (N tokens per hash id, checkpoint interval C, G groups; its page
    policy is unused: sizes here are bytes, not pages); kv_block_bytes: bytes of one KV block;
    group_state_bytes: bytes of one checkpoint per group (len = G); capacity_bytes: cache budget
    (None = unlimited). Raises ValueError for non-positive sizes, a group count that disagrees, or a
    capacity that is not None or a finite number >= 0 (a string, NaN, inf).
    """

    serving: ServeConfig
    kv_block_bytes: int
    group_state_bytes: tuple[int, ...]
    capacity_bytes: float | None = None

    def __post_init__(self):
        if not isinstance(self.serving, ServeConfig):
            raise ValueError(f"serving must be a ServeConfig, got {type(self.serving).__name__}")
        if self.kv_block_bytes <= 0 or not self.group_state_bytes or min(self.group_state_bytes) <= 0:
            raise ValueError("kv_block_bytes and every group_state_bytes must be positive")
        if len(self.group_state_bytes) != self.serving.num_groups:
            raise ValueError(f"group_state_bytes must give one size per group ({self.serving.num_groups}), "
                             f"got {len(self.group_state_bytes)}")
        cap = self.capacity_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, Real) or not math.isfinite(cap)
                                or cap < 0):
            raise ValueError(f"capacity_bytes must be None (unlimited) or a finite number >= 0, got {cap!r}")

    @classmethod
    def for_preset(cls, preset: str, serving: ServeConfig, capacity_bytes: float | None = None,
                   kv_dtype: torch.dtype = torch.bfloat16, state_dtype: torch.dtype = torch.float32,
                   conv_dtype: torch.dtype = torch.bfloat16) -> TraceReplayConfig:
        """Byte sizes of a real preset (``kda_core.config``): KV block = MLA KV bytes/token * N; a group's
        checkpoint = its KDA layers * (recurrent + conv state bytes). Raises ValueError for an unknown
        preset or more groups than its KDA layers."""
        check_choice("preset", preset, sorted(PRESETS))
        cfg = PRESETS[preset]
        groups = tuple(group_state_bytes(cfg, len(g), state_dtype, conv_dtype)
                       for g in group_layers(cfg, serving.num_groups))
        return cls(serving, mla_kv_bytes_per_token(cfg, kv_dtype) * serving.block_size, groups, capacity_bytes)


class TraceReplayResult(NamedTuple):
    """Outcome of a replay. Ratios in [0, 1]; tokens and bytes are totals over the trace.

    miss_tokens: ``{cause: tokens}`` over :data:`MISS_CAUSES`; peak_*_bytes: the most held after any
    request, per kind (reached at different times); checkpoints_written: group checkpoints stored; evicted_*:
    entries evicted; seconds: wall time; request_hit_tokens: the token-level hit of each request, in trace
    order; at_peak_kv_bytes / at_peak_state_bytes: held after the request where KV + checkpoints was largest
    (their sum is the peak total, <= the capacity).
    """

    block_hit_ratio: float
    token_hit_ratio: float
    hit_blocks: int
    total_blocks: int
    hit_tokens: int
    total_tokens: int
    miss_tokens: dict
    peak_kv_bytes: int
    peak_state_bytes: int
    checkpoints_written: int
    evicted_blocks: int
    evicted_checkpoints: int
    seconds: float
    request_hit_tokens: tuple = ()
    at_peak_kv_bytes: int = 0
    at_peak_state_bytes: int = 0


class ReplayCache:
    """The cache a replay drives, one request at a time (the fleet simulation drives it per replica).

    ``walk(r)`` is the engine's lookup (pure): ``(kv_tokens, hit_blocks)``. ``admit(r, hit_blocks)``
    applies what the engine does after the request: refresh the hit, insert the prompt's blocks, publish
    the missing checkpoint groups at the placement rule's boundaries past the hit. ``evict_to(cap)``
    evicts LRU entries until KV + checkpoint bytes <= cap. Byte counters ``kv_used`` / ``st_used``;
    counters ``written``, ``ev_kv`` (blocks), ``ev_ck`` (group checkpoints)."""

    def __init__(self, config: TraceReplayConfig):
        self.config = config
        self.idx = PrefixIndex(config.serving.num_groups)
        self.kv_used = self.st_used = self.written = self.ev_kv = self.ev_ck = 0

    def walk(self, r) -> tuple[int, int]:
        """``(kv_tokens, hit_blocks)`` of request ``r`` (``hash_ids``, ``input_length``); pure."""
        N, L = self.config.serving.block_size, r.input_length
        return self.idx.walk(r.hash_ids[:L // N], L, N) if L else (0, 0)

    def admit(self, r, hit_blocks: int, run: int | None = None) -> None:
        """The request ran with a hit of ``hit_blocks`` blocks (as :meth:`walk` gave; if the cache changed
        since, the walk of now is used when it is shorter). ``run``: the leading cached blocks, if known."""
        idx, serving, ids, L = self.idx, self.config.serving, r.hash_ids, r.input_length
        N, total = serving.block_size, len(ids)
        if run is None:
            run = idx.kv_run(ids)
            hit_blocks = min(hit_blocks, self.walk(r)[1])
        if hit_blocks:
            idx.touch(ids, hit_blocks)
        kv_b, ck_b = self.config.kv_block_bytes, self.config.group_state_bytes
        idx.add_path(ids, run)                                # insert the prompt's blocks, refresh its path
        self.kv_used += kv_b * max(total - run, 0)
        for b in serving.prefill_checkpoints(L):              # the engine's placement rule
            b //= N
            if b <= hit_blocks:
                continue
            missing = idx.missing_groups(ids[b - 1])
            if not missing:
                idx.touch(ids, b)
            for g in missing:                                 # as PrefixCache.publish_checkpoint
                idx.add_checkpoint(ids[b - 1], g, None, b * N)
                self.st_used += ck_b[g]
                self.written += 1

    def evict_to(self, cap: float) -> None:
        """Evict LRU entries until KV + checkpoint bytes <= ``cap``."""
        if self.kv_used + self.st_used > cap:
            self.kv_used, self.st_used, blocks, ckpts = self.idx.evict_to_bytes(
                cap, self.kv_used, self.st_used, self.config.kv_block_bytes, self.config.group_state_bytes)
            self.ev_kv += blocks
            self.ev_ck += ckpts


def replay_trace(requests: Sequence[TraceRequest], config: TraceReplayConfig,
                 progress: Callable[[float], None] | None = None) -> TraceReplayResult:
    """Replay ``requests`` in order through one simulated cache (:class:`ReplayCache`); see the module
    docstring. ``progress(fraction)`` is called about every 1,000 requests. Ratios are 0.0 when the trace
    has no blocks or no tokens (every ``input_length`` 0). Raises ValueError on an empty trace."""
    if not requests:
        raise ValueError("requests must not be empty")
    t0 = time.perf_counter()
    N = config.serving.block_size
    cap = config.capacity_bytes
    cache = ReplayCache(config)
    idx = cache.idx
    seen: set = set()
    miss = dict.fromkeys(MISS_CAUSES, 0)
    hit_blocks = total_blocks = total_tokens = 0
    peak_kv = peak_st = at_kv = at_st = 0
    request_hits: list[int] = []
    for n, r in enumerate(requests):
        ids, L = r.hash_ids, r.input_length
        full, total = L // N, len(ids)
        run = idx.kv_run(ids)                                 # the trace's view: no token cap
        kvb = min(run, full)
        jb = idx.checkpoint_run(ids, kvb)
        kv_tokens, jt = cache.walk(r)                         # the engine's lookup
        limit = kv_tokens // N
        ideal_full = min(leading_run(ids, seen), full)
        hit_blocks += jb + (jb == full and run == total > full)
        total_blocks += total
        request_hits.append(jt * N)                           # the token-level hit
        total_tokens += L
        evicted = max(0, ideal_full - kvb) * N
        new = (full - max(ideal_full, kvb)) * N
        miss["kv_no_checkpoint"] += (limit - jt) * N
        miss["evicted"] += evicted
        miss["no_kv_block"] += new
        miss["below_one_block"] += L - jt * N - (limit - jt) * N - evicted - new
        cache.admit(r, jt, run)
        seen.update(ids)
        if cap is not None:
            cache.evict_to(cap)
        peak_kv, peak_st = max(peak_kv, cache.kv_used), max(peak_st, cache.st_used)
        if cache.kv_used + cache.st_used > at_kv + at_st:
            at_kv, at_st = cache.kv_used, cache.st_used
        if progress is not None and n % 1000 == 0:
            progress(n / len(requests))
    if progress is not None:
        progress(1.0)
    hit_tokens, miss_total = sum(request_hits), sum(miss.values())
    assert miss_total == total_tokens - hit_tokens, "miss causes must add up to the missed tokens"
    return TraceReplayResult(_ratio(hit_blocks, total_blocks), _ratio(hit_tokens, total_tokens), hit_blocks,
                             total_blocks, hit_tokens, total_tokens, miss, peak_kv, peak_st, cache.written,
                             cache.ev_kv, cache.ev_ck, time.perf_counter() - t0, tuple(request_hits), at_kv, at_st)


def _ratio(part: int, whole: int) -> float:
    """``part / whole``, 0.0 for an empty whole (a trace whose prompts are all empty hits nothing)."""
    return part / whole if whole else 0.0


CAPACITY_FRACTIONS = (0.01, 0.03, 0.1, 0.3, 1.0)


def replay_row(requests: Sequence[TraceRequest], preset: str, checkpoint_interval: int, num_groups: int = 1,
               capacity_bytes: float | None = None) -> dict:
    """One replay with a preset's byte sizes, flattened for a table: the config, hit ratios, peak GB,
    checkpoints written, evictions, seconds, and ``miss_<cause>`` as fractions of all tokens. Raises
    ValueError (:class:`TraceReplayConfig`) for a capacity that is not None or a finite number >= 0."""
    serving = ServeConfig(MOONCAKE_BLOCK_TOKENS, checkpoint_interval, num_groups)
    res = replay_trace(requests, TraceReplayConfig.for_preset(preset, serving, capacity_bytes))
    return dict(interval_tokens=checkpoint_interval, num_groups=num_groups,
                capacity_gb=None if capacity_bytes is None else capacity_bytes / 1e9,
                block_hit_ratio=res.block_hit_ratio, token_hit_ratio=res.token_hit_ratio,
                peak_kv_gb=res.peak_kv_bytes / 1e9, peak_state_gb=res.peak_state_bytes / 1e9,
                checkpoints_written=res.checkpoints_written, evicted_blocks=res.evicted_blocks,
                evicted_checkpoints=res.evicted_checkpoints, seconds=res.seconds,
                **{f"miss_{c}": _ratio(res.miss_tokens[c], res.total_tokens) for c in MISS_CAUSES})


def capacity_points(unlimited: dict, fractions: Sequence[float] = CAPACITY_FRACTIONS) -> list[float]:
    """Capacities (bytes) at ``fractions`` of what an unlimited replay (a :func:`replay_row`) peaked at."""
    peak = (unlimited["peak_kv_gb"] + unlimited["peak_state_gb"]) * 1e9
    return [f * peak for f in fractions]
