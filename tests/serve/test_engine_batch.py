"""Continuous batching through ``ServeEngine``: every request's tokens and logits in any batch are
bitwise those of the same request run alone (with fp32 and with bf16 stored states); slots and pages are
conserved after aborts, rejections and preemptions; never more running requests than state slots."""
from __future__ import annotations

import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from serve.config import ServeConfig
from serve.engine import EngineArgs, ServeEngine, build_engine
from serve.engine.request import RequestStatus
from serve.memory.pool import PagePool
from tests.serve.engine_helpers import STRATEGIES, oracle_speculation
from tests.serve.prefix.helpers import tiny_model, tokens

NEAR = [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129]   # around block (16) and chunk (64) multiples


def engine(cache: bool, block: int = 64, num_pages: int = 160, state_dtype=torch.float32, **kw) -> ServeEngine:
    """An engine on a poisoned pool (never-written pages read NaN) storing states in ``state_dtype``; the
    cache's blocks and checkpoint interval are 64 tokens, so a hit lies on the 64-token grid and (fp32) a
    warm prefill is bitwise cold."""
    config = ServeConfig(block, block, page_policy="unified", state_dtype=state_dtype)
    return build_engine(EngineArgs(tiny_model(), num_pages, config, prefix_cache=cache, poison=True, **kw))


def alone(prompt, new, cache: bool, **kw):
    """The request run alone (a fresh engine, same settings, nothing else submitted)."""
    return engine(cache, **kw).generate(prompt, new, record_logits=True)


def alone_warm(prompt, new, hit: int, **kw):
    """The request run alone from a hit at ``hit`` tokens: a fresh cache-on engine first serves
    ``prompt[:hit] + [0]`` (publishing the checkpoint at ``hit``), then the request. With a 16-bit state a warm
    run restores a rounded state, so its batch-1 twin must start from the same checkpoint."""
    eng = engine(True, **kw)
    eng.generate(list(prompt[:hit]) + [0], 1)
    res = eng.generate(prompt, new, record_logits=True)
    assert res.hit_tokens == hit
    return res


def drive(eng: ServeEngine, arrivals, aborts=None, preempt_at=()):
    """Submit ``(step, prompt, new)`` arrivals at their steps and step to idle, checking integrity and the
    slot cap after every step. Returns {rid: prompt}."""
    aborts = aborts or {}
    pending, rids, steps = sorted(arrivals, key=lambda a: a[0]), {}, 0
    cap = eng.sched_config.max_running
    while pending or eng.waiting or eng.running:
        while pending and pending[0][0] <= steps:
            _, prompt, new = pending.pop(0)
            rids[eng.submit(prompt, new, record_logits=True)] = prompt
        for rid, at in list(aborts.items()):
            if at == steps and rid in rids:
                eng.abort(rid)
        if steps in preempt_at:
            eng.preempt_newest()
        eng.step()
        if eng.last_batch is not None:
            drive.max_live_rows = max(drive.max_live_rows, len(eng.last_batch.rows) - eng.last_batch.num_pad)
        eng.check_integrity()
        assert cap is None or len(eng.running) <= cap, f"{len(eng.running)} running > {cap} slots"
        steps += 1
        assert steps < 5000
    return rids


drive.max_live_rows = 0
request = st.tuples(st.integers(0, 6), st.sampled_from(NEAR) | st.integers(1, 140), st.integers(1, 6))


