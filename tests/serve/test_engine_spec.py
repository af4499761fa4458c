"""Speculative decoding inside the engine; the end checkpoint is the state after the last accepted token
at exactly its boundary, never after a rejected draft; a follow-up that hits it is equal. A verify step
that accepts drafts onto the boundary publishes exactly the committed tokens; a failed publish aborts
its request with a reason and strands nothing."""
from __future__ import annotations

import pytest
import torch

from serve.engine.postprocess import Postprocessor
from serve.engine.request import RequestStatus
from serve.memory.pages import read_state
from serve.prefix.cache import PrefixCache
from serve.spec_decode.draft import DraftModelProposer
from serve.spec_decode.verify import Speculation, draft_budget
from tests.serve.engine_helpers import (
    STRATEGIES,
    check_checkpoints,
    oracle_speculation,
    poison_state,
    spec_engine,
    step_until,
)
from tests.serve.prefix.helpers import assert_equal_to_reference, make_engine, reference, tiny_model, tokens
from tests.serve.spec_decode.helpers import perturbed_copy

torch.set_num_threads(1)


def _engine(strategy, prompt, max_new, corrupt_prob=0.4, num_draft=4):
    ref_tokens, _ = reference(prompt, max_new)
    return spec_engine(oracle_speculation({tuple(prompt): ref_tokens}, strategy, corrupt_prob, num_draft),
                       interval=1024)


def _state_after(seq, n):
    """Reference KDA state after ``n`` tokens: prefill the 40-token prompt, then decode one by one (the
    engine splits that prefill at 32, so states agree to ~1e-6, not bitwise; neighbours differ by ~1)."""
    model = tiny_model()
    _, cache = model.prefill(torch.tensor([seq[:40]]))
    for t in seq[40:n]:
        _, cache = model.decode_step(t, cache)
    return {i: cache.layers[i] for i in model.cfg.kda_layers}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_scenario6_end_checkpoint_is_after_the_last_accepted_token(strategy):
    prompt, max_new = tokens(70, 40), 30                 # the cache ends at 69 tokens: last full block 64
    eng = _engine(strategy, prompt, max_new)
    rid = eng.submit(prompt, max_new)
    while eng.step():
        eng.check_integrity()
    res = eng.result(rid)
    assert res.output_tokens == reference(prompt, max_new)[0]
    assert 0 < res.accepted_tokens < res.drafted_tokens          # drafts were rejected along the way
    seq = prompt + list(res.output_tokens)
    ck = [c for c in eng.cache.checkpoints() if c.boundary == 64]
    assert len(ck) == 1 and ck[0].written_at == 64
    node = eng.cache.index.node(eng.cache.keys(seq[:64])[-1])
    stored = read_state(eng.layout, eng.pool, [node.ckpts[0].payload])
    for n, should_match in ((64, True), (63, False), (65, False), (66, False)):
        ref = _state_after(seq, n)
        close = all(torch.allclose(stored[i].recurrent, ref[i].recurrent, atol=1e-5, rtol=0)
                    and torch.allclose(stored[i].conv, ref[i].conv, atol=1e-5, rtol=0) for i in ref)
        assert close == should_match, f"end checkpoint vs state after {n} tokens"
    follow = seq[:64] + tokens(71, 7)
    rid2 = eng.submit(follow, 1, record_logits=True)
    eng.run_until_idle()
    res2 = eng.result(rid2)
    assert res2.hit_tokens == 64
    assert_equal_to_reference(res2, follow)
    eng.check_integrity()


