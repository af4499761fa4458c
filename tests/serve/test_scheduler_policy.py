"""The scheduler's policies, pinned by what it chooses (not by outputs: batch invariance makes every request's
tokens bitwise the same whatever the order, the padding or the queue position, so an output test cannot see
a policy bug).

- decode first (vLLM's ``reorder_batch_threshold = 1``): a decoding request gets its token every step, whatever
  prompt arrives under the token budget;
- prefill chunks: oldest first, cut on the 64-token grid when the state is exact (fp32), never cut with a
  16-bit state;
- admission FCFS without overtaking (vLLM / nano-vllm): a request that fits only LATER holds back the ones
  behind it;
- preemption by recompute (nano-vllm's ``preempt`` -> ``waiting.appendleft``): the preempted request goes back
  to the HEAD of the queue and runs before the requests that were already waiting.
"""
from __future__ import annotations

import pytest
import torch

from serve.config import ServeConfig
from serve.engine import EngineArgs, ServeEngine, build_engine
from serve.engine.request import RequestStatus
from serve.memory.pool import PagePool
from tests.serve.engine_helpers import oracle_speculation
from tests.serve.prefix.helpers import tiny_model, tokens


def engine(num_pages: int = 96, state_dtype=torch.float32, **kw) -> ServeEngine:
    """A cache-off engine on a poisoned pool (64-token blocks), with the scheduler caps in ``kw``."""
    model = tiny_model()
    config = ServeConfig(64, 64, page_policy="unified", state_dtype=state_dtype)
    pool = PagePool(num_pages, config.page_bytes(model.cfg), poison=True)
    return ServeEngine(model, pool, None, config=config, **kw)


def step_to(eng: ServeEngine, rid: int, status: RequestStatus, max_steps: int = 50) -> int:
    """Step (integrity checked each step) until request ``rid`` has ``status``; returns the steps taken."""
    for n in range(max_steps):
        if eng.requests[rid].status is status:
            return n
        eng.step()
        eng.check_integrity()
    raise AssertionError(f"request {rid} not {status} after {max_steps} steps")


def test_decode_first_a_long_prompt_never_takes_a_step_from_the_decoder():
    """64-token budget, one request decoding, a 200-token prompt arrives: every step runs the decode row (1
    token) first; the prompt's 64-token chunk does not fit the 63 left (and 63 is not on the grid), so it waits.
    The decoder finishes in exactly as many steps as it has tokens left, one token per step."""
    eng = engine(max_num_batched_tokens=64)
    dec = eng.submit(tokens(1, 40), 12)
    step_to(eng, dec, RequestStatus.DECODE)
    before = len(eng.requests[dec].output)
    long = eng.submit(tokens(2, 200), 3)
    steps = 0
    while eng.requests[dec].status is RequestStatus.DECODE:
        eng.step()
        eng.check_integrity()
        steps += 1
        b = eng.last_batch
        assert b.num_decode == 1 and b.rows[0].req.rid == dec, f"step {steps}: the decoder has no row"
        assert b.num_prefill_tokens + b.num_decode <= 64, "the step went over the token budget"
        assert len(eng.requests[dec].output) == before + steps, f"step {steps}: the decoder lost a token"
    assert steps == 12 - before
    assert eng.requests[long].computed == 0                      # it waited for the budget the decoder left
    eng.run_until_idle()
    assert eng.result(long).status is RequestStatus.FINISHED


@pytest.mark.parametrize("state_dtype,chunk", [(torch.float32, 64), (torch.bfloat16, 0)], ids=["fp32-cut", "bf16-waits"])
def test_a_chunk_that_does_not_fit_is_cut_on_the_grid_only_with_an_exact_state(state_dtype, chunk):
    """Budget 128, one decoder: 127 tokens left for a 200-token prompt whose chunk is 128. An fp32 state cuts
    it on the 64-token grid (64 tokens, bitwise the uncut chunk); a bf16 state is rounded at every chunk end,
    so the row waits rather than compute other chunks than it would alone."""
    eng = engine(max_num_batched_tokens=128, state_dtype=state_dtype)
    dec = eng.submit(tokens(3, 30), 8)
    step_to(eng, dec, RequestStatus.DECODE)
    long = eng.submit(tokens(4, 200), 2)
    eng.step()
    b = eng.last_batch
    assert b.num_decode == 1 and b.num_prefill_tokens == chunk
    assert eng.requests[long].computed == chunk