@settings(max_examples=25, deadline=None)
@given(reqs=st.lists(request, min_size=1, max_size=6), max_num_seqs=st.integers(1, 16),
       budget=st.sampled_from([None, 64, 128, 40, 200]), cache=st.booleans(), shared=st.booleans(),
       state_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
@example(reqs=[(0, 20, 3), (3, 30, 3), (3, 70, 4), (4, 1, 2)], max_num_seqs=4, budget=None, cache=True, shared=True,
         state_dtype=torch.float32)
@example(reqs=[(0, 129, 3), (2, 64, 5), (2, 65, 4)], max_num_seqs=3, budget=64, cache=True, shared=True,
         state_dtype=torch.float32)
@example(reqs=[(0, 17, 6), (0, 63, 6), (1, 140, 2), (1, 2, 6), (2, 33, 6)], max_num_seqs=16, budget=40,
         cache=False, shared=False, state_dtype=torch.float32)
@example(reqs=[(0, 129, 3), (1, 20, 5), (1, 140, 4), (2, 65, 4)], max_num_seqs=3, budget=128, cache=True, shared=True,
         state_dtype=torch.bfloat16)
@example(reqs=[(0, 17, 6), (0, 63, 6), (1, 140, 2), (1, 2, 6), (2, 33, 6)], max_num_seqs=16, budget=64,
         cache=False, shared=False, state_dtype=torch.bfloat16)
def test_batched_equals_alone_bitwise(reqs, max_num_seqs, budget, cache, shared, state_dtype):
    """Tokens AND logits of every request in the batch are bitwise its run alone (same settings, same
    stored state dtype). With the cache on, prompts may share a 64-token-aligned prefix, so some requests
    start warm: in fp32 a warm run is bitwise the cold one; in bf16 its twin starts from the same hit."""
    if cache and budget is not None and budget % 64:
        budget = 128                   # off-grid chunks make a warm prefill differ by rounding (documented)
    base = tokens(999, 128)
    arrivals = [(t, (base[:64] if shared else []) + tokens(10 + i, n), new)
                for i, (t, n, new) in enumerate(reqs)]
    kw = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, state_dtype=state_dtype)
    eng = engine(cache, **kw)
    rids = drive(eng, arrivals)
    for rid, prompt in rids.items():
        res = eng.result(rid)
        assert res.status is RequestStatus.FINISHED
        if res.hit_tokens and state_dtype != torch.float32:
            ref = alone_warm(prompt, len(res.output_tokens), res.hit_tokens, **kw)
        else:
            ref = alone(prompt, len(res.output_tokens) or 1, cache=False, **kw)
        assert res.output_tokens == ref.output_tokens, f"request {rid}: tokens differ from alone"
        assert torch.equal(res.logits, ref.logits), f"request {rid}: logits differ from alone (hit {res.hit_tokens})"
        event(f"hit {res.hit_tokens > 0}")
    event(f"rows in a batch up to {drive.max_live_rows}")
    drive.max_live_rows = 0
    if cache:
        eng.cache.clear()
    assert eng.pool.num_free == eng.pool.num_pages, "pages leaked"


def test_decode_batch_holds_pad_rows_and_matches_one_row_per_forward():
    """Three decoding requests run as one bucket of 4 rows (one pad row, slot -1; a live row's slot is its state page); each equals the same
    request on the batch-1 baseline (``rows_per_forward=1``: every forward holds one row, no pad) bitwise."""
    prompts = [tokens(40 + i, 20 + 7 * i) for i in range(3)]
    eng = engine(False)
    rids = [eng.submit(p, 5, record_logits=True) for p in prompts]
    eng.step()                                           # admit all three, prefill all three
    eng.step()                                           # one decode step for all three
    b = eng.last_batch
    assert (b.num_decode, b.num_pad, len(b.rows)) == (3, 1, 4)
    assert b.meta.slot_idx.tolist() == [eng.requests[rid].state_pages[0][0] for rid in rids] + [-1]
    eng.run_until_idle()
    one = engine(False, rows_per_forward=1)
    one_rids = [one.submit(p, 5, record_logits=True) for p in prompts]
    while one.step():
        assert (len(one.last_batch.rows), one.last_batch.num_pad) == (1, 0), "a forward held more than one row"
    for rid, one_rid in zip(rids, one_rids):
        res, old = eng.result(rid), one.result(one_rid)
        assert res.output_tokens == old.output_tokens and torch.equal(res.logits, old.logits)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache", [False, True])
