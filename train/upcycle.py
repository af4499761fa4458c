"""Warm start from a trained dense model of the previous design (sparse upcycling).

Komatsuzaki et al. 2022, "Sparse Upcycling: Training Mixture-of-Experts from Dense Checkpoints"
(arXiv:2212.05055): a MoE starts from a trained dense model's weights rather than from scratch. The source is a
``model.safetensors`` of the earlier byte model (state-dict names ``embed``, ``mixers.{i}.*``, ``norm1``,
``norm2``, ``mlp_up.{i}`` ``[2F, D]``, ``mlp_down.{i}`` ``[D, F]``, ``norm_f``, ``lm_head``; e.g. this repository's
``weights/kda-demo/model.safetensors`` before the Kimi-Linear architecture, ``git show 10317b4:...``), of the same
widths. What is copied:

- embeddings, every norm, every KDA and MLA layer (the MLA layers lose their rotary embedding: the model runs
  them without positional encoding, as Kimi-Linear, and training adapts them), ``lm_head``;
- dense layers: the dense MLP as it is;
- MoE layers: the dense MLP's F hidden units split into F / F_e slices of the expert width F_e; the shared expert
  takes slice 0, routed expert e slice ``1 + e mod (F / F_e - 1)``; the router starts at small random weights.

The result is not the dense model (the MoE sums the shared slice and two routed slices, weighted), only a start
much closer to a good model than a random one; training then runs as usual.
"""
from __future__ import annotations

import torch

from kda_core.model import HybridLM


def upcycle(model: HybridLM, path, seed: int = 0) -> list[str]:
    """Copy the dense model at ``path`` into ``model`` in place (see the module docstring); returns the names of
    ``model``'s tensors that were filled from it.

    Raises:
        ValueError: the file lacks a tensor the copy needs, a shape differs, or the dense MLP width is not a
            multiple of the expert width with at least 2 slices.
    """
    from safetensors.torch import load_file

    cfg = model.cfg
    src = load_file(str(path))
    filled = []

    def take(name: str, shape) -> torch.Tensor:
        if name not in src:
            raise ValueError(f"{path} has no tensor {name!r} (not a dense model of the previous design)")
        t = src[name].to(torch.float32)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{path}: {name!r} has shape {tuple(t.shape)}, need {tuple(shape)}")
        return t

    state = model.state_dict()
    with torch.no_grad():
        for name, t in state.items():
            if name.startswith(("embed", "norm1", "norm2", "norm_f", "lm_head", "mixers.")):
                t.copy_(take(name, t.shape))
                filled.append(name)
        gen = torch.Generator().manual_seed(seed)
        for i, ffn in enumerate(model.ffn):
            up = take(f"mlp_up.{i}", (2 * cfg.intermediate_size, cfg.hidden_size))
            down = take(f"mlp_down.{i}", (cfg.hidden_size, cfg.intermediate_size))
            F = cfg.intermediate_size
            if not cfg.is_moe_layer(i):
                ffn.gate_up.copy_(up)
                ffn.down.copy_(down)
                filled += [f"ffn.{i}.gate_up", f"ffn.{i}.down"]
                continue
            Fe = cfg.moe_intermediate_size
            if F % Fe or F // Fe < 2:
                raise ValueError(f"the dense MLP width {F} must be a multiple >= 2x of the expert width {Fe}")
            slices = F // Fe

            if ffn.shared is not None:
                gu, dn = _slice(up, down, 0, Fe)
                ffn.shared.gate_up.copy_(gu)
                ffn.shared.down.copy_(dn)
            for e in range(cfg.num_experts):
                gu, dn = _slice(up, down, 1 + e % (slices - 1), Fe)
                ffn.experts_gate_up[e].copy_(gu)
                ffn.experts_down[e].copy_(dn)
            ffn.router.copy_(torch.randn(ffn.router.shape, generator=gen) * 0.02)
            filled += [f"ffn.{i}.{n}" for n, _ in ffn.named_parameters()]
    return filled


def _slice(up: torch.Tensor, down: torch.Tensor, s: int, Fe: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden units ``[s Fe, (s + 1) Fe)`` of a dense SwiGLU MLP (``up`` ``[2F, D]`` gate rows then up rows,
    ``down`` ``[D, F]``) as an expert's (gate_up ``[2 Fe, D]``, down ``[D, Fe]``)."""
    F = up.shape[0] // 2
    rows = torch.cat([up[s * Fe:(s + 1) * Fe], up[F + s * Fe: F + (s + 1) * Fe]])   # [2 Fe, D]
    return rows, down[:, s * Fe:(s + 1) * Fe]                                       # [D, Fe]
