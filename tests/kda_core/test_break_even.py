"""kda_core.config break-even contexts of the real presets, with and without the conv state.

Worked by hand: MLA KV per token = num_mla_layers * (512 + 64) * 2 B (bf16); recurrent state =
num_kda_layers * H*K*V*4 B (fp32); conv state = num_kda_layers * (2HK + HV)*(W - 1)*2 B (bf16).
"""
import math

import pytest

from kda_core.config import PRESETS, break_even_tokens, custom_config, recurrent_break_even_tokens


@pytest.mark.parametrize("name, kda, mla, heads, recurrent, total", [
    pytest.param("kimi-linear-48b-a3b", 20, 7, 32, 5201, 5384, id="kimi-linear"),
    pytest.param("kimi-k3", 69, 24, 96, 15701, 16253, id="kimi-k3"),
])
def test_break_even_presets(name, kda, mla, heads, recurrent, total):
    cfg = PRESETS[name]
    per_token = mla * 576 * 2
    rec = kda * heads * 128 * 128 * 4
    conv = kda * 3 * heads * 128 * 3 * 2
    assert recurrent_break_even_tokens(cfg) == pytest.approx(rec / per_token, rel=1e-12)
    assert break_even_tokens(cfg) == pytest.approx((rec + conv) / per_token, rel=1e-12)
    assert math.floor(recurrent_break_even_tokens(cfg)) == recurrent
    assert math.floor(break_even_tokens(cfg)) == total


def test_break_even_without_mla_is_infinite():
    cfg = custom_config(num_layers=8, kda_per_mla=0, num_heads=4, head_dim=32)   # every layer MLA
    assert recurrent_break_even_tokens(cfg) == 0.0
    no_mla = PRESETS["demo"].__class__(**{**PRESETS["demo"].__dict__, "mla_layers": ()})
    assert math.isinf(recurrent_break_even_tokens(no_mla)) and math.isinf(break_even_tokens(no_mla))
