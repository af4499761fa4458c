"""Speculative decoding on the hybrid KDA/MLA model: verify, accept, commit with projection replay.

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

:class:`ProjectionReplay` (this file) keeps no states: per KDA layer and verify token it keeps the
tensors the kernel consumed — k, v, g, beta — and the raw conv inputs, and the commit replays
``kda_step`` from the committed state over the accepted tokens. ReplaySSM (Dao AI Lab, 2026) does the
same in kind: post-projection per-step records (for a gated delta net k, the delta term and g) in a ring
plus a state checkpoint; :mod:`serve.spec.raw_input_ring` instead caches the raw layer inputs.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kda_core.kda import kda_recurrent
from kda_core.layer import KDAAux, KDACache, KDALayer
from kda_core.model import ForwardOutput, HybridCache, HybridLM
from serve.spec.draft import DraftProposer
from serve.spec.rollback import LayerShape, RollbackStrategy, conv_window_after, owned, projection_bytes_per_token


class ProjectionReplay(RollbackStrategy):
    """Per KDA layer: k, g ``[1, T, H, K]``, v ``[1, T, H, V]``, beta ``[1, T, H]``, raw ``[1, T, 2HK + HV]``."""

    name = "projection replay"
    FIELDS = ("k", "v", "g", "beta", "raw_qkv")

    def __init__(self, store_dtype: torch.dtype = torch.float32):
        super().__init__(store_dtype)
        self._store: dict[int, dict[str, torch.Tensor]] = {}

    @classmethod
    def bytes_per_token(cls, shape: LayerShape, elem_bytes: int) -> int:
        return projection_bytes_per_token(shape, elem_bytes)

    def projections(self, index: int) -> dict[str, torch.Tensor]:
        """The stored tensors of KDA layer ``index`` (k, v, g, beta, raw_qkv; ``[1, T, ...]``)."""
        return self._store[index]

    def _record_layer(self, index: int, layer: KDALayer, base: KDACache, aux: KDAAux) -> None:
        self._store[index] = {f: owned(getattr(aux, f), self.store_dtype) for f in self.FIELDS}

    def _commit_layer(self, index: int, layer: KDALayer, base: KDACache, num_tokens: int) -> KDACache:
        p = {f: t[:, :num_tokens] for f, t in self._store[index].items()}     # accepted tokens only
        # the state does not depend on q; kda_recurrent runs the same per-token _step as the verify
        _, state = kda_recurrent(torch.zeros_like(p["k"]), p["k"], p["v"], p["g"], p["beta"], base.recurrent)
        return KDACache(state, conv_window_after(base.conv, p["raw_qkv"], num_tokens))

    def _release(self) -> None:
        self._store = {}

    def _buffers(self) -> list[torch.Tensor]:
        return [t for d in self._store.values() for t in d.values()]

    def check_integrity(self) -> None:
        super().check_integrity()
        if not self._check_layer_buffers(self._store):
            return
        valid = self._valid_tokens
        for i, p in self._store.items():
            assert all(t.shape[1] == self._num_tokens for t in p.values()), f"layer {i}: wrong token count"
            assert bool((p["g"][:, :valid] <= 0).all()), f"layer {i}: log decay g must be <= 0"
            beta = p["beta"][:, :valid]
            assert bool(((beta >= 0) & (beta <= 1)).all()), f"layer {i}: beta outside [0, 1]"


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

    Each step drafts ``min(num_draft_tokens, tokens still to emit - 1)`` tokens (never emits more
    than asked). Raises ValueError for ``max_new_tokens < 1`` or ``num_draft_tokens < 0``.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be an int >= 0, got {num_draft_tokens!r}")
    state = prefill_state(model, prompt)
    history = torch.as_tensor(prompt).reshape(-1).tolist() + [state.last_token]
    out, steps = [state.last_token], []
    while len(out) < max_new_tokens:
        n = min(num_draft_tokens, max_new_tokens - len(out) - 1)
        drafts = proposer.propose(history, n)[:n]
        res = verify_and_replay(model, state, drafts, strategy)
        steps.append(StepRecord(len(steps), state.cache.num_tokens, len(drafts), res.num_accepted,
                                len(res.emitted_tokens), res.rollback_bytes, res.verify_ms, res.commit_ms,
                                res.forced_commit))
        out.extend(res.emitted_tokens)
        history.extend(res.emitted_tokens)
        state = res.state
    return SpecResult(out, state, steps)


# ---- inside the serving engine: one speculative step on a request's cache, and its draft budget ----
# The draft budget never lets the committed cache jump over the boundary where the request's end
# checkpoint goes, so the state published there is the state after the last *accepted* token at exactly
# that boundary; the engine commits the emitted tokens to the request before it publishes.

class Speculation(NamedTuple):
    """Engine speculation settings: ``proposer(prompt) -> DraftProposer`` (one per request),
    ``strategy() -> RollbackStrategy`` (one per request), ``num_draft_tokens`` n >= 0 per step."""

    proposer: Callable[[list[int]], DraftProposer]
    strategy: Callable[[], RollbackStrategy]
    num_draft_tokens: int


def draft_budget(num_draft_tokens: int, consumed: int, tokens_left: int, boundary: int | None) -> int:
    """Drafts allowed in one step: at most n; at most ``tokens_left - 1`` (a step emits accepted + 1
    tokens); and while the cache (``consumed`` tokens) is below ``boundary``, at most
    ``boundary - consumed - 1`` so the commit (at most n + 1 tokens) lands on the boundary, not past it."""
    n = min(num_draft_tokens, tokens_left - 1)
    if boundary is not None and consumed < boundary:
        n = min(n, boundary - consumed - 1)
    return max(0, n)


def speculative_step(model: HybridLM, cache: HybridCache, history: Sequence[int], proposer: DraftProposer,
                     strategy: RollbackStrategy, num_drafts: int) -> VerifyResult:
    """Draft up to ``num_drafts`` tokens after ``history`` (prompt + outputs; its last token is not yet in
    ``cache``), verify, accept greedily and commit. Returns the :class:`VerifyResult` (emitted tokens
    and their logits ``[a + 1, 256]`` fp32)."""
    drafts = proposer.propose(list(history), num_drafts)[:num_drafts]
    return verify_and_replay(model, DecodeState(cache, int(history[-1])), drafts, strategy)
