"""ModelShape presets: parameter totals against the published model sizes; hardware presets."""
import pytest

from kda_core.config import PRESETS as CONFIG_PRESETS
from kda_core.config import mla_kv_bytes_per_token
from serve.scale.hardware import GPUS, hardware
from serve.scale.model_shape import from_model_config, preset


def test_kimi_linear_total_and_active_params():
    """The model card: 48B total, 3B activated (the checkpoint counts 49.1B with the untied head)."""
    kl = preset("kimi-linear-48b-a3b")
    assert 48e9 <= kl.total_params <= 50e9
    assert 2.9e9 <= kl.active_params <= 3.3e9


def test_geometry_comes_from_model_config():
    for name in ("kimi-linear-48b-a3b", "kimi-k3"):
        cfg, shape = CONFIG_PRESETS[name], preset(name)
        assert shape.mla_layers == cfg.mla_layers and shape.num_layers == cfg.num_layers
        assert shape.num_mla_layers * shape.mla_kv_bytes_per_token_layer == mla_kv_bytes_per_token(cfg)


def test_all_mla_counterfactual():
    kl = preset("kimi-linear-48b-a3b")
    mla = kl.all_mla()
    assert mla.num_mla_layers == 27 and mla.num_kda_layers == 0
    assert mla.num_experts == kl.num_experts and mla.hidden_size == kl.hidden_size


def test_k3_routed_experts_are_mxfp4():
    k3 = preset("kimi-k3")
    assert k3.routed_expert_weight_bytes == pytest.approx(4.25 / 8)
    assert k3.num_kda_layers == 69 and k3.num_mla_layers == 24


def test_demo_config_has_no_sourced_figures():
    with pytest.raises(ValueError, match="cfg.name"):
        from_model_config(CONFIG_PRESETS["demo"])
    with pytest.raises(ValueError, match="name"):
        preset("demo")


def test_hardware_presets_are_datasheet_figures():
    assert hardware("H100").peak_bf16_flops == 989e12 and hardware("H100").hbm_bytes_per_s == 3.35e12
    assert hardware("H200").hbm_bytes == 141e9 and hardware("B200").nvlink_bytes_per_s == 1.8e12
    assert set(GPUS) == {"A100", "H100", "H200", "B200"}
    with pytest.raises(ValueError, match="hardware"):
        hardware("V100")


def test_one_k3_config_revision_everywhere():
    """kda_core's geometry and serve.scale's sourced figures cite the same Kimi K3 config.json revision."""
    revision = "f831ab66814297da540d832a5235f8e904f29d06"
    assert revision in CONFIG_PRESETS["kimi-k3"].source and revision in preset("kimi-k3").source
