"""What each rollback strategy holds: bytes measured after a real one-layer verify, and per-model tables.

The measurement (page 01) runs one KDA layer's verify with the real kernels — short conv + SiLU, L2
norm, :func:`kda_core.kda.kda_gate`, :func:`kda_core.kda.kda_recurrent` with every intermediate
state — on seeded inputs, hands it to each strategy's ``record`` and reads ``nbytes()``. The layer's
projection weights are not materialised: at Kimi K3 width (d = 7168, H = 96) they alone would take
1.4 GB, and the buffers a strategy keeps depend only on the tensors the verify produced.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kda_core.config import PRESETS, REAL_PRESETS, ModelConfig, dtype_bytes
from kda_core.config import preset_title as preset_title  # re-exported: page 01's model labels
from kda_core.conv import short_conv
from kda_core.kda import kda_gate, kda_recurrent
from kda_core.layer import KDAAux, KDACache, l2norm
from kda_core.model import ForwardOutput, HybridCache
from serve.errors import check_choice, check_int
from serve.spec_decode.projection import ProjectionReplay
from serve.spec_decode.raw_input_ring import RawInputRing
from serve.spec_decode.replay_ssm import ReplaySSM
from serve.spec_decode.rollback import (
    LayerShape,
    RollbackStrategy,
    projection_bytes_per_token,
    raw_input_bytes_per_token,
    snapshot_bytes_per_token,
)
from serve.spec_decode.snapshot import SnapshotRollback
from serve.spec_decode.verify import STRATEGIES, make_strategy

MIB = 2 ** 20
LAYER_PRESETS: dict[str, LayerShape] = {
    "S0 toy (H=1, K=V=16)": LayerShape(1, 16, 16, 4, 64),
    "S1 small (H=4, K=V=64)": LayerShape(4, 64, 64, 4, 512),
    "S2 Kimi-Linear (H=32, K=V=128)": LayerShape(32, 128, 128, 4, 2304),
    "S3 Kimi K3 (H=96, K=V=128)": LayerShape(96, 128, 128, 4, 7168),
}
FORMULAS = {
    SnapshotRollback.name: "H·K·V·s + (2HK+HV)(W−1)·s",
    ProjectionReplay.name: "H·(2K+V+1)·s + (2HK+HV)·s",
    RawInputRing.name: "d·s",
    ReplaySSM.name: "H·(2K+V)·s + (2HK+HV)·s",
}


class LayerTarget:
    """A one-KDA-layer stand-in for ``HybridLM`` with what ``RollbackStrategy.record`` reads
    (``cfg``, ``kda_layers``); it has no weights, so a commit that re-projects (the ring) cannot run."""

    def __init__(self, shape: LayerShape):
        self.cfg = ModelConfig(name="one-layer", num_layers=1, mla_layers=(), hidden_size=shape.hidden_size,
                               num_heads=shape.num_heads, head_k_dim=shape.head_k_dim, head_v_dim=shape.head_v_dim,
                               kv_lora_rank=1, qk_rope_head_dim=2, conv_kernel=shape.conv_kernel)
        self.kda_layers = self.cfg.kda_layers
        self.mixers = (None,)


def layer_verify(shape: LayerShape, num_draft: int, seed: int = 0) -> tuple[LayerTarget, HybridCache, ForwardOutput]:
    """One KDA layer's verify over ``1 + num_draft`` tokens from a non-zero state, real kernels, seeded.

    Returns (target, base cache, verify output with ``aux[0]`` a :class:`KDAAux`). Raises ValueError
    for ``num_draft < 0``."""
    check_int("num_draft", num_draft, 0)
    gen = torch.Generator().manual_seed(seed)
    H, K, V, W, d = shape
    T, D = 1 + num_draft, shape.conv_dim
    raw = torch.randn(1, T, D, generator=gen)                                # [1, T, 2HK+HV]
    conv0 = torch.randn(1, D, W - 1, generator=gen)                          # [1, D, W-1]
    y, conv = short_conv(raw, torch.randn(D, W, generator=gen) * W ** -0.5, conv0)
    q = l2norm(y[..., : H * K].reshape(1, T, H, K))                          # [1, T, H, K]
    k = l2norm(y[..., H * K: 2 * H * K].reshape(1, T, H, K))                 # [1, T, H, K]
    v = y[..., 2 * H * K:].reshape(1, T, H, V)                               # [1, T, H, V]
    g = kda_gate(torch.randn(1, T, H, K, generator=gen), torch.zeros(H))     # [1, T, H, K]
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen))               # [1, T, H]
    s0 = 0.1 * torch.randn(1, H, K, V, generator=gen)                        # [1, H, K, V]
    _, state, states = kda_recurrent(q, k, v, g, beta, s0, output_states=True)
    x = torch.randn(1, T, d, generator=gen)                                  # [1, T, d]
    base = HybridCache((KDACache(s0, conv0),), 16)
    out = ForwardOutput(None, HybridCache((KDACache(state, conv),), 16 + T), {0: KDAAux(x, raw, q, k, v, g, beta, states)})
    return LayerTarget(shape), base, out


def strategies_for(num_tokens: int, store_dtype: torch.dtype = torch.float32) -> list[RollbackStrategy]:
    """One of each strategy (snapshot first); both rings sized to exactly the verify (capacity = window = T)."""
    return [make_strategy(name, num_tokens, num_tokens, store_dtype) for name in STRATEGIES]


class LayerBytes(NamedTuple):
    """One strategy after a one-layer verify: measured ``nbytes`` and the analytic formula (bytes)."""

    strategy: str
    measured_bytes: int
    formula_bytes: int
    formula: str
    vs_snapshot: float


def measure_layer_bytes(shape: LayerShape, num_draft: int, store_dtype: torch.dtype = torch.float32,
                        seed: int = 0) -> list[LayerBytes]:
    """Bytes each strategy holds after a real one-layer verify of ``1 + num_draft`` tokens.

    Formula bytes = ``(1 + num_draft) x bytes_per_token(shape, s)``; ``vs_snapshot`` = measured / snapshot.
    """
    target, base, out = layer_verify(shape, num_draft, seed)
    T, s = 1 + num_draft, dtype_bytes(store_dtype)
    rows = []
    for strat in strategies_for(T, store_dtype):
        strat.record(target, base, out)
        strat.check_integrity()
        rows.append((strat.name, strat.nbytes(), T * strat.bytes_per_token(shape, s)))
        strat.discard()
    snap = rows[0][1]
    return [LayerBytes(n, b, f, FORMULAS[n], b / snap) for n, b, f in rows]


def model_rollback_row(cfg: ModelConfig, state_dtype: torch.dtype = torch.float32,
                       act_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Whole-model rollback bytes per draft token (all KDA layers), by component, in MiB.

    Snapshot state in ``state_dtype`` (recurrent states are kept in fp32 by vLLM/SGLang for KDA);
    conv windows, projections and raw inputs in ``act_dtype`` (the activations' dtype)."""
    shape, L = LayerShape.from_config(cfg), cfg.num_kda_layers
    s_state, s_act = dtype_bytes(state_dtype), dtype_bytes(act_dtype)
    H, K, V = cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
    snap_state = L * H * K * V * s_state
    snap_conv = L * (snapshot_bytes_per_token(shape, s_act) - H * K * V * s_act)
    proj = L * H * (2 * K + V + 1) * s_act
    conv_in = L * (projection_bytes_per_token(shape, s_act) - H * (2 * K + V + 1) * s_act)
    raw = L * raw_input_bytes_per_token(shape, s_act)
    replay = L * H * (2 * K + V) * s_act                    # ReplaySSM k, u, g (its conv inputs as projection replay's)
    return {"model": cfg.name, "KDA layers": L, "snapshot state MiB": snap_state / MIB,
            "snapshot conv window MiB": snap_conv / MIB, "projections k,v,g,beta MiB": proj / MIB,
            "conv inputs MiB": conv_in / MIB, "raw inputs MiB": raw / MIB,
            "ReplaySSM k,u,g MiB": replay / MIB,
            "snapshot / projections": snap_state / proj, "snapshot / raw inputs": snap_state / raw}


