"""How one request's hybrid cache lives in :class:`serve.paged_cache.PagePool` pages.

- **MLA KV block**: one ``PageKind.MLA_KV`` page per block of N tokens, holding
  ``[M, N, r + rope]`` fp32 (M MLA layers, latent width r + rope) from byte 0.
- **KDA group state**: the KDA layers are split into G contiguous groups. A group's state is the flat
  fp32 concatenation, per layer in order, of the recurrent state ``[H, K, V]`` and the conv window
  ``[2HK + HV, W-1]``; it spans ``ceil(group_state_bytes / page_bytes)`` ``PageKind.KDA_STATE`` pages
  (page i holds elements ``[i E, (i+1) E)``, E = page_bytes / 4).

All data is fp32, so a write then a read is bitwise exact. Functions here move bytes only; who owns
which page is the caller's business (the engine and :class:`serve.prefix_cache.PrefixCache`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kda_core.config import ModelConfig
from kda_core.layer import KDACache
from serve.page_policy import kda_groups
from serve.paged_cache import PagePool

FP32_BYTES = 4
PAGE_ALIGN_BYTES = 64
POLICIES = ("unified", "multi_page")


def group_layers(cfg: ModelConfig, num_groups: int) -> tuple[tuple[int, ...], ...]:
    """The KDA layers of each of ``num_groups`` contiguous groups (:func:`serve.page_policy.kda_groups`)."""
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


def _flat_pages(pool: PagePool, pages) -> torch.Tensor:
    arena = pool.typed_arena(torch.float32, (pool.page_bytes // FP32_BYTES,))  # [num_pages, E]
    return arena[torch.as_tensor(list(pages), dtype=torch.long)].reshape(-1)  # [len(pages) * E]


def read_state(layout: CacheLayout, pool: PagePool, pages_by_group) -> dict[int, KDACache]:
    """Read every group's state pages into ``{layer: KDACache}`` (recurrent ``[1, H, K, V]``, conv
    ``[1, 2HK + HV, W-1]``, fp32 copies)."""
    cfg = layout.cfg
    rec_shape = (1, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim)
    conv_shape = (1, cfg.conv_dim, cfg.conv_kernel - 1)
    n_rec, n_conv = math.prod(rec_shape), math.prod(conv_shape)
    out = {}
    for layers, pages in zip(layout.groups, pages_by_group):
        flat = _flat_pages(pool, pages)
        off = 0
        for i in layers:
            rec = flat[off: off + n_rec].view(rec_shape)                 # [1, H, K, V]
            conv = flat[off + n_rec: off + n_rec + n_conv].view(conv_shape)  # [1, 2HK + HV, W-1]
            out[i] = KDACache(rec, conv)
            off += n_rec + n_conv
    return out


def write_state(layout: CacheLayout, pool: PagePool, pages_by_group, caches: dict[int, KDACache]) -> None:
    """Write ``{layer: KDACache}`` (batch 1) into every group's state pages, in place."""
    per_page = pool.page_bytes // FP32_BYTES
    for layers, pages in zip(layout.groups, pages_by_group):
        flat = torch.cat([t.reshape(-1) for i in layers for t in (caches[i].recurrent, caches[i].conv)])
        for j, p in enumerate(pages):
            chunk = flat[j * per_page: (j + 1) * per_page]
            pool.view(p, torch.float32, (chunk.numel(),)).copy_(chunk)


def zero_state(layout: CacheLayout, pool: PagePool, pages_by_group) -> None:
    """Write the empty-sequence state (all zeros) into every group's state pages."""
    for g, pages in enumerate(pages_by_group):
        remaining = layout.group_state_bytes(g) // FP32_BYTES
        for p in pages:
            n = min(remaining, pool.page_bytes // FP32_BYTES)
            pool.view(p, torch.float32, (n,)).zero_()
            remaining -= n


def copy_state(pool: PagePool, src_by_group, dst_by_group) -> None:
    """Copy a state page by page (a checkpoint into a request's private pages, or back)."""
    for src, dst in zip(src_by_group, dst_by_group):
        if len(src) != len(dst):
            raise ValueError(f"state page counts differ: {len(src)} vs {len(dst)}")
        for s, d in zip(src, dst):
            pool.copy_page(s, d)


def read_kv(layout: CacheLayout, pool: PagePool, page_table, num_tokens: int) -> list[torch.Tensor]:
    """The first ``num_tokens`` latents of a request, per MLA layer ``[1, num_tokens, r + rope]``
    (one gather over the page table)."""
    M, N, R = layout.kv_block_shape
    nb = -(-num_tokens // N)
    if nb > len(page_table):
        raise ValueError(f"page table holds {len(page_table)} blocks, {nb} needed for {num_tokens} tokens")
    if nb == 0:
        return [torch.zeros(1, 0, R) for _ in range(M)]
    arena = pool.typed_arena(torch.float32, (M, N, R))                    # [num_pages, M, N, R]
    blocks = arena[torch.as_tensor(list(page_table[:nb]), dtype=torch.long)]  # [nb, M, N, R]
    lat = blocks.permute(1, 0, 2, 3).reshape(M, nb * N, R)[:, :num_tokens]  # [M, num_tokens, R]
    return [lat[m: m + 1] for m in range(M)]


def write_kv(layout: CacheLayout, pool: PagePool, page_table, start: int, latents) -> None:
    """Write per-MLA-layer latents ``[1, T, r + rope]`` of tokens ``[start, start + T)`` into the pages."""
    M, N, R = layout.kv_block_shape
    T = latents[0].shape[1]
    pos = start
    while pos < start + T:
        b, off = divmod(pos, N)
        n = min(N - off, start + T - pos)
        page = pool.view(page_table[b], torch.float32, (M, N, R))        # [M, N, R]
        for m in range(M):
            page[m, off: off + n].copy_(latents[m][0, pos - start: pos - start + n])
        pos += n
