"""Page 12 in one call: the keys each algorithm moves when a replica joins or leaves, and a trace replayed
across that scale event with per-replica LRU block caches, averaged over several synthetic traces
(:func:`fleet_scaling`)."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from lab.fleet import ANCHORS, DIP_WINDOWS, hit_ratio_across_scale_event, keys_moved_table, page_trace
from serve.fleet import KEY_ROUTERS, make_router, replica_names

ACTIONS = ("add", "remove")
CAPACITIES = ("500", "2000", "8000", "unlimited")  # cache per replica options (512-token blocks)
TRACE_SEEDS = 3   # synthetic traces averaged: the windowed hit ratio of one trace swings as much as the dip
SMOOTH_WINDOWS = 3   # paired_dip: the loss is averaged over this many windows before testing for recovery


@dataclass(frozen=True)
class FleetScaling:
    """Everything page 12 draws.

    moved: fraction of random keys moved per algorithm with the ideal and mod-N expectations
    (:func:`lab.fleet.keys_moved_table`); replicas_after: replicas after the event; dip: windowed token hit
    ratio per algorithm, mean over ``seeds`` traces (columns algorithm, request, hit_ratio, lo, hi: the
    lowest / highest trace's window, the band; change, change_lo, change_hi: the same for the hit ratio minus
    that of the same trace replayed without the event, exactly 0 before it); recovery: :func:`paired_dip` per
    algorithm; seeds: traces averaged (1 for an upload); at_request: index of the event; num_requests: trace length; routing_keys: distinct routing
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


def fleet_scaling(num_replicas: int, action: str, num_keys: int, vnodes: int, num_requests: int, k: int,
                  at_fraction: float, window: int, capacity: str, upload: bytes | None = None,
                  upload_name: str = "uploaded file") -> FleetScaling:
    """Keys moved going from ``num_replicas`` to one more ("add") or one fewer ("remove"), then the page trace
    (``upload``, or :data:`TRACE_SEEDS` synthetic traces of seeds 0, 1, ...) routed on its first ``k`` blocks by
    every key-based algorithm with the event after ``at_fraction`` of the requests; hit ratio per ``window``
    requests, averaged over the traces; ``capacity`` one of :data:`CAPACITIES` (blocks per replica).

    Raises: ValueError for an unknown action or capacity, bad sizes, or a bad upload (TraceFormatError)."""
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
    if capacity not in CAPACITIES:
        raise ValueError(f"capacity must be one of {CAPACITIES}, got {capacity!r}")
    moved = keys_moved_table(num_replicas, action, num_keys, vnodes)
    cap = None if capacity == "unlimited" else int(capacity)
    seeds = 1 if upload is not None else TRACE_SEEDS
    routers = {name: make_router(name, replica_names(num_replicas), vnodes=vnodes) for name in KEY_ROUTERS}
    runs, keys = [], set()
    for seed in range(seeds):
        trace, note, _ = page_trace(upload, num_requests, seed=seed, name=upload_name)
        keys |= {r.hash_ids[:k] for r in trace}
        args = (trace, KEY_ROUTERS, num_replicas, k, action, at_fraction, window, cap, vnodes)
        run = hit_ratio_across_scale_event(*args, routers=routers)
        run["change"] = run.hit_ratio - hit_ratio_across_scale_event(*args, routers=routers, event=False).hit_ratio
        runs.append(run)
    dip = (pd.concat(runs).groupby(["algorithm", "request"], sort=False)
           .agg(hit_ratio=("hit_ratio", "mean"), lo=("hit_ratio", "min"), hi=("hit_ratio", "max"),
                change=("change", "mean"), change_lo=("change", "min"), change_hi=("change", "max")).reset_index())
    at_request = int(len(trace) * at_fraction)
    return FleetScaling(moved, num_replicas + 1 if action == "add" else num_replicas - 1, dip,
                        paired_dip(dip, at_request), at_request, len(trace), len(keys), note, seeds=seeds,
                        anchors=dict(ANCHORS))


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
