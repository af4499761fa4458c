"""ServeEngine correctness scenarios: every warm run equals the cache-off run.

"Equal" = greedy tokens identical and logits within 1e-5 of the cache-off run, fp32.
"""
from __future__ import annotations

import pytest
import torch

from serve.config import ServeConfig
from serve.engine import EngineArgs, build_engine
from serve.engine.request import RequestStatus
from serve.memory.kinds import POISON_BYTE
from serve.memory.pages import read_state, write_state
from serve.prefix.cache import CheckpointError, PrefixCache
from serve.prefix.index import PrefixIndex
from tests.serve.engine_helpers import poison_state, step_until
from tests.serve.prefix.helpers import (
    LOGITS_ATOL,
    assert_equal_to_reference,
    make_engine,
    max_logit_error,
    reference,
    run_checked,
    tiny_model,
    tokens,
)

torch.set_num_threads(1)  # 2 shared cores: oversubscribed OpenMP threads slow every forward ~50x


def test_engine_without_cache_is_the_model():
    """The cache-off engine (pages, gathers, chunking) is bitwise the plain model run."""
    eng = make_engine(cache=False)
    prompt = tokens(0, 37)
    res = run_checked(eng, prompt, 4)
    ref_tokens, ref_logits = reference(prompt, 4)
    assert res.output_tokens == ref_tokens and torch.equal(res.logits, ref_logits)
    assert res.prefill_tokens == 37 and res.hit_tokens == 0 and res.ttft_ms > 0


def test_scenario1_shared_40_tokens_hits_32():
    eng = make_engine(block_size=16, interval=16)
    shared = tokens(1, 40)
    r1, r2 = shared + tokens(2, 8), shared + tokens(3, 8)
    a = run_checked(eng, r1)
    b = run_checked(eng, r2)
    assert a.hit_tokens == 0 and b.hit_tokens == 32 and b.prefill_tokens == 16
    assert b.shared_kv_bytes == 2 * eng.layout.kv_block_bytes and b.restored_bytes == eng.layout.state_bytes
    for res, p in ((a, r1), (b, r2)):
        assert_equal_to_reference(res, p)


def test_identical_resubmit_hits_below_the_last_token():
    """A 48-token prompt sent twice (N = 16): phase 1 stops at 47 (one token must be computed for the
    logits), so the hit is the checkpoint at 32 and 16 tokens are prefilled, not a hit of 48 with nothing
    left to compute (vLLM issue #50235)."""
    eng = make_engine(block_size=16, interval=16)
    prompt = tokens(60, 48)
    a = run_checked(eng, prompt)
    hit = eng.cache.lookup(prompt)
    assert (hit.kv_tokens, hit.num_tokens) == (47, 32)
    assert [c.boundary for c in eng.cache.checkpoints()] == [16, 32, 48]
    b = run_checked(eng, prompt)
    assert (a.hit_tokens, b.hit_tokens, b.prefill_tokens) == (0, 32, 16)
    for res in (a, b):
        assert_equal_to_reference(res, prompt)


def test_scenario2_interior_checkpoint_of_a_single_prefill():
    """R1 = 256 tokens in one scheduled prefill: the engine still splits at 64/128/192 internally."""
    eng = make_engine(block_size=64, interval=64, num_pages=32)
    r1 = tokens(4, 256)
    run_checked(eng, r1, 1)
    assert [c.boundary for c in eng.cache.checkpoints()] == [64, 128, 192, 256]
    r2 = r1[:128] + tokens(5, 100)
    res = run_checked(eng, r2)
    assert res.hit_tokens == 128
    assert_equal_to_reference(res, r2)


def _restore_mutant(monkeypatch, eng, edit):
    """Make every restore apply ``edit(kda_caches) -> kda_caches`` to the restored private state."""
    original = PrefixCache.restore

    def mutated(self, hit, owner, dst):
        n = original(self, hit, owner, dst)
        caches = read_state(eng.layout, eng.pool, dst)
        write_state(eng.layout, eng.pool, dst, edit(caches))
        return n

    monkeypatch.setattr(PrefixCache, "restore", mutated)


def _state_after(prompt, n):
    _, cache = tiny_model().prefill(torch.tensor([prompt[:n]]))
    return {i: cache.layers[i] for i in tiny_model().cfg.kda_layers}


