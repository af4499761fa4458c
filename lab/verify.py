"""Page 02's live experiment: a speculative generation in one of three modes, every step checked
against plain sequential greedy decoding of the same tokens.

- ``normal``: noisy-oracle drafts, verify, accept, commit.
- ``interrupted``: before each real verify, a verify is started and aborted part-way (after some
  layers and/or some tokens, as if the request were preempted); its output is dropped. The step
  then checks that the committed caches are bitwise untouched and that the retried verify gives
  exactly what an uninterrupted verify gives.
- ``injected deviation``: the draft token at a chosen position is corrupted every step; optionally
  the stored data of every rejected token is overwritten with NaN before the commit (a control: a
  correct commit never reads it, so the result stays bitwise exact).
"""
from __future__ import annotations

import sys
from typing import NamedTuple

from kda_core.model import HybridLM, cache_equal, encode
from lab.threads import one_thread
from serve.spec.draft import NoisyOracleProposer
from serve.spec.raw_input_ring import RawInputRing
from serve.spec.reference import cache_max_abs_diff, clone_cache, sequential_decode
from serve.spec.rollback import RollbackStrategy
from serve.spec.snapshot import SnapshotRollback
from serve.spec.verify import ProjectionReplay, prefill_state, verify, verify_and_replay

MODES = ("normal", "interrupted", "injected deviation")
STRATEGIES = (SnapshotRollback.name, ProjectionReplay.name, RawInputRing.name)
PROMPT_TEXT = "Kimi Delta Attention keeps a fixed-size state per layer, so a rejected draft "


def built_by_loaded_code(obj: object) -> bool:
    """True if ``obj``'s class is still the one its module defines (looked up in ``sys.modules`` now).

    For ``st.cache_resource(validate=...)`` on the pages' models: when a source file changes, Streamlit
    evicts and re-imports every project module, but a cached model keeps running the old modules and
    returns caches of the old ``KDACache`` class, which the new code's ``isinstance`` checks reject
    (``AttributeError: 'KDACache' object has no attribute 'shape'``). False makes Streamlit rebuild it."""
    cls = type(obj)
    return getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls


def make_strategy(name: str, num_draft: int) -> RollbackStrategy:
    """A fresh strategy by display name; the ring gets a window of one verify and room for four.

    Raises ValueError for an unknown name."""
    if name == SnapshotRollback.name:
        return SnapshotRollback()
    if name == ProjectionReplay.name:
        return ProjectionReplay()
    if name == RawInputRing.name:
        return RawInputRing(capacity=4 * (num_draft + 1), window=num_draft + 1)
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {name!r}")


class LabStep(NamedTuple):
    """One step. max_abs_diff: max |committed - sequential reference| over all KDA states, conv states and
    MLA latents (0.0 = bitwise equal); tokens_match: emitted tokens equal plain greedy decoding.
    untouched / retry_equal: interrupted mode only (None otherwise); corrupted_position: 1-based draft
    position forced wrong (None if not applied); poisoned_tokens: rejected tokens overwritten with NaN."""

    step: int
    position: int
    num_drafted: int
    num_accepted: int
    num_emitted: int
    tokens_match: bool
    max_abs_diff: float
    rollback_bytes: int
    verify_ms: float
    commit_ms: float
    forced_commit: bool
    untouched: bool | None
    retry_equal: bool | None
    corrupted_position: int | None
    poisoned_tokens: int


def _poison_rejected(counter: list[int]):
    def hook(strategy: RollbackStrategy, num_accepted: int) -> None:
        first_rejected = num_accepted + 1                 # verify token index of the first rejected draft
        if first_rejected < strategy.num_tokens:
            strategy.poison(first_rejected)
            counter.append(strategy.num_tokens - first_rejected)
        else:
            counter.append(0)
    return hook


