"""Page 02's live experiment: a speculative generation in one of three modes, every step checked
against plain sequential greedy decoding of the same tokens.

- ``normal``: drafts from the chosen drafter (n-gram prompt lookup, the trained draft model, or the noisy
  oracle: :data:`lab.drafters.DRAFTERS`), verify, accept, commit.
- ``interrupted``: before each real verify, a verify is started and aborted part-way (after some
  layers and/or some tokens, as if the request were preempted); its output is dropped. The step
  then checks that the committed caches are bitwise untouched and that the retried verify gives
  exactly what an uninterrupted verify gives.
- ``injected deviation``: the draft token at a chosen position is corrupted every step; optionally
  the stored data of every rejected token is overwritten with NaN before the commit (a control: a
  correct commit never reads it, so the result stays bitwise exact).

Every mode works with every drafter; the reference is the target's plain greedy output (``HybridLM.generate``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kda_core.model import HybridLM, cache_equal, encode
from lab.drafters import make_proposer
from lab.threads import one_thread
from serve.errors import check_choice, check_int
from serve.spec_decode.draft import DraftProposer
from serve.spec_decode.reference import cache_max_abs_diff, clone_cache, greedy_decode, sequential_decode
from serve.spec_decode.rollback import RollbackStrategy
from serve.spec_decode.verify import STRATEGIES as STRATEGY_TYPES
from serve.spec_decode.verify import (
    DecodeState,
    draft_budget,
    make_strategy,
    prefill_state,
    speculate,
    verify,
    verify_and_replay,
)

MODES = ("normal", "interrupted", "injected deviation")
STRATEGIES = tuple(STRATEGY_TYPES)  # display names
PROMPT_TEXT = "Kimi Delta Attention keeps a fixed-size state per layer, so a rejected draft "


class LabStep(NamedTuple):
    """One step. max_abs_diff: max |committed - sequential reference| over all KDA states, conv states and
    MLA latents (0.0 = bitwise equal); tokens_match: emitted tokens equal plain greedy decoding.
    untouched / retry_equal: interrupted mode only (None otherwise); corrupted_position: 1-based draft
    position forced wrong (None if not applied); poisoned_tokens: rejected tokens overwritten with NaN;
    budget: drafts the step was allowed (``draft_budget``: fewer than n only near the end of the generation)."""

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
    budget: int


class CorruptingProposer(DraftProposer):
    """A proposer whose draft at 1-based ``position`` is always forced wrong (the target's greedy token + 1;
    ``reference``: the target's greedy output after a prompt of ``prompt_len`` tokens)."""

    name = "one position corrupted"

    def __init__(self, inner: DraftProposer, prompt_len: int, reference: Sequence[int], position: int):
        self.inner, self.prompt_len, self.reference, self.position = inner, prompt_len, list(reference), position

    def propose(self, history: Sequence[int], num_tokens: int) -> list[int]:
        drafts = self.inner.propose(history, num_tokens)
        at = len(history) - self.prompt_len + self.position - 1                 # index in the reference
        if self.position <= len(drafts) and at < len(self.reference):
            drafts[self.position - 1] = (self.reference[at] + 1) % 256
        return drafts


def run_verify_lab(model: HybridLM, num_draft: int, acceptance: float, strategy_name: str, seed: int,
                   mode: str = "normal", max_new_tokens: int = 32, abort_layers: int | None = None,
                   abort_tokens: int = 1, corrupt_position: int = 1, poison_rejected: bool = False,
                   drafter: str = "noisy oracle", draft: HybridLM | None = None,
                   prompt: Sequence[int] | None = None) -> list[LabStep]:
    """Run the experiment; one :class:`LabStep` per verify.

    Args:
        num_draft: drafts per step (>= 1). acceptance: the noisy oracle's per-token probability a draft is
        right, in [0, 1] (it corrupts with ``1 - acceptance``; unused by the other drafters). strategy_name: one of ``STRATEGIES``. seed: the
        oracle's seed. mode: one of ``MODES``. abort_layers: layers the aborted verify runs (None = all).
        abort_tokens: verify tokens the aborted verify runs (1..1 + num_draft). corrupt_position: 1-based
        draft position forced wrong in ``injected deviation``. poison_rejected: NaN the rejected tokens' data.
        drafter: one of :data:`lab.drafters.DRAFTERS`; draft: the draft model (for ``"draft model"``).
        prompt: byte ids (default :data:`PROMPT_TEXT`'s bytes).

    Raises:
        ValueError: an unknown mode/strategy/drafter, an out-of-range argument, no draft model for
        ``"draft model"``.
    """
    check_choice("mode", mode, MODES)
    check_int("num_draft", num_draft)
    if not 1 <= abort_tokens <= num_draft + 1:
        raise ValueError(f"abort_tokens must be in [1, {num_draft + 1}], got {abort_tokens}")
    if not 1 <= corrupt_position <= num_draft:
        raise ValueError(f"corrupt_position must be in [1, num_draft = {num_draft}], got {corrupt_position}")
    with one_thread():
        return _run(model, num_draft, acceptance, strategy_name, seed, mode, max_new_tokens, abort_layers,
                    abort_tokens, corrupt_position, poison_rejected, drafter, draft, prompt)


def _run(model, num_draft, acceptance, strategy_name, seed, mode, max_new_tokens, abort_layers, abort_tokens,
         corrupt_position, poison_rejected, drafter, draft, prompt_ids) -> list[LabStep]:
    """:func:`serve.spec_decode.verify.speculate` with this experiment's instrumentation: a corrupting proposer,
    an aborted verify plus a clean run before each verify (``before_verify``), NaN in the rejected tokens'
    data (``before_commit``), and after each step the checks against sequential decoding."""
    prompt = encode(PROMPT_TEXT) if prompt_ids is None else torch.tensor([int(t) for t in prompt_ids])
    if not 0.0 <= float(acceptance) <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance!r}")
    state = prefill_state(model, prompt)
    # Plain greedy decoding, once: its tokens are the reference output (model.generate's, bitwise) and its caches
    # are sequential decoding of those tokens, the ground truth for every step that committed exactly them.
    plain = greedy_decode(model, state.cache, state.last_token, max_new_tokens)
    reference = plain.tokens
    proposer = make_proposer(drafter, draft, prompt.tolist(), reference, 1.0 - float(acceptance), seed)
    window = num_draft + 1
    strategy = make_strategy(strategy_name, window, capacity=4 * window)    # ring: room for four verifies
    injected = mode == "injected deviation"
    if injected:
        proposer = CorruptingProposer(proposer, len(prompt), reference, corrupt_position)
    seen: dict = {}                                  # what the hooks saw in the current step

    def interrupt(state: DecodeState, drafts: list[int]) -> None:
        before = clone_cache(state.cache)
        verify(model, state, drafts[: abort_tokens - 1], num_layers=abort_layers)   # aborted, dropped
        seen["untouched"] = cache_equal(state.cache, before)
        seen["clean"] = verify_and_replay(model, state, drafts, make_strategy(strategy_name, window, 4 * window))

    def poison(strat: RollbackStrategy, num_accepted: int) -> None:
        first_rejected = num_accepted + 1            # verify token index of the first rejected draft
        seen["poisoned"] = max(0, strat.num_tokens - first_rejected)
        if seen["poisoned"]:
            strat.poison(first_rejected)

    history = prompt.tolist() + [state.last_token]
    ref_cache, steps, fed, on_reference = state.cache, [], 0, True   # fed: tokens committed after the prompt
    for step in speculate(model, state, history, proposer, strategy, num_draft, max_new_tokens - 1,
                          before_verify=interrupt if mode == "interrupted" else None,
                          before_commit=poison if injected and poison_rejected else None):
        strategy.check_integrity()
        res, before = step.result, step.before
        untouched = retry_equal = None
        if mode == "interrupted":
            untouched, clean = seen["untouched"], seen["clean"]
            retry_equal = res.emitted_tokens == clean.emitted_tokens and cache_equal(res.state.cache, clean.state.cache)
        committed = [before.last_token, *res.accepted_tokens]            # fed by this step's commit
        on_reference = on_reference and committed == reference[fed: fed + len(committed)]
        fed += len(committed)
        ref_cache = (plain.caches[fed - 1] if on_reference and fed <= len(plain.caches)   # the same tokens, decoded once
                     else sequential_decode(model, ref_cache, committed)[-1])
        emitted_at = len(history) - len(prompt)
        match = list(res.emitted_tokens) == reference[emitted_at: emitted_at + len(res.emitted_tokens)]
        corrupted = corrupt_position if injected and corrupt_position <= len(res.draft_tokens) else None
        steps.append(LabStep(step.step, before.cache.num_tokens, len(res.draft_tokens), res.num_accepted,
                             len(res.emitted_tokens), match, cache_max_abs_diff(res.state.cache, ref_cache),
                             res.rollback_bytes, res.verify_ms, res.commit_ms, res.forced_commit, untouched,
                             retry_equal, corrupted, seen.pop("poisoned", 0),
                             draft_budget(num_draft, 0, max_new_tokens - emitted_at)))
        history.extend(res.emitted_tokens)
    return steps
