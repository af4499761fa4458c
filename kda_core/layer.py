"""The two mixer layers of a Kimi hybrid: ``KDALayer`` and ``MLALayer`` (pure torch, fp32).

Two execution modes share every projection (row-invariant ``kda_core.invariant.linear``):
- ``mode="chunk"``: prefill; KDA via :func:`kda_core.chunk.kda_chunk`, MLA as batched causal attention.
- ``mode="recurrent"``: KDA token by token (fp32 without autograd: the fused C form of
  :func:`kda_core.decode.kda_decode`, as the engine's decode and verify rows; else a loop of
  :func:`kda_core.kda.kda_step`), MLA one query row at a time over exactly its causal prefix. Verifying n
  tokens in one call is then *bitwise* equal to decoding them one by one (speculative decoding verify).
  ``decode`` uses this mode.

Caches are immutable values: every call returns a new cache and never mutates its input.
"""
from __future__ import annotations

from numbers import Integral
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kda_core import cpu_mla, decode
from kda_core.chunk import CHUNK_SIZE, kda_chunk
from kda_core.config import ModelConfig
from kda_core.conv import short_conv
from kda_core.invariant import linear, linear_cat, pointwise
from kda_core.invariant import rmsnorm as invariant_rmsnorm
from kda_core.kda import kda_gate, kda_recurrent

MODES = ("chunk", "recurrent")
L2_EPS = 1e-6
RMS_EPS = 1e-6


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _check_x(x: torch.Tensor, d: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != d:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must have shape [B, T, D] with D = {d}, got {got}")
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"x must hold at least one sequence and one token (B, T >= 1), got {tuple(x.shape)}")


