"""THE cache layout: how one request's hybrid cache lives in :class:`serve.memory.pool.PagePool` pages,
and the page-size policy that sizes the pool's pages for it.

- **MLA KV block**: one ``PageKind.MLA_KV`` page per block of N tokens, holding
  ``[M, N, r + rope]`` (M MLA layers, latent width r + rope) from byte 0.
- **KDA group state**: the KDA layers are split into G contiguous groups (:func:`group_layers`). A
  group's state is the flat concatenation, per layer in order, of the recurrent state ``[H, K, V]`` and
  the conv window ``[2HK + HV, W-1]``; it spans ``ceil(group_state_bytes / page_bytes)``
  ``PageKind.KDA_STATE`` pages (page i holds elements ``[i E, (i+1) E)``, E = page_bytes / element size).

Page-size policies (:data:`PAGE_POLICIES`, :meth:`CacheLayout.page_bytes_for`); the block size N is the
caller's and is never changed (it is the prefix-cache granularity):

1. ``"unified"``: one page holds a whole group state, so a state is one page; every KV page is then
   padded from ``kv_block_bytes`` up to that size (:attr:`CacheLayout.kv_page_padding_bytes`).
2. ``"multi_page"``: the page is one KV block; a group state spans several pages and wastes the tail
   of its last page (:attr:`CacheLayout.state_waste_bytes`).

vLLM's hybrid allocator instead grows the attention block until one block's page holds one layer's
state (:mod:`serve.memory.vllm_block`). Byte counts come from :mod:`kda_core.config`
(:func:`~kda_core.config.kda_state_bytes_per_layer`, :func:`~kda_core.config.conv_state_bytes_per_layer`,
:func:`~kda_core.config.mla_kv_bytes_per_token`). The engine stores everything in fp32 (the dtype
defaults), so a write then a read through :mod:`serve.memory.pages` is bitwise exact; other dtypes
size pages for the real presets but cannot be read or written.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

import torch

from kda_core.config import (
    ModelConfig,
    conv_state_bytes_per_layer,
    kda_state_bytes_per_layer,
    mla_kv_bytes_per_token,
)
from serve.errors import check_choice, check_int

FP32_BYTES = 4
PAGE_ALIGN_BYTES = 64
PAGE_POLICIES = ("unified", "multi_page")
REAL_DTYPES = {"kv_dtype": torch.bfloat16, "state_dtype": torch.float32, "conv_dtype": torch.bfloat16}
"""The real models' stored dtypes (bf16 latents and conv windows, fp32 recurrent state), for sizing pages."""
ENGINE_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Recurrent-state dtypes the engine stores (compute stays fp32: upcast on read, round to nearest on write)."""


def group_layers(cfg: ModelConfig, num_groups: int) -> tuple[tuple[int, ...], ...]:
    """Partition the KDA layers (model layer indices, in order) into ``num_groups`` contiguous groups
    whose sizes differ by at most one (the first groups take the extra layers).

    Raises ValueError unless ``num_groups`` is an int in ``[1, cfg.num_kda_layers]``.
    """
    layers = cfg.kda_layers
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or not 1 <= num_groups <= len(layers):
        raise ValueError(f"num_groups must be an int in [1, {len(layers)}] (KDA layers), got {num_groups!r}")
    base, extra = divmod(len(layers), num_groups)
    it = iter(layers)
    return tuple(tuple(islice(it, base + (g < extra))) for g in range(num_groups))


def group_state_bytes(cfg: ModelConfig, num_layers: int, state_dtype: torch.dtype = torch.float32,
                      conv_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of ``num_layers`` KDA layers' state for one sequence:
    ``num_layers * (H K V s_state + (2HK + HV)(W-1) s_conv)``. Defaults are the real models' dtypes."""
    return num_layers * (kda_state_bytes_per_layer(cfg, state_dtype) + conv_state_bytes_per_layer(cfg, conv_dtype))


