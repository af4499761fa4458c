"""What a pool page is: its kind, the pool's error types and its statistics record.

Kept apart from :mod:`serve.memory.pool` (which re-exports every name here) so the pool file holds
only :class:`serve.memory.pool.PagePool`.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

POISON_BYTE = 0xFF  # 0xFFFFFFFF is a NaN in fp32, 0xFFFF a NaN in fp16 and bf16 (fla's habit)


class PageKind(enum.IntEnum):
    """What a page holds: nothing, per-token MLA latent KV, or a per-sequence KDA state."""

    FREE = 0
    MLA_KV = 1
    KDA_STATE = 2


USED_KINDS = (PageKind.MLA_KV, PageKind.KDA_STATE)


class PoolExhausted(RuntimeError):
    """An allocation needed more free pages than the pool has. Nothing was allocated.

    Attributes: kind (:class:`PageKind`), needed (pages asked for), free (pages free at the time).
    """

    def __init__(self, kind: PageKind, needed: int, free: int):
        self.kind, self.needed, self.free = kind, needed, free
        super().__init__(f"pool exhausted: {kind.name} needs {needed} pages, {free} free")


class NoFreeRun(PoolExhausted):
    """A run of consecutive pages was asked for and enough pages are free, but no run of that length is
    (the arena is fragmented). Nothing was allocated.

    Attributes: as :class:`PoolExhausted` (``needed`` = the run's pages), plus ``longest`` (the longest run of
    free pages left for it: after the earlier runs of the same allocation).
    """

    def __init__(self, kind: PageKind, needed: int, free: int, longest: int):
        RuntimeError.__init__(self, f"no run of {needed} consecutive free pages for {kind.name}: {free} pages "
                                    f"free, the longest run {longest} (fragmented pool)")
        self.kind, self.needed, self.free, self.longest = kind, needed, free, longest


class PageError(ValueError):
    """Misuse of a page: double free, releasing a reference the caller does not hold, touching a free
    page, or a view that does not fit the page."""


class PoolStats(NamedTuple):
    """Snapshot of a pool (counts in pages, sizes in bytes).

    pages_by_kind: ``{PageKind: pages}`` for every kind including FREE (sums to num_pages).
    utilisation: used pages / num_pages in [0, 1]. shared_pages: pages with reference count > 1.
    free_runs: maximal runs of consecutive free page ids; largest_free_run: pages in the longest run;
    external_fragmentation: ``1 - largest_free_run / free_pages`` (0 when free space is one run or
    the pool is full) -- only matters to a caller that needs physically consecutive pages.
    """

    num_pages: int
    page_bytes: int
    free_pages: int
    pages_by_kind: dict
    utilisation: float
    shared_pages: int
    free_runs: int
    largest_free_run: int
    external_fragmentation: float


def check_used_kind(kind) -> PageKind:
    if kind is PageKind.MLA_KV or kind is PageKind.KDA_STATE:
        return kind
    raise ValueError(f"kind must be PageKind.MLA_KV or PageKind.KDA_STATE, got {kind!r}")
