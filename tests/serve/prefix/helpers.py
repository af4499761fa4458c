"""Shared set-up for the prefix-cache and engine tests: a tiny model, the cache-off reference, engines."""
from __future__ import annotations

import functools

import torch

from kda_core.config import PRESETS
from kda_core.model import HybridLM
from serve.config import ServeConfig
from serve.engine import ServeEngine
from serve.memory.pages import zero_state
from serve.memory.pool import PageKind, PagePool
from serve.prefix.cache import PrefixCache

LOGITS_ATOL = 1e-5   # "equal": greedy tokens identical and logits within this of the cache-off run


@functools.cache
def tiny_model() -> HybridLM:
    return HybridLM(PRESETS["demo-tiny"])


def tokens(seed: int, n: int) -> list[int]:
    """``n`` seeded random byte ids."""
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@functools.cache
def _reference(prompt: tuple, max_new_tokens: int) -> tuple[tuple, torch.Tensor]:
    model = tiny_model()
    logits, cache = model.prefill(torch.tensor([prompt]))
    rows = [logits[0, -1]]
    out = [int(rows[-1].argmax())]
    for _ in range(max_new_tokens - 1):
        step, cache = model.decode_step(out[-1], cache)
        rows.append(step[0])
        out.append(int(step[0].argmax()))
    return tuple(out), torch.stack(rows)


def reference(prompt, max_new_tokens: int) -> tuple[tuple, torch.Tensor]:
    """Cache-off greedy run straight on the model: (tokens, logits ``[max_new_tokens, 256]``)."""
    return _reference(tuple(prompt), max_new_tokens)


def max_logit_error(result, prompt) -> float:
    """max |logits - reference| of a finished result (inf if the tokens differ)."""
    ref_tokens, ref_logits = reference(prompt, len(result.output_tokens))
    if result.output_tokens != ref_tokens:
        return float("inf")
    return float((result.logits - ref_logits).abs().max())


def assert_equal_to_reference(result, prompt) -> None:
    err = max_logit_error(result, prompt)
    assert err <= LOGITS_ATOL, f"request {result.rid}: max |logits - cache-off| = {err} (hit {result.hit_tokens})"


def make_engine(block_size: int = 16, interval: int = 16, num_groups: int = 1, num_pages: int = 64,
                policy: str = "unified", max_checkpoints: int | None = None, cache: bool = True,
                max_prefill_chunk: int | None = None) -> ServeEngine:
    """An engine on a poisoned pool (never-written pages read as NaN) with an optional prefix cache."""
    model = tiny_model()
    config = ServeConfig(block_size, interval, num_groups, policy)
    pool = PagePool(num_pages, config.page_bytes(model.cfg), poison=True)
    pc = PrefixCache(pool, config, cfg=model.cfg, max_checkpoints=max_checkpoints) if cache else None
    return ServeEngine(model, pool, pc, max_prefill_chunk, config=config)


def run_checked(engine: ServeEngine, prompt, max_new_tokens: int = 3):
    """Submit one request, step to idle calling ``check_integrity`` after every step; the result."""
    rid = engine.submit(prompt, max_new_tokens, record_logits=True)
    engine.check_integrity()
    while engine.step():
        engine.check_integrity()
    engine.check_integrity()
    return engine.result(rid)


def make_cache(num_pages=64, block_size=4, groups=1, interval=4, max_checkpoints=None, policy="unified"):
    """A PrefixCache on a poisoned pool of ``num_pages`` pages (never-written pages read as NaN)."""
    cfg = PRESETS["demo-tiny"]
    config = ServeConfig(block_size, interval, groups, policy)
    pool = PagePool(num_pages, config.page_bytes(cfg), poison=True)
    return PrefixCache(pool, config, cfg=cfg, max_checkpoints=max_checkpoints)


def insert_prefix(cache, seq, num_blocks, boundaries, owner="w"):
    """Publish ``num_blocks`` blocks of ``seq`` and checkpoints at ``boundaries`` (in blocks) as a request
    would; returns the boundaries that were published."""
    lay = cache.layout
    keys = cache.keys(seq)
    kv = cache.alloc(PageKind.MLA_KV, num_blocks, owner)
    state = cache.alloc(PageKind.KDA_STATE, lay.state_pages, owner)
    split, start = [], 0
    for g in range(lay.num_groups):
        split.append(tuple(state[start: start + lay.group_pages(g)]))
        start += lay.group_pages(g)
    zero_state(lay, cache.pool, split)
    cache.publish_blocks(keys, kv, num_blocks, owner)
    done = [b for b in boundaries if cache.publish_checkpoint(keys, b, split, b * cache.block_size, owner)]
    cache.release(owner)
    cache.pool.decref(kv + state, owner)
    return done
