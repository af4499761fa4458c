"""verify_and_replay / speculative_generate: every strategy commits caches bitwise equal to plain
sequential greedy decoding, and the verify returns the emitted tokens' logits bitwise equal to one
``decode_step`` per token (fp32, demo-tiny with K != V)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kda_core.config import PRESETS
from kda_core.kda import NonFiniteError
from kda_core.model import HybridLM, cache_equal
from serve.spec_decode.draft import DraftModelProposer, NgramProposer, NoisyOracleProposer
from serve.spec_decode.projection import ProjectionReplay
from serve.spec_decode.reference import cache_max_abs_diff, clone_cache, closed_form_states, corrections
from serve.spec_decode.verify import (
    STRATEGIES,
    DecodeState,
    Speculation,
    greedy_accept,
    speculate,
    speculative_generate,
    verify,
    verify_and_replay,
)
from serve.spec_decode.verify import make_strategy as spec_make_strategy
from tests.serve.spec_decode.helpers import (
    PROMPT,
    STRATEGY_IDS,
    greedy_continuation,
    make_strategy,
    model,
    one_thread,
    perturbed_copy,
    start,
)

N_DRAFT = 4
pytestmark = pytest.mark.usefixtures(one_thread.__name__)
__all__ = ["model", "start"]  # shared fixtures


def _decode_logits(model, state: DecodeState, fed: list[int]) -> torch.Tensor:
    """Plain decoding from ``state``: the ``decode_step`` logits ``[len(fed), 256]`` after feeding each
    of ``fed`` (``fed[0]`` is ``state.last_token``)."""
    rows, cache = [], state.cache
    for tok in fed:
        logits, cache = model.decode_step(torch.tensor([tok]), cache)
        rows.append(logits[0])
    return torch.stack(rows)


def _drafts_accepting(target: list[int], num_accepted: int, n: int) -> list[int]:
    """n drafts whose first num_accepted match the greedy target and the next one does not."""
    drafts = list(target[:n])
    if num_accepted < n:
        drafts[num_accepted] = (drafts[num_accepted] + 1) % 256
        drafts[num_accepted + 1:] = [(t + 7) % 256 for t in drafts[num_accepted + 1:]]
    return drafts


@pytest.mark.parametrize("kind", STRATEGY_IDS)
@pytest.mark.parametrize("num_accepted", range(N_DRAFT + 1), ids=lambda a: f"accept{a}")
def test_verify_and_replay_every_accept_count(model, start, kind, num_accepted):
    target, ref_caches = greedy_continuation(model, start, N_DRAFT)
    drafts = _drafts_accepting(target, num_accepted, N_DRAFT)
    before = clone_cache(start.cache)
    strategy = make_strategy(kind)
    res = verify_and_replay(model, start, drafts, strategy)
    strategy.check_integrity()
    assert res.num_accepted == num_accepted
    assert list(res.emitted_tokens) == target[: num_accepted + 1]          # accepted + bonus
    assert res.state.last_token == target[num_accepted]
    assert cache_equal(res.state.cache, ref_caches[num_accepted])          # bitwise
    assert cache_max_abs_diff(res.state.cache, ref_caches[num_accepted]) == 0.0
    assert cache_equal(start.cache, before), "verify/commit mutated the committed caches"
    assert res.rollback_bytes > 0 and strategy.nbytes() == strategy.expected_nbytes()
    ref_logits = _decode_logits(model, start, [start.last_token, *target[:num_accepted]])
    assert res.logits.shape == (num_accepted + 1, 256) and res.logits.dtype == torch.float32
    assert torch.equal(res.logits, ref_logits)                              # bitwise (kda_core.invariant)
    assert [int(t) for t in res.logits.argmax(-1)] == list(res.emitted_tokens)


@pytest.mark.parametrize("kind", STRATEGY_IDS)
def test_verify_accept1_holds_no_rejected_draft(model, start, kind):
    """Verify 4, accept 1: the state is after [t0, d1] exactly, not after any rejected draft
    (tpu-inference#3178 folded a rejected draft into the state)."""
    target, ref_caches = greedy_continuation(model, start, N_DRAFT)
    drafts = _drafts_accepting(target, 1, N_DRAFT)
    res = verify_and_replay(model, start, drafts, make_strategy(kind))
    assert res.state.cache.num_tokens == start.cache.num_tokens + 2
    assert cache_equal(res.state.cache, ref_caches[1])
    folded = verify(model, DecodeState(ref_caches[1], drafts[1]), []).cache  # with the rejected d2 fed
    assert not cache_equal(res.state.cache, folded)
    assert cache_max_abs_diff(res.state.cache, folded) == float("inf")


@pytest.mark.parametrize("kind", STRATEGY_IDS)
def test_verify_and_replay_stale_slot_sequence(model, start, kind):
    """Accept >= 2, then a step with zero drafts, then another verify: each step starts from the state
    after the accepted tokens (vllm#52942 reused a stale per-draft slot after a zero-draft step)."""
    strategy, state = make_strategy(kind), start
    target, ref_caches = greedy_continuation(model, state, 12)
    steps = [(_drafts_accepting(target, 3, N_DRAFT), 3)]
    res = verify_and_replay(model, state, steps[0][0], strategy)
    strategy.check_integrity()
    assert res.num_accepted == 3 and cache_equal(res.state.cache, ref_caches[3])
    res = verify_and_replay(model, res.state, [], strategy)                # zero drafts: a plain decode step
    strategy.check_integrity()
    assert res.num_accepted == 0 and res.bonus_token == target[4]
    assert cache_equal(res.state.cache, ref_caches[4])
    drafts = _drafts_accepting(target[5:], 2, N_DRAFT)
    res = verify_and_replay(model, res.state, drafts, strategy)
    strategy.check_integrity()
    assert res.num_accepted == 2 and list(res.emitted_tokens) == target[5:8]
    assert cache_equal(res.state.cache, ref_caches[7])


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "proposer"), [(k, p) for p in ("ngram", "oracle") for k in STRATEGY_IDS]
                         + [("projection", "draft-model"), ("replayssm", "draft-model")])   # the draft model costs most
