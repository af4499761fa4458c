"""kda_core.config: the byte figures of the real models (fixed values from the published configs)."""
import pytest
import torch

from kda_core import config as kc


def test_layer_patterns():
    kl, k3 = kc.PRESETS["kimi-linear-48b-a3b"], kc.PRESETS["kimi-k3"]
    assert kl.mla_layers == (3, 7, 11, 15, 19, 23, 26) and kl.num_kda_layers == 20
    assert k3.mla_layers == tuple(range(3, 92, 4)) + (92,) and (k3.num_kda_layers, k3.num_mla_layers) == (69, 24)


@pytest.mark.parametrize("name,kv,state,conv,breakeven,allmla", [
    ("kimi-linear-48b-a3b", 8064, 2_097_152, 73_728, 5384, 31_104),
    ("kimi-k3", 27_648, 6_291_456, 221_184, 16_253, 107_136),
])
def test_bytes(name, kv, state, conv, breakeven, allmla):
    cfg = kc.PRESETS[name]
    assert kc.mla_kv_bytes_per_token(cfg, torch.bfloat16) == kv
    assert kc.kda_state_bytes_per_layer(cfg, torch.float32) == state
    assert kc.conv_state_bytes_per_layer(cfg, torch.bfloat16) == conv
    assert kc.fixed_state_bytes_per_sequence(cfg) == cfg.num_kda_layers * (state + conv)
    assert round(kc.break_even_tokens(cfg)) == breakeven
    assert kc.all_mla_kv_bytes_per_token(cfg) == allmla


def test_k3_tp8_state():
    assert kc.kda_state_bytes_per_layer(kc.PRESETS["kimi-k3"], torch.float32, tp_size=8) == 786_432  # 0.75 MiB


def test_sequence_bytes_and_table():
    cfg = kc.PRESETS["kimi-linear-48b-a3b"]
    sb = kc.sequence_bytes(cfg, 1000)
    assert sb.mla_kv_bytes == 8064 * 1000 and sb.total_bytes == sb.mla_kv_bytes + sb.kda_state_bytes
    rows = kc.layer_table(cfg, 1000)
    assert sum(r["bytes_at_context"] for r in rows) == sb.total_bytes


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_layers=0), "num_layers"),
    (dict(mla_layers=(30,)), "mla_layers"),
    (dict(gate="relu"), "gate"),
    (dict(gate="lower_bound", lower_bound=None), "lower_bound"),
    # 3 experts from the one kept group of 2: the torch form routed to a masked-out expert, the C form raised
    (dict(num_experts=8, num_expert_group=4, topk_group=1, num_experts_per_token=3), "num_experts_per_token"),
])
def test_validation(kwargs, match):
    base = dict(name="x", num_layers=8, mla_layers=(3, 7), hidden_size=64, num_heads=2, head_k_dim=16,
                head_v_dim=16, kv_lora_rank=16, qk_rope_head_dim=8)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        kc.ModelConfig(**base)


def test_every_preset_has_a_title():
    from kda_core.config import PRESET_TITLES, PRESETS, preset_title
    assert set(PRESET_TITLES) == set(PRESETS)
    assert preset_title("kimi-k3") == "Kimi K3"
    with pytest.raises(ValueError, match="name must be one of"):
        preset_title("kimi-k2")
