"""Scaling: what moves when a replica is added or removed.

- :func:`keys_moved` — fraction of keys whose replica changes when ``router`` gains (or loses) one
  replica, measured on the same router object before and after the membership change.
- :func:`scaling_table` — that fraction for every key-based algorithm, with the ideal 1/(n+1)
  (only the new replica's share moves) and mod-N's expected n/(n+1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from serve.fleet.routing.registry import KEY_ROUTERS, make_router, options_for, replica_names
from serve.fleet.routing.router import Router


def _names(router: Router, keys: np.ndarray) -> np.ndarray:
    return np.asarray(router.replicas, dtype=object)[router.assign(keys)]


def keys_moved(router: Router, keys: np.ndarray, add: str | None = None, remove: str | None = None) -> float:
    """Fraction of ``keys`` (``uint64``) whose replica changes after adding ``add`` or removing
    ``remove`` (exactly one of them). Mutates ``router``. Raises ValueError otherwise."""
    if (add is None) == (remove is None):
        raise ValueError("give exactly one of add= or remove=")
    before = _names(router, keys)
    if add is not None:
        router.add_replica(add)
    else:
        router.remove_replica(remove)
    after = _names(router, keys)
    return float(np.mean(before != after))


class ScalingRow(NamedTuple):
    """One algorithm's ``moved_fraction`` going from ``n_before`` to ``n_after`` replicas, with the
    ``ideal`` fraction (|Δn| / max(n_before, n_after)) and mod-N's expected ``mod_n_expected``."""

    algorithm: str
    n_before: int
    n_after: int
    moved_fraction: float
    ideal: float
    mod_n_expected: float


def scaling_table(n_before: int, n_after: int, keys: np.ndarray, algorithms: Sequence[str] = KEY_ROUTERS,
                  **params) -> list[ScalingRow]:
    """Keys moved per algorithm when scaling from ``n_before`` to ``n_after`` = n_before ± 1 replicas
    (adding ``replica-n_before`` or removing the last replica). Raises ValueError otherwise."""
    if abs(n_after - n_before) != 1 or min(n_before, n_after) < 1:
        raise ValueError(f"n_after must be n_before ± 1 with both >= 1, got {n_before} -> {n_after}")
    big = max(n_before, n_after)
    ideal = 1.0 / big
    mod_n = 1.0 - 1.0 / big  # a key stays iff key mod n == key mod (n+1): probability 1/(n+1)
    rows = []
    for name in algorithms:
        router = make_router(name, replica_names(n_before), **options_for(name, params))
        if n_after > n_before:
            moved = keys_moved(router, keys, add=f"replica-{n_before}")
        else:
            moved = keys_moved(router, keys, remove=f"replica-{n_after}")
        rows.append(ScalingRow(name, n_before, n_after, moved, ideal, mod_n))
    return rows