def test_speculative_generate_equals_plain_greedy(model, kind, proposer):
    ref_tokens, ref_cache = model.generate(PROMPT.reshape(1, -1), 64)
    prop = {"ngram": NgramProposer, "draft-model": lambda: DraftModelProposer(perturbed_copy(model, 0.3)),
            "oracle": lambda: NoisyOracleProposer.from_model(model, PROMPT, 64, 0.3, seed=3)}[proposer]()
    strategy = make_strategy(kind)
    res = speculative_generate(model, PROMPT, 64, prop, strategy, N_DRAFT)
    strategy.check_integrity()
    assert res.tokens == ref_tokens[0].tolist()
    assert cache_equal(res.state.cache, ref_cache)
    assert sum(s.num_emitted for s in res.steps) + 1 == 64
    assert any(s.num_accepted > 0 for s in res.steps), "no draft accepted: rollback not exercised"
    assert any(s.num_accepted < s.num_drafted for s in res.steps), "no draft rejected: rollback not exercised"
    if proposer != "ngram":
        assert any(0 < s.num_accepted < s.num_drafted for s in res.steps), "no partially rejected draft"


def test_speculative_generate_demo_k3_gate():
    """Same exactness on the 8-layer demo with the K3 lower-bound gate and wider layers."""
    model = HybridLM(PRESETS["demo-k3gate"])
    ref_tokens, ref_cache = model.generate(PROMPT.reshape(1, -1), 24)
    prop = NoisyOracleProposer.from_model(model, PROMPT, 24, 0.25, seed=0)
    res = speculative_generate(model, PROMPT, 24, prop, ProjectionReplay(), 5)
    assert res.tokens == ref_tokens[0].tolist() and cache_equal(res.state.cache, ref_cache)


