"""Replays of every policy model pinned to the figures of the plain implementation (commit faab2ec): the
index's path insertion and byte-budget eviction, and the state tree's batched state insertion, are
optimisations that must not change one hit or one eviction. The first 800 requests of the Mooncake
conversation trace, Kimi-Linear-48B-A3B on 8 ranks, at 2, 8 and 32 GB per replica (every one evicts).
Each pin: hit tokens, states written, states evicted, KV tokens evicted, tokens lost to a missing
state, peak KV bytes, peak state bytes, and the first 16 hex digits of the SHA-256 of the per-request hit
tokens (int64 little-endian)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from lab.real_scale import make_policy
from serve.scale.policies import replay
from serve.traces import load_mooncake

torch.set_num_threads(1)

PINS = {
    ('ours', 2): (157696, 5593, 5582, 10844160, 251392, 1453326336, 564428800, 'a9c7798e50e3af12'),
    ('ours', 8): (367616, 5553, 5507, 10774528, 41472, 5978456064, 2170880000, 'a9734af88b4c7e2e'),
    ('ours', 32): (400896, 5545, 5359, 10497024, 8192, 23913824256, 8423014400, '81c2874c26347e73'),
    ('sglang no_buffer', 2): (408576, 1774, 1772, 10657294, 512, 1052319744, 347340800, '18d4c41b502f89f9'),
    ('sglang no_buffer', 8): (408576, 1774, 1763, 10602550, 512, 4210504704, 824934400, '18d4c41b502f89f9'),
    ('sglang no_buffer', 32): (408576, 1774, 1734, 10409680, 512, 16841889792, 2387968000, '18d4c41b502f89f9'),
    ('sglang extra_buffer', 2): (408576, 1772, 1770, 10626112, 512, 1048707072, 347340800, '18d4c41b502f89f9'),
    ('sglang extra_buffer', 8): (408576, 1772, 1761, 10571456, 512, 4207214592, 824934400, '18d4c41b502f89f9'),
    ('sglang extra_buffer', 32): (408576, 1772, 1732, 10378880, 512, 16841244672, 2431385600, '18d4c41b502f89f9'),
    ('vllm align', 2): (0, 1790, 1787, 10536448, 409088, 1767112704, 424673280, '56a43ef88ddfcd0f'),
    ('vllm align', 8): (0, 1790, 1775, 10452480, 409088, 7299661824, 1274019840, '56a43ef88ddfcd0f'),
    ('vllm align', 32): (8192, 1789, 1721, 10104576, 415232, 28884860928, 4152360960, '02f48bb9601217ff'),
    ('vllm all', 2): (271872, 41800, 41770, 10555904, 137216, 511967232, 1415577600, '45ff059e993ba876'),
    ('vllm all', 8): (372736, 41406, 41284, 10531840, 36352, 2064384000, 5851054080, '8fa1d12d208faf94'),
    ('vllm all', 32): (409088, 41264, 40765, 10435584, 0, 8274051072, 23592960000, '8b97b67a43aa062e'),
    ('vllm align +replay stop', 2): (0, 1791, 1788, 10536448, 409088, 1767112704, 424673280, '56a43ef88ddfcd0f'),
    ('vllm align +replay stop', 8): (0, 1791, 1776, 10452480, 409088, 7299661824, 1274019840, '56a43ef88ddfcd0f'),
    ('vllm align +replay stop', 32): (8192, 1790, 1722, 10104576, 415232, 28884860928, 4152360960, '02f48bb9601217ff'),
}


@pytest.fixture(scope="module")
def trace(traces_dir):
    return load_mooncake(traces_dir / "mooncake_conversation_trace.jsonl")[:800]


@pytest.mark.parametrize("policy,budget_gb", list(PINS))
def test_replay_matches_the_plain_implementation(trace, policy, budget_gb):
    r = replay(trace, make_policy(policy, "kimi-linear-48b-a3b", 8), budget_gb * 1e9)
    digest = hashlib.sha256(r.request_hit_tokens.astype("<i8").tobytes()).hexdigest()[:16]
    got = (r.hit_tokens, r.states_written, r.states_evicted, r.kv_evicted_tokens, r.lost_to_missing_state,
           r.peak_bytes["kv"], r.peak_bytes["state"], digest)
    assert got == PINS[(policy, budget_gb)]
    assert r.states_evicted > 0 and r.kv_evicted_tokens > 0
