"""The torch backend of :mod:`kda_core.chunk`: the chunked form as torch ops (any dtype, any device, autograd).

A backend implements four steps on the chunk-major unit layout (a unit is one chunk of one batch row and
head; units ordered ``[NT, B, H]``, n = NT B H), the same for :class:`TorchChunk` and the fused C backend
(:class:`kda_core.cpu_kernel.FusedChunk`); :func:`kda_core.chunk._choose` picks one per call:

- ``prepare(q, k, v, g, beta, C, may_forget)`` -> :class:`kda_core.wy.WY`, each field ``[n, ...]``;
- ``states(wy, B, H, S)`` -> ``(h [NT, B*H, K, V], v_new [NT, B*H, C, V], final [B*H, K, V])`` from the
  starting state S ``[B*H, K, V]``;
- ``outputs(wy, h, v_new, B, H, T, scale)`` -> o ``[B, T, H, V]`` (compute dtype; may be a view);
- ``forward(q, k, v, g, beta, h, scale, C, piece_tokens, may_forget)`` -> o ``[B, T, H, V]``: the whole call
  without autograd, h ``[NT + 1, B, H, K, V]`` holding the initial state in ``h[0]`` and receiving every
  later state in place (``h[NT]`` the final one).

Inputs reach a backend validated (:func:`kda_core.chunk.kda_chunk`); ``scale`` is a float.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kda_core.kda import _compute_dtype
from kda_core.wy import WY, wy_units


def units(x: torch.Tensor, C: int, dt: torch.dtype) -> torch.Tensor:
    """``[B, T, H, D]`` -> ``[NT, B, H, C, D]`` in ``dt`` (a view when no cast or padding is needed); the T dim
    padded to NT C tokens with zeros, which are exact no-op tokens for g, k, v and beta (NT >= 1)."""
    B, T, H = x.shape[:3]
    NT = max(1, -(-T // C))
    x = x.to(dt)
    if NT * C - T:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, NT * C - T))
    return x.view(B, NT, C, H, -1).permute(1, 0, 3, 2, 4)                     # [NT, B, H, C, D]


def token_major(o: torch.Tensor, B: int, H: int, num_tokens: int) -> torch.Tensor:
    """``[NT*B*H, C, V]`` unit outputs as a ``[B, num_tokens, H, V]`` view (padding dropped)."""
    n, C, V = o.shape
    return o.view(-1, B, H, C, V).permute(1, 0, 3, 2, 4).flatten(1, 2)[:, :num_tokens]   # [B, T, H, V]


def _chunk_views(wy: WY, B: int, H: int) -> tuple:
    """w, u ``[NT, B*H, C, *]``, kd transposed ``[NT, B*H, K, C]`` (``K~_c^T``) and decay_last ``[NT, B*H, K, 1]``:
    views of the unit tensors."""
    n, C, K = wy.w.shape
    NT = n // (B * H)
    return (wy.w.view(NT, B * H, C, K), wy.u.view(NT, B * H, C, -1),
            wy.kd.view(NT, B * H, C, K).transpose(-1, -2), wy.decay_last.view(NT, B * H, K, 1))


class TorchChunk:
    """The chunked form in torch ops (the reference the fused form is checked against); see the module docstring
    for the four steps."""

    name = "torch form"

    def prepare(self, q, k, v, g, beta, C: int, may_forget: bool) -> WY:
        """The WY quantities of every unit (:func:`kda_core.wy.wy_units`: each unit by the form its own gates
        allow), in the compute dtype."""
        dt = _compute_dtype(v)
        return wy_units(*(units(x, C, dt) for x in (g, k, q, v, beta.unsqueeze(-1))), may_forget)

    def states(self, wy: WY, B: int, H: int, S: torch.Tensor) -> tuple:
        """``v_new = u - w S``; ``S <- diag(exp(G_C)) S + K~^T v_new`` per chunk. Without autograd each state is
        written in place into one tensor; with autograd (training) they are stacked (an in-place write would
        invalidate what autograd saved): the same products, bitwise equal."""
        w, u, kd, decay_last = _chunk_views(wy, B, H)
        NT = len(u)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (S, wy.w, wy.u, wy.kd, wy.decay_last)):
            hs, vs = [], []
            for j in range(NT):
                hs.append(S)
                vn = torch.baddbmm(u[j], w[j], S, alpha=-1.0)          # u - w S   [B*H, C, V]
                vs.append(vn)
                S = torch.baddbmm(S * decay_last[j], kd[j], vn)
            return torch.stack(hs), torch.stack(vs), S
        h = S.new_empty(NT + 1, *S.shape)                               # [NT + 1, B*H, K, V]
        h[0] = S
        v_new = self._scan_into(wy, B, H, h)
        return h[:NT], v_new, h[NT].clone()

    @staticmethod
    def _scan_into(wy: WY, B: int, H: int, h: torch.Tensor) -> torch.Tensor:
        """The scan without autograd, in place: h ``[NT + 1, B*H, K, V]`` holds the starting state in ``h[0]``
        and receives the state before each later chunk and the final one in ``h[NT]``. Returns v_new
        ``[NT, B*H, C, V]``."""
        w, u, kd, decay_last = (t.unbind(0) for t in _chunk_views(wy, B, H))
        v_new = wy.u.new_empty(len(u), *u[0].shape)                     # [NT, B*H, C, V]
        hs, vs = h.unbind(0), v_new.unbind(0)                           # per-chunk views, made once
        for j in range(len(u)):                                         # sequential only over chunks
            torch.baddbmm(u[j], w[j], hs[j], alpha=-1.0, out=vs[j])    # u - w S   [B*H, C, V]
            torch.mul(hs[j], decay_last[j], out=hs[j + 1])
            hs[j + 1].baddbmm_(kd[j], vs[j])                           # diag(exp(G_C)) S + K~^T v_new
        return v_new

    def outputs(self, wy: WY, h: torch.Tensor, v_new: torch.Tensor, B: int, H: int, T: int, scale: float):
        """``scale ((q exp(G)) h + Aqk v_new)`` of every unit, all chunks at once, as a ``[B, T, H, V]`` view;
        h ``[NT, B*H, K, V]``, v_new ``[NT, B*H, C, V]``."""
        n, C, K = wy.qg.shape
        av = torch.bmm(wy.Aqk, v_new.reshape(n, C, -1))
        o = torch.baddbmm(av, wy.qg, h.reshape(n, K, -1), beta=scale, alpha=scale)   # [NT*B*H, C, V]
        return token_major(o, B, H, T)

    def forward(self, q, k, v, g, beta, h: torch.Tensor, scale: float, C: int, piece_tokens: int,
                may_forget: bool) -> torch.Tensor:
        """The call without autograd, piece by piece (``piece_tokens`` each, the state carried in ``h``); o
        ``[B, T, H, V]`` in v's dtype, written piece by piece."""
        B, T, H, K = q.shape
        V = v.shape[-1]
        o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)          # [B, T, H, V]
        for s in range(0, max(T, 1), piece_tokens):
            part = slice(s, s + piece_tokens)
            wy = self.prepare(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], C, may_forget)
            j, nt = s // C, len(wy.w) // (B * H)
            v_new = self._scan_into(wy, B, H, h[j: j + nt + 1].view(nt + 1, B * H, K, V))
            o[:, part] = self.outputs(wy, h[j: j + nt], v_new, B, H, min(T - s, piece_tokens), scale)
        return o


TORCH = TorchChunk()
