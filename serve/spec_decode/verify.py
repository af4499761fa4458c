"""Speculative decoding on the hybrid KDA/MLA model: verify, accept, commit; the one loop and strategy factory.

One speculative step (greedy; Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", with the greedy acceptance rule):

1. the proposer drafts n tokens ``d_1..d_n`` after the last committed token ``t_0``;
2. **verify**: the target runs once over ``[t_0, d_1, .., d_n]`` from the committed caches
   (``HybridLM.forward(mode="recurrent")``, bitwise equal to n + 1 single decode steps). It is pure:
   the committed caches are never mutated;
3. **accept** the longest prefix with ``d_j == argmax logits[j - 1]``, say a tokens, plus the
   **bonus** token ``argmax logits[a]`` -> a + 1 tokens are emitted;
4. **commit**: the rollback strategy builds the caches after ``t_0, d_1..d_a``; the bonus becomes
   the new last committed token.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

from kda_core.model import ForwardOutput, HybridCache, HybridLM
from serve.errors import check_choice, check_int
from serve.spec_decode.draft import DraftProposer
from serve.spec_decode.projection import ProjectionReplay
from serve.spec_decode.raw_input_ring import RawInputRing
from serve.spec_decode.replay_ssm import DEFAULT_RING_SIZE, ReplaySSM
from serve.spec_decode.rollback import RollbackStrategy
from serve.spec_decode.snapshot import SnapshotRollback


class DecodeState(NamedTuple):
    """A request between speculative steps: ``cache`` has consumed every token before ``last_token``;
    ``last_token`` (a byte id) is emitted but not yet fed to the model."""

    cache: HybridCache
    last_token: int


class VerifyResult(NamedTuple):
    """Result of :func:`verify_and_replay`.

    draft_tokens: the n drafts; target_tokens: the target's greedy token after each of the ``1 + n``
    verify tokens; num_accepted a; bonus_token = ``target_tokens[a]``; state: the new committed state;
    rollback_bytes: bytes the strategy held after recording the verify; verify_ms: forward + record
    (wall clock, ms); commit_ms: the strategy's commit (ms); forced_commit: the strategy had to commit
    older data before recording (ring write-back); logits: ``[a + 1, 256]`` fp32, row j = the verify
    forward's logits after ``[t_0, d_1..d_j]``, whose argmax is emitted token j (the accepted drafts,
    then the bonus). Rows of rejected drafts are dropped; the rows are bitwise equal to one
    :meth:`HybridLM.decode_step` per emitted token (``kda_core.invariant`` keeps every GEMM and
    pointwise op independent of the row count).
    """

    draft_tokens: tuple[int, ...]
    target_tokens: tuple[int, ...]
    num_accepted: int
    bonus_token: int
    state: DecodeState
    rollback_bytes: int
    verify_ms: float
    commit_ms: float
    forced_commit: bool
    logits: torch.Tensor

    @property
    def accepted_tokens(self) -> tuple[int, ...]:
        return self.draft_tokens[: self.num_accepted]

    @property
    def emitted_tokens(self) -> tuple[int, ...]:
        """Accepted drafts then the bonus token (a + 1 tokens)."""
        return self.accepted_tokens + (self.bonus_token,)


def _check_state(state: DecodeState) -> None:
    if not isinstance(state, DecodeState):
        raise ValueError(f"state must be a DecodeState, got {type(state).__name__}")
    if state.cache.layers and state.cache.layers[0][0].shape[0] != 1:
        raise ValueError("speculative decoding runs one request at a time: the cache batch must be 1")


def verify(model: HybridLM, state: DecodeState, draft_tokens: Sequence[int],
           num_layers: int | None = None) -> ForwardOutput:
    """The verify forward over ``[last_token, *draft_tokens]`` from ``state.cache`` (pure).

    ``num_layers`` stops part-way (a verify interrupted by preemption); its output is then discarded.
    Raises ValueError on token ids outside [0, 255] or a batch other than 1.
    """
    _check_state(state)
    tokens = torch.tensor([[state.last_token, *[int(t) for t in draft_tokens]]], dtype=torch.long)  # [1, 1+n]
    return model.forward(tokens, state.cache, mode="recurrent", output_aux=True, num_layers=num_layers)


def greedy_accept(draft_tokens: Sequence[int], target_tokens: Sequence[int]) -> int:
    """Length of the longest prefix with ``draft[j] == target[j]`` (target has one more token)."""
    if len(target_tokens) != len(draft_tokens) + 1:
        raise ValueError(f"target_tokens must have len(draft) + 1 = {len(draft_tokens) + 1} tokens, "
                         f"got {len(target_tokens)}")
    a = 0
    while a < len(draft_tokens) and int(draft_tokens[a]) == int(target_tokens[a]):
        a += 1
    return a


def verify_and_replay(model: HybridLM, state: DecodeState, draft_tokens: Sequence[int],
                      strategy: RollbackStrategy,
                      before_commit: Callable[[RollbackStrategy, int], None] | None = None) -> VerifyResult:
    """One speculative step: verify the drafts, accept greedily, commit through ``strategy``.

    Args:
        model: the target. state: committed caches + last token (batch 1). draft_tokens: n >= 0 byte
        ids (n = 0 is a plain decode step). strategy: a :class:`RollbackStrategy` with nothing recorded.
        before_commit: optional ``fn(strategy, num_accepted)`` run between accept and commit (page 02
        uses it to poison the stored data of rejected tokens).

    Returns: :class:`VerifyResult` (with the logits ``[a + 1, 256]`` fp32 of the emitted tokens);
    ``state.cache`` is never mutated.

    Raises:
        ValueError: bad tokens, batch != 1, a strategy with a pending record, or a draft longer than
        the strategy can hold (ring window).
    """
    drafts = tuple(int(t) for t in draft_tokens)
    t0 = time.perf_counter()
    out = verify(model, state, drafts)
    strategy.record(model, state.cache, out)
    held = strategy.nbytes()
    t1 = time.perf_counter()
    target = tuple(int(t) for t in out.logits[0].argmax(-1))             # [1 + n] greedy tokens
    a = greedy_accept(drafts, target)
    emitted_logits = out.logits[0, : a + 1].clone()                        # [a + 1, 256] accepted + bonus
    if before_commit is not None:
        before_commit(strategy, a)
    t2 = time.perf_counter()
    cache = strategy.commit(a)
    t3 = time.perf_counter()
    return VerifyResult(drafts, target, a, target[a], DecodeState(cache, target[a]), held,
                        (t1 - t0) * 1e3, (t3 - t2) * 1e3, strategy.forced_commit, emitted_logits)


# ---- the one speculative loop: propose -> verify_and_replay -> extend, under one draft budget ----

def draft_budget(num_draft_tokens: int, consumed: int, tokens_left: int, boundary: int | None = None) -> int:
    """Drafts allowed in one step: at most n; at most ``tokens_left - 1`` (a step emits accepted + 1
    tokens, so it never emits more than asked); and while the cache (``consumed`` tokens) is below
    ``boundary`` (the engine's end-checkpoint boundary), at most ``boundary - consumed - 1`` so the commit
    (at most n + 1 tokens) lands on the boundary, not past it: the state published there is the state
    after exactly that many accepted tokens."""
    n = min(num_draft_tokens, tokens_left - 1)
    if boundary is not None and consumed < boundary:
        n = min(n, boundary - consumed - 1)
    return max(0, n)


def speculative_step(model: HybridLM, cache: HybridCache, history: Sequence[int], proposer: DraftProposer,
                     strategy: RollbackStrategy, num_drafts: int,
                     before_verify: Callable[[DecodeState, list[int]], None] | None = None,
                     before_commit: Callable[[RollbackStrategy, int], None] | None = None) -> VerifyResult:
    """One step: draft up to ``num_drafts`` tokens after ``history`` (prompt + outputs; its last token is
    not yet in ``cache``), then :func:`verify_and_replay`. ``before_verify(state, drafts)`` runs between
    the proposal and the verify (page 02 aborts a verify there, as a preemption would);
    ``before_commit`` is passed on. Returns the :class:`VerifyResult`."""
    drafts = proposer.propose(list(history), num_drafts)[:num_drafts]
    state = DecodeState(cache, int(history[-1]))
    if before_verify is not None:
        before_verify(state, drafts)
    return verify_and_replay(model, state, drafts, strategy, before_commit)


class SpecStep(NamedTuple):
    """One step of :func:`speculate`: its index, the committed state it started from, its result
    (``result.state`` is the state after it)."""

    step: int
    before: DecodeState
    result: VerifyResult


def speculate(model: HybridLM, state: DecodeState, history: Sequence[int], proposer: DraftProposer,
              strategy: RollbackStrategy, num_draft_tokens: int, num_tokens: int,
              before_verify: Callable[[DecodeState, list[int]], None] | None = None,
              before_commit: Callable[[RollbackStrategy, int], None] | None = None) -> Iterator[SpecStep]:
    """The speculative loop: emit exactly ``num_tokens`` more tokens after ``history``, one
    :func:`speculative_step` per iteration with :func:`draft_budget` drafts, yielding each step.

    Args:
        state: committed caches and ``last_token == history[-1]`` (batch 1). history: prompt + tokens
        emitted so far. num_draft_tokens: n >= 0 drafts per step at most. num_tokens: tokens still to emit
        (>= 0). before_verify / before_commit: the experiment hooks of :func:`speculative_step`.

    Raises:
        ValueError: ``num_draft_tokens`` or ``num_tokens`` not an int >= 0, or ``history[-1]`` is not
        ``state.last_token``.
    """
    check_int("num_draft_tokens", num_draft_tokens, 0)
    check_int("num_tokens", num_tokens, 0)
    history = [int(t) for t in history]
    if not history or history[-1] != int(state.last_token):
        raise ValueError("history must end with state.last_token (emitted, not yet fed to the model)")
    step = 0
    while num_tokens > 0:
        n = draft_budget(num_draft_tokens, state.cache.num_tokens, num_tokens)
        res = speculative_step(model, state.cache, history, proposer, strategy, n, before_verify, before_commit)
        yield SpecStep(step, state, res)
        history.extend(res.emitted_tokens)
        num_tokens -= len(res.emitted_tokens)
        state, step = res.state, step + 1


class StepRecord(NamedTuple):
    """One speculative step of :func:`speculative_generate`.

    step index; position: tokens in the committed cache before the step; num_drafted n;
    num_accepted a; num_emitted a + 1; rollback_bytes held after the verify; verify_ms, commit_ms
    (wall clock); forced_commit (ring write-back before this verify).
    """

    step: int
    position: int
    num_drafted: int
    num_accepted: int
    num_emitted: int
    rollback_bytes: int
    verify_ms: float
    commit_ms: float
    forced_commit: bool

    @classmethod
    def of(cls, step: SpecStep) -> StepRecord:
        r = step.result
        return cls(step.step, step.before.cache.num_tokens, len(r.draft_tokens), r.num_accepted,
                   len(r.emitted_tokens), r.rollback_bytes, r.verify_ms, r.commit_ms, r.forced_commit)


class SpecResult(NamedTuple):
    """tokens: the ``max_new_tokens`` generated byte ids; state: final committed state (its cache
    has consumed the prompt and all generated tokens but the last, like ``HybridLM.generate``);
    steps: one :class:`StepRecord` per verify."""

    tokens: list[int]
    state: DecodeState
    steps: list[StepRecord]


def prefill_state(model: HybridLM, prompt: torch.Tensor) -> DecodeState:
    """Prefill ``prompt [T]`` (or ``[1, T]``) and take the greedy first token."""
    logits, cache = model.prefill(torch.as_tensor(prompt).reshape(1, -1))
    return DecodeState(cache, int(logits[0, -1].argmax()))


def speculative_generate(model: HybridLM, prompt: torch.Tensor, max_new_tokens: int, proposer: DraftProposer,
                         strategy: RollbackStrategy, num_draft_tokens: int) -> SpecResult:
    """Greedy generation of ``max_new_tokens`` with speculation; output equals ``model.generate``.

    Prefill, then :func:`speculate` for the other ``max_new_tokens - 1`` tokens. Raises ValueError for
    ``max_new_tokens < 1`` or ``num_draft_tokens < 0``.
    """
    check_int("max_new_tokens", max_new_tokens)
    state = prefill_state(model, prompt)
    history = torch.as_tensor(prompt).reshape(-1).tolist() + [state.last_token]
    out, steps = [state.last_token], []
    for step in speculate(model, state, history, proposer, strategy, num_draft_tokens, max_new_tokens - 1):
        steps.append(StepRecord.of(step))
        out.extend(step.result.emitted_tokens)
        state = step.result.state
    return SpecResult(out, state, steps)


# ---- the one strategy factory, and the engine's speculation settings ----

STRATEGIES: dict[str, type[RollbackStrategy]] = {s.name: s for s in (SnapshotRollback, ProjectionReplay, RawInputRing,
                                                                              ReplaySSM)}


def make_strategy(name: str, window: int, capacity: int | None = None,
                  store_dtype: torch.dtype = torch.float32) -> RollbackStrategy:
    """A fresh rollback strategy by display name (a key of ``STRATEGIES``).

    Args:
        name: ``"snapshot"``, ``"projection replay"``, ``"raw-input ring"`` or ``"ReplaySSM"``.
        window: the longest verify (1 + n drafts, tokens) it must roll back; the rings' rollback window.
        capacity: ring slots; raw-input ring: default ``window`` (room for exactly one verify); ReplaySSM:
            records per layer, default ``max(16, window)`` (SGLang's default ring length).
        store_dtype: dtype of the stored buffers (fp32 keeps the commit bitwise exact).

    Raises:
        ValueError: an unknown name, ``window`` not an int >= 1, or (rings) ``capacity < window``.
    """
    check_choice("strategy", name, tuple(STRATEGIES))
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1 (verify tokens), got {window!r}")
    if name == RawInputRing.name:
        return RawInputRing(window if capacity is None else capacity, window, store_dtype)
    if name == ReplaySSM.name:
        return ReplaySSM(max(DEFAULT_RING_SIZE, window) if capacity is None else capacity, window, store_dtype)
    return STRATEGIES[name](store_dtype)


class Speculation(NamedTuple):
    """Engine speculation settings: ``proposer(prompt) -> DraftProposer`` (one per request),
    ``strategy() -> RollbackStrategy`` (one per request), ``num_draft_tokens`` n >= 0 per step."""

    proposer: Callable[[list[int]], DraftProposer]
    strategy: Callable[[], RollbackStrategy]
    num_draft_tokens: int

    @classmethod
    def named(cls, proposer: Callable[[list[int]], DraftProposer], strategy: str, num_draft_tokens: int,
              capacity: int | None = None, store_dtype: torch.dtype = torch.float32) -> Speculation:
        """Settings whose strategies come from :func:`make_strategy` with a window of one verify
        (``1 + num_draft_tokens``). Raises ValueError as :func:`make_strategy` does, at once."""
        make_strategy(strategy, num_draft_tokens + 1, capacity, store_dtype)
        return cls(proposer, functools.partial(make_strategy, strategy, num_draft_tokens + 1, capacity, store_dtype),
                   num_draft_tokens)

    def snapshot_slots(self) -> int | None:
        """k + 1 state slots per request for snapshot speculation of k drafts stored in fp32 (the verify row
        writes the state after each token into one by index; vLLM's speculative Mamba blocks), else None."""
        strategy = self.strategy()
        if isinstance(strategy, SnapshotRollback) and strategy.store_dtype == torch.float32:
            return self.num_draft_tokens + 1
        return None
