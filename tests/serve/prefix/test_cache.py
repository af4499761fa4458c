"""PrefixCache, PrefixIndex and block keys: units, error paths, and random operations against the oracle."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kda_core.config import PRESETS
from serve.config import ServeConfig
from serve.memory.layout import CacheLayout, group_layers
from serve.memory.pages import read_state, write_state, zero_state
from serve.memory.pool import PageError, PageKind, PagePool, PoolExhausted
from serve.prefix.cache import PrefixCache
from serve.prefix.index import EntryKind, PrefixIndex, block_keys
from serve.prefix.reference import PrefixOracle
from tests.serve.prefix.helpers import insert_prefix, make_cache

CFG = PRESETS["demo-tiny"]


def test_block_keys_are_chained():
    a = list(range(40))
    b = a[:20] + [99] + a[21:]
    ka, kb = block_keys(a, 8), block_keys(b, 8)
    assert len(ka) == 5 and all(len(k) == 32 for k in ka)
    assert ka[:2] == kb[:2] and all(x != y for x, y in zip(ka[2:], kb[2:]))   # one token changes all later keys
    assert block_keys(a[:39], 8) == ka[:4]                                    # the partial block has no key
    assert block_keys(torch.tensor(a), 8) == ka
    assert block_keys(a[8:16], 8) != ka[1:2]                                  # same block, other prefix
    with pytest.raises(ValueError, match="block_size"):
        block_keys(a, 0)
    with pytest.raises(ValueError, match="1-D"):
        block_keys([[1, 2]], 1)


def test_group_layers_and_layout():
    assert group_layers(PRESETS["demo"], 2) == ((0, 1, 2), (4, 5, 6))
    assert group_layers(PRESETS["demo"], 4) == ((0, 1), (2, 4), (5,), (6,))
    with pytest.raises(ValueError, match="num_groups"):
        group_layers(CFG, 4)
    unified = CacheLayout.page_bytes_for(CFG, 16, 1, "unified")
    multi = CacheLayout.page_bytes_for(CFG, 16, 1, "multi_page")
    lay = CacheLayout(CFG, 16, 1, multi)
    assert multi == lay.kv_block_bytes == 1 * 16 * 24 * 4
    assert lay.state_bytes == 3 * (2 * 16 * 12 + 88 * 3) * 4 and unified >= lay.state_bytes
    assert lay.group_pages(0) == -(-lay.state_bytes // multi) and CacheLayout(CFG, 16, 1, unified).state_pages == 1
    with pytest.raises(ValueError, match="cannot hold one KV block"):
        CacheLayout(CFG, 64, 1, multi)
    with pytest.raises(ValueError, match="policy"):
        CacheLayout.page_bytes_for(CFG, 16, 1, "bogus")


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_state_round_trip_through_pages_is_bitwise(groups):
    lay = CacheLayout(CFG, 8, groups, CacheLayout.page_bytes_for(CFG, 8, groups, "multi_page"))
    pool = PagePool(64, lay.page_bytes, poison=True)
    pages = [tuple(pool.alloc(PageKind.KDA_STATE, lay.group_pages(g), "r")) for g in range(groups)]
    gen = torch.Generator().manual_seed(0)
    caches = {i: type(c)(*(torch.randn(t.shape, generator=gen) for t in c))
              for i, c in read_state(lay, pool, pages).items()}
    write_state(lay, pool, pages, caches)
    back = read_state(lay, pool, pages)
    assert all(torch.equal(back[i].recurrent, caches[i].recurrent) and torch.equal(back[i].conv, caches[i].conv)
               for i in caches)
    zero_state(lay, pool, pages)
    assert all(not back.recurrent.any() and not back.conv.any() for back in read_state(lay, pool, pages).values())


def test_lookup_two_phases_and_cap():
    cache = make_cache()
    seq = list(range(1, 21))                      # 5 blocks of 4
    insert_prefix(cache, seq, 5, [2, 5])
    hit = cache.lookup(seq)
    assert (hit.kv_tokens, hit.num_tokens) == (19, 8)         # capped at len - 1; no checkpoint at 16
    assert cache.lookup(seq + [7]).num_tokens == 20
    assert cache.lookup(seq[:9]).num_tokens == 8 and cache.lookup(seq[:3]).num_tokens == 0
    assert cache.lookup([0] + seq).kv_tokens == 0
    steps = cache.explain(seq)
    assert [s.phase for s in steps] == [1, 1, 1, 1, 1, 2, 2, 2] and "cap" in steps[4].note
    assert steps[-1].found and steps[-1].boundary == 8
    with pytest.raises(ValueError, match="at least one token"):
        cache.lookup([])


def test_failed_checkpoint_publishes_nothing():
    cache = make_cache(num_pages=40, groups=3)
    lay = cache.layout
    seq = list(range(12))
    kv = cache.alloc(PageKind.MLA_KV, 3, "w")
    state = cache.alloc(PageKind.KDA_STATE, lay.state_pages, "w")
    split = [tuple(state[: lay.group_pages(0)]), tuple(state[lay.group_pages(0): lay.group_pages(0) + lay.group_pages(1)]),
             tuple(state[lay.group_pages(0) + lay.group_pages(1):])]
    cache.publish_blocks(cache.keys(seq), kv, 3, "w")
    hog = cache.pool.alloc(PageKind.KDA_STATE, cache.pool.num_free - lay.state_pages + 1, "hog")
    before = cache.pool.page_table()
    assert not cache.publish_checkpoint(cache.keys(seq), 3, split, 12, "w")
    assert cache.pool.page_table() == before and cache.checkpoints() == []
    assert cache.stats().failed_checkpoints == 1
    cache.pool.decref(hog, "hog")
    assert cache.publish_checkpoint(cache.keys(seq), 3, split, 12, "w")
    assert [(c.boundary, c.group) for c in cache.checkpoints()] == [(12, 0), (12, 1), (12, 2)]
    cache.release("w")
    cache.pool.decref(kv + state, "w")
    cache.check_integrity()
    with pytest.raises(PoolExhausted):
        cache.alloc(PageKind.MLA_KV, 41, "x")


def test_drop_checkpoint_errors():
    cache = make_cache()
    seq = list(range(8))
    insert_prefix(cache, seq, 2, [2])
    with pytest.raises(ValueError, match="multiple of 4"):
        cache.drop_checkpoint(seq, 6, 0)
    with pytest.raises(ValueError, match="no checkpoint"):
        cache.drop_checkpoint(seq, 4, 0)
    cache.drop_checkpoint(seq, 8, 0)
    assert cache.checkpoints() == [] and cache.stats().evicted_checkpoints == 0
    cache.check_integrity()


def test_index_rejects_orphans_and_bad_pins():
    idx = PrefixIndex(2)
    with pytest.raises(ValueError, match="parent"):
        idx.add_block("b", "a")
    idx.add_block("a", None)
    assert not idx.add_block("a", None)
    with pytest.raises(ValueError, match="not pinned"):
        idx.pin_blocks(["a"], -1)
    with pytest.raises(ValueError, match="group"):
        idx.add_checkpoint("a", 2, None, 4)
    idx.add_checkpoint("a", 0, None, 4)
    idx.check_integrity(4)
    with pytest.raises(ValueError, match="num_groups"):
        PrefixIndex(0)


# ---- random operations against the oracle ---------------------------------------------------------
SEQS = [[(i >> b) & 1 for b in range(6) for _ in range(4)] for i in range(8)]   # 6 blocks of 4, shared prefixes
KEY_TO_PREFIX = {k: tuple(s[: 4 * (i + 1)]) for s in SEQS for i, k in enumerate(block_keys(s, 4))}


class MirroredCache(PrefixCache):
    """A PrefixCache that mirrors every publish / pin into a :class:`PrefixOracle` and checks that every
    eviction removes exactly what the oracle evicts."""

    def __init__(self, oracle, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.oracle, self.seq = oracle, None
        original = self.index.evict_one

        def evict_both(checkpoints_only=False):
            got = original(checkpoints_only)
            assert {(KEY_TO_PREFIX[e.key], e.kind, e.group) for e in got} == oracle.evict_one(checkpoints_only)
            return got

        self.index.evict_one = evict_both

    def publish_blocks(self, keys, page_table, num_blocks, owner):
        super().publish_blocks(keys, page_table, num_blocks, owner)
        self.oracle.insert_blocks(self.seq, num_blocks)
        self.oracle.pin(self.seq, 4 * num_blocks, +1)

    def publish_checkpoint(self, keys, num_blocks, pages, written_at, owner):
        b = 4 * num_blocks
        present = self.oracle.groups_at(self.seq, b)      # the cache keeps these during its allocation
        self.oracle.pin(self.seq, b, +1, present)
        ok = super().publish_checkpoint(keys, num_blocks, pages, written_at, owner)
        self.oracle.pin(self.seq, b, -1, present)
        if ok:
            self.oracle.insert_checkpoint(self.seq, b)
        return ok


def _contents(cache):
    out = set()
    for key, node in cache.index.nodes.items():
        out.add((KEY_TO_PREFIX[key], EntryKind.BLOCK, None))
        out.update((KEY_TO_PREFIX[key], EntryKind.CHECKPOINT, g) for g in node.ckpts)
    return out


def _lru_order(cache) -> list:
    """The index's LRU list, oldest first, as the oracle's ``(prefix, kind, group)`` entries."""
    return [(KEY_TO_PREFIX[e.key], e.kind, e.group) for e in cache.index.lru]


def _oracle_order(oracle) -> list:
    """The oracle's entries by recency stamp, oldest first."""
    return [(e[0], e[1], e[2]) for e in sorted(oracle.entries, key=lambda e: e[3])]


ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 7), st.integers(1, 6), st.lists(st.integers(1, 6), max_size=3)),
    st.tuples(st.just("hit"), st.integers(0, 7), st.integers(1, 24)),
    st.tuples(st.just("drop"), st.integers(0, 63)),          # the i-th stored checkpoint (mod their count)
    st.tuples(st.just("squeeze"), st.integers(1, 6)),
), min_size=10, max_size=30)


