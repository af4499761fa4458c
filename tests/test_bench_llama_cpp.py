"""bench.tiny_kimi (the real-format rewrite), bench.llama_cpp's alignment of llama-server's log-probs and
bench.kimi_agreement's measures. llama.cpp itself is not needed (the bench runs it)."""
import json

import pytest
import torch

from bench.kimi_agreement import Transformers, first_difference, kda_l2norm_eps, max_abs_delta
from bench.llama_cpp import listed_positions
from bench.tiny_kimi import TINY, real_config, to_real_format

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_kimi")
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**TINY)).eval()
    model.save_pretrained(root / "hf")
    to_real_format(root / "hf", root / "real")
    return root / "hf", root / "real"


def test_to_real_format_names_and_config(folders):
    from safetensors import safe_open

    _, real = folders
    cfg = json.loads((real / "config.json").read_text())
    assert cfg["linear_attn_config"] == {"full_attn_layers": [3], "kda_layers": [1, 2, 4], "num_heads": 4,
                                         "head_dim": 16, "short_conv_kernel_size": 4}
    assert cfg["first_k_dense_replace"] == 1 and cfg["moe_router_activation_func"] == "sigmoid"
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"] and cfg["mla_use_nope"] is True
    assert not {"layer_types", "mlp_layer_types", "linear_num_heads"} & set(cfg)
    with safe_open(real / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} <= names
    assert not any(n.startswith("model.layers.0.block_sparse_moe") for n in names)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in names


def test_to_real_format_loads_in_transformers_unchanged(folders):
    hf, real = folders
    a = transformers.KimiLinearForCausalLM.from_pretrained(hf).eval()
    b, info = transformers.KimiLinearForCausalLM.from_pretrained(real, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert b.config.layer_types == TINY["layer_types"] and b.config.mlp_layer_types == TINY["mlp_layer_types"]
    ids = torch.tensor([list(b"def f(x):\n    return")])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b.eval()(ids).logits)


def test_real_config_rejects_dense_after_sparse():
    hf = {**TINY, "mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]}
    with pytest.raises(ValueError, match="mlp_layer_types"):
        real_config(hf)


def test_to_real_format_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        to_real_format(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("tokens, listed", [
    pytest.param(list(b"ab\n"), [0, 1, 2], id="ascii"),
    pytest.param([0x41, 0xC3, 0xA9], [0, 2], id="2-byte"),
    pytest.param([0xE2, 0x82, 0xAC, 0x41], [2, 3], id="3-byte"),
    pytest.param([0xF0, 0x9F, 0xA6, 0x99], [3], id="4-byte"),
    pytest.param([0xE2, 0x41, 0x42, 0x43], [2, 3], id="invalid-lead-then-ascii"),
    pytest.param([0x80, 0xBF], [0, 1], id="lone-continuations"),
    pytest.param([0x41, 0xF0], [0], id="ends-mid-character"),
])
def test_listed_positions(tokens, listed):
    assert listed_positions(tokens) == listed


def test_max_abs_delta_and_first_difference():
    ref = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 0.0]]), -1)
    top = [{2: ref[0, 2].item(), 1: ref[0, 1].item() + 0.25}, {0: ref[1, 0].item() - 0.5}]
    assert max_abs_delta(top, ref) == pytest.approx(0.5)
    assert first_difference([1, 2, 3], [1, 2, 3]) is None and first_difference([1, 2, 3], [1, 5, 3]) == 1


def test_kda_l2norm_eps_changes_the_reference_then_restores_it(folders):
    ref = Transformers(folders[1])
    ids = list(b"def f(x):\n    return x")
    before = ref.logprobs(ids, 4)
    with kda_l2norm_eps(1e-2):
        during = ref.logprobs(ids, 4)
    assert (during - before).abs().max() > 1e-4
    assert torch.equal(ref.logprobs(ids, 4), before)


def test_router_margins(folders):
    ref = Transformers(folders[1])
    ids = list(b"def f(x):\n    return x")
    margins = ref.router_margins(ids, 5)
    assert margins.shape == (5,) and (margins >= 0).all()
    gate = ref.model.model.layers[1].mlp.gate                 # recompute layer 1's margin by hand: an upper bound
    seen = []
    handle = gate.register_forward_hook(lambda m, a, o: seen.append(a[0].reshape(-1, m.hidden_dim)))
    with torch.no_grad():
        ref.model(torch.tensor([ids]))
    handle.remove()
    scores = torch.sigmoid(seen[0] @ gate.weight.T) + gate.e_score_correction_bias
    top = scores.sort(-1, descending=True).values
    assert (margins <= (top[:, gate.top_k - 1] - top[:, gate.top_k])[-6:-1] + 1e-7).all()
