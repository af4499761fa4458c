"""vLLM's mamba_cache_mode model against vLLM's own tests and logged numbers: the shared-prefix cut of align
mode (PR #37898), the KV-cache-group padding of a state, and "all" as a counterfactual for Kimi models."""
from __future__ import annotations

import pytest
import torch

from kda_core.config import PRESETS
from serve.scale.policies import VLLMMambaPolicy, replay, vllm_block_size, vllm_group_pages
from serve.traces.mooncake import TraceRequest

torch.set_num_threads(1)
KIMI = "kimi-linear-48b-a3b"
BIG = 1e15


def req(ids, length, n=16):
    """A prompt of ``length`` tokens named by chained ids of ``n``-token blocks."""
    ids = tuple(ids)
    assert len(ids) == -(-length // n)
    return TraceRequest(0, length, 1, ids)


def align(block=16, trace_block=16, **kw):
    return VLLMMambaPolicy(KIMI, "align", block_size=block, trace_block_size=trace_block, **kw)


def hits(policy, requests):
    return replay(requests, policy, BIG, check_every=1).request_hit_tokens.tolist()


# ---- PR #37898: the state where a shared prefix ends ------------------------------------------------
def test_align_shared_prefix_detection():
    """Port of vLLM's test_hybrid_cache_mamba_align_shared_prefix_detection (tests/v1/core/
    test_prefix_caching.py), block 16. req_0: 3 blocks. req_1: the same 3 blocks + 7 tokens -> a 48-token hit,
    no uncached common prefix. req_2: the first 2 blocks, the 3rd differs -> 0 cached (align keeps no
    intermediate state), num_uncached_common_prefix_tokens = 32, and _mamba_block_aligned_split cuts its
    48-token prefill to 32, so the state at 32 is cached. A 4th request sharing those 2 blocks hits 32
    (before the PR: 0)."""
    prefix = [0, 1, 2]
    r0, r1, r2 = req(prefix, 48), req(prefix + [3], 55), req([0, 1, 101], 48)
    pol = align()
    assert hits(pol, [r0, r1, r2, r2]) == [0, 48, 0, 32]
    other = req([0, 1, 102, 103], 64)                         # another prompt sharing the 2 blocks
    assert hits(align(), [r0, r1, r2, other]) == [0, 48, 0, 32]


def test_align_split_is_the_common_prefix():
    """The scheduler's numbers in the same test: req_2 computes 0 cached tokens, its attention hit is 32
    (num_computed + num_uncached_common = 0 + 32), the first chunk is cut from 48 to 32 -> states at 32 and
    at the last full block 48; no cut when nothing is shared (req_1: common 0) or the common part is under a
    block."""
    r0, r1, r2 = req([0, 1, 2], 48), req([0, 1, 2, 3], 55), req([0, 1, 101], 48)
    pol = align()
    replay([r0, r1], pol, BIG)
    assert pol.lookup(r2) == (0, 32)
    assert pol.state_positions(0, 48, kv=32) == [32, 48]
    assert pol.state_positions(48, 55, kv=48) == []           # req_1: a 7-token tail caches nothing
    assert pol.state_positions(0, 48, kv=0) == [48]
    small = align(max_num_batched_tokens=16)                  # a first chunk of 16 < common 32: no cut needed
    assert small.state_positions(0, 48, kv=32) == [16, 32, 48]


def test_align_shared_prefix_chunks_logged_in_vllm_issue_42317():
    """vLLM issue #42317 logged the prefill chunks of align mode with PR #37898 (block 1056, 6,000 shared
    tokens + 2,000 unique, max_num_batched_tokens 8192): first request 7392 + 608; second 5280 + 2112 + 608
    (the first chunk ends at the shared prefix floored to the block, 5 x 1056); third and later 2112 + 608
    after a 5280-token hit."""
    shared = list(range(375))                                  # 6000 tokens of 16-token trace blocks
    a, b, c = (req(shared + [1000 * k + i for i in range(125)], 8000) for k in (1, 2, 3))
    pol = align(block=1056)
    assert pol.state_positions(0, 8000) == [7392]
    assert hits(pol, [a, b, c, c]) == [0, 0, 5280, 7392]
    assert pol.state_positions(0, 8000, kv=5280) == [5280, 7392]
    assert pol.state_positions(5280, 8000, kv=5280) == [7392]


def test_all_mode_has_no_cut():
    """The cut is align's; all caches every full block anyway."""
    pol = VLLMMambaPolicy(KIMI, "all", block_size=16, trace_block_size=16)
    assert pol.state_positions(0, 48, kv=32) == [16, 32, 48]


# ---- KV-cache groups: a state's pages -----------------------------------------------------------------
@pytest.mark.parametrize("mla,kda,want", [
    pytest.param(7, 20, (7, 21, 7), id="kimi-linear-7mla-20kda"),
    pytest.param(24, 69, (24, 72, 24), id="kimi-k3-24mla-69kda"),
    pytest.param(10, 52, (10, 60, 10), id="gemma3-like-10-52"),     # vLLM's doc: 52 sw + 10 full -> 6 groups
    pytest.param(13, 12, (13, 13, 13), id="within-1.25-uses-max"),  # gpt-oss + eagle: 12 + 13 -> groups of 13
])
def test_group_pages(mla, kda, want):
    """_get_kv_cache_groups_uniform_page_size: group size = the fewest layers of a kind (the most when < 1.25 x
    the fewest), each kind padded to whole groups; a block of any group is a page in each of the group size
    tensors."""
    assert tuple(vllm_group_pages(mla, kda)) == want


@pytest.mark.parametrize("preset,tp,pages", [(KIMI, 8, 21), ("kimi-k3", 16, 72)], ids=["kimi-linear-TP8", "k3-TP16"])
def test_state_bytes_include_group_padding(preset, tp, pages):
    """A vLLM state is 21 pages for Kimi-Linear (20 KDA layers, groups of 7) and 72 for K3 (69 KDA layers,
    groups of 24), not one page per KDA layer; the running request's two state slots are as large."""
    cfg = PRESETS[preset]
    pol = VLLMMambaPolicy(preset, "align", tp)
    page = vllm_block_size(preset, "align", tp_size=tp) * cfg.latent_dim * 2           # bf16 latent, one layer
    assert pol.state_bytes == pages * page * tp
    assert pol.state_bytes > cfg.num_kda_layers * page * tp
    assert pol.kv_bytes_per_token == cfg.num_mla_layers * cfg.latent_dim * 2 * tp       # no padding on the MLA side
    res = replay([req([1], 10, 512)], pol, BIG)
    assert res.peak_bytes["running"] == 2 * pol.state_bytes


def test_all_is_a_counterfactual_for_kimi():
    """vLLM's KimiLinearForCausalLM does not declare SupportsMambaPrefixCaching: vLLM serves Kimi in align."""
    assert VLLMMambaPolicy(KIMI, "all").counterfactual
    assert VLLMMambaPolicy("kimi-k3", "all", 16).counterfactual
    assert not VLLMMambaPolicy(KIMI, "align").counterfactual


def test_align_on_the_mooncake_conversation_trace(traces_dir):
    """The first 800 requests of the Mooncake conversation trace, Kimi-Linear on 8 ranks at 2 GB per replica:
    with the shared-prefix cut vLLM align hits about what SGLang extra_buffer does (it hit 0 tokens without)."""
    from serve.scale.policies import make_policy
    from serve.traces.mooncake import load_mooncake
    trace = load_mooncake(traces_dir / "mooncake_conversation_trace.jsonl")[:800]
    got = {p: replay(trace, make_policy(p, KIMI, 8), 2e9).hit_tokens for p in ("vllm align", "sglang extra_buffer")}
    assert got["vllm align"] >= 0.8 * got["sglang extra_buffer"] > 0, got
