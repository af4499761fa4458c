"""The trace replay's cache (:class:`serve.prefix.sim.ReplayCache`: its path insertion and byte-budget
eviction) against the list oracle :class:`serve.prefix.reference.PrefixOracle`, request by request."""
from __future__ import annotations

import pytest

from serve.config import ServeConfig
from serve.prefix.index import EntryKind
from serve.prefix.reference import PrefixOracle
from serve.prefix.sim import ReplayCache, TraceReplayConfig
from serve.traces.mooncake import synthesize


def _oracle_step(oracle: PrefixOracle, r, serving: ServeConfig) -> int:
    """The replay's rules on the oracle, one hash id = one oracle token (prefix of ids = chained key):
    the hit (blocks), then refresh it, insert the prompt's blocks, publish the checkpoints past it."""
    N, ids, L = serving.block_size, tuple(r.hash_ids), r.input_length
    cap = (L - 1) // N                                   # blocks ending at or before token L - 1
    hit, _ = oracle.lookup(ids[:cap] + ("end",))         # a sentinel token: the lookup caps at len - 1 = cap
    if hit:
        oracle.touch(ids, hit)
    oracle.insert_blocks(ids, len(ids))
    for b in serving.prefill_checkpoints(L):
        if b // N > hit:
            oracle.insert_checkpoint(ids, b // N)
    return hit


def _oracle_bytes(oracle: PrefixOracle, kv_bytes: int, group_bytes: tuple) -> int:
    return sum(kv_bytes if e[1] == EntryKind.BLOCK else group_bytes[e[2]] for e in oracle.entries)


@pytest.mark.parametrize("groups,interval,capacity", [((700,), 32, 6_000), ((300, 500), 16, 9_000),
                                                      ((250, 400), 48, 3_000)])
def test_replay_cache_matches_the_oracle(groups, interval, capacity):
    """Same hit, same contents and the same LRU order after every request, and the same evictions by kind,
    with a budget small enough that most requests evict (checkpoints of every group and leaf blocks)."""
    trace = synthesize(num_requests=70, duration_s=30.0, seed=5, block_size=16, median_first_prompt_tokens=70,
                       median_turn_tokens=24, median_output_tokens=8, max_input_tokens=200)
    serving = ServeConfig(16, interval, len(groups))
    cache = ReplayCache(TraceReplayConfig(serving, 100, groups, capacity))
    oracle = PrefixOracle(1, len(groups))
    prefix = {h: tuple(r.hash_ids[: i + 1]) for r in trace for i, h in enumerate(r.hash_ids)}
    evicted = {EntryKind.BLOCK: 0, EntryKind.CHECKPOINT: 0}
    for r in trace:
        _, hit = cache.walk(r)
        assert hit == _oracle_step(oracle, r, serving)
        cache.admit(r, hit)
        cache.evict_to(capacity)
        while _oracle_bytes(oracle, 100, groups) > capacity:
            for _, kind, _ in oracle.evict_one():
                evicted[kind] += 1
        assert (cache.ev_kv, cache.ev_ck) == (evicted[EntryKind.BLOCK], evicted[EntryKind.CHECKPOINT])
        assert cache.kv_used + cache.st_used == _oracle_bytes(oracle, 100, groups) <= capacity
        order = [(prefix[e.key], e.kind, e.group) for e in cache.idx.lru]
        assert order == [(e[0], e[1], e[2]) for e in sorted(oracle.entries, key=lambda e: e[3])]
        cache.idx.check_integrity(serving.block_size)
    assert evicted[EntryKind.BLOCK] > 50 and evicted[EntryKind.CHECKPOINT] > 20
