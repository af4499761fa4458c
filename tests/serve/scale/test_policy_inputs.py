"""Bad input to the policy models and the trace replay: a clear ValueError naming the input, never a
TypeError, IndexError, ZeroDivisionError or a silent wrong value."""
from __future__ import annotations

import math

import pytest
import torch

from serve.config import ServeConfig
from serve.prefix.sim import TraceReplayConfig, replay_row
from serve.scale.policies import (
    OursPolicy,
    ReplicaBytes,
    SGLangExtraBuffer,
    SGLangNoBuffer,
    VLLMMambaPolicy,
    replay,
)
from serve.traces.mooncake import TraceRequest

torch.set_num_threads(1)
KIMI = "kimi-linear-48b-a3b"


def policies(block=512):
    rb = ReplicaBytes.for_preset(KIMI)
    return [OursPolicy(KIMI), SGLangNoBuffer(rb, block_size=block), SGLangExtraBuffer(rb, block_size=block),
            VLLMMambaPolicy(KIMI, "align", trace_block_size=block), VLLMMambaPolicy(KIMI, "all", trace_block_size=block)]


def prompt(n_blocks, length, first=0):
    return TraceRequest(0, length, 1, tuple(range(first, first + n_blocks)))


@pytest.mark.parametrize("budget", ["1e12", math.nan, math.inf, -1.0, True, None], ids=repr)
def test_replay_rejects_a_budget_that_is_not_a_finite_number(budget):
    """A string was a TypeError; NaN was accepted and never evicted; inf made SGLang's KV cap inf - inf."""
    for pol in policies():
        with pytest.raises(ValueError, match="budget_bytes"):
            replay([prompt(2, 1000)], pol, budget)


@pytest.mark.parametrize("cap", [math.nan, math.inf, "5", -1.0], ids=repr)
def test_trace_replay_rejects_a_capacity_that_is_not_a_finite_number(cap):
    """serve.prefix.sim: replay_row / TraceReplayConfig took a NaN capacity and never evicted."""
    with pytest.raises(ValueError, match="capacity_bytes"):
        replay_row([prompt(2, 1000)], KIMI, 1024, capacity_bytes=cap)
    with pytest.raises(ValueError, match="capacity_bytes"):
        TraceReplayConfig(ServeConfig(512, 1024), 1, (1,), cap)


def test_zero_length_prompts_hit_nothing_without_dividing_by_zero():
    """Mooncake allows input_length 0 (no hash ids): a trace of only such prompts replays to a 0.0 ratio."""
    empty = [TraceRequest(0, 0, 10, ())] * 3
    for pol in policies():
        res = replay(empty, pol, 1e12, check_every=1)
        assert (res.token_hit_ratio, res.hit_tokens, res.total_tokens) == (0.0, 0, 0), pol.name
    mixed = [prompt(2, 1000), TraceRequest(0, 0, 10, ()), prompt(2, 1000)]
    for pol in policies():
        res = replay(mixed, pol, 1e12, check_every=1)
        assert res.total_tokens == 2000 and res.request_hit_tokens[1] == 0, pol.name
    assert replay(mixed, OursPolicy(KIMI, 512), 1e12).hit_tokens == 512         # the empty prompt changes nothing


def test_block_size_that_is_not_the_trace_block():
    """A 512-token-block trace replayed with 16-token blocks was an IndexError deep in the tree (or, for a
    larger block, a silent wrong hit): now a ValueError naming block_size."""
    trace = [prompt(4, 2000), prompt(4, 2000)]
    for pol in policies(block=16)[1:] + [OursPolicy(KIMI, 1024, block_size=1024)]:
        with pytest.raises(ValueError, match="block_size"):
            replay(trace, pol, 1e12)


@pytest.mark.parametrize("ratio", [math.inf, math.nan, 0.0, "0.9"], ids=repr)
def test_sglang_memory_ratio_must_be_finite(ratio):
    """mamba_full_memory_ratio = inf gave a state share of inf / inf = NaN and went over the budget."""
    rb = ReplicaBytes.for_preset(KIMI)
    for cls in (SGLangNoBuffer, SGLangExtraBuffer):
        with pytest.raises(ValueError, match="mamba_full_memory_ratio"):
            cls(rb, mamba_full_memory_ratio=ratio)


def test_sglang_branch_split_is_a_bool():
    with pytest.raises(ValueError, match="branch_split"):
        SGLangNoBuffer(ReplicaBytes.for_preset(KIMI), branch_split="yes")
