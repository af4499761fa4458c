"""Draft proposers for speculative decoding: prompt lookup (n-gram), a draft model, a seeded noisy oracle.

A proposer sees the token history (prompt + every emitted token, in order) and proposes up to
``num_tokens`` draft tokens that the target model then verifies (``serve.spec_decode.verify``).

- :class:`NgramProposer` — prompt-lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's
  ``NgramProposer`` with ``prompt_lookup_min/max``, SGLang's n-gram speculator): find the earliest
  occurrence of the history's last n tokens (n from ``max_ngram`` down to ``min_ngram``)
  and propose the tokens that followed it. No model, no training.
- :class:`NoisyOracleProposer` — proposes the target's own greedy continuation with each token
  replaced by a different token with probability ``corrupt_prob`` (seeded), so a page can set the
  acceptance rate with a slider: a draft token is accepted with probability ``1 - corrupt_prob``
  given that all earlier drafts of the step were accepted.
- :class:`DraftModelProposer` — a small model of the same byte vocabulary drafts its own greedy
  continuation (Leviathan et al. 2023; vLLM's ``draft_model`` speculative method). It keeps its own
  cache and rolls it back after a partial accept by keeping a snapshot after every draft token.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from kda_core.model import HybridCache, HybridLM
from serve.errors import check_int


def _check_request(history: Sequence[int], num_tokens: int) -> None:
    check_int("num_tokens", num_tokens, 0)
    if len(history) == 0:
        raise ValueError("history must hold at least one token (the prompt)")


class DraftProposer(ABC):
    """Proposes draft tokens from the token history. May return fewer than asked (even none)."""

    name: str = "proposer"

    @abstractmethod
    def propose(self, history: Sequence[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` byte ids continuing ``history`` (prompt + emitted tokens).

        Raises:
            ValueError: ``num_tokens < 0`` or an empty history.
        """


