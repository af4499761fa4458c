"""Causal depthwise short convolution with an explicit state (kernel W = 4, no bias, SiLU after).

The state holds the raw pre-conv inputs of the last ``W - 1`` tokens, ``[B, D, W-1]`` (oldest
first), exactly what fla's ``ShortConvolution`` cache and vLLM/SGLang's ``conv_state`` keep.
The sum over the window is written as a fixed-order sum of W elementwise products, so one token
at a time and many tokens at once give bitwise-identical results.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    apply_silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv of ``x`` continuing from ``conv_state``. Pure (no mutation).

    Args:
        x: raw inputs ``[B, T, D]``.
        weight: depthwise kernel ``[D, W]``; ``weight[:, -1]`` multiplies the current token.
        conv_state: raw inputs of the previous ``W - 1`` tokens ``[B, D, W-1]``, oldest first;
            None means zeros (start of a sequence).
        apply_silu: apply SiLU to the output (the KDA layer does).

    Returns:
        (y ``[B, T, D]`` in x's dtype, new_conv_state ``[B, D, W-1]``: the raw inputs of the last
        ``W - 1`` tokens of ``[state, x]``).

    Raises:
        ValueError: on shape mismatch.
    """
    if x.dim() != 3:
        raise ValueError(f"x must have shape [B, T, D], got {tuple(x.shape)}")
    B, T, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight must have shape [D, W] = [{D}, W], got {tuple(weight.shape)}")
    W = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(B, D, W - 1)
    elif conv_state.shape != (B, D, W - 1):
        raise ValueError(f"conv_state must have shape [B, D, W-1] = {(B, D, W - 1)}, got {tuple(conv_state.shape)}")
    full = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, D, W-1+T]
    y = full[..., 0:T] * weight[:, 0:1]
    for w in range(1, W):                                   # fixed order: bitwise split-invariant
        y = y + full[..., w:w + T] * weight[:, w:w + 1]      # [B, D, T]
    if apply_silu:
        y = F.silu(y)
    new_state = full[..., full.shape[-1] - (W - 1):].clone()  # [B, D, W-1]
    return y.transpose(1, 2), new_state
