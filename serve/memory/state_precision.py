"""Storage formats of a KDA state slot (and of a prefix-cache checkpoint): the recurrence computes in fp32,
only the bytes at rest change.

A slot holds one sequence's recurrent state ``[B, H, K, V]`` (key-first, as everywhere). :func:`store` turns
an fp32 state into a :class:`StoredState` of raw bytes (``uint8`` payload plus fp32 scales); :func:`load`
turns it back into fp32. The engine-side contract is vLLM's ``--mamba-ssm-cache-dtype`` (vllm#22928: the
state is kept in its own dtype, the conv state in the model's) and tpu-inference#2482: read the slot,
dequantise to fp32, run the step in fp32, quantise on the write back.

Formats (:data:`FORMATS`; per element, V values per key row):

=============  ===========================================  ======================  ==============================
name           stored as                                    bound per element       source
=============  ===========================================  ======================  ==============================
fp32           the fp32 bits (bitwise round trip)           0                       vllm#22928, vllm#34489 default
bf16           round-to-nearest-even bf16                   rel 2^-8 (normal)       vLLM / SGLang ``bfloat16``
fp16           round-to-nearest-even fp16; > 65504 -> inf   rel 2^-11 (normal)      vLLM ``float16``; vllm#54146
fp8_e4m3       e4m3fn of x / s, s = amax(row) / 448         rel 2^-4 (normal)       vllm#52962, vllm#40012
fp8_e4m3_sr    as fp8_e4m3, stochastic rounding (seeded)    one e4m3 step, unbiased vllm#52962, vllm#40012
int8_head      round(x / s), s = amax(head) / 127           abs s / 2               per-head scale, for contrast
int8           round(x / s), s = amax(row) / 127            abs s / 2               vllm#52196, vllm#55196
int8_ef        int8 of (x + r_prev); r = x + r_prev - x̂      abs s / 2 of x + r_prev vllm#55196 (error feedback)
               kept as int4 with its own row scale
=============  ===========================================  ======================  ==============================

Scales are fp32, one per **head row** ``(h, k)`` of the state (``[B, H, K]``, each covering V values), as
vllm#52962 and vllm#40012 store one scale per ``(head, head_dim)``. Why per row and not per head: KDA's
decay ``diag(exp(g))`` is per key channel, so the K rows of one head decay at different rates and their
magnitudes differ by orders; one scale per head sizes the step for the largest row and rounds the small
rows to zero (on the trained model, after 5,500 tokens: state drift 0.139 with a head scale, 0.049 with row
scales; ``bench/results/state_precision.json``). The cost is 4 bytes per V values (1/32 of a byte per element
at V = 128).

Error feedback (vllm#55196): the residual ``r = (x + r_prev) - x̂`` (x̂ = what the load returns) of one store is kept in the slot
(as int4 with its own row scale, packed two per byte) and added to the state of the **next** store, so a
rounding error is paid back one step later instead of accumulating (sigma-delta quantisation). The load
returns the int8 value alone; the residual is never read by the step.

Stochastic rounding picks the upper or lower e4m3 neighbour of ``x / s`` with probability proportional to
closeness (``E[load] = x``); draws come from the ``generator`` the caller passes (seeded), never a global one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

FP8_MAX = 448.0          # largest finite float8_e4m3fn
INT8_MAX = 127           # symmetric int8: [-127, 127]
INT4_MAX = 7             # symmetric int4 residual: [-7, 7]
SCALE_BYTES = 4          # one fp32 scale per head row


@dataclass(frozen=True)
class StateFormat:
    """One storage format. ``element_bytes``: payload bytes per state element; ``row_scaled``: one fp32 scale
    per head row ``(h, k)``; ``head_scaled``: one fp32 scale per head; ``stochastic``: stochastic rounding; ``error_feedback``: an int4 residual with its
    own row scale carried to the next store; ``rel_bound``: worst relative error per element for values in the
    format's normal range (None for the absolute int8 bound ``scale / 2``)."""

    name: str
    label: str
    element_bytes: int
    row_scaled: bool = False
    head_scaled: bool = False
    stochastic: bool = False
    error_feedback: bool = False
    rel_bound: float | None = 0.0

    def state_bytes(self, heads: int, k_dim: int, v_dim: int) -> int:
        """Bytes of one sequence's ``[H, K, V]`` state in one layer: payload + row scales + residual.
        Raises ValueError for a size < 1 or, with error feedback, an odd V (two int4 values per byte)."""
        for name, val in (("heads", heads), ("k_dim", k_dim), ("v_dim", v_dim)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        if self.error_feedback and v_dim % 2:
            raise ValueError(f"v_dim must be even for {self.name} (two int4 residuals per byte), got {v_dim}")
        rows = heads * k_dim
        total = rows * v_dim * self.element_bytes                     # payload
        if self.row_scaled:
            total += rows * SCALE_BYTES                               # one fp32 scale per head row
        if self.head_scaled:
            total += heads * SCALE_BYTES                              # one fp32 scale per head
        if self.error_feedback:
            total += rows * (v_dim // 2 + SCALE_BYTES)                # int4 residual + its row scale
        return total


FORMATS: dict[str, StateFormat] = {f.name: f for f in (
    StateFormat("fp32", "fp32", 4),
    StateFormat("bf16", "bf16", 2, rel_bound=2.0 ** -8),
    StateFormat("fp16", "fp16", 2, rel_bound=2.0 ** -11),
    StateFormat("fp8_e4m3", "fp8 e4m3 (row scale)", 1, row_scaled=True, rel_bound=2.0 ** -4),
    StateFormat("fp8_e4m3_sr", "fp8 e4m3 + stochastic rounding", 1, row_scaled=True, stochastic=True,
                rel_bound=2.0 ** -3),
    StateFormat("int8_head", "int8 (head scale)", 1, head_scaled=True, rel_bound=None),
    StateFormat("int8", "int8 (row scale)", 1, row_scaled=True, rel_bound=None),
    StateFormat("int8_ef", "int8 + error feedback", 1, row_scaled=True, error_feedback=True, rel_bound=None),
)}


def state_format(name: str) -> StateFormat:
    """The format called ``name``. Raises ValueError naming the bad name and the known ones."""
    if not isinstance(name, str) or name not in FORMATS:
        raise ValueError(f"state format must be one of {list(FORMATS)}, got {name!r}")
    return FORMATS[name]


class StoredState(NamedTuple):
    """A state at rest. ``payload`` uint8 ``[B, H, K, V * element_bytes]`` (the format's raw bits);
    ``scales`` fp32 ``[B, H, K]`` (row-scaled formats, else None); ``residual`` uint8 ``[B, H, K, V / 2]``
    (int4 pairs, error feedback only) and ``residual_scales`` fp32 ``[B, H, K]``."""

    format: str
    payload: torch.Tensor
    scales: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    residual_scales: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held, every tensor counted (equals ``state_bytes`` x B)."""
        return sum(t.numel() * t.element_size() for t in self[1:] if t is not None)


def _check_state(state) -> None:
    if not isinstance(state, torch.Tensor) or state.dim() != 4:
        got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
        raise ValueError(f"state must be a tensor [B, H, K, V], got {got}")
    if state.dtype != torch.float32:
        raise ValueError(f"state must be float32 (the recurrence's dtype), got {state.dtype}")


def _row_scale(x: torch.Tensor, qmax: float, per_head: bool = False) -> torch.Tensor:
    """fp32 scale per head row ``[B, H, K]`` (``per_head``: per head ``[B, H]``) = amax / qmax over the V values
    of the row (the K x V values of the head); an all-zero row gets 1 (it stores zeros)."""
    amax = x.abs().amax(dim=(-2, -1) if per_head else -1)             # [B, H] or [B, H, K]
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def _expand(scale: torch.Tensor) -> torch.Tensor:
    """A row scale ``[B, H, K]`` -> ``[B, H, K, 1]``; a head scale ``[B, H]`` -> ``[B, H, 1, 1]``."""
    return scale.unsqueeze(-1) if scale.dim() == 3 else scale[..., None, None]


def _fp8_stochastic(y: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """e4m3fn of ``y`` (|y| <= 448) with stochastic rounding: the nearest value ``a`` or its neighbour ``b`` on
    the other side of ``y``, ``b`` with probability |y - a| / |b - a|. Neighbours are one code apart in the
    magnitude bits (the low 7 bits of e4m3fn), so ``b`` is ``a``'s code +-1 with ``a``'s sign."""
    if generator is None:
        raise ValueError("generator must be a seeded torch.Generator for stochastic rounding, got None")
    near = y.to(torch.float8_e4m3fn)                                  # round to nearest even
    a = near.float()
    mag = near.view(torch.uint8).to(torch.int16) & 0x7F               # magnitude code of a
    away = (a.abs() < y.abs()).to(torch.int16) * 2 - 1                # +1: b is further from 0, -1: nearer
    far_mag = (mag + away).clamp(0, 0x7E)                             # 0x7F is NaN in e4m3fn
    sign = (y < 0).to(torch.int16) << 7
    far = (sign | far_mag).to(torch.uint8)
    b = far.view(torch.float8_e4m3fn).float()
    step = (b - a).abs()
    p = torch.where((step > 0) & (a != y), (y - a).abs() / step, torch.zeros_like(step))
    u = torch.rand(y.shape, generator=generator)
    code = torch.where(u < p, far, near.view(torch.uint8))
    return code.view(torch.float8_e4m3fn)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int values in [-7, 7] ``[..., V]`` (V even) -> uint8 ``[..., V / 2]``, low nibble first."""
    n = (q.to(torch.int16) & 0xF)                                     # two's-complement nibbles
    return (n[..., 0::2] | (n[..., 1::2] << 4)).to(torch.uint8)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.int16)
    n = torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)           # [..., V]
    return torch.where(n > 7, n - 16, n).float()


