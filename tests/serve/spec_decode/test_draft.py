"""Draft proposers: prompt lookup on known histories; the noisy oracle's rate and reproducibility."""
import pytest

from serve.spec_decode.draft import NgramProposer, NoisyOracleProposer


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