def test_prefill_chunks_go_to_the_oldest_request_first():
    """Budget 64, two prompts admitted in the same step: the older one's chunks fill every step until its
    prompt is done (the 42 tokens its last 22-token chunk leaves are off the grid, and the next step's decode
    row leaves 63); the younger one prefills once the older has finished."""
    eng = engine(max_num_batched_tokens=64)
    old, young = eng.submit(tokens(5, 150), 2), eng.submit(tokens(6, 150), 2)
    seen = []
    while eng.requests[young].computed == 0:
        eng.step()
        eng.check_integrity()
        seen.append(tuple((r.req.rid, len(r.tokens)) for r in eng.last_batch.rows if not r.decode))
    assert seen == [((old, 64),), ((old, 64),), ((old, 22),), (), ((young, 64),)]


def test_admission_is_fcfs_a_request_that_fits_later_is_not_overtaken():
    """The head of the queue needs more pages than are free while another request runs (it fits LATER); a
    small request behind it would fit NOW but must not overtake it (FCFS: admission stops at the head)."""
    eng = engine(num_pages=40)
    per_state = eng.layout.state_pages
    big_kv = 40 - per_state - 1                                  # fits the pool alone, not beside anyone
    first = eng.submit(tokens(7, 60), 4)
    eng.step()
    big = eng.submit(tokens(8, big_kv * 64 - 8), 4)
    small = eng.submit(tokens(9, 10), 2)
    eng.step()
    assert eng.waiting == [big, small], "a small request overtook the head of the queue"
    assert eng.requests[small].status is RequestStatus.WAITING
    eng.run_until_idle()
    order = sorted((first, big, small), key=lambda r: eng.requests[r].first_token_t)
    assert order == [first, big, small]


def test_preempted_request_goes_back_to_the_head_of_the_queue_and_finishes_first():
    """Two slots run A and B, C waits. Preempting the newest (B) puts it at the head of the queue, before
    C: it is admitted again at once (A still runs) and finishes before C starts (nano-vllm's appendleft)."""
    eng = engine(max_num_seqs=2)
    a, b, c = (eng.submit(tokens(10 + i, 30), 6) for i in range(3))
    step_to(eng, b, RequestStatus.DECODE)
    assert eng.running == [a, b] and eng.waiting == [c]
    assert eng.preempt_newest() == b
    assert eng.waiting == [b, c], "the preempted request did not go back to the head of the queue"
    eng.step()
    eng.check_integrity()
    assert eng.running == [a, b] and eng.waiting == [c]
    finished = []
    while eng.running or eng.waiting:
        eng.step()
        eng.check_integrity()
        finished += [r for r in (a, b, c) if eng.requests[r].status is RequestStatus.FINISHED and r not in finished]
    assert finished == [a, b, c]
    assert eng.pool.num_free == eng.pool.num_pages


