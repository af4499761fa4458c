"""PagePool: allocation, references, copy-on-write, typed views, errors, integrity."""
import pytest
import torch

from serve.memory.pool import NoFreeRun, PageError, PageKind, PagePool, PoolExhausted

MLA, KDA = PageKind.MLA_KV, PageKind.KDA_STATE


def test_alloc_decref_roundtrip():
    pool = PagePool(8, 64)
    a = pool.alloc(MLA, 3, "r1")
    b = pool.alloc(KDA, 2, "r2")
    pool.check_integrity()
    assert a == [0, 1, 2] and b == [3, 4]
    assert [pool.kind(p) for p in a + b] == [MLA] * 3 + [KDA] * 2
    assert all(pool.refcount(p) == 1 for p in a + b) and pool.owner(3) == "r2"
    s = pool.stats()
    assert s.pages_by_kind == {PageKind.FREE: 3, MLA: 3, KDA: 2} and s.utilisation == 5 / 8
    assert sorted(pool.decref(a, "r1")) == a
    pool.check_integrity()
    assert pool.num_free == 6 and pool.kind(0) is PageKind.FREE and pool.owner(0) is None
    pool.decref(b, "r2")
    pool.check_integrity()
    assert pool.num_free == 8 and pool.alloc(MLA, 0, "r3") == []


def test_alloc_all_or_nothing():
    pool = PagePool(4, 16)
    pool.alloc(MLA, 3, "r1")
    before = (pool.page_table(), list(pool._free))
    with pytest.raises(PoolExhausted) as e:
        pool.alloc(KDA, 2, "r2")
    assert (e.value.needed, e.value.free, e.value.kind) == (2, 1, KDA)
    assert "needs 2 pages, 1 free" in str(e.value)
    assert (pool.page_table(), list(pool._free)) == before
    pool.check_integrity()


def test_batched_decref_mixed_kinds_and_sharing():
    pool = PagePool(8, 16)
    a = pool.alloc(MLA, 3, "r1")
    b = pool.alloc(KDA, 3, "r1")
    pool.incref([b[0]], "r2")
    pool.incref([a[1]], "r1")                    # owner's second reference: still private
    assert sorted(pool.decref(a + b, "r1")) == [a[0], a[2]] + b[1:]
    pool.check_integrity()
    assert pool.num_used(MLA) == 1 and pool.num_used(KDA) == 1
    assert pool.holders(b[0]) == {"r2": 1} and pool.holders(a[1]) == {"r1": 1}
    with pytest.raises(ValueError, match="page ids"):
        pool.decref([a[1], -1], "r1")
    with pytest.raises(ValueError, match="page ids"):
        pool.decref([a[1], 8], "r1")
    pool.decref([a[1]], "r1")
    pool.decref([b[0]], "r2")
    pool.check_integrity()
    assert pool.num_free == 8


def test_shared_pages_live_until_last_reference():
    pool = PagePool(4, 16)
    (p,) = pool.alloc(MLA, 1, "r1")
    assert pool.fork([p], "r2") == [p]
    pool.incref([p], "cache")
    assert pool.refcount(p) == 3 and pool.holders(p) == {"r1": 1, "r2": 1, "cache": 1}
    assert pool.stats().shared_pages == 1
    assert pool.decref([p], "r1") == []
    assert pool.decref([p], "cache") == [] and pool.owner(p) == "r1"
    pool.check_integrity()
    assert pool.decref([p], "r2") == [p]
    pool.check_integrity()
    assert pool.num_free == 4


def test_copy_on_write():
    pool = PagePool(4, 16)
    (p,) = pool.alloc(KDA, 1, "r1")
    pool.view(p, torch.float32, (4,)).copy_(torch.arange(4.0))
    assert pool.copy_on_write(p, "r1") == p  # sole holder: no copy
    pool.fork([p], "r2")
    q = pool.copy_on_write(p, "r2")
    pool.check_integrity()
    assert q != p and pool.kind(q) is KDA and pool.refcount(p) == 1 and pool.holders(q) == {"r2": 1}
    pool.view(q, torch.float32, (4,)).add_(10)
    assert torch.equal(pool.view(p, torch.float32, (4,)), torch.arange(4.0))
    assert torch.equal(pool.view(q, torch.float32, (4,)), torch.arange(4.0) + 10)
    with pytest.raises(PageError, match="holds no reference"):
        pool.copy_on_write(p, "r3")


def test_cow_exhausted_changes_nothing():
    pool = PagePool(2, 16)
    (p,) = pool.alloc(MLA, 1, "r1")
    pool.fork([p], "r2")
    pool.alloc(MLA, 1, "r3")
    with pytest.raises(PoolExhausted):
        pool.copy_on_write(p, "r2")
    assert pool.holders(p) == {"r1": 1, "r2": 1}
    pool.check_integrity()


