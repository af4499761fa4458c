"""Page 17, what a state format buys and where a state's range ends: requests per GPU at the real models'
bytes, and whether a KDA state can outgrow fp16.

:func:`capacity_table` turns bytes per slot (:mod:`serve.memory.state_precision`) into slots per GB and the
largest concurrent batch on one GPU of a TP group (:mod:`serve.scale.capacity`: 0.9 of HBM minus the weights;
MLA latent KV at the context plus every KDA layer's state in the format and its bf16 conv state).
:func:`low_decay_probe` runs the KDA recurrence on a constructed near-zero-decay input to see whether the state
or its readout can pass fp16's 65,504 (vllm#54146 saw a GDN readout overflow there).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import pandas as pd
import torch

from kda_core.kda import kda_recurrent
from lab.threads import one_thread
from serve.errors import check_choice, check_int
from serve.memory.state_precision import FORMATS, state_format
from serve.scale.capacity import cache_bytes_per_sequence, free_cache_bytes
from serve.scale.hardware import GPUS, hardware
from serve.scale.model_shape import preset

REFERENCE = "fp32"
FP16_MAX = 65504.0               # largest finite fp16
REAL_MODELS = ("kimi-linear-48b-a3b", "kimi-k3")
GPU_NAMES = tuple(GPUS)
GB = 1e9
CONTEXTS = (0, 4096, 32768, 131072, 1048576)            # capacity: tokens of MLA latent KV beside each slot
DECAYS = (1e-2, 1e-4, 1e-6)                             # low-decay probe: 1 - exp(g) per token
VALUE_SCALES = (1.0, 100.0, 10000.0, 30000.0)           # low-decay probe: sigma of v ~ N(0, sigma^2)


def slot_bytes(model: str, fmt: str, tp: int) -> float:
    """Bytes of one request's KDA slot on each GPU of a TP group of ``tp`` for real model ``model``: every KDA
    layer's recurrent state in ``fmt`` (scales included) plus its conv state at the model's conv bytes (bf16),
    split by heads. Raises ValueError for an unknown model or format or a bad tp."""
    check_choice("model", model, list(REAL_MODELS))
    shape = preset(model)
    check_int("tp", tp)
    fp32_state = shape.kda_heads * shape.kda_head_dim ** 2 * shape.state_bytes    # kda_state_bytes_layer's state part
    conv = shape.kda_state_bytes_layer - fp32_state                              # 3 H K (W - 1) conv bytes
    state = state_format(fmt).state_bytes(shape.kda_heads, shape.kda_head_dim, shape.kda_head_dim)
    return shape.num_kda_layers * (state + conv) / tp


class SlotParts(NamedTuple):
    """One request's KDA state for a real model at TP 1, all KDA layers, by part (bytes): ``recurrent_fp32``
    (H K V x 4 B per layer), ``conv_bf16`` and ``conv_fp32`` (the (2 H K + H V)(W - 1) conv window at 2 or 4 B).
    The figures the pages show are sums of these: page 03 and section 1 here (the real models' layout) are
    recurrent fp32 + bf16 conv; our engine's layout (section 4) is recurrent + fp32 conv."""

    recurrent_fp32: int
    conv_bf16: int
    conv_fp32: int


def slot_parts(model: str) -> SlotParts:
    """:class:`SlotParts` of real model ``model`` (config: :func:`serve.scale.model_shape.preset`). Raises
    ValueError for an unknown model."""
    check_choice("model", model, list(REAL_MODELS))
    shape = preset(model)
    hk, hv = shape.kda_heads * shape.kda_head_dim, shape.kda_heads * shape.kda_head_dim   # K = V
    conv_elems = (2 * hk + hv) * (shape.conv_kernel - 1)                          # per layer
    n = shape.num_kda_layers
    return SlotParts(recurrent_fp32=n * shape.kda_heads * shape.kda_head_dim ** 2 * 4, conv_bf16=n * conv_elems * 2,
                     conv_fp32=n * conv_elems * 4)


def smallest_tp(model: str, gpu: str) -> int:
    """The smallest power-of-two TP group (up to 64) whose GPUs hold the weights with room for one request."""
    shape, hw = preset(model), hardware(gpu)
    for tp in (1, 2, 4, 8, 16, 32, 64):
        if free_cache_bytes(shape, hw, tp) > cache_bytes_per_sequence(shape, tp, 0):
            return tp
    raise ValueError(f"{model} does not fit on 64 x {gpu}")


def capacity_table(context: int = 4096, gpu: str = "H200") -> pd.DataFrame:
    """Per real model and format: ``tp`` (:func:`smallest_tp`), ``slot_bytes`` (per GPU), ``slots_per_gb``
    (1e9 / slot bytes: state slots alone), ``max_requests`` (largest concurrent batch at ``context`` tokens:
    free cache bytes / (MLA latent KV at the context + slot bytes)) and ``vs_fp32`` (max_requests / fp32's).
    Raises ValueError for a bad context or GPU."""
    check_int("context", context, 0)
    check_choice("gpu", gpu, list(GPUS))
    rows = []
    for model in REAL_MODELS:
        shape, hw = preset(model), hardware(gpu)
        tp = smallest_tp(model, gpu)
        free = free_cache_bytes(shape, hw, tp)
        kv = shape.num_mla_layers * context * shape.mla_kv_bytes_per_token_layer     # replicated on every rank
        for fmt in FORMATS:
            sb = slot_bytes(model, fmt, tp)
            rows.append(dict(model=model, gpu=gpu, tp=tp, context=context, format=fmt, label=FORMATS[fmt].label,
                             slot_bytes=sb, slots_per_gb=GB / sb, max_requests=max(0, math.floor(free / (kv + sb)))))
    df = pd.DataFrame(rows)
    base = df[df.format == REFERENCE].set_index("model").max_requests
    df["vs_fp32"] = df.max_requests / df.model.map(base)
    return df


def low_decay_probe(num_tokens: int = 2048, decay: float = 1e-4, value_scale: float = 1.0, seed: int = 0,
                    heads: int = 4, dim: int = 32) -> pd.DataFrame:
    """The KDA recurrence (fp32) on a constructed near-zero-decay input: ``g = log(1 - decay)`` on every key
    channel, ``beta = 1``, random L2-normalised q and k, v ~ N(0, value_scale^2), H = ``heads``, K = V = ``dim``.
    Returns one row per position: ``max_abs_state`` (max |S|), ``max_abs_readout`` (max |o|, o = S^T q K^-0.5:
    what an fp16 readout would hold, vllm#54146), ``max_abs_value`` (max |v| so far). Raises ValueError for
    ``decay`` outside (0, 1), a bad size or ``value_scale`` <= 0."""
    check_int("num_tokens", num_tokens)
    check_int("heads", heads)
    check_int("dim", dim)
    if not 0 < decay < 1 or not 0 < value_scale < math.inf:
        raise ValueError(f"decay must be in (0, 1) and value_scale > 0, got {decay!r}, {value_scale!r}")
    gen = torch.Generator().manual_seed(seed)
    shape = (1, num_tokens, heads, dim)
    q = torch.nn.functional.normalize(torch.randn(shape, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(shape, generator=gen), dim=-1)
    v = torch.randn(shape, generator=gen) * value_scale
    g = torch.full(shape, math.log1p(-decay))
    beta = torch.ones(1, num_tokens, heads)
    with one_thread():
        o, _, states = kda_recurrent(q, k, v, g, beta, output_states=True)   # o [1, T, H, V], states [1, T, H, K, V]
    return pd.DataFrame(dict(position=range(1, num_tokens + 1),
                             max_abs_state=states.flatten(2).abs().amax(-1)[0].tolist(),
                             max_abs_readout=o.flatten(2).abs().amax(-1)[0].tolist(),
                             max_abs_value=v.flatten(2).abs().amax(-1)[0].cummax(0).values.tolist()))
