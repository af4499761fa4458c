"""``ServeConfig``: the serving knobs set once (block size, checkpoint interval, KDA groups, page policy).

One frozen value object is shared by :class:`serve.engine.ServeEngine`,
:class:`serve.prefix.cache.PrefixCache` and the trace replay :mod:`serve.prefix.sim`, so each number
is stored once. The checkpoint placement rule lives here too, because the engine (which writes
checkpoints) and the trace replay (which models them) must place them identically.

Letters: N = ``block_size`` (tokens per KV block and page), C = ``checkpoint_interval`` (tokens),
G = ``num_groups`` (contiguous groups of KDA layers, each checkpointed separately), L = prompt tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kda_core.config import ModelConfig
from serve.errors import check_choice, check_int
from serve.memory.layout import ENGINE_STATE_DTYPES, PAGE_POLICIES, CacheLayout

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Command-line names of :data:`serve.memory.layout.ENGINE_STATE_DTYPES` (``python -m serve.http --state-dtype``)."""


@dataclass(frozen=True)
class ServeConfig:
    """Serving configuration. Frozen; validated in ``__post_init__``.

    Args:
        block_size: N > 0 tokens per KV block (one ``MLA_KV`` page each).
        checkpoint_interval: C tokens between prefill checkpoints, a positive multiple of N.
        num_groups: G >= 1 KDA layer groups (checked against a model in :meth:`layout`).
        page_policy: "unified" (one page size that holds a whole group state, vLLM's unified page) or
            "multi_page" (pages sized to one KV block; a state spans several), see
            :meth:`serve.memory.layout.CacheLayout.page_bytes_for`.
        state_dtype: the stored dtype of every KDA recurrent state (request slots and prefix-cache checkpoints):
            torch.float32 (default, bitwise exact), torch.bfloat16 or torch.float16 (half the recurrent bytes;
            rounded to nearest on every write, upcast on read; compute stays fp32). vLLM's
            ``mamba_ssm_cache_dtype`` (``vllm/config/cache.py``); vLLM itself pins the KDA recurrent state to
            fp32 (``MambaStateDtypeCalculator.kda_state_dtype`` in ``vllm/model_executor/layers/mamba/mamba_utils.py``).
            Conv windows and MLA latents stay fp32.
    Raises ValueError naming the first bad field.
    """

    block_size: int = 16          # vLLM's default KV block (tokens); a demo prompt of a few hundred bytes spans blocks
    checkpoint_interval: int = 64  # = kda_core.chunk.CHUNK_SIZE: prefill splits on the chunk grid, so a warm run is
    # bitwise equal to the cold one (a checkpoint off the grid would change the chunking of what follows it)
    num_groups: int = 1           # one state per checkpoint: the fewest pages; more groups trade pages for finer reuse
    page_policy: str = "multi_page"  # pages of one KV block: no padding of KV pages up to a state (vLLM's unified
    # page pads every KV block to the largest group state; see serve.memory.layout)
    state_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        check_int("block_size", self.block_size)
        check_int("num_groups", self.num_groups)
        check_int("checkpoint_interval", self.checkpoint_interval)
        if self.checkpoint_interval % self.block_size:
            raise ValueError(f"checkpoint_interval must be a positive multiple of block_size={self.block_size}, "
                             f"got {self.checkpoint_interval}")
        check_choice("page_policy", self.page_policy, PAGE_POLICIES)
        check_choice("state_dtype", self.state_dtype, ENGINE_STATE_DTYPES)

    def page_bytes(self, model_cfg: ModelConfig) -> int:
        """Pool page size (bytes) for ``model_cfg`` under :attr:`page_policy`. Raises ValueError if
        :attr:`num_groups` exceeds the model's KDA layers."""
        return CacheLayout.page_bytes_for(model_cfg, self.block_size, self.num_groups, self.page_policy,
                                          state_dtype=self.state_dtype)

    def layout(self, model_cfg: ModelConfig, page_bytes: int | None = None) -> CacheLayout:
        """The :class:`CacheLayout` of ``model_cfg`` on pages of ``page_bytes`` (default: :meth:`page_bytes`).
        Raises ValueError for bad groups or a page that cannot hold one KV block."""
        return CacheLayout(model_cfg, self.block_size, self.num_groups,
                           self.page_bytes(model_cfg) if page_bytes is None else page_bytes,
                           state_dtype=self.state_dtype)

    def prefill_checkpoints(self, num_prompt_tokens: int) -> list[int]:
        """Where a prefill of L = ``num_prompt_tokens`` writes checkpoints, in tokens, ascending: every
        multiple of C up to L, the replay boundary floor((L - 1) / N) N (where an identical prompt's
        lookup stops, since one token must be computed for its logits) and the end of the prompt
        floor(L / N) N. (The engine adds one more at a request's end: :meth:`final_checkpoint`.)"""
        N, L = self.block_size, num_prompt_tokens
        marks = set(range(self.checkpoint_interval, L + 1, self.checkpoint_interval))
        marks |= {(L - 1) // N * N, L // N * N}
        return sorted(b for b in marks if b > 0)

    def final_checkpoint(self, num_prompt_tokens: int, final_tokens: int) -> int | None:
        """The boundary published when a request's cache reaches ``final_tokens`` (prompt + output - 1
        tokens consumed): its last full block floor(final / N) N, or None if that is not past the
        prompt's last full block (already covered by :meth:`prefill_checkpoints`)."""
        N = self.block_size
        b = final_tokens // N * N
        return b if b > num_prompt_tokens // N * N else None
