"""The trained models' shapes: the target ``kda-demo`` and its draft model ``kda-draft``.

``kda-demo``: the ``demo`` preset in the Kimi-Linear architecture (8 layers in the Kimi pattern 3 KDA : 1 MLA,
d = 128, 4 KDA heads of K = V = 32, MLA latent 64 + 16 without positional encoding, byte vocabulary; layer 0 a
dense SwiGLU MLP of width 512 (``first_k_dense_replace`` 1), layers 1-7 an MoE of 8 experts of width 128, top-2,
one shared expert, sigmoid router, ``routed_scaling_factor`` 2.446 as Kimi-Linear-48B-A3B), about 4.0 M
parameters of which about 1.9 M are active per token. Every cache and state shape (KDA state ``[H, K, V]``, conv
window, MLA latent width) is the demo preset's, so byte counts of the demo model hold for the trained one.

``kda-draft``: the draft model of speculative decoding (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding": a small model of the same vocabulary proposes, the target verifies).
Two layers, 1 KDA + 1 MLA (``kimi_pattern(2)``: the last layer is MLA), layer 0 dense and layer 1 an MoE of the
target's shape, so it shares the byte vocabulary, the corpus split and the training loop; about 1.0 M parameters.
"""
from __future__ import annotations

import dataclasses

from kda_core.config import PRESETS, ModelConfig, kimi_pattern

TRAINED_NAME = "kda-demo"
DRAFT_NAME = "kda-draft"
_SOURCE = "trained by python -m train on the CPython stdlib corpus (this repo)"


def model_config(name: str = TRAINED_NAME) -> ModelConfig:
    """The config trained by ``python -m train --model NAME`` and shipped in ``weights/NAME``.

    Raises:
        ValueError: ``name`` is not one of :data:`TRAINED_MODELS`.
    """
    if name == TRAINED_NAME:
        return dataclasses.replace(PRESETS["demo"], name=TRAINED_NAME, intermediate_size=512, moe_intermediate_size=128,
                                   source=_SOURCE)
    if name == DRAFT_NAME:
        return dataclasses.replace(PRESETS["demo"], name=DRAFT_NAME, num_layers=2, mla_layers=kimi_pattern(2),
                                   intermediate_size=512, moe_intermediate_size=128, source=_SOURCE)
    raise ValueError(f"name must be one of {TRAINED_MODELS}, got {name!r}")


TRAINED_MODELS = (TRAINED_NAME, DRAFT_NAME)
