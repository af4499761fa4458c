"""Persistent state slots read and written in place (``serve.engine.model_runner``), under both page policies: a
request's slot is the first page of its state run (one page under "unified", a run of consecutive pages under the
server's default "multi_page"); the forward reads the arena by slot and commit writes it back by slot. Pinned here:
a pad row (slot -1, NaN inputs) writes no slot, not even slot 0 (tokenspeed#700, sglang#30974); a request admitted
onto a finished one's pages never sees its state (tpu-inference#3412); decode, verify and prefill rows all go
through the arena views and a step moves each live state about once each way (no dense gather and scatter:
counted); batched equals alone bitwise; and the dense path still runs with ReplaySSM."""
from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import serve.engine.model_runner as model_runner
from serve.config import ServeConfig
from serve.engine import ServeEngine
from serve.engine.model_runner import ModelRunner
from serve.engine.request import RequestStatus
from serve.memory.pages import read_state, write_state
from serve.memory.pool import PageKind, PagePool
from serve.prefix.cache import PrefixCache
from tests.serve.engine_helpers import STRATEGIES, oracle_speculation
from tests.serve.prefix.helpers import tiny_model, tokens
from tests.serve.test_model_runner_slots import random_states

POLICIES = [pytest.param("unified", id="unified"), pytest.param("multi_page", id="multipage")]


def engine(cache: bool = False, num_pages: int | None = None, poison: bool = True, policy: str = "unified",
           state_dtype=torch.float32, speculation=None, num_groups: int = 1, **kw) -> ServeEngine:
    """The tiny model's engine; ``num_pages`` None: 64 unified pages, or as many bytes of multi_page pages."""
    model = tiny_model()
    config = ServeConfig(16, 16, num_groups=num_groups, page_policy=policy, state_dtype=state_dtype)
    if num_pages is None:
        num_pages = 64 * ServeConfig(16, 16, page_policy="unified").page_bytes(model.cfg) // config.page_bytes(model.cfg)
    pool = PagePool(num_pages, config.page_bytes(model.cfg), poison=poison)
    pc = PrefixCache(pool, config, cfg=model.cfg) if cache else None
    return ServeEngine(model, pool, pc, config=config, speculation=speculation, **kw)