# Inputs that caught a broken index in some random runs only, pinned so every run tries them:
# groups whose checkpoints cross (group 0 keeps 4, group 1 keeps 8: no common boundary, hit 0, not 4);
@example(ops=[("insert", 0, 2, [1, 2]), ("drop", 2), ("drop", 1)], num_pages=40, groups=2, max_ck=None)
# re-publishing the checkpoint at 12 must not refresh the one at 4 above it;
@example(ops=[("insert", 0, 3, [1, 3]), ("insert", 0, 4, [3]), ("squeeze", 1)], num_pages=10, groups=1, max_ck=None)
# a hit at 8 with KV cached to 12 refreshes blocks [0, 8) only.
@example(ops=[("insert", 0, 3, [1, 2]), ("hit", 0, 13), ("squeeze", 1)], num_pages=10, groups=1, max_ck=None)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_pages=st.integers(10, 40), groups=st.integers(1, 2), max_ck=st.sampled_from([None, 3, 6]))
def test_prefix_cache_matches_oracle(ops, num_pages, groups, max_ck):
    """Random operation sequences on the cache and on the list oracle: same lookups, same contents and
    the same LRU order after every operation (so a wrong refresh fails where it happens, not only when an
    eviction later exposes it). CI runs these inputs derandomized (tests/conftest.py)."""
    oracle = PrefixOracle(4, groups)
    config = ServeConfig(4, 4, groups, "unified")
    pool = PagePool(num_pages, config.page_bytes(CFG), poison=True)
    cache = MirroredCache(oracle, pool, config, cfg=CFG, max_checkpoints=max_ck)
    for op in ops:
        if op[0] == "insert":
            _, s, nb, bounds = op
            if nb + 2 * cache.layout.state_pages > num_pages:
                continue
            cache.seq = SEQS[s]
            insert_prefix(cache, SEQS[s], nb, sorted({b for b in bounds if b <= nb}))
            oracle.pin(SEQS[s], 4 * nb, -1)
        elif op[0] == "hit":
            seq = SEQS[op[1]][: op[2]]
            hit = cache.lookup(seq)
            assert (hit.num_tokens, hit.kv_tokens) == oracle.lookup(seq)
            cache.acquire(hit, "r")
            oracle.touch(seq, hit.num_tokens)
            cache.release("r")
            cache.pool.decref(list(hit.kv_pages), "r")
        elif op[0] == "drop":
            stored = sorted((len(p), p, g) for p, kind, g in oracle.contents() if kind is EntryKind.CHECKPOINT)
            if stored:
                _, prefix, g = stored[op[1] % len(stored)]
                cache.drop_checkpoint(prefix, len(prefix), g)
                oracle.drop_checkpoint(prefix, len(prefix), g)
        else:
            try:
                pages = cache.alloc(PageKind.MLA_KV, min(num_pages, cache.pool.num_free + op[1]), "x")
                cache.pool.decref(pages, "x")
            except PoolExhausted:
                pass
        cache.check_integrity()
        assert _contents(cache) == oracle.contents()
        assert _lru_order(cache) == _oracle_order(oracle)      # refresh order, not only what is stored
        for s in SEQS:
            assert (cache.lookup(s).num_tokens, cache.lookup(s).kv_tokens) == oracle.lookup(s)


