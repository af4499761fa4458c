"""``PooledHybridCache``: a request's whole :class:`kda_core.model.HybridCache` held in pool pages.

MLA latents go to a :class:`serve.memory.paged_mla.PagedMLACache` (one page table for all MLA layers), KDA
states to a :class:`serve.memory.kda_state_cache.KDAStateCache`. Each model step reads the cache out of the
pool (:meth:`PooledHybridCache.load`: gathered latents, KDA states as in-place views when a group fits
one page) and writes the new tokens' latents and the new states back (:meth:`PooledHybridCache.store`).
Decode through this object is bitwise equal to decode with plain tensors (fp32 storage).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from kda_core.config import ModelConfig
from kda_core.layer import KDACache
from kda_core.model import HybridCache
from serve.memory.kda_state_cache import KDAStateCache
from serve.memory.paged_mla import PagedMLACache
from serve.memory.pool import PagePool


class PooledHybridCache:
    """One request (batch 1) of a HybridLM with every cache byte in ``pool``.

    Args: pool; owner (holder of all page references); cfg (the model config); block_size (tokens per
    MLA_KV page); groups (KDA layer groups, default one group); dtype of the stored latents and states.
    Allocates the KDA state pages and writes zero states (raises PoolExhausted, nothing held).
    """

    def __init__(self, pool: PagePool, owner: Hashable, cfg: ModelConfig, block_size: int,
                 groups: Sequence[Sequence[int]] | None = None, dtype: torch.dtype = torch.float32):
        self.cfg = cfg
        self.mla = PagedMLACache(pool, owner, cfg.num_mla_layers, cfg.latent_dim, block_size, dtype)
        self.kda = KDAStateCache(pool, owner, cfg, groups, dtype, dtype)
        for i in cfg.kda_layers:
            self.kda.write(i, KDACache(torch.zeros(1, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim),
                                       torch.zeros(1, cfg.conv_dim, cfg.conv_kernel - 1)))

    @property
    def num_tokens(self) -> int:
        return self.mla.num_tokens

    def load(self) -> HybridCache:
        """The cache as a HybridCache: MLA latents ``[1, L, r + rope]`` gathered from the pages, KDA
        states read from their pages (views when in place). Pure with respect to the pool."""
        layers, m = [], 0
        for i in range(self.cfg.num_layers):
            if i in self.cfg.mla_layers:
                layers.append(self.mla.gather(m).unsqueeze(0))            # [1, L, D]
                m += 1
            else:
                layers.append(self.kda.read(i))
        return HybridCache(tuple(layers), self.mla.num_tokens)

    def store(self, cache: HybridCache) -> None:
        """Write a cache that continues this one: append latents of tokens ``[num_tokens,
        cache.num_tokens)`` and overwrite every KDA state. Mutates the pool pages.

        Raises ValueError (batch != 1, fewer tokens than stored) and PoolExhausted (nothing written).
        """
        if cache.num_tokens < self.num_tokens:
            raise ValueError(f"cache has {cache.num_tokens} tokens, fewer than the {self.num_tokens} stored")
        mla = [cache.layers[i] for i in self.cfg.mla_layers]
        if any(t.shape[0] != 1 for t in mla):
            raise ValueError("PooledHybridCache holds one sequence: batch must be 1")
        if mla:
            new = torch.stack([t[0, self.num_tokens: cache.num_tokens] for t in mla])  # [Lm, T_new, D]
            self.mla.append(new)
        for i in self.cfg.kda_layers:
            self.kda.write(i, cache.layers[i])

    def free(self) -> None:
        """Release every page reference of this request."""
        self.mla.free()
        self.kda.free()

    def check_integrity(self) -> None:
        self.mla.check_integrity()
        self.kda.check_integrity()
