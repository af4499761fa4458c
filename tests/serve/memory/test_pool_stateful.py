"""Hypothesis stateful test: random alloc / alloc_runs / incref / decref / fork / append / free on both page kinds,
replayed against an obviously-correct oracle pool (a free set and a Counter of holders per page; single pages are
the smallest free ids, a run the highest run of free ids, found by scanning every start)."""
import dataclasses
from collections import Counter

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kda_core.config import PRESETS
from kda_core.layer import KDACache
from serve.memory.layout import CacheLayout
from serve.memory.paged_mla import PagedMLACache
from serve.memory.pages import read_state, write_state
from serve.memory.pool import NoFreeRun, PageError, PageKind, PagePool, PoolExhausted

LM, BS, D = 2, 4, 6                   # MLA layers, block size (tokens), latent width
PAGE_BYTES = 1024                     # one fp32 KV block (192 B) + padding; a KDA state spans 8 or 9 pages
CFG = dataclasses.replace(PRESETS["demo-tiny"], num_layers=5, mla_layers=(3, 4), kv_lora_rank=4, qk_rope_head_dim=2)
LAYOUTS = {G: CacheLayout(CFG, BS, G, PAGE_BYTES) for G in (1, 2, 3)}
OWNERS = ("a", "b", "c")
KINDS = (PageKind.MLA_KV, PageKind.KDA_STATE)


class OraclePool:
    """The pool as sets: free page ids, and per used page its kind and a Counter of holders."""

    def __init__(self, num_pages):
        self.free = set(range(num_pages))
        self.kind, self.holders = {}, {}

    def alloc(self, pages, kind, owner):
        assert set(pages) <= self.free and len(set(pages)) == len(pages)
        for p in pages:
            self.free.remove(p)
            self.kind[p], self.holders[p] = kind, Counter({owner: 1})

    def highest_run(self, n, free):
        """First id of the highest run of ``n`` ids in ``free`` (None if none)."""
        starts = [s for s in free if all(s + i in free for i in range(n))]
        return max(starts, default=None)

    def incref(self, pages, owner):
        for p in pages:
            self.holders[p][owner] += 1

    def decref(self, pages, owner):
        for p in pages:
            self.holders[p][owner] -= 1
            if self.holders[p][owner] == 0:
                del self.holders[p][owner]
            if not self.holders[p]:
                del self.kind[p], self.holders[p]
                self.free.add(p)


class PoolMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(1, 24))
    def setup(self, num_pages):
        self.pool = PagePool(num_pages, PAGE_BYTES, poison=True)
        self.oracle = OraclePool(num_pages)
        self.mla: dict[str, tuple[PagedMLACache, torch.Tensor]] = {}  # name -> (cache, expected latents)
        self.states: dict[str, tuple[CacheLayout, list[list[int]], dict]] = {}  # name -> (layout, pages, states)
        self.counter = 0

    def _name(self):
        self.counter += 1
        return f"req{self.counter}"

    def _snapshot(self):
        return self.pool.page_table(), sorted(self.pool._free)

    # ---- raw pool operations ------------------------------------------------------------------------
    @rule(kind=st.sampled_from(KINDS), n=st.integers(0, 8), owner=st.sampled_from(OWNERS))
    def alloc(self, kind, n, owner):
        before = self._snapshot()
        if n > len(self.oracle.free):
            with pytest.raises(PoolExhausted) as e:
                self.pool.alloc(kind, n, owner)
            assert (e.value.needed, e.value.free) == (n, len(self.oracle.free))
            assert self._snapshot() == before              # a failed alloc leaves the pool unchanged
        else:
            pages = self.pool.alloc(kind, n, owner)
            assert pages == sorted(self.oracle.free)[:n]     # single pages: the smallest free ids
            self.oracle.alloc(pages, kind, owner)

    @rule(kind=st.sampled_from(KINDS), sizes=st.lists(st.integers(1, 6), min_size=1, max_size=3),
          owner=st.sampled_from(OWNERS))
    def alloc_runs(self, kind, sizes, owner):
        before = self._snapshot()
        free, want = set(self.oracle.free), []
        for n in sizes:                                    # each run the highest free run at its turn
            first = self.oracle.highest_run(n, free)
            if first is None:
                break
            want.append(list(range(first, first + n)))
            free -= set(want[-1])
        assert self.pool.can_alloc_runs(sizes) == (len(want) == len(sizes))
        if len(want) < len(sizes):
            with pytest.raises(PoolExhausted) as e:
                self.pool.alloc_runs(kind, sizes, owner)
            assert isinstance(e.value, NoFreeRun) == (sum(sizes) <= len(self.oracle.free))
            assert self._snapshot() == before              # a failed alloc leaves the pool unchanged
            return
        runs = self.pool.alloc_runs(kind, sizes, owner)
        assert runs == want and all(self.pool.is_run(r) for r in runs)
        for r in runs:
            self.oracle.alloc(r, kind, owner)

    def _raw_pages(self):  # pages held by the raw owners a / b / c
        return sorted((p, o) for p, h in self.oracle.holders.items() for o in h if o in OWNERS)

    @precondition(lambda self: self._raw_pages())
    @rule(data=st.data(), owner=st.sampled_from(OWNERS))
    def incref(self, data, owner):
        p, _ = data.draw(st.sampled_from(self._raw_pages()))
        self.pool.incref([p], owner)
        self.oracle.incref([p], owner)

    @precondition(lambda self: self._raw_pages())
    @rule(data=st.data())
    def decref(self, data):
        p, o = data.draw(st.sampled_from(self._raw_pages()))
        assert self.pool.decref([p], o) == ([p] if sum(self.oracle.holders[p].values()) == 1 else [])
        self.oracle.decref([p], o)

    @rule(page=st.integers(0, 23), owner=st.sampled_from(OWNERS))
    def decref_not_held(self, page, owner):
        held = self.oracle.holders.get(page, Counter())[owner] if page < self.pool.num_pages else 0
        if held or page >= self.pool.num_pages:
            return
        before = self._snapshot()
        with pytest.raises(PageError):                     # double free / not the holder
            self.pool.decref([page], owner)
        assert self._snapshot() == before

    # ---- caches on top of the pool ------------------------------------------------------------------
    @rule(T=st.integers(0, 10), seed=st.integers(0, 2**16))
    def new_request(self, T, seed):
        name = self._name()
        cache = PagedMLACache(LAYOUTS[1], self.pool, name)
        self.mla[name] = (cache, torch.zeros(LM, 0, D))
        self.append_to(name, T, seed)

    def append_to(self, name, T, seed):
        cache, want = self.mla[name]
        lat = torch.randn(LM, T, D, generator=torch.Generator().manual_seed(seed))
        before_table, before = list(cache.block_table), self._snapshot()
        try:
            cache.append(lat)
        except PoolExhausted:
            assert cache.block_table == before_table and self._snapshot() == before
            return
        self.mla[name] = (cache, torch.cat([want, lat], dim=1))
        self._resync()

    @precondition(lambda self: self.mla)
    @rule(data=st.data(), T=st.integers(1, 6), seed=st.integers(0, 2**16))
    def append(self, data, T, seed):
        self.append_to(data.draw(st.sampled_from(sorted(self.mla))), T, seed)

    @precondition(lambda self: self.mla)
    @rule(data=st.data())
    def fork(self, data):
        name = data.draw(st.sampled_from(sorted(self.mla)))
        cache, want = self.mla[name]
        n = data.draw(st.integers(0, cache.num_tokens))
        child = cache.fork(self._name(), n)
        self.mla[child.owner] = (child, want[:, :n])
        self._resync()
        if data.draw(st.booleans()):  # a child appending into a shared partial block must copy it first
            self.append_to(child.owner, data.draw(st.integers(1, 6)), data.draw(st.integers(0, 2**16)))

    @rule(G=st.integers(1, 3), seed=st.integers(0, 2**16))
    def new_state(self, G, seed):
        name, before, lay = self._name(), self._snapshot(), LAYOUTS[G]
        try:
            flat = self.pool.alloc(PageKind.KDA_STATE, lay.state_pages, name)
        except PoolExhausted:
            assert self._snapshot() == before
            return
        pages = []
        for g in range(G):
            pages.append(flat[: lay.group_pages(g)])
            flat = flat[lay.group_pages(g):]
        gen = torch.Generator().manual_seed(seed)
        states = {i: KDACache(torch.randn(1, CFG.num_heads, CFG.head_k_dim, CFG.head_v_dim, generator=gen),
                              torch.randn(1, CFG.conv_dim, CFG.conv_kernel - 1, generator=gen)) for i in CFG.kda_layers}
        write_state(lay, self.pool, pages, states)
        self.states[name] = (lay, pages, states)
        self._resync()

    @precondition(lambda self: self.mla or self.states)
    @rule(data=st.data())
    def free_request(self, data):
        name = data.draw(st.sampled_from(sorted(self.mla) + sorted(self.states)))
        if name in self.mla:
            self.mla.pop(name)[0].free()
        else:
            self.pool.decref([p for grp in self.states.pop(name)[1] for p in grp], name)
        self._resync()

    def _resync(self):
        """Rebuild the oracle from the caches' own tables (each cache's pages have its kind) plus the raw
        owners' references; the pool is then compared with it page by page."""
        held = Counter()
        for name, (cache, _) in self.mla.items():
            held.update((p, name, PageKind.MLA_KV) for p in cache.block_table)
        for name, (_, pages, _) in self.states.items():
            held.update((p, name, PageKind.KDA_STATE) for grp in pages for p in grp)
        raw = {(p, o, self.oracle.kind[p]): c for p, h in self.oracle.holders.items()
               for o, c in h.items() if o in OWNERS}
        self.oracle = OraclePool(self.pool.num_pages)
        for (p, o, kind), c in list(raw.items()) + list(held.items()):
            if p in self.oracle.free:
                self.oracle.alloc([p], kind, o)
                c -= 1
            assert self.oracle.kind[p] is kind, f"page {p} held as {kind.name} and {self.oracle.kind[p].name}"
            self.oracle.incref([p] * c, o)

    # ---- invariants ---------------------------------------------------------------------------------
    @invariant()
    def pool_matches_oracle(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_integrity()
        s = self.pool.stats()
        assert sum(s.pages_by_kind.values()) == self.pool.num_pages
        assert s.free_pages == len(self.oracle.free)
        for p, (kind, _, ref) in enumerate(self.pool.page_table()):
            assert ref >= 0
            if p in self.oracle.free:
                assert kind is PageKind.FREE and ref == 0      # never both free and referenced
            else:
                assert kind is self.oracle.kind[p] and self.pool.holders(p) == dict(self.oracle.holders[p])
        for cache, want in self.mla.values():
            cache.check_integrity()
            assert all(torch.equal(g[0], want[m]) for m, g in enumerate(cache.gather()))
        for lay, pages, states in self.states.values():          # no other write reached a state's pages
            got = read_state(lay, self.pool, pages)
            assert all(torch.equal(got[i].recurrent, s.recurrent) and torch.equal(got[i].conv, s.conv)
                       for i, s in states.items())

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for cache, _ in self.mla.values():
            cache.free()
        for name, (_, pages, _) in self.states.items():
            self.pool.decref([p for grp in pages for p in grp], name)
        for p, h in list(self.oracle.holders.items()):
            for o, c in h.items():
                if o in OWNERS:
                    self.pool.decref([p] * c, o)
        self.pool.check_integrity()
        assert self.pool.num_free == self.pool.num_pages   # no leak once every request is freed


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
