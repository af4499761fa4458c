"""Training batches and held-out evaluation windows over a byte string.

A training batch is B windows of ``T + 1`` bytes at offsets drawn uniformly from the training bytes by a
seeded ``torch.Generator`` (its state is part of a checkpoint, so a resumed run draws the same batches
as an uninterrupted one). Inputs are the first T bytes of each window, targets the last T.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Batch(NamedTuple):
    """inputs ``[B, T]`` int64 byte ids; targets ``[B, T]`` int64, ``targets[:, t] = inputs[:, t + 1]``
    (the byte after position t)."""

    inputs: torch.Tensor
    targets: torch.Tensor


def as_tensor(data: bytes) -> torch.Tensor:
    """Bytes as a uint8 tensor ``[N]`` (no copy of the Python bytes kept)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class BatchSampler:
    """Random windows of ``seq_len + 1`` bytes of ``data``.

    Args: data: uint8 ``[N]``; batch_size B >= 1; seq_len T >= 1; seed: of the generator.
    Raises ValueError when data holds fewer than T + 1 bytes or B, T are not positive.
    """

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int):
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if data.numel() < seq_len + 1:
            raise ValueError(f"data must hold at least seq_len + 1 = {seq_len + 1} bytes, got {data.numel()}")
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> Batch:
        """The next batch (advances the generator)."""
        T = self.seq_len
        cpu = self.data.device                                               # explicit: the default may be cuda
        starts = torch.randint(0, self.data.numel() - T, (self.batch_size,), generator=self.gen, device=cpu)  # [B]
        idx = starts[:, None] + torch.arange(T + 1, device=cpu)              # [B, T + 1]
        win = self.data[idx].long()                                          # [B, T + 1]
        return Batch(win[:, :-1], win[:, 1:])

    def state(self) -> torch.Tensor:
        return self.gen.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)


def eval_windows(data: torch.Tensor, num_windows: int, seq_len: int) -> Batch:
    """``num_windows`` windows of ``seq_len + 1`` bytes at evenly spaced offsets of ``data`` (deterministic).

    Raises ValueError when data is shorter than one window."""
    T = seq_len
    if data.numel() < T + 1 or num_windows < 1:
        raise ValueError(f"data must hold >= seq_len + 1 = {T + 1} bytes and num_windows >= 1, "
                         f"got {data.numel()} bytes, {num_windows} windows")
    last = data.numel() - (T + 1)
    starts = torch.linspace(0, last, num_windows, device=data.device).round().long()  # [W]
    win = data[starts[:, None] + torch.arange(T + 1, device=data.device)].long()      # [W, T + 1]
    return Batch(win[:, :-1], win[:, 1:])
