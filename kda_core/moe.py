"""The feed-forward blocks of Kimi-Linear: a dense SwiGLU MLP in the first ``first_k_dense_replace`` layers,
a sparse mixture of experts (MoE) with shared experts in the others (fp32, row-invariant; a C form and a torch form).

Router (DeepSeek-V3's, which Kimi-Linear keeps: Moonshot's ``modeling_kimi.py`` ``KimiMoEGate``, transformers'
``KimiLinearTopkRouter``; arXiv:2412.19437 section 2.1.2):

- ``s = sigmoid(x W_r^T)`` ``[N, E]`` in fp32 (``moe_router_activation_func`` "sigmoid");
- the choice adds the load-balancing bias: ``c = s + e_score_correction_bias``; with ``num_expert_group`` G > 1
  each group is scored by the sum of its top-2 ``c`` and only the best ``topk_group`` groups stay;
- the top-k experts of ``c``; their weights are the *unbiased* ``s``, divided by their sum when
  ``moe_renormalize`` (+ 1e-20), times ``routed_scaling_factor``;
- ``y = sum_k w_k expert_k(x) + shared(x)``, each expert a SwiGLU ``w2(silu(w1 x) * w3 x)``.

Two forms, one chosen per process: the C form (:mod:`kda_core.cpu_moe`: router, top-k, routed and shared experts and
their combine in one call) runs every fp32 CPU forward without autograd where the C GEMM runs; the torch form
(:meth:`MoE.forward_torch`) runs the rest and is the C form's reference (within ``cpu_moe.RTOL`` / ``ATOL``: their
sigmoid and SiLU differ in the last bits). In both, every row's result depends on that row alone
(``kda_core.invariant``'s GEMM, per-element activations, the top-k sum in a fixed order), so a batched forward equals
each row's forward alone, bitwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kda_core import cpu_moe
from kda_core.config import ModelConfig
from kda_core.invariant import linear, linear_cat, pointwise, rmsnorm

_FUSED: list = []     # [cpu_moe.backend()], read on every call once it is chosen


def _choose():
    _FUSED.append(cpu_moe.backend())
    return _FUSED[0]


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is torch.float32 else t.float()


def _init(gen: torch.Generator, *shape: int) -> nn.Parameter:
    w = torch.randn(*shape, generator=gen) * shape[-1] ** -0.5
    return nn.Parameter(w, requires_grad=False)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate x) * up x)``; x ``[..., D]``, gate_up ``[2F, D]`` (gate rows then up rows), down ``[D, F]``."""
    return swiglu_down(linear(x, gate_up), down)