def test_view_in_place_and_typed_arena():
    pool = PagePool(3, 64)
    a, b = pool.alloc(MLA, 2, "r")
    v = pool.view(b, torch.float32, (2, 4), offset_bytes=16)
    v.copy_(torch.arange(8.0).view(2, 4))
    assert torch.equal(pool.arena[b, 16:48].view(torch.float32), torch.arange(8.0))
    typed = pool.typed_arena(torch.float32, (4, 4))                       # [3, 4, 4]
    assert torch.equal(typed[b, 1:3], torch.arange(8.0).view(2, 4))
    assert pool.view(a, torch.bfloat16, (0,)).numel() == 0


@pytest.mark.parametrize("kwargs, err, match", [
    pytest.param(dict(page=0, dtype=torch.float32, shape=(17,)), PageError, "does not fit", id="too-big"),
    pytest.param(dict(page=0, dtype=torch.float32, shape=(15,), offset_bytes=8), PageError, "does not fit",
                 id="offset-too-big"),
    pytest.param(dict(page=0, dtype=torch.float32, shape=(2,), offset_bytes=2), PageError, "multiple",
                 id="misaligned"),
    pytest.param(dict(page=1, dtype=torch.float32, shape=(2,)), PageError, "is free", id="free-page"),
    pytest.param(dict(page=9, dtype=torch.float32, shape=(2,)), ValueError, "page must be", id="bad-id"),
    pytest.param(dict(page=0, dtype="f4", shape=(2,)), ValueError, "dtype", id="bad-dtype"),
    pytest.param(dict(page=0, dtype=torch.float32, shape=(-1,)), ValueError, "shape", id="neg-shape"),
])
def test_view_errors(kwargs, err, match):
    pool = PagePool(2, 64)
    pool.alloc(MLA, 1, "r")
    with pytest.raises(err, match=match):
        pool.view(**kwargs)


@pytest.mark.parametrize("args", [(0, 8), (8, 0), (-1, 8), (2.0, 8), (True, 8)], ids=str)
def test_bad_sizes(args):
    with pytest.raises(ValueError, match="must be an int >= 1"):
        PagePool(*args)


def test_usage_errors_change_nothing():
    pool = PagePool(4, 16)
    pages = pool.alloc(MLA, 2, "r1")
    snapshot = pool.page_table()
    with pytest.raises(ValueError, match="kind must be"):
        pool.alloc(PageKind.FREE, 1, "r1")
    with pytest.raises(ValueError, match="kind must be"):
        pool.alloc("mla", 1, "r1")
    with pytest.raises(ValueError, match="n must be"):
        pool.alloc(MLA, -1, "r1")
    with pytest.raises(ValueError, match="owner"):
        pool.alloc(MLA, 1, None)
    for bad in ([1], {}, {"r": 1}):              # was stored, then a raw TypeError at the first share
        with pytest.raises(ValueError, match=f"owner must be hashable .*, got {type(bad).__name__}"):
            pool.alloc(MLA, 1, bad)
        with pytest.raises(ValueError, match="owner must be hashable"):
            pool.incref(pages, bad)
        with pytest.raises(ValueError, match="owner must be hashable"):
            pool.decref(pages, bad)
        with pytest.raises(ValueError, match="owner must be hashable"):
            pool.copy_on_write(pages[0], bad)
        pool.check_integrity()
    with pytest.raises(PageError, match="holds no reference"):
        pool.decref(pages, "r2")                 # freeing a page you do not own
    with pytest.raises(PageError, match="double free"):
        pool.decref([pages[0], pages[0]], "r1")  # two drops, one reference
    with pytest.raises(PageError, match="is free"):
        pool.decref([pages[0], 3], "r1")         # page 3 never allocated: nothing is dropped
    with pytest.raises(PageError, match="is free"):
        pool.incref([3], "r1")
    assert pool.page_table() == snapshot
    pool.decref(pages, "r1")
    with pytest.raises(PageError, match="double free"):
        pool.decref(pages, "r1")
    pool.check_integrity()


def test_poison_makes_unwritten_pages_nan():
    pool = PagePool(2, 32, poison=True)
    (p,) = pool.alloc(KDA, 1, "r")
    pool.view(p, torch.float32, (8,)).zero_()
    pool.decref([p], "r")
    (q,) = pool.alloc(KDA, 1, "r")
    assert q == p and pool.view(q, torch.float32, (8,)).isnan().all()
    assert pool.view(q, torch.bfloat16, (16,)).isnan().all()


def test_stats_fragmentation():
    pool = PagePool(6, 8)
    pages = pool.alloc(MLA, 6, "r")
    pool.decref([pages[0], pages[2], pages[3]], "r")
    s = pool.stats()
    assert (s.free_pages, s.free_runs, s.largest_free_run) == (3, 2, 2)
    assert s.external_fragmentation == pytest.approx(1 / 3)


def test_check_integrity_catches_corruption():
    pool = PagePool(3, 8)
    (p,) = pool.alloc(MLA, 1, "r")
    pool.fork([p], "r2")
    pool._ref[p] = 3
    with pytest.raises(AssertionError, match="holders"):
        pool.check_integrity()
    pool._ref[p] = 2
    pool._count[MLA] += 1
    with pytest.raises(AssertionError, match="counter"):
        pool.check_integrity()
    pool._count[MLA] -= 1
    pool.check_integrity()
    pool._free.push([p])                                                # a used page among the free ids
    with pytest.raises(AssertionError, match="free list length"):
        pool.check_integrity()


