"""What vLLM picks for a KDA/MLA hybrid's attention block, beside our page-size policy
(:mod:`serve.memory.layout`).

What vLLM itself picks (:func:`vllm_block_pick`) differs from our "unified" policy in two ways. vLLM pages are
*per layer*: an attention page holds ``block_size`` tokens of one MLA layer (``MLAAttentionSpec``:
``kv_lora_rank + qk_rope_head_dim`` values), a KDA ("mamba") page holds one KDA layer's state
(``MambaStateShapeCalculator.kda_state_shape``: conv ``[W - 1 (+ drafts), 2HK + HV]`` in the model
dtype, recurrent ``[H, K, V]`` in fp32, ``kda_state_dtype``; heads divided by TP). And the block is
aligned to the attention backend's kernel block size, not to 16:
``Platform._align_hybrid_block_size`` (``vllm/platforms/interface.py``; before that
``HybridAttentionMambaModelConfig.verify_and_update_config`` in ``vllm/model_executor/models/config.py``)
sets ``align = max(min(backend.get_supported_kernel_block_sizes()), cache_config.block_size)`` and,
without prefix caching or with ``mamba_cache_mode="align"``,
``block = align * cdiv(mamba_page, align * attn_page_1_token)``; the mamba page is padded to the
attention page. Kernel block sizes of the MLA backends: FlashMLA [64], FlashInfer MLA [32, 64],
CUTLASS MLA [128] (``vllm/v1/attention/backends/mla/*.py``). The ``mamba_cache_mode="all"`` branch
(alignment to the mamba chunk size) is not modelled.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kda_core.config import ModelConfig, conv_state_bytes_per_layer, dtype_bytes, kda_state_bytes_per_layer
from serve.errors import check_int
from serve.memory.layout import REAL_DTYPES, CacheLayout

# Kernel block sizes (tokens) of vLLM's MLA attention backends: min of get_supported_kernel_block_sizes().
VLLM_MLA_KERNEL_BLOCK = {"FlashInfer MLA": 32, "FlashMLA": 64, "CUTLASS MLA": 128}


class VLLMBlockPick(NamedTuple):
    """The attention block vLLM's ``_align_hybrid_block_size`` picks for a KDA/MLA hybrid (bytes per
    layer, one TP rank): ``align`` (tokens), ``block_size`` (tokens), ``attn_page_bytes`` = block_size x
    one MLA layer's latent bytes per token, ``state_bytes`` = one KDA layer's recurrent + conv state
    (the unpadded mamba page), ``padding_fraction`` = (attn_page - state) / state."""

    align: int
    block_size: int
    attn_page_bytes: int
    state_bytes: int
    padding_fraction: float


def vllm_block_pick(cfg: ModelConfig, kernel_block_size: int, block_size: int = 16, tp_size: int = 1,
                    kv_dtype: torch.dtype = torch.bfloat16, state_dtype: torch.dtype = torch.float32,
                    conv_dtype: torch.dtype = torch.bfloat16) -> VLLMBlockPick:
    """vLLM's attention block for ``cfg`` (see the module docstring for the rule and its source):
    ``align = max(kernel_block_size, block_size)``; ``block = align * ceil(state / (align * attn_1_token))``
    with ``state`` one KDA layer's state per TP rank and ``attn_1_token`` one MLA layer's latent bytes
    per token (the MLA latent is not split by TP). Raises ValueError for non-positive sizes, a ``tp_size``
    that does not divide the heads, or a model without MLA or KDA layers."""
    check_int("kernel_block_size", kernel_block_size)
    check_int("block_size", block_size)
    if not cfg.num_mla_layers or not cfg.num_kda_layers:
        raise ValueError(f"config {cfg.name!r} needs both MLA and KDA layers for a hybrid page size")
    attn_1_token = cfg.latent_dim * dtype_bytes(kv_dtype)        # (r + rope) * s_kv, one MLA layer
    state = (kda_state_bytes_per_layer(cfg, state_dtype, tp_size)     # H K V s_state / tp
             + conv_state_bytes_per_layer(cfg, conv_dtype, tp_size))  # (2HK + HV)(W - 1) s_conv / tp
    align = max(kernel_block_size, block_size)
    block = align * -(-state // (align * attn_1_token))
    page = block * attn_1_token
    return VLLMBlockPick(align, block, page, state, (page - state) / state)


def vllm_vs_ours(cfg: ModelConfig, block_size: int = 16, num_groups: int = 1) -> list[dict]:
    """One row per vLLM MLA backend (:data:`VLLM_MLA_KERNEL_BLOCK`) with vLLM's block and per-layer
    pages, beside our unified policy (:class:`serve.memory.layout.CacheLayout`, same dtypes) for
    ``num_groups`` groups: our block stays ``block_size``, our page holds every MLA layer's block or a
    whole group state, whichever is larger, so our KV pages carry the padding instead of the state."""
    ours = CacheLayout.for_policy(cfg, block_size, num_groups, "unified", **REAL_DTYPES)
    rows = []
    for backend, kernel in VLLM_MLA_KERNEL_BLOCK.items():
        v = vllm_block_pick(cfg, kernel, block_size)
        rows.append({"model": cfg.name, "vLLM backend": backend, "kernel block": kernel,
                     "vLLM block (tokens)": v.block_size, "vLLM page, one layer (B)": v.attn_page_bytes,
                     "vLLM state padding": v.padding_fraction, "our block (tokens)": ours.block_size,
                     "our page (B)": ours.page_bytes, "our KV page padding": ours.kv_page_padding_bytes / ours.page_bytes,
                     "our state padding": ours.state_waste_bytes / ours.state_bytes})
    return rows
