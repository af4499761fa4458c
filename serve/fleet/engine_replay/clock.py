"""The replay's two clocks: strict (the engine's own thread CPU time) and wall.

A clock answers ``now_ms()``, runs one step boundary's work with :meth:`run` (returning that work's CPU and wall
ms, both always measured) and lets an idle engine wait for the next arrival (:meth:`wait_until`).

- :class:`CpuClock` (LLMServingSim's strict replay): virtual time that advances by the CPU time of the thread
  that runs the work (``time.thread_time``, this thread only; run torch with 1 thread so the model's compute is
  on it), so other processes on the host change nothing but the CPU time's own cache and frequency noise. An
  idle gap jumps to the next arrival.
- :class:`WallClock`: ``time.perf_counter`` since the replay started; an idle gap sleeps until the arrival.
"""
from __future__ import annotations

import time
from collections.abc import Callable


class CpuClock:
    """Virtual ms advanced by each :meth:`run`'s thread CPU time; starts at 0."""

    name = "cpu"

    def __init__(self):
        self._now_ms = 0.0

    def now_ms(self) -> float:
        return self._now_ms

    def run(self, work: Callable[[], object]) -> tuple[float, float]:
        """Run ``work()``; advance by its thread CPU time. Returns ``(cpu_ms, wall_ms)``."""
        c0, t0 = time.thread_time(), time.perf_counter()
        work()
        cpu_ms, wall_ms = (time.thread_time() - c0) * 1e3, (time.perf_counter() - t0) * 1e3
        self._now_ms += cpu_ms
        return cpu_ms, wall_ms

    def wait_until(self, t_ms: float) -> None:
        """An idle engine: jump to ``t_ms`` (never back)."""
        self._now_ms = max(self._now_ms, t_ms)


class WallClock:
    """``time.perf_counter`` ms since construction."""

    name = "wall"

    def __init__(self):
        self._t0 = time.perf_counter()

    def now_ms(self) -> float:
        return (time.perf_counter() - self._t0) * 1e3

    def run(self, work: Callable[[], object]) -> tuple[float, float]:
        """Run ``work()``. Returns ``(cpu_ms, wall_ms)`` of it (the clock moves by itself)."""
        c0, t0 = time.thread_time(), time.perf_counter()
        work()
        return (time.thread_time() - c0) * 1e3, (time.perf_counter() - t0) * 1e3

    def wait_until(self, t_ms: float) -> None:
        """An idle engine: sleep until ``t_ms``."""
        delay = t_ms - self.now_ms()
        if delay > 0:
            time.sleep(delay / 1e3)


CLOCKS = {"cpu": CpuClock, "wall": WallClock}
