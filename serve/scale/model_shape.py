"""Sizes of a real Kimi model per layer kind: parameters, weight bytes, cache bytes.

``kda_core.config.ModelConfig`` holds the attention geometry (layers, KDA heads, MLA latent width);
the figures it does not hold (vocab, MLA heads and head dims, MoE experts and widths, weight
formats) come from the same public Hugging Face configs, listed in ``SOURCED_FIGURES``:

- Kimi-Linear-48B-A3B: ``moonshotai/Kimi-Linear-48B-A3B-Instruct`` ``config.json``: vocab_size 163840,
  num_attention_heads 32, q_lora_rank null, qk_nope_head_dim 128, v_head_dim 128,
  first_k_dense_replace 1, intermediate_size 9216, num_experts 256, num_experts_per_token 8,
  num_shared_experts 1, moe_intermediate_size 1024, tie_word_embeddings false, bf16 weights.
- Kimi K3: ``moonshotai/Kimi-K3`` ``config.json`` ``text_config`` (revision
  f831ab66814297da540d832a5235f8e904f29d06): vocab_size 163840, num_attention_heads 96,
  q_lora_rank 1536, qk_nope_head_dim 128, v_head_dim 128, mla_use_output_gate true,
  first_k_dense_replace 1, intermediate_size 33792, num_experts 896, num_experts_per_token 16,
  num_shared_experts 2, moe_intermediate_size 3072, routed_expert_hidden_size 3584 (latent MoE),
  ``linear_attn_config.use_full_rank_gate`` true (the KDA output gate: the checkpoint has one ``g_proj``
  per KDA layer where Kimi-Linear has ``g_a_proj`` / ``g_b_proj``, and keeps the low-rank decay gate
  ``f_a_proj`` / ``f_b_proj``; the revision's ``modeling_kimi_linear.py``); ``quantization_config`` mxfp4-pack-quantized,
  group_size 32, uint8 scales, shared experts ignored -> routed experts at 4 + 8/32 bits per weight.

Parameter counts (per layer; D hidden, H heads; weights only, norms and biases ignored):

- KDA (fla ``KimiDeltaAttention``): q, k, v projections 3 D H K; output H V D; beta D H;
  decay gate (f_a, f_b, low rank) D K + K H K; output gate (g_a, g_b) D V + V H V, or full rank (g_proj,
  K3's ``use_full_rank_gate``) D H V; short conv (2 H K + H V) W.
- MLA (DeepSeek-V2 layout): q D H (nope + rope) or D q_r + q_r H (nope + rope); kv_a D (r + rope);
  kv_b r H (nope + v); o H v D; K3's output gate D H v.
- FFN: dense SwiGLU 3 D I; MoE router D E, experts E 3 D_e I_moe, shared n_s 3 D I_moe, and for a
  latent MoE (D_e < D) down/up projections 2 D D_e (an assumption: the config names the width, not
  the layout).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kda_core.config import PRESETS as CONFIG_PRESETS
from kda_core.config import REAL_PRESETS, ModelConfig
from serve.errors import check_choice, check_int

MXFP4_BYTES_PER_WEIGHT = (4 + 8 / 32) / 8  # 4-bit values + one 8-bit scale per group of 32


@dataclass(frozen=True)
class ModelShape:
    """A hybrid KDA/MLA MoE model's sizes. Frozen; validated once in ``__post_init__``.

    Layers are 0-based; ``mla_layers`` lists the MLA ones, the rest are KDA. Widths in elements;
    ``*_bytes`` are bytes per element (weights may be fractional, e.g. MXFP4 0.53125).
    ``q_lora_rank`` 0 means a direct q projection. ``routed_expert_hidden_size`` equals
    ``hidden_size`` for an ordinary MoE. ``full_rank_gate``: the KDA output gate is one full-rank D x H V
    projection (``use_full_rank_gate``, Kimi K3) instead of the low-rank pair; the decay gate is low rank.
    """

    name: str
    num_layers: int
    mla_layers: tuple[int, ...]
    hidden_size: int
    vocab_size: int
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int
    full_rank_gate: bool
    mla_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_output_gate: bool
    first_dense_layers: int
    dense_intermediate_size: int
    num_experts: int
    experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    tie_word_embeddings: bool = False
    weight_bytes: float = 2.0
    routed_expert_weight_bytes: float = 2.0
    kv_bytes: int = 2
    state_bytes: int = 4
    conv_bytes: int = 2
    source: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "vocab_size", "kda_heads", "kda_head_dim", "conv_kernel",
                     "mla_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "dense_intermediate_size", "num_experts", "experts_per_token", "moe_intermediate_size",
                     "routed_expert_hidden_size", "kv_bytes", "state_bytes", "conv_bytes"):
            check_int(name, getattr(self, name))
        for name in ("q_lora_rank", "first_dense_layers", "num_shared_experts"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"{name} must be an int >= 0, got {val!r}")
        for name in ("weight_bytes", "routed_expert_weight_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if len(set(self.mla_layers)) != len(self.mla_layers) or any(
                not 0 <= i < self.num_layers for i in self.mla_layers):
            raise ValueError(f"mla_layers must be distinct indices in [0, {self.num_layers}), got {self.mla_layers}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token must be <= num_experts={self.num_experts}, "
                             f"got {self.experts_per_token}")
        if self.first_dense_layers > self.num_layers:
            raise ValueError(f"first_dense_layers must be <= num_layers={self.num_layers}, got {self.first_dense_layers}")

    # layer counts
    @property
    def num_mla_layers(self) -> int:
        return len(self.mla_layers)

    @property
    def num_kda_layers(self) -> int:
        return self.num_layers - len(self.mla_layers)

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers

    def all_mla(self) -> ModelShape:
        """Counterfactual: the same model with every layer MLA (the report's full-attention baseline,
        "the same number of layers and attention heads")."""
        return dataclasses.replace(self, name=f"{self.name} (all MLA)", mla_layers=tuple(range(self.num_layers)))

    # parameters per layer (elements)
    @property
    def kda_decay_gate_params(self) -> int:
        """Decay gate f_a (D -> K) then f_b (K -> H K): low rank in both Kimi-Linear and K3."""
        d, k = self.hidden_size, self.kda_head_dim
        return d * k + k * self.kda_heads * k

    @property
    def kda_output_gate_params(self) -> int:
        """Output gate: g_proj (D -> H V) when ``full_rank_gate``, else g_a (D -> V) then g_b (V -> H V)."""
        d, v = self.hidden_size, self.kda_head_dim
        return d * self.kda_heads * v if self.full_rank_gate else d * v + v * self.kda_heads * v

    @property
    def kda_layer_params(self) -> int:
        d, hk, hv = self.hidden_size, self.kda_heads * self.kda_head_dim, self.kda_heads * self.kda_head_dim
        return (3 * d * hk + hv * d + d * self.kda_heads + self.kda_decay_gate_params + self.kda_output_gate_params
                + (2 * hk + hv) * self.conv_kernel)

    @property
    def mla_kv_b_params(self) -> int:
        """kv_b: latent -> per-head nope keys and values (absorbed into q / o at decode)."""
        return self.kv_lora_rank * self.mla_heads * (self.qk_nope_head_dim + self.v_head_dim)

    @property
    def mla_kv_a_params(self) -> int:
        """kv_a: hidden -> latent + shared rope key (not split by heads: replicated under TP)."""
        return self.hidden_size * (self.kv_lora_rank + self.qk_rope_head_dim)

    @property
    def mla_layer_params(self) -> int:
        d, h, qk = self.hidden_size, self.mla_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        q = d * h * qk if self.q_lora_rank == 0 else d * self.q_lora_rank + self.q_lora_rank * h * qk
        gate = d * h * self.v_head_dim if self.mla_output_gate else 0
        return q + self.mla_kv_a_params + self.mla_kv_b_params + h * self.v_head_dim * d + gate

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.dense_intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed expert (SwiGLU at the expert width)."""
        return 3 * self.routed_expert_hidden_size * self.moe_intermediate_size

    @property
    def moe_always_params(self) -> int:
        """Per MoE layer, used by every token: router, shared experts, latent down/up projections."""
        d = self.hidden_size
        latent = 2 * d * self.routed_expert_hidden_size if self.routed_expert_hidden_size != d else 0
        return d * self.num_experts + self.num_shared_experts * 3 * d * self.moe_intermediate_size + latent

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        return (self.num_kda_layers * self.kda_layer_params + self.num_mla_layers * self.mla_layer_params
                + self.first_dense_layers * self.dense_mlp_params
                + self.num_moe_layers * (self.moe_always_params + self.num_experts * self.expert_params)
                + self.embedding_params + self.lm_head_params)

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies by (embedding lookup excluded, lm head included)."""
        head = self.lm_head_params or self.embedding_params
        return (self.num_kda_layers * self.kda_layer_params + self.num_mla_layers * self.mla_layer_params
                + self.first_dense_layers * self.dense_mlp_params
                + self.num_moe_layers * (self.moe_always_params + self.experts_per_token * self.expert_params)
                + head)

    # cache bytes
    @property
    def mla_kv_bytes_per_token_layer(self) -> int:
        """Latent KV bytes per token per MLA layer: (kv_lora_rank + rope) * kv_bytes."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_bytes

    @property
    def kda_state_bytes_layer(self) -> int:
        """One sequence's recurrent (H K V * state_bytes) + conv ((2 H K + H V)(W - 1) * conv_bytes)
        state in one KDA layer."""
        hk = self.kda_heads * self.kda_head_dim
        return (self.kda_heads * self.kda_head_dim ** 2 * self.state_bytes
                + 3 * hk * (self.conv_kernel - 1) * self.conv_bytes)


