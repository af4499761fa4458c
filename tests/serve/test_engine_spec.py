"""Scenario 6: speculative decoding inside the engine; the end checkpoint is the state after the last
accepted token at exactly its boundary, never after a rejected draft; a follow-up that hits it is equal."""
from __future__ import annotations

import pytest
import torch

from serve.cache_layout import CacheLayout, read_state
from serve.decode import ProjectionReplay
from serve.draft import NoisyOracleProposer
from serve.engine import ServeEngine
from serve.paged_cache import PagePool
from serve.prefix_cache import PrefixCache
from serve.replayssm import RawInputRing
from serve.snapshot import SnapshotRollback
from serve.spec_step import Speculation, draft_budget
from tests.serve.prefix_helpers import assert_equal_to_reference, reference, tiny_model, tokens

torch.set_num_threads(1)

STRATEGIES = {
    "snapshot": SnapshotRollback,
    "projection": ProjectionReplay,
    "ring": lambda: RawInputRing(capacity=24, window=8),
}


def _engine(strategy, prompt, max_new, corrupt_prob=0.4, num_draft=4):
    model = tiny_model()
    ref_tokens, _ = reference(prompt, max_new)
    spec = Speculation(lambda p: NoisyOracleProposer(p, list(ref_tokens), corrupt_prob, seed=1),
                       STRATEGIES[strategy], num_draft)
    pool = PagePool(64, CacheLayout.page_bytes_for(model.cfg, 16, 1), poison=True)
    cache = PrefixCache(pool, 16, 1024, cfg=model.cfg)
    return ServeEngine(model, pool, cache, speculation=spec)


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


def test_record_logits_needs_plain_decoding():
    eng = _engine("projection", tokens(72, 20), 4)
    with pytest.raises(ValueError, match="record_logits"):
        eng.submit(tokens(72, 20), 4, record_logits=True)
