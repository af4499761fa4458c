"""How a KDA state fits a pool of equal-size pages: two page-size policies, compared in bytes.

An MLA_KV page holds ``block_size`` tokens of latent KV for every MLA layer; a KDA_STATE page holds
one *group's* state (the recurrent ``[H, K, V]`` and conv ``[2HK + HV, W-1]`` states of every KDA
layer in the group). The two sizes are unrelated, so a pool of one page size must bend one of them:

1. **unified page size**: grow the attention block, in steps of ``block_align`` tokens, until one KV
   page (all MLA layers) is at least one group's state; the state page is padded up to that size.
   Waste = ``page_bytes - state_bytes`` per group state.
2. **multi-page state**: keep the KV block size; a state spans ``ceil(state_bytes / page_bytes)``
   pages. Waste = the unused tail of its last page.

Sizes come from :mod:`kda_core.config` (``mla_kv_bytes_per_token``, ``kda_state_bytes_per_layer``,
``conv_state_bytes_per_layer``); a group's state = all KDA layers of that group.

What vLLM itself picks (:func:`vllm_block_pick`) differs from policy 1 in two ways. vLLM pages are
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

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kda_core.config import (
    ModelConfig,
    conv_state_bytes_per_layer,
    dtype_bytes,
    kda_state_bytes_per_layer,
    mla_kv_bytes_per_token,
)

POLICIES = ("unified", "multi_page")


def kda_groups(cfg: ModelConfig, num_groups: int = 1) -> tuple[tuple[int, ...], ...]:
    """Partition the KDA layers (model layer indices, in order) into ``num_groups`` contiguous groups
    whose sizes differ by at most one (the first groups take the extra layers).

    Raises ValueError unless ``1 <= num_groups <= cfg.num_kda_layers``.
    """
    layers = cfg.kda_layers
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or not 1 <= num_groups <= len(layers):
        raise ValueError(f"num_groups must be an int in [1, {len(layers)}] (KDA layers), got {num_groups!r}")
    base, extra = divmod(len(layers), num_groups)
    out, start = [], 0
    for g in range(num_groups):
        size = base + (g < extra)
        out.append(tuple(layers[start: start + size]))
        start += size
    return tuple(out)


def group_state_bytes(cfg: ModelConfig, num_layers: int, state_dtype: torch.dtype = torch.float32,
                      conv_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one group's state for one sequence: num_layers * (H K V s_state + (2HK + HV)(W-1) s_conv)."""
    return num_layers * (kda_state_bytes_per_layer(cfg, state_dtype) + conv_state_bytes_per_layer(cfg, conv_dtype))


@dataclass(frozen=True)
class PageLayout:
    """One page-size decision (sizes in bytes unless named otherwise).

    policy: "unified" or "multi_page". block_size: tokens per MLA_KV page. page_bytes: bytes per page.
    kv_block_bytes: bytes of one block's latent KV (all MLA layers). state_bytes: bytes of the largest
    group's state. state_pages: pages per group state. num_groups: G.
    """

    policy: str
    block_size: int
    page_bytes: int
    kv_block_bytes: int
    state_bytes: int
    state_pages: int
    num_groups: int

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("block_size", "page_bytes", "num_groups"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kv_block_bytes > self.page_bytes:
            raise ValueError(f"kv_block_bytes {self.kv_block_bytes} exceeds page_bytes {self.page_bytes}")
        if self.state_pages * self.page_bytes < self.state_bytes:
            raise ValueError(f"{self.state_pages} pages of {self.page_bytes} bytes cannot hold {self.state_bytes} bytes")

    @property
    def state_waste_bytes(self) -> int:
        """Unused bytes per group state: padding (unified) or last-page tail (multi-page)."""
        return self.state_pages * self.page_bytes - self.state_bytes

    @property
    def state_waste_fraction(self) -> float:
        """state_waste_bytes / bytes allocated for one group state (0 when there is no state)."""
        alloc = self.state_pages * self.page_bytes
        return self.state_waste_bytes / alloc if alloc else 0.0

    @property
    def kv_waste_bytes(self) -> int:
        """Unused bytes in every full MLA_KV page (page larger than one block)."""
        return self.page_bytes - self.kv_block_bytes

    def sequence_pages(self, num_tokens: int) -> int:
        """Pages one sequence needs at ``num_tokens`` of context: ceil(T / block_size) KV + G state."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size) + self.num_groups * self.state_pages


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def page_layout(cfg: ModelConfig, policy: str, block_size: int = 16, num_groups: int = 1,
                block_align: int = 16, kv_dtype: torch.dtype = torch.bfloat16,
                state_dtype: torch.dtype = torch.float32, conv_dtype: torch.dtype = torch.bfloat16) -> PageLayout:
    """Choose the page size for ``cfg`` under ``policy``.

    unified: block size = the smallest multiple of ``block_align`` that is >= ``block_size`` and makes
    one KV page >= one group state; page_bytes = that KV page. multi_page: page_bytes = the KV page of
    ``block_size`` tokens; a group state spans ``ceil(state / page_bytes)`` pages.
    Raises ValueError for an unknown policy, non-positive sizes, or a model without MLA layers
    (no KV page to size the pool by).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    for name, val in (("block_size", block_size), ("block_align", block_align)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    per_token = mla_kv_bytes_per_token(cfg, kv_dtype)  # num_mla_layers * (r + rope) * s_kv
    if per_token == 0:
        raise ValueError(f"config {cfg.name!r} has no MLA layer: no KV page to size the pool by")
    groups = kda_groups(cfg, num_groups) if cfg.num_kda_layers else ()
    state = max((group_state_bytes(cfg, len(g), state_dtype, conv_dtype) for g in groups), default=0)
    if policy == "unified":
        bs = max(_round_up(block_size, block_align), _round_up(math.ceil(state / per_token), block_align))
        page = bs * per_token
        return PageLayout("unified", bs, page, page, state, 1 if state else 0, max(len(groups), 1))
    page = block_size * per_token
    return PageLayout("multi_page", block_size, page, page, state, -(-state // page), max(len(groups), 1))


def compare_policies(cfg: ModelConfig, block_size: int = 16, num_groups: int = 1, **dtypes) -> list[dict]:
    """Both policies side by side: one row per policy with the :class:`PageLayout` fields and wastes."""
    rows = []
    for policy in POLICIES:
        lay = page_layout(cfg, policy, block_size, num_groups, **dtypes)
        rows.append({**lay.__dict__, "state_waste_bytes": lay.state_waste_bytes,
                     "state_waste_fraction": lay.state_waste_fraction})
    return rows


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
    for name, val in (("kernel_block_size", kernel_block_size), ("block_size", block_size)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
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
    pages, beside our unified policy's block and page for ``num_groups`` groups."""
    ours = page_layout(cfg, "unified", block_size, num_groups)
    rows = []
    for backend, kernel in VLLM_MLA_KERNEL_BLOCK.items():
        v = vllm_block_pick(cfg, kernel, block_size)
        rows.append({"model": cfg.name, "vLLM backend": backend, "kernel block": kernel,
                     "vLLM block (tokens)": v.block_size, "vLLM page, one layer (B)": v.attn_page_bytes,
                     "vLLM state padding": v.padding_fraction, "our block (tokens)": ours.block_size,
                     "our page, all MLA layers (B)": ours.page_bytes, "our state padding":
                     ours.state_waste_bytes / ours.state_bytes if ours.state_bytes else 0.0})
    return rows
