"""Held-out quality of a byte LM: nats per byte (mean next-byte cross-entropy) and greedy top-1 accuracy."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from train.batches import Batch


class Quality(NamedTuple):
    """nats_per_byte: mean cross-entropy of each target byte given the bytes before it in its window
    (nats; ``/ ln 2`` for bits); top1: fraction of targets equal to the argmax of the logits;
    num_bytes: targets scored."""

    nats_per_byte: float
    top1: float
    num_bytes: int


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of logits ``[B, T, 256]`` against targets ``[B, T]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model, windows: Batch, batch_size: int = 8) -> Quality:
    """Score ``model`` (a ``HybridLM``) on evaluation windows, ``batch_size`` windows per forward.

    The model's training flag is left as it was; the forward runs without autograd."""
    was_training = model.training
    model.eval()
    total, correct, n = 0.0, 0, 0
    try:
        for s in range(0, windows.inputs.shape[0], batch_size):
            x, y = windows.inputs[s: s + batch_size], windows.targets[s: s + batch_size]
            logits = model(x).logits                                          # [b, T, 256]
            total += F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="sum").item()
            correct += int((logits.argmax(-1) == y).sum())
            n += y.numel()
    finally:
        model.train(was_training)
    return Quality(total / n, correct / n, n)