@dataclass(frozen=True)
class CacheLayout:
    """Page layout of a model's caches. Frozen; validated in ``__post_init__``.

    Args: cfg: the model config; block_size: N tokens per KV block; num_groups: G KDA layer groups;
        page_bytes: the pool's page size (a multiple of 4 that fits one KV block); kv_dtype /
        state_dtype / conv_dtype: stored dtypes of the latents, recurrent states and conv windows
        (fp32 by default; the engine also stores bf16 / fp16 recurrent states, other dtypes only size pages
        for a real model).
    Raises ValueError for a non-positive block size, bad groups, or a page that cannot hold a block.
    """

    cfg: ModelConfig
    block_size: int
    num_groups: int
    page_bytes: int
    kv_dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    conv_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        check_int("block_size", self.block_size)
        group_layers(self.cfg, self.num_groups)
        if isinstance(self.page_bytes, bool) or not isinstance(self.page_bytes, int) or self.page_bytes <= 0 \
                or self.page_bytes % FP32_BYTES:
            raise ValueError(f"page_bytes must be a positive multiple of 4, got {self.page_bytes!r}")
        if self.kv_block_bytes > self.page_bytes:
            raise ValueError(f"page_bytes {self.page_bytes} cannot hold one KV block of {self.block_size} tokens "
                             f"({self.kv_block_bytes} bytes); use CacheLayout.page_bytes_for")

    @staticmethod
    def page_bytes_for(cfg: ModelConfig, block_size: int, num_groups: int, policy: str,
                       kv_dtype: torch.dtype = torch.float32, state_dtype: torch.dtype = torch.float32,
                       conv_dtype: torch.dtype = torch.float32) -> int:
        """Page size under ``policy`` (see the module docstring): "unified" = max(KV block, largest
        group state), "multi_page" = one KV block; rounded up to 64 bytes. No default: the serving default is
        :class:`serve.config.ServeConfig`'s ``page_policy``, and a layout of the other one must say so. Raises ValueError for an
        unknown policy, a non-positive ``block_size`` or bad ``num_groups``."""
        check_choice("policy", policy, PAGE_POLICIES)
        check_int("block_size", block_size)
        need = block_size * mla_kv_bytes_per_token(cfg, kv_dtype)
        if policy == "unified":
            need = max(need, max(group_state_bytes(cfg, len(g), state_dtype, conv_dtype)
                                 for g in group_layers(cfg, num_groups)))
        return -(-need // PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES

    @classmethod
    def for_policy(cls, cfg: ModelConfig, block_size: int, num_groups: int, policy: str,
                   **dtypes: torch.dtype) -> CacheLayout:
        """The layout whose page size :meth:`page_bytes_for` picks for ``policy``."""
        return cls(cfg, block_size, num_groups, cls.page_bytes_for(cfg, block_size, num_groups, policy, **dtypes),
                   **dtypes)

    @property
    def is_fp32(self) -> bool:
        """True when every stored dtype is fp32 (every write then read is bitwise exact)."""
        return self.kv_dtype == self.state_dtype == self.conv_dtype == torch.float32

    def check_engine_dtypes(self) -> None:
        """Raise ValueError unless the engine can read and write this layout (:mod:`serve.memory.pages`,
        :class:`serve.engine.model_runner.ModelRunner`): fp32 latents and conv windows, a recurrent state in
        :data:`ENGINE_STATE_DTYPES` whose bytes per layer (H K V s_state) are a multiple of 4, so every conv
        window starts on an fp32 word."""
        if self.kv_dtype != torch.float32 or self.conv_dtype != torch.float32:
            raise ValueError(f"layout must store fp32 latents and conv windows (the engine's dtype), got kv "
                             f"{self.kv_dtype}, conv {self.conv_dtype}")
        if self.state_dtype not in ENGINE_STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {ENGINE_STATE_DTYPES}, got {self.state_dtype!r}")
        if kda_state_bytes_per_layer(self.cfg, self.state_dtype) % FP32_BYTES:
            raise ValueError(f"state_dtype {self.state_dtype} needs H K V even (the conv window after each "
                             f"recurrent state must start on a 4-byte word), got H K V = "
                             f"{self.cfg.num_heads * self.cfg.head_k_dim * self.cfg.head_v_dim}")

    def state_words(self) -> tuple[int, int]:
        """``(w_rec, w_conv)``: 4-byte words of one layer's recurrent state and conv window in a group state
        (H K V s_state / 4 and (2HK + HV)(W-1)); call :meth:`check_engine_dtypes` first."""
        return (kda_state_bytes_per_layer(self.cfg, self.state_dtype) // FP32_BYTES,
                conv_state_bytes_per_layer(self.cfg, self.conv_dtype) // FP32_BYTES)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """KDA layer indices of each group."""
        return group_layers(self.cfg, self.num_groups)

    @property
    def kv_block_shape(self) -> tuple[int, int, int]:
        """``(M, N, r + rope)``: MLA layers, tokens per block, latent width."""
        return (self.cfg.num_mla_layers, self.block_size, self.cfg.latent_dim)

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block: N * M * (r + rope) * s_kv."""
        return self.block_size * mla_kv_bytes_per_token(self.cfg, self.kv_dtype)

    @property
    def kv_page_padding_bytes(self) -> int:
        """Unused bytes of every KV page: page_bytes - kv_block_bytes."""
        return self.page_bytes - self.kv_block_bytes

    def group_state_bytes(self, group: int) -> int:
        """Bytes of one group's state (:func:`group_state_bytes` of its layers, in this layout's dtypes)."""
        return group_state_bytes(self.cfg, len(self.groups[group]), self.state_dtype, self.conv_dtype)

    def group_pages(self, group: int) -> int:
        """Pages one group's state spans: ceil(group_state_bytes / page_bytes)."""
        return -(-self.group_state_bytes(group) // self.page_bytes)

    @property
    def state_bytes(self) -> int:
        """Bytes of a whole-model KDA state (all groups)."""
        return sum(self.group_state_bytes(g) for g in range(self.num_groups))

    @property
    def state_pages(self) -> int:
        """Pages of a whole-model KDA state (all groups)."""
        return sum(self.group_pages(g) for g in range(self.num_groups))

    @property
    def state_waste_bytes(self) -> int:
        """Allocated but unused bytes of a whole-model state: state_pages * page_bytes - state_bytes."""
        return self.state_pages * self.page_bytes - self.state_bytes
