"""Roofline cost of one prefill or decode step of a real Kimi model on one TP group.

Each layer kind's time is max(FLOPs / peak, bytes / bandwidth) (Williams, Waterman & Patterson,
"Roofline", CACM 2009), summed over kinds, plus the TP all-reduces and a fixed per-step overhead the
caller states (``overhead_s``, default 0: the pure roofline). Figures are per GPU of a TP group of
``tp`` GPUs; weights, heads and experts are split evenly, the MLA latent KV cache is replicated
(every rank reads all of it: the latent has no head dimension, a known property of MLA under TP).

FLOP counts (2 FLOP per multiply-add):
- projections and experts: 2 * parameters * tokens. MoE: each token uses its top-k experts plus the
  shared ones; the weights read are those of the distinct experts the step touches,
  E (1 - (1 - k/E)^T) for T tokens under uniform independent routing (an assumption).
- MLA prefill (non-absorbed, FlashAttention on expanded keys): per (query, key) pair
  2 H (d_nope + d_rope) + 2 H d_v; causal pairs of n new tokens after b cached: n b + n (n + 1) / 2;
  kv_b re-expands all b + n latents. This is the report's Eq. 14 (2 T^2 d_h per head for T tokens).
- MLA decode (absorbed, as FlashMLA): per pair 2 H (r + d_rope) + 2 H r, over c + 1 keys.
- KDA prefill, chunked: per head 6 T d^2 + 3 T C d + T C^2 with C = 64 (Kimi Linear tech report,
  arXiv 2510.26692, Sec. 6.3, Eq. 13). KDA decode, recurrent: 7 K V per head per token (decay K V,
  k^T S 2 K V, rank-1 update 2 K V, q^T S 2 K V; fla ``fused_recurrent_kda``).

TP all-reduces: two ring all-reduces of the bf16 hidden states per layer over the link
:meth:`serve.scale.hardware.Hardware.allreduce_bytes_per_s` gives: NVLink inside one 8-GPU node, the
inter-node NIC (InfiniBand, e.g. 400 Gb/s NDR = 50 GB/s per GPU) for a TP group beyond one node.

Bytes: weights read once per step; MLA latent KV read (b or c tokens) and written (new tokens),
expanded prefill keys/values written and read once; KDA state read and written once per sequence
(recurrent fp32 + conv window bf16) and q, k, g, v, o activations once; lm head on each decoded token
and on the last token of each prefilled sequence. Not modelled: norms, rotary, sampling, FlashAttention
re-reads of K/V tiles, kernel launch gaps (put them in ``overhead_s``).

Inputs: token counts and batch sizes are ints (not bools) up to ``MAX_TOKENS`` / ``MAX_BATCH``; larger
ones would overflow the float FLOP counts. ``overhead_s`` is a finite real >= 0. Every bad input raises
ValueError naming it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real

from serve.errors import check_int
from serve.scale.hardware import Hardware
from serve.scale.model_shape import ModelShape

KDA_CHUNK = 64  # C in Eq. 13; fla's chunk_kda block size
ACT_BYTES = 2  # bf16 activations
KINDS = ("kda", "mla", "moe", "dense_mlp", "embed_head")
MAX_TOKENS = 2 ** 40  # tokens per sequence (new, cached or context): ~1e12, far past any model's window
MAX_BATCH = 2 ** 40   # sequences per step


@dataclass(frozen=True)
class KindCost:
    """One layer kind summed over its layers, per GPU. flops in FLOP, bytes in bytes, times in s;
    ``bound`` is "compute" or "memory" (whichever time won)."""

    kind: str
    flops: float
    bytes: float
    compute_s: float
    memory_s: float

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclass(frozen=True)
class StepCost:
    """A step's breakdown: ``kinds`` (one ``KindCost`` per layer kind present), ``comm_s`` (TP
    all-reduces), ``overhead_s`` (stated fixed cost); ``total_s`` is their sum, in seconds."""

    kinds: tuple[KindCost, ...]
    comm_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return sum(k.time_s for k in self.kinds) + self.comm_s + self.overhead_s

    def kind(self, name: str) -> KindCost:
        for k in self.kinds:
            if k.kind == name:
                return k
        raise ValueError(f"name must be one of {[k.kind for k in self.kinds]}, got {name!r}")


def _check(shape: ModelShape, hw: Hardware, tp: int, overhead_s: float) -> None:
    if not isinstance(shape, ModelShape):
        raise ValueError(f"shape must be a ModelShape, got {type(shape).__name__}")
    if not isinstance(hw, Hardware):
        raise ValueError(f"hw must be a Hardware, got {type(hw).__name__}")
    if (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or shape.kda_heads % tp
            or shape.mla_heads % tp):
        raise ValueError(f"tp must be a positive divisor of the KDA heads ({shape.kda_heads}) and MLA heads "
                         f"({shape.mla_heads}), got {tp!r}")
    if isinstance(overhead_s, bool) or not isinstance(overhead_s, Real) or not 0 <= overhead_s < math.inf:
        raise ValueError(f"overhead_s must be a finite number of seconds >= 0, got {overhead_s!r}")


def _tokens(name: str, val, minimum: int) -> int:
    check_int(name, val, minimum)
    if val > MAX_TOKENS:
        raise ValueError(f"{name} must be <= {MAX_TOKENS} tokens, got {val!r}")
    return int(val)


def _batch(val) -> int:
    check_int("batch", val)
    if val > MAX_BATCH:
        raise ValueError(f"batch must be <= {MAX_BATCH} sequences, got {val!r}")
    return int(val)


def _kind(name: str, flops: float, nbytes: float, hw: Hardware) -> KindCost:
    return KindCost(name, flops, nbytes, flops / hw.peak_bf16_flops, nbytes / hw.hbm_bytes_per_s)


def _experts_touched(shape: ModelShape, tokens: int) -> float:
    e, k = shape.num_experts, shape.experts_per_token
    return e * (1 - (1 - k / e) ** tokens)


def _ffn_kinds(shape: ModelShape, hw: Hardware, tp: int, tokens: int, head_tokens: int) -> list[KindCost]:
    wb, d = shape.weight_bytes, shape.hidden_size
    out = []
    if shape.first_dense_layers:
        p = shape.first_dense_layers * shape.dense_mlp_params
        out.append(_kind("dense_mlp", 2 * p * tokens / tp, p * wb / tp, hw))
    if shape.num_moe_layers:
        n = shape.num_moe_layers
        used = shape.moe_always_params + shape.experts_per_token * shape.expert_params
        read = (shape.moe_always_params * wb
                + _experts_touched(shape, tokens) * shape.expert_params * shape.routed_expert_weight_bytes)
        out.append(_kind("moe", n * 2 * used * tokens / tp, n * read / tp, hw))
    head = shape.lm_head_params or shape.embedding_params
    out.append(_kind("embed_head", 2 * head * head_tokens / tp,
                     head * wb / tp + tokens * d * ACT_BYTES, hw))
    return out


def _comm_s(shape: ModelShape, hw: Hardware, tp: int, tokens: int) -> float:
    """Two ring all-reduces of the bf16 hidden states per layer: 2 (tp - 1) / tp of the bytes each way, over
    NVLink within a node and the inter-node NIC beyond (:meth:`Hardware.allreduce_bytes_per_s`)."""
    if tp == 1:
        return 0.0
    nbytes = 2 * shape.num_layers * tokens * shape.hidden_size * ACT_BYTES
    return 2 * (tp - 1) / tp * nbytes / hw.allreduce_bytes_per_s(tp)


def _kda_act_bytes(shape: ModelShape, tokens: int) -> float:
    return tokens * shape.kda_heads * 5 * shape.kda_head_dim * ACT_BYTES  # q, k, g, v, o


def prefill_time(shape: ModelShape, hw: Hardware, tp: int, new_tokens: int, cached_tokens: int = 0,
                 batch: int = 1, overhead_s: float = 0.0) -> StepCost:
    """Roofline time of prefilling ``new_tokens`` after ``cached_tokens`` (a prefix hit: cached MLA
    KV, restored KDA state) for each of ``batch`` equal sequences. Seconds; ValueError names a bad arg
    (module docstring: ints up to ``MAX_TOKENS`` / ``MAX_BATCH``, finite ``overhead_s`` >= 0).

    The MLA latent KV (cached and new) is read in full by every TP rank: it is replicated, not split."""
    _check(shape, hw, tp, overhead_s)
    n = _tokens("new_tokens", new_tokens, 1)
    b = _tokens("cached_tokens", cached_tokens, 0)
    batch = _batch(batch)
    tokens = batch * n
    wb, kinds = shape.weight_bytes, []
    if shape.num_kda_layers:
        h, dk = shape.kda_heads, shape.kda_head_dim
        core = h * (6 * n * dk ** 2 + 3 * n * KDA_CHUNK * dk + n * KDA_CHUNK ** 2) * batch
        state = (2 if b else 1) * shape.kda_state_bytes_layer * batch  # read the restored state (hit), write the last
        flops = shape.num_kda_layers * (2 * shape.kda_layer_params * tokens + core)
        nbytes = shape.num_kda_layers * (shape.kda_layer_params * wb + state + _kda_act_bytes(shape, tokens))
        kinds.append(_kind("kda", flops / tp, nbytes / tp, hw))
    if shape.num_mla_layers:
        h, qk, v = shape.mla_heads, shape.qk_nope_head_dim + shape.qk_rope_head_dim, shape.v_head_dim
        pairs = (n * b + n * (n + 1) // 2) * batch
        core = pairs * 2 * h * (qk + v)
        proj = 2 * (shape.mla_layer_params - shape.mla_kv_b_params) * tokens
        expand = 2 * shape.mla_kv_b_params * (b + n) * batch
        expanded = 2 * (b + n) * batch * h * (qk + v) * ACT_BYTES  # write then read expanded K, V
        kv_cache = (b + n) * batch * shape.mla_kv_bytes_per_token_layer  # read cached, write new
        per_layer_bytes = (shape.mla_layer_params * wb + expanded + tokens * h * (qk + v) * ACT_BYTES) / tp + kv_cache
        kinds.append(_kind("mla", shape.num_mla_layers * (core + proj + expand) / tp,
                           shape.num_mla_layers * per_layer_bytes, hw))
    kinds += _ffn_kinds(shape, hw, tp, tokens, head_tokens=batch)
    return StepCost(tuple(kinds), _comm_s(shape, hw, tp, tokens), overhead_s)


def _context_sum(contexts, batch: int) -> int:
    """Total context tokens of the batch: ``contexts`` is one int for every sequence, or ``batch`` ints."""
    bad = ValueError(f"contexts must be an int in [0, {MAX_TOKENS}] or {batch} such ints, got {contexts!r}")
    if isinstance(contexts, (str, bytes)):
        raise bad
    if not isinstance(contexts, Sequence):
        try:
            return batch * _tokens("contexts", contexts, 0)
        except ValueError:
            raise bad from None
    if len(contexts) != batch:
        raise bad
    total = 0
    for c in contexts:
        try:
            total += _tokens("contexts", c, 0)
        except ValueError:
            raise bad from None
    return total


def decode_time(shape: ModelShape, hw: Hardware, tp: int, batch: int, contexts: int | Sequence[int],
                overhead_s: float = 0.0) -> StepCost:
    """Roofline time of one decode step (TPOT) for ``batch`` sequences at ``contexts`` tokens of
    context each (one int for all, or one per sequence). Seconds; ValueError names a bad arg (module
    docstring). One int context is not expanded per sequence: a large ``batch`` (10**9) costs no memory."""
    _check(shape, hw, tp, overhead_s)
    batch = _batch(batch)
    context_sum = _context_sum(contexts, batch)
    wb, kinds = shape.weight_bytes, []
    if shape.num_kda_layers:
        h, dk = shape.kda_heads, shape.kda_head_dim
        flops = shape.num_kda_layers * (2 * shape.kda_layer_params + 7 * h * dk * dk) * batch
        nbytes = shape.num_kda_layers * (shape.kda_layer_params * wb + 2 * shape.kda_state_bytes_layer * batch
                                         + _kda_act_bytes(shape, batch))
        kinds.append(_kind("kda", flops / tp, nbytes / tp, hw))
    if shape.num_mla_layers:
        h, r, rope = shape.mla_heads, shape.kv_lora_rank, shape.qk_rope_head_dim
        keys = context_sum + batch
        flops = shape.num_mla_layers * (2 * shape.mla_layer_params * batch + keys * 2 * h * (2 * r + rope))
        kv = shape.num_mla_layers * keys * shape.mla_kv_bytes_per_token_layer  # replicated on every rank
        kinds.append(_kind("mla", flops / tp, shape.num_mla_layers * shape.mla_layer_params * wb / tp + kv, hw))
    kinds += _ffn_kinds(shape, hw, tp, batch, head_tokens=batch)
    return StepCost(tuple(kinds), _comm_s(shape, hw, tp, batch), overhead_s)


def checkpoint_restore_time(shape: ModelShape, hw: Hardware, tp: int, batch: int = 1) -> float:
    """Seconds to copy ``batch`` sequences' KDA checkpoints (all KDA layers, recurrent + conv state)
    into their working slots on a prefix hit: bytes read + bytes written over HBM bandwidth, per GPU."""
    _check(shape, hw, tp, 0.0)
    batch = _batch(batch)
    return 2 * shape.num_kda_layers * shape.kda_state_bytes_layer * batch / tp / hw.hbm_bytes_per_s