def test_draft_budget_never_jumps_the_boundary():
    assert draft_budget(4, 60, 10, 64) == 3           # commit of at most 4 tokens lands on 64
    assert draft_budget(4, 63, 10, 64) == 0           # one plain token reaches 64
    assert draft_budget(4, 64, 10, 64) == 4           # past the boundary: no cap
    assert draft_budget(4, 10, 2, None) == 1          # never emit more than asked
    assert draft_budget(0, 10, 9, 64) == 0


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_record_logits_with_speculation_equals_plain_engine(strategy):
    """Without a prefix cache the speculative engine records, for every emitted token (accepted drafts
    and bonus), logits bitwise equal to the plain engine's one-token decode (``kda_core.invariant``
    makes each verify row independent of the verify length)."""
    prompt, max_new = tokens(72, 37), 20
    ref_tokens, _ = reference(prompt, max_new)
    speculation = oracle_speculation({tuple(prompt): ref_tokens}, strategy, 0.4, 4)
    res = spec_engine(speculation, prefix_cache=False).generate(prompt, max_new, record_logits=True)
    plain = make_engine(cache=False).generate(prompt, max_new, record_logits=True)
    assert 0 < res.accepted_tokens < res.drafted_tokens            # accepted and rejected drafts
    assert res.output_tokens == plain.output_tokens == ref_tokens
    assert res.logits.shape == (max_new, 256) and torch.equal(res.logits, plain.logits)


def test_draft_model_speculation_equals_plain_engine():
    """The engine with a draft model (its own cache per request, rolled back after partial accepts) emits the
    plain engine's tokens and logits bitwise; the draft is the target with noise, so drafts are partly right."""
    draft = perturbed_copy(tiny_model(), 0.3)
    speculation = Speculation.named(lambda p: DraftModelProposer(draft), STRATEGIES["projection"], 4)
    prompt, max_new = tokens(73, 37), 20
    res = spec_engine(speculation, prefix_cache=False).generate(prompt, max_new, record_logits=True)
    plain = make_engine(cache=False).generate(prompt, max_new, record_logits=True)
    assert 0 < res.accepted_tokens < res.drafted_tokens
    assert res.output_tokens == plain.output_tokens and torch.equal(res.logits, plain.logits)


def _spy_commits(monkeypatch) -> list:
    """Record ``(tokens consumed after the commit, drafts accepted)`` for every verify step."""
    commits, real = [], Postprocessor.verify

    def spy(self, req, *args):          # the batched engine commits each verify row here
        before = req.accepted_tokens
        real(self, req, *args)
        commits.append((req.computed, req.accepted_tokens - before))

    monkeypatch.setattr(Postprocessor, "verify", spy)
    return commits


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("prompt_len, accepted", [(71, 4), (72, 3), (73, 2), (74, 1)],
                         ids=["L71-accept4", "L72-accept3", "L73-accept2", "L74-accept1"])
def test_verify_accepting_drafts_onto_the_end_boundary(monkeypatch, strategy, prompt_len, accepted):
    """Every draft accepted (4 per step): the verify step that lands on the end boundary 96 accepts
    ``accepted`` drafts, so the cache consumed tokens the request had not yet committed when the old
    engine published (IndexError in ``publish_blocks``, request left mid-flight)."""
    prompt, max_new = tokens(70, prompt_len), 30          # the cache ends at L + 29 > 96: end boundary 96
    eng = _engine(strategy, prompt, max_new, corrupt_prob=0.0)
    commits = _spy_commits(monkeypatch)
    rid = eng.submit(prompt, max_new)
    while eng.step():
        eng.check_integrity()
    assert (96, accepted) in commits
    res = eng.result(rid)
    assert res.status is RequestStatus.FINISHED
    assert res.output_tokens == reference(prompt, max_new)[0]
    seq = prompt + list(res.output_tokens)
    assert [(c.boundary, c.written_at) for c in eng.cache.checkpoints()][-1] == (96, 96)
    assert check_checkpoints(eng, [seq], set()) == len(eng.cache.checkpoints())
    follow = seq[:96] + tokens(71, 5)
    rid2 = eng.submit(follow, 1, record_logits=True)
    eng.run_until_idle()
    assert eng.result(rid2).hit_tokens == 96
    assert_equal_to_reference(eng.result(rid2), follow)
    eng.check_integrity()


