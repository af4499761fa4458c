"""Hypothesis: random request mixes with shared prefixes, random capacities and random aborts.

Every finished request equals the cache-off run; rejected requests carry a reason; integrity holds
after every step; an idle engine holds only cache pages, and clearing the cache frees the pool.
"""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from serve.engine.request import RequestStatus
from tests.serve.prefix.helpers import assert_equal_to_reference, make_engine, tokens

torch.set_num_threads(1)

PREFIXES = [tokens(500, 48), tokens(501, 24)]

request = st.tuples(
    st.sampled_from([0, 0, 1, 2]),      # prefix id (2 = none)
    st.integers(12, 48),                # prefix length used
    st.integers(1, 20),                 # unique tail length (seeded by its index)
    st.integers(1, 4),                  # max_new_tokens
    st.sampled_from([None, None, None, 1, 3, 6]),  # abort this many steps after submit (None = never)
    st.integers(0, 8),                  # submit this many steps after the previous request
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=1, max_size=6),
       layout=st.sampled_from([(8, 8, 1), (8, 16, 2), (16, 16, 1), (16, 32, 3)]),
       num_pages=st.integers(6, 40), policy=st.sampled_from(["unified", "multi_page"]),
       chunk=st.sampled_from([None, 7, 16]), max_ck=st.sampled_from([None, 3]))
def test_random_mixes_equal_cache_off(reqs, layout, num_pages, policy, chunk, max_ck):
    N, C, G = layout
    if policy == "multi_page":
        num_pages *= 8                  # a state spans several small pages
    eng = make_engine(N, C, G, num_pages, policy, max_ck if (max_ck or 0) >= G else None, max_prefill_chunk=chunk)
    prompts, aborts, submit_at, t = {}, {}, [], 0
    for i, (pid, plen, tail, new, abort_after, delay) in enumerate(reqs):
        t += delay
        prompt = (PREFIXES[pid][:plen] if pid < 2 else []) + tokens(600 + i, tail)
        submit_at.append((t, prompt, new, None if abort_after is None else t + abort_after))
    steps = 0
    while eng.waiting or eng.running or submit_at:
        while submit_at and submit_at[0][0] <= steps:
            _, prompt, new, abort_at = submit_at.pop(0)
            rid = eng.submit(prompt, new, record_logits=True)
            prompts[rid] = prompt
            if abort_at is not None:
                aborts[rid] = abort_at
            eng.check_integrity()
        for rid, at in list(aborts.items()):
            if at <= steps:
                eng.abort(rid)
                del aborts[rid]
        progressed = eng.step()
        eng.check_integrity()
        steps += 1
        if not progressed and not eng.running and eng.waiting:
            raise AssertionError("engine stalled with waiting requests")
    for rid, prompt in prompts.items():
        res = eng.result(rid)
        event(f"{res.status.value}{' with hit' if res.hit_tokens else ''}")
        if res.status is RequestStatus.FINISHED:
            assert_equal_to_reference(res, prompt)
            assert res.hit_tokens + res.prefill_tokens == len(prompt)
        elif res.status is RequestStatus.REJECTED:
            assert res.reason
        else:
            assert res.status is RequestStatus.ABORTED
    cache_pages = eng.cache.stats().kv_pages + eng.cache.stats().state_pages
    assert eng.pool.num_used() == cache_pages
    eng.cache.clear()
    eng.check_integrity()
    assert eng.pool.num_free == eng.pool.num_pages
