"""Our prefix cache (this repo's engine), as a policy: a wrapper over :func:`serve.prefix.sim.replay_trace`.

The rules live in one place: :class:`serve.prefix.index.PrefixIndex` (chained block keys, per-group
checkpoints, two-phase lookup, kind-aware LRU) driven by :func:`serve.prefix.sim.replay_trace` (checkpoints
every C tokens + the replay boundary + the prompt end, :meth:`serve.config.ServeConfig.prefill_checkpoints`;
lookup capped at L - 1; eviction to a byte capacity after each request), the same index the engine's
:class:`serve.prefix.cache.PrefixCache` uses. This class only maps a replica budget onto a
:class:`serve.prefix.sim.TraceReplayConfig` and the simulator's result onto a
:class:`serve.scale.policies.base.PolicyResult`. :func:`serve.scale.policies.base.replay` replays whole
traces through ``replay_trace``; the fleet simulation drives one request at a time through ``lookup`` /
``admit`` / ``evict_to`` over the same :class:`serve.prefix.sim.ReplayCache`.

Bytes: a KV block = ``replica.kv_bytes_per_token x N``; a checkpoint of group g = that group's KDA layers'
state (:func:`serve.memory.layout.group_state_bytes`), so a complete checkpoint = one sequence's state. One
running request holds one working state (all groups), reserved from the budget.
"""
from __future__ import annotations

import numpy as np

from kda_core.config import PRESETS
from serve.config import ServeConfig
from serve.memory.layout import group_layers, group_state_bytes
from serve.prefix.sim import ReplayCache, TraceReplayConfig, replay_trace
from serve.scale.policies.base import PolicyResult, ReplicaBytes, cache_bytes, running_bytes
from serve.traces.mooncake import MOONCAKE_BLOCK_TOKENS, ideal_hit_ratio


class OursPolicy:
    """Our engine's policy: blocks of N (= the trace block), checkpoints every ``checkpoint_interval`` tokens
    per group, ``num_groups`` groups, two-phase lookup. Raises ValueError via :class:`ServeConfig` for an
    interval that is not a positive multiple of N, and for an unknown preset."""

    running_state_slots = 1

    def __init__(self, preset: str, checkpoint_interval: int = 4 * MOONCAKE_BLOCK_TOKENS, num_groups: int = 1,
                 tp_size: int = 1, block_size: int = MOONCAKE_BLOCK_TOKENS):
        self.replica = ReplicaBytes.for_preset(preset, tp_size)
        cfg = PRESETS[preset]
        self.serving = ServeConfig(block_size, checkpoint_interval, num_groups)   # validates now
        self.groups = tuple(group_state_bytes(cfg, len(g)) for g in group_layers(cfg, num_groups))
        self.name = f"ours C={checkpoint_interval} G={num_groups}"

    @property
    def block_size(self) -> int:
        """N tokens per block (the trace block)."""
        return self.serving.block_size

    @property
    def state_bytes(self) -> int:
        """One sequence's working state (all groups), the running request's slot."""
        return self.replica.state_bytes

    def config(self, capacity_bytes: float | None) -> TraceReplayConfig:
        """The trace replay's config for a cache capacity (bytes; None = unlimited)."""
        N = self.serving.block_size
        return TraceReplayConfig(self.serving, self.replica.kv_bytes_per_token * N, self.groups, capacity_bytes)

    def replay_trace(self, requests, budget_bytes: float, check_every: int = 0) -> PolicyResult:
        """Replay through :func:`serve.prefix.sim.replay_trace` (which checks its own invariants: ``check_every``
        is not used) with capacity = budget - one running state (:func:`serve.scale.policies.base.cache_bytes`)."""
        running = running_bytes(self)
        res = replay_trace(requests, self.config(cache_bytes(self, budget_bytes)))
        ideal = ideal_hit_ratio(requests, self.block_size).hit_tokens
        peak = {"kv": res.peak_kv_bytes, "state": res.peak_state_bytes, "running": running}
        at_peak = {"kv": res.at_peak_kv_bytes, "state": res.at_peak_state_bytes, "running": running}
        return PolicyResult(
            name=self.name, token_hit_ratio=res.token_hit_ratio, hit_tokens=res.hit_tokens,
            total_tokens=res.total_tokens, ideal_hit_tokens=ideal,
            request_hit_tokens=np.asarray(res.request_hit_tokens, dtype=np.int64), peak_bytes=peak,
            states_written=res.checkpoints_written, states_evicted=res.evicted_checkpoints,
            kv_evicted_tokens=res.evicted_blocks * self.block_size,
            lost_to_missing_state=res.miss_tokens["kv_no_checkpoint"], budget_bytes=float(budget_bytes),
            seconds=res.seconds, held_at_peak=at_peak)

    # ---- one request at a time (the fleet simulation) ---------------------------------------------
    @property
    def cache(self) -> ReplayCache:
        """The per-request cache (created on first use; unlimited capacity, ``evict_to`` trims it)."""
        if getattr(self, "_cache", None) is None:
            self._cache = ReplayCache(self.config(None))
        return self._cache

    def lookup(self, r) -> tuple[int, int]:
        """(hit tokens, KV-reusable tokens) of request ``r`` by the engine's two-phase walk; pure."""
        kv_tokens, hit_blocks = self.cache.walk(r)
        N = self.block_size
        return hit_blocks * N, kv_tokens // N * N

    def admit(self, r, hit_tokens: int) -> None:
        """The request ran with ``hit_tokens`` (re-walked if the cache changed since the lookup)."""
        self.cache.admit(r, hit_tokens // self.block_size)

    def evict_to(self, cache_bytes: float) -> None:
        self.cache.evict_to(cache_bytes)

    def bytes_by_kind(self) -> dict:
        return {"kv": self.cache.kv_used, "state": self.cache.st_used}

    def check_integrity(self) -> None:
        self.cache.idx.check_integrity(self.block_size)

    @property
    def states_written(self) -> int:
        return self.cache.written

    @property
    def states_evicted(self) -> int:
        return self.cache.ev_ck

    @property
    def kv_evicted_tokens(self) -> int:
        return self.cache.ev_kv * self.block_size
