"""Speculative decoding inside the serving engine: the verify / accept / commit step of
:mod:`serve.decode` with any :class:`serve.rollback.RollbackStrategy`, and the draft budget that
keeps a commit from jumping over the request's end checkpoint boundary.

A request's cache lives in pool pages between steps; a step gathers it, verifies the drafts with
:func:`serve.decode.verify_and_replay` and writes the committed cache back. The draft budget never
lets the committed cache jump over the boundary where the request's end checkpoint goes, so the
state published there is the state after the last *accepted* token at exactly that boundary, never
a state that folded in a rejected draft. A commit may land on that boundary with accepted drafts
(a + 1 tokens consumed in one step); the engine commits the emitted tokens to the request before it
publishes, so the block keys cover exactly the consumed tokens.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kda_core.model import HybridCache, HybridLM
from serve.decode import DecodeState, VerifyResult, verify_and_replay
from serve.draft import DraftProposer
from serve.rollback import RollbackStrategy


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
