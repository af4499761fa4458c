"""Prefix-cache policy models: each engine's documented behaviour on small scenarios, bounds, the real trace."""
from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve.config import ServeConfig
from serve.prefix.sim import TraceReplayConfig, replay_trace
from serve.scale.policies import (
    OursPolicy,
    ReplicaBytes,
    SGLangExtraBuffer,
    SGLangNoBuffer,
    VLLMMambaPolicy,
    all_policies,
    replay,
    vllm_block_size,
)
from serve.traces.mooncake import TraceRequest, leading_run, load_mooncake, synthesize

torch.set_num_threads(1)
KIMI = "kimi-linear-48b-a3b"
N = 16                                   # trace block in the small scenarios
BIG = 1e15                               # a budget nothing fills


def req(ids, length):
    """A prompt of ``length`` tokens named by chained ids of ``N``-token blocks."""
    assert len(ids) == -(-length // N)
    return TraceRequest(0, length, 1, tuple(ids))


def hits(policy, requests, budget=BIG):
    return replay(requests, policy, budget, check_every=1).request_hit_tokens.tolist()


def sglang(cls, **kw):
    return cls(ReplicaBytes.for_preset(KIMI), block_size=N, **kw)


def vllm(mode, **kw):
    return VLLMMambaPolicy(KIMI, mode, block_size=16, trace_block_size=N, **kw)


# ---- vLLM -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length,without,with_stop", [(32, 0, 16), (48, 0, 32)], ids=["L32", "L48"])
def test_vllm_align_replay_stop(length, without, with_stop):
    """vLLM PR #50409 (fixes #50235), block 16: a prompt of an exact multiple of the block runs as one
    chunk in align mode, its only state sits at L, the lookup is capped at L - 1, so the same prompt again
    hits 0; the replay-boundary stop makes it 16 (L = 32) and 32 (L = 48), the PR's measured numbers."""
    prompt = req(range(length // N), length)
    assert hits(vllm("align"), [prompt, prompt]) == [0, without]
    assert hits(vllm("align", replay_stop=True), [prompt, prompt]) == [0, with_stop]
    assert hits(vllm("all"), [prompt, prompt]) == [0, length - 16]


def test_vllm_align_diverging_before_the_only_state():
    """vLLM issue #43587 (root cause in PR #43628): in align mode a one-chunk prefill caches its state only
    at its last full block; a request sharing an earlier prefix and diverging before it gets a 0-token hit,
    although the attention blocks match. ``all`` caches a state per block and hits the shared prefix."""
    a = req([0, 1, 2, 3, 4], 69)                  # states: align at 64 only
    b = req([0, 1, 9, 10], 60)                    # shares 32 tokens
    assert hits(vllm("align"), [a, b]) == [0, 0]
    assert hits(vllm("all"), [a, b]) == [0, 32]
    assert vllm("align").state_positions(0, 69) == [64]


def test_vllm_align_chunk_ends_and_none():
    """Align caches a state at the end of each block-aligned chunk (max_num_batched_tokens) and at the
    last full block; none caches nothing."""
    pol = vllm("align", max_num_batched_tokens=40)            # 2 blocks per chunk
    assert pol.state_positions(0, 100) == [32, 64, 96]
    assert pol.state_positions(32, 100) == [64, 96]
    a = req(range(7), 100)
    assert hits(vllm("none"), [a, a]) == [0, 0]
    assert replay([a], vllm("none"), BIG).peak_bytes["state"] == 0


def test_vllm_block_size_follows_page_unification():
    """Kimi-Linear: one KDA layer's state per rank over one MLA layer's 1152 B/token, aligned to FlashMLA's
    64: 1920 tokens on one rank, 256 on TP8 (the state is split by heads, the latent is not)."""
    assert vllm_block_size(KIMI, "align", 64, 1) == 1920
    assert vllm_block_size(KIMI, "align", 64, 8) == 256
    assert vllm_block_size(KIMI, "all", 64, 8) == 256
    assert vllm_block_size(KIMI, "all", 128, 8) == 256       # lcm(64, 128) = 128 -> 2 x 128


# ---- SGLang -----------------------------------------------------------------------------------------
def _branch_trace():
    a = req(range(13), 200)                       # 12 full blocks + 8
    b = req([0, 1, 2, 3, 4, 5, 50, 51, 52, 53], 150)          # shares 96 tokens with a
    c = req([0, 1, 2, 3, 4, 5, 50, 51, 70, 71], 150)          # shares 128 tokens with b
    return a, b, c


def test_sglang_no_buffer_caches_no_state_at_the_branching_point():
    """SGLang caches a state at the branching point only in extra_buffer (PR #14792: "support branching
    point caching ... enable with --mamba-scheduler-strategy extra_buffer"). no_buffer by default: b matches
    96 tokens of KV but no state (a's is at its end, 200), and nothing is cached at 64 for c: [0, 0, 0]. The
    what-if ``branch_split=True`` (named so) floors the branching point to floor(96 / 64) * 64 = 64 and
    caches it, so c hits 64; extra_buffer does the same (test below)."""
    a, b, c = _branch_trace()
    assert hits(sglang(SGLangNoBuffer), [a, b, c]) == [0, 0, 0]
    what_if = sglang(SGLangNoBuffer, branch_split=True)
    assert hits(what_if, [a, b, c]) == [0, 0, 64]
    assert "what-if" in what_if.name and sglang(SGLangNoBuffer).name == "sglang no_buffer"


def test_sglang_no_buffer_same_prompt_twice():
    """The request-end state is at L and the lookup stops at L - 1 (Req._compute_max_prefix_len), so the
    same prompt never hits in no_buffer (no branching-point state); the what-if caches floor(199 / 64) * 64
    = 192 on the second pass and hits it on the third."""
    a = req(range(13), 200)
    assert hits(sglang(SGLangNoBuffer), [a, a, a]) == [0, 0, 0]
    assert hits(sglang(SGLangNoBuffer, branch_split=True), [a, a, a]) == [0, 0, 192]


def test_sglang_extra_buffer_hits_only_at_track_boundaries():
    """schedule_batch._mamba_radix_cache_v2_req_prepare_for_extend: one tracked state per extend at its
    last 64-aligned position (a: 192 of 200), or the branching point instead (b: 64), and only the tracked
    length is cached, so the same prompt hits 192 at once and c hits b's tracked 64."""
    a, b, c = _branch_trace()
    pol = sglang(SGLangExtraBuffer)
    assert hits(pol, [a, a]) == [0, 192]
    assert hits(sglang(SGLangExtraBuffer), [a, b, c]) == [0, 0, 64]
    short = req([99, 98], 20)                                 # extend < 64: nothing tracked, nothing cached
    pol = sglang(SGLangExtraBuffer)
    assert hits(pol, [short, short]) == [0, 0] and pol.bytes_by_kind() == {"kv": 0, "state": 0}


def test_sglang_extra_buffer_chunked_prefill_tracks_each_chunk():
    """With chunked_prefill_size 64 a 200-token prompt tracks at 64, 128, 192 (one per extend); a request
    sharing 160 tokens hits 128."""
    a = req(range(13), 200)
    b = req(list(range(10)) + [77, 78], 190)
    assert hits(sglang(SGLangExtraBuffer, chunked_prefill_size=64), [a, b]) == [0, 128]


def test_sglang_state_pool_evicts_to_tombstones_and_prunes_leaves():
    """Two pools: a state budget of ~1 state keeps the newest; evicted leaf states take their stateless
    KV leaves with them (no tombstone leaf), integrity holds after each request."""
    rb = ReplicaBytes.for_preset(KIMI)
    pol = SGLangNoBuffer(rb, block_size=N, mamba_full_memory_ratio=1.0)
    trace = [req([i * 100 + j for j in range(4)], 64) for i in range(5)]
    budget = 2 * (2 * rb.state_bytes)            # state pool = half = 2 states, minus 1 running slot
    res = replay(trace, pol, budget, check_every=1)
    assert len(pol.tree.states) == 1 and res.states_evicted == 4
    assert pol.tree.kv_tokens == 64 and res.kv_evicted_tokens == 4 * 64


# ---- ours ---------------------------------------------------------------------------------------------
def test_ours_wraps_prefix_sim():
    """Ours is the trace replay, not a copy: the same hits as replay_trace() at the same capacity, per request."""
    trace = synthesize(num_requests=200, duration_s=30.0, seed=5, block_size=512, median_first_prompt_tokens=3000,
                       median_turn_tokens=800, median_output_tokens=50, max_input_tokens=20000)
    pol = OursPolicy(KIMI, checkpoint_interval=1024)
    budget = 20e9
    res = replay(trace, pol, budget)
    direct = replay_trace(trace, TraceReplayConfig(ServeConfig(512, 1024), pol.replica.kv_bytes_per_token * 512,
                                                   pol.groups, budget - pol.replica.state_bytes))
    assert res.hit_tokens == direct.hit_tokens == int(res.request_hit_tokens.sum())
    assert res.request_hit_tokens.tolist() == list(direct.request_hit_tokens)


# ---- bounds -------------------------------------------------------------------------------------------
def _small_policies():
    rb = ReplicaBytes.for_preset(KIMI)
    return [SGLangNoBuffer(rb, block_size=N, chunked_prefill_size=128), SGLangExtraBuffer(rb, block_size=N),
            vllm("align"), vllm("align", replay_stop=True), vllm("all"), vllm("none")]


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), budget_states=st.floats(3.0, 40.0))
def test_hits_within_ideal_and_bytes_within_budget(seed, budget_states):
    """Every policy: each request's hit <= its block ideal (min(leading run x N, L)) and <= L - 1; cached
    bytes <= budget - running slots after every request; check_integrity after every request."""
    trace = synthesize(num_requests=120, duration_s=20.0, seed=seed, block_size=N, median_first_prompt_tokens=120,
                       median_turn_tokens=40, median_output_tokens=8, max_input_tokens=600)
    budget = budget_states * ReplicaBytes.for_preset(KIMI).state_bytes
    seen, ideal = set(), []
    for r in trace:
        ideal.append(min(leading_run(r.hash_ids, seen) * N, r.input_length))
        seen.update(r.hash_ids)
    for pol in _small_policies():
        res = replay(trace, pol, budget, check_every=1)
        for h, i, r in zip(res.request_hit_tokens.tolist(), ideal, trace):
            assert h <= i and h <= max(r.input_length - 1, 0), pol.name
        assert res.peak_bytes["kv"] + res.peak_bytes["state"] <= 2 * (budget - res.peak_bytes["running"])
        assert res.lost_to_missing_state >= 0


def test_bad_input():
    a = req([1], 10)
    with pytest.raises(ValueError, match="mode"):
        VLLMMambaPolicy(KIMI, "some")
    with pytest.raises(ValueError, match="budget_bytes"):
        replay([a], sglang(SGLangExtraBuffer), 1e6)           # below 3 running slots
    with pytest.raises(ValueError, match="requests"):
        replay([], vllm("all"), BIG)
    with pytest.raises(ValueError, match="tp_size"):
        ReplicaBytes.for_preset(KIMI, 5)


# ---- the real trace -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_mooncake_conversation_all_policies(traces_dir):
    """Kimi-Linear on an H200 x TP8 replica with 300 GB left for the cache: every policy replays the real
    conversation trace (12,031 requests) in <= 5 s, stays within its ideal and its budget."""
    trace = load_mooncake(traces_dir / "mooncake_conversation_trace.jsonl")
    budget = 300e9
    timings = {}
    for pol in all_policies(KIMI, tp_size=8):
        t0 = time.perf_counter()
        res = replay(trace, pol, budget)
        timings[pol.name] = time.perf_counter() - t0
        assert res.hit_tokens <= res.ideal_hit_tokens, pol.name
        assert res.peak_bytes["kv"] <= budget and res.peak_bytes["state"] <= budget
        assert timings[pol.name] <= 5.0, timings
        if pol.name != "vllm none":
            assert res.token_hit_ratio > 0.03, (pol.name, res.token_hit_ratio)
    print({k: round(v, 2) for k, v in timings.items()})


def test_every_policy_declares_its_replay():
    """One way in: ``replay`` calls the policy's own ``replay_trace`` (a protocol member), it no longer asks
    ``hasattr``; the tree policies replay one request at a time, ours through serve.prefix.sim; both meet the same
    budget check (``cache_bytes``) first."""
    from serve.scale.policies import EXTRA_CACHE_POLICIES, PrefixPolicy, make_policy
    from serve.scale.policies.base import cache_bytes, running_bytes
    policies = all_policies(KIMI, tp_size=8)
    assert [p.name for p in policies][:3] == ["ours C=2048 G=1", "sglang no_buffer", "sglang extra_buffer"]
    assert all(isinstance(p, PrefixPolicy) and callable(p.replay_trace) for p in policies)
    assert len(policies) == 5 + len(EXTRA_CACHE_POLICIES)
    pol = make_policy("vllm align", KIMI, 8)
    assert cache_bytes(pol, 1e12) == 1e12 - running_bytes(pol) and running_bytes(pol, 3) == 3 * running_bytes(pol)
    with pytest.raises(ValueError, match="state slots of 1 running request"):
        cache_bytes(pol, running_bytes(pol) - 1)
