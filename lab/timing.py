"""Live timings the pages show: repeated, interleaved, after a warm-up, with their spread and conditions.

One rule for every measured chart: each case runs ``warmup`` times, then ``repeats`` rounds in which
every case runs once, in an order that rotates from round to round (interleaving: a slow phase of the
machine, such as another process waking up, hits every case instead of one). A timing is reported as its
median with the interquartile range and the min / max; :class:`Conditions` records when, how often and
under which load it was taken, so a page can stamp the chart with it.

Fixed overhead vs per-token cost: :func:`fit_linear` fits ``t(n) = a + b n`` (least squares) over the
medians of measurements at several sizes n, so a page can show the per-call overhead ``a`` apart from the
per-token cost ``b`` instead of reading a total as a per-token figure.
"""
from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from kda_core.chunk import kernel_in_use
from serve.errors import check_int

MIN_REPEATS = 5


class Timing(NamedTuple):
    """One case's timing, seconds: median, first / third quartile, min, max, and every sample (in run order)."""

    label: str
    median_s: float
    q1_s: float
    q3_s: float
    min_s: float
    max_s: float
    samples_s: tuple[float, ...]

    @property
    def iqr_s(self) -> float:
        """Interquartile range q3 - q1 (s)."""
        return self.q3_s - self.q1_s


class Conditions(NamedTuple):
    """When and how a measurement was taken: ``measured_at`` (UTC, ISO 8601 to the second), ``repeats`` and
    ``warmup`` per case, ``torch_threads`` (intra-op threads during the runs), ``cores`` (CPUs this process
    may use), ``load_avg_1m`` (the machine's 1-minute load average at the start, NaN where unknown),
    ``chunk_kernel`` (the form ``kda_chunk`` runs without autograd here: "fused C (AVX-512)", "fused C (AVX2)" or
    "torch form", :func:`kda_core.chunk.kernel_in_use`)."""

    measured_at: str
    repeats: int
    warmup: int
    torch_threads: int
    cores: int
    load_avg_1m: float
    chunk_kernel: str = "torch form"

    def stamp(self) -> str:
        """One line for under a chart."""
        load = "n/a" if self.load_avg_1m != self.load_avg_1m else f"{self.load_avg_1m:.2f}"
        return (f"Measured {self.measured_at} UTC · median of {self.repeats} interleaved repeats after "
                f"{self.warmup} warm-up · {self.torch_threads} torch thread(s) · {self.cores} core(s) · "
                f"load average {load} · chunk kernel {self.chunk_kernel}")


def conditions(repeats: int, warmup: int) -> Conditions:
    """The :class:`Conditions` of a measurement starting now. Raises ValueError for ``repeats`` <
    :data:`MIN_REPEATS` or ``warmup`` < 0 (every measurement's rule)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < MIN_REPEATS:
        raise ValueError(f"repeats must be an int >= {MIN_REPEATS}, got {repeats!r}")
    check_int("warmup", warmup, 0)
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    return Conditions(now, repeats, warmup, torch.get_num_threads(), cores, load, kernel_in_use())


def summarize(label: str, samples_s: Sequence[float]) -> Timing:
    """A :class:`Timing` from raw samples (s). Raises ValueError for no samples."""
    if not len(samples_s):
        raise ValueError(f"{label}: no samples")
    a = np.asarray(samples_s, dtype=float)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return Timing(label, float(med), float(q1), float(q3), float(a.min()), float(a.max()), tuple(float(x) for x in a))


def measure(cases: Mapping[str, Callable[[], object]], repeats: int = MIN_REPEATS,
            warmup: int = 1) -> tuple[list[Timing], Conditions]:
    """Time every case ``repeats`` times, interleaved, after ``warmup`` untimed runs of each.

    Round r runs the cases starting at index ``r mod len(cases)`` (rotating order). Returns one
    :class:`Timing` per case, in the order of ``cases``, and the :class:`Conditions`.
    Raises ValueError for no cases, ``repeats`` < :data:`MIN_REPEATS` or ``warmup`` < 0."""
    if not cases:
        raise ValueError("cases must name at least one callable")
    cond = conditions(repeats, warmup)
    labels = list(cases)
    for _ in range(warmup):
        for label in labels:
            cases[label]()
    samples: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(repeats):
        for i in range(len(labels)):
            label = labels[(r + i) % len(labels)]
            t0 = time.perf_counter()
            cases[label]()
            samples[label].append(time.perf_counter() - t0)
    return [summarize(label, samples[label]) for label in labels], cond


class LinearFit(NamedTuple):
    """``t(n) = a + b n`` by least squares: ``a_s`` fixed per-call overhead (s), ``b_s`` cost per unit of n
    (s), ``r2`` coefficient of determination (1 = the line explains all variation; NaN for constant t),
    ``b_se_s`` the standard error of ``b_s`` (s; ``inf`` with two points: no residual to estimate it from)."""

    a_s: float
    b_s: float
    r2: float
    b_se_s: float = float("inf")

    @property
    def b_measurable(self) -> bool:
        """True when the per-unit cost is positive and larger than its standard error."""
        return self.b_s > 0 and self.b_s > self.b_se_s

    def at(self, n: float) -> float:
        """The fitted time at n (s)."""
        return self.a_s + self.b_s * n


def fit_linear(ns: Sequence[float], ts: Sequence[float]) -> LinearFit:
    """Least-squares line through ``(n, t)`` points. Raises ValueError for fewer than two distinct n or
    mismatched lengths."""
    x, y = np.asarray(ns, dtype=float), np.asarray(ts, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"ns and ts must be 1-D of equal length, got {x.shape} and {y.shape}")
    if len(np.unique(x)) < 2:
        raise ValueError("fit_linear needs at least two distinct n")
    b, a = np.polyfit(x, y, 1)
    resid = y - (a + b * x)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = float("nan") if ss_tot == 0 else 1.0 - float((resid ** 2).sum()) / ss_tot
    dof = len(x) - 2                                                   # residual degrees of freedom
    b_se = float(np.sqrt(float((resid ** 2).sum()) / dof / float(((x - x.mean()) ** 2).sum()))) if dof > 0 else float("inf")
    return LinearFit(float(a), float(b), r2, b_se)
