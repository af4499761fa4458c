"""Parsing a Hugging Face config.json of the Kimi-Linear / K3 format into a ModelShape."""
import copy

import pytest

from serve.scale.hf_config import from_hf_config
from serve.scale.model_shape import preset

# moonshotai/Kimi-Linear-48B-A3B-Instruct config.json: the fields the roofline reads (values as
# published on the Hugging Face model page; the same values appear in the vLLM / Megatron-Bridge
# Kimi-Linear test fixtures).
KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "torch_dtype": "bfloat16",
    "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27, "num_attention_heads": 32,
    "num_key_value_heads": 32, "intermediate_size": 9216, "head_dim": 72,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "num_heads": 32, "head_dim": 128,
        "short_conv_kernel_size": 4},
    "num_experts": 256, "moe_intermediate_size": 1024, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "num_experts_per_token": 8, "num_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "tie_word_embeddings": False,
}

# moonshotai/Kimi-K3 config.json text_config (revision f831ab66814297da540d832a5235f8e904f29d06).
K3 = {
    "model_type": "kimi_k3",
    "text_config": {
        "model_type": "kimi_linear", "dtype": "bfloat16", "vocab_size": 163840, "hidden_size": 7168,
        "num_hidden_layers": 93, "num_attention_heads": 96, "num_key_value_heads": 96,
        "intermediate_size": 33792, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "tie_word_embeddings": False,
        "linear_attn_config": {"full_attn_layers": list(range(4, 93, 4)) + [93], "num_heads": 96,
                               "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                               "gate_lower_bound": -5.0},
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
    },
}


@pytest.mark.parametrize("config, name", [(KIMI_LINEAR, "kimi-linear-48b-a3b"), (K3, "kimi-k3")], ids=["kl", "k3"])
def test_real_config_equals_the_preset(config, name):
    parsed = from_hf_config(config, name=name)
    assert parsed == preset(name)  # every field but source


def _without(path):
    cfg = copy.deepcopy(K3)
    *parents, leaf = path.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    del node[leaf]
    return cfg


@pytest.mark.parametrize("path", ["text_config.hidden_size", "text_config.kv_lora_rank",
                                  "text_config.num_experts_per_token",
                                  "text_config.linear_attn_config.head_dim",
                                  "text_config.linear_attn_config"])
def test_missing_field_is_named(path):
    with pytest.raises(ValueError, match=path.replace(".", r"\.")):
        from_hf_config(_without(path))


@pytest.mark.parametrize("patch, path", [
    ({"hidden_size": "2304"}, "hidden_size"),
    ({"model_type": "deepseek_v3"}, "model_type"),
    ({"torch_dtype": "float16"}, "torch_dtype"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
    ({"quantization_config": {"format": "int4"}}, "quantization_config.format"),
    ({"linear_attn_config": {**KIMI_LINEAR["linear_attn_config"], "full_attn_layers": [0, 4]}},
     "linear_attn_config.full_attn_layers"),
], ids=["type", "model_type", "dtype", "moe_freq", "dense", "quant", "layers"])
def test_bad_field_is_named(patch, path):
    with pytest.raises(ValueError, match=path):
        from_hf_config({**KIMI_LINEAR, **patch})


def test_not_a_dict():
    with pytest.raises(ValueError, match="config"):
        from_hf_config([1, 2])


@pytest.mark.parametrize("layers", [[True, 4], [4, 4], [4.0]], ids=["true", "duplicate", "float"])
def test_full_attn_layers_are_distinct_ints(layers):
    """JSON ``true`` is a bool, not layer 1 (the old reader took it as layer 1); a repeated layer is named too."""
    lin = {**KIMI_LINEAR["linear_attn_config"], "full_attn_layers": layers}
    with pytest.raises(ValueError, match=r"linear_attn_config\.full_attn_layers"):
        from_hf_config({**KIMI_LINEAR, "linear_attn_config": lin})