def run_verify_lab(model: HybridLM, num_draft: int, acceptance: float, strategy_name: str, seed: int,
                   mode: str = "normal", max_new_tokens: int = 32, abort_layers: int | None = None,
                   abort_tokens: int = 1, corrupt_position: int = 1, poison_rejected: bool = False) -> list[LabStep]:
    """Run the experiment; one :class:`LabStep` per verify.

    Args:
        num_draft: drafts per step (>= 1). acceptance: per-token probability a draft is right, in [0, 1]
        (the oracle corrupts with ``1 - acceptance``). strategy_name: one of ``STRATEGIES``. seed: the
        oracle's seed. mode: one of ``MODES``. abort_layers: layers the aborted verify runs (None = all).
        abort_tokens: verify tokens the aborted verify runs (1..1 + num_draft). corrupt_position: 1-based
        draft position forced wrong in ``injected deviation``. poison_rejected: NaN the rejected tokens' data.

    Raises:
        ValueError: an unknown mode/strategy or an out-of-range argument.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(num_draft, int) or num_draft < 1:
        raise ValueError(f"num_draft must be an int >= 1, got {num_draft!r}")
    if not 1 <= abort_tokens <= num_draft + 1:
        raise ValueError(f"abort_tokens must be in [1, {num_draft + 1}], got {abort_tokens}")
    if not 1 <= corrupt_position <= num_draft:
        raise ValueError(f"corrupt_position must be in [1, num_draft = {num_draft}], got {corrupt_position}")
    with one_thread():
        return _run(model, num_draft, acceptance, strategy_name, seed, mode, max_new_tokens, abort_layers,
                    abort_tokens, corrupt_position, poison_rejected)


def _run(model, num_draft, acceptance, strategy_name, seed, mode, max_new_tokens, abort_layers, abort_tokens,
         corrupt_position, poison_rejected) -> list[LabStep]:
    prompt = encode(PROMPT_TEXT)
    proposer = NoisyOracleProposer.from_model(model, prompt, max_new_tokens, 1.0 - float(acceptance), seed)
    strategy = make_strategy(strategy_name, num_draft)
    state = prefill_state(model, prompt)
    ref_cache, history = state.cache, prompt.tolist() + [state.last_token]
    steps: list[LabStep] = []
    while len(history) - len(prompt) < max_new_tokens:
        n = min(num_draft, max_new_tokens - (len(history) - len(prompt)) - 1)
        drafts = proposer.propose(history, n)
        corrupted = None
        if mode == "injected deviation" and corrupt_position <= len(drafts):
            corrupted = corrupt_position
            drafts[corrupted - 1] = (proposer.reference[len(history) - len(prompt) + corrupted - 1] + 1) % 256
        untouched = retry_equal = None
        if mode == "interrupted":
            before = clone_cache(state.cache)
            verify(model, state, drafts[: abort_tokens - 1], num_layers=abort_layers)   # aborted, dropped
            untouched = cache_equal(state.cache, before)
            clean = verify_and_replay(model, state, drafts, make_strategy(strategy_name, num_draft))
        poisoned: list[int] = []
        hook = _poison_rejected(poisoned) if mode == "injected deviation" and poison_rejected else None
        res = verify_and_replay(model, state, drafts, strategy, before_commit=hook)
        strategy.check_integrity()
        if mode == "interrupted":
            retry_equal = res.emitted_tokens == clean.emitted_tokens and cache_equal(res.state.cache, clean.state.cache)
        ref_cache = sequential_decode(model, ref_cache, (state.last_token, *res.accepted_tokens))[-1]
        emitted_at = len(history) - len(prompt)
        match = list(res.emitted_tokens) == proposer.reference[emitted_at: emitted_at + len(res.emitted_tokens)]
        steps.append(LabStep(len(steps), state.cache.num_tokens, len(drafts), res.num_accepted, len(res.emitted_tokens),
                             match, cache_max_abs_diff(res.state.cache, ref_cache), res.rollback_bytes, res.verify_ms,
                             res.commit_ms, res.forced_commit, untouched, retry_equal, corrupted, sum(poisoned)))
        history.extend(res.emitted_tokens)
        state = res.state
    return steps

