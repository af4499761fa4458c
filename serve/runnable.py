"""The shipped models, loaded in this one module, once per process: which weights each runnable preset runs, and
the trained draft model.

| preset | weights | parameters |
|---|---|---|
| ``demo`` | trained, shipped in ``weights/kda-demo`` (Kimi-Linear's format, fp32) | 4.0 M (1.9 M active) |
| ``demo-k3gate`` | seeded random init (no trained weights ship for the K3 lower-bound gate) | 2.36 M |
| ``demo-tiny`` | seeded random init (test-sized: 4 layers, d = 32) | 0.07 M |

The trained ``demo`` model has the ``demo`` preset's every cache and state shape (KDA state ``[H, K, V]``,
conv window, MLA latent width), so byte counts of the preset hold for it; only its feed-forward widths differ
(dense 512 vs 256, experts 128 vs 64, ``train.model_config``). ``weights/kda-draft`` holds the target's trained
2-layer draft model (:func:`draft_model`).

Nothing else loads shipped weights: the HTTP server (:mod:`serve.http.model`) and the fleet simulator's measured
service model call :func:`demo_model`; the lab, the benches and the pages take both models from :mod:`lab.models`,
which re-exports this module's (``tests/test_layers.py`` pins both).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

from serve.errors import check_choice

if TYPE_CHECKING:    # torch loads on the first model: Home reads this table (lab.trained) before it
    from kda_core.model import HybridLM

RUNNABLE = ("demo", "demo-k3gate", "demo-tiny")
WEIGHTS_ROOT = Path(__file__).resolve().parents[1] / "weights"
TRAINED_WEIGHTS = {"demo": WEIGHTS_ROOT / "kda-demo"}
"""Model folder (Kimi-Linear's format, :mod:`kda_core.pretrained`) of each runnable preset that ships trained weights."""
MODEL_PATH_ENV = "KDA_LAB_MODEL_PATH"
"""Environment variable (or a Streamlit root-level secret of that name) naming another checkpoint folder for the
``demo`` preset: any Kimi-Linear checkpoint of the byte vocabulary (256 ids; the pages type text as bytes)."""


def trained_folder(preset: str = "demo") -> Path:
    """The folder the trained ``preset`` loads: ``$KDA_LAB_MODEL_PATH`` when set (``demo`` only), else the shipped
    one. Raises ValueError for a preset without trained weights."""
    if preset not in TRAINED_WEIGHTS:
        raise ValueError(f"preset {preset!r} has no trained weights (those that do: {sorted(TRAINED_WEIGHTS)})")
    override = os.environ.get(MODEL_PATH_ENV)
    return Path(override) if override and preset == "demo" else TRAINED_WEIGHTS[preset]
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
    weights (``HybridLM.from_pretrained``, or the folder ``$KDA_LAB_MODEL_PATH`` names), the others their seeded random
    init (see the table above). The same object is returned on every call: do not modify it.

    Raises ValueError naming ``preset`` unless it is one of :data:`RUNNABLE`, or (from ``from_pretrained``)
    when the shipped folder is missing a file or its tensors do not match its config."""
    from kda_core.config import PRESETS
    from kda_core.model import HybridLM

    if is_trained(preset):
        model = HybridLM.from_pretrained(trained_folder(preset)).eval()
        if model.cfg.vocab_size != 256:
            raise ValueError(f"{MODEL_PATH_ENV}={trained_folder(preset)} has a vocabulary of {model.cfg.vocab_size} "
                             "ids; the lab's pages need the byte vocabulary (256): serve it with "
                             "python -m serve.http --model-path instead")
        return model
    return HybridLM(PRESETS[preset]).eval()


def folder_model(path) -> HybridLM:
    """A checkpoint folder in Kimi-Linear's format (``python -m serve.http --model-path``: the user's folder, not a
    shipped one), fp32, eval mode; loaded afresh on every call. Raises ValueError (from ``from_pretrained``) for a
    folder that is not one, an unsupported config, or mismatched tensors."""
    from kda_core.model import HybridLM

    return HybridLM.from_pretrained(path).eval()


@functools.lru_cache(maxsize=1)
def draft_model() -> HybridLM:
    """The trained 2-layer draft model of the ``demo`` target (``weights/kda-draft``: 1 KDA + 1 MLA layer, the
    target's widths), fp32, eval mode, no autograd; the same object on every call: do not modify it.

    Raises ValueError (from ``from_pretrained``) when the shipped folder is missing a file or its tensors do not
    match its config."""
    from kda_core.model import HybridLM

    return HybridLM.from_pretrained(DRAFT_WEIGHTS).eval()