def test_preempted_request_equals_its_uninterrupted_output(cache, state_dtype):
    """Preemption by recompute (newest running request: slot and pages freed, back at the head of the
    queue) gives bitwise the uninterrupted output; pages return to the baseline. With the cache a recompute
    may restart from the request's own checkpoint: with a 16-bit state its twin then starts from that hit."""
    prompts = [tokens(60 + i, 30 + 20 * i) for i in range(3)]
    eng = engine(cache, state_dtype=state_dtype)
    rids = drive(eng, [(0, p, 6) for p in prompts], preempt_at=(2, 4))
    for rid, p in rids.items():
        res = eng.result(rid)
        if res.hit_tokens and state_dtype != torch.float32:
            ref = alone_warm(p, 6, res.hit_tokens, state_dtype=state_dtype)
        else:
            ref = alone(p, 6, cache=False, state_dtype=state_dtype)
        assert res.output_tokens == ref.output_tokens and torch.equal(res.logits, ref.logits)
    if cache:
        eng.cache.clear()
    assert eng.pool.num_free == eng.pool.num_pages


def test_state_slots_cap_running_requests_and_pages_are_conserved():
    """With 2 state slots never more than 2 requests run; aborts (waiting, mid-prefill, mid-decode) and
    a rejection give every page back."""
    eng = engine(False, num_pages=40, num_state_slots=2, max_num_batched_tokens=64)
    arrivals = [(0, tokens(70 + i, 50), 8) for i in range(5)] + [(1, tokens(90, 4000), 2)]   # last never fits
    rids = drive(eng, arrivals, aborts={0: 1, 3: 0, 1: 4})
    statuses = {rid: eng.result(rid).status for rid in rids}
    assert statuses[5] is RequestStatus.REJECTED
    assert [statuses[r] for r in (0, 1, 3)] == [RequestStatus.ABORTED] * 3
    assert statuses[2] is statuses[4] is RequestStatus.FINISHED
    assert eng.pool.num_free == eng.pool.num_pages


def test_scheduler_rejects_bad_caps():
    for kw in ({"max_num_seqs": 0}, {"max_num_batched_tokens": -1}, {"num_state_slots": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            engine(False, **kw)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_speculation_through_the_batched_engine_equals_alone(strategy, state_dtype):
    """With speculation every decoding row verifies its own drafts in the same forward (verify rows next
    to prefill rows) and commits through its own rollback strategy; every request (several in flight,
    arriving at different steps) is bitwise the previous engine's batch-1 verify, with every strategy and
    both stored state dtypes (a 16-bit state is rounded where the verify commit writes it)."""
    prompts = [tokens(120 + i, 20 + 23 * i) for i in range(3)]
    refs = {tuple(p): alone(p, 12, cache=False, state_dtype=state_dtype).output_tokens for p in prompts}

    def spec_eng(rows_per_forward=None):
        model = tiny_model()
        config = ServeConfig(16, 16, page_policy="unified", state_dtype=state_dtype)
        pool = PagePool(96, config.page_bytes(model.cfg), poison=True)
        return ServeEngine(model, pool, None, config=config, max_num_seqs=4, rows_per_forward=rows_per_forward,
                           speculation=oracle_speculation(refs, strategy, 0.3, 3))

    eng = spec_eng()
    rids = drive(eng, [(i, p, 12) for i, p in enumerate(prompts)])
    assert drive.max_live_rows >= 2, "the verify rows never shared a forward"
    drive.max_live_rows = 0
    for rid, p in rids.items():
        res, ref = eng.result(rid), spec_eng(rows_per_forward=1).generate(p, 12, record_logits=True)
        assert res.output_tokens == ref.output_tokens
        if state_dtype == torch.float32:   # lossless: a 16-bit state is rounded after each verify, not each token
            assert res.output_tokens == refs[tuple(p)]
        assert torch.equal(res.logits, ref.logits), "batched verify differs from the batch-1 verify"
        assert res.drafted_tokens == ref.drafted_tokens > 0 and res.accepted_tokens == ref.accepted_tokens
