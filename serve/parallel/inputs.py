"""Deterministic inputs for context-parallel runs: any rank can make exactly its slice of tokens.

Inputs are generated in tiles of ``TILE_TOKENS`` tokens, each from its own seeded generator, so the
tokens ``[start, end)`` are the same tensors whether one process makes the whole sequence or a rank
makes only its block (no rank holds the full sequence). Gates follow the KDA layer's own
parameterisation (:func:`kda_core.kda.kda_gate`, softplus form, ``A`` in [1, 4), ``dt`` log-uniform in
[1e-3, 0.1] as in fla's init), keys and queries are L2-normalised, ``beta = sigmoid(N(0, 1))``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kda_core.kda import kda_gate
from serve.errors import check_choice, check_int

TILE_TOKENS = 256
DTYPES = {"float32": torch.float32, "float64": torch.float64}


class KDAInputs(NamedTuple):
    """q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H, K]`` (log decay); beta ``[B, T, H]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


def _check_range(start: int, end: int) -> None:
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end):
        raise ValueError(f"token range must satisfy 0 <= start < end, got start={start!r}, end={end!r}")


def _tiles(start: int, end: int, seed: int, make):
    """Concatenate ``make(gen, n_tokens)`` over the tiles covering [start, end), then slice."""
    first, last = start // TILE_TOKENS, (end - 1) // TILE_TOKENS
    parts = [make(torch.Generator().manual_seed(seed * 1_000_003 + i), TILE_TOKENS) for i in range(first, last + 1)]
    lo = start - first * TILE_TOKENS
    return [torch.cat(p, dim=1)[:, lo: lo + end - start] for p in zip(*parts)]


def _gate_params(H: int, K: int, seed: int):
    gen = torch.Generator().manual_seed(seed * 7 + 1)
    A_log = torch.empty(H, dtype=torch.float64).uniform_(1.0, 4.0, generator=gen).log()  # [H]
    dt = torch.empty(H * K, dtype=torch.float64).uniform_(-6.9, -2.3, generator=gen).exp()  # [H K]
    return A_log, dt + torch.log(-torch.expm1(-dt))                                        # softplus^-1(dt)


def kda_inputs(batch: int, num_heads: int, head_k_dim: int, head_v_dim: int, start: int, end: int,
               seed: int = 0, dtype: str = "float32") -> KDAInputs:
    """Tokens ``[start, end)`` of a seeded KDA input sequence (see module doc).

    Returns :class:`KDAInputs` in ``dtype`` ("float32" or "float64"; generated in fp64, then cast).

    Raises:
        ValueError: bad sizes, range or dtype.
    """
    for name, val in (("batch", batch), ("num_heads", num_heads), ("head_k_dim", head_k_dim),
                      ("head_v_dim", head_v_dim)):
        check_int(name, val)
    check_choice("dtype", dtype, list(DTYPES))
    _check_range(start, end)
    B, H, K, V = batch, num_heads, head_k_dim, head_v_dim
    A_log, dt_bias = _gate_params(H, K, seed)

    def make(gen, n):
        def r(*shape):
            return torch.randn(B, n, *shape, generator=gen, dtype=torch.float64)
        q, k, v, f, b = r(H, K), r(H, K), r(H, V), r(H, K), r(H)
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, kda_gate(f, A_log, dt_bias), torch.sigmoid(b)

    return KDAInputs(*(x.to(DTYPES[dtype]) for x in _tiles(start, end, seed, make)))


def initial_state(batch: int, num_heads: int, head_k_dim: int, head_v_dim: int, seed: int = 0,
                  dtype: str = "float32") -> torch.Tensor:
    """A seeded non-zero state ``[B, H, K, V]`` standing in for a prefix-cache hit."""
    gen = torch.Generator().manual_seed(seed * 13 + 5)
    S = 0.1 * torch.randn(batch, num_heads, head_k_dim, head_v_dim, generator=gen, dtype=torch.float64)
    return S.to(DTYPES[dtype])


def layer_inputs(batch: int, hidden_size: int, start: int, end: int, seed: int = 0) -> torch.Tensor:
    """Tokens ``[start, end)`` of a seeded layer input ``x [B, T, D]`` (fp32, unit-variance)."""
    _check_range(start, end)
    check_int("hidden_size", hidden_size)

    def make(gen, n):
        return (torch.randn(batch, n, hidden_size, generator=gen),)

    return _tiles(start, end, seed, make)[0]
