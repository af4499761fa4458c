"""Per-request sampling: ``SamplingParams`` (temperature, top-k, top-p, seed) and :func:`sample_token`.

The engine picks each request's next token from that row's logits ``[256]`` (fp32) after the forward: greedy
(argmax) at temperature 0, else a draw from ``softmax(logits / temperature)`` cut to the ``top_k`` most likely
tokens, then to the top-p nucleus of what is left (Holtzman et al. 2019, "The Curious Case of Neural Text
Degeneration", arXiv:1904.09751), in the order of vLLM's ``vllm/v1/sample/ops/topk_topp_sampler.py``
(``apply_top_k_top_p``: top-k first, then the smallest set of most likely tokens whose renormalised probability
reaches ``top_p``). ``top_k`` follows vLLM's ``SamplingParams``: 0 or -1 disable it, any other value must be >= 1.
Each request owns a ``torch.Generator`` seeded with its ``seed`` (a fresh random seed when
None) and draws one number per token in order, and a row's logits do not depend on its neighbours (batch
invariance), so a seeded request emits the same tokens in any batch as alone.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import torch

MAX_TEMPERATURE = 2.0                       # the OpenAI API's range for temperature: [0, 2]
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1      # a 64-bit signed int, vLLM's bounds (torch.iinfo(torch.long))
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny   # 1.18e-38: smaller temperatures are sampled at it (the greedy limit)


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` in [0, 2] (0: greedy), ``top_p`` in (0, 1], ``seed``: an int in [-2**63, 2**63 - 1] (a
    64-bit signed int, as vLLM bounds it) or None (a random one), ``top_k``: an int, 0 or -1 (off) or >= 1 (keep
    the k most likely tokens; k >= the vocabulary keeps all). top-k and top-p do not change a greedy argmax, so
    any valid value is accepted at temperature 0. Raises ValueError naming the field for a value out of range,
    TypeError for a wrong type."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(v).__name__}")
            if not math.isfinite(v):
                raise ValueError(f"{name} must be finite, got {v}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a 64-bit signed int in [-2**63, 2**63 - 1], got {self.seed}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise TypeError(f"top_k must be an int, got {type(self.top_k).__name__}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off), or at least 1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def seeded(self) -> SamplingParams:
        """These params with a seed: a fresh random one when ``seed`` is None and not greedy (so a request
        preempted and recomputed draws the same tokens again)."""
        if self.greedy or self.seed is not None:
            return self
        return replace(self, seed=random.SystemRandom().randrange(2**63))

    def generator(self) -> torch.Generator | None:
        """A CPU generator at ``seed``'s start (None when greedy: nothing is drawn). Call on :meth:`seeded`
        params; raises ValueError when sampling without a seed."""
        if self.greedy:
            return None
        if self.seed is None:
            raise ValueError("generator() needs a seed: call seeded() first")
        return torch.Generator().manual_seed(self.seed)


GREEDY = SamplingParams()


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from one row's ``logits`` ``[V]`` (fp32): argmax when greedy, else one draw with
    ``generator`` from the temperature-scaled softmax cut to the ``top_k`` most likely tokens (ties with the
    k-th kept, as vLLM keeps them) and then to the top-p nucleus (the most likely token always stays in).

    Total over :class:`SamplingParams`: the logits are shifted by their maximum before the division
    (softmax is shift-invariant), so ``(logits - max) / temperature`` is 0 at the argmax and at most 0
    elsewhere, and its softmax is finite whatever the temperature; a temperature below the smallest
    normal fp32 (:data:`MIN_TEMPERATURE`, 1.18e-38: subnormals, or values fp32 rounds to 0) is sampled at
    it, where every token whose logit is below the maximum has probability 0 (up to logits within ~1e-38
    of it) — the greedy limit, ties split evenly. ``top_p`` compares in fp32, where a tiny ``top_p``
    rounds to 0: the most likely token is kept explicitly. Raises ValueError for logits that are not one
    finite row."""
    if logits.dim() != 1:
        raise ValueError(f"logits must be one row [V], got shape {tuple(logits.shape)}")
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"logits must be finite, got {int((~torch.isfinite(logits)).sum())} NaN/inf value(s)")
    if params.greedy:
        return int(logits.argmax())
    logits = logits.float()
    gap = logits - logits.max()                                   # [V] <= 0, 0 at the argmax (-inf on overflow)
    scaled = gap / max(params.temperature, MIN_TEMPERATURE)                                   # [V]
    if 0 < params.top_k < scaled.numel():
        kth = scaled.topk(params.top_k).values[-1]                                            # the k-th largest
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)                                                     # [V]
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)                                         # [V], [V]
        outside = sorted_p.cumsum(-1) - sorted_p >= params.top_p       # the mass before a token already reaches p
        outside[0] = False                                             # the most likely token stays in
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)                          # [V]
    return int(torch.multinomial(probs, 1, generator=generator))