def _residual(stored: StoredState) -> torch.Tensor:
    return _unpack_int4(stored.residual) * stored.residual_scales.unsqueeze(-1)


def store(state: torch.Tensor, fmt: str, previous: StoredState | None = None,
          generator: torch.Generator | None = None) -> StoredState:
    """Write fp32 ``state [B, H, K, V]`` in format ``fmt``. Pure: ``state`` is not modified.

    ``previous``: the slot's last :class:`StoredState` (error feedback reads its residual; other formats ignore
    it). ``generator``: the seeded ``torch.Generator`` stochastic rounding draws from.
    Raises ValueError for an unknown format, a state that is not fp32 ``[B, H, K, V]``, an odd V with error
    feedback, a ``previous`` of another format or shape, or stochastic rounding without a generator.
    """
    f = state_format(fmt)
    _check_state(state)
    if f.element_bytes in (2, 4):
        dtype = {4: torch.float32, 2: torch.bfloat16 if f.name == "bf16" else torch.float16}[f.element_bytes]
        return StoredState(f.name, state.to(dtype).contiguous().view(torch.uint8))
    x = state
    if f.error_feedback:
        if state.shape[-1] % 2:
            raise ValueError(f"state's V must be even for {f.name} (two int4 residuals per byte), got {state.shape[-1]}")
        if previous is not None:
            if previous.format != f.name or previous.residual is None or \
                    tuple(previous.scales.shape) != tuple(state.shape[:-1]):
                raise ValueError(f"previous must be a {f.name} slot of state shape {tuple(state.shape)}, "
                                 f"got format {previous.format!r}")
            x = state + _residual(previous)                           # pay back last store's rounding
    if f.name.startswith("fp8"):
        scale = _row_scale(x, FP8_MAX)                                # [B, H, K]
        y = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)        # [B, H, K, V]
        q = _fp8_stochastic(y, generator) if f.stochastic else y.to(torch.float8_e4m3fn)
        return StoredState(f.name, q.view(torch.uint8), scale)
    scale = _row_scale(x, INT8_MAX, f.head_scaled)                    # [B, H, K] or [B, H]
    q = torch.round(x / _expand(scale)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)  # [B, H, K, V]
    out = StoredState(f.name, q.view(torch.uint8), scale)
    if not f.error_feedback:
        return out
    r = x - q.float() * scale.unsqueeze(-1)                           # this store's rounding error
    rscale = _row_scale(r, INT4_MAX)
    rq = torch.round(r / rscale.unsqueeze(-1)).clamp(-INT4_MAX, INT4_MAX)
    return out._replace(residual=_pack_int4(rq), residual_scales=rscale)


def load(stored: StoredState) -> torch.Tensor:
    """The fp32 state ``[B, H, K, V]`` a :class:`StoredState` holds (the residual of error feedback is not
    part of it). Raises ValueError for an unknown format."""
    f = state_format(stored.format)
    p = stored.payload
    if f.element_bytes in (2, 4):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[f.name]
        return p.view(dtype).float()
    q = p.view(torch.float8_e4m3fn if f.name.startswith("fp8") else torch.int8).float()
    return q * _expand(stored.scales)


def round_trip(state: torch.Tensor, fmt: str, previous: StoredState | None = None,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, StoredState]:
    """``(load(s), s)`` with ``s = store(state, fmt, previous, generator)``: what the next step reads back."""
    s = store(state, fmt, previous, generator)
    return load(s), s
