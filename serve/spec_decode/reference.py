"""Independent references for the rollback strategies (obviously right, slow; tests and page 02 use them).

- :func:`sequential_decode`: plain greedy decoding, one ``HybridLM.decode_step`` per token — the
  ground truth every committed cache must equal bitwise.
- :func:`greedy_decode`: the target's own greedy tokens from a state, one ``decode_step`` per token, with
  the cache after each fed token: the reference tokens and the reference caches of one run, computed once.
- :func:`closed_form_states`: the KDA state as a closed-form sum instead of a recurrence,
  ``S_h = diag(exp(G_h)) S_0 + sum_{j <= h} diag(exp(G_h - G_j)) k_j u_j^T`` with ``G_h = sum_{i <= h} g_i``
  and ``u_j = beta_j (v_j - S'_j^T k_j)`` the per-token delta correction (Kimi Linear, arXiv:2510.26692,
  the unrolled delta rule). Computed in fp64, so it agrees with the fp32 replay to rounding (~1e-7).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kda_core.kda import kda_step_with_correction
from kda_core.layer import KDACache
from kda_core.model import HybridCache, HybridLM


def sequential_decode(model: HybridLM, cache: HybridCache, tokens: Sequence[int]) -> list[HybridCache]:
    """Caches after each of ``tokens`` fed one ``decode_step`` at a time from ``cache`` (batch 1)."""
    out = []
    for t in tokens:
        _, cache = model.decode_step(torch.tensor([int(t)]), cache)
        out.append(cache)
    return out


class GreedyRun(NamedTuple):
    """tokens: ``num_tokens`` greedy token ids, ``tokens[0]`` the given first token; caches: ``num_tokens - 1``
    caches, ``caches[i]`` = the start cache after feeding ``tokens[0 .. i]`` (the last token is not fed)."""

    tokens: list[int]
    caches: list[HybridCache]


def greedy_decode(model: HybridLM, cache: HybridCache, first_token: int, num_tokens: int) -> GreedyRun:
    """Plain greedy decoding from ``cache`` (batch 1) whose next token is ``first_token``: feed each token with
    one ``decode_step`` and take the argmax as the next. From a prompt's prefill and its greedy first token,
    ``tokens`` is ``model.generate(prompt, num_tokens)`` and ``caches`` are :func:`sequential_decode` of those
    tokens, bitwise (the same calls). Raises ValueError for ``num_tokens < 1``."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
    tokens, caches = [int(first_token)], []
    for _ in range(num_tokens - 1):
        logits, cache = model.decode_step(torch.tensor([tokens[-1]]), cache)   # logits [1, 256]
        caches.append(cache)
        tokens.append(int(logits[0].argmax()))
    return GreedyRun(tokens, caches)


def clone_cache(cache: HybridCache) -> HybridCache:
    """A deep copy of ``cache`` (to prove later that a call left the original untouched)."""
    return HybridCache(tuple(KDACache(x.recurrent.clone(), x.conv.clone()) if isinstance(x, KDACache) else x.clone()
                             for x in cache.layers), cache.num_tokens)


def cache_max_abs_diff(a: HybridCache, b: HybridCache) -> float:
    """Largest ``|a - b|`` over every KDA state, conv state and MLA latent; inf if the shapes or token
    counts differ (a cache holding a rejected token must never read as close)."""
    if a.num_tokens != b.num_tokens or len(a.layers) != len(b.layers):
        return float("inf")
    worst = 0.0
    for x, y in zip(a.layers, b.layers):
        pairs = zip(x, y) if isinstance(x, KDACache) else [(x, y)]
        for s, t in pairs:
            if s.shape != t.shape:
                return float("inf")
            if s.numel():
                worst = max(worst, float((s.double() - t.double()).abs().max()))
    return worst


def corrections(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the recurrence with :func:`kda_step_with_correction` and return (states, u).

    Args: state ``[B, H, K, V]``; k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``.
    Returns: states ``[B, T, H, K, V]`` (after each token) and u ``[B, T, H, V]`` (fp32).
    """
    states, us = [], []
    for t in range(k.shape[1]):
        kt = k[:, t].contiguous()
        _, state, u = kda_step_with_correction(torch.zeros_like(kt), kt, v[:, t].contiguous(),
                                               g[:, t].contiguous(), beta[:, t].contiguous(), state)
        states.append(state)
        us.append(u)
    return torch.stack(states, dim=1), torch.stack(us, dim=1)


def closed_form_states(state: torch.Tensor, k: torch.Tensor, u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``S_h`` for every h by the closed form (fp64), from recorded k, u and log decays g.

    Args: state ``[B, H, K, V]`` (S_0); k, g ``[B, T, H, K]``; u ``[B, T, H, V]``.
    Returns: ``[B, T, H, K, V]`` fp64, ``[:, h]`` = state after token h.
    """
    S0, k, u, g = (x.double() for x in (state, k, u, g))
    G = g.cumsum(dim=1)                                                  # [B, T, H, K]
    out = []
    for h in range(k.shape[1]):
        decay = (G[:, h: h + 1] - G[:, : h + 1]).exp()                   # [B, h+1, H, K], all <= 1
        writes = torch.einsum("bjhk,bjhv->bhkv", decay * k[:, : h + 1], u[:, : h + 1])  # [B, H, K, V]
        out.append(G[:, h].exp().unsqueeze(-1) * S0 + writes)            # [B, H, K, V]
    return torch.stack(out, dim=1)                                       # [B, T, H, K, V]