def test_evicting_a_checkpoint_keeps_kv_and_evicting_kv_drops_its_checkpoints():
    cache = make_cache(max_checkpoints=2)
    seq = list(range(1, 17))                       # 4 blocks of 4
    insert_prefix(cache, seq, 4, [1, 2, 3])              # the third checkpoint evicts the LRU one (at 4)
    assert [c.boundary for c in cache.checkpoints()] == [8, 12]
    assert cache.stats().evicted_checkpoints == 1 and cache.lookup(seq).kv_tokens == 15
    assert cache.lookup(seq[:5]).kv_tokens == 4 and cache.lookup(seq[:5]).num_tokens == 0   # KV still usable
    cache.clear()
    assert cache.checkpoints() == [] and cache.stats().kv_blocks == 0
    assert cache.pool.num_free == cache.pool.num_pages
    idx = PrefixIndex(1)
    idx.add_block("a", None)
    idx.add_block("b", "a")
    idx.add_checkpoint("b", 0, "pages-of-b", 8)
    idx.touch(["a", "b"], 2, with_checkpoint=False)     # the checkpoint at b is now the oldest entry
    assert [e.kind for e in idx.evict_one()] == [EntryKind.CHECKPOINT]
    idx.touch(["a", "b"], 2, with_checkpoint=False)     # LRU order: block b, block a
    idx.add_checkpoint("b", 0, "pages-of-b", 8)         # then the checkpoint: block b is the oldest entry
    # block b and its checkpoint
    assert [(e.kind, e.key) for e in idx.evict_one()] == [(EntryKind.CHECKPOINT, "b"), (EntryKind.BLOCK, "b")]
    idx.check_integrity(4)


