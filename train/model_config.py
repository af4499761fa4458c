"""The trained demo model's shape: the ``demo`` preset (8 layers in the Kimi pattern 3 KDA : 1 MLA, d = 128,
4 KDA heads of K = V = 32, MLA latent 64 + 16, byte vocabulary) with a wider MLP (512), about 2.3 M parameters.

Every cache and state shape (KDA state ``[H, K, V]``, conv window, MLA latent width) is the demo preset's, so
byte counts of the demo model hold for the trained one; only the MLP width differs. Chosen by measured
training throughput (``python -m bench.train``, 1 thread): 1,855 bytes/s against 2,062 for the 1.49 M ``demo``
shape and 1,221 for a 3.8 M d = 192 shape (``bench/results/train.json``).
"""
from __future__ import annotations

import dataclasses

from kda_core.config import PRESETS, ModelConfig

TRAINED_NAME = "kda-demo"


def model_config() -> ModelConfig:
    """The config trained by ``python -m train`` and shipped in ``weights/kda-demo``."""
    return dataclasses.replace(PRESETS["demo"], name=TRAINED_NAME, intermediate_size=512,
                               source="trained by python -m train on the CPython stdlib corpus (this repo)")
