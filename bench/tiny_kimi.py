"""A tiny random Kimi-Linear in the real checkpoint format, written with transformers (the model to check llama.cpp
against until trained weights in this format exist).

:func:`write_tiny_kimi` builds ``transformers.KimiLinearForCausalLM`` from :data:`TINY` (vocabulary 256 = the
bytes, 4 layers: KDA, KDA, MLA, KDA; layer 0 a dense SwiGLU, the others MoE with 4 experts, top-2, one shared
expert; fp32), gives the tensors that transformers initialises to constants random values (RMSNorm weights and
the router's ``e_score_correction_bias``, so a mistake in them shows), saves it with ``save_pretrained`` and
rewrites the folder into the real format with :func:`to_real_format`; then writes the byte tokenizer.

What ``save_pretrained`` writes differs from Moonshot's checkpoint (``moonshotai/Kimi-Linear-48B-A3B-Instruct``:
``config.json``, ``configuration_kimi.py``, ``modeling_kimi.py``) in two ways, which :func:`to_real_format` undoes:

- the dense layers' MLP: transformers names it ``block_sparse_moe.{gate,up,down}_proj`` (its conversion mapping
  renames ``block_sparse_moe`` -> ``mlp`` on load and back on save, for every layer); Moonshot's decoder layer
  names a dense layer's MLP ``mlp`` (``self.mlp = KimiMLP(...)``, vLLM's ``kimi_linear.py`` the same) and keeps
  ``block_sparse_moe`` for MoE layers. llama.cpp's converter maps only ``mlp.*`` to the dense FFN tensors.
- ``config.json``: transformers writes its own fields (``layer_types``, ``mlp_layer_types``, ``linear_num_heads``,
  ...); the real config has ``linear_attn_config`` (1-based ``kda_layers`` / ``full_attn_layers``, ``num_heads``,
  ``head_dim``, ``short_conv_kernel_size``), ``first_k_dense_replace``, ``moe_router_activation_func``
  ("sigmoid"; llama.cpp's converter writes the GGUF's ``expert_gating_func`` from it, and llama.cpp will not load
  a Kimi-Linear GGUF without that key), ``mla_use_nope``, ``num_key_value_heads`` equal to the heads (the converter splits ``kv_b_proj`` per
  KV head with it), and no token ids our 256-token vocabulary lacks.

transformers reads the rewritten folder with no missing or unexpected keys (``tests/test_bench_llama_cpp.py``).
Only for this tiny model: our own checkpoint writer emits the real format directly.
"""
from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import torch

from kda_core.tokenizer import BYTE_VOCAB_SIZE, MODEL_MAX_LENGTH, write_tokenizer

# transformers KimiLinearConfig arguments of the tiny model (its own field names).
TINY = dict(
    vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
    routed_scaling_factor=2.446, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    # 0.1 rather than transformers' 0.02: at 0.02 the tiny model's next-token distribution is nearly flat (median
    # top-1 / top-2 gap 0.03 nats) and greedy choices hinge on rounding; at 0.1 the median gap is 0.3 nats.
    initializer_range=0.1,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)

# transformers-only config.json fields, replaced by the real config's.
_HF_ONLY = ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
            "qk_head_dim", "output_router_logits", "pretraining_tp", "attention_bias", "attention_dropout")
_DENSE_MLP = re.compile(r"^(model\.layers\.(\d+)\.)block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")


def real_config(hf: dict) -> dict:
    """The real-format ``config.json`` of a transformers-saved Kimi-Linear config dict ``hf`` (not modified).
    Raises ``ValueError`` naming the field if the layer types are not a KDA/MLA pattern or the dense layers do
    not come first."""
    cfg = {k: v for k, v in hf.items() if k not in _HF_ONLY}
    layers, mlps = hf["layer_types"], hf["mlp_layer_types"]
    if set(layers) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types: only linear_attention / full_attention are Kimi-Linear layers, got {layers}")
    dense = mlps.index("sparse") if "sparse" in mlps else len(mlps)
    if mlps != ["dense"] * dense + ["sparse"] * (len(mlps) - dense):
        raise ValueError(f"mlp_layer_types: the real format has dense layers first (first_k_dense_replace), got {mlps}")
    cfg["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, t in enumerate(layers) if t == "full_attention"],  # 1-based
        "kda_layers": [i + 1 for i, t in enumerate(layers) if t == "linear_attention"],
        "num_heads": hf["linear_num_heads"], "head_dim": hf["linear_head_dim"],
        "short_conv_kernel_size": hf["linear_conv_kernel_dim"],
    }
    cfg.update(
        first_k_dense_replace=dense, moe_layer_freq=1, moe_router_activation_func="sigmoid", use_grouped_topk=True,
        mla_use_nope=True, num_nextn_predict_layers=0, num_key_value_heads=hf["num_attention_heads"],
        head_dim=hf["hidden_size"] // hf["num_attention_heads"],  # Moonshot's configuration_kimi.py default
        model_max_length=MODEL_MAX_LENGTH,
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):   # ids past the vocabulary mean nothing here
        if cfg.get(key) is not None and not 0 <= cfg[key] < hf["vocab_size"]:
            cfg[key] = None
    return dict(sorted(cfg.items()))


def real_name(name: str, first_k_dense: int) -> str:
    """Moonshot's name of a tensor that transformers saved as ``name``: a dense layer's (index < ``first_k_dense``)
    ``block_sparse_moe.{gate,up,down}_proj`` is ``mlp.*``; every other name is already Moonshot's."""
    m = _DENSE_MLP.match(name)
    if m and int(m.group(2)) < first_k_dense:
        return f"{m.group(1)}mlp.{m.group(3)}"
    return name


def to_real_format(src: str | Path, dst: str | Path) -> Path:
    """Rewrite the transformers-saved Kimi-Linear folder ``src`` (one ``model.safetensors``) into ``dst`` in the
    real checkpoint format (config and tensor names as above; tensors and dtypes unchanged). Returns ``dst``.
    Raises ``FileNotFoundError`` naming the missing file."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    for name in ("config.json", "model.safetensors"):
        if not (src / name).is_file():
            raise FileNotFoundError(f"{src / name} not found (to_real_format reads a save_pretrained folder)")
    cfg = real_config(json.loads((src / "config.json").read_text()))
    tensors = load_file(src / "model.safetensors")
    renamed = {real_name(k, cfg["first_k_dense_replace"]): v for k, v in tensors.items()}
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(renamed, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _randomise_constants(model: torch.nn.Module, gen: torch.Generator) -> None:
    """RMSNorm weights ~ U(0.5, 1.5) and router biases ~ N(0, 0.1), in place (transformers sets 1 and 0)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "norm.weight")):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def write_tiny_kimi(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny random Kimi-Linear (:data:`TINY`, fp32, ``seed``) into ``folder`` in the real format, with
    the byte tokenizer. Returns the folder."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**TINY)).float().eval()
    _randomise_constants(model, torch.Generator().manual_seed(seed))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        to_real_format(tmp, folder)
    write_tokenizer(folder)
    return Path(folder)
