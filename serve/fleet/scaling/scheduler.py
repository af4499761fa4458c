"""Per-replica request schedulers: FCFS and the Virtual Token Counter (VTC).

VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI'24; the artifact's
``slora/server/router/vtc_req_queue.py``): one counter per client (here: per class).
- Admission picks the backlogged class with the smallest counter and charges
  ``input_price · input_len / weight`` (input_price = 1).
- Every decode step charges ``output_price / weight`` per generated token (output_price = 2).
- Counter lift: when a class's queue goes from empty to non-empty, its counter becomes
  ``max(own, min(counters of the other backlogged classes))`` — it cannot bank credit while idle.
- Admission stops at the first request that does not fit (as S-LoRA does), so a class is never
  skipped over for a smaller request of another class.

FCFS admits in arrival order and stops at the first request that does not fit.
Both expose ``push``, ``pop_admissible(fits)``, ``remove``, ``on_decode``, ``__len__``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Protocol


class Schedulable(Protocol):
    request_id: int
    klass: str
    input_length: int


class FCFSScheduler:
    """First come, first served (arrival order of ``push``)."""

    name = "fcfs"

    def __init__(self, weights: dict[str, float] | None = None):
        self._queue: deque = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, req: Schedulable) -> None:
        self._queue.append(req)

    def remove(self, req: Schedulable) -> bool:
        """Drop ``req`` if queued (abort / re-route); returns whether it was there."""
        try:
            self._queue.remove(req)
            return True
        except ValueError:
            return False

    def pop_admissible(self, fits: Callable[[Schedulable], bool]) -> list:
        """Pop requests in order while ``fits(req)`` (which may record the reservation)."""
        out = []
        while self._queue and fits(self._queue[0]):
            out.append(self._queue.popleft())
        return out

    def on_decode(self, klass: str, tokens: int) -> None:
        """FCFS keeps no per-class state."""

    def steps_until_pick_changes(self, growth: dict[str, float]) -> int | None:
        """FCFS order never changes while nothing arrives or finishes."""
        return None

    def drain(self) -> list:
        out = list(self._queue)
        self._queue.clear()
        return out

    def check_integrity(self) -> None:
        ids = [r.request_id for r in self._queue]
        assert len(ids) == len(set(ids)), "a request is queued twice"


class VTCScheduler:
    """Virtual token counter fair scheduler (see module docstring). ``weights`` per class (default 1)."""

    name = "vtc"
    INPUT_PRICE = 1.0
    OUTPUT_PRICE = 2.0

    def __init__(self, weights: dict[str, float] | None = None):
        self.weights = dict(weights or {})
        if any(not w > 0 for w in self.weights.values()):
            raise ValueError(f"class weights must be > 0, got {self.weights}")
        self.counters: dict[str, float] = {}
        self._queues: dict[str, deque] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def _weight(self, klass: str) -> float:
        return self.weights.get(klass, 1.0)

    def push(self, req: Schedulable) -> None:
        q = self._queues.setdefault(req.klass, deque())
        self.counters.setdefault(req.klass, 0.0)
        q.append(req)
        self._size += 1
        if len(q) == 1:  # lift: the class was idle
            others = [self.counters[k] for k, qq in self._queues.items() if qq and k != req.klass]
            if others:
                self.counters[req.klass] = max(self.counters[req.klass], min(others))

    def remove(self, req: Schedulable) -> bool:
        q = self._queues.get(req.klass)
        if q is None:
            return False
        try:
            q.remove(req)
        except ValueError:
            return False
        self._size -= 1
        return True

    def pop_admissible(self, fits: Callable[[Schedulable], bool]) -> list:
        out = []
        while True:
            backlogged = [k for k, q in self._queues.items() if q]
            if not backlogged:
                return out
            klass = min(backlogged, key=lambda k: self.counters[k])  # ties: first class seen
            req = self._queues[klass][0]
            if not fits(req):
                return out
            self._queues[klass].popleft()
            self._size -= 1
            self.counters[klass] += self.INPUT_PRICE * req.input_length / self._weight(klass)
            out.append(req)

    def on_decode(self, klass: str, tokens: int) -> None:
        """Charge ``tokens`` generated tokens of ``klass``."""
        self.counters[klass] = self.counters.get(klass, 0.0) + self.OUTPUT_PRICE * tokens / self._weight(klass)

    def _pick(self) -> str | None:
        backlogged = [k for k, q in self._queues.items() if q]
        return min(backlogged, key=lambda k: self.counters[k]) if backlogged else None

    def steps_until_pick_changes(self, growth: dict[str, float]) -> int | None:
        """Decode steps until another backlogged class has the smallest counter, when each class's
        counter grows by ``growth[class]`` per step (``OUTPUT_PRICE · running / weight``); None if never.
        Ties keep the first class in ``_queues`` order, as ``min`` does in ``pop_admissible``."""
        current = self._pick()
        if current is None:
            return None
        order = list(self._queues)
        g_m, c_m, i_m = growth.get(current, 0.0), self.counters[current], order.index(current)
        best: int | None = None
        for k, q in self._queues.items():
            if not q or k == current:
                continue
            g_c = growth.get(k, 0.0)
            if g_c >= g_m:
                continue  # never catches up from above
            gap = (self.counters[k] - c_m) / (g_m - g_c)  # steps until equal counters
            j = math.ceil(gap) if order.index(k) < i_m else math.floor(gap) + 1
            j = max(1, j)
            best = j if best is None else min(best, j)
        return best

    def drain(self) -> list:
        out = sorted((r for q in self._queues.values() for r in q), key=lambda r: r.request_id)
        for q in self._queues.values():
            q.clear()
        self._size = 0
        return out

    def check_integrity(self) -> None:
        ids = [r.request_id for q in self._queues.values() for r in q]
        assert len(ids) == len(set(ids)) == self._size, "queue size or uniqueness broken"
        assert all(c >= 0 for c in self.counters.values())


SCHEDULERS = {"fcfs": FCFSScheduler, "vtc": VTCScheduler}
