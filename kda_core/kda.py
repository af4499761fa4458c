"""Kimi Delta Attention (KDA) kernels in pure torch: gate, one step, the recurrent loop (the reference).

Layout follows fla (fla-org/flash-linear-attention, ``fla/ops/kda``):
q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H, K]`` (log-space decay, already activated,
``g <= 0``); beta ``[B, T, H]`` (already through sigmoid); state key-first ``[B, H, K, V]``.
All maths runs in fp32 (fp64 inputs stay fp64 for oracle runs); outputs keep v's dtype.

Per token and head (Kimi Linear paper, arXiv:2510.26692, eq. for KDA):
``S' = diag(exp(g)) S``; ``u = beta (v - S'^T k)``; ``S = S' + k u^T``; ``o = S^T (scale q)``.

The reference ladder: :func:`kda_step` -> :func:`kda_recurrent` -> :func:`kda_core.chunk.kda_chunk`
(the chunked form, checked against this loop and against fla's naive forms).

Inputs: ``g = -inf`` is full forgetting (``exp(-inf) = 0`` zeroes that state row) and every form
handles it. Every form checks the gates' domain (:func:`check_gates`): ``g`` in ``[-inf, 0]`` (a decay
``exp(g)`` in [0, 1]) and ``beta`` in [0, 1] (a sigmoid's range), NaN rejected; outside it the
recurrence is not a decay and grows the state until it overflows (``g = +10`` or ``beta = 1e6`` gave
silent NaN, and a different NaN count in the chunk form than in the loop). fla's layers can double
beta into [0, 2] (``allow_neg_eigval``, negative eigenvalues); this project's layers do not, so
[0, 1] it is. Keys are expected L2-normalised (the layers do it); that is not checked.
``kda_step`` / ``kda_recurrent`` (the per-token decode path) do not check q, k, v or the state for
NaN, and a NaN there reaches only the tokens after it (the engine aborts a request whose logits are
not finite); the chunk form rejects non-finite inputs.
"""
from __future__ import annotations

import math
from numbers import Real

import torch
import torch.nn.functional as F

