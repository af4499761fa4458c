"""``RequestMemory`` (``serve/engine/request_memory.py``) on its own: ask (``can_admit``) answers NOW / LATER /
NEVER from the pool alone and changes nothing; act (``admit``) takes exactly the pages asked for; ``release`` is the
one path back (the pool ends as it started); ``preempt`` drops the progress and the hit; the
final boundary is the config's. The scheduler's queues never enter it."""
from __future__ import annotations

import time

import pytest
import torch

from serve.config import ServeConfig
from serve.engine import EngineArgs, build_engine
from serve.engine.request import Request, RequestStatus
from serve.engine.request_memory import Fit, RequestMemory
from serve.memory.pool import PageKind, PagePool
from serve.prefix.cache import PrefixCache
from tests.serve.prefix.helpers import tiny_model, tokens


def memory(num_pages: int, cache: bool = False) -> RequestMemory:
    model, config = tiny_model(), ServeConfig(16, 16, page_policy="unified")
    pool = PagePool(num_pages, config.page_bytes(model.cfg), poison=True)
    pc = PrefixCache(pool, config, cfg=model.cfg) if cache else None
    return RequestMemory(pool, config.layout(model.cfg, pool.page_bytes), pc, config)


def request(rid: int, prompt_len: int, new: int) -> Request:
    return Request(rid, tokens(rid, prompt_len), new, False, time.perf_counter())


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "cache"])
def test_ask_then_act_then_release_through_one_path(cache):
    mem = memory(8, cache)
    req = request(1, 40, 9)                                 # final tokens 48: 3 KV pages + the state
    mem.match(req)
    need = sum(req.pages_needed(mem.layout))
    free = mem.pool.num_free
    assert mem.can_admit(req, anything_running=False) is Fit.NOW and mem.pool.num_free == free   # asking is pure
    assert mem.admit(req) and req.status is RequestStatus.PREFILL
    assert mem.pool.num_free == free - need
    mem.check_integrity([req], [])
    big = request(2, 200, 10)                               # more pages than the whole pool
    mem.match(big)
    assert mem.can_admit(big, anything_running=True) is Fit.NEVER
    mem.reject(big)
    assert big.status is RequestStatus.REJECTED and "needs" in big.reason
    later = request(3, 60, 5)                               # fits the pool, not beside the first request
    mem.match(later)
    assert mem.can_admit(later, anything_running=True) is Fit.LATER
    assert mem.can_admit(later, anything_running=False) is Fit.NEVER
    mem.release(req)
    mem.release(later)
    mem.check_integrity([], [])
    assert mem.pool.num_free == mem.pool.num_pages


def test_preempt_drops_progress_and_its_hit():
    """Preempted, a request holds nothing (no page, no pin, no hit) until it is matched again at the head."""
    mem = memory(16, cache=True)
    req = request(4, 40, 9)
    assert mem.match(req) is Fit.NOW
    assert mem.admit(req)
    req.computed, req.output = 40, [7]
    mem.preempt(req)
    assert (req.status, req.computed, req.output, req.state_pages, req.page_table, req.hit) == (
        RequestStatus.WAITING, 0, [], [], [], None)
    mem.check_integrity([], [req])
    assert mem.pool.num_free == mem.pool.num_pages
    assert mem.match(req) is Fit.NOW and req.hit.num_tokens == 0    # matched again (nothing was published)
    mem.release(req)
    assert mem.pool.num_free == mem.pool.num_pages


def test_final_boundary_is_the_configs_and_none_without_a_cache():
    req = request(5, 40, 30)                                # final tokens 69: last full block ends at 64
    assert memory(16, cache=True).final_boundary(req) == ServeConfig(16, 16).final_checkpoint(40, 69) == 64
    assert memory(16, cache=False).final_boundary(req) is None


# ---- state runs under multi_page: a fragmented pool ----------------------------------------------------
def checkerboard(pool: PagePool, below: int) -> list[int]:
    """Hold every free page for a bystander, then give back every other one below ``below``: free pages but
    no run of 2 there. Returns the pages the bystander keeps."""
    held = pool.alloc(PageKind.MLA_KV, pool.num_free, "bystander")
    pool.decref([p for p in held if p < below and p % 2 == 0], "bystander")
    return [p for p in held if pool.refcount(p)]


def test_admit_without_a_free_run_waits_while_others_run_and_is_rejected_when_idle():
    """RequestMemory with runs: 12 free pages, none consecutive. ``can_admit`` says LATER while anything runs
    (and NEVER when idle, with the run in the reason); ``admit`` itself, asked anyway, leaves the request WAITING
    holding nothing while others run, and rejects it when idle; the pool is unchanged either way."""
    model, config = tiny_model(), ServeConfig(16, 16)                        # the server default: multi_page
    pool = PagePool(40, config.page_bytes(model.cfg))
    mem = RequestMemory(pool, config.layout(model.cfg, pool.page_bytes), None, config, runs=True)
    assert mem.run_sizes == [6]
    checkerboard(pool, 24)
    req = request(1, 20, 4)                                                 # 6 state + 2 KV pages <= 11 free + 1
    mem.match(req)
    before = pool.page_table()
    assert mem.can_admit(req, anything_running=True) is Fit.LATER
    assert mem.can_admit(req, anything_running=False) is Fit.NEVER
    assert not mem.admit(req, anything_running=True)
    assert req.status is RequestStatus.WAITING and req.state_pages == [] and req.page_table == []
    assert pool.page_table() == before
    assert not mem.admit(req, anything_running=False)
    assert req.status is RequestStatus.REJECTED and "run of 6 consecutive free pages" in req.reason
    assert pool.page_table() == before
    pool.check_integrity()


