"""Parse a Hugging Face ``config.json`` of the Kimi-Linear / Kimi K3 format into a ``ModelShape``.

Accepted: a ``kimi_linear`` config at the top level (Kimi-Linear-48B-A3B) or nested in
``text_config`` (Kimi K3, ``model_type`` ``kimi_k3``). Layer lists in
``linear_attn_config.full_attn_layers`` are 1-based (as in the published configs); the shape's are
0-based. Every error is a ValueError naming the field by its path in the file, e.g.
``text_config.linear_attn_config.full_attn_layers``.

Optional fields and the defaults used when absent (those of the published ``KimiLinearConfig``):
``first_k_dense_replace`` 0, ``num_shared_experts`` 0, ``routed_expert_hidden_size`` = hidden_size,
``mla_use_output_gate`` false, ``tie_word_embeddings`` false, ``moe_layer_freq`` 1,
``linear_attn_config.use_full_rank_gate`` false, ``dtype`` / ``torch_dtype`` bfloat16.
Weight formats: bf16 everywhere, or routed experts in ``mxfp4-pack-quantized`` (4-bit, group 32).
"""
from __future__ import annotations

from collections.abc import Mapping

from serve.scale.model_shape import MXFP4_BYTES_PER_WEIGHT, ModelShape

REQUIRED = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size", "num_experts",
            "num_experts_per_token", "moe_intermediate_size")
REQUIRED_LINEAR = ("full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size")


def _int(section: Mapping, key: str, prefix: str, default: int | None = None, allow_null: bool = False) -> int:
    path = prefix + key
    if key not in section:
        if default is None:
            raise ValueError(f"missing field {path!r} (required for the roofline)")
        return default
    val = section[key]
    if val is None and allow_null:
        return 0
    if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
        raise ValueError(f"field {path!r} must be a positive int, got {val!r}")
    return val


def _count(section: Mapping, key: str, prefix: str) -> int:
    """An optional count (>= 0, absent or null = 0)."""
    val = section.get(key) or 0
    if not isinstance(val, int) or isinstance(val, bool) or val < 0:
        raise ValueError(f"field {prefix + key!r} must be an int >= 0, got {val!r}")
    return val


def _bool(section: Mapping, key: str, prefix: str) -> bool:
    val = section.get(key, False)
    if not isinstance(val, bool):
        raise ValueError(f"field {prefix + key!r} must be true or false, got {val!r}")
    return val


def _weight_formats(text: Mapping, prefix: str) -> tuple[float, float]:
    """(bytes per dense weight, bytes per routed-expert weight)."""
    for key in ("dtype", "torch_dtype"):
        if key in text and text[key] != "bfloat16":
            raise ValueError(f"field {prefix + key!r}: only 'bfloat16' weights are supported, got {text[key]!r}")
    quant = text.get("quantization_config")
    if quant is None:
        return 2.0, 2.0
    if not isinstance(quant, Mapping):
        raise ValueError(f"field {prefix + 'quantization_config'!r} must be an object, got {type(quant).__name__}")
    fmt = quant.get("format")
    if fmt != "mxfp4-pack-quantized":
        raise ValueError(f"field {prefix + 'quantization_config.format'!r}: only 'mxfp4-pack-quantized' is supported, "
                         f"got {fmt!r}")
    return 2.0, MXFP4_BYTES_PER_WEIGHT


def from_hf_config(config: Mapping, name: str = "uploaded") -> ModelShape:
    """A ``ModelShape`` from a parsed ``config.json`` (a dict). Raises ValueError naming the missing,
    malformed or unsupported field."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a JSON object (dict), got {type(config).__name__}")
    text, prefix = (config["text_config"], "text_config.") if "text_config" in config else (config, "")
    if not isinstance(text, Mapping):
        raise ValueError(f"field 'text_config' must be an object, got {type(text).__name__}")
    model_type = text.get("model_type", "kimi_linear")
    if model_type != "kimi_linear":
        raise ValueError(f"field {prefix + 'model_type'!r}: only 'kimi_linear' is supported, got {model_type!r}")
    vals = {key: _int(text, key, prefix, allow_null=key == "q_lora_rank") for key in REQUIRED}
    lin = text.get("linear_attn_config")
    lin_prefix = prefix + "linear_attn_config."
    if not isinstance(lin, Mapping):
        raise ValueError(f"missing field {prefix + 'linear_attn_config'!r} (a KDA/MLA hybrid needs it)")
    for key in REQUIRED_LINEAR[1:]:
        vals["lin_" + key] = _int(lin, key, lin_prefix)
    full = lin.get("full_attn_layers")
    n = vals["num_hidden_layers"]
    if (not isinstance(full, list) or len(set(map(repr, full))) != len(full)
            or any(isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= n for i in full)):
        raise ValueError(f"field {lin_prefix + 'full_attn_layers'!r} must be a list of distinct 1-based layer numbers "
                         f"(ints, not true/false) in [1, {n}], got {full!r}")
    if text.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"field {prefix + 'moe_layer_freq'!r}: only 1 (MoE in every layer) is supported, "
                         f"got {text['moe_layer_freq']!r}")
    weight_bytes, expert_bytes = _weight_formats(text, prefix)
    hidden = vals["hidden_size"]
    return ModelShape(
        name=name, num_layers=n, mla_layers=tuple(sorted(i - 1 for i in full)), hidden_size=hidden,
        vocab_size=vals["vocab_size"], kda_heads=vals["lin_num_heads"], kda_head_dim=vals["lin_head_dim"],
        conv_kernel=vals["lin_short_conv_kernel_size"], full_rank_gate=_bool(lin, "use_full_rank_gate", lin_prefix),
        mla_heads=vals["num_attention_heads"], q_lora_rank=vals["q_lora_rank"], kv_lora_rank=vals["kv_lora_rank"],
        qk_nope_head_dim=vals["qk_nope_head_dim"], qk_rope_head_dim=vals["qk_rope_head_dim"],
        v_head_dim=vals["v_head_dim"], mla_output_gate=_bool(text, "mla_use_output_gate", prefix),
        first_dense_layers=_count(text, "first_k_dense_replace", prefix),
        dense_intermediate_size=vals["intermediate_size"], num_experts=vals["num_experts"],
        experts_per_token=vals["num_experts_per_token"],
        num_shared_experts=_count(text, "num_shared_experts", prefix),
        moe_intermediate_size=vals["moe_intermediate_size"],
        routed_expert_hidden_size=_int(text, "routed_expert_hidden_size", prefix, default=hidden),
        tie_word_embeddings=_bool(text, "tie_word_embeddings", prefix), weight_bytes=weight_bytes,
        routed_expert_weight_bytes=expert_bytes, source=f"uploaded config.json ({name})")
