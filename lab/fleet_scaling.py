"""Page 12 in one call: the keys each algorithm moves when a replica joins or leaves, and a trace replayed
across that scale event with per-replica caches (by default Kimi-Linear's prefix-cache policy model at real
bytes on 8 x H200, or LRU block caches), averaged over several synthetic traces (:func:`fleet_scaling`)."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from lab.fleet import (
    ANCHORS,
    REPLICA_CACHES,
    hit_ratio_across_scale_event,
    ideal_ratio,
    keys_moved_table,
    page_trace,
)
from serve.errors import check_choice
from serve.fleet.real_replica import RealReplica
from serve.fleet.routing.registry import KEY_ROUTERS, make_router, options_for, replica_names

ACTIONS = ("add", "remove")
CAPACITIES = ("500", "2000", "8000", "unlimited")  # cache per replica options (512-token blocks)
TRACE_SEEDS = 2   # synthetic traces averaged by default: one trace's dip swings by about a third between seeds
MAX_SEEDS = 5
DIP_WINDOWS = 5      # paired_dip: windows from the event over which the hit-ratio loss is averaged
SMOOTH_WINDOWS = 3   # paired_dip: the loss is averaged over this many windows before testing for recovery


@dataclass(frozen=True)
class FleetScaling:
    """Everything page 12 draws.

    moved: fraction of random keys moved per algorithm with the ideal and mod-N expectations
    (:func:`lab.fleet.keys_moved_table`); replicas_after: replicas after the event; dip: windowed token hit
    ratio per algorithm, mean over ``seeds`` traces (columns algorithm, request, hit_ratio, lo, hi: the
    lowest / highest trace's window, the band; change, change_lo, change_hi: the same for the hit ratio minus
    that of the same trace replayed without the event, exactly 0 before it; lost_ratio: the window's prompt
    tokens whose KV the replica held but no state let it reuse); recovery: :func:`paired_dip` per algorithm,
    with hit_ratio_no_event and lost_no_event: the whole no-event replay's token hit ratio and lost share, mean
    over the traces; ideal_ratio: the block ideal (one infinite shared cache), mean over the traces; budget_gb:
    each replica's cache budget (GB; None with block LRU caches); seeds: traces averaged (1 for an upload); at_request: index of the event; num_requests: trace length; routing_keys: distinct routing
    keys in the trace (1: every algorithm sends all to one replica); note: what the budget cut from an
    upload; dip_windows: windows averaged in ``hit_ratio_lost``; anchors: published figures with sources."""

    moved: pd.DataFrame
    replicas_after: int
    dip: pd.DataFrame
    recovery: pd.DataFrame
    at_request: int
    num_requests: int
    routing_keys: int
    note: str
    seeds: int = 1
    dip_windows: int = DIP_WINDOWS
    anchors: dict | None = None
    ideal_ratio: float = float("nan")
    budget_gb: float | None = None


def fleet_scaling(num_replicas: int, action: str, num_keys: int, vnodes: int, num_requests: int, k: int,
                  at_fraction: float, window: int, capacity: str, upload: bytes | None = None,
                  upload_name: str = "uploaded file", replica_cache: str = "policy",
                  algorithms: tuple[str, ...] = KEY_ROUTERS, seeds: int = TRACE_SEEDS,
                  replica: RealReplica = RealReplica()) -> FleetScaling:
    """Keys moved going from ``num_replicas`` to one more ("add") or one fewer ("remove"), then the page trace
    (``upload``, or ``seeds`` synthetic traces of seeds 0, 1, ...) routed on its first ``k`` blocks by each of
    ``algorithms`` (key-based, :data:`serve.fleet.KEY_ROUTERS`) with the event after ``at_fraction`` of the
    requests; hit ratio per ``window`` requests, averaged over the traces. ``replica_cache`` ("policy" or
    "block_lru", :data:`lab.fleet.REPLICA_CACHES`): each replica's cache is ``replica``'s prefix-cache policy at
    real bytes (:meth:`serve.fleet.real_replica.RealReplica.cache`), or an LRU cache of ``capacity`` (one of :data:`CAPACITIES`) blocks.

    Raises: ValueError for an unknown action, capacity, replica cache or algorithm, ``seeds`` outside [1, :data:`MAX_SEEDS`], bad
    sizes, or a bad upload (TraceFormatError)."""
    check_choice("action", action, ACTIONS)
    check_choice("capacity", capacity, CAPACITIES)
    check_choice("replica_cache", replica_cache, tuple(REPLICA_CACHES.values()))
    if not algorithms or any(a not in KEY_ROUTERS for a in algorithms):
        raise ValueError(f"algorithms must be a non-empty subset of {KEY_ROUTERS}, got {list(algorithms)}")
    if isinstance(seeds, bool) or not isinstance(seeds, int) or not 1 <= seeds <= MAX_SEEDS:
        raise ValueError(f"seeds must be an int in [1, {MAX_SEEDS}], got {seeds!r}")
    factory = replica.cache if replica_cache == "policy" else None
    moved = keys_moved_table(num_replicas, action, num_keys, vnodes)
    cap = None if capacity == "unlimited" else int(capacity)
    seeds = 1 if upload is not None else seeds
    routers = {name: make_router(name, replica_names(num_replicas), **options_for(name, {"vnodes": vnodes})) for name in algorithms}
    runs, keys, whole, ideals = [], set(), [], []
    for seed in range(seeds):
        trace, note, _ = page_trace(upload, num_requests, seed=seed, name=upload_name)
        keys |= {r.hash_ids[:k] for r in trace}
        ideals.append(ideal_ratio(trace))
        args = (trace, algorithms, num_replicas, k, action, at_fraction, window, cap, vnodes)
        run = hit_ratio_across_scale_event(*args, routers=routers, cache_factory=factory)
        base = hit_ratio_across_scale_event(*args, routers=routers, event=False, cache_factory=factory)
        run["change"] = run.hit_ratio - base.hit_ratio
        runs.append(run)
        sums = base.groupby("algorithm", sort=False)[["hit_tokens", "lost_tokens", "tokens"]].sum()
        whole.append(pd.DataFrame({"hit_ratio_no_event": sums.hit_tokens / sums.tokens.clip(lower=1),
                                   "lost_no_event": sums.lost_tokens / sums.tokens.clip(lower=1)}))
    dip = (pd.concat(runs).groupby(["algorithm", "request"], sort=False)
           .agg(hit_ratio=("hit_ratio", "mean"), lo=("hit_ratio", "min"), hi=("hit_ratio", "max"),
                change=("change", "mean"), change_lo=("change", "min"), change_hi=("change", "max"),
                lost_ratio=("lost_ratio", "mean")).reset_index())
    no_event = pd.concat(whole).groupby(level=0, sort=False).mean()
    at_request = int(len(trace) * at_fraction)
    recovery = paired_dip(dip, at_request).join(no_event, on="algorithm")
    return FleetScaling(moved, num_replicas + 1 if action == "add" else num_replicas - 1, dip, recovery, at_request, len(trace), len(keys), note, seeds=seeds,
                        anchors=dict(ANCHORS), ideal_ratio=float(sum(ideals) / len(ideals)),
                        budget_gb=replica.budget_bytes / 1e9 if factory else None)


def paired_dip(dip: pd.DataFrame, at_request: int, windows_after: int = DIP_WINDOWS) -> pd.DataFrame:
    """Per algorithm from :attr:`FleetScaling.dip` (mean curves): hit_ratio_before (mean before the event),
    lowest_after (lowest mean window from the event on), hit_ratio_lost (mean of max(0, -change) over the first
    ``windows_after`` windows from the event: the loss against the same traces without the event, so trace
    noise cancels) and requests_to_recover (requests from the event to the first window from which the loss,
    averaged over :data:`SMOOTH_WINDOWS` windows, is at most half of hit_ratio_lost: half the dip refilled;
    0 without a loss; NaN if not within the trace). Raises ValueError for ``windows_after`` < 1."""
    if windows_after < 1:
        raise ValueError(f"windows_after must be >= 1 window, got {windows_after}")
    rows = []
    for name, g in dip.groupby("algorithm", sort=False):
        before, after = g[g.request < at_request], g[g.request >= at_request]
        loss = (-after.change).clip(lower=0)
        lost = float(loss.head(windows_after).mean()) if len(after) else float("nan")
        smooth = loss.rolling(SMOOTH_WINDOWS, min_periods=SMOOTH_WINDOWS).mean().shift(1 - SMOOTH_WINDOWS)
        recovered = after.request[smooth <= lost / 2]
        rows.append({"algorithm": name, "hit_ratio_before": float(before.hit_ratio.mean()) if len(before)
                     else float("nan"),
                     "lowest_after": float(after.hit_ratio.min()) if len(after) else float("nan"),
                     "hit_ratio_lost": lost,
                     "requests_to_recover": 0.0 if lost == 0 else float(recovered.iloc[0] - at_request)
                     if len(recovered) else float("nan")})
    return pd.DataFrame(rows)
