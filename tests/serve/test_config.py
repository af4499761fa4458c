"""ServeConfig: validation, the placement rule, one layout, and the engine / cache / replay sharing it."""
from __future__ import annotations

import pytest

from kda_core.config import PRESETS
from serve.config import ServeConfig
from serve.engine import ServeEngine
from serve.memory.pool import PagePool
from serve.prefix.cache import PrefixCache
from serve.prefix.index import PrefixIndex
from serve.prefix.sim import TraceReplayConfig, replay_trace
from serve.traces.mooncake import TraceRequest
from tests.serve.prefix.helpers import insert_prefix, make_cache, make_engine, tiny_model, tokens

CFG = PRESETS["demo-tiny"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=0), "block_size"), (dict(block_size=True), "block_size"),
    (dict(num_groups=0), "num_groups"), (dict(checkpoint_interval=-16), "checkpoint_interval"),
    (dict(block_size=16, checkpoint_interval=24), "multiple of block_size=16"),
    (dict(page_policy="bogus"), "page_policy"),
])
def test_bad_fields_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServeConfig(**kwargs)


def test_frozen_and_derived():
    cfg = ServeConfig(16, 64, 2, "unified")
    with pytest.raises(AttributeError):
        cfg.block_size = 32
    lay = cfg.layout(CFG)
    assert (lay.block_size, lay.num_groups, lay.page_bytes) == (16, 2, cfg.page_bytes(CFG))
    with pytest.raises(ValueError, match="num_groups"):
        ServeConfig(num_groups=CFG.num_kda_layers + 1).layout(CFG)


def test_placement_rule():
    """Multiples of C, the replay boundary floor((L-1)/N) N and the prompt end floor(L/N) N."""
    cfg = ServeConfig(16, 32)
    assert cfg.prefill_checkpoints(100) == [32, 64, 96]
    assert cfg.prefill_checkpoints(96) == [32, 64, 80, 96]        # L on a block: the replay boundary is 80
    assert cfg.prefill_checkpoints(40) == [32]
    assert cfg.prefill_checkpoints(10) == []
    assert cfg.final_checkpoint(40, 60) == 48 and cfg.final_checkpoint(40, 45) is None


def test_values_are_stored_once():
    """The cache reads N and G from its config (no copies to drift), the index gets the config's G,
    and the engine takes the cache's config and layout."""
    eng = make_engine(block_size=16, interval=32, num_groups=2, policy="multi_page")
    cache = eng.cache
    assert eng.config is cache.config and eng.layout is cache.layout
    assert (cache.block_size, cache.num_groups, cache.index.num_groups) == (16, 2, 2)
    assert not {"block_size", "num_groups", "checkpoint_interval"} & set(vars(cache))
    with pytest.raises(AttributeError):
        cache.index.num_groups = 3


def test_engine_rejects_a_config_other_than_its_cache():
    """The engine used to ignore ``block_size=`` whenever a cache was passed; now a disagreeing config raises."""
    model, cfg = tiny_model(), ServeConfig(16, 16, page_policy="unified")
    pool = PagePool(16, cfg.page_bytes(model.cfg))
    cache = PrefixCache(pool, cfg, cfg=model.cfg)
    with pytest.raises(ValueError, match="differs from the prefix cache"):
        ServeEngine(model, pool, cache, config=ServeConfig(32, 32, page_policy="unified"))
    assert ServeEngine(model, pool, cache, config=ServeConfig(16, 16, page_policy="unified")).config is cfg
    with pytest.raises(ValueError, match="ServeConfig"):
        PrefixCache(pool, 16, cfg=model.cfg)


def test_cache_and_replay_share_one_lookup_walk(monkeypatch):
    """A mutant of :meth:`PrefixIndex.walk` (never a hit) reaches both the page-backed cache and the trace
    replay: neither re-implements the lookup."""
    cache = make_cache(block_size=4, interval=4)
    seq = list(range(1, 14))
    insert_prefix(cache, seq, 3, [1, 2, 3])
    req = TraceRequest(0, 13, 1, (1, 2, 3, 4))
    config = TraceReplayConfig(ServeConfig(4, 4), 1, (1,))
    assert cache.lookup(seq).num_tokens == 12 and replay_trace([req, req], config).hit_tokens == 12
    original = PrefixIndex.walk
    monkeypatch.setattr(PrefixIndex, "walk", lambda self, *a, **k: original(self, *a, **k)._replace(hit_blocks=0))
    assert cache.lookup(seq).num_tokens == 0 and replay_trace([req, req], config).hit_tokens == 0
    assert [s for s in cache.explain(seq) if s.phase == 2 and s.found]        # explain walks the same path


def test_explain_agrees_with_lookup():
    """explain is the lookup's own walk: its last phase-2 step is the hit, its phase-1 run the KV tokens."""
    cache = make_cache(block_size=4, interval=4, groups=2, num_pages=80)
    base = tokens(5, 24)
    insert_prefix(cache, base, 6, [2, 5])
    for n in (1, 3, 4, 5, 8, 9, 20, 21, 24, 25):
        prompt = (base + tokens(6, 4))[:n]
        hit, steps = cache.lookup(prompt), cache.explain(prompt)
        found = [s.boundary for s in steps if s.phase == 2 and s.found]
        assert (found[-1] if found else 0) == hit.num_tokens
        cached = [s for s in steps if s.phase == 1 and s.note == "KV block cached"]
        assert len(cached) == hit.kv_tokens // 4
