"""Training checkpoints: model + optimizer + step + every RNG state, written atomically.

One file ``<out>/checkpoint.pt`` (``torch.save`` of a dict); it is written to a temporary name and renamed,
so a run killed while saving leaves the previous checkpoint intact. ``load`` returns None when there is none.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import torch

CHECKPOINT_NAME = "checkpoint.pt"


def checkpoint_path(out_dir) -> Path:
    return Path(out_dir) / CHECKPOINT_NAME


def save(out_dir, *, model, optimizer, step: int, tokens: int, sampler_state: torch.Tensor, config: dict,
         args: dict, elapsed_s: float) -> Path:
    """Write the checkpoint of a run at ``step`` (optimizer steps done) and ``tokens`` (trained bytes)."""
    path = checkpoint_path(out_dir)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "tokens": tokens,
                "sampler_state": sampler_state, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                "config": config, "args": args, "elapsed_s": elapsed_s}, tmp)
    os.replace(tmp, path)
    return path


def load(out_dir) -> dict | None:
    """The checkpoint dict of ``out_dir``, or None if it has none. Restores the global torch and Python RNGs."""
    path = checkpoint_path(out_dir)
    if not path.is_file():
        return None
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    torch.set_rng_state(ckpt["torch_rng"])
    random.setstate(ckpt["python_rng"])
    return ckpt
