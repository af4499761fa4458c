"""Trained weights on disk: ``safetensors`` tensors + a Hugging Face style ``config.json``.

A model folder holds ``model.safetensors`` (the ``HybridLM`` state dict, names as ``state_dict()`` gives
them, stored in fp16 or bf16) and ``config.json``. The config follows Kimi-Linear's published layout
(``moonshotai/Kimi-Linear-48B-A3B-Instruct`` ``config.json``): top-level MLA and model sizes,
``linear_attn_config`` with 1-based ``full_attn_layers`` / ``kda_layers``, ``num_heads``, ``head_dim``,
``short_conv_kernel_size``; plus ``head_k_dim`` / ``head_v_dim`` (ours may differ) and the gate form.

:func:`load` checks every tensor name and shape against the model the config describes and raises
ValueError naming the first missing, unexpected or mis-shaped tensor, or the missing config key.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kda_core.config import ModelConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODEL_TYPE = "kda_hybrid"
ARCHITECTURE = "HybridLM"
STORE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The ``config.json`` dict of ``cfg`` with weights stored in ``dtype`` (fp16 or bf16)."""
    names = {v: k for k, v in STORE_DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(STORE_DTYPES)}, got {dtype}")
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "name": cfg.name, "torch_dtype": names[dtype],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_mla_heads,
        "kv_lora_rank": cfg.kv_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "v_head_dim": cfg.v_head_dim, "rms_norm_eps": 1e-6,
        "linear_attn_config": {
            "full_attn_layers": [i + 1 for i in cfg.mla_layers], "kda_layers": [i + 1 for i in cfg.kda_layers],
            "num_heads": cfg.num_heads, "head_dim": cfg.head_k_dim, "head_k_dim": cfg.head_k_dim,
            "head_v_dim": cfg.head_v_dim, "short_conv_kernel_size": cfg.conv_kernel, "gate": cfg.gate,
            "gate_lower_bound": cfg.lower_bound},
        "seed": cfg.seed, "source": cfg.source,
    }


def config_from_hf(d: dict) -> ModelConfig:
    """The :class:`ModelConfig` of a ``config.json`` dict. Raises ValueError on a missing key or another
    model type (and whatever ``ModelConfig`` rejects)."""
    try:
        if d["model_type"] != MODEL_TYPE:
            raise ValueError(f"config.json model_type must be {MODEL_TYPE!r}, got {d['model_type']!r}")
        lin = d["linear_attn_config"]
        return ModelConfig(
            name=d["name"], num_layers=d["num_hidden_layers"], mla_layers=tuple(i - 1 for i in lin["full_attn_layers"]),
            hidden_size=d["hidden_size"], num_heads=lin["num_heads"], head_k_dim=lin["head_k_dim"],
            head_v_dim=lin["head_v_dim"], kv_lora_rank=d["kv_lora_rank"], qk_rope_head_dim=d["qk_rope_head_dim"],
            gate=lin["gate"], lower_bound=lin["gate_lower_bound"], conv_kernel=lin["short_conv_kernel_size"],
            vocab_size=d["vocab_size"], num_mla_heads=d["num_attention_heads"], qk_nope_head_dim=d["qk_nope_head_dim"],
            v_head_dim=d["v_head_dim"], intermediate_size=d["intermediate_size"], seed=d.get("seed", 0),
            source=d.get("source", ""))
    except KeyError as e:
        raise ValueError(f"config.json is missing the key {e.args[0]!r}") from None


def save(model, path, dtype: torch.dtype = torch.float16) -> dict:
    """Write ``model`` (a ``HybridLM``) to folder ``path``: weights cast to ``dtype`` and ``config.json``.
    Returns the config dict. Raises ValueError for a dtype other than fp16 / bf16 or a non-finite weight
    after the cast (an fp16 overflow)."""
    from safetensors.torch import save_file

    conf = hf_config(model.cfg, dtype)
    state = {name: t.detach().to(dtype).contiguous() for name, t in model.state_dict().items()}
    bad = [name for name, t in state.items() if not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"weights {bad[:3]} are not finite in {dtype} (overflow); store bf16 instead")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(conf, indent=2) + "\n")
    return conf


def check_state(expected: dict, got: dict) -> None:
    """Raise ValueError unless ``got`` has exactly the names of ``expected`` with the same shapes."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        raise ValueError(f"weights do not match the config's model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in expected.items():
        if tuple(got[name].shape) != tuple(t.shape):
            raise ValueError(f"weight {name!r} must have shape {tuple(t.shape)}, got {tuple(got[name].shape)}")


def load(path) -> tuple[ModelConfig, dict]:
    """Read a model folder: (config, state dict of fp32 tensors). Names and shapes are checked later by
    :func:`check_state` against the model built from the config. Raises ValueError for a missing folder or file."""
    from safetensors.torch import load_file

    folder = Path(path)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (folder / name).is_file():
            raise ValueError(f"path must be a model folder holding {CONFIG_NAME} and {WEIGHTS_NAME}; "
                             f"{folder / name} does not exist")
    cfg = config_from_hf(json.loads((folder / CONFIG_NAME).read_text()))
    state = {name: t.to(torch.float32) for name, t in load_file(str(folder / WEIGHTS_NAME)).items()}
    return cfg, state
