"""How one request's hybrid cache lives in :class:`serve.memory.pool.PagePool` pages.

- **MLA KV block**: one ``PageKind.MLA_KV`` page per block of N tokens, holding
  ``[M, N, r + rope]`` fp32 (M MLA layers, latent width r + rope) from byte 0.
- **KDA group state**: the KDA layers are split into G contiguous groups. A group's state is the flat
  fp32 concatenation, per layer in order, of the recurrent state ``[H, K, V]`` and the conv window
  ``[2HK + HV, W-1]``; it spans ``ceil(group_state_bytes / page_bytes)`` ``PageKind.KDA_STATE`` pages
  (page i holds elements ``[i E, (i+1) E)``, E = page_bytes / 4).

All data is fp32, so a write then a read is bitwise exact. Functions here move bytes only; who owns
which page is the caller's business (the engine and :class:`serve.prefix.cache.PrefixCache`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kda_core.config import ModelConfig
from serve.memory.page_policy import kda_groups

FP32_BYTES = 4
PAGE_ALIGN_BYTES = 64
POLICIES = ("unified", "multi_page")


def group_layers(cfg: ModelConfig, num_groups: int) -> tuple[tuple[int, ...], ...]:
    """The KDA layers of each of ``num_groups`` contiguous groups (:func:`serve.memory.page_policy.kda_groups`)."""
    return kda_groups(cfg, num_groups)


@dataclass(frozen=True)
class CacheLayout:
    """Page layout of a model's caches. Frozen; validated in ``__post_init__``.

    Args: cfg: the model config; block_size: N tokens per KV block; num_groups: G KDA layer groups;
        page_bytes: the pool's page size (a multiple of 4 that fits one KV block).
    Raises ValueError for a non-positive block size, bad groups, or a page that cannot hold a block.
    """

    cfg: ModelConfig
    block_size: int
    num_groups: int
    page_bytes: int

    def __post_init__(self):
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        group_layers(self.cfg, self.num_groups)
        if self.page_bytes % FP32_BYTES:
            raise ValueError(f"page_bytes must be a multiple of 4 (fp32), got {self.page_bytes}")
        if self.kv_block_bytes > self.page_bytes:
            raise ValueError(f"page_bytes {self.page_bytes} cannot hold one KV block of {self.block_size} tokens "
                             f"({self.kv_block_bytes} bytes); use CacheLayout.page_bytes_for")

    @staticmethod
    def page_bytes_for(cfg: ModelConfig, block_size: int, num_groups: int = 1, policy: str = "unified") -> int:
        """Page size for a policy: "unified" grows the page to hold a whole group state (vLLM's
        unified page size; KV pages then carry padding), "multi_page" uses the KV block size (a state
        spans several pages). Rounded up to 64 bytes."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        kv = cfg.num_mla_layers * block_size * cfg.latent_dim * FP32_BYTES
        need = kv
        if policy == "unified":
            need = max(kv, max(_layers_state_elems(cfg, g) for g in group_layers(cfg, num_groups)) * FP32_BYTES)
        return -(-need // PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES

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
        """Bytes of one KV block: M * N * (r + rope) * 4."""
        return math.prod(self.kv_block_shape) * FP32_BYTES

    def group_state_bytes(self, group: int) -> int:
        """Bytes of one group's state: sum over its layers of (H K V + (2HK + HV)(W-1)) * 4."""
        return _layers_state_elems(self.cfg, self.groups[group]) * FP32_BYTES

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


def _layers_state_elems(cfg: ModelConfig, layers) -> int:
    per_layer = cfg.num_heads * cfg.head_k_dim * cfg.head_v_dim + cfg.conv_dim * (cfg.conv_kernel - 1)
    return per_layer * len(layers)
