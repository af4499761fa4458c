"""``FreePages``: the free page ids of a :class:`serve.memory.pool.PagePool`, for the two ways it hands pages out.

- **Single pages** (KV blocks, prefix-cache checkpoint pages) come from the low end of the arena: the smallest free
  ids, popped from a min-heap.
- **Runs** of consecutive ids (a KDA group state spanning several pages under the "multi_page" policy, read and
  written in place through its first page: :func:`serve.memory.pages.slot_views`) come from the high end: the
  highest run of the length asked, found with one ``bytes.rfind`` over a byte map of the free ids (1 = free).

So the two kinds grow towards each other, and a freed run is usually refilled by the next run of the same size.
Neither vLLM nor SGLang needs runs: vLLM's hybrid allocator pads a Mamba layer's page up to the largest page so one
state is one block (``unify_kv_cache_spec_page_size`` in ``vllm/v1/core/kv_cache_utils.py``; its free blocks are a
queue, ``FreeKVCacheBlockQueue`` in ``vllm/v1/core/kv_cache_utils.py``), and SGLang keeps the states in their own
``MambaPool`` of slots beside the token pool (``python/sglang/srt/mem_cache/memory_pool.py``). A shared arena can
be fragmented: enough pages free but no run of the length asked (:class:`serve.memory.kinds.NoFreeRun`).

Pure bookkeeping of ids: the pool owns kinds, references and bytes, and calls these methods with ids it checked.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from heapq import heapify, heappop, heappush

from serve.memory.kinds import NoFreeRun, PageKind


def _longest_run(free_map: bytearray) -> int:
    """Longest run of 1 bytes in a free map (0 when there is none)."""
    return max(map(len, free_map.split(b"\x00")), default=0)


class FreePages:
    """The free ids of a pool of ``num_pages`` pages (all free at first): a min-heap and a byte map by id.

    Mutating methods trust their arguments (the pool validates ids and counts first)."""

    def __init__(self, num_pages: int):
        self._heap = list(range(num_pages))            # a min-heap: single pages come from the low end
        self._map = bytearray(b"\x01") * num_pages     # 1 = free, by page id (runs: one rfind)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[int]:
        """The free ids, in no particular order."""
        return iter(self._heap)

    def pop_lowest(self, n: int) -> list[int]:
        """Take the ``n`` smallest free ids (``n`` <= len), ascending."""
        pages = [heappop(self._heap) for _ in range(n)]
        for p in pages:
            self._map[p] = 0
        return pages

    def push(self, pages: Iterable[int]) -> None:
        """Give back ``pages`` (ids not free now)."""
        heap, free_map = self._heap, self._map
        for p in pages:
            heappush(heap, p)
            free_map[p] = 1

    def find_runs(self, sizes: Sequence[int], kind: PageKind, also_free: Iterable[int] = ()) -> list[list[int]]:
        """Where :meth:`take` of one run per entry of ``sizes`` (pages each, >= 1; ``sum(sizes)`` <= len) would
        put them: each the highest run of its size left at its turn, ids ascending; ``also_free``: ids to count
        as free too (pages an eviction would free: the answer is then "after that eviction"). Pure. Raises
        :class:`NoFreeRun` (for ``kind``, naming the longest run left for the size that did not fit)."""
        free_map, runs = bytearray(self._map), []
        for p in also_free:
            free_map[p] = 1
        for n in sizes:
            first = free_map.rfind(b"\x01" * n)
            if first < 0:
                raise NoFreeRun(kind, n, len(self._heap), _longest_run(free_map))   # after this call's earlier runs
            free_map[first: first + n] = bytes(n)
            runs.append(list(range(first, first + n)))
        return runs

    def take(self, pages: Sequence[int]) -> None:
        """Take the free ``pages`` (any ids, e.g. runs from :meth:`find_runs`): O(free pages)."""
        taken = set(pages)
        self._heap = [p for p in self._heap if p not in taken]
        heapify(self._heap)
        for p in taken:
            self._map[p] = 0

    def longest_run(self) -> int:
        """Pages of the longest run of consecutive free ids (0 when none is free)."""
        return _longest_run(self._map)

    def check_integrity(self) -> set[int]:
        """Assert (AssertionError) no id is free twice, the heap is a min-heap and the map marks exactly its ids;
        returns the free ids."""
        heap = self._heap
        free = set(heap)
        assert len(free) == len(heap), "a page sits on the free list twice"
        assert all(heap[i] <= heap[j] for i in range(len(heap)) for j in (2 * i + 1, 2 * i + 2) if j < len(heap)), \
            "the free list is not a min-heap"
        assert {p for p, f in enumerate(self._map) if f} == free, "the free map disagrees with the free list"
        return free
