"""The largest decode batch a TP group holds at a context, and the roofline TPOT and throughput at it.

The Kimi Linear report's Fig. 1b ("6.3x faster TPOT (1.84 ms vs. 11.48 ms) than MLA at 1M tokens",
"larger batches", batch sizes not stated) and its abstract's "up to 6x decoding throughput" compare
the models where each runs the batch its memory allows. This module models that case:

- memory per GPU left for the cache = ``memory_fraction`` x HBM - weights / tp. ``memory_fraction``
  0.9 is vLLM's default ``gpu_memory_utilization`` (vllm/config/cache.py); activations and the CUDA
  graph pool are not modelled beyond it.
- cache per sequence per GPU at context c = num_mla_layers x c x latent bytes per token per layer
  (the MLA latent has no head dimension: every TP rank holds all of it) + num_kda_layers x one
  sequence's KDA state / tp (split by heads).
- batch = floor(free / per sequence); 0 when not even one sequence fits (TPOT is then NaN).
- TPOT = :func:`serve.scale.roofline.decode_time` at that batch; throughput = batch / TPOT (tokens/s);
  time per token = TPOT / batch (what a per-token comparison at unequal batches reads).

What a roofline can and cannot reproduce here: it counts bytes and FLOPs at peak, so at long context
its MLA / Kimi Linear throughput ratio tops out near the ratio of the models' KV bytes per token
(27 / 7 ~ 3.9x for Kimi-Linear-48B-A3B, batch ratio x per-step ratio). The report's 6.3x also carries
kernel efficiency at long context (MLA attention kernels below peak bandwidth at 1M), which is
outside a roofline.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from serve.errors import check_int
from serve.scale.hardware import Hardware
from serve.scale.model_shape import ModelShape
from serve.scale.roofline import MAX_TOKENS, decode_time

MEMORY_FRACTION = 0.9  # vLLM's default gpu_memory_utilization


def weight_bytes(shape: ModelShape) -> float:
    """Weight bytes of the whole model: routed experts at ``routed_expert_weight_bytes`` per parameter
    (K3: MXFP4), everything else at ``weight_bytes`` (bf16)."""
    routed = shape.num_moe_layers * shape.num_experts * shape.expert_params
    return routed * shape.routed_expert_weight_bytes + (shape.total_params - routed) * shape.weight_bytes


def cache_bytes_per_sequence(shape: ModelShape, tp: int, context: int) -> float:
    """Bytes one sequence at ``context`` tokens holds on each GPU of a TP group of ``tp``: the MLA latent KV
    in full (replicated) plus the KDA state split by heads."""
    check_int("tp", tp)
    check_int("context", context, 0)
    return (shape.num_mla_layers * context * shape.mla_kv_bytes_per_token_layer
            + shape.num_kda_layers * shape.kda_state_bytes_layer / tp)


def free_cache_bytes(shape: ModelShape, hw: Hardware, tp: int, memory_fraction: float = MEMORY_FRACTION) -> float:
    """Bytes per GPU left for the cache after the weights (may be <= 0: the weights do not fit)."""
    check_int("tp", tp)
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)) or not (
            0 < memory_fraction <= 1):
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    return memory_fraction * hw.hbm_bytes - weight_bytes(shape) / tp


class BatchDecode(NamedTuple):
    """One model at one context on one setup: ``batch`` (the largest that fits, sequences), ``tpot_s``
    (one decode step at that batch, s; NaN when batch is 0), ``throughput_tok_s`` (batch / tpot_s,
    tokens/s over the TP group), ``time_per_token_s`` (tpot_s / batch)."""

    context: int
    batch: int
    tpot_s: float
    throughput_tok_s: float

    @property
    def time_per_token_s(self) -> float:
        return self.tpot_s / self.batch if self.batch else math.nan


def max_batch(shape: ModelShape, hw: Hardware, tp: int, context: int,
              memory_fraction: float = MEMORY_FRACTION) -> int:
    """Largest number of sequences at ``context`` tokens whose cache fits next to the weights (0 if none).
    Raises ValueError naming a bad tp, context or memory_fraction."""
    check_int("context", context, 0)
    if context > MAX_TOKENS:
        raise ValueError(f"context must be <= {MAX_TOKENS} tokens, got {context!r}")
    free = free_cache_bytes(shape, hw, tp, memory_fraction)
    per_seq = cache_bytes_per_sequence(shape, tp, context)
    return max(0, math.floor(free / per_seq)) if per_seq > 0 else 0


def largest_batch_decode(shape: ModelShape, hw: Hardware, tp: int, context: int,
                         memory_fraction: float = MEMORY_FRACTION) -> BatchDecode:
    """:class:`BatchDecode` at the largest batch (:func:`max_batch`); the roofline step of
    :func:`serve.scale.roofline.decode_time` at that batch."""
    batch = max_batch(shape, hw, tp, context, memory_fraction)
    if batch == 0:
        return BatchDecode(context, 0, math.nan, 0.0)
    tpot = decode_time(shape, hw, tp, batch, context).total_s
    return BatchDecode(context, batch, tpot, batch / tpot)