def _check_state_at(state_at) -> None:
    """Raise ValueError unless ``state_at`` is a tuple or list of ints (a float offset failed as an
    IndexError deep in the chunk states, a bare int as a TypeError, and True passed as offset 1)."""
    if not isinstance(state_at, (tuple, list)) or any(isinstance(t, bool) or not isinstance(t, Integral)
                                                      for t in state_at):
        raise ValueError(f"state_at must be a tuple of int offsets, got {state_at!r}")


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """Per-head L2 norm over the last dim, eps inside the sqrt: ``x / sqrt(sum x^2 + 1e-6)``."""
    return x * pointwise(torch.rsqrt, (x * x).sum(-1) + L2_EPS).unsqueeze(-1)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = RMS_EPS) -> torch.Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean x^2 + eps) * weight`` (eps: the config's ``rms_norm_eps``), row-invariant
    (:func:`kda_core.invariant.rmsnorm`)."""
    return invariant_rmsnorm(x, weight, eps)


def _init(gen: torch.Generator, out_dim: int, in_dim: int) -> nn.Parameter:
    w = torch.randn(out_dim, in_dim, generator=gen) * in_dim ** -0.5
    return nn.Parameter(w, requires_grad=False)


class KDACache(NamedTuple):
    """Per-sequence KDA cache: recurrent ``[B, H, K, V]`` fp32 and conv ``[B, 2HK + HV, W-1]`` fp32
    (raw pre-conv q, k, v inputs of the last W-1 tokens)."""

    recurrent: torch.Tensor
    conv: torch.Tensor


class KDAOutput(NamedTuple):
    """What :meth:`KDALayer.forward` returns: y ``[B, T, D]``, the new cache, and what the flags asked for:
    ``aux`` (:class:`KDAAux`, with ``output_aux``) and ``states_at`` (``{t: KDACache}``, with ``state_at``);
    None when not asked."""

    y: torch.Tensor
    cache: KDACache
    aux: KDAAux | None = None
    states_at: dict | None = None


class KDAAux(NamedTuple):
    """What a KDA layer consumed, per token (for the speculative-decoding rollback strategies).

    x ``[B, T, D]`` layer input (after the pre-norm); raw_qkv ``[B, T, 2HK + HV]`` pre-conv inputs;
    q, k ``[B, T, H, K]`` and v ``[B, T, H, V]`` after conv/SiLU/L2 norm; g ``[B, T, H, K]`` log decay;
    beta ``[B, T, H]``; states ``[B, T, H, K, V]`` state after each token (recurrent mode only, else None);
    u ``[B, T, H, V]`` the delta correction ``beta (v - S'^T k)`` of each token, where the fused decode ran
    (:mod:`kda_core.decode`; else None: recompute it with :func:`kda_core.kda.kda_step_with_correction`).
    """

    x: torch.Tensor
    raw_qkv: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    states: torch.Tensor | None
    u: torch.Tensor | None = None


class KDALayer(nn.Module):
    """Kimi Delta Attention layer (Kimi Linear, arXiv:2510.26692; fla ``fla/layers/kda.py``).

    q/k/v projections -> short conv (W = 4) + SiLU -> per-head L2 norm of q, k -> low-rank forget
    gate through :func:`kda_gate`, ``beta = sigmoid(W_b x)`` -> KDA -> per-head gated RMSNorm
    (sigmoid output gate, low rank) -> o_proj.
    """

    def __init__(self, cfg: ModelConfig, gen: torch.Generator):
        super().__init__()
        self.cfg = cfg
        d, H, K, V = cfg.hidden_size, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
        r = V  # low-rank width of the gate projections (Kimi Linear uses head_dim)
        self.qkv_proj = _init(gen, H * (2 * K + V), d)      # q | k | v stacked
        self.conv_weight = nn.Parameter(torch.randn(cfg.conv_dim, cfg.conv_kernel, generator=gen)
                                        * cfg.conv_kernel ** -0.5, requires_grad=False)
        self.f_a = _init(gen, r, d)
        self.f_b = _init(gen, H * K, r)
        # fla's init: A in [1, 16) (we use [1, 4)), dt = softplus(dt_bias) in [1e-3, 0.1]
        self.A_log = nn.Parameter(torch.empty(H).uniform_(1.0, 4.0, generator=gen).log(), requires_grad=False)
        dt = torch.empty(H * K).uniform_(-6.9, -2.3, generator=gen).exp()   # log-uniform [1e-3, 0.1]
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)), requires_grad=False)
        self.b_proj = _init(gen, H, d)
        self.g_a = _init(gen, r, d)
        self.g_b = _init(gen, H * V, r)
        self.o_norm = nn.Parameter(torch.ones(V), requires_grad=False)
        self.o_proj = _init(gen, d, H * V)

    def empty_cache(self, batch: int) -> KDACache:
        cfg = self.cfg
        return KDACache(torch.zeros(batch, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim),
                        torch.zeros(batch, cfg.conv_dim, cfg.conv_kernel - 1))

    def project(self, x: torch.Tensor):
        """Per-token projections of ``x [B, T, D]`` that do not depend on the cache (:meth:`project_inputs`, then
        :meth:`gates`).

        Returns (raw_qkv ``[B, T, 2HK + HV]`` (a view with a row stride past its last dim), g ``[B, T, H, K]``,
        beta ``[B, T, H]``, out_gate ``[B, T, H, V]``)."""
        raw, f_low, b, g_low = self.project_inputs(x)
        return (raw, *self.gates(f_low, b, g_low))

    def project_inputs(self, x: torch.Tensor):
        """The layer's input GEMM: the four projections of ``x [B, T, D]`` from one :func:`linear_cat` (views of one
        ``[B, T, H(2K+V) + RF + H + RG]`` tensor). Returns (raw_qkv ``[B, T, 2HK + HV]``, f_low ``[B, T, RF]``,
        b ``[B, T, H]`` (pre-sigmoid), g_low ``[B, T, RG]``); RF, RG the gate ranks."""
        return linear_cat(x, (self.qkv_proj, self.f_a, self.b_proj, self.g_a))

    def gates(self, f_low: torch.Tensor, b: torch.Tensor, g_low: torch.Tensor):
        """The gates from :meth:`project_inputs`' outputs ``[B, T, *]``: (g ``[B, T, H, K]`` = :func:`kda_gate` of
        the f_b GEMM, beta ``[B, T, H]`` = sigmoid(b), out_gate ``[B, T, H, V]`` = the g_b GEMM, pre-sigmoid)."""
        cfg = self.cfg
        B, T, _ = f_low.shape
        H, K, V = cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
        f = linear(f_low, self.f_b).view(B, T, H, K)                     # [B, T, H, K]
        g = kda_gate(f, self.A_log, self.dt_bias, cfg.lower_bound if cfg.gate == "lower_bound" else None)
        beta = pointwise(torch.sigmoid, b)                               # [B, T, H]
        out_gate = linear(g_low, self.g_b).view(B, T, H, V)              # [B, T, H, V]
        return g, beta, out_gate

    def activate(self, raw: torch.Tensor, conv_state: torch.Tensor):
        """Short conv + SiLU on raw q|k|v, then split and L2-normalise q and k.

        Returns (q ``[B, T, H, K]``, k ``[B, T, H, K]``, v ``[B, T, H, V]``, new conv state)."""
        y, conv = short_conv(raw, self.conv_weight, conv_state, apply_silu=False)  # [B, T, H(2K+V)]
        return (*self.split_qkv(y), conv)

    def split_qkv(self, y: torch.Tensor):
        """SiLU on the conv output ``y [B, T, 2HK + HV]``, then split and L2-normalise q and k (the part of
        :meth:`activate` after the conv). Returns (q ``[B, T, H, K]``, k ``[B, T, H, K]``, v ``[B, T, H, V]``)."""
        cfg = self.cfg
        B, T, _ = y.shape
        H, K, V = cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
        y = pointwise(F.silu, y)
        qk = l2norm(y[..., : 2 * H * K].reshape(B, T, 2 * H, K))         # [B, T, 2H, K]: q heads, then k heads
        v = y[..., 2 * H * K:].reshape(B, T, H, V)                       # [B, T, H, V]
        return qk[:, :, :H], qk[:, :, H:], v

    def output(self, o: torch.Tensor, out_gate: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm per head then o_proj: ``o_proj(rmsnorm(o) * sigmoid(gate))``; o ``[B, T, H, V]``."""
        B, T = o.shape[:2]
        return linear(self.gated_norm(o, out_gate).reshape(B, T, -1), self.o_proj)   # [B, T, D]

    def gated_norm(self, o: torch.Tensor, out_gate: torch.Tensor) -> torch.Tensor:
        """``rmsnorm(o) * sigmoid(out_gate)`` per head: o_proj's input ``[B, T, H, V]`` from o, out_gate ``[B, T, H,
        V]``."""
        return rmsnorm(o, self.o_norm, self.cfg.rms_norm_eps) * pointwise(torch.sigmoid, out_gate)

    def forward(self, x: torch.Tensor, cache: KDACache | None = None, mode: str = "chunk",
                output_aux: bool = False, state_at: tuple[int, ...] = ()) -> KDAOutput:
        """Run T tokens from ``cache`` (None = empty). Returns a :class:`KDAOutput` (y ``[B, T, D]``, new cache,
        and ``aux`` / ``states_at`` when asked).

        Chunk mode always runs :func:`kda_chunk` on the grid of ``CHUNK_SIZE`` (C = 64) tokens from
        the first token of the call, whatever ``state_at`` asks, so a prefill split at a multiple of C
        computes every token bitwise as one unsplit prefill does.

        ``state_at`` (chunk mode, not with ``output_aux``): offsets t, 0 < t < T, at which to also
        return the cache after exactly t tokens of this call (``states_at``, ``{t: KDACache}``). A t on the grid (t % C == 0) takes the chunk state
        ``h[:, t // C]`` of :func:`kda_chunk`; any other t runs the t % C tokens after the grid point
        below it as one more short chunk from that state. The conv part is the raw inputs of the W-1
        tokens before t. One forward then yields every prefix-cache checkpoint of a prefill.
        Raises ValueError for x not ``[B, T, D]`` fp32 with B, T >= 1, ``state_at`` not a tuple or list
        of ints, offsets outside (0, T), or ``state_at`` in recurrent mode or with output_aux.
        """
        _check_mode(mode)
        _check_x(x, self.cfg.hidden_size)
        if cache is None:
            cache = self.empty_cache(x.shape[0])
        T = x.shape[1]
        _check_state_at(state_at)
        if state_at and (mode != "chunk" or output_aux or any(not 0 < t < T for t in state_at)):
            raise ValueError(f"state_at must hold offsets in (0, {T}) and needs mode='chunk' without output_aux, "
                             f"got {state_at} (mode={mode!r}, output_aux={output_aux})")
        if mode == "recurrent" and self._fused(x):
            return self._forward_fused(x, cache, output_aux)
        raw, g, beta, out_gate = self.project(x)
        q, k, v, conv = self.activate(raw, cache.conv)
        states = None
        if mode == "chunk":
            C = CHUNK_SIZE
            o, state, h = kda_chunk(q, k, v, g, beta, cache.recurrent, chunk_size=C)
            if state_at:
                W1 = self.cfg.conv_kernel - 1
                full = torch.cat([cache.conv, raw.transpose(1, 2)], dim=-1)   # [B, D, W-1+T]
                states_at = {}
                for t in state_at:
                    s0 = t // C * C                                          # grid point at or below t
                    rec = h[:, t // C].clone()                               # [B, H, K, V]
                    if t > s0:                                               # tokens [s0, t): one short chunk
                        part = slice(s0, t)
                        rec = kda_chunk(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], rec,
                                        chunk_size=C).final_state
                    states_at[t] = KDACache(rec, full[..., t: t + W1].clone())
        elif output_aux:
            o, state, states = kda_recurrent(q, k, v, g, beta, cache.recurrent, output_states=True)
        else:
            o, state = kda_recurrent(q, k, v, g, beta, cache.recurrent)
        aux = KDAAux(x, raw, q, k, v, g, beta, states) if output_aux else None
        return KDAOutput(self.output(o, out_gate), KDACache(state, conv), aux, states_at if state_at else None)

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether recurrent mode runs :func:`kda_core.decode.kda_decode`'s C form here, as the engine's decode and
        verify rows do (fp32 CPU, no autograd, the C form built and self-checked for this shape)."""
        return decode.why_not(self, x) is None

    def _forward_fused(self, x: torch.Tensor, cache: KDACache, output_aux: bool) -> KDAOutput:
        """Recurrent mode through the fused decode (:func:`kda_core.decode.kda_decode`): the B sequences as rows of
        a dense pool (the cache, only read), slots ``arange(B)``, T tokens token by token in one call."""
        B = x.shape[0]
        raw, f_low, b, g_low = self.project_inputs(x)                    # [B, T, *]
        rec, conv = (t.to(torch.float32).contiguous() for t in cache)  # [B, H, K, V], [B, C, W-1]
        state, conv_new = torch.empty_like(rec), torch.empty_like(conv)
        res = decode.kda_decode(self, raw, f_low, b, g_low, rec, conv, torch.arange(B), backend="fused",
                                out=(state, conv_new), aux=output_aux)
        aux = KDAAux(x, raw, res.q, res.k, res.v, res.g, res.beta, res.states, res.u) if output_aux else None
        return KDAOutput(linear(res.y, self.o_proj), KDACache(state, conv_new), aux)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding on the last dim (even width), positions ``[T]``; x ``[B, T, ..., R]``."""
    R = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, R, 2, dtype=torch.float32) / R)  # [R/2]
    ang = positions.to(torch.float32)[:, None] * inv_freq[None, :]     # [T, R/2]
    shape = (1, ang.shape[0]) + (1,) * (x.dim() - 3) + (R // 2,)
    cos, sin = pointwise(torch.cos, ang).view(shape), pointwise(torch.sin, ang).view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


def _block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                            scale: float) -> torch.Tensor:
    """Causal attention of T query rows (positions ``start..start+T-1``) over keys ``[0, start + T)``,
    in blocks of ``CHUNK_SIZE`` query rows from the first row of the call.

    The rows of block ``[s, e)`` (absolute positions) attend over exactly the keys ``[0, e)``, so every
    score, softmax and ``P @ V`` reduction of a row depends only on s and e, not on how many rows the
    call holds nor on the keys after the block: a prefill split at a multiple of ``CHUNK_SIZE`` gives
    bitwise the rows of the unsplit one (a row of the full ``[T, L+T]`` masked product would sum over
    ``L+T`` columns, masked zeros included, and BLAS splits that reduction by its width). It also
    skips the masked upper blocks (about half the score work of the full product at large T).
    q ``[B, Hm, T, dq]``; k ``[B, Hm, start+T, dq]``; v ``[B, Hm, start+T, vd]``. Returns ``[B, Hm, T, vd]``.
    """
    T = q.shape[2]
    rows = []
    for s in range(start, start + T, CHUNK_SIZE):
        e = min(s + CHUNK_SIZE, start + T)
        sc = (q[:, :, s - start: e - start] @ k[:, :, :e].transpose(-1, -2)) * scale  # [B, Hm, e-s, e]
        mask = torch.ones(e - s, e, dtype=torch.bool).tril(diagonal=s)     # row i sees keys <= s + i
        rows.append(torch.softmax(sc.masked_fill(~mask, float("-inf")), dim=-1) @ v[:, :, :e])  # [B, Hm, e-s, vd]
    return torch.cat(rows, dim=2)


