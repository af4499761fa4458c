"""Shared set-up for the speculative-decoding tests: a tiny model, a prefilled request, strategies."""
from __future__ import annotations

import pytest
import torch

from kda_core.config import PRESETS
from kda_core.model import HybridCache, HybridLM
from serve.spec_decode import verify as spec_verify
from serve.spec_decode.verify import DecodeState, prefill_state

PROMPT = torch.tensor([72, 101, 108, 108, 111, 32, 75, 68, 65, 32, 115, 101, 114, 118, 101, 32, 108, 97, 98, 33])
STRATEGY_NAMES = {"snapshot": "snapshot", "projection": "projection replay", "ring": "raw-input ring",
                  "replayssm": "ReplaySSM"}  # id -> name
STRATEGY_IDS = list(STRATEGY_NAMES)


@pytest.fixture(scope="module")
def one_thread():
    """Two cores are shared by every test process: one torch thread avoids spin contention (measured
    20x slower with two threads under load). Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> HybridLM:
    return tiny_model()


@pytest.fixture(scope="module")
def start(model) -> DecodeState:
    return prefilled(model)


def make_strategy(kind: str, store_dtype: torch.dtype = torch.float32):
    """A fresh strategy from :func:`serve.spec_decode.verify.make_strategy`; the ring gets a window of 8 verify
    tokens and room for 24 (several steps)."""
    return spec_verify.make_strategy(STRATEGY_NAMES[kind], 8, 24, store_dtype)


def tiny_model() -> HybridLM:
    return HybridLM(PRESETS["demo-tiny"])


def perturbed_copy(model: HybridLM, scale: float, seed: int = 0) -> HybridLM:
    """A copy of ``model`` with seeded Gaussian noise of relative size ``scale`` on every weight: a draft model
    that agrees with the target on most but not all greedy tokens (partial accepts)."""
    gen = torch.Generator().manual_seed(seed)
    copy = HybridLM(model.cfg)
    copy.load_state_dict({k: v + scale * v.std() * torch.randn(v.shape, generator=gen) if v.numel() > 1 else v
                          for k, v in model.state_dict().items()})
    return copy


def greedy_continuation(model: HybridLM, state: DecodeState, num_tokens: int) -> tuple[list[int], list[HybridCache]]:
    """Plain greedy decoding from ``state``: the next ``num_tokens`` tokens and the cache after feeding
    ``last_token`` and then each of them (caches[j] has consumed last_token + tokens[:j])."""
    tokens, caches, cache, tok = [], [], state.cache, state.last_token
    for _ in range(num_tokens + 1):
        logits, cache = model.decode_step(torch.tensor([tok]), cache)
        caches.append(cache)
        tok = int(logits[0].argmax())
        tokens.append(tok)
    return tokens, caches


def prefilled(model: HybridLM) -> DecodeState:
    return prefill_state(model, PROMPT)