@pytest.mark.parametrize("case", ["free-page", "other-owners-page"])
def test_publish_blocks_is_atomic(case):
    """Publishing a block whose page the owner does not hold raises before anything is added: the index
    never points at a free page (or one the cache holds no reference to)."""
    cache = make_cache(num_pages=16)
    seq = list(range(12))                          # 3 blocks of 4
    kv = cache.alloc(PageKind.MLA_KV, 3, "w")
    other = cache.alloc(PageKind.MLA_KV, 1, "x")
    bad = 15 if case == "free-page" else other[0]
    assert cache.pool.kind(15) is PageKind.FREE
    before = cache.pool.page_table()
    with pytest.raises(PageError, match="holds no reference to page"):
        cache.publish_blocks(cache.keys(seq), kv[:2] + [bad], 3, "w")
    assert cache.pool.page_table() == before and not cache.index.nodes
    cache.check_integrity()
    with pytest.raises(ValueError, match="num_blocks"):
        cache.publish_blocks(cache.keys(seq), kv, 4, "w")
    cache.publish_blocks(cache.keys(seq), kv, 3, "w")   # the valid call still works afterwards
    assert cache.lookup(seq + [0]).kv_tokens == 12
    cache.release("w")
    cache.pool.decref(kv, "w")
    cache.pool.decref(other, "x")
    cache.check_integrity()
