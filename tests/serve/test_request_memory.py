"""``RequestMemory`` (``serve/engine/request_memory.py``) on its own: ask (``can_admit``) answers NOW / LATER /
NEVER from the pool alone and changes nothing; act (``admit``) takes exactly the pages asked for; ``release`` is the
one path back (the pool ends as it started); ``preempt`` drops the progress and matches the prompt again; the
final boundary is the config's. The scheduler's queues never enter it."""
from __future__ import annotations

import time

import pytest

from serve.config import ServeConfig
from serve.engine.request import Request, RequestStatus
from serve.engine.request_memory import Fit, RequestMemory
from serve.memory.pool import PagePool
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


def test_preempt_drops_progress_and_matches_again():
    mem = memory(16, cache=True)
    req = request(4, 40, 9)
    mem.match(req)
    assert mem.admit(req)
    req.computed, req.output = 40, [7]
    mem.preempt(req)
    assert (req.status, req.computed, req.output, req.state_pages, req.page_table) == (
        RequestStatus.WAITING, 0, [], [], [])
    assert req.hit is not None and req.hit.num_tokens == 0  # matched again (nothing was published)
    mem.check_integrity([], [req])
    mem.release(req)
    assert mem.pool.num_free == mem.pool.num_pages


def test_final_boundary_is_the_configs_and_none_without_a_cache():
    req = request(5, 40, 30)                                # final tokens 69: last full block ends at 64
    assert memory(16, cache=True).final_boundary(req) == ServeConfig(16, 16).final_checkpoint(40, 69) == 64
    assert memory(16, cache=False).final_boundary(req) is None
