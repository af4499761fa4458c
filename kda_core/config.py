"""Model configurations (real Kimi presets + small demo models) and cache byte accounting.

Real-model facts are from the published Hugging Face configs (layer lists there are 1-based; ours
are 0-based):

- Kimi-Linear-48B-A3B: ``moonshotai/Kimi-Linear-48B-A3B-Instruct`` ``config.json`` at revision
  ``e1df551a447157d4658b573f9a695d57658590e9``: 27 layers, ``linear_attn_config.full_attn_layers``
  [4, 8, ..., 24, 27] (MLA at 0-based 3, 7, 11, 15, 19, 23, 26), 32 KDA heads x ``head_dim`` 128,
  ``short_conv_kernel_size`` 4; MLA ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64; softplus gate.
- Kimi K3: ``moonshotai/Kimi-K3`` ``config.json`` (``text_config``) at revision
  ``f831ab66814297da540d832a5235f8e904f29d06``: 93 layers, ``full_attn_layers`` [4, 8, ..., 92, 93]
  (24 MLA at 0-based 3, 7, ..., 91 and 92; 69 KDA), 96 KDA heads x 128, ``short_conv_kernel_size`` 4,
  ``gate_lower_bound`` -5.0; ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64, ``hidden_size`` 7168.

Byte formulas:

- MLA latent KV per token, whole model = num_mla_layers * (kv_lora_rank + qk_rope_head_dim) * s_kv
- KDA recurrent state per layer per sequence = H * K * V * s_state
- KDA conv state per layer per sequence = (2 H K + H V) * (W - 1) * s_conv  (raw q, k, v inputs)
- break-even context = fixed KDA state / MLA KV per token (with or without the conv state)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

GATES = ("softplus", "lower_bound")


def dtype_bytes(dtype: torch.dtype) -> int:
    """Element size in bytes of a torch dtype (e.g. bf16 -> 2, fp32 -> 4)."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ModelConfig:
    """A hybrid KDA/MLA model. Frozen; validated once in ``__post_init__``.

    Attributes (sizes in elements unless named otherwise):
        name: preset name. num_layers: all layers. mla_layers: 0-based indices of MLA layers.
        hidden_size: d_model. num_heads / head_k_dim / head_v_dim: KDA heads H and dims K, V.
        kv_lora_rank / qk_rope_head_dim: MLA latent (c_kv) width and shared rope-key width.
        gate: "softplus" (Kimi-Linear) or "lower_bound" (Kimi K3); lower_bound: e.g. -5.0.
        conv_kernel: short-conv width W. The remaining fields only size the runnable model
        ``HybridLM`` (vocab, MLA heads, MLP / MoE widths, norms, seed); for real presets they are unused.
        rms_norm_eps: epsilon of every RMSNorm (Kimi-Linear: 1e-5). mla_use_nope: MLA without rotary
            embedding (Kimi-Linear's ``mla_use_nope``: the shared ``qk_rope_head_dim`` key part is kept, unrotated).
        num_experts: routed experts per MoE layer (0 = a dense SwiGLU MLP of ``intermediate_size`` in every
            layer); num_experts_per_token: top-k; moe_intermediate_size: width of one expert (and of each shared
            expert); num_shared_experts: shared experts (their widths add up into one SwiGLU MLP);
            routed_scaling_factor: multiplies the routed weights; moe_renormalize: top-k weights divided by
            their sum first; num_expert_group / topk_group: grouped top-k (DeepSeek-V3); first_k_dense_replace:
            the first layers that keep a dense MLP. The router is sigmoid with ``e_score_correction_bias``
            (Kimi-Linear's ``moe_router_activation_func`` "sigmoid").
        source: where the numbers come from.
    """

    name: str
    num_layers: int
    mla_layers: tuple[int, ...]
    hidden_size: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    gate: str = "softplus"
    lower_bound: float | None = None
    conv_kernel: int = 4
    vocab_size: int = 256
    num_mla_heads: int = 4
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    intermediate_size: int = 256
    rms_norm_eps: float = 1e-6
    mla_use_nope: bool = False
    num_experts: int = 0
    num_experts_per_token: int = 1
    moe_intermediate_size: int = 64
    num_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    seed: int = 0
    source: str = field(default="", compare=False)

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_heads", "head_k_dim", "head_v_dim",
                     "kv_lora_rank", "qk_rope_head_dim", "vocab_size", "num_mla_heads",
                     "qk_nope_head_dim", "v_head_dim", "intermediate_size"):
            val = getattr(self, name)
            if not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be >= 2, got {self.conv_kernel}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE pairs), got {self.qk_rope_head_dim}")
        if len(set(self.mla_layers)) != len(self.mla_layers) or any(
                not 0 <= i < self.num_layers for i in self.mla_layers):
            raise ValueError(f"mla_layers must be distinct indices in [0, {self.num_layers}), got {self.mla_layers}")
        if not (isinstance(self.rms_norm_eps, float) and 0 < self.rms_norm_eps < 1):
            raise ValueError(f"rms_norm_eps must be a float in (0, 1), got {self.rms_norm_eps!r}")
        for name in ("num_experts", "num_shared_experts", "first_k_dense_replace"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise ValueError(f"{name} must be an int >= 0, got {val!r}")
        for name in ("num_experts_per_token", "moe_intermediate_size", "num_expert_group", "topk_group"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if self.num_experts:
            if self.num_experts_per_token > self.num_experts:
                raise ValueError(f"num_experts_per_token must be <= num_experts = {self.num_experts}, "
                                 f"got {self.num_experts_per_token}")
            if self.num_experts % self.num_expert_group or self.topk_group > self.num_expert_group:
                raise ValueError(f"num_experts ({self.num_experts}) must split into num_expert_group "
                                 f"({self.num_expert_group}) groups and topk_group ({self.topk_group}) <= groups")
            if self.num_expert_group > 1 and self.num_experts // self.num_expert_group < 2:
                raise ValueError("grouped top-k scores each group by its top 2 experts: need >= 2 experts per group")
            kept = self.topk_group * (self.num_experts // self.num_expert_group)      # experts of the kept groups
            if self.num_experts_per_token > kept:
                raise ValueError(f"num_experts_per_token ({self.num_experts_per_token}) must be <= the {kept} experts "
                                 f"of the topk_group ({self.topk_group}) groups kept")
        if not (isinstance(self.routed_scaling_factor, (int, float)) and 0 < self.routed_scaling_factor < math.inf):
            raise ValueError(f"routed_scaling_factor must be a finite number > 0, got {self.routed_scaling_factor!r}")
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {self.gate!r}")
        if self.gate == "lower_bound" and (self.lower_bound is None or self.lower_bound >= 0):
            raise ValueError(f"lower_bound must be negative for gate='lower_bound', got {self.lower_bound}")

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """0-based indices of the KDA layers."""
        return tuple(i for i in range(self.num_layers) if i not in self.mla_layers)

    @property
    def num_kda_layers(self) -> int:
        return self.num_layers - len(self.mla_layers)

    @property
    def num_mla_layers(self) -> int:
        return len(self.mla_layers)

    @property
    def latent_dim(self) -> int:
        """Per-token MLA cache width per layer: kv_lora_rank + qk_rope_head_dim (elements)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` (0-based) has the MoE feed-forward (else a dense SwiGLU MLP)."""
        return self.num_experts > 0 and i >= self.first_k_dense_replace

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv = raw q, k, v inputs: 2 H K + H V."""
        return self.num_heads * (2 * self.head_k_dim + self.head_v_dim)


def kimi_pattern(num_layers: int, kda_per_mla: int = 3) -> tuple[int, ...]:
    """MLA layer indices of the Kimi pattern: every (kda_per_mla + 1)-th layer, plus the last."""
    if num_layers <= 0 or kda_per_mla < 0:
        raise ValueError(f"num_layers must be > 0 and kda_per_mla >= 0, got {num_layers}, {kda_per_mla}")
    period = kda_per_mla + 1
    idx = {i for i in range(num_layers) if i % period == period - 1}
    idx.add(num_layers - 1)
    return tuple(sorted(idx))


def custom_config(num_layers: int, kda_per_mla: int, num_heads: int, head_dim: int,
                  hidden_size: int = 2304, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64) -> ModelConfig:
    """A Kimi-pattern config from a few sliders (page 03 "custom")."""
    return ModelConfig(name="custom", num_layers=num_layers, mla_layers=kimi_pattern(num_layers, kda_per_mla),
                       hidden_size=hidden_size, num_heads=num_heads, head_k_dim=head_dim, head_v_dim=head_dim,
                       kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, source="custom")


PRESETS: dict[str, ModelConfig] = {
    "kimi-linear-48b-a3b": ModelConfig(
        name="kimi-linear-48b-a3b", num_layers=27, mla_layers=kimi_pattern(27), hidden_size=2304,
        num_heads=32, head_k_dim=128, head_v_dim=128, kv_lora_rank=512, qk_rope_head_dim=64,
        gate="softplus", source="moonshotai/Kimi-Linear-48B-A3B-Instruct config.json "
               "(revision e1df551a447157d4658b573f9a695d57658590e9)"),
    "kimi-k3": ModelConfig(
        name="kimi-k3", num_layers=93, mla_layers=kimi_pattern(93), hidden_size=7168,
        num_heads=96, head_k_dim=128, head_v_dim=128, kv_lora_rank=512, qk_rope_head_dim=64,
        gate="lower_bound", lower_bound=-5.0, source="moonshotai/Kimi-K3 config.json, text_config "
               "(revision f831ab66814297da540d832a5235f8e904f29d06)"),
    "demo": ModelConfig(
        name="demo", num_layers=8, mla_layers=kimi_pattern(8), hidden_size=128, num_heads=4,
        head_k_dim=32, head_v_dim=32, kv_lora_rank=64, qk_rope_head_dim=16, num_mla_heads=4,
        qk_nope_head_dim=32, v_head_dim=32, intermediate_size=256,
        rms_norm_eps=1e-5, mla_use_nope=True, num_experts=8, num_experts_per_token=2, moe_intermediate_size=64,
        num_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1, source="runnable demo (this repo)"),
    "demo-k3gate": ModelConfig(
        name="demo-k3gate", num_layers=8, mla_layers=kimi_pattern(8), hidden_size=128, num_heads=4,
        head_k_dim=32, head_v_dim=32, kv_lora_rank=64, qk_rope_head_dim=16, gate="lower_bound",
        lower_bound=-5.0, rms_norm_eps=1e-5, mla_use_nope=True, num_experts=8, num_experts_per_token=2, moe_intermediate_size=64,
        num_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1, source="runnable demo with the K3 lower-bound gate (this repo)"),
    "demo-tiny": ModelConfig(
        name="demo-tiny", num_layers=4, mla_layers=kimi_pattern(4), hidden_size=32, num_heads=2,
        head_k_dim=16, head_v_dim=12, kv_lora_rank=16, qk_rope_head_dim=8, num_mla_heads=2,
        qk_nope_head_dim=8, v_head_dim=8, intermediate_size=64, rms_norm_eps=1e-5,
        mla_use_nope=True, num_experts=4, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1,
        routed_scaling_factor=2.446, first_k_dense_replace=1, source="test model (this repo), K != V"),
}
REAL_PRESETS = ("kimi-linear-48b-a3b", "kimi-k3")
PRESET_TITLES = {"kimi-linear-48b-a3b": "Kimi-Linear-48B-A3B", "kimi-k3": "Kimi K3", "demo": "demo hybrid",
                 "demo-k3gate": "demo hybrid (K3 gate)", "demo-tiny": "tiny test hybrid"}


def preset_title(name: str) -> str:
    """How a preset is written for a reader (Moonshot's model names; "demo hybrid" for the runnable demo).
    Raises ValueError for a name not in :data:`PRESETS`."""
    if name not in PRESET_TITLES:
        raise ValueError(f"name must be one of {sorted(PRESET_TITLES)}, got {name!r}")
    return PRESET_TITLES[name]


def mla_kv_bytes_per_token(cfg: ModelConfig, kv_dtype: torch.dtype = torch.bfloat16) -> int:
    """Latent KV bytes per token for the whole model: num_mla_layers * (r + rope) * s_kv."""
    return cfg.num_mla_layers * cfg.latent_dim * dtype_bytes(kv_dtype)


def all_mla_kv_bytes_per_token(cfg: ModelConfig, kv_dtype: torch.dtype = torch.bfloat16) -> int:
    """Counterfactual only: every layer counted at MLA width (a known mistake in public tools)."""
    return cfg.num_layers * cfg.latent_dim * dtype_bytes(kv_dtype)


def kda_state_elems_per_layer(shape) -> tuple[int, int]:
    """Elements of one KDA layer's state for one sequence: ``(H * K * V, (2 H K + H V) * (W - 1))``, the
    recurrent state and the conv window. The one place this formula lives; every byte count of a KDA
    state multiplies it by element sizes. ``shape``: a :class:`ModelConfig`, or any object with
    ``num_heads``, ``head_k_dim``, ``head_v_dim``, ``conv_dim`` and ``conv_kernel`` (e.g.
    ``serve.spec_decode.rollback.LayerShape``)."""
    return shape.num_heads * shape.head_k_dim * shape.head_v_dim, shape.conv_dim * (shape.conv_kernel - 1)


def kda_state_bytes_per_layer(cfg: ModelConfig, state_dtype: torch.dtype = torch.float32, tp_size: int = 1) -> int:
    """Recurrent state bytes per KDA layer per sequence: H * K * V * s / tp_size (heads split by TP)."""
    if tp_size <= 0 or cfg.num_heads % tp_size:
        raise ValueError(f"tp_size must be a positive divisor of num_heads={cfg.num_heads}, got {tp_size}")
    return kda_state_elems_per_layer(cfg)[0] * dtype_bytes(state_dtype) // tp_size


def conv_state_bytes_per_layer(cfg: ModelConfig, conv_dtype: torch.dtype = torch.bfloat16, tp_size: int = 1) -> int:
    """Conv state bytes per KDA layer per sequence: (2 H K + H V) * (W - 1) * s / tp_size."""
    if tp_size <= 0 or cfg.num_heads % tp_size:
        raise ValueError(f"tp_size must be a positive divisor of num_heads={cfg.num_heads}, got {tp_size}")
    return kda_state_elems_per_layer(cfg)[1] * dtype_bytes(conv_dtype) // tp_size


def fixed_state_bytes_per_sequence(cfg: ModelConfig, state_dtype: torch.dtype = torch.float32,
                                   conv_dtype: torch.dtype = torch.bfloat16) -> int:
    """All KDA layers' recurrent + conv state of one sequence (independent of context length)."""
    return cfg.num_kda_layers * (kda_state_bytes_per_layer(cfg, state_dtype) + conv_state_bytes_per_layer(cfg, conv_dtype))


def break_even_tokens(cfg: ModelConfig, state_dtype: torch.dtype = torch.float32,
                      kv_dtype: torch.dtype = torch.bfloat16, conv_dtype: torch.dtype = torch.bfloat16) -> float:
    """Context length (tokens) at which the MLA KV equals the fixed KDA state, recurrent + conv
    (inf if no MLA layer)."""
    per_tok = mla_kv_bytes_per_token(cfg, kv_dtype)
    return math.inf if per_tok == 0 else fixed_state_bytes_per_sequence(cfg, state_dtype, conv_dtype) / per_tok


def recurrent_break_even_tokens(cfg: ModelConfig, state_dtype: torch.dtype = torch.float32,
                                kv_dtype: torch.dtype = torch.bfloat16) -> float:
    """Like :func:`break_even_tokens` but counting only the recurrent state
    (num_kda_layers * H K V s_state), without the conv window (inf if no MLA layer)."""
    per_tok = mla_kv_bytes_per_token(cfg, kv_dtype)
    return math.inf if per_tok == 0 else cfg.num_kda_layers * kda_state_bytes_per_layer(cfg, state_dtype) / per_tok


class SequenceBytes(NamedTuple):
    """Cache bytes of one sequence at a context length (all fields in bytes)."""

    num_tokens: int
    mla_kv_bytes: int
    kda_state_bytes: int
    total_bytes: int
    all_mla_bytes: int


def sequence_bytes(cfg: ModelConfig, num_tokens: int, state_dtype: torch.dtype = torch.float32,
                   kv_dtype: torch.dtype = torch.bfloat16, conv_dtype: torch.dtype = torch.bfloat16) -> SequenceBytes:
    """Bytes one sequence holds at ``num_tokens`` of context: MLA KV grows, KDA state is flat."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    kv = num_tokens * mla_kv_bytes_per_token(cfg, kv_dtype)
    st = fixed_state_bytes_per_sequence(cfg, state_dtype, conv_dtype)
    return SequenceBytes(num_tokens, kv, st, kv + st, num_tokens * all_mla_kv_bytes_per_token(cfg, kv_dtype))


def layer_table(cfg: ModelConfig, num_tokens: int, state_dtype: torch.dtype = torch.float32,
                kv_dtype: torch.dtype = torch.bfloat16, conv_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """One row per layer: index, kind, bytes per token, fixed bytes, bytes at ``num_tokens``."""
    rows = []
    st = kda_state_bytes_per_layer(cfg, state_dtype)
    cv = conv_state_bytes_per_layer(cfg, conv_dtype)
    per_tok = cfg.latent_dim * dtype_bytes(kv_dtype)
    for i in range(cfg.num_layers):
        if i in cfg.mla_layers:
            rows.append({"layer": i, "kind": "MLA", "bytes_per_token": per_tok, "fixed_bytes": 0,
                         "bytes_at_context": per_tok * num_tokens})
        else:
            rows.append({"layer": i, "kind": "KDA", "bytes_per_token": 0, "fixed_bytes": st + cv,
                         "bytes_at_context": st + cv})
    return rows