class NgramProposer(DraftProposer):
    """Prompt lookup: copy what followed the earliest earlier occurrence of the last n-gram.

    Args:
        max_ngram / min_ngram: n-gram lengths tried, longest first.

    Raises:
        ValueError: ``min_ngram < 1`` or ``max_ngram < min_ngram``.
    """

    name = "n-gram (prompt lookup)"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        check_int("min_ngram", min_ngram)
        if not isinstance(max_ngram, int) or max_ngram < min_ngram:
            raise ValueError(f"max_ngram must be an int >= min_ngram = {min_ngram}, got {max_ngram!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, history: Sequence[int], num_tokens: int) -> list[int]:
        _check_request(history, num_tokens)
        hist = [int(t) for t in history]
        if num_tokens == 0:
            return []
        for n in range(min(self.max_ngram, len(hist) - 1), self.min_ngram - 1, -1):
            suffix = hist[-n:]
            # earliest start i < len - n whose n tokens equal the suffix (the suffix itself excluded):
            # inside a repeated run the earliest match leaves the longest continuation to copy
            for i in range(len(hist) - n):
                if hist[i: i + n] == suffix:
                    return hist[i + n: i + n + num_tokens]
        return []


class NoisyOracleProposer(DraftProposer):
    """The target's greedy continuation of ``prompt``, each token corrupted with probability p.

    ``reference`` is the target's greedy output for the prompt (``HybridLM.generate``); since greedy
    speculative decoding emits exactly that sequence, the history is always ``prompt + reference[:i]``.
    A corrupted token is replaced by a uniformly drawn *different* byte. Draws come from one
    ``random.Random(seed)`` stream, so a run is reproducible.

    Raises:
        ValueError: ``corrupt_prob`` outside [0, 1]; a history that is not ``prompt + reference[:i]``.
    """

    name = "noisy oracle"

    def __init__(self, prompt: Sequence[int], reference: Sequence[int], corrupt_prob: float, seed: int = 0):
        if not 0.0 <= float(corrupt_prob) <= 1.0:
            raise ValueError(f"corrupt_prob must be in [0, 1], got {corrupt_prob!r}")
        self.prompt = [int(t) for t in prompt]
        self.reference = [int(t) for t in reference]
        self.corrupt_prob = float(corrupt_prob)
        self._rng = random.Random(seed)

    @classmethod
    def from_model(cls, model: HybridLM, prompt: torch.Tensor, max_new_tokens: int, corrupt_prob: float,
                   seed: int = 0) -> NoisyOracleProposer:
        """Build from the target's own greedy generation of ``max_new_tokens`` after ``prompt [T]``."""
        reference, _ = model.generate(prompt.reshape(1, -1), max_new_tokens)
        return cls(prompt.reshape(-1).tolist(), reference[0].tolist(), corrupt_prob, seed)

    def propose(self, history: Sequence[int], num_tokens: int) -> list[int]:
        _check_request(history, num_tokens)
        hist = [int(t) for t in history]
        n_prompt = len(self.prompt)
        if hist[:n_prompt] != self.prompt or hist[n_prompt:] != self.reference[: len(hist) - n_prompt]:
            raise ValueError("history must be the prompt followed by a prefix of the oracle's reference")
        out = []
        for tok in self.reference[len(hist) - n_prompt: len(hist) - n_prompt + num_tokens]:
            if self._rng.random() < self.corrupt_prob:
                tok = (tok + 1 + self._rng.randrange(255)) % 256        # any byte but the right one
            out.append(tok)
        return out


class DraftModelProposer(DraftProposer):
    """A draft model's greedy continuation of the history, with the draft model's own cache.

    State: ``tokens`` (the history the committed draft cache has consumed) and that cache. ``propose``
    first brings the cache up to the new history, then drafts ``num_tokens`` greedily, keeping the cache
    after each draft token: ``snapshots[j]`` has consumed ``tokens + drafts[:j]`` (j = 0..n - 1; the last
    draft is never fed). Rollback after a partial accept: the next history is ``tokens + drafts[:a] +
    [bonus, ...]``; the proposer resumes from ``snapshots[min(a, n - 1)]`` (the cache after exactly the
    accepted drafts, never one that holds a rejected token) and feeds the remaining committed tokens in
    recurrent mode. The snapshots are immutable :class:`HybridCache` values (every model call returns a new
    one), so keeping them costs no copy, and the other snapshots are dropped.

    Exactness contract (tested bitwise): the committed cache always equals a chunk-mode prefill of the first
    history the proposer saw, followed by one ``decode_step`` per later committed token; the drafts equal the
    draft model's greedy tokens from that cache. A history that does not extend the committed one (another
    request, an edited prompt) starts over with a prefill. ``num_fed`` counts draft-model tokens run (the
    drafting cost, for benchmarks).

    Raises:
        TypeError: ``model`` is not a :class:`HybridLM`.
    """

    name = "draft model"

    def __init__(self, model: HybridLM):
        if not isinstance(model, HybridLM):
            raise TypeError(f"model must be a HybridLM, got {type(model).__name__}")
        self.model = model
        self.tokens: list[int] = []
        self.cache: HybridCache | None = None
        self._drafts: list[int] = []
        self._snapshots: list[tuple[HybridCache, torch.Tensor]] = []   # (cache, logits [256]) per draft
        self._logits: torch.Tensor | None = None          # [256] logits after ``tokens`` (drafts d_1)
        self.num_fed = 0

    def _advance(self, hist: list[int]) -> None:
        """Bring the committed cache from ``self.tokens`` to ``hist`` (an extension, or a fresh start)."""
        n_old = len(self.tokens)
        if self.cache is not None and hist == self.tokens:
            return                                        # same history again: cache and logits are current
        if self.cache is None or len(hist) < n_old or hist[:n_old] != self.tokens:
            logits, self.cache = self.model.prefill(torch.tensor([hist], dtype=torch.long))   # [1, T, 256]
            self.tokens, self._logits, self.num_fed = list(hist), logits[0, -1], self.num_fed + len(hist)
            self._drafts, self._snapshots = [], []
            return
        new = hist[n_old:]
        # rollback: the longest accepted draft prefix with a snapshot (snapshot j has consumed drafts[:j])
        a = 0
        while a < min(len(new), len(self._snapshots) - 1) and new[a] == self._drafts[a]:
            a += 1
        cache, logits = self._snapshots[a] if self._snapshots else (self.cache, self._logits)
        for tok in new[a:]:                               # the bonus token and anything after it
            step_logits, cache = self.model.decode_step(tok, cache)           # [1, 256]
            logits = step_logits[0]
        self.num_fed += len(new) - a
        self.cache, self._logits, self.tokens = cache, logits, list(hist)
        self._drafts, self._snapshots = [], []

    def propose(self, history: Sequence[int], num_tokens: int) -> list[int]:
        _check_request(history, num_tokens)
        self._advance([int(t) for t in history])
        cache, logits = self.cache, self._logits
        drafts, snapshots = [], [(cache, logits)]
        for j in range(num_tokens):
            drafts.append(int(logits.argmax()))
            if j + 1 < num_tokens:                        # the last draft is not fed: nothing drafts after it
                step_logits, cache = self.model.decode_step(drafts[-1], cache)  # [1, 256]
                logits = step_logits[0]
                snapshots.append((cache, logits))
                self.num_fed += 1
        self._drafts, self._snapshots = drafts, snapshots
        return drafts