# Figures ModelConfig lacks, from the public HF configs (see the module docstring).
SOURCED_FIGURES: dict[str, dict] = {
    "kimi-linear-48b-a3b": dict(
        vocab_size=163840, mla_heads=32, q_lora_rank=0, qk_nope_head_dim=128, v_head_dim=128, mla_output_gate=False,
        full_rank_gate=False, first_dense_layers=1, dense_intermediate_size=9216, num_experts=256,
        experts_per_token=8, num_shared_experts=1, moe_intermediate_size=1024, routed_expert_hidden_size=2304,
        tie_word_embeddings=False, weight_bytes=2.0, routed_expert_weight_bytes=2.0,
        source="moonshotai/Kimi-Linear-48B-A3B-Instruct config.json"),
    "kimi-k3": dict(
        vocab_size=163840, mla_heads=96, q_lora_rank=1536, qk_nope_head_dim=128, v_head_dim=128, mla_output_gate=True,
        full_rank_gate=True, first_dense_layers=1, dense_intermediate_size=33792, num_experts=896,
        experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072, routed_expert_hidden_size=3584,
        tie_word_embeddings=False, weight_bytes=2.0, routed_expert_weight_bytes=MXFP4_BYTES_PER_WEIGHT,
        source="moonshotai/Kimi-K3 config.json text_config (revision f831ab66814297da540d832a5235f8e904f29d06)"),
}


def from_model_config(cfg: ModelConfig) -> ModelShape:
    """The ModelShape of a real preset: geometry from ``cfg``, the rest from ``SOURCED_FIGURES``.
    Raises ValueError for a config without sourced figures (the demo models)."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if cfg.name not in SOURCED_FIGURES:
        raise ValueError(f"cfg.name must be one of {sorted(SOURCED_FIGURES)} (real presets), got {cfg.name!r}")
    if cfg.head_k_dim != cfg.head_v_dim:
        raise ValueError(f"cfg.head_k_dim must equal head_v_dim for the real models, got {cfg.head_k_dim}, {cfg.head_v_dim}")
    return ModelShape(name=cfg.name, num_layers=cfg.num_layers, mla_layers=cfg.mla_layers, hidden_size=cfg.hidden_size,
                      kda_heads=cfg.num_heads, kda_head_dim=cfg.head_k_dim, conv_kernel=cfg.conv_kernel,
                      kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
                      **SOURCED_FIGURES[cfg.name])


def preset(name: str) -> ModelShape:
    """``from_model_config(kda_core.config.PRESETS[name])`` for a real preset name."""
    check_choice("name", name, list(REAL_PRESETS))
    return from_model_config(CONFIG_PRESETS[name])
