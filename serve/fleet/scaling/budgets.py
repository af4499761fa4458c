"""Priority classes and token budgets (admission control before routing).

A :class:`PriorityClass` has a scheduling ``weight`` (used by the VTC scheduler: a class with weight
2 gets twice the token share of a class with weight 1 when both are backlogged) and an optional token
bucket: ``rate_tokens_per_s`` refill and ``burst_tokens`` capacity. A request costs
``input_length + output_length`` tokens (the VTC paper's "service" counts both). Admission is FIFO
per class: a request waits until the bucket holds its cost; one larger than ``burst_tokens`` can
never be admitted and is rejected.

Invariant (tested): tokens admitted for a class in [0, t] ≤ ``burst_tokens + rate · t``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PriorityClass:
    """A class of requests; ``rate_tokens_per_s=None`` means no bucket (unlimited admission)."""

    name: str
    weight: float = 1.0
    rate_tokens_per_s: float | None = None
    burst_tokens: float | None = None

    def __post_init__(self):
        if not self.name:
            raise ValueError("PriorityClass.name must be non-empty")
        if not self.weight > 0:
            raise ValueError(f"PriorityClass.weight must be > 0, got {self.weight}")
        if (self.rate_tokens_per_s is None) != (self.burst_tokens is None):
            raise ValueError("give both rate_tokens_per_s and burst_tokens, or neither")
        if self.rate_tokens_per_s is not None and not (self.rate_tokens_per_s > 0 and self.burst_tokens > 0):
            raise ValueError("rate_tokens_per_s and burst_tokens must be > 0")

    @property
    def has_bucket(self) -> bool:
        return self.rate_tokens_per_s is not None


class TokenBucket:
    """Token bucket, time in ms. Starts full at ``start_ms``.

    ``available(now_ms)`` refills lazily; ``take(now_ms, cost)`` debits (ValueError if not enough);
    ``wait_ms(now_ms, cost)`` is the time until ``cost`` tokens are there (inf if cost > burst).
    """

    def __init__(self, rate_tokens_per_s: float, burst_tokens: float, start_ms: float = 0.0):
        if not (rate_tokens_per_s > 0 and burst_tokens > 0):
            raise ValueError("rate_tokens_per_s and burst_tokens must be > 0")
        self.rate_per_ms = rate_tokens_per_s / 1000.0
        self.burst_tokens = float(burst_tokens)
        self.start_ms = start_ms
        self._tokens = float(burst_tokens)
        self._last_ms = start_ms
        self.admitted_tokens = 0.0

    def available(self, now_ms: float) -> float:
        if now_ms < self._last_ms:
            raise ValueError(f"time went backwards: {now_ms} < {self._last_ms}")
        self._tokens = min(self.burst_tokens, self._tokens + (now_ms - self._last_ms) * self.rate_per_ms)
        self._last_ms = now_ms
        return self._tokens

    def wait_ms(self, now_ms: float, cost: float) -> float:
        if cost > self.burst_tokens:
            return math.inf
        missing = cost - self.available(now_ms)
        return 0.0 if missing <= 0 else missing / self.rate_per_ms

    def take(self, now_ms: float, cost: float) -> None:
        # tolerance: a refill computed by wait_ms() may land a rounding error short of ``cost``
        if self.available(now_ms) < cost - 1e-6:
            raise ValueError(f"bucket holds {self._tokens:.1f} tokens, request costs {cost}")
        self._tokens = max(0.0, self._tokens - cost)
        self.admitted_tokens += cost

    def check_integrity(self, now_ms: float) -> None:
        """0 ≤ tokens ≤ burst, and admitted ≤ burst + rate · elapsed (+ rounding)."""
        assert -1e-9 <= self._tokens <= self.burst_tokens + 1e-9
        assert self.admitted_tokens <= self.burst_tokens + self.rate_per_ms * (now_ms - self.start_ms) + 1e-3