def test_projection_replay_matches_closed_form(model, start):
    """Second, independent check: the replayed state equals the closed-form sum over recorded (k, u, g)."""
    target, _ = greedy_continuation(model, start, N_DRAFT)
    strategy = ProjectionReplay()
    out = verify(model, start, target[:N_DRAFT])
    strategy.record(model, start.cache, out)
    stored = {i: strategy.projections(i) for i in model.kda_layers}
    cache = strategy.commit(N_DRAFT)
    for i in model.kda_layers:
        p, s0 = stored[i], start.cache.layers[i].recurrent
        _, u = corrections(s0, p["k"], p["v"], p["g"], p["beta"])
        closed = closed_form_states(s0, p["k"], u, p["g"])                  # [1, T, H, K, V] fp64
        err = (closed[:, -1] - cache.layers[i].recurrent.double()).abs().max().item()
        assert err <= 1e-6, f"layer {i}: closed form differs by {err}"
        assert float(s0.abs().max()) > 1e-2, "the check needs a non-trivial S_0"


def test_poisoned_rejected_tokens_are_never_read(model, start):
    """Control: NaN in the stored data of rejected tokens leaves the commit bitwise exact."""
    target, ref_caches = greedy_continuation(model, start, N_DRAFT)
    drafts = _drafts_accepting(target, 2, N_DRAFT)
    for kind in STRATEGY_IDS:
        strategy = make_strategy(kind)
        strategy.record(model, start.cache, verify(model, start, drafts))
        strategy.poison(3)                                                 # tokens 3, 4 were rejected
        strategy.check_integrity()
        assert cache_equal(strategy.commit(2), ref_caches[2]), kind
        strategy.check_integrity()
    strategy = make_strategy("projection")                                 # and poisoning an accepted one shows:
    strategy.record(model, start.cache, verify(model, start, drafts))      # its replay meets NaN gates, which
    strategy.poison(2)                                                     # the kernels refuse (it was a NaN state)
    with pytest.raises(NonFiniteError, match="g must be a log decay"):
        strategy.commit(2)


def test_interrupted_verify_leaves_caches_and_retry_is_equal(model, start):
    target, _ = greedy_continuation(model, start, N_DRAFT)
    before = clone_cache(start.cache)
    partial = verify(model, start, target[:N_DRAFT], num_layers=2)
    assert partial.logits is None and not cache_equal(partial.cache, start.cache)
    assert cache_equal(start.cache, before)
    first = verify_and_replay(model, start, target[:N_DRAFT], make_strategy("projection"))
    strategy = make_strategy("projection")
    strategy.record(model, start.cache, verify(model, start, target[:N_DRAFT]))
    strategy.discard()                                                     # preempted after the verify
    strategy.check_integrity()
    retry = verify_and_replay(model, start, target[:N_DRAFT], strategy)
    assert retry.emitted_tokens == first.emitted_tokens and cache_equal(retry.state.cache, first.state.cache)


def test_store_dtype_bf16_halves_bytes(model, start):
    drafts = greedy_continuation(model, start, N_DRAFT)[0][:N_DRAFT]
    for kind in STRATEGY_IDS:
        a, b = make_strategy(kind), make_strategy(kind, torch.bfloat16)
        ra, rb = verify_and_replay(model, start, drafts, a), verify_and_replay(model, start, drafts, b)
        assert ra.rollback_bytes == 2 * rb.rollback_bytes, kind
        b.check_integrity()


def test_greedy_accept():
    assert greedy_accept([1, 2, 3], [1, 2, 3, 4]) == 3
    assert greedy_accept([1, 9, 3], [1, 2, 3, 4]) == 1
    assert greedy_accept([], [5]) == 0
    with pytest.raises(ValueError, match="target_tokens"):
        greedy_accept([1, 2], [1, 2])


