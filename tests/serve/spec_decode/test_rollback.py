"""Rollback buffers: nonzero, measured nbytes equal the analytic formulas (fixed values), K3 table."""
import pytest
import torch

from kda_core.config import PRESETS
from kda_core.conv import short_conv
from lab.rollback import LAYER_PRESETS, measure_layer_bytes, model_rollback_row, model_rollback_table
from serve.spec_decode.replay_ssm import replay_ssm_bytes_per_token
from serve.spec_decode.rollback import (
    LayerShape,
    conv_window_after,
    projection_bytes_per_token,
    raw_input_bytes_per_token,
    snapshot_bytes_per_token,
)
from serve.spec_decode.verify import verify_and_replay
from tests.serve.spec_decode.helpers import STRATEGY_IDS, make_strategy, one_thread, prefilled, tiny_model

pytestmark = pytest.mark.usefixtures(one_thread.__name__)
TINY = LayerShape.from_config(PRESETS["demo-tiny"])          # H=2, K=16, V=12, W=4, d=32


def test_per_token_formulas_fixed_values():
    assert TINY.conv_dim == 2 * (2 * 16 + 12) == 88
    assert snapshot_bytes_per_token(TINY, 4) == 2 * 16 * 12 * 4 + 88 * 3 * 4 == 2592
    assert projection_bytes_per_token(TINY, 4) == 2 * (2 * 16 + 12 + 1) * 4 + 88 * 4 == 712
    assert raw_input_bytes_per_token(TINY, 4) == 32 * 4 == 128
    assert replay_ssm_bytes_per_token(TINY, 4) == 2 * (2 * 16 + 12) * 4 + 88 * 4 == 704    # k, u, g + conv inputs


@pytest.mark.parametrize("kind, expected", [("snapshot", 5 * 3 * 2592), ("projection", 5 * 3 * 712),
                                            ("ring", 24 * 3 * 128), ("replayssm", 24 * 3 * 704)],
                         ids=STRATEGY_IDS)
def test_strategy_nbytes_after_verify_equal_formula(kind, expected):
    """demo-tiny, 4 drafts (T = 5 verify tokens), 3 KDA layers; both rings have 24 slots."""
    model = tiny_model()
    strategy = make_strategy(kind)
    res = verify_and_replay(model, prefilled(model), [1, 2, 3, 4], strategy)
    assert res.rollback_bytes == expected > 0
    strategy.check_integrity()
    assert strategy.nbytes() == (expected if kind in ("ring", "replayssm") else 0)        # per-verify buffers released


@pytest.mark.parametrize("preset", list(LAYER_PRESETS)[:3], ids=["S0", "S1", "S2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_measure_layer_bytes(preset, dtype):
    rows = measure_layer_bytes(LAYER_PRESETS[preset], 3, dtype)
    assert [r.strategy for r in rows] == ["snapshot", "projection replay", "raw-input ring", "ReplaySSM"]
    for r in rows:
        assert r.measured_bytes == r.formula_bytes > 0
    assert rows[0].vs_snapshot == 1.0 and rows[0].measured_bytes > rows[1].measured_bytes > rows[2].measured_bytes
    assert rows[0].measured_bytes > rows[3].measured_bytes       # ReplaySSM records: u in place of v and beta


def test_k3_whole_model_per_draft_token():
    row = model_rollback_row(PRESETS["kimi-k3"])
    assert row["snapshot state MiB"] * 2 ** 20 == 69 * 96 * 128 * 128 * 4 == 434_110_464       # 414.0 MiB
    assert row["projections k,v,g,beta MiB"] * 2 ** 20 == 69 * 96 * (2 * 128 + 128 + 1) * 2 == 5_100_480
    assert row["raw inputs MiB"] * 2 ** 20 == 69 * 7168 * 2 == 989_184                           # 0.94 MiB
    assert round(row["snapshot state MiB"]) == 414 and round(row["projections k,v,g,beta MiB"], 1) == 4.9
    assert round(row["raw inputs MiB"], 2) == 0.94
    assert row["ReplaySSM k,u,g MiB"] * 2 ** 20 == 69 * 96 * (2 * 128 + 128) * 2 == 5_087_232
    assert [r["model"] for r in model_rollback_table()] == ["kimi-linear-48b-a3b", "kimi-k3", "demo"]


@pytest.mark.parametrize("num_tokens", [0, 1, 2, 3, 5])
def test_conv_window_after_equals_short_conv_state(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    state, raw = torch.randn(1, 6, 3, generator=gen), torch.randn(1, 5, 6, generator=gen)
    _, expected = short_conv(raw[:, :num_tokens], torch.randn(6, 4, generator=gen), state) if num_tokens else (None, state)
    assert torch.equal(conv_window_after(state, raw, num_tokens), expected)