def model_rollback_table(state_dtype: torch.dtype = torch.float32, act_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """:func:`model_rollback_row` for the real presets and the runnable demo."""
    return [model_rollback_row(PRESETS[n], state_dtype, act_dtype) for n in (*REAL_PRESETS, "demo")]



DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}    # stored dtypes page 01 offers


class RollbackPage(NamedTuple):
    """Everything page 01 draws: the layer ``shape``, the stored element size ``elem_bytes`` (s), the
    measured one-layer rows (:func:`measure_layer_bytes`), the whole-model rows (:func:`model_rollback_table`)
    and the Kimi K3 config the text quotes."""

    shape: LayerShape
    elem_bytes: int
    layer: list[LayerBytes]
    models: list[dict]
    k3: ModelConfig


def rollback_page(shape: tuple[int, ...], num_draft: int, dtype_name: str) -> RollbackPage:
    """Page 01's one call. ``shape``: ``(H, K, V, W, d)`` as :class:`LayerShape`; ``dtype_name`` a key of
    ``DTYPES``. Raises ValueError for an unknown dtype name or ``num_draft < 0``."""
    check_choice("dtype_name", dtype_name, tuple(DTYPES))
    layer_shape = LayerShape(*shape)
    return RollbackPage(layer_shape, dtype_bytes(DTYPES[dtype_name]),
                        measure_layer_bytes(layer_shape, num_draft, DTYPES[dtype_name]), model_rollback_table(),
                        PRESETS["kimi-k3"])
