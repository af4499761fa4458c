"""Hypothesis: the engine with speculation and a prefix cache, prompts around block multiples.

Block size N in {16, 64}, every rollback strategy, noisy-oracle drafts with every draft accepted, none,
or a random share; several requests share prefixes, and follow-ups extend an earlier request's prompt
and output (so they hit the checkpoints its decode published). Invariants: every request finishes;
tokens equal the cache-off engine's and every request's logits (one row per emitted token: prefill,
then the verify rows of accepted drafts and bonus) are within ``LOGITS_ATOL`` of the cache-off
engine's (a restored checkpoint and a chunked prefill differ from the cache-off run by ~1e-6 in
fp32); every stored checkpoint holds the model's state after exactly its ``written_at`` tokens;
``check_integrity`` holds after every step; once idle the pool holds only cache pages, and none
after ``clear``.
"""
from __future__ import annotations

import functools

import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from serve.engine.request import RequestStatus
from tests.serve.engine_helpers import STRATEGIES, check_checkpoints, oracle_speculation, spec_engine
from tests.serve.prefix.helpers import LOGITS_ATOL, make_engine, tokens

torch.set_num_threads(1)

settings.register_profile("engine_spec", max_examples=12, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PREFIX = tokens(800, 200)
MAX_NEW = 24                                # a longer run to the next block is cut short (runtime)
ACCEPT = {"all": 0.0, "none": 1.0}          # corrupt probability; "random" draws one


@functools.cache
def cache_off(prompt: tuple, max_new_tokens: int):
    """The cache-off engine (no prefix cache, no speculation): (tokens, logits ``[max_new_tokens, 256]``)."""
    res = make_engine(cache=False, num_pages=32).generate(list(prompt), max_new_tokens, record_logits=True)
    return res.output_tokens, res.logits


request = st.tuples(
    st.integers(1, 2),                              # k: the prompt ends near k blocks
    st.integers(-2, 2),                             # d: L = k N + d
    st.sampled_from(["shared", "follow", "own"]),   # head: common prefix / previous request's tokens / none
    st.integers(0, 3),                              # unique tail tokens
    st.sampled_from([None, 0, 1, 3]),               # None: one token (prefill only); else end this far past the next block
    st.booleans(),                                  # wait until idle before submitting
)


def _plan(N: int, reqs) -> list[tuple[list[int], int, bool]]:
    """(prompt, max_new_tokens, wait) per request. A request that decodes ends ``past`` tokens after the
    block boundary above its prompt (its end checkpoint), or, if that needs more than ``MAX_NEW`` tokens,
    ``past`` + 1 tokens after its prompt. A follow-up takes the previous request's prompt and cache-off
    output and ends near the block after that request's prompt (where its end checkpoint is)."""
    plan, prev = [], None
    for i, (k, d, head, tail, past, wait) in enumerate(reqs):
        if head == "follow" and prev is not None:
            k, wait = len(prev[0]) // N + 1, True
        L = max(2, k * N + d)
        tail = min(tail, L - 1)
        if head == "follow" and prev is not None:
            seq = prev[0] + list(cache_off(tuple(prev[0]), prev[1])[0])
            body = seq[: L - tail]
            body += tokens(1000 + i, L - tail - len(body)) if len(body) < L - tail else []
        elif head == "own":
            body = tokens(900 + i, L - tail)
        else:
            body = PREFIX[: L - tail]
        prompt = body + tokens(700 + i, tail)
        max_new = 1 if past is None else (L // N + 1) * N + past - L + 1     # the cache ends at block + past
        max_new = max_new if max_new <= MAX_NEW else past + 2
        plan.append((prompt, max_new, wait))
        prev = (prompt, max_new)
    return plan


def _drive(eng, seqs, checked) -> None:
    """Step until idle, checking integrity and every new checkpoint after each step."""
    while eng.step():
        eng.check_integrity()
        check_checkpoints(eng, seqs(), checked)


def _count_landings(eng, events: list) -> None:
    """Wrap the engine's verify commit to note verify steps that accept drafts onto the end boundary."""
    commit_verify = eng.postprocess.verify

    def spy(req, *args):
        before = req.accepted_tokens
        commit_verify(req, *args)
        b_end = req.final_tokens // eng.layout.block_size * eng.layout.block_size
        if req.computed == b_end and req.accepted_tokens > before:
            events.append(req.rid)

    eng.postprocess.verify = spy


@settings(settings.get_profile("engine_spec"))
@given(N=st.sampled_from([16, 64]), strategy=st.sampled_from(list(STRATEGIES)),
       accept=st.sampled_from(["all", "random", "none", "all"]), corrupt=st.floats(0.2, 0.8), seed=st.integers(0, 99),
       num_draft=st.integers(1, 4), interval_blocks=st.sampled_from([1, 2]),
       reqs=st.lists(request, min_size=2, max_size=3))
@example(N=16, strategy="ring", accept="all", corrupt=0.5, seed=0, num_draft=3, interval_blocks=1,
         reqs=[(2, 0, "shared", 0, 1, False), (2, 1, "follow", 2, None, True)])   # L = 32: 32+4k, then 3 drafts onto 48
@example(N=64, strategy="snapshot", accept="all", corrupt=0.5, seed=0, num_draft=3, interval_blocks=2,
         reqs=[(1, -2, "shared", 1, 0, False), (1, 2, "shared", 0, None, False)])
@example(N=16, strategy="snapshot", accept="all", corrupt=0.5, seed=0, num_draft=1, interval_blocks=1,
         reqs=[(1, 0, "shared", 0, 0, False), (1, 0, "shared", 0, None, False)])  # shrunk on the old engine
def test_speculation_with_prefix_cache_equals_cache_off(N, strategy, accept, corrupt, seed, num_draft,
                                                        interval_blocks, reqs):
    plan = _plan(N, reqs)
    refs = {}
    for prompt, max_new, _ in plan:
        refs[tuple(prompt)] = max(refs.get(tuple(prompt), ()), cache_off(tuple(prompt), max_new)[0], key=len)
    eng = spec_engine(oracle_speculation(refs, strategy, ACCEPT.get(accept, corrupt), num_draft, seed),
                      block_size=N, interval=interval_blocks * N, num_pages=96)
    landings: list = []
    _count_landings(eng, landings)
    rids, checked = [], set()

    def seqs():
        return [eng.requests[r].tokens() for r in rids]

    for prompt, max_new, wait in plan:
        if wait:
            _drive(eng, seqs, checked)
        rids.append(eng.submit(prompt, max_new, record_logits=True))
        eng.check_integrity()
    _drive(eng, seqs, checked)
    for rid, (prompt, max_new, _) in zip(rids, plan):
        res = eng.result(rid)
        assert res.status is RequestStatus.FINISHED, f"request {rid} ended {res.status}: {res.reason}"
        ref_tokens, ref_logits = cache_off(tuple(prompt), max_new)
        assert res.output_tokens == ref_tokens, f"request {rid}: tokens differ from the cache-off engine"
        assert res.logits.shape == ref_logits.shape, f"request {rid}: logits {tuple(res.logits.shape)}"
        err = float((res.logits - ref_logits).abs().max())
        assert err <= LOGITS_ATOL, f"request {rid}: max |logits - cache-off| = {err} (hit {res.hit_tokens})"
        event(f"logits vs cache-off: {'bitwise' if err == 0 else 'within LOGITS_ATOL'}")
        event(f"hit {'> 0' if res.hit_tokens else '0'}")
    event(f"a verify accepted drafts onto an end boundary: {bool(landings)}")
    check_checkpoints(eng, seqs(), checked)
    stats = eng.cache.stats()
    assert eng.pool.num_used() == stats.kv_pages + stats.state_pages
    eng.cache.clear()
    eng.check_integrity()
    assert eng.pool.num_free == eng.pool.num_pages