def _scenario3(monkeypatch=None, mutant=None):
    eng = make_engine(block_size=64, interval=64, num_pages=32)
    r1 = tokens(6, 130)
    run_checked(eng, r1, 1)
    if mutant is not None:
        _restore_mutant(monkeypatch, eng, mutant(r1))
    r2 = r1[:128] + tokens(7, 5)
    res = run_checked(eng, r2)
    assert res.hit_tokens == 128
    return eng, r1, res, max_logit_error(res, r2)


def test_scenario3_checkpoint_holds_the_state_after_exactly_128():
    eng, r1, _, err = _scenario3()
    assert err <= LOGITS_ATOL
    keys = eng.cache.keys(r1)
    node = eng.cache.index.node(keys[1])
    stored = read_state(eng.layout, eng.pool, [node.ckpts[0].payload])
    for n, should_match in ((128, True), (127, False), (129, False), (64, False)):
        ref = _state_after(r1, n)
        close = all(torch.allclose(stored[i].recurrent, ref[i].recurrent, atol=1e-6)
                    and torch.allclose(stored[i].conv, ref[i].conv, atol=1e-6) for i in ref)
        assert close == should_match, f"checkpoint at 128 vs state after {n}"


MUTANTS = {
    "zeroed-conv": lambda r1: lambda c: {i: x._replace(conv=torch.zeros_like(x.conv)) for i, x in c.items()},
    "conv-shifted-one-token": lambda r1: lambda c: {
        i: x._replace(conv=_state_after(r1, 127)[i].conv) for i, x in c.items()},
    "state-from-64": lambda r1: lambda c: _state_after(r1, 64),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_scenario3_mutants_are_caught(monkeypatch, name):
    *_, err = _scenario3(monkeypatch, MUTANTS[name])
    assert err > LOGITS_ATOL, f"mutant {name} was not caught (max error {err})"


def test_scenario3_mislabelled_checkpoint_is_refused():
    """A checkpoint whose written-at length is not its boundary cannot be restored (or inserted)."""
    eng = make_engine(block_size=64, interval=64, num_pages=32)
    r1 = tokens(6, 130)
    run_checked(eng, r1, 1)
    node = eng.cache.index.node(eng.cache.keys(r1)[1])
    node.ckpts[0].written_at = 64
    rid = eng.submit(r1[:128] + tokens(7, 5), 2)
    eng.step()                                                   # rejected with the error; the engine goes on
    res = eng.result(rid)
    assert res.status is RequestStatus.REJECTED and "CheckpointError" in res.reason and "written at 64" in res.reason
    node.ckpts[0].written_at = 128
    eng.check_integrity()
    with pytest.raises(CheckpointError):
        eng.cache.publish_checkpoint(eng.cache.keys(r1), 1, [()], 63, "someone")


def test_scenario4_hit_pages_are_pinned_before_allocation():
    """6 pages: R1 leaves 2 KV blocks + checkpoints 16 and 32 cached; R2 hits 2 blocks and needs more
    pages than are free: eviction takes the unpinned checkpoint at 16, never a hit page."""
    eng = make_engine(block_size=16, interval=16, num_pages=6)
    r1 = tokens(8, 40)
    run_checked(eng, r1, 1)
    assert eng.pool.num_free == 2 and [c.boundary for c in eng.cache.checkpoints()] == [16, 32]
    r2 = r1[:32] + tokens(9, 30)
    hit = eng.cache.lookup(r2)
    hit_pages = set(hit.kv_pages) | {p for grp in hit.checkpoint_pages for p in grp}
    rid = eng.submit(r2, 1, record_logits=True)
    eng.step()                                   # admission + the first prefill chunk
    req = eng.requests[rid]
    new_pages = {p for grp in req.state_pages for p in grp} | set(req.page_table[len(hit.kv_pages):])
    assert hit_pages.isdisjoint(new_pages)
    eng.check_integrity()
    eng.run_until_idle()
    res = eng.result(rid)
    assert res.hit_tokens == 32
    assert_equal_to_reference(res, r2)
    eng.check_integrity()


def test_scenario4_request_that_cannot_fit_is_rejected_with_reason():
    eng = make_engine(block_size=16, interval=16, num_pages=6)
    r1 = tokens(8, 40)
    run_checked(eng, r1, 1)
    baseline = eng.pool.page_table()
    res = run_checked(eng, r1[:32] + tokens(10, 60), 1)
    assert res.status is RequestStatus.REJECTED and res.reason.startswith("needs 7 pages"), res.reason
    assert eng.pool.page_table() == baseline


def test_generate_returns_a_request_that_can_never_fit_as_rejected():
    """The rejection (with its reason) is the result; run_until_idle does not turn it into a RuntimeError."""
    eng = make_engine(block_size=16, interval=16, num_pages=4)
    res = eng.generate(tokens(15, 100), 2)
    assert res.status is RequestStatus.REJECTED and "needs" in res.reason and "pages" in res.reason
    rid = eng.submit(tokens(16, 100), 2)
    assert eng.run_until_idle() == 1 and eng.result(rid).status is RequestStatus.REJECTED
    eng.check_integrity()
    assert eng.pool.num_free == eng.pool.num_pages
    assert eng.generate(tokens(17, 20), 2).status is RequestStatus.FINISHED   # the engine still serves


def test_scenario4_request_waits_while_another_runs():
    eng = make_engine(block_size=16, interval=1024, num_pages=7)
    a, b = tokens(11, 40), tokens(12, 40)
    ra = eng.submit(a, 3, record_logits=True)
    rb = eng.submit(b, 3, record_logits=True)
    eng.step()
    assert eng.requests[rb].status is RequestStatus.WAITING     # 4 + 4 pages > 7
    eng.run_until_idle()
    eng.check_integrity()
    for rid, p in ((ra, a), (rb, b)):
        assert_equal_to_reference(eng.result(rid), p)


def test_scenario5_abort_before_admission_returns_pages():
    eng = make_engine(block_size=16, interval=16, num_pages=8)
    r1 = tokens(13, 40)
    run_checked(eng, r1, 1)
    baseline, free = eng.pool.page_table(), eng.pool.num_free
    for i in range(20):
        rid = eng.submit(r1[:32] + tokens(100 + i, 8), 2)
        assert eng.requests[rid].hit is None                 # looked up and pinned at admission
        eng.check_integrity()
        assert eng.abort(rid) and eng.result(rid).status is RequestStatus.ABORTED
        eng.check_integrity()
        assert eng.pool.num_free == free and eng.pool.page_table() == baseline
    assert not eng.abort(rid)


def test_abort_mid_prefill_and_mid_decode_leaks_nothing():
    eng = make_engine(block_size=16, interval=16, num_pages=16, max_prefill_chunk=8)
    p = tokens(14, 50)
    for steps in (1, 3, 9):
        rid = eng.submit(p, 4)
        for _ in range(steps):
            eng.step()
            eng.check_integrity()
        eng.abort(rid)
        eng.check_integrity()
    assert not eng.waiting and not eng.running
    eng.cache.clear()
    assert eng.pool.num_free == eng.pool.num_pages


def test_release_forgets_an_ended_request_only():
    """``release`` hands back an ended request's final result and forgets it; a live or unknown id is refused
    (ValueError naming it), so a server that releases what it has answered holds no record of it."""
    eng = make_engine(block_size=16, interval=16, num_pages=16)
    done, live = eng.submit(tokens(15, 20), 3), eng.submit(tokens(16, 20), 3)
    eng.step()
    with pytest.raises(ValueError, match=f"request {live} is still"):
        eng.release(live)
    eng.run_until_idle()
    res = eng.release(done)
    assert res.status is RequestStatus.FINISHED and len(res.output_tokens) == 3
    assert done not in eng.requests and live in eng.requests
    for rid in (done, 99):
        with pytest.raises(ValueError, match="unknown request id"):
            eng.release(rid)
    assert not eng.abort(live)                     # it finished too: nothing to abort
    eng.release(live)
    assert not eng.requests
    eng.check_integrity()


def _checkpointed_turns(eng, prompts):
    return [run_checked(eng, p, 1) for p in prompts]


def _scenario7_prompts():
    a1 = tokens(20, 20)
    a2 = a1 + tokens(21, 20)
    a3 = a2 + tokens(22, 20)
    b1 = tokens(23, 20)
    a4 = a3 + tokens(24, 16)
    b2 = b1 + tokens(25, 20)
    return [a1, a2, a3, b1, a4, b2]


def test_scenario7_hit_refreshes_only_the_consumed_checkpoint():
    eng = make_engine(block_size=16, interval=1024, num_pages=64, max_checkpoints=4)
    prompts = _scenario7_prompts()
    results = _checkpointed_turns(eng, prompts)
    assert [r.hit_tokens for r in results] == [0, 16, 32, 0, 48, 16]
    for res, p in zip(results, prompts):
        assert_equal_to_reference(res, p)


def test_scenario7_refreshing_every_ancestor_would_evict_b1(monkeypatch):
    """The same test catches the bug it guards against: touching every ancestor's checkpoint."""
    original = PrefixIndex.touch

    def touch_all(self, keys, num_blocks, with_checkpoint=True):
        for j in range(1, num_blocks):
            for g in sorted(self.nodes[keys[j - 1]].ckpts):
                self.lru.move_to_end(self.nodes[keys[j - 1]].ckpts[g])
        original(self, keys, num_blocks, with_checkpoint)

    monkeypatch.setattr(PrefixIndex, "touch", touch_all)
    eng = make_engine(block_size=16, interval=1024, num_pages=64, max_checkpoints=4)
    results = _checkpointed_turns(eng, _scenario7_prompts())
    assert results[-1].hit_tokens == 0


def test_scenario8_multi_turn_conversation():
    eng = make_engine(block_size=16, interval=64, num_pages=64)
    prompt = tokens(30, 45)
    prev_len = None
    for turn in range(5):
        res = run_checked(eng, prompt, 6)
        assert_equal_to_reference(res, prompt)
        if prev_len is not None:
            assert res.hit_tokens >= prev_len // 16 * 16, f"turn {turn + 1} hit {res.hit_tokens}"
        prev_len = len(prompt)
        prompt = prompt + list(res.output_tokens) + tokens(31 + turn, 13)


def test_groups_fall_back_to_a_boundary_every_group_has():
    eng = make_engine(block_size=16, interval=16, num_groups=3, num_pages=64, policy="multi_page")
    r1 = tokens(40, 70)
    run_checked(eng, r1, 1)
    assert eng.cache.stats().complete_boundaries == 4
    eng.cache.drop_checkpoint(r1, 64, 1)
    r2 = r1[:66] + tokens(41, 5)
    assert eng.cache.lookup(r2).num_tokens == 48
    res = run_checked(eng, r2)
    assert res.hit_tokens == 48
    assert_equal_to_reference(res, r2)


@pytest.mark.parametrize("prompt", [
    pytest.param([], id="empty"), pytest.param([300], id="300"), pytest.param(None, id="None"),
    pytest.param(torch.zeros(2, 3, dtype=torch.long), id="2-D"), pytest.param(torch.tensor(7), id="0-D"),
    pytest.param(7, id="scalar"), pytest.param("abc", id="str"), pytest.param([1.5, 2], id="float"),
    pytest.param([True, 2], id="bool"), pytest.param([1, None], id="None-id")])
def test_submit_rejects_bad_prompts(prompt):
    eng = make_engine()
    with pytest.raises(ValueError, match="tokens must be a non-empty 1-D sequence"):
        eng.submit(prompt, 2)
    assert not eng.requests and not eng.waiting


def test_submit_accepts_tensor_bytes_and_list():
    eng = make_engine(cache=False)
    p = tokens(3, 10)
    rids = [eng.submit(x, 1) for x in (p, torch.tensor(p), bytes(p))]
    assert [eng.requests[r].prompt for r in rids] == [p, p, p]


def test_submit_rejects_bad_input():
    eng = make_engine()
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.submit([1, 2], 0)
    with pytest.raises(ValueError, match="unknown request"):
        eng.result(99)


def test_waiting_request_rematches_at_admission():
    """R2 waits for pages (nothing cached yet); R1's one prefill forward publishes its checkpoints at 16, 32
    and 48 (the whole shared prefix), so the match at admission finds 48, which makes R2 need fewer pages, so
    it is admitted then; one lookup counted per admitted request."""
    eng = make_engine(block_size=16, interval=16, num_pages=9)
    shared = tokens(50, 48)
    r1, r2 = shared + tokens(51, 8), shared + tokens(52, 8)
    a = eng.submit(r1, 2, record_logits=True)
    b = eng.submit(r2, 2, record_logits=True)
    eng.step()
    assert eng.requests[b].status is RequestStatus.WAITING and eng.requests[b].hit.num_tokens == 0
    eng.run_until_idle()
    eng.check_integrity()
    stats = eng.cache.stats()
    assert eng.result(b).hit_tokens == 48 and stats.lookups == 2 and stats.hit_tokens == 48
    for rid, p in ((a, r1), (b, r2)):
        assert_equal_to_reference(eng.result(rid), p)


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_a_nan_state_in_decode_aborts_that_request_with_a_reason(cache):
    """A NaN state gave all-NaN logits and the engine emitted token 0 (argmax of NaN) until done, as a
    FINISHED request. Now that request is ABORTED with the cause, before anything is written or
    published; its neighbour finishes exactly as the cache-off run, and nothing leaks."""
    eng = make_engine(cache=cache)
    bad_prompt, good_prompt = tokens(40, 37), tokens(41, 37)
    bad = eng.submit(bad_prompt, 5)
    good = eng.submit(good_prompt, 5, record_logits=True)
    step_until(eng, bad, RequestStatus.DECODE)
    poison_state(eng, bad)
    while eng.step():
        eng.check_integrity()
    res = eng.result(bad)
    assert res.status is RequestStatus.ABORTED and len(res.output_tokens) == 1, res   # only the prefill's token
    assert res.reason.startswith("decode of output token 1: ") and "NaN" in res.reason, res.reason
    assert_equal_to_reference(eng.result(good), good_prompt)
    assert not eng.running and not eng.waiting
    if cache:
        eng.cache.clear()
    assert eng.pool.num_free == eng.pool.num_pages


def test_a_nan_state_in_prefill_aborts_that_request_with_a_reason():
    """Mid-prefill, the chunk kernel's NonFiniteError escaped step() and left the request in PREFILL, so
    every later step raised it again and no other request could run."""
    eng = make_engine(max_prefill_chunk=16)
    bad = eng.submit(tokens(42, 50), 3)
    step_until(eng, bad, RequestStatus.PREFILL)
    poison_state(eng, bad)
    good_prompt = tokens(43, 20)
    good = eng.submit(good_prompt, 3, record_logits=True)
    while eng.step():
        eng.check_integrity()
    res = eng.result(bad)
    assert res.status is RequestStatus.ABORTED and res.output_tokens == ()
    assert res.reason.startswith("prefill of tokens [16, 32): ") and "must be finite" in res.reason, res.reason
    assert_equal_to_reference(eng.result(good), good_prompt)
    eng.cache.clear()
    assert eng.pool.num_free == eng.pool.num_pages


def test_nan_logits_abort_the_request_before_a_token_is_emitted():
    """A NaN KV page reaches only the last (MLA) layer here, so no kernel sees it: the logits are NaN and
    the engine emitted token 0. It now checks the logits and aborts (the cache-off engine: its KV
    pages are its own, shared with no cache)."""
    eng = make_engine(cache=False)
    rid = eng.submit(tokens(44, 37), 4)
    step_until(eng, rid, RequestStatus.DECODE)
    eng.pool.arena.index_fill_(0, torch.tensor(eng.requests[rid].page_table[:1]), POISON_BYTE)
    while eng.step():
        eng.check_integrity()
    res = eng.result(rid)
    assert res.status is RequestStatus.ABORTED and len(res.output_tokens) == 1
    assert res.reason == ("decode of output token 1: the logits hold 256 NaN/inf value(s) of 256 (a non-finite "
                          "state or cache page); no token was emitted"), res.reason
    assert eng.pool.num_free == eng.pool.num_pages


def test_build_engine_builds_what_its_args_say_and_refuses_bad_args():
    """``build_engine(EngineArgs)``: a fresh pool of ``num_pages`` pages of the config's size (poisoned when asked),
    a prefix cache on it when asked, the caps in the scheduler; the same tokens as the engine built by hand. Bad
    args are refused naming the field."""
    model, config = tiny_model(), ServeConfig(16, 16, page_policy="unified")
    eng = build_engine(EngineArgs(model, 40, config, prefix_cache=True, poison=True, max_num_seqs=3,
                                  rows_per_forward=1))
    assert (eng.pool.num_pages, eng.pool.page_bytes, eng.pool.poison) == (40, config.page_bytes(model.cfg), True)
    assert eng.cache is not None and eng.cache.pool is eng.pool and eng.config is eng.cache.config
    assert eng.sched_config.max_num_seqs == 3 and eng.rows_per_forward == 1
    by_hand = make_engine(block_size=16, interval=16, num_pages=40)
    assert eng.generate(tokens(17, 30), 4).output_tokens == by_hand.generate(tokens(17, 30), 4).output_tokens
    assert build_engine(EngineArgs(model, 8, config)).cache is None
    for bad, match in ((dict(model="tiny"), "model must be a HybridLM"), (dict(num_pages=0), "num_pages"),
                       (dict(config={}), "config must be a ServeConfig"), (dict(prefix_cache=1), "prefix_cache"),
                       (dict(rows_per_forward=0), "rows_per_forward")):
        with pytest.raises(ValueError, match=match):
            build_engine(EngineArgs(**{"model": model, "num_pages": 8, "config": config, **bad}))
