"""A warm run that restores a checkpoint on the 64-token chunk grid is bitwise the cache-off run.

Rule (``serve.engine``, docs/exactness.md): the warm prefill starts at the hit boundary b; when b is a multiple of
``kda_core.chunk.CHUNK_SIZE`` (64) and the checkpoint there was taken by a prefill that started on the grid,
logits and tokens are bitwise equal to the cache-off run. Off the grid they agree within ``WARM_TOLERANCE``.
"""
import pytest
import torch

from kda_core.chunk import CHUNK_SIZE
from lab.prefix import WARM_TOLERANCE, Comparison, compare, shared_prefix_prompts
from lab.threads import one_thread
from serve.config import ServeConfig
from serve.engine import EngineArgs, build_engine
from serve.runnable import demo_model


def _cold_warm(first, second, block_size, interval, preset="demo", max_new_tokens=4):
    model = demo_model(preset)
    with one_thread():
        cold = build_engine(EngineArgs(model, 512, ServeConfig(block_size, interval))).generate(second, max_new_tokens, record_logits=True)
        eng = build_engine(EngineArgs(model, 512, ServeConfig(block_size, interval), prefix_cache=True))
        eng.generate(first, max_new_tokens)
        warm = eng.generate(second, max_new_tokens, record_logits=True)
        eng.check_integrity()
    return cold, warm


# (block size N, checkpoint interval C, shared tokens, unique tokens) -> hit b on the grid
ALIGNED = [
    (16, 64, 128, 16),      # page 08's defaults: b = 128
    (16, 64, 384, 64),      # b = 384
    (16, 64, 200, 40),      # b = 192, the shared prefix ends mid-block
    (64, 64, 320, 16),      # N = C = 64: every boundary is on the grid
    (16, 128, 300, 30),     # b = 256
    (32, 256, 1100, 40),    # b = 1024: the cold prefill runs in two 1,024-token pieces
]


@pytest.mark.parametrize("block_size,interval,shared,unique", ALIGNED, ids=str)
def test_warm_on_grid_is_bitwise(block_size, interval, shared, unique):
    first, second = shared_prefix_prompts(shared, unique, seed=4)
    cold, warm = _cold_warm(first, second, block_size, interval)
    assert warm.hit_tokens > 0 and warm.hit_tokens % CHUNK_SIZE == 0
    assert warm.output_tokens == cold.output_tokens
    assert torch.equal(warm.logits, cold.logits)
    check = compare(warm, cold)
    assert check.bitwise and check.on_grid and check.max_logit_diff == 0.0 and check.hit_tokens == warm.hit_tokens


def test_warm_from_the_end_of_an_earlier_prompt_on_grid_is_bitwise():
    """A follow-up turn: request 2 extends request 1's 320-token prompt; the hit is request 1's end-of-prompt
    checkpoint (the final state of its prefill), on the grid."""
    first, _ = shared_prefix_prompts(320, 0, seed=5)
    second = first + shared_prefix_prompts(0, 24, seed=6)[0]
    cold, warm = _cold_warm(first, second, 16, 64)
    assert warm.hit_tokens == 320
    assert warm.output_tokens == cold.output_tokens and torch.equal(warm.logits, cold.logits)


@pytest.mark.parametrize("seed", [7, 8])
@pytest.mark.parametrize("block_size,interval,shared,follow_up", [(16, 32, 416, False), (16, 64, 400, True)], ids=str)
def test_warm_off_grid_is_within_tolerance(block_size, interval, shared, follow_up, seed):
    """Off the grid (b = 416, an interval checkpoint at C = 32; b = 400, the end-of-prompt checkpoint of a
    400-token request 1 that request 2 extends) the warm chunks start at b: same tokens, logits within
    WARM_TOLERANCE, and the comparison says why."""
    first, second = shared_prefix_prompts(shared, 48, seed=seed)   # seed 8 at C = 32: 1.2e-5 on the trained model
    if follow_up:
        first = first[:shared]
    cold, warm = _cold_warm(first, second, block_size, interval)
    assert warm.hit_tokens == shared and shared % CHUNK_SIZE
    check = compare(warm, cold)
    assert not check.on_grid and check.outputs_identical
    assert check.max_logit_diff <= WARM_TOLERANCE
    assert check.bitwise == torch.equal(warm.logits, cold.logits)


def test_checkpoint_written_during_decode_is_on_grid_but_not_a_prefill_state():
    """Request 2 extends request 1's prompt and 64 of its output tokens: the hit b = 384 is on the grid but
    its checkpoint was written during decode (token-by-token state), so it is within tolerance, and said so."""
    model = demo_model("demo")
    first, _ = shared_prefix_prompts(320, 0, seed=5)
    with one_thread():
        eng = build_engine(EngineArgs(model, 512, ServeConfig(64, 64), prefix_cache=True))
        out = eng.generate(first, 70).output_tokens
        second = first + list(out[:64]) + shared_prefix_prompts(0, 20, seed=9)[0]
        warm = eng.generate(second, 4, record_logits=True)
        cold = build_engine(EngineArgs(model, 512, ServeConfig(64, 64))).generate(second, 4, record_logits=True)
    check = compare(warm, cold)
    assert check.hit_tokens == 384 and check.on_grid and check.outputs_identical
    assert check.max_logit_diff <= WARM_TOLERANCE and not check.bitwise   # 6.7e-6 here (trained)
    assert "not taken by a prefill" in check.reason and check.verdict.startswith("within tolerance")


def test_verdict_and_reason():
    on = compare_row(bitwise=True, hit=320)
    assert on.verdict == "bitwise equal" and "b = 320 is a multiple of the 64-token KDA chunk" in on.reason
    off = compare_row(bitwise=False, hit=400, diff=3.2e-6)
    assert off.verdict == "within tolerance (max |Δ| = 3.2e-06)" and "b = 400 is not a multiple" in off.reason
    assert compare_row(bitwise=False, hit=400, diff=2 * WARM_TOLERANCE).verdict == "different"


def test_reason_with_no_hit():
    """With no shared prefix (page 08 at b = 0) the reason said "the hit b = 0 is a multiple of the 64-token KDA
    chunk": with no hit there is nothing to explain beyond warm == cold running the same forward."""
    none = compare_row(bitwise=True, hit=0)
    assert none.reason.startswith("there is no hit (b = 0)") and "multiple" not in none.reason
    assert compare_row(bitwise=False, hit=0, diff=1.0).reason.endswith("yet its output differs")


def compare_row(bitwise, hit, diff=0.0):
    return Comparison(True, diff, bitwise, hit, hit % CHUNK_SIZE == 0)