from kda_core.invariant import pointwise


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_inputs(q, k, v, g, beta, state, *, has_time: bool, state_name: str):
    """Validate shapes/dtypes; raise ValueError naming the argument and the expected shape."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    lead = "[B, T, H, K]" if has_time else "[B, H, K]"
    nd = 4 if has_time else 3
    if q.dim() != nd:
        raise ValueError(f"q must have shape {lead}, got {tuple(q.shape)}")
    for name, t in (("k", k), ("g", g)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have shape {lead} = {tuple(q.shape)} (same as q), got {tuple(t.shape)}")
    if v.dim() != nd or v.shape[:-1] != q.shape[:-1]:
        exp = tuple(q.shape[:-1]) + ("V",)
        raise ValueError(f"v must have shape {lead[:-2]}V] = {exp}, got {tuple(v.shape)}")
    if beta.shape != q.shape[:-1]:
        raise ValueError(f"beta must have shape {tuple(q.shape[:-1])} (q without K), got {tuple(beta.shape)}")
    B, H, K, V = q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1]
    if 0 in (B, H, K, V):
        raise ValueError(f"B, H, K and V must be >= 1, got B={B}, H={H}, K={K}, V={V} "
                         f"(q {tuple(q.shape)}, v {tuple(v.shape)})")
    if state is not None:
        if not isinstance(state, torch.Tensor) or state.shape != (B, H, K, V):
            got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(f"{state_name} must have shape [B, H, K, V] = {(B, H, K, V)}, got {got}")


class NonFiniteError(ValueError):
    """An input holds NaN (or inf where the maths needs finite values): a ValueError a caller can tell
    from a wrong shape, e.g. the engine aborts the one request whose state or cache went non-finite."""


def check_scale(scale) -> None:
    """Raise ValueError unless ``scale`` is None (``K ** -0.5``) or a finite real number > 0 (not a bool)."""
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, Real)
                              or not 0 < scale < math.inf):
        raise ValueError(f"scale must be None (K ** -0.5) or a finite number > 0, got {scale!r}")


def check_gates(g: torch.Tensor, beta: torch.Tensor) -> bool:
    """Raise ValueError unless ``g`` lies in ``[-inf, 0]`` and ``beta`` in [0, 1]; where the cause is NaN (or
    +inf in g, +-inf in beta) it is a :class:`NonFiniteError`.

    One ``aminmax`` pass per tensor (a min/max reduction reads each element once; NaN propagates
    into it), the element counts only on the error path. Returns True if ``g`` holds ``-inf`` (full
    forgetting, which the chunk form handles apart).
    """
    may_forget = False
    if g.numel():
        g_min, g_max = (m.item() for m in torch.aminmax(g))     # Python floats: no more tensor ops
        if not g_max <= 0:
            pos = int((g > 0).sum())
            raise (ValueError if math.isfinite(g_max) else NonFiniteError)(   # NaN or +inf: non-finite
                f"g must be a log decay in [-inf, 0] (-inf = full forgetting), got {pos} element(s) > 0 "
                f"(max {float(g.nan_to_num(-math.inf, math.inf, -math.inf).max()):g}) and {int(g.isnan().sum())} NaN"
                + (": a g > 0 grows the state by exp(g) per token until it overflows" if pos else ""))
        may_forget = g_min == -math.inf
    if beta.numel():
        b_min, b_max = (m.item() for m in torch.aminmax(beta))
        if not 0 <= b_min <= b_max <= 1:
            bad = (beta < 0) | (beta > 1)
            out = int(bad.sum())
            raise (ValueError if math.isfinite(b_min) and math.isfinite(b_max) else NonFiniteError)(
                f"beta must be in [0, 1] (a sigmoid's output), got {out} element(s) outside it and "
                f"{int(beta.isnan().sum())} NaN (range {float(beta.nan_to_num(0.0, math.inf, -math.inf).min()):g} .. "
                f"{float(beta.nan_to_num(0.0, math.inf, -math.inf).max()):g})"
                + (": outside [0, 1] the delta rule overshoots and the state diverges" if out else ""))
    return may_forget


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """Activate the raw forget-gate projection into log-space decay ``g``.

    Args:
        f: raw gate ``[..., H, K]`` (output of the low-rank forget-gate projection).
        A_log: per-head log rate ``[H]``.
        dt_bias: optional bias ``[H * K]`` or ``[H, K]`` added to f first.
        lower_bound: None -> softplus form (Kimi-Linear, fla ``naive_kda_gate``):
            ``g = -exp(A_log[h]) * softplus(f + dt_bias)``;
            a negative float -> lower-bound form (Kimi K3, fla ``naive_kda_lowerbound_gate``):
            ``g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))``, so ``g`` lies in
            ``(lower_bound, 0)``.

    Returns:
        g ``[..., H, K]`` fp32 (fp64 for fp64 input), log-space, ``g <= 0``.

    Raises:
        ValueError: bad shapes, or a non-negative lower_bound.
    """
    if f.dim() < 2:
        raise ValueError(f"f must have shape [..., H, K], got {tuple(f.shape)}")
    H, K = f.shape[-2:]
    if A_log.numel() != H:
        raise ValueError(f"A_log must have H = {H} elements, got shape {tuple(A_log.shape)}")
    dt = _compute_dtype(f)
    x = f.to(dt)
    if dt_bias is not None:
        if dt_bias.numel() != H * K:
            raise ValueError(f"dt_bias must have H * K = {H * K} elements, got shape {tuple(dt_bias.shape)}")
        x = x + dt_bias.to(dt).view(H, K)
    a = A_log.to(dt).view(H, 1).exp()  # [H, 1]
    flat = f.shape[:-2] + (H * K,)     # transcendentals run row-invariantly (kda_core.invariant)
    if lower_bound is None:
        return -a * pointwise(F.softplus, x.reshape(flat)).view(x.shape)
    if not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative (e.g. -5.0 for Kimi K3), got {lower_bound}")
    return lower_bound * pointwise(torch.sigmoid, (a * x).reshape(flat)).view(x.shape)


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One KDA token (no T dim). Pure: ``state`` is not modified.

    Args:
        q, k: ``[B, H, K]``; v: ``[B, H, V]``; g: ``[B, H, K]`` log decay; beta: ``[B, H]``;
        state: ``[B, H, K, V]`` state before the token; scale: defaults to ``K ** -0.5``.

    Returns:
        (o ``[B, H, V]`` in v's dtype, new_state ``[B, H, K, V]`` fp32/fp64).

    Raises:
        ValueError: on shape mismatch (names the argument and the expected shape), a zero B, H, K or V,
        a g or beta outside its domain (:func:`check_gates`) or a bad scale (:func:`check_scale`).
    """
    o, s, _ = kda_step_with_correction(q, k, v, g, beta, state, scale)
    return o, s


