"""The largest decode batch after the weights, and TPOT / throughput at it, beside the report's Fig. 1b."""
import math

import pytest

from serve.scale.capacity import (
    MEMORY_FRACTION,
    cache_bytes_per_sequence,
    largest_batch_decode,
    max_batch,
    weight_bytes,
)
from serve.scale.hardware import hardware
from serve.scale.model_shape import preset
from serve.scale.published import TPOT_FIG1B
from serve.scale.roofline import decode_time

KL = preset("kimi-linear-48b-a3b")
M = 1024 * 1024


def test_max_batch_is_the_free_memory_over_the_cache_per_sequence_by_hand():
    hw = hardware("H200")
    free = MEMORY_FRACTION * 141e9 - weight_bytes(KL) / 8
    per_seq = 7 * M * (512 + 64) * 2 + 20 * KL.kda_state_bytes_layer / 8   # latent replicated, state split
    assert cache_bytes_per_sequence(KL, 8, M) == per_seq
    assert max_batch(KL, hw, 8, M) == math.floor(free / per_seq)
    assert max_batch(KL, hw, 8, M) * per_seq <= free < (max_batch(KL, hw, 8, M) + 1) * per_seq


def test_tpot_and_throughput_at_the_largest_batch():
    hw = hardware("H200")
    d = largest_batch_decode(KL, hw, 8, M)
    assert d.tpot_s == decode_time(KL, hw, 8, d.batch, M).total_s
    assert d.throughput_tok_s == pytest.approx(d.batch / d.tpot_s)
    assert d.time_per_token_s == pytest.approx(1 / d.throughput_tok_s)


def test_none_fits_gives_nan_not_a_crash():
    """All-MLA 48B at 1M on one H200: one sequence's 32.6 GB latent does not fit next to 98 GB of weights."""
    d = largest_batch_decode(KL.all_mla(), hardware("H200"), 1, M)
    assert d.batch == 0 and math.isnan(d.tpot_s) and d.throughput_tok_s == 0 and math.isnan(d.time_per_token_s)


def test_the_roofline_stays_below_the_reports_6x_at_1m():
    """What a roofline reproduces: at the largest batch each model fits, MLA / Kimi Linear time per token at 1M is
    near the KV-bytes ratio 27 / 7 ~ 3.9x on every 8-GPU setup, below Fig. 1b's 6.3x and the abstract's 6x:
    kernel efficiency at long context is outside a roofline."""
    for name in ("H100", "H200", "B200"):
        hw = hardware(name)
        kl, mla = largest_batch_decode(KL, hw, 8, M), largest_batch_decode(KL.all_mla(), hw, 8, M)
        ratio = mla.time_per_token_s / kl.time_per_token_s
        assert 3.0 < ratio < 27 / 7 * 1.05 < 6.0 < TPOT_FIG1B.ratio(M), (name, ratio)


@pytest.mark.parametrize("call, arg", [
    (lambda: max_batch(KL, hardware("H200"), 8, -1), "context"),
    (lambda: max_batch(KL, hardware("H200"), 8, 4096.0), "context"),
    (lambda: max_batch(KL, hardware("H200"), 8, "4096"), "context"),
    (lambda: max_batch(KL, hardware("H200"), 8, 4096, memory_fraction=1.5), "memory_fraction"),
    (lambda: max_batch(KL, hardware("H200"), True, 4096), "tp"),
], ids=["neg", "float", "str", "fraction", "tp-true"])
def test_bad_input_names_the_argument(call, arg):
    with pytest.raises(ValueError, match=arg):
        call()