def test_free_pages_check_integrity_catches_a_broken_heap_or_map():
    """The free ids' own invariants: a min-heap, each id once, the byte map marking exactly them."""
    from serve.memory.free_pages import FreePages
    free = FreePages(6)
    assert free.pop_lowest(2) == [0, 1] and free.check_integrity() == {2, 3, 4, 5}
    free._heap[0], free._heap[-1] = free._heap[-1], free._heap[0]
    with pytest.raises(AssertionError, match="min-heap"):
        free.check_integrity()
    free = FreePages(6)
    free._map[0] = 0
    with pytest.raises(AssertionError, match="free map"):
        free.check_integrity()
    free = FreePages(6)
    free._heap.append(5)
    with pytest.raises(AssertionError, match="twice"):
        free.check_integrity()


@pytest.mark.parametrize("pages", [[True], [True, 0], [1.0], [0, 1.0]], ids=["True", "True-and-0", "1.0", "0-and-1.0"])
def test_decref_and_incref_reject_non_int_ids(pages):
    """``True == 1`` indexes page 1: a bool (or float) id must be refused, not free page 1."""
    pool = PagePool(4, 16)
    held = pool.alloc(MLA, 2, "r1")                  # pages 0 and 1
    snapshot = pool.page_table()
    with pytest.raises(ValueError, match="page ids must be ints"):
        pool.decref(pages, "r1")
    with pytest.raises(ValueError, match="page ids must be ints"):
        pool.incref(pages, "r1")
    assert pool.page_table() == snapshot and pool.num_free == 2
    pool.decref(held, "r1")
    pool.check_integrity()


def test_alloc_runs_takes_the_highest_free_run_and_single_pages_the_lowest():
    """Runs (a multi-page state slot) come from the high end, single pages from the low end: the two kinds grow
    towards each other; a freed run is refilled by the next run of its size."""
    pool = PagePool(12, 64)
    assert pool.alloc_run(KDA, 4, "a") == [8, 9, 10, 11]
    assert pool.alloc(MLA, 2, "b") == [0, 1]
    assert pool.alloc_runs(KDA, [3, 2], "c") == [[5, 6, 7], [3, 4]]
    pool.decref([8, 9, 10, 11], "a")
    assert pool.longest_free_run() == 4 and pool.alloc_run(KDA, 4, "d") == [8, 9, 10, 11]
    assert pool.is_run([3, 4, 5]) and not pool.is_run([3, 5]) and not pool.is_run([])
    pool.check_integrity()


def test_no_free_run_when_enough_pages_are_free_changes_nothing():
    """A fragmented pool (every other page held) has 6 free pages but no run of 2: alloc_runs raises NoFreeRun
    (a PoolExhausted) naming the run and the longest free run, and the pool is unchanged."""
    pool = PagePool(12, 64)
    held = pool.alloc(MLA, 12, "a")
    pool.decref(held[::2], "a")
    before = pool.page_table(), sorted(pool._free)
    assert not pool.can_alloc_runs([2]) and pool.can_alloc_runs([1] * 6) and not pool.can_alloc_runs([1] * 7)
    assert pool.can_alloc_runs([3], also_free=[1]) and not pool.can_alloc_runs([4], also_free=[1])   # 0-2 once 1 is freed
    with pytest.raises(ValueError, match="page"):
        pool.can_alloc_runs([2], also_free=[12])
    with pytest.raises(NoFreeRun, match="no run of 2 consecutive free pages.*6 pages free, the longest run 1") as e:
        pool.alloc_runs(KDA, [1, 2], "b")
    assert isinstance(e.value, PoolExhausted) and (e.value.needed, e.value.free, e.value.longest) == (2, 6, 1)
    assert (pool.page_table(), sorted(pool._free)) == before
    with pytest.raises(PoolExhausted) as e:
        pool.alloc_runs(KDA, [4, 3], "b")
    assert not isinstance(e.value, NoFreeRun)
    with pytest.raises(ValueError, match="size"):
        pool.alloc_runs(KDA, [0], "b")
    pool.check_integrity()


def test_no_free_run_names_the_longest_run_left_for_it():
    """Free runs of 4 and 7 pages: runs of 6 and 5 do not fit (the first takes 6 of the 7); the error names the
    longest run left for the second (4), not the 7 the pool had before the call."""
    pool = PagePool(12, 64)
    held = pool.alloc(MLA, 12, "a")
    pool.decref(held[:4] + held[5:], "a")                                # free: 0..3 and 5..11
    with pytest.raises(NoFreeRun, match="no run of 5 .* the longest run 4") as e:
        pool.alloc_runs(KDA, [6, 5], "b")
    assert e.value.longest == 4 and pool.longest_free_run() == 7
    pool.check_integrity()
