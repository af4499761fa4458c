"""The shipped models, loaded in this one module, once per process: which weights each runnable preset runs, and
the trained draft model.

| preset | weights | parameters |
|---|---|---|
| ``demo`` | trained, shipped in ``weights/kda-demo`` (fp16 ``safetensors``, computed in fp32) | 2.28 M |
| ``demo-k3gate`` | seeded random init (no trained weights ship for the K3 lower-bound gate) | 1.49 M |
| ``demo-tiny`` | seeded random init (test-sized: 4 layers, d = 32) | 0.06 M |

The trained ``demo`` model has the ``demo`` preset's every cache and state shape (KDA state ``[H, K, V]``,
conv window, MLA latent width), so byte counts of the preset hold for it; only its MLP is wider (512 vs 256,
``train.model_config``). ``weights/kda-draft`` holds the target's trained 2-layer draft model (:func:`draft_model`).

Nothing else loads shipped weights: the HTTP server (:mod:`serve.http.model`) and the fleet simulator's measured
service model call :func:`demo_model`; the lab, the benches and the pages take both models from :mod:`lab.models`,
which re-exports this module's (``tests/test_layers.py`` pins both).
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from serve.errors import check_choice

if TYPE_CHECKING:    # torch loads on the first model: Home reads this table (lab.trained) before it
    from kda_core.model import HybridLM

RUNNABLE = ("demo", "demo-k3gate", "demo-tiny")
WEIGHTS_ROOT = Path(__file__).resolve().parents[1] / "weights"
TRAINED_WEIGHTS = {"demo": WEIGHTS_ROOT / "kda-demo"}
"""Model folder (``config.json`` + ``model.safetensors``) of each runnable preset that ships trained weights."""
DRAFT_WEIGHTS = WEIGHTS_ROOT / "kda-draft"
"""Model folder of the trained draft model of the ``demo`` target (speculative decoding)."""


def is_trained(preset: str) -> bool:
    """True when ``preset`` runs shipped trained weights, False when it runs its seeded random init.
    Raises ValueError naming ``preset`` unless it is one of :data:`RUNNABLE`."""
    check_choice("preset", preset, RUNNABLE)
    return preset in TRAINED_WEIGHTS


@functools.lru_cache(maxsize=len(RUNNABLE))   # bounded: one model per runnable preset, built once per process
def demo_model(preset: str = "demo") -> HybridLM:
    """The runnable model of a demo preset, fp32, eval mode, no autograd: ``demo`` loads the shipped trained
    weights (``HybridLM.from_pretrained``; fp16 on disk, fp32 in memory), the others their seeded random
    init (see the table above). The same object is returned on every call: do not modify it.

    Raises ValueError naming ``preset`` unless it is one of :data:`RUNNABLE`, or (from ``from_pretrained``)
    when the shipped folder is missing a file or its tensors do not match its config."""
    from kda_core.config import PRESETS
    from kda_core.model import HybridLM

    if is_trained(preset):
        return HybridLM.from_pretrained(TRAINED_WEIGHTS[preset]).eval()
    return HybridLM(PRESETS[preset]).eval()


@functools.lru_cache(maxsize=1)
def draft_model() -> HybridLM:
    """The trained 2-layer draft model of the ``demo`` target (``weights/kda-draft``: 1 KDA + 1 MLA layer, the
    target's widths), fp32, eval mode, no autograd; the same object on every call: do not modify it.

    Raises ValueError (from ``from_pretrained``) when the shipped folder is missing a file or its tensors do not
    match its config."""
    from kda_core.model import HybridLM

    return HybridLM.from_pretrained(DRAFT_WEIGHTS).eval()