def test_strategy_misuse_raises(model, start):
    strategy = make_strategy("snapshot")
    with pytest.raises(ValueError, match="nothing recorded"):
        strategy.commit(0)
    out = verify(model, start, [1, 2])
    strategy.record(model, start.cache, out)
    with pytest.raises(ValueError, match="already recorded"):
        strategy.record(model, start.cache, out)
    with pytest.raises(ValueError, match="num_accepted"):
        strategy.commit(3)
    with pytest.raises(ValueError, match="output_aux"):
        make_strategy("projection").record(model, start.cache, model.forward(torch.tensor([1, 2]), start.cache))
    with pytest.raises(ValueError, match="DecodeState"):
        verify(model, (start.cache, 3), [1])
    with pytest.raises(ValueError, match="store_dtype"):
        ProjectionReplay(torch.int32)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(model, PROMPT, 4, NgramProposer(), ProjectionReplay(), -1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", STRATEGY_IDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4), st.booleans()), min_size=1, max_size=6))
def test_random_step_sequences_match_sequential(model, start, kind, plan):
    """Random (draft length, accepted count, abort-first) sequences: after every step the strategy is intact
    and the committed caches equal a plain decode of the emitted tokens (the oracle)."""
    strategy, state = make_strategy(kind), start
    for n, a, abort in plan:
        a = min(a, n)
        target, ref_caches = greedy_continuation(model, state, n)
        drafts = _drafts_accepting(target, a, n)
        if abort:                                                           # a preempted verify, dropped
            strategy.record(model, state.cache, verify(model, state, drafts))
            strategy.discard()
            strategy.check_integrity()
        res = verify_and_replay(model, state, drafts, strategy)
        strategy.check_integrity()
        assert res.num_accepted == a and list(res.emitted_tokens) == target[: a + 1]
        assert cache_equal(res.state.cache, ref_caches[a])
        assert torch.equal(res.logits, _decode_logits(model, state, [state.last_token, *target[:a]]))
        state = res.state


def test_make_strategy_is_the_one_factory():
    """Every strategy by its display name; the ring's window and capacity; bad input named."""
    assert [type(make_strategy(k)).__name__ for k in STRATEGY_IDS] == [c.__name__ for c in STRATEGIES.values()]
    ring = spec_make_strategy("raw-input ring", 5)
    assert (ring.window, ring.capacity) == (5, 5)                            # default: room for one verify
    ring = spec_make_strategy("raw-input ring", 5, capacity=20, store_dtype=torch.bfloat16)
    assert (ring.window, ring.capacity, ring.store_dtype) == (5, 20, torch.bfloat16)
    assert spec_make_strategy("snapshot", 3, capacity=99).store_dtype == torch.float32   # capacity: ring only
    with pytest.raises(ValueError, match="strategy must be one of"):
        spec_make_strategy("snapshots", 3)
    with pytest.raises(ValueError, match="window"):
        spec_make_strategy("projection replay", 0)
    with pytest.raises(ValueError, match="window"):
        spec_make_strategy("raw-input ring", 5, capacity=4)
    with pytest.raises(ValueError, match="strategy must be one of"):
        Speculation.named(NgramProposer, "ring", 4)                         # raised at once, not per request
    spec = Speculation.named(lambda p: NgramProposer(), "raw-input ring", 4, capacity=12)
    a, b = spec.strategy(), spec.strategy()
    assert a is not b and (a.window, a.capacity) == (5, 12)                 # fresh per request, window 1 + n


def test_speculate_hooks_and_budget(model, start):
    """The one loop: each step starts where the last ended, ``before_verify`` sees the committed state and
    the drafts about to be verified, ``before_commit`` the accepted count; it emits exactly num_tokens."""
    history = PROMPT.tolist() + [start.last_token]
    seen_verify, seen_commit = [], []
    steps = list(speculate(model, start, history, NgramProposer(), make_strategy("projection"), N_DRAFT, 11,
                           before_verify=lambda s, d: seen_verify.append((s, list(d))),
                           before_commit=lambda st_, a: seen_commit.append(a)))
    assert sum(len(s.result.emitted_tokens) for s in steps) == 11
    assert [s.step for s in steps] == list(range(len(steps)))
    for prev, step in zip(steps, steps[1:]):
        assert step.before is prev.result.state
    assert [(s.before, list(s.result.draft_tokens)) for s in steps] == seen_verify
    assert [s.result.num_accepted for s in steps] == seen_commit
    assert list(speculate(model, start, history, NgramProposer(), make_strategy("projection"), N_DRAFT, 0)) == []
    with pytest.raises(ValueError, match="history must end"):
        next(speculate(model, start, history[:-1], NgramProposer(), make_strategy("projection"), N_DRAFT, 3))
    with pytest.raises(ValueError, match="num_tokens"):
        next(speculate(model, start, history, NgramProposer(), make_strategy("projection"), N_DRAFT, -1))