def test_the_head_of_the_queue_is_not_rejected_for_pages_pinned_by_requests_behind_it():
    """An idle cache-on engine (the server default, multi_page) of 20 pages holds an 8-page prefix (2 blocks and
    a 6-page checkpoint). B (13 pages, no hit) is queued, then C, whose hit would pin those 8 pages (it did, from
    its submit, leaving 12 free pages and none evictable, and B was rejected as never fitting): 12 are free. B fits
    the idle pool (13 <= 20) and is at the head of the queue, so it must not be REJECTED; both finish. A waiting
    request pins nothing (its prefix is looked up at admission, as vLLM's scheduler does)."""
    eng = build_engine(EngineArgs(tiny_model(), 20, ServeConfig(), prefix_cache=True, poison=True))
    shared = tokens(170, 40)
    eng.generate(shared, 2)
    assert eng.pool.num_used() == 8 and not eng.running
    b = eng.submit(tokens(171, 100), 2)                       # 6 state + 7 KV pages
    c = eng.submit(shared + tokens(172, 5), 2)                # would hit the 2 blocks and the checkpoint at 32
    assert eng.cache.lookup(eng.requests[c].prompt).num_tokens == 32 and eng.requests[c].hit is None
    assert eng.cache.evictable_pages() == 8 and eng.pool.num_free == 12
    eng.run_until_idle()
    eng.check_integrity()
    assert [eng.result(r).status for r in (b, c)] == [RequestStatus.FINISHED] * 2, eng.result(b).reason


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32-trims", "bf16-waits"])
def test_the_token_budget_holds_verify_rows_with_their_drafts(state_dtype):
    """Speculation of 4 oracle drafts, 4 requests of 2-token prompts (prefilled together, then decoding together),
    max_num_batched_tokens=8: no step's forward holds more than 8 tokens (it held up to 20: verify rows of up to 5
    tokens each), and every request's tokens and logits are bitwise those of the engine without a budget. fp32:
    some step trims a row's drafts to what is left (a verify row's outputs do not depend on how many drafts it
    carries); bf16 (the state rounded at each verify commit): no row is trimmed, a row that does not get its
    drafts waits instead (some step runs fewer verify rows than there are decoding requests)."""
    prompts = [tokens(190 + i, 2) for i in range(4)]
    refs = {tuple(p): engine(num_pages=64, state_dtype=state_dtype).generate(p, 12).output_tokens for p in prompts}

    def run(budget):
        config = ServeConfig(64, 64, page_policy="unified", state_dtype=state_dtype)
        eng = build_engine(EngineArgs(tiny_model(), 64, config, poison=True, max_num_batched_tokens=budget,
                                      speculation=oracle_speculation(refs, "snapshot", 0.0, 4)))
        rids = [eng.submit(p, 12, record_logits=True) for p in prompts]
        most, trimmed, waited = 0, False, False
        while True:
            decoding = sum(eng.requests[r].status is RequestStatus.DECODE for r in rids)
            if not eng.step():
                break
            eng.check_integrity()
            rows = [r for r in eng.last_batch.rows if r.req is not None]
            most = max(most, sum(len(r.tokens) for r in rows))
            trimmed |= any(r.verify and 1 < len(r.tokens) < 5 and len(r.req.output) < 8 for r in rows)
            waited |= sum(r.verify for r in rows) < decoding
        return most, trimmed, waited, [eng.result(r) for r in rids]

    most, trimmed, waited, got = run(8)
    free = run(None)[3]
    assert most <= 8, f"a step ran {most} tokens under max_num_batched_tokens=8"
    assert (trimmed, waited) == ((True, False) if state_dtype == torch.float32 else (False, True))
    assert all(g.output_tokens == f.output_tokens and torch.equal(g.logits, f.logits) for g, f in zip(got, free))


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_requests():
    """Budget of 48 tokens (off the 64 grid, so never cut), the server's default config otherwise. A short request
    decodes; a 200-token prompt A arrives; a 5-token request arrives every third step. Within 100 steps A must
    finish its prefill (it computed 0 tokens: each step one decode row leaves 47 < 48 and a younger chunk of 5
    fits)."""
    eng = build_engine(EngineArgs(tiny_model(), 400, ServeConfig(), max_num_batched_tokens=48))
    eng.submit(tokens(200, 5), 6)
    eng.step()
    a = eng.submit(tokens(201, 200), 2)
    for step in range(100):
        if step % 3 == 0:
            eng.submit(tokens(300 + step, 5), 6)
        eng.step()
    assert eng.requests[a].computed >= 200, \
        f"A computed {eng.requests[a].computed} of 200 prompt tokens in 100 steps"