def _step(q, k, v, g, beta, S, scale):
    """Unchecked step on compute-dtype tensors; fixed op order so every caller is bitwise equal.
    Returns (o, new state, u = the delta correction)."""
    S = S * g.exp().unsqueeze(-1)                          # decay        [B, H, K, V]
    kv = (S * k.unsqueeze(-1)).sum(-2)                     # S'^T k       [B, H, V]
    u = beta.unsqueeze(-1) * (v - kv)                      # correction   [B, H, V]
    S = S + k.unsqueeze(-1) * u.unsqueeze(-2)              # rank-1 write [B, H, K, V]
    o = (S * (q * scale).unsqueeze(-1)).sum(-2)            # read         [B, H, V]
    return o, S, u


def kda_step_with_correction(q, k, v, g, beta, state, scale=None):
    """Like :func:`kda_step` but also returns ``u`` ``[B, H, V]``, the per-token delta correction
    ``beta (v - S'^T k)`` (used by the closed-form check of the speculative-decoding rollback strategies)."""
    _check_inputs(q, k, v, g, beta, state, has_time=False, state_name="state")
    check_scale(scale)
    check_gates(g, beta)
    dt = _compute_dtype(v)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, S, u = _step(q.to(dt), k.to(dt), v.to(dt), g.to(dt), beta.to(dt), state.to(dt), scale)
    return o.to(v.dtype), S, u


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    output_states: bool = False,
):
    """Token-by-token KDA: the reference form (a loop of :func:`kda_step`).

    Args:
        q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H, K]``; beta ``[B, T, H]``;
        initial_state ``[B, H, K, V]`` or None (zeros); scale defaults to ``K ** -0.5``.
        output_states: also return every intermediate state.

    Returns:
        (o ``[B, T, H, V]``, final_state ``[B, H, K, V]``) and, with ``output_states``,
        states ``[B, T, H, K, V]`` where ``states[:, t]`` is the state after token t.

    Raises:
        ValueError: on shape mismatch, a zero B, H, K or V (T = 0 returns no outputs and the initial
        state), a g or beta outside its domain (:func:`check_gates`) or a bad scale (:func:`check_scale`).
    """
    _check_inputs(q, k, v, g, beta, initial_state, has_time=True, state_name="initial_state")
    check_scale(scale)
    check_gates(g, beta)
    dt, out_dtype = _compute_dtype(v), v.dtype
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    o = q.new_empty(B, T, H, V)
    states = q.new_empty(B, T, H, K, V) if output_states else None
    for t in range(T):  # contiguous per-token slices: same memory layout as a one-token call
        o[:, t], S, _ = _step(*(x[:, t].contiguous() for x in (q, k, v, g, beta)), S, scale)
        if states is not None:
            states[:, t] = S
    o = o.to(out_dtype)
    if output_states:
        return o, S, states
    return o, S