def test_a_request_waits_for_a_run_then_runs_in_the_one_a_finished_request_frees():
    """The engine (multi_page, in place): A runs in the top run; a bystander leaves 16 free pages, none
    consecutive; B (8 pages) waits at the head of the queue, holding nothing, while A runs; when A finishes B is
    admitted into A's run and equals its run alone, bitwise. Integrity holds after every step."""
    from tests.serve.test_model_runner_in_place import alone, engine
    eng = engine(policy="multi_page", num_pages=40)
    a = eng.submit(tokens(130, 20), 4)
    eng.step()
    run = eng.requests[a].state_pages[0]
    assert run == tuple(range(34, 40))
    checkerboard(eng.pool, 40)
    prompt = tokens(131, 20)
    b = eng.submit(prompt, 4, record_logits=True)
    waited = 0
    while True:
        a_ran = eng.requests[a].status is not RequestStatus.FINISHED        # when this step began
        if not eng.step():
            break
        eng.pool.check_integrity()
        req_b = eng.requests[b]
        if req_b.status is RequestStatus.WAITING:
            assert a_ran and req_b.state_pages == [], "B waited although A had finished (its run was free)"
            waited += 1
        elif req_b.status is RequestStatus.PREFILL:
            assert req_b.state_pages[0] == run
    assert waited >= 3 and eng.result(a).reason == ""
    ref = alone(prompt, 4, policy="multi_page")
    assert eng.result(b).output_tokens == ref.output_tokens and torch.equal(eng.result(b).logits, ref.logits)


def test_eviction_opens_a_run_for_the_state():
    """With a prefix cache, the free pages are not consecutive but the cache's checkpoints (6 consecutive pages
    each) are evictable: admission evicts (LRU) until a run is free, and the request runs there."""
    from tests.serve.test_model_runner_in_place import alone, engine
    eng = engine(cache=True, policy="multi_page", num_pages=40)
    eng.generate(tokens(140, 40), 2)
    assert eng.cache.stats().checkpoints >= 1 and not eng.running
    checkerboard(eng.pool, 40)
    assert not eng.pool.can_alloc_runs([6]) and eng.cache.evictable_pages() > 0
    prompt = tokens(141, 10)
    rid = eng.submit(prompt, 3, record_logits=True)
    eng.step()
    req = eng.requests[rid]
    assert req.status is not RequestStatus.REJECTED and eng.pool.is_run(req.state_pages[0])
    assert eng.cache.stats().evicted_checkpoints >= 1
    eng.cache.check_integrity()
    eng.run_until_idle()
    ref = alone(prompt, 3, policy="multi_page")
    assert eng.result(rid).output_tokens == ref.output_tokens and torch.equal(eng.result(rid).logits, ref.logits)


def test_no_eviction_in_vain_when_even_an_empty_cache_opens_no_run():
    """RequestMemory with runs and a cache: 11 free pages, none consecutive, and one cached block whose page (an
    evictable page beside held ones) cannot join a run of 6. ``can_admit`` says LATER while something runs (NOW
    only when eviction can open the run), and ``admit``, asked anyway, leaves the request WAITING without evicting
    that block: evicting what cannot open a run only empties the prefix cache (it wiped every evictable entry on
    each such admission)."""
    model, config = tiny_model(), ServeConfig(16, 16)                        # the server default: multi_page
    pool = PagePool(40, config.page_bytes(model.cfg))
    cache = PrefixCache(pool, config, cfg=model.cfg)
    mem = RequestMemory(pool, config.layout(model.cfg, pool.page_bytes), cache, config, runs=True)
    prompt = tokens(150, 16)
    page = pool.alloc(PageKind.MLA_KV, 1, "writer")                          # page 0: one published block
    cache.publish_blocks(cache.keys(prompt), page, 1, "writer")
    cache.release("writer")
    pool.decref(page, "writer")
    checkerboard(pool, 24)                                                  # free: 2, 4, ..., 22; page 1 held
    assert cache.evictable_pages() == 1 and not pool.can_alloc_runs([6])
    req = request(2, 20, 4)                                                 # 6 state + 2 KV pages <= 11 free + 1
    mem.match(req)
    assert mem.can_admit(req, anything_running=True) is Fit.LATER
    assert not mem.admit(req, anything_running=True)
    assert req.status is RequestStatus.WAITING and req.state_pages == []
    assert cache.stats().evicted_blocks == 0 and cache.lookup(prompt + [1]).kv_tokens == 16
    cache.check_integrity()


def test_a_prefix_hit_never_makes_a_request_that_fits_the_pool_rejected():
    """The server default (multi_page), 17 pages: A (65 tokens) publishes 4 blocks and its checkpoint at 64 (10
    pages). B = A's prompt + 30 tokens fits the pool on its own (6 state + 6 KV = 12 pages), but with its hit it
    needs 8 new pages beside the 10 it pins while 7 are free. The cache must not turn B into a rejection: it
    finishes, bitwise as on an empty engine."""
    def make():
        return build_engine(EngineArgs(tiny_model(), 17, ServeConfig(), prefix_cache=True, poison=True))
    eng, shared = make(), tokens(180, 65)
    assert eng.generate(shared, 1).checkpoints_written == 1 and eng.pool.num_used() == 10
    prompt = shared + tokens(181, 30)
    cold = make().generate(prompt, 1, record_logits=True)
    assert cold.status is RequestStatus.FINISHED
    got = eng.generate(prompt, 1, record_logits=True)
    eng.check_integrity()
    assert got.status is RequestStatus.FINISHED, got.reason
    assert got.output_tokens == cold.output_tokens and torch.equal(got.logits, cold.logits)
