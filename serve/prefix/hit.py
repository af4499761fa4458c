"""What a :class:`serve.prefix.cache.PrefixCache` hands out: the hit of a lookup, the steps of the
two-phase lookup, stored checkpoints and counters, and the error for a checkpoint off its boundary."""
from __future__ import annotations

from typing import NamedTuple


class CheckpointError(RuntimeError):
    """A checkpoint's written-at length differs from its boundary (a state would be off by tokens)."""


class CheckpointInfo(NamedTuple):
    """One stored checkpoint: ``boundary`` tokens, ``group``, ``key`` (hex prefix of the chained key),
    ``written_at`` (tokens the state had consumed when written), ``num_pages``, ``pins`` (requests)."""

    boundary: int
    group: int
    key: str
    written_at: int
    num_pages: int
    pins: int


class PrefixHit(NamedTuple):
    """Result of a lookup.

    num_tokens: restore boundary b (multiple of N; 0 = nothing usable); kv_tokens: phase-1 bound
    (cached KV tokens, capped at len - 1); num_prompt_tokens: len; keys: chained keys of the prompt's
    full blocks; kv_pages: pages of blocks ``[0, b / N)``; checkpoint_pages: per group, the pages of the
    checkpoint at b (() when b = 0).
    """

    num_tokens: int
    kv_tokens: int
    num_prompt_tokens: int
    keys: tuple
    kv_pages: tuple
    checkpoint_pages: tuple

    @property
    def checkpoint_key(self) -> bytes | None:
        """Chained key of the checkpoint used (None when num_tokens = 0)."""
        return self.keys[len(self.kv_pages) - 1] if self.kv_pages else None


class LookupStep(NamedTuple):
    """One step of the two-phase lookup (page 07): phase 1 or 2, block index, boundary (tokens after
    the block), whether the block / a complete checkpoint was found, groups present, and a note."""

    phase: int
    block: int
    boundary: int
    found: bool
    groups: tuple
    note: str


class CacheStats(NamedTuple):
    """Counters (blocks, checkpoints, pages; tokens for lookups)."""

    kv_blocks: int
    checkpoints: int
    complete_boundaries: int
    kv_pages: int
    state_pages: int
    lookups: int
    lookup_tokens: int
    hit_tokens: int
    evicted_blocks: int
    evicted_checkpoints: int
    published_checkpoints: int
    failed_checkpoints: int