def _inject_publish_failure(monkeypatch, where: str, rid: int, num_blocks: int) -> None:
    """Make the cache raise RuntimeError("injected") when request ``rid`` publishes ``num_blocks``:
    in ``publish_checkpoint`` (nothing published), or in ``publish_blocks`` after the blocks below
    the last one were published (a partial publish)."""
    real_blocks, real_ckpt = PrefixCache.publish_blocks, PrefixCache.publish_checkpoint

    def blocks(self, keys, page_table, nb, owner):
        if where == "blocks" and owner == rid and nb == num_blocks:
            real_blocks(self, keys, page_table, nb - 1, owner)
            raise RuntimeError("injected")
        return real_blocks(self, keys, page_table, nb, owner)

    def ckpt(self, keys, nb, pages, written_at, owner):
        if where == "checkpoint" and owner == rid and nb == num_blocks:
            raise RuntimeError("injected")
        return real_ckpt(self, keys, nb, pages, written_at, owner)

    monkeypatch.setattr(PrefixCache, "publish_blocks", blocks)
    monkeypatch.setattr(PrefixCache, "publish_checkpoint", ckpt)


@pytest.mark.parametrize("prompt_len, max_new, boundary, where", [
    (40, 20, 32, "checkpoint"),     # prefill: the checkpoint at 32 inside the prompt's forward
    (72, 30, 96, "blocks"),         # decode: verify lands on 96 with drafts; blocks published partly
    (72, 30, 96, "checkpoint"),     # decode: the end checkpoint at 96
    (72, 25, 96, "checkpoint"),     # decode: 96 is also the request's last token
], ids=["prefill-checkpoint", "decode-blocks", "decode-checkpoint", "last-token-checkpoint"])
def test_failed_publish_aborts_the_request_and_strands_nothing(monkeypatch, prompt_len, max_new, boundary, where):
    prompt, other = tokens(70, prompt_len), tokens(90, 50)
    refs = {tuple(p): reference(p, 30)[0] for p in (prompt, other)}
    eng = spec_engine(oracle_speculation(refs, "projection", 0.0, 4), interval=32, num_pages=48)
    rid = eng.submit(prompt, max_new)
    rid_other = eng.submit(other, 30)
    _inject_publish_failure(monkeypatch, where, rid, boundary // 16)
    while eng.requests[rid].status is not RequestStatus.ABORTED:     # step() does not raise: the step goes on
        assert eng.step()
        eng.check_integrity()
    req = eng.requests[rid]
    assert req.status is RequestStatus.ABORTED and rid not in eng.running
    assert f"publish at {boundary} tokens failed" in req.reason and "injected" in req.reason
    assert all(rid not in eng.pool.holders(p) for p in range(eng.pool.num_pages)), "aborted request holds pages"
    eng.check_integrity()
    monkeypatch.undo()                                    # the other request carries on
    eng.run_until_idle()
    eng.check_integrity()
    assert eng.result(rid_other).status is RequestStatus.FINISHED
    assert eng.result(rid_other).output_tokens == refs[tuple(other)]
    check_checkpoints(eng, [other + list(refs[tuple(other)]), prompt + list(refs[tuple(prompt)])], set())
    eng.cache.clear()
    eng.check_integrity()
    assert eng.pool.num_free == eng.pool.num_pages


@pytest.mark.parametrize("strategy", list(STRATEGIES)[:1])
def test_a_nan_state_aborts_a_speculating_request(strategy):
    """With speculation the verify forward met the NaN state; the request is ABORTED with the cause
    and emits nothing from that step (it emitted token 0 before)."""
    prompt = tokens(72, 40)
    eng = _engine(strategy, prompt, 12)
    rid = eng.submit(prompt, 12)
    step_until(eng, rid, RequestStatus.DECODE)
    poison_state(eng, rid)
    while eng.step():
        eng.check_integrity()
    res = eng.result(rid)
    assert res.status is RequestStatus.ABORTED and len(res.output_tokens) == 1
    assert res.reason.startswith("decode of output token 1: ") and "NaN" in res.reason, res.reason
    eng.cache.clear()
    assert eng.pool.num_free == eng.pool.num_pages
