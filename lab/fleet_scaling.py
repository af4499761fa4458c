"""Page 12 in one call: the keys each algorithm moves when a replica joins or leaves, and a trace replayed
across that scale event with per-replica LRU block caches (:func:`fleet_scaling`)."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from lab.fleet import ANCHORS, DIP_WINDOWS, hit_ratio_across_scale_event, keys_moved_table, page_trace, scale_dip
from serve.fleet import KEY_ROUTERS

ACTIONS = ("add", "remove")
CAPACITIES = ("500", "2000", "8000", "unlimited")  # cache per replica options (512-token blocks)


@dataclass(frozen=True)
class FleetScaling:
    """Everything page 12 draws.

    moved: fraction of random keys moved per algorithm with the ideal and mod-N expectations
    (:func:`lab.fleet.keys_moved_table`); replicas_after: replicas after the event; dip: windowed token hit
    ratio per algorithm (columns algorithm, request, hit_ratio); recovery: :func:`lab.fleet.scale_dip` per
    algorithm; at_request: index of the event; num_requests: trace length; routing_keys: distinct routing
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
    dip_windows: int = DIP_WINDOWS
    anchors: dict | None = None


def fleet_scaling(num_replicas: int, action: str, num_keys: int, vnodes: int, num_requests: int, k: int,
                  at_fraction: float, window: int, capacity: str, upload: bytes | None = None,
                  upload_name: str = "uploaded file") -> FleetScaling:
    """Keys moved going from ``num_replicas`` to one more ("add") or one fewer ("remove"), then the page trace
    (``upload`` or the synthetic one) routed on its first ``k`` blocks by every key-based algorithm with the
    event after ``at_fraction`` of the requests; hit ratio per ``window`` requests; ``capacity`` one of
    :data:`CAPACITIES` (blocks per replica).

    Raises: ValueError for an unknown action or capacity, bad sizes, or a bad upload (TraceFormatError)."""
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
    if capacity not in CAPACITIES:
        raise ValueError(f"capacity must be one of {CAPACITIES}, got {capacity!r}")
    moved = keys_moved_table(num_replicas, action, num_keys, vnodes)
    trace, note, _ = page_trace(upload, num_requests, name=upload_name)
    cap = None if capacity == "unlimited" else int(capacity)
    dip = hit_ratio_across_scale_event(trace, KEY_ROUTERS, num_replicas, k, action, at_fraction, window, cap, vnodes)
    at_request = int(len(trace) * at_fraction)
    return FleetScaling(moved, num_replicas + 1 if action == "add" else num_replicas - 1, dip,
                        scale_dip(dip, at_request), at_request, len(trace), len({r.hash_ids[:k] for r in trace}),
                        note, anchors=dict(ANCHORS))