def alone(prompt, n: int, **kw):
    return engine(**kw).generate(prompt, n, record_logits=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_pad_rows_fed_nan_write_no_slot_not_even_slot_0(policy):
    """Three decoders run as a bucket of 4 rows: the pad row (slot -1, NaN hidden states) must write nothing.
    Slot 0 (the run of pages from page 0) is a live state slot outside the batch (a bystander's), so a -1 clamped
    to 0 anywhere in the reads or writes by slot would overwrite it with NaN; every page but the rows' own stays
    bitwise unchanged."""
    eng = engine(policy=policy)
    lay, pool = eng.layout, eng.pool
    bystander = tuple(pool.alloc(PageKind.KDA_STATE, lay.group_pages(0), "bystander"))
    assert bystander == tuple(range(lay.group_pages(0)))
    write_state(lay, pool, [bystander], random_states(eng.model, torch.Generator().manual_seed(5)))
    prompts = [tokens(70 + i, 12 + 5 * i) for i in range(3)]
    rids = [eng.submit(p, 6, record_logits=True) for p in prompts]
    eng.step()                                                           # all three prefilled, decoding
    for _ in range(4):
        before = pool.arena.clone()
        eng.step()
        b = eng.last_batch
        assert (b.num_decode, b.num_pad) == (3, 1) and b.meta.slot_idx.tolist()[-1] == -1
        assert b.slot_idx.dtype == torch.long and b.slot_idx.shape == (1, 4)
        own = {p for rid in rids for grp in eng.requests[rid].state_pages for p in grp}
        own |= {p for rid in rids for p in eng.requests[rid].page_table}
        changed = (pool.arena != before).any(dim=1).nonzero().flatten().tolist()
        assert not set(bystander) & set(changed) and set(changed) <= own, f"pages written outside the rows: {changed}"
    assert eng.runner.in_place == (True,) and eng.runner.num_dense_copies == 0
    assert torch.isfinite(read_state(lay, pool, [bystander])[eng.model.cfg.kda_layers[0]].recurrent).all()
    eng.run_until_idle()
    for rid, p in zip(rids, prompts):
        ref = alone(p, 6, policy=policy)
        assert eng.result(rid).output_tokens == ref.output_tokens and torch.equal(eng.result(rid).logits, ref.logits)


def finished_then_planted(eng: ServeEngine, prompt) -> None:
    """Run ``prompt`` to the end, then fill every free page with the bytes of its state run's pages (page p gets
    those of the run's page (p - first) mod n): whatever run the next request gets holds the finished request's
    state, or a shifted copy of it (pages reused without zeroing or restoring)."""
    rid = eng.submit(prompt, 4)
    while eng.requests[rid].status is not RequestStatus.FINISHED:
        if len(eng.requests[rid].output) == 3:
            run = eng.requests[rid].state_pages[0]
            last = eng.pool.arena[list(run)].clone()                     # [n, page_bytes]
        eng.step()
    for p in range(eng.pool.num_pages):
        if eng.pool.refcount(p) == 0:
            eng.pool.arena[p] = last[(p - run[0]) % len(run)]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_fresh_request_on_a_finished_ones_page_starts_from_zeros(monkeypatch, policy):
    """tpu-inference#3412: a request admitted after a finished one must not see its state. Cold admission zeroes
    the slot (seen by the first forward that holds the new request) and the request equals its run alone."""
    eng = engine(poison=False, policy=policy)
    finished_then_planted(eng, tokens(80, 40))
    seen, real_run = [], eng.runner.run

    def spy(batch):
        for r in batch.rows:
            if r.req is not None and r.req.rid == rid and not seen:
                seen.append(read_state(eng.layout, eng.pool, r.req.state_pages))
        return real_run(batch)

    monkeypatch.setattr(eng.runner, "run", spy)
    prompt = tokens(81, 30)
    rid = eng.submit(prompt, 5, record_logits=True)
    eng.run_until_idle()
    assert all(not c.recurrent.any() and not c.conv.any() for c in seen[0].values()), "slot not zeroed at admission"
    ref = alone(prompt, 5, policy=policy)
    assert eng.result(rid).output_tokens == ref.output_tokens and torch.equal(eng.result(rid).logits, ref.logits)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prefix_hit_on_a_finished_ones_page_restores_its_checkpoint(policy):
    """With a prefix hit the checkpoint (under multi_page: pages anywhere in the pool, not a run) is copied into
    the new request's own state run (its slot) at admission; skipping that restore leaves the finished request's
    state there and changes the logits."""
    prompt_a, prompt_b = tokens(90, 40), tokens(90, 40)[:33] + tokens(91, 9)
    eng = engine(cache=True, poison=False, policy=policy)
    finished_then_planted(eng, prompt_a)
    rid = eng.submit(prompt_b, 5, record_logits=True)
    eng.run_until_idle()
    assert eng.result(rid).hit_tokens == 32
    ref_eng = engine(cache=True, poison=False, policy=policy)            # the same history, nothing planted
    ref_eng.generate(prompt_a, 4)
    ref = ref_eng.generate(prompt_b, 5, record_logits=True)
    assert ref.hit_tokens == 32
    assert eng.result(rid).output_tokens == ref.output_tokens and torch.equal(eng.result(rid).logits, ref.logits)


class MovedBytes(TorchDispatchMode):
    """Bytes written by data-movement ops (gathers, scatters, copies, concatenations): an out-of-place op's
    output, an in-place one's source (not its whole destination, e.g. the arena)."""

    OUT = {"index_select", "index", "cat", "stack", "clone", "_to_copy", "contiguous"}
    SOURCE = {"index_copy_": 3, "index_copy": 3, "index_put_": 2, "index_put": 2, "copy_": 1}

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        t = out if name in self.OUT else args[self.SOURCE[name]] if name in self.SOURCE else None
        if isinstance(t, torch.Tensor):
            self.bytes += t.numel() * t.element_size()
        return out


PROMPTS = [tokens(100 + i, 18 + 9 * i) for i in range(3)]


NEW = 5                                                                  # output tokens per request here


@functools.cache
def greedy_refs() -> dict:
    return {tuple(p): engine().generate(p, NEW).output_tokens for p in PROMPTS}


def speculation():
    """Noisy-oracle drafts for :data:`PROMPTS` (every decoding row is a verify row)."""
    return oracle_speculation(greedy_refs(), next(iter(STRATEGIES)), 0.3, 3)


def mixed_step(monkeypatch, mode: str, in_place: bool, policy: str = "unified"):
    """Two requests decoding (``mode`` "verify+prefill": verifying drafts) and a third arriving: run the mixed
    step, counting the bytes its run and commit move (:class:`MovedBytes`) and the storage of the KDA states
    forward_batch gets. Returns the engine, its request ids, the bytes and those storages."""
    eng = engine(speculation=speculation() if mode == "verify+prefill" else None, policy=policy)
    if not in_place:                                                     # the dense path, as the reference
        eng.runner = eng.postprocess.runner = ModelRunner(eng.model, eng.pool, eng.layout, in_place=False)
    rids = [eng.submit(p, NEW, record_logits=True) for p in PROMPTS[:2]]
    eng.step()
    rids.append(eng.submit(PROMPTS[2], NEW, record_logits=True))
    got, real_fb = [], model_runner.forward_batch

    def spy(model, toks, meta, pools, **kw):
        got.append({ls.recurrent.untyped_storage().data_ptr() for ls in pools.kda.values()}
                   | {ls.conv.untyped_storage().data_ptr() for ls in pools.kda.values()})
        return real_fb(model, toks, meta, pools, **kw)

    monkeypatch.setattr(model_runner, "forward_batch", spy)
    runner, moved = eng.runner, MovedBytes()
    real_run, real_commit = runner.run, runner.commit
    monkeypatch.setattr(runner, "run", lambda batch: _counted(moved, real_run, batch))
    monkeypatch.setattr(runner, "commit", lambda *a, **kw: _counted(moved, real_commit, *a, **kw))
    eng.step()
    monkeypatch.undo()
    kinds = {"verify" if r.verify else "decode" if r.decode else "prefill" for r in eng.last_batch.rows if r.req}
    assert kinds == {mode.split("+")[0], "prefill"}, kinds
    return eng, rids, moved.bytes, got[-1]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", ["decode+prefill", "verify+prefill"])
def test_a_step_reads_and_writes_the_arena_in_place_and_copies_no_live_state(monkeypatch, mode, policy):
    """A mixed step (decode or verify rows beside a prefill row): forward_batch gets views of the pool's arena
    for every KDA layer, each row's slot is the first page of its state run, no dense gather or scatter runs
    (``num_dense_copies`` stays 0), and the step moves at least 2.5 live states fewer bytes than the dense path
    (which gathers the states into a dense copy and scatters them back: measured 3 states more per step here);
    every request still equals its run alone bitwise."""
    eng, rids, moved, storages = mixed_step(monkeypatch, mode, True, policy)
    assert eng.runner.in_place == (True,) and eng.runner.num_dense_copies == 0
    assert storages == {eng.pool.arena.untyped_storage().data_ptr()}, "a KDA layer's state is not the arena"
    b = eng.last_batch
    live = [r.req for r in b.rows if r.req is not None]
    assert b.meta.slot_idx[b.meta.slot_idx >= 0].tolist() == [req.state_pages[0][0] for req in live]
    assert all(eng.pool.is_run(req.state_pages[0]) for req in live)
    dense_eng, _, moved_dense, storages_dense = mixed_step(monkeypatch, mode, False, policy)
    assert eng.pool.arena.untyped_storage().data_ptr() not in storages_dense
    assert dense_eng.runner.num_dense_copies > 0
    state_bytes = eng.layout.state_bytes * len(live)
    assert moved <= moved_dense - 2.5 * state_bytes, \
        f"in place moved {moved} bytes, the dense path {moved_dense}, for {state_bytes} bytes of live state"
    eng.run_until_idle()
    for rid, p in zip(rids, PROMPTS):
        ref = alone(p, NEW, speculation=speculation() if mode == "verify+prefill" else None, policy=policy)
        assert eng.result(rid).output_tokens == ref.output_tokens and torch.equal(eng.result(rid).logits, ref.logits)


def _counted(mode: MovedBytes, fn, *a, **kw):
    with mode:
        return fn(*a, **kw)


@pytest.mark.parametrize("policy,state_dtype,groups,state_write,in_place", [
    pytest.param("unified", torch.bfloat16, 1, "slot", (True,), id="unified-bf16-in-place"),
    pytest.param("multi_page", torch.float32, 1, "slot", (True,), id="multipage-in-place"),
    pytest.param("multi_page", torch.bfloat16, 2, "slot", (True, True), id="multipage-bf16-2groups-in-place"),
    pytest.param("multi_page", torch.float32, 1, "replay_ssm", (False,), id="multipage-replayssm-dense")])
def test_batched_equals_alone_in_place_and_dense(policy, state_dtype, groups, state_write, in_place):
    """A bf16 state is read and written in place (rounded to nearest on the write); a multi-page state in place
    through its run (two groups: runs of 4 and 2 pages); ReplaySSM on the dense path (the only place it is
    still needed). Each way each request equals its run alone, bitwise, and only the dense one copies states."""
    prompts = [tokens(110 + i, 15 + 11 * i) for i in range(3)]
    kw = dict(policy=policy, state_dtype=state_dtype, num_groups=groups, state_write=state_write)
    eng = engine(**kw)
    assert eng.runner.in_place == in_place
    rids = [eng.submit(p, 6, record_logits=True) for p in prompts]
    while eng.step():
        eng.memory.check_integrity([eng.requests[r] for r in eng.running], [eng.requests[r] for r in eng.waiting])
    assert (eng.runner.num_dense_copies > 0) == (not all(in_place))
    for rid, p in zip(rids, prompts):
        ref = alone(p, 6, **kw)
        assert eng.result(rid).output_tokens == ref.output_tokens and torch.equal(eng.result(rid).logits, ref.logits)


def test_a_multi_page_state_lives_in_one_run_even_when_the_smallest_free_pages_are_scattered():
    """multi_page: a bystander holds every odd page below 24 and 24..39, so the smallest free pages are 0, 2, 4...
    (where KV pages go) and the only run of 6 is at the top. The request's state must be that run (its slot is
    the run's first page; the arena views read 6 consecutive pages from there): state pages taken like KV pages
    would put the slot over the bystander's pages (seen red: the in-place writes of slot 0 = pages 0..5 overwrote
    the bystander's pages 1, 3, 5). It equals its run alone, bitwise, and the bystander's bytes are untouched."""
    eng = engine(policy="multi_page", num_pages=60)
    pool, n = eng.pool, eng.layout.group_pages(0)
    held = pool.alloc(PageKind.MLA_KV, 60, "bystander")
    pool.decref([p for p in held if p < 24 and p % 2 == 0 or p >= 40], "bystander")
    theirs = [p for p in range(60) if pool.refcount(p)]
    before = pool.arena[theirs].clone()
    prompt = tokens(120, 20)
    rid = eng.submit(prompt, 4, record_logits=True)
    eng.step()
    req = eng.requests[rid]
    pages = req.state_pages, req.page_table
    pool.check_integrity()
    eng.run_until_idle()
    ref = alone(prompt, 4, policy="multi_page")
    assert eng.result(rid).reason == "" and eng.result(rid).output_tokens == ref.output_tokens
    assert torch.equal(eng.result(rid).logits, ref.logits)
    assert torch.equal(pool.arena[theirs], before), "the request's state was written over the bystander's pages"
    assert pages == ([tuple(range(60 - n, 60))], [0, 2])


@pytest.mark.parametrize("policy", POLICIES)
def test_snapshot_speculation_verifies_into_k_plus_1_slots_held_for_life(monkeypatch, policy):
    """Snapshot speculation of k = 3 drafts: every running request holds k + 1 = 4 state slots (runs under
    multi_page) for its whole life; a verify row writes the state after each of its tokens into them by index
    and the commit makes the accepted one current (it moves when drafts are accepted) -- no read of the request's
    cache into tensors, no snapshot record, no copy back. Tokens and logits equal the copying path's (projection
    replay) bitwise, and integrity (4 slots each, runs) holds after every step."""
    import serve.engine.engine as engine_module
    from serve.spec_decode.snapshot import SnapshotRollback

    def never(*a, **kw):
        raise AssertionError("the snapshot-in-slots path copied the request's cache or recorded a snapshot")

    new = 14
    refs = {tuple(p): engine().generate(p, new).output_tokens for p in PROMPTS}
    eng = engine(speculation=oracle_speculation(refs, "snapshot", 0.3, 3), policy=policy)
    monkeypatch.setattr(engine_module, "read_request_cache", never)
    monkeypatch.setattr(SnapshotRollback, "record", never)
    assert eng.memory.slots_per_request == 4
    rids = [eng.submit(p, new, record_logits=True) for p in PROMPTS]
    held, moved = {}, 0
    while eng.step():
        eng.memory.check_integrity([eng.requests[r] for r in eng.running], [eng.requests[r] for r in eng.waiting])
        for r in eng.running:
            req = eng.requests[r]
            assert len(req.spec_slots) == 4 and held.setdefault(r, req.spec_slots) == req.spec_slots
            moved += req.state_pages != req.spec_slots[0]
    monkeypatch.undo()
    for rid, p in zip(rids, PROMPTS):
        ref = alone(p, new, speculation=oracle_speculation(refs, "projection", 0.3, 3), policy=policy)
        assert eng.result(rid).output_tokens == ref.output_tokens and torch.equal(eng.result(rid).logits, ref.logits)
    assert moved > 0, "no verify accepted a draft: the slot choice was never exercised"
