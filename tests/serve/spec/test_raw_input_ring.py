"""RawInputRing: slots, wrap-around, write-back on a full ring, ValueError past the window; exact commits."""
import pytest
import torch

from kda_core.model import cache_equal
from serve.spec.draft import NoisyOracleProposer
from serve.spec.raw_input_ring import RawInputRing
from serve.spec.verify import speculative_generate, verify, verify_and_replay
from tests.serve.spec.helpers import PROMPT, greedy_continuation, model, one_thread, start, tiny_model

pytestmark = pytest.mark.usefixtures(one_thread.__name__)
__all__ = ["model", "start"]  # shared fixtures


def test_ring_validation():
    with pytest.raises(ValueError, match="capacity"):
        RawInputRing(0, 1)
    with pytest.raises(ValueError, match="window"):
        RawInputRing(4, 5)
    with pytest.raises(ValueError, match="window"):
        RawInputRing(4, 0)


def test_ring_draft_longer_than_window_raises_and_changes_nothing(model, start):
    ring = RawInputRing(capacity=8, window=3)
    with pytest.raises(ValueError, match="rollback window of 3"):
        verify_and_replay(model, start, [1, 2, 3], ring)                  # 4 verify tokens > window 3
    ring.check_integrity()
    assert ring.head == ring.tail == 0 and not ring.recording and ring.nbytes() == 0
    res = verify_and_replay(model, start, [1, 2], ring)                     # 3 tokens fit
    ring.check_integrity()
    assert ring.commit_end == res.num_accepted + 1


def test_ring_wraps_and_writes_back_when_full(model, start):
    """Capacity 7, window 5: history fills the ring, then a verify that does not fit forces a write-back;
    every commit stays bitwise equal to sequential decoding and the slots wrap around."""
    ring = RawInputRing(capacity=7, window=5)
    target, ref_caches = greedy_continuation(model, start, 30)
    state, emitted, forced, wrapped = start, 0, 0, False
    while emitted < 24:
        drafts = target[emitted: emitted + 4]
        drafts[-1] = (drafts[-1] + 1) % 256                                 # accept 3 of 4 each step
        res = verify_and_replay(model, state, drafts, ring)
        ring.check_integrity()
        forced += res.forced_commit
        wrapped |= ring.slot(ring.tail) < ring.slot(ring.head)
        assert res.num_accepted == 3
        emitted += len(res.emitted_tokens)
        assert cache_equal(res.state.cache, ref_caches[emitted - 1])
        state = res.state
    assert forced >= 2 and ring.num_write_backs == forced
    assert wrapped, "the committed history never wrapped around the ring"
    statuses = [r["status"] for r in ring.slot_table()]
    assert statuses.count("committed") == ring.commit_end - ring.head and "pending" not in statuses
    for row in ring.slot_table():   # after wrapping: the counter, not the token position, gives the slot
        assert row["counter"] == -1 if row["status"] == "free" else row["counter"] % ring.capacity == row["slot"]


def test_ring_slot_table_marks_pending_then_frees_rejected(model, start):
    ring = RawInputRing(capacity=6, window=6)
    target, ref_caches = greedy_continuation(model, start, 5)
    drafts = target[:4]
    drafts[1] = (drafts[1] + 1) % 256                                       # accept 1
    ring.record(model, start.cache, verify(model, start, drafts))
    ring.check_integrity()
    table = ring.slot_table()
    assert [r["status"] for r in table] == ["pending"] * 5 + ["free"]
    assert [r["position"] for r in table][:5] == list(range(start.cache.num_tokens, start.cache.num_tokens + 5))
    assert [r["counter"] for r in table] == [0, 1, 2, 3, 4, -1]         # slot = counter mod capacity
    cache = ring.commit(1)
    ring.check_integrity()
    assert [r["status"] for r in ring.slot_table()] == ["committed"] * 2 + ["free"] * 4
    assert cache_equal(cache, ref_caches[1])
    assert ring.rebuild()[0].recurrent.equal(cache.layers[0].recurrent)


def test_ring_rejects_caches_from_elsewhere(model, start):
    ring = RawInputRing(capacity=8, window=4)
    res = verify_and_replay(model, start, [1, 2], ring)
    with pytest.raises(ValueError, match="committed up to"):
        verify_and_replay(model, start, [1], ring)                           # stale caches of the old step
    ring.check_integrity()
    res = verify_and_replay(model, res.state, [1], ring)
    ring.check_integrity()
    with pytest.raises(ValueError, match="another model"):
        verify_and_replay(tiny_model(), res.state, [1], ring)
    ring.check_integrity()


def test_ring_integrity_detects_a_corrupted_committed_slot(model, start):
    ring = RawInputRing(capacity=8, window=4)
    verify_and_replay(model, start, greedy_continuation(model, start, 3)[0][:3], ring)
    ring.check_integrity()
    ring._slots[ring.slot(ring.head), 0, 0] += 1.0                         # flip a committed input
    with pytest.raises(AssertionError, match="rebuild"):
        ring.check_integrity()


def test_ring_generation_with_frequent_write_backs(model):
    ref_tokens, ref_cache = model.generate(PROMPT.reshape(1, -1), 40)
    prop = NoisyOracleProposer.from_model(model, PROMPT, 40, 0.2, seed=5)
    ring = RawInputRing(capacity=6, window=6)
    res = speculative_generate(model, PROMPT, 40, prop, ring, 5)
    ring.check_integrity()
    assert res.tokens == ref_tokens[0].tolist() and cache_equal(res.state.cache, ref_cache)
    assert sum(s.forced_commit for s in res.steps) >= 3
    assert ring.nbytes() == 6 * model.cfg.num_kda_layers * model.cfg.hidden_size * 4 == 2304


def test_ring_bytes_store_dtype(model, start):
    ring = RawInputRing(4, 2, store_dtype=torch.bfloat16)
    assert ring.nbytes() == 0                                               # allocated at the first record
    verify_and_replay(model, start, [7], ring)
    ring.check_integrity()
    assert ring.nbytes() == 4 * 3 * 32 * 2 == 768                           # capacity x KDA layers x d x s
