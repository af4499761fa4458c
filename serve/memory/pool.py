"""``PagePool``: one arena of equal-size pages shared by MLA latent KV and KDA state.

A hybrid KDA/MLA model caches two opposite shapes: MLA keeps latent KV *per token* (grows with
context), KDA keeps a recurrent + conv state *per sequence* (fixed size, overwritten in place). One
pool of equal-size pages, each tagged with its :class:`PageKind`, serves both -- the design of
vLLM's hybrid KV cache manager (``vllm/v1/core/kv_cache_coordinator.py``) and SGLang's unified
memory pool. The bytes live in one real ``uint8`` tensor ``arena [num_pages, page_bytes]``;
:meth:`PagePool.view` hands out typed in-place views, so caches are written and read in place.

Per page the pool keeps a kind, a reference count, the owner that allocated it and the holders of
its references (``{owner: count}``, summing to the reference count). A page is free iff its
reference count is 0, iff its kind is ``PageKind.FREE``, iff it is among the free ids
(:class:`serve.memory.free_pages.FreePages`).

Runs. A KDA group state that spans several pages (the "multi_page" policy) is read and written in place
only if its pages are consecutive ids: :meth:`PagePool.alloc_runs` hands out such runs (a request's slot is
then the run's first page; :func:`serve.memory.pages.slot_views`), from the high end of the arena while
:meth:`PagePool.alloc` hands out the smallest free ids (:mod:`serve.memory.free_pages`). A shared arena can be
fragmented: enough pages free but no run of the size asked; :meth:`PagePool.alloc_runs` then raises
:class:`NoFreeRun` (a :class:`PoolExhausted`) and :meth:`PagePool.can_alloc_runs` answers beforehand.

Contract (every public method): arguments are validated first, and a call that raises changes
nothing (all-or-nothing). Page ids returned by :meth:`alloc` stay valid until the last reference is
dropped by :meth:`decref`; a view returned by :meth:`view` aliases the page bytes and must not be
used after the page is freed (the bytes may then belong to another request).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from itertools import groupby
from operator import itemgetter

import torch

from serve.errors import check_int
from serve.memory.free_pages import FreePages
from serve.memory.kinds import (
    POISON_BYTE,
    USED_KINDS,
    NoFreeRun,
    PageError,
    PageKind,
    PoolExhausted,
    PoolStats,
    check_used_kind,
)


def _check_owner(owner) -> None:
    """Raise ValueError unless ``owner`` can own pages: not None (None marks a free page) and hashable
    (it keys a shared page's holders; a list owner used to be stored, then fail as a raw TypeError at
    the first share)."""
    if owner is None:
        raise ValueError("owner must not be None (None marks a free page)")
    try:
        hash(owner)
    except TypeError:
        raise ValueError(f"owner must be hashable (a request id, a name), got {type(owner).__name__} "
                         f"{owner!r}") from None


class PagePool:
    """A pool of ``num_pages`` pages of ``page_bytes`` bytes each, backed by ``arena [num_pages, page_bytes]``
    (``torch.uint8``).

    Args:
        num_pages: pages in the pool (> 0). page_bytes: bytes per page (> 0).
        poison: if True, the arena starts filled with ``0xFF`` bytes and every page is re-filled on
            allocation, so a float read of a never-written page yields NaN and fails loudly (tests).
    Raises ValueError on non-positive sizes.
    """

    def __init__(self, num_pages: int, page_bytes: int, poison: bool = False):
        self.num_pages = check_int("num_pages", num_pages)
        self.page_bytes = check_int("page_bytes", page_bytes)
        self.poison = bool(poison)
        self.arena = torch.empty((num_pages, page_bytes), dtype=torch.uint8)  # [num_pages, page_bytes]
        if self.poison:
            self.arena.fill_(POISON_BYTE)
        self._kind = [PageKind.FREE] * num_pages
        self._ref = [0] * num_pages
        self._owner: list[Hashable | None] = [None] * num_pages
        self._holders: list[dict | None] = [None] * num_pages  # None: {owner: ref} (not shared)
        self._free = FreePages(num_pages)
        self._count = {PageKind.MLA_KV: 0, PageKind.KDA_STATE: 0}

    @property
    def total_bytes(self) -> int:
        """Arena size in bytes: num_pages * page_bytes."""
        return self.num_pages * self.page_bytes

    @property
    def num_free(self) -> int:
        """Free pages right now."""
        return len(self._free)

    def num_used(self, kind: PageKind | None = None) -> int:
        """Pages in use, of ``kind`` (MLA_KV / KDA_STATE) or of both (None)."""
        if kind is None:
            return self.num_pages - len(self._free)
        return self._count[check_used_kind(kind)]

    # ---- allocation and references --------------------------------------------------------------
    def alloc(self, kind: PageKind, n: int, owner: Hashable) -> list[int]:
        """Allocate ``n`` pages of ``kind`` for ``owner``, each with reference count 1.

        Mutates: the free list, kind / ref count / owner / holders of the returned pages (and their
        bytes when ``poison``). Returns the page ids (``n == 0`` returns ``[]``).
        Raises ValueError (unknown kind, ``n`` not an int >= 0, owner None or unhashable) and
        :class:`PoolExhausted` (``n`` > free pages); on any error nothing changes.
        """
        kind = check_used_kind(kind)
        check_int("n", n, 0)
        _check_owner(owner)
        free = self._free
        if n > len(free):
            raise PoolExhausted(kind, n, len(free))
        if n == 0:
            return []
        pages = free.pop_lowest(n)                         # the n smallest free ids, ascending
        self._take(pages, kind, owner)
        return pages

    def _take(self, pages: list[int], kind: PageKind, owner: Hashable) -> None:
        """Mark ``pages`` (already taken off the free ids) used by ``owner``, one reference each."""
        kinds, refs, owners = self._kind, self._ref, self._owner
        for p in pages:  # holders stay None: the owner holds the only reference
            kinds[p] = kind
            refs[p] = 1
            owners[p] = owner
        self._count[kind] += len(pages)
        if self.poison:
            self.arena.index_fill_(0, torch.tensor(pages), POISON_BYTE)

    # ---- runs of consecutive pages (a multi-page state read in place) -----------------------------
    def can_alloc_runs(self, sizes: Sequence[int], also_free: Sequence[int] = ()) -> bool:
        """Whether :meth:`alloc_runs` of ``sizes`` (pages per run, each >= 1) would succeed now, or once the used
        pages ``also_free`` are freed too (what evicting a prefix cache would free). Pure.
        Raises ValueError for a size that is not an int >= 1 or an ``also_free`` id outside the pool."""
        sizes = [check_int("size", n) for n in sizes]
        also_free = [self._check_id(p) for p in also_free]
        if sum(sizes) > len(self._free) + len(also_free):    # a quick no (find_runs is exact)
            return False
        try:
            self._free.find_runs(sizes, PageKind.KDA_STATE, also_free)
        except NoFreeRun:
            return False
        return True

    def longest_free_run(self) -> int:
        """Pages of the longest run of consecutive free ids (0 when none is free)."""
        return self._free.longest_run()

    def alloc_run(self, kind: PageKind, n: int, owner: Hashable) -> list[int]:
        """Allocate ``n`` consecutive page ids ``[first, first + n)`` of ``kind`` for ``owner`` (the highest free
        run), each with reference count 1; :meth:`alloc_runs` of one run."""
        return self.alloc_runs(kind, [n], owner)[0]

    def alloc_runs(self, kind: PageKind, sizes: Sequence[int], owner: Hashable) -> list[list[int]]:
        """Allocate one run of consecutive ids per entry of ``sizes`` (pages each, >= 1), each the highest
        free run of its size at its turn, one reference each; all or nothing.

        Mutates: the free ids, kind / ref count / owner of the pages (their bytes when ``poison``).
        Returns each run's ids, ascending. Raises ValueError (unknown kind, a size not an int >= 1, owner None
        or unhashable), :class:`PoolExhausted` (fewer free pages than ``sum(sizes)``) and :class:`NoFreeRun`
        (enough free pages but no run of some size: fragmentation); on any error nothing changes."""
        kind = check_used_kind(kind)
        sizes = [check_int("size", n) for n in sizes]
        _check_owner(owner)
        need = sum(sizes)
        if need > len(self._free):
            raise PoolExhausted(kind, need, len(self._free))
        runs = self._free.find_runs(sizes, kind)
        pages = [p for run in runs for p in run]
        self._free.take(pages)                             # O(free pages), once per admission
        self._take(pages, kind, owner)
        return runs

    def is_run(self, pages: Sequence[int]) -> bool:
        """Whether ``pages`` are consecutive ascending ids (a run; an empty list is not)."""
        return bool(pages) and list(pages) == list(range(pages[0], pages[0] + len(pages)))

    def _check_used(self, pages: Iterable[int], what: str) -> list[int]:
        """Validate ids (ints in range) and that no page is free; returns the ids as a list."""
        pages = pages if type(pages) is list else list(pages)
        if not pages:
            return pages
        kinds = self._kind
        if any(type(p) is not int for p in pages):  # bools (True would be page 1), floats, numpy scalars
            p = next(p for p in pages if type(p) is not int)
            raise ValueError(f"{what}: page ids must be ints in [0, {self.num_pages}), got {p!r} "
                             f"({type(p).__name__})")
        try:
            bad = min(pages) < 0 or any(kinds[p] is PageKind.FREE for p in pages)
        except (IndexError, TypeError):
            raise ValueError(f"{what}: page ids must be ints in [0, {self.num_pages}), got {pages!r}") from None
        if bad:
            if min(pages) < 0:
                raise ValueError(f"{what}: page ids must be ints in [0, {self.num_pages}), got {min(pages)}")
            p = next(p for p in pages if kinds[p] is PageKind.FREE)
            raise PageError(f"{what}: page {p} is free (double free or use after free)")
        return pages

    def _held(self, page: int, owner: Hashable) -> int:
        """References ``owner`` holds to a used ``page``."""
        h = self._holders[page]
        if h is None:  # only the allocating owner holds references
            return self._ref[page] if self._owner[page] == owner else 0
        return h.get(owner, 0)

    def incref(self, pages: Iterable[int], owner: Hashable) -> None:
        """Add one reference held by ``owner`` to each page (a page may repeat: one reference per entry).

        Mutates: ref counts and holders. Raises ValueError (an id that is not an int in range, e.g. a
        bool, or owner None or unhashable) / PageError (free page); on error nothing changes.
        """
        _check_owner(owner)
        pages = self._check_used(pages, "incref")
        refs, holders, owners = self._ref, self._holders, self._owner
        for p in pages:
            h = holders[p]
            if h is None and owners[p] != owner:  # first reference by a second owner: track holders
                h = holders[p] = {owners[p]: refs[p]}
            if h is not None:
                h[owner] = h.get(owner, 0) + 1
            refs[p] += 1

    def decref(self, pages: Iterable[int], owner: Hashable) -> list[int]:
        """Drop one reference held by ``owner`` from each page; a page at 0 returns to the free list.

        Mutates: ref counts, holders, the free list and the kind of freed pages. Returns the page ids
        that became free. Raises ValueError for an id that is not an int in range (bools included:
        ``True`` is not page 1); PageError for a free page (double free) or a reference ``owner`` does
        not hold (freeing a page you do not own); on error nothing changes.
        """
        pages = pages if type(pages) is list else list(pages)
        n = len(pages)
        if n == 1:  # fast path for one private page
            p = pages[0]
            if type(p) is int and 0 <= p < self.num_pages and self._ref[p] == 1 and self._holders[p] is None \
                    and self._owner[p] == owner and self._kind[p] is not PageKind.FREE:
                self._count[self._kind[p]] -= 1
                self._kind[p], self._ref[p], self._owner[p] = PageKind.FREE, 0, None
                self._free.push((p,))
                return [p]
        elif n > 1:  # fast path: every page private to owner with one reference (C-level tuple checks)
            try:
                get = itemgetter(*pages)
                ks = get(self._kind)
                fast = (min(pages) >= 0 and PageKind.FREE not in ks and get(self._holders).count(None) == n
                        and get(self._owner).count(owner) == n and get(self._ref).count(1) == n
                        and len(set(pages)) == n and set(map(type, pages)) == {int})  # no bools
            except (IndexError, TypeError):
                fast = False
            if fast:
                kinds, refs, owners = self._kind, self._ref, self._owner
                for p in pages:
                    kinds[p] = PageKind.FREE
                    refs[p] = 0
                    owners[p] = None
                self._free.push(pages)
                freed_mla = ks.count(PageKind.MLA_KV)
                self._count[PageKind.MLA_KV] -= freed_mla
                self._count[PageKind.KDA_STATE] -= n - freed_mla
                return list(pages)
        return self._decref_general(pages, owner)

    def _decref_general(self, pages: list[int], owner: Hashable) -> list[int]:
        """:meth:`decref` for shared pages, repeated ids and every error case."""
        _check_owner(owner)
        pages = self._check_used(pages, "decref")
        holders, owners = self._holders, self._owner
        for p in pages:
            h = holders[p]
            if (owners[p] != owner) if h is None else (owner not in h):
                raise PageError(f"decref: {owner!r} holds no reference to page {p} "
                                f"(owner {owners[p]!r}, holders {h})")
        if len(set(pages)) != len(pages):
            for p, k in Counter(pages).items():
                if self._held(p, owner) < k:
                    raise PageError(f"decref: {owner!r} holds {self._held(p, owner)} references to "
                                    f"page {p}, asked to drop {k} (double free)")
        refs, kinds = self._ref, self._kind
        freed, freed_mla = [], 0
        for p in pages:
            h = holders[p]
            if h is not None:
                c = h[owner] - 1
                if c:
                    h[owner] = c
                else:
                    del h[owner]
            r = refs[p] = refs[p] - 1
            if r == 0:
                freed_mla += kinds[p] is PageKind.MLA_KV
                kinds[p] = PageKind.FREE
                owners[p] = None
                holders[p] = None
                freed.append(p)
        self._free.push(freed)
        self._count[PageKind.MLA_KV] -= freed_mla
        self._count[PageKind.KDA_STATE] -= len(freed) - freed_mla
        return freed

    def free(self, pages: Iterable[int], owner: Hashable) -> list[int]:
        """Alias of :meth:`decref` (release ``owner``'s reference); pages shared by others stay alive."""
        return self.decref(pages, owner)

    # ---- sharing: fork and copy-on-write ----------------------------------------------------------
    def fork(self, pages: Iterable[int], new_owner: Hashable) -> list[int]:
        """Share ``pages`` with ``new_owner`` (one more reference each, no bytes copied). Returns the
        same page ids. Raises as :meth:`incref`."""
        pages = list(pages)
        self.incref(pages, new_owner)
        return pages

    def copy_page(self, src: int, dst: int) -> None:
        """Copy the bytes of page ``src`` into page ``dst`` (both in use). Mutates dst's bytes only."""
        self._check_used([src, dst], "copy_page")
        self.arena[dst].copy_(self.arena[src])

    def copy_on_write(self, page: int, owner: Hashable) -> int:
        """Make ``page`` private to ``owner`` before a write.

        If ``owner`` holds the only reference, returns ``page`` unchanged. Otherwise allocates a page
        of the same kind for ``owner``, copies the bytes, drops ``owner``'s reference to the shared
        page and returns the new id. Raises PageError if ``owner`` holds no reference to ``page``,
        PoolExhausted if no page is free (nothing changes then).
        """
        _check_owner(owner)
        self._check_used([page], "copy_on_write")
        if self._held(page, owner) == 0:
            raise PageError(f"copy_on_write: {owner!r} holds no reference to page {page}")
        if self._ref[page] == 1:
            return page
        (new,) = self.alloc(self._kind[page], 1, owner)
        self.arena[new].copy_(self.arena[page])
        self.decref([page], owner)
        return new

    # ---- inspection -------------------------------------------------------------------------------
    def kind(self, page: int) -> PageKind:
        """Kind of ``page`` (FREE when free)."""
        return self._kind[self._check_id(page)]

    def refcount(self, page: int) -> int:
        """Reference count of ``page`` (0 when free)."""
        return self._ref[self._check_id(page)]

    def owner(self, page: int) -> Hashable | None:
        """Owner that allocated ``page`` (None when free)."""
        return self._owner[self._check_id(page)]

    def holders(self, page: int) -> dict:
        """``{owner: references}`` of ``page`` (a new dict; {} when free)."""
        self._check_id(page)
        if self._kind[page] is PageKind.FREE:
            return {}
        h = self._holders[page]
        return {self._owner[page]: self._ref[page]} if h is None else dict(h)

    def _check_id(self, page: int) -> int:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ValueError(f"page must be an int in [0, {self.num_pages}), got {page!r}")
        return page

    def page_table(self) -> list[tuple[PageKind, Hashable | None, int]]:
        """Per page ``(kind, owner, refcount)``, in page-id order (for drawing the pool)."""
        return list(zip(self._kind, self._owner, self._ref))

    # ---- typed views ------------------------------------------------------------------------------
    def view(self, page: int, dtype: torch.dtype, shape: tuple[int, ...], offset_bytes: int = 0) -> torch.Tensor:
        """A typed tensor of ``shape`` and ``dtype`` aliasing the bytes of ``page`` from ``offset_bytes``.

        Writes to the view write the pool. Raises PageError when the page is free, the view does not
        fit (``offset_bytes + prod(shape) * itemsize > page_bytes``) or the offset is not a multiple of
        the element size; ValueError for a bad page id, dtype or negative shape / offset.
        """
        self._check_id(page)
        if self._kind[page] is PageKind.FREE:
            raise PageError(f"view: page {page} is free")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        shape = tuple(shape)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape):
            raise ValueError(f"shape must be a tuple of ints >= 0, got {shape!r}")
        check_int("offset_bytes", offset_bytes, 0)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        if offset_bytes + nbytes > self.page_bytes:
            raise PageError(f"view of {shape} {dtype} ({nbytes} bytes) at offset {offset_bytes} does not fit "
                            f"a page of {self.page_bytes} bytes")
        start = page * self.page_bytes + offset_bytes
        if start % itemsize:
            raise PageError(f"view: byte offset {start} in the arena is not a multiple of {dtype}'s "
                            f"{itemsize}-byte element size (choose page_bytes / offset_bytes aligned)")
        return self.arena[page, offset_bytes: offset_bytes + nbytes].view(dtype).view(shape)

    def typed_arena(self, dtype: torch.dtype, page_shape: tuple[int, ...]) -> torch.Tensor:
        """The whole arena as ``[num_pages, *page_shape]`` of ``dtype`` (each page's first bytes), for
        batched ``index_select`` gathers over page tables. Raises PageError if ``page_shape`` does not
        fit a page or ``page_bytes`` is not a multiple of the element size."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_page = math.prod(page_shape)
        if self.page_bytes % itemsize or per_page * itemsize > self.page_bytes:
            raise PageError(f"page shape {page_shape} of {dtype} does not fit / align with "
                            f"{self.page_bytes}-byte pages")
        typed = self.arena.view(dtype)                                    # [num_pages, page_bytes / s]
        return typed[:, :per_page].view((self.num_pages, *page_shape))     # [num_pages, *page_shape]

    # ---- statistics and integrity -----------------------------------------------------------------
    def stats(self) -> PoolStats:
        """A :class:`PoolStats` snapshot. Pure (mutates nothing)."""
        # runs of consecutive free ids: within a run, id - rank in the sorted list is constant
        run_lengths = [len(list(g)) for _, g in groupby(p - i for i, p in enumerate(sorted(self._free)))]
        runs, longest, nfree = len(run_lengths), max(run_lengths, default=0), len(self._free)
        by_kind = {PageKind.FREE: nfree, **self._count}
        return PoolStats(self.num_pages, self.page_bytes, nfree, by_kind,
                         (self.num_pages - nfree) / self.num_pages,
                         sum(1 for r in self._ref if r > 1), runs, longest,
                         0.0 if nfree == 0 else 1.0 - longest / nfree)

    def check_integrity(self) -> None:
        """Assert every invariant; raise AssertionError naming the first one broken.

        Pages by kind + free = total; a page is free iff ref 0 iff kind FREE iff among the free ids (exactly once:
        :meth:`FreePages.check_integrity`); ref counts >= 0 and equal to the sum of holders' counts; used pages have
        an owner; per-kind counters match the pages.
        """
        free_set = self._free.check_integrity()
        counts = Counter(self._kind)
        assert counts[PageKind.FREE] == len(self._free), "FREE pages != free list length"
        for k in USED_KINDS:
            assert counts[k] == self._count[k], f"{k.name} counter {self._count[k]} != {counts[k]} pages"
        assert sum(counts.values()) == self.num_pages, "pages by kind do not add up to the total"
        for p in range(self.num_pages):
            ref, kind, hold = self._ref[p], self._kind[p], self._holders[p]
            assert ref >= 0, f"page {p}: negative ref count {ref}"
            if kind is PageKind.FREE:
                assert ref == 0 and hold is None and self._owner[p] is None, f"page {p}: free but referenced"
                assert p in free_set, f"page {p}: FREE kind but not on the free list"
            else:
                assert p not in free_set, f"page {p}: in use and on the free list"
                assert ref > 0, f"page {p}: in use with ref count {ref}"
                assert self._owner[p] is not None, f"page {p}: in use without owner"
                assert hold is None or (all(c > 0 for c in hold.values()) and sum(hold.values()) == ref), \
                    f"page {p}: holders {hold} do not sum to ref count {ref}"

