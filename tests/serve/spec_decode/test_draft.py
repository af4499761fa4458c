"""Draft proposers: prompt lookup on known histories; the noisy oracle's rate and reproducibility; the draft
model's greedy drafts and the exact rollback of its own cache."""
import pytest
import torch

from kda_core.model import cache_equal
from serve.spec_decode.draft import DraftModelProposer, NgramProposer, NoisyOracleProposer
from tests.serve.spec_decode.helpers import PROMPT, tiny_model


def test_ngram_proposes_what_followed_the_suffix():
    p = NgramProposer(max_ngram=3, min_ngram=1)
    hist = [1, 2, 3, 4, 5, 9, 2, 3]                   # "2 3" occurred before, followed by 4 5 9
    assert p.propose(hist, 3) == [4, 5, 9]
    assert p.propose(hist, 10) == [4, 5, 9, 2, 3]      # stops at the end of the history
    assert p.propose(hist, 0) == []


def test_ngram_prefers_the_longest_ngram():
    p = NgramProposer(max_ngram=3)
    hist = [7, 3, 8, 5, 3, 6, 5, 3]                   # "5 3" -> 6; "3" alone would give 8 first
    assert p.propose(hist, 1) == [6]
    assert NgramProposer(max_ngram=1).propose(hist, 1) == [8]


def test_ngram_repeated_run_gives_full_draft_and_no_match_gives_none():
    p = NgramProposer()
    assert p.propose([4] * 8, 3) == [4, 4, 4]        # earliest match: the longest continuation
    assert p.propose([4] * 4, 3) == [4]              # only one token follows the earliest "4 4 4"
    assert p.propose([1, 2, 3], 4) == []
    assert p.propose([5], 2) == []


def test_ngram_validation():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramProposer(min_ngram=0)
    with pytest.raises(ValueError, match="max_ngram"):
        NgramProposer(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="num_tokens"):
        NgramProposer().propose([1, 2], -1)
    with pytest.raises(ValueError, match="history"):
        NgramProposer().propose([], 2)


def test_noisy_oracle_rates_and_seed():
    prompt, ref = [10, 11], list(range(100, 200))
    exact = NoisyOracleProposer(prompt, ref, 0.0)
    assert exact.propose(prompt + ref[:5], 4) == ref[5:9]
    wrong = NoisyOracleProposer(prompt, ref, 1.0).propose(prompt + ref[:5], 50)
    assert len(wrong) == 50 and all(w != r for w, r in zip(wrong, ref[5:55]))
    a = NoisyOracleProposer(prompt, ref, 0.5, seed=7).propose(prompt, 90)
    b = NoisyOracleProposer(prompt, ref, 0.5, seed=7).propose(prompt, 90)
    assert a == b
    rate = sum(x != r for x, r in zip(a, ref)) / 90
    assert 0.35 < rate < 0.65
    assert NoisyOracleProposer(prompt, ref, 0.0).propose(prompt + ref, 3) == []   # reference exhausted


def test_noisy_oracle_validation():
    with pytest.raises(ValueError, match="corrupt_prob"):
        NoisyOracleProposer([1], [2], 1.5)
    with pytest.raises(ValueError, match="prefix of the oracle"):
        NoisyOracleProposer([1], [2, 3], 0.0).propose([1, 3], 1)


def test_ngram_finds_the_earliest_occurrence():
    hist = [1, 2, 7, 5, 1, 2, 8, 5, 1, 2]              # "1 2" at 0 (-> 7) and at 4 (-> 8): the earliest wins
    assert NgramProposer(max_ngram=2).propose(hist, 2) == [7, 5]


# ---- DraftModelProposer: its own greedy continuation, and an exact rollback of its own cache ----

@pytest.fixture(scope="module")
def draft():
    torch.set_num_threads(1)
    return tiny_model()


def _reference_cache(model, first_history, later_tokens):
    """The contract: chunk prefill of the first history, then one decode_step per later committed token."""
    logits, cache = model.prefill(torch.tensor([first_history]))
    logits = logits[0, -1]
    for tok in later_tokens:
        step_logits, cache = model.decode_step(tok, cache)
        logits = step_logits[0]
    return cache, logits


def test_draft_model_proposes_its_own_greedy_continuation(draft):
    hist = PROMPT.tolist()
    ref, _ = draft.generate(PROMPT.reshape(1, -1), 6)                   # [1, 6] the draft model's greedy tokens
    prop = DraftModelProposer(draft)
    assert prop.propose(hist, 6) == ref[0].tolist()
    assert prop.propose(hist, 0) == [] and prop.propose(hist, 2) == ref[0, :2].tolist()   # same history: reused


@pytest.mark.parametrize("accepts", [[0, 2, 4, 1, 3], [4, 4, 0]], ids=["partial", "full-then-none"])
def test_draft_model_rollback_is_exact(draft, accepts):
    """After every partial (or full) accept plus a bonus token that differs from the next draft, the proposer's
    committed cache equals the reference bitwise, and its next drafts are the greedy tokens from it."""
    first = PROMPT.tolist()
    prop, hist = DraftModelProposer(draft), list(first)
    drafts = prop.propose(hist, 4)
    for a in accepts:
        bonus = (drafts[a] + 1) % 256 if a < len(drafts) else 33         # a rejected draft, or the bonus after all
        hist = hist + drafts[:a] + [bonus]
        drafts = prop.propose(hist, 4)
        ref_cache, ref_logits = _reference_cache(draft, first, hist[len(first):])
        assert prop.tokens == hist and cache_equal(prop.cache, ref_cache)
        ref_drafts, cache, logits = [], ref_cache, ref_logits
        for _ in range(4):
            ref_drafts.append(int(logits.argmax()))
            step_logits, cache = draft.decode_step(ref_drafts[-1], cache)
            logits = step_logits[0]
        assert drafts == ref_drafts


def test_draft_model_restarts_on_a_history_that_does_not_extend(draft):
    prop = DraftModelProposer(draft)
    prop.propose(PROMPT.tolist(), 3)
    other = [65, 66, 67, 68]
    ref, _ = draft.generate(torch.tensor([other]), 3)
    assert prop.propose(other, 3) == ref[0].tolist()
    assert cache_equal(prop.cache, draft.prefill(torch.tensor([other]))[1])


def test_draft_model_validation(draft):
    with pytest.raises(TypeError, match="model"):
        DraftModelProposer("not a model")
    with pytest.raises(ValueError, match="num_tokens"):
        DraftModelProposer(draft).propose([1, 2], -1)
    with pytest.raises(ValueError, match="history"):
        DraftModelProposer(draft).propose([], 2)