def latent_attention(q_cat: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int, scale: float) -> torch.Tensor:
    """Absorbed MLA decode core: one query per head over L cached latents.

    q_cat ``[B, Hm, r + rope]`` (q_nope absorbed into the latent space, then q_rope); cache
    ``[B, L, r + rope]``. Returns the latent output ``[B, Hm, r]`` = softmax(q . c_j * scale) @ c[:, :r].
    Reads every cached latent once: cost linear in L.
    """
    s = (q_cat @ cache.transpose(1, 2)) * scale                         # [B, Hm, L]
    return torch.softmax(s, dim=-1) @ cache[..., :kv_lora_rank]         # [B, Hm, r]


class MLALayer(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 MLA, as used by Kimi Linear / K3; with ``mla_use_nope`` no
    rotary embedding, as Kimi-Linear: Moonshot's ``modeling_kimi.py``, transformers' ``KimiLinearAttention``).

    Weights (Moonshot's names): ``q_proj`` (``q_lora_rank`` null), ``kv_a`` = ``kv_a_proj_with_mqa``,
    ``kv_norm`` = ``kv_a_layernorm``, ``kv_b`` = ``kv_b_proj``, ``o_proj``. The cache keeps per token ``kv_lora_rank + qk_rope_head_dim`` values: the normalised compressed
    ``c_kv`` and the shared roped key. Keys/values are expanded from ``c_kv`` by ``kv_b``;
    :meth:`decode_absorbed` is the weight-absorbed decode that reads only the latents.
    """

    def __init__(self, cfg: ModelConfig, gen: torch.Generator):
        super().__init__()
        self.cfg = cfg
        d, Hm = cfg.hidden_size, cfg.num_mla_heads
        nope, rp, vd, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.q_proj = _init(gen, Hm * (nope + rp), d)
        self.kv_a = _init(gen, r + rp, d)
        self.kv_norm = nn.Parameter(torch.ones(r), requires_grad=False)
        self.kv_b = _init(gen, Hm * (nope + vd), r)
        self.o_proj = _init(gen, d, Hm * vd)
        self.scale = (nope + rp) ** -0.5

    def empty_cache(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, 0, self.cfg.latent_dim)

    def position(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The positional part of a key or query ``[B, T, ..., rope]`` at ``positions [T]``: unchanged with
        ``mla_use_nope`` (Kimi-Linear's MLA has no positional encoding), else rotary embedding."""
        return x if self.cfg.mla_use_nope else rope(x, positions)

    def latents_at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Per-token latent cache entries ``[B, T, r + rope]`` of x ``[B, T, D]`` at ``positions [T]``:
        ``kv_a_layernorm(c_kv)`` and the shared key part."""
        r = self.cfg.kv_lora_rank
        ckv = linear(x, self.kv_a)                                          # [B, T, r + rope]
        return torch.cat([rmsnorm(ckv[..., :r], self.kv_norm, self.cfg.rms_norm_eps),
                          self.position(ckv[..., r:], positions)], dim=-1)

    def latents(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Per-token latent cache entries ``[B, T, r + rope]`` for tokens at positions start.."""
        return self.latents_at(x, torch.arange(start, start + x.shape[1]))

    def latents_and_queries_at(self, x: torch.Tensor, positions: torch.Tensor) -> tuple:
        """(:meth:`latents_at`, :meth:`queries_at`) of x ``[B, T, D]`` from one GEMM (bitwise the two calls)."""
        cfg = self.cfg
        B, T, _ = x.shape
        r, nope = cfg.kv_lora_rank, cfg.qk_nope_head_dim
        ckv, q = linear_cat(x, (self.kv_a, self.q_proj))                    # [B, T, r + rope], [B, T, Hm dq]
        q = q.view(B, T, cfg.num_mla_heads, -1)                             # [B, T, Hm, nope+rope]
        lat = torch.cat([rmsnorm(ckv[..., :r], self.kv_norm, cfg.rms_norm_eps), self.position(ckv[..., r:], positions)],
                        dim=-1)                                             # [B, T, r + rope]
        if cfg.mla_use_nope:                                                # no positional part: q as projected
            return lat, q
        return lat, torch.cat([q[..., :nope], self.position(q[..., nope:], positions)], dim=-1)

    def queries_at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Queries ``[B, T, Hm, nope + rope]`` of x ``[B, T, D]`` at ``positions [T]``."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = linear(x, self.q_proj).view(B, T, cfg.num_mla_heads, -1)       # [B, T, Hm, nope+rope]
        return torch.cat([q[..., : cfg.qk_nope_head_dim], self.position(q[..., cfg.qk_nope_head_dim:], positions)],
                         dim=-1)

    def _queries(self, x: torch.Tensor, start: int):
        return self.queries_at(x, torch.arange(start, start + x.shape[1]))

    def _keys_values(self, lat: torch.Tensor):
        cfg = self.cfg
        B, L, _ = lat.shape
        r, nope = cfg.kv_lora_rank, cfg.qk_nope_head_dim
        kv = linear(lat[..., :r], self.kv_b).view(B, L, cfg.num_mla_heads, -1)  # [B, L, Hm, nope+vd]
        k_rope = lat[..., r:].unsqueeze(2).expand(B, L, cfg.num_mla_heads, -1)  # [B, L, Hm, rope]
        k = torch.cat([kv[..., :nope], k_rope], dim=-1).transpose(1, 2).contiguous()  # [B, Hm, L, dq]
        v = kv[..., nope:].transpose(1, 2).contiguous()                     # [B, Hm, L, vd]
        return k, v

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None, mode: str = "chunk"):
        """Attend T new tokens over ``cache [B, L, r + rope]`` + themselves (causal).

        Returns (y ``[B, T, D]``, new cache ``[B, L + T, r + rope]``)."""
        _check_mode(mode)
        _check_x(x, self.cfg.hidden_size)
        B, T, _ = x.shape
        if cache is None:
            cache = self.empty_cache(B)
        if cache.dim() != 3 or cache.shape[0] != B or cache.shape[2] != self.cfg.latent_dim:
            raise ValueError(f"cache must have shape [B, L, {self.cfg.latent_dim}], got {tuple(cache.shape)}")
        L = cache.shape[1]
        lat = torch.cat([cache, self.latents(x, L)], dim=1)                 # [B, L+T, r+rope]
        if mode == "chunk":
            q = self._queries(x, L).transpose(1, 2)                         # [B, Hm, T, dq]
            k, v = self._keys_values(lat)                                   # [B, Hm, L+T, *]
            o = _block_causal_attention(q, k, v, L, self.scale)            # [B, Hm, T, vd]
            o = o.transpose(1, 2).reshape(B, T, -1)                         # [B, T, Hm vd]
        else:
            o = self.attend_absorbed(self._queries(x, L), lat, L)           # [B, T, Hm vd]
        return linear(o, self.o_proj), lat                                  # [B, T, D]

    def absorb_queries(self, q: torch.Tensor) -> torch.Tensor:
        """Queries ``[..., Hm, nope + rope]`` -> ``[..., Hm, r + rope]``: each head's ``q_nope`` taken into the
        latent space (``q_nope W_uk[h]``, W_uk the key half of ``kv_b``), then its rope part. Row-invariant (one
        :func:`linear` per head)."""
        cfg = self.cfg
        r, nope, Hm = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.num_mla_heads
        w_uk = self.kv_b.view(Hm, nope + cfg.v_head_dim, r)[:, :nope]      # [Hm, nope, r]
        q_lat = torch.stack([linear(q[..., h, :nope], w_uk[h].T) for h in range(Hm)], dim=-2)   # [..., Hm, r]
        return torch.cat([q_lat, q[..., nope:]], dim=-1)                    # [..., Hm, r + rope]

    def absorbed_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Latent outputs ``[..., Hm, r]`` -> ``[..., Hm vd]``: each head's ``o_lat W_uv[h]^T`` (W_uv the value half
        of ``kv_b``), heads side by side. Row-invariant (one :func:`linear` per head)."""
        cfg = self.cfg
        r, nope, Hm = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.num_mla_heads
        w_uv = self.kv_b.view(Hm, nope + cfg.v_head_dim, r)[:, nope:]      # [Hm, vd, r]
        return torch.cat([linear(o_lat[..., h, :], w_uv[h]) for h in range(Hm)], dim=-1)   # [..., Hm vd]

    def attend_absorbed(self, q: torch.Tensor, lat: torch.Tensor, L: int) -> torch.Tensor:
        """Token-by-token attention in the absorbed form (DeepSeek-V2's MLA with ``W_uk`` / ``W_uv`` folded into
        the query and the output, as vLLM's MLA decode backends do: ``vllm/v1/attention/backends/mla/common.py``):
        query t of q ``[B, T, Hm, nope + rope]`` over exactly the latents ``lat[:, :L + t + 1]`` (``lat`` ``[B,
        L + T, r + rope]``), never expanding a latent through ``kv_b``. Returns ``[B, T, Hm vd]``.

        Two forms: fp32 CPU tensors without autograd run the C form (:mod:`kda_core.cpu_mla`: every query in one
        call) where the process runs it, the rest the torch form below (:func:`latent_attention` per query,
        :meth:`absorb_queries` / :meth:`absorbed_output`); they agree within ``cpu_mla.RTOL`` / ``ATOL``. Every
        decode and verify query of the engine runs the same form with the same per-query operands, so they are
        bitwise this; against the expanded form of prefill (chunk mode) they agree to fp32 rounding (``(q W_uk) .
        c`` vs ``q . (W_uk c)``: reassociated sums, ~1e-6 relative)."""
        B, T = q.shape[:2]
        c = cpu_mla.runs(q, lat, self.kv_b)
        if c is not None:                                                   # one call: query (b, t) over its latents
            n = lat.shape[1]
            off = (torch.arange(B) * n).repeat_interleave(T)                # [B T] its first latent
            lens = torch.arange(L + 1, L + T + 1).repeat(B)                 # [B T] how many it reads
            o = c.attend(self, q.reshape(B * T, *q.shape[2:]), lat.reshape(B * n, -1), off, lens)   # [B T, Hm vd]
            return o.view(B, T, -1)                                         # [B, T, Hm vd]
        q_cat = self.absorb_queries(q)                                      # [B, T, Hm, r + rope]
        r = self.cfg.kv_lora_rank
        o_lat = torch.stack([latent_attention(q_cat[:, t], lat[:, : L + t + 1].contiguous(), r, self.scale)
                             for t in range(T)], dim=1)                     # [B, T, Hm, r]
        return self.absorbed_output(o_lat)                                  # [B, T, Hm vd]

    def decode_absorbed(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """One-token decode reading only the latent cache (weights absorbed, as FlashMLA does).

        x ``[B, 1, D]``; cache ``[B, L, r + rope]`` already holding this token's latent at L-1.
        Per head: ``score_j = (q_nope W_uk) . c_j + q_rope . k_rope_j``, ``o = (sum_j p_j c_j) W_uv``.
        Returns y ``[B, 1, D]``. Cost is linear in L: the KV read that page 03 measures.
        """
        cfg = self.cfg
        B, L, _ = cache.shape
        r, nope, Hm = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.num_mla_heads
        q = self._queries(x, L - 1)[:, 0]                                  # [B, Hm, dq]
        wkv = self.kv_b.view(Hm, nope + cfg.v_head_dim, r)
        w_uk, w_uv = wkv[:, :nope], wkv[:, nope:]                          # [Hm, nope, r], [Hm, vd, r]
        q_lat = torch.einsum("bhn,hnr->bhr", q[..., :nope], w_uk)          # [B, Hm, r]
        q_cat = torch.cat([q_lat, q[..., nope:]], dim=-1)                  # [B, Hm, r + rope]
        o_lat = latent_attention(q_cat, cache, r, self.scale)              # [B, Hm, r]
        o = torch.einsum("bhr,hvr->bhv", o_lat, w_uv)                      # [B, Hm, vd]
        return linear(o.reshape(B, 1, -1), self.o_proj)                    # [B, 1, D]
