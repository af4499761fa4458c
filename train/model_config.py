"""The trained models' shapes: the target ``kda-demo`` and its draft model ``kda-draft``.

``kda-demo``: the ``demo`` preset (8 layers in the Kimi pattern 3 KDA : 1 MLA, d = 128, 4 KDA heads of
K = V = 32, MLA latent 64 + 16, byte vocabulary) with a wider MLP (512), about 2.3 M parameters. Every cache
and state shape (KDA state ``[H, K, V]``, conv window, MLA latent width) is the demo preset's, so byte counts
of the demo model hold for the trained one; only the MLP width differs. Chosen by measured training
throughput (``python -m bench.train``, 1 thread): 1,855 bytes/s against 2,062 for the 1.49 M ``demo`` shape
and 1,221 for a 3.8 M d = 192 shape (``bench/results/train.json``).

``kda-draft``: the draft model of speculative decoding (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding": a small model of the same vocabulary proposes, the target verifies).
Two layers, 1 KDA + 1 MLA (``kimi_pattern(2)``: the last layer is MLA), otherwise the target's widths, so it
shares the byte vocabulary, the corpus split and the training loop; about 0.6 M parameters.
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
        return dataclasses.replace(PRESETS["demo"], name=TRAINED_NAME, intermediate_size=512, source=_SOURCE)
    if name == DRAFT_NAME:
        return dataclasses.replace(PRESETS["demo"], name=DRAFT_NAME, num_layers=2, mla_layers=kimi_pattern(2),
                                   intermediate_size=512, source=_SOURCE)
    raise ValueError(f"name must be one of {TRAINED_MODELS}, got {name!r}")


TRAINED_MODELS = (TRAINED_NAME, DRAFT_NAME)
