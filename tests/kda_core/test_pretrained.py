"""kda_core.pretrained + HybridLM.from_pretrained: safetensors + config.json round trip, names and shapes
checked with an error that names the tensor or key."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kda_core.config import PRESETS
from kda_core.model import HybridLM
from kda_core.pretrained import config_from_hf, hf_config


@pytest.mark.parametrize("preset", ["demo-tiny", "demo-k3gate"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_from_pretrained_round_trip(tmp_path, preset, dtype):
    cfg = PRESETS[preset]
    model = HybridLM(cfg)
    conf = model.save_pretrained(tmp_path, dtype)
    assert json.loads((tmp_path / "config.json").read_text()) == conf
    assert config_from_hf(conf) == cfg
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert set(stored) == set(model.state_dict()) and all(t.dtype == dtype for t in stored.values())
    loaded = HybridLM.from_pretrained(tmp_path)
    assert loaded.cfg == cfg and not loaded.training
    for name, t in loaded.state_dict().items():
        assert t.dtype == torch.float32
        assert torch.equal(t, model.state_dict()[name].to(dtype).float()), name
    # The loaded model is the original with its weights rounded to dtype: same logits as rounding by hand.
    rounded = HybridLM(cfg)
    rounded.load_state_dict({n: t.to(dtype).float() for n, t in model.state_dict().items()})
    x = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(x).logits, rounded(x).logits)


def test_hf_config_layout():
    conf = hf_config(PRESETS["demo"], torch.float16)
    assert conf["architectures"] == ["HybridLM"] and conf["torch_dtype"] == "float16"
    assert conf["linear_attn_config"]["full_attn_layers"] == [4, 8]          # 1-based, as Kimi-Linear's
    assert conf["linear_attn_config"]["kda_layers"] == [1, 2, 3, 5, 6, 7]
    with pytest.raises(ValueError, match="dtype"):
        hf_config(PRESETS["demo"], torch.float32)


def _saved(tmp_path):
    HybridLM(PRESETS["demo-tiny"]).save_pretrained(tmp_path)
    return load_file(str(tmp_path / "model.safetensors"))


def test_from_pretrained_rejects_a_wrong_shape(tmp_path):
    state = _saved(tmp_path)
    state["mixers.0.qkv_proj"] = state["mixers.0.qkv_proj"][:-1].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"mixers\.0\.qkv_proj.*shape"):
        HybridLM.from_pretrained(tmp_path)


def test_from_pretrained_rejects_missing_and_extra_tensors(tmp_path):
    state = _saved(tmp_path)
    del state["lm_head"]
    state["extra.weight"] = torch.zeros(2, dtype=torch.float16)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['lm_head'\], unexpected \['extra.weight'\]"):
        HybridLM.from_pretrained(tmp_path)


def test_from_pretrained_rejects_a_config_of_another_shape(tmp_path):
    _saved(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["intermediate_size"] *= 2
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=r"mlp_up\.0.*shape"):
        HybridLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("key", ["hidden_size", "linear_attn_config"])
def test_from_pretrained_names_a_missing_config_key(tmp_path, key):
    _saved(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    del conf[key]
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=f"missing the key '{key}'"):
        HybridLM.from_pretrained(tmp_path)


def test_from_pretrained_rejects_a_missing_folder_and_model_type(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        HybridLM.from_pretrained(tmp_path / "nowhere")
    _saved(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="model_type"):
        HybridLM.from_pretrained(tmp_path)


def test_save_rejects_an_fp16_overflow(tmp_path):
    model = HybridLM(PRESETS["demo-tiny"])
    with torch.no_grad():
        model.lm_head[0, 0] = 1e6
    with pytest.raises(ValueError, match="lm_head.*bf16"):
        model.save_pretrained(tmp_path, torch.float16)
    model.save_pretrained(tmp_path, torch.bfloat16)                      # bf16 holds it