def swiglu_down(gu: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The part of :func:`swiglu` after the gate_up projection: ``gu [..., 2F]`` (gate then up) -> ``[..., D]``."""
    a, b = gu.chunk(2, dim=-1)                                              # [..., F] each
    return linear(pointwise(F.silu, a) * b, down)                           # [..., D]


class DenseMLP(nn.Module):
    """SwiGLU MLP: ``gate_up`` ``[2F, D]`` (Moonshot's ``gate_proj`` then ``up_proj``), ``down`` ``[D, F]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, gen: torch.Generator):
        super().__init__()
        self.gate_up = _init(gen, 2 * intermediate_size, hidden_size)
        self.down = _init(gen, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., D]`` -> ``[..., D]``: the C form (:meth:`kda_core.cpu_moe.CMoE.dense`, one call) for fp32 CPU
        tensors without autograd where the process runs it, else :meth:`forward_torch` (within ``cpu_moe.RTOL`` /
        ``ATOL`` of each other; each row on its own in both)."""
        fused = _FUSED[0] if _FUSED else _choose()
        if fused is not None and x.dtype is torch.float32 and x.is_cpu and self.gate_up.dtype is torch.float32 \
                and not (torch.is_grad_enabled() and (x.requires_grad or self.gate_up.requires_grad)):
            return fused.dense(self, x)
        return self.forward_torch(x)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The torch form: :func:`swiglu`; x ``[..., D]`` -> ``[..., D]``."""
        return swiglu(x, self.gate_up, self.down)


class MoE(nn.Module):
    """Routed experts + shared experts (see the module docstring for the router).

    Parameters: ``router`` ``[E, D]`` (``gate.weight``), buffer ``router_bias`` ``[E]``
    (``gate.e_score_correction_bias``: not trained by gradient; :meth:`update_bias` moves it),
    ``experts_gate_up`` ``[E, 2F, D]`` (w1 then w3 of each expert), ``experts_down`` ``[E, D, F]`` (w2),
    ``shared`` a :class:`DenseMLP` of width ``F * num_shared_experts`` (or None without shared experts).
    In training mode the last forward's expert loads are kept in ``last_load`` ``[E]`` (tokens routed to each).
    """

    def __init__(self, cfg: ModelConfig, gen: torch.Generator):
        super().__init__()
        if cfg.num_experts < 1:
            raise ValueError(f"cfg.num_experts must be >= 1 for an MoE layer, got {cfg.num_experts}")
        self.cfg = cfg
        E, D, F_ = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.router = _init(gen, E, D)
        self.register_buffer("router_bias", torch.zeros(E))
        self.experts_gate_up = _init(gen, E, 2 * F_, D)
        self.experts_down = _init(gen, E, D, F_)
        self.shared = DenseMLP(D, F_ * cfg.num_shared_experts, gen) if cfg.num_shared_experts else None
        self.last_load: torch.Tensor | None = None

    def route(self, rows: torch.Tensor, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing of rows ``[N, D]`` (or of their router ``logits [N, E]`` fp32 when given): (weights
        ``[N, k]`` fp32, expert ids ``[N, k]`` int64, best first)."""
        cfg = self.cfg
        N, E, G = rows.shape[0], cfg.num_experts, cfg.num_expert_group
        if logits is None:
            logits = linear(_fp32(rows), _fp32(self.router))                               # [N, E]
        scores = pointwise(torch.sigmoid, logits)                                        # [N, E]
        choice = scores + self.router_bias
        if G > 1:
            group = choice.view(N, G, E // G).topk(2, dim=-1).values.sum(-1)            # [N, G]
            keep = torch.zeros_like(group, dtype=torch.bool).scatter_(
                1, group.topk(cfg.topk_group, dim=-1).indices, True)                    # [N, G]
            choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
        idx = choice.topk(cfg.num_experts_per_token, dim=-1, sorted=True).indices      # [N, k]
        w = scores.gather(1, idx)                                                        # [N, k]
        if cfg.moe_renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * cfg.routed_scaling_factor, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., D]`` -> ``[..., D]``: the routed experts' weighted sum plus the shared experts.

        fp32 CPU tensors without autograd run the C form (:mod:`kda_core.cpu_moe`: the whole block in one call)
        where the process runs it, any other input :meth:`forward_torch`; the two agree within
        ``cpu_moe.RTOL`` / ``cpu_moe.ATOL``. Either way a row's result does not depend on the other rows."""
        fused = _FUSED[0] if _FUSED else _choose()
        if fused is not None and x.dtype is torch.float32 and x.is_cpu and self.router.dtype is torch.float32 \
                and not (torch.is_grad_enabled() and (x.requires_grad or self.router.requires_grad)):
            if not self.training:
                return fused.forward(self, x)                               # [..., D]
            idx = torch.empty(x.numel() // x.shape[-1], self.cfg.num_experts_per_token, dtype=torch.long)  # [N, k]
            y = fused.forward(self, x, idx)                                 # [..., D]
            self.last_load = torch.bincount(idx.flatten(), minlength=self.cfg.num_experts)
            return y
        return self.forward_torch(x)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The torch form of :meth:`forward` (the reference of the C form; what runs in training, on other dtypes
        and devices, and without the C library): x ``[..., D]`` -> ``[..., D]``."""
        rows = x.reshape(-1, x.shape[-1])                                   # [N, D]
        shared_gu = None
        if self.shared is not None and rows.dtype is torch.float32 and self.router.dtype is torch.float32:
            # the router and the shared experts' gate_up read the same rows: one GEMM (bitwise the two calls)
            logits, shared_gu = linear_cat(rows, (self.router, self.shared.gate_up))   # [N, E], [N, 2 F_s]
            w, idx = self.route(rows, logits)
        else:
            w, idx = self.route(rows)
        N, k = idx.shape
        if N == 1:                                                          # one row (batch-1 decode): no dispatch
            e = idx[0].tolist()
            y = swiglu(rows, self.experts_gate_up[e[0]], self.experts_down[e[0]]) * w[:, :1]
            for j in range(1, k):                                           # the same order as below
                y = y + swiglu(rows, self.experts_gate_up[e[j]], self.experts_down[e[j]]) * w[:, j: j + 1]
            return self._finish(x, y, idx, shared_gu)
        flat = idx.flatten()                                                # [N k] (row, top-k position) pairs
        order = flat.argsort(stable=True)                                   # the pairs grouped by expert
        sorted_rows = rows.index_select(0, order // k)                      # [N k, D]
        outs, start = [], 0
        for e, count in enumerate(torch.bincount(flat, minlength=self.cfg.num_experts).tolist()):
            if count:                                                       # expert e's rows: one contiguous run
                part = sorted_rows[start: start + count]
                outs.append(swiglu(part, self.experts_gate_up[e], self.experts_down[e]))
                start += count
        per_k = rows.new_empty(N * k, rows.shape[1]).index_copy_(0, order, torch.cat(outs))  # [N k, D]
        per_k = per_k.view(N, k, -1)                                        # [N, k, D]
        y = per_k[:, 0] * w[:, :1]
        for j in range(1, idx.shape[1]):                                    # fixed order: row-invariant
            y = y + per_k[:, j] * w[:, j: j + 1]
        return self._finish(x, y, idx, shared_gu)

    def _finish(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, shared_gu: torch.Tensor | None) -> torch.Tensor:
        """The routed sum ``y [N, D]`` in x's shape plus the shared experts (their gate_up output ``shared_gu
        [N, 2 F_s]`` when the router's GEMM computed it), and the load, in training."""
        if self.training:
            self.last_load = torch.bincount(idx.flatten(), minlength=self.cfg.num_experts).detach()
        y = y.view(x.shape)
        if self.shared is None:
            return y
        if shared_gu is None:
            return y + self.shared.forward_torch(x)
        return y + swiglu_down(shared_gu, self.shared.down).view(x.shape)

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """Auxiliary-loss-free load balancing (DeepSeek-V3, arXiv:2412.19437 eq. 16; Wang et al. 2024,
        arXiv:2408.15664): after a training step, ``b_e += rate * sign(mean load - load_e)``, so an
        overloaded expert is chosen less. Uses ``last_load``; does nothing before a training forward."""
        if self.last_load is None:
            return
        load = self.last_load.float()
        self.router_bias += rate * torch.sign(load.mean() - load)


def ffn_residual(ffn: nn.Module, x: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """A decoder layer's post-attention sublayer: ``x + ffn(rmsnorm(x, norm, eps))``, ffn a :class:`MoE` or a
    :class:`DenseMLP`, x ``[..., D]``, norm ``[D]``. Where the C form runs them (fp32 CPU tensors, x contiguous, no
    autograd, a MoE not in training) one C call writes it into x and returns x (:meth:`kda_core.cpu_moe.CMoE.residual`,
    bitwise the separate calls); else those calls return a new tensor. Raises what they raise."""
    fused = _FUSED[0] if _FUSED else _choose()
    w = ffn._parameters.get("router", ffn._parameters.get("gate_up"))
    if fused is not None and x.dtype is torch.float32 and norm.dtype is torch.float32 and w.dtype is torch.float32 \
            and x.is_cpu and norm.is_cpu and w.is_cpu and x.is_contiguous() and norm.is_contiguous() \
            and norm.shape == x.shape[-1:] and not ffn.training \
            and not (torch.is_grad_enabled() and (x.requires_grad or norm.requires_grad or w.requires_grad)):
        fused.residual(ffn, x.view(-1, x.shape[-1]), norm, eps)            # [M, D]
        return x
    return x + ffn(rmsnorm(x, norm, eps))
