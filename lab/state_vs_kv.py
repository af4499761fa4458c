"""Live decode-cost measurements on this CPU (page 03, chart 2).

Per decoded token and layer: one :func:`kda_core.kda.kda_step` (constant work: H K V state
update) against one absorbed MLA decode over a latent cache of N tokens
(:func:`kda_core.layer.latent_attention`, linear in N). Real head dims (K = V = 128, latent
r + rope = 576) with the number of heads scaled down (``num_heads``) so a sweep stays under a
second; the page says so. Each time is the minimum over ``repeats`` back-to-back runs of that one
operation (ns clock, in microseconds): on a shared CPU, contention only ever adds time, so the
least-disturbed run is the cost of the work (a median still let 100 ms stalls through on a loaded
2-core machine). The two operations are timed apart, not interleaved: interleaving let the MLA pass
over N latents evict the KDA state from the CPU cache, so the KDA time grew with N (3.4x at 16k,
found in review) although its work does not. Runs use one torch thread.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from kda_core.config import ModelConfig
from kda_core.kda import kda_step
from kda_core.layer import latent_attention


class DecodeCost(NamedTuple):
    """One context length: measured microseconds per decoded token for one layer (min of runs)."""

    context_tokens: int
    kda_step_us: float
    mla_decode_us: float


def _min_us(fn, repeats: int) -> float:
    """Minimum time in µs of ``fn`` over ``repeats`` back-to-back runs (after one warm-up run)."""
    fn()  # warm-up (allocations, kernel selection, cache)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        best = min(best, (time.perf_counter_ns() - t0) / 1e3)
    return best


def measure_decode_cost(cfg: ModelConfig, contexts: list[int], num_heads: int = 4, repeats: int = 7,
                        seed: int = 0) -> list[DecodeCost]:
    """Measure per-token decode time of one KDA layer step vs one MLA decode at each context.

    Args:
        cfg: model config (head dims K, V and latent width r + rope come from it).
        contexts: context lengths N in tokens (each >= 1, at most 262,144).
        num_heads: heads used for both layers in the measurement (scaled down from the real model).
        repeats: timed rounds per point (the minimum is reported).

    Returns: list of :class:`DecodeCost`, one per context, in input order.

    Raises: ValueError on empty/out-of-range contexts or non-positive heads/repeats.
    """
    if not contexts or any((not isinstance(n, int)) or n < 1 or n > 262_144 for n in contexts):
        raise ValueError(f"contexts must be ints in [1, 262144], got {contexts}")
    if num_heads < 1 or repeats < 1:
        raise ValueError(f"num_heads and repeats must be >= 1, got {num_heads}, {repeats}")
    gen = torch.Generator().manual_seed(seed)
    H, K, V, r = num_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.kv_lora_rank
    q = torch.nn.functional.normalize(torch.randn(1, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, H, K, generator=gen), dim=-1)
    v = torch.randn(1, H, V, generator=gen)
    g = -torch.rand(1, H, K, generator=gen) * 0.1
    beta = torch.rand(1, H, generator=gen)
    state = torch.randn(1, H, K, V, generator=gen)
    q_cat = torch.randn(1, H, cfg.latent_dim, generator=gen)
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    out = []
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n in contexts:
            cache = torch.randn(1, n, cfg.latent_dim, generator=gen)    # [1, N, r + rope]
            mla_us = _min_us(lambda c=cache: latent_attention(q_cat, c, r, scale), repeats)
            kda_us = _min_us(lambda: kda_step(q, k, v, g, beta, state), repeats)  # re-measured at every N
            out.append(DecodeCost(n, kda_us, mla_us))
    finally:
        torch.set_num_threads(prev_threads)
    return out
