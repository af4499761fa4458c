"""Page 02's experiment: every mode stays bitwise exact, and its checks report what they claim."""
import pytest

import lab.verify as lab_verify
from kda_core.layer import KDACache
from kda_core.model import HybridCache, encode
from lab.verify import MODES, PROMPT_TEXT, STRATEGIES, run_verify_lab
from serve.spec_decode.reference import cache_max_abs_diff, sequential_decode
from serve.spec_decode.snapshot import SnapshotRollback
from serve.spec_decode.verify import prefill_state
from tests.serve.spec_decode.helpers import model, one_thread, perturbed_copy

pytestmark = pytest.mark.usefixtures(one_thread.__name__)
__all__ = ["model"]  # shared fixture


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", MODES)
def test_run_verify_lab_is_exact(model, mode, strategy):
    steps = run_verify_lab(model, 4, 0.6, strategy, seed=1, mode=mode, max_new_tokens=20, abort_layers=2,
                           abort_tokens=3, corrupt_position=2, poison_rejected=True)
    assert sum(s.num_emitted for s in steps) + 1 == 20
    assert all(s.max_abs_diff == 0.0 and s.tokens_match for s in steps)
    assert all(s.rollback_bytes > 0 for s in steps)
    if mode == "interrupted":
        assert all(s.untouched and s.retry_equal for s in steps)
    else:
        assert all(s.untouched is None and s.retry_equal is None for s in steps)
    if mode == "injected deviation":
        full = [s for s in steps if s.num_drafted >= 2]
        assert full and all(s.corrupted_position == 2 and s.num_accepted <= 1 for s in full)
        assert sum(s.poisoned_tokens for s in steps) > 0


def test_run_verify_lab_acceptance_extremes(model):
    all_right = run_verify_lab(model, 3, 1.0, STRATEGIES[0], 0, max_new_tokens=17)
    assert [s.num_accepted for s in all_right] == [s.num_drafted for s in all_right] and len(all_right) == 4
    all_wrong = run_verify_lab(model, 3, 0.0, STRATEGIES[0], 0, max_new_tokens=9)
    assert all(s.num_accepted == 0 for s in all_wrong) and len(all_wrong) == 8


def test_run_verify_lab_validation(model):
    with pytest.raises(ValueError, match="mode"):
        run_verify_lab(model, 2, 0.5, STRATEGIES[0], 0, mode="chaos")
    with pytest.raises(ValueError, match="strategy"):
        run_verify_lab(model, 2, 0.5, "magic", 0)
    with pytest.raises(ValueError, match="abort_tokens"):
        run_verify_lab(model, 2, 0.5, STRATEGIES[0], 0, mode="interrupted", abort_tokens=4)
    with pytest.raises(ValueError, match="corrupt_position"):
        run_verify_lab(model, 2, 0.5, STRATEGIES[0], 0, corrupt_position=3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("drafter", ["n-gram", "draft model"])
def test_run_verify_lab_with_real_drafters_is_exact(model, mode, drafter):
    draft = perturbed_copy(model, 0.3) if drafter == "draft model" else None
    steps = run_verify_lab(model, 4, 0.0, STRATEGIES[1], seed=0, mode=mode, max_new_tokens=24, abort_layers=2,
                           abort_tokens=3, corrupt_position=2, poison_rejected=True, drafter=drafter, draft=draft,
                           prompt=list(b"def f(x):\n    return x\n\ndef f(x):\n"))
    assert sum(s.num_emitted for s in steps) + 1 == 24
    assert all(s.max_abs_diff == 0.0 and s.tokens_match for s in steps)
    assert [s.budget for s in steps] == [min(4, 23 - sum(t.num_emitted for t in steps[:i]) - 1)
                                        for i in range(len(steps))]
    if mode == "normal" and drafter == "draft model":
        assert sum(s.num_accepted for s in steps) > 0, "acceptance 0.0 is the oracle's: real drafters ignore it"


def test_run_verify_lab_diff_is_against_sequential_decoding_of_the_same_tokens(model, monkeypatch):
    """The check takes its reference caches from the one plain greedy run while the commits follow it, and decodes
    the committed tokens itself once they leave it: a state corrupted by the second commit shows, at every step, its
    difference from sequential decoding of the tokens that run really committed."""
    seen, commits = [], []
    real_speculate, real_commit = lab_verify.speculate, SnapshotRollback.commit

    def recording(*args, **kwargs):
        for step in real_speculate(*args, **kwargs):
            seen.append(step)
            yield step

    def corrupting_commit(self, num_accepted):
        cache = real_commit(self, num_accepted)
        commits.append(num_accepted)
        if len(commits) != 2:
            return cache
        layers, i = list(cache.layers), model.kda_layers[0]
        layers[i] = KDACache(layers[i].recurrent + 5.0, layers[i].conv)
        return HybridCache(tuple(layers), cache.num_tokens)

    monkeypatch.setattr(lab_verify, "speculate", recording)
    monkeypatch.setattr(SnapshotRollback, "commit", corrupting_commit)
    steps = run_verify_lab(model, 3, 0.7, SnapshotRollback.name, seed=0, max_new_tokens=20, drafter="n-gram")
    start = prefill_state(model, encode(PROMPT_TEXT))
    emitted = [start.last_token] + [t for step in seen for t in step.result.emitted_tokens]
    plain = sequential_decode(model, start.cache, emitted[:-1])          # plain[j]: after the first j + 1 tokens
    fed = [sum(len(s.result.emitted_tokens) for s in seen[: k + 1]) for k in range(len(seen))]
    want = [cache_max_abs_diff(step.result.state.cache, plain[n - 1]) for step, n in zip(seen, fed)]
    assert [s.max_abs_diff for s in steps] == want
    assert steps[0].max_abs_diff == 0.0 and all(s.max_abs_diff > 0 for s in steps[1:])
    assert not all(s.tokens_match for s in steps), "the corruption must also change tokens (the decode-it-now path)"
