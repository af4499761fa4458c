"""Replays of every policy model pinned to the figures of the plain implementation (commit faab2ec): the
index's path insertion and byte-budget eviction, and the state tree's batched state insertion, are
optimisations that must not change one hit or one eviction. The first 800 requests of the Mooncake
conversation trace, Kimi-Linear-48B-A3B on 8 ranks, at 2, 8 and 32 GB per replica (every one evicts).
Each pin: hit tokens, states written, states evicted, KV tokens evicted, tokens lost to a missing
state, peak KV bytes, peak state bytes, and the first 16 hex digits of the SHA-256 of the per-request hit
tokens (int64 little-endian).

Re-pinned on purpose when the models were brought in line with the engines (ours and extra_buffer untouched):
SGLang no_buffer caches no state at the branching point (extra_buffer's feature; the former default is the
what-if below, whose figures are the old ones to the byte); vLLM align caches the state where a shared
prefix ends (vLLM PR #37898); vLLM states include the KV-group padding (21 pages, not 20)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from serve.scale.policies import ReplicaBytes, SGLangNoBuffer, make_policy, replay
from serve.traces.mooncake import load_mooncake

torch.set_num_threads(1)

WHAT_IF = "sglang no_buffer +branch split (what-if)"
PINS = {
    ('ours', 2): (157696, 5593, 5582, 10844160, 251392, 1453326336, 564428800, 'a9c7798e50e3af12'),
    ('ours', 8): (367616, 5553, 5507, 10774528, 41472, 5978456064, 2170880000, 'a9734af88b4c7e2e'),
    ('ours', 32): (400896, 5545, 5359, 10497024, 8192, 23913824256, 8423014400, '81c2874c26347e73'),
    ('sglang no_buffer', 2): (0, 1818, 1817, 10657806, 409088, 1051997184, 303923200, '56a43ef88ddfcd0f'),
    ('sglang no_buffer', 8): (0, 1818, 1808, 10603062, 409088, 4210053120, 781516800, '56a43ef88ddfcd0f'),
    ('sglang no_buffer', 32): (0, 1818, 1779, 10409680, 409088, 16841825280, 2431385600, '56a43ef88ddfcd0f'),
    ('sglang extra_buffer', 2): (408576, 1772, 1770, 10626112, 512, 1048707072, 347340800, '18d4c41b502f89f9'),
    ('sglang extra_buffer', 8): (408576, 1772, 1761, 10571456, 512, 4207214592, 824934400, '18d4c41b502f89f9'),
    ('sglang extra_buffer', 32): (408576, 1772, 1732, 10378880, 512, 16841244672, 2431385600, '18d4c41b502f89f9'),
    ('vllm align', 2): (360960, 1849, 1846, 10536448, 48128, 1750597632, 495452160, 'c65b3c3b4f02214f'),
    ('vllm align', 8): (406016, 1761, 1745, 10453504, 3072, 7233601536, 1387266048, '7e0ce179dde95cee'),
    ('vllm align', 32): (416768, 1755, 1686, 10110208, 4608, 28818800640, 4359979008, '58852400d794fc9b'),
    ('vllm all', 2): (271360, 41802, 41774, 10556416, 137728, 495452160, 1387266048, '41b7275b23d93919'),
    ('vllm all', 8): (372224, 41408, 41290, 10532864, 36864, 1981808640, 5895880704, '80733a480e3e80c6'),
    ('vllm all', 32): (409088, 41264, 40783, 10440192, 0, 7976779776, 23880794112, '8b97b67a43aa062e'),
    ('vllm align +replay stop', 2): (360960, 1850, 1847, 10536448, 48128, 1750597632, 495452160, 'c65b3c3b4f02214f'),
    ('vllm align +replay stop', 8): (406016, 1762, 1746, 10453504, 3072, 7233601536, 1387266048, '7e0ce179dde95cee'),
    ('vllm align +replay stop', 32): (416768, 1756, 1687, 10110208, 4608, 28818800640, 4359979008, '58852400d794fc9b'),
    # SGLang no_buffer's former default, now the named what-if: the plain implementation's figures, unchanged
    (WHAT_IF, 2): (408576, 1774, 1772, 10657294, 512, 1052319744, 347340800, '18d4c41b502f89f9'),
    (WHAT_IF, 8): (408576, 1774, 1763, 10602550, 512, 4210504704, 824934400, '18d4c41b502f89f9'),
    (WHAT_IF, 32): (408576, 1774, 1734, 10409680, 512, 16841889792, 2387968000, '18d4c41b502f89f9'),
}


@pytest.fixture(scope="module")
def trace(traces_dir):
    return load_mooncake(traces_dir / "mooncake_conversation_trace.jsonl")[:800]


@pytest.mark.parametrize("policy,budget_gb", list(PINS))
def test_replay_matches_the_plain_implementation(trace, policy, budget_gb):
    pol = (SGLangNoBuffer(ReplicaBytes.for_preset("kimi-linear-48b-a3b", 8), branch_split=True) if policy == WHAT_IF
           else make_policy(policy, "kimi-linear-48b-a3b", 8))
    r = replay(trace, pol, budget_gb * 1e9)
    digest = hashlib.sha256(r.request_hit_tokens.astype("<i8").tobytes()).hexdigest()[:16]
    got = (r.hit_tokens, r.states_written, r.states_evicted, r.kv_evicted_tokens, r.lost_to_missing_state,
           r.peak_bytes["kv"], r.peak_bytes["state"], digest)
    assert got == PINS[(policy, budget_gb)]
    assert r.states_evicted > 0 and r.kv_evicted_tokens > 0
