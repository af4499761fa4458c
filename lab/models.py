"""The shipped models, as the lab, the benches and the pages take them: the one door to :mod:`serve.runnable`, the
module that loads them (once per process; the HTTP server loads through it too).

=====================  ======================================  =====================================================
name                   what                                    weights
=====================  ======================================  =====================================================
``demo_model(preset)`` the runnable model of a demo preset     ``demo``: trained ``weights/kda-demo``; the others
                                                               their seeded random init
``draft_model()``      the ``demo`` target's draft model       trained ``weights/kda-draft``
``RUNNABLE``           the runnable presets                    ``demo``, ``demo-k3gate``, ``demo-tiny``
``TRAINED_WEIGHTS``    model folder per trained preset         ``{"demo": weights/kda-demo}``
``DRAFT_WEIGHTS``      the draft model's folder                ``weights/kda-draft``
``is_trained(preset)`` True when ``preset`` runs shipped       (raises ValueError for a preset not in ``RUNNABLE``)
                       weights
=====================  ======================================  =====================================================

Every model returned is shared by the whole process: do not modify it. ``tests/test_layers.py`` pins that no other
module loads weights and that outside ``serve/`` these names are imported from here only.
"""
from __future__ import annotations

from serve.runnable import DRAFT_WEIGHTS, RUNNABLE, TRAINED_WEIGHTS, demo_model, draft_model, is_trained

__all__ = ["DRAFT_WEIGHTS", "RUNNABLE", "TRAINED_WEIGHTS", "demo_model", "draft_model", "is_trained"]
