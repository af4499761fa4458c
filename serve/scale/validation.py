"""The roofline against the Kimi Linear tech report's published curves (``published.py``), with what is
fitted, what is predicted and what is published kept apart.

Absolute times depend on the report's unstated setup (GPU, count, parallelism, framework
overheads), so the headline comparison is the ratio MLA / Kimi Linear; the target is within +-25 %.
The prefill fit has ONE meaning: alpha, beta fitted once at :data:`FIT_SETUP` (H100 x TP8, the setup
assumed for the report, which states none) and carried unchanged to every other setup, where the
fitted curve is a prediction (nothing is refitted per GPU). The service times of the fleet simulator
(:class:`serve.fleet.sim.roofline_service.RooflineService`) use these factors. The ratio functions take
the setup (hardware, TP) they are asked about; ``DECODE_SETUP`` is only the decode tests' default.

- Prefill (Fig. 7a, batch 1): the pure ("physical") roofline overshoots the MLA / Kimi Linear ratio,
  because it runs everything but attention at peak. One named fit, ``PrefillFit``: two time scales,
  alpha for the attention layers' kind ("mla") and beta for every other kind, fitted by least squares
  on relative error to **Kimi Linear's nine published points only** (``FIT_CURVE``) at ``FIT_SETUP``.
  The all-MLA curve's nine points are held out: they are predicted, and :func:`prefill_points` reports
  the error on them (at ``FIT_SETUP``) apart from the error on the points the fit saw. (An earlier version solved alpha, beta from
  the two MLA points at 512K and 1M and then compared the curve with those same points: a fit checked
  on its own training points proves nothing.)
- Decode (Fig. 7b, batch 1): the pure roofline, no fitted constant: every point is a prediction.
- Fig. 1b (larger batches, "theoretical"): see :mod:`serve.scale.capacity` (the largest batch each
  model fits, TPOT and throughput at it).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from serve.errors import check_choice
from serve.scale.hardware import Hardware
from serve.scale.hardware import hardware as hardware_preset
from serve.scale.model_shape import ModelShape, preset
from serve.scale.published import CONTEXTS, PREFILL_FIG7A, TPOT_FIG7B, PublishedCurve
from serve.scale.roofline import decode_time, prefill_time

RATIO_TOLERANCE = 0.25  # +-25 % on MLA / Kimi Linear
DECODE_SETUP = ("H100", 1)  # the tests' default (hardware, tp) for decode: batch 1 on one GPU
FIT_SETUP = ("H100", 8)  # (hardware, tp) the report is assumed to run on; alpha, beta are fitted there only
FIT_CURVE = "kimi_linear"  # the prefill fit sees only Fig. 7a's Kimi Linear points; the MLA ones are held out
FIT_MODEL = "kimi-linear-48b-a3b"  # the model those points were measured on
CURVE_NAMES = {"kimi_linear": "Kimi Linear", "mla": "all MLA"}


class RatioRow(NamedTuple):
    """One published context: the published and modelled MLA / Kimi Linear ratios and the model's
    relative error (model / published - 1)."""

    figure: str
    context: int
    published: float
    model: float

    @property
    def rel_error(self) -> float:
        return self.model / self.published - 1


class PointRow(NamedTuple):
    """One published latency point against the model: ``curve`` ("Kimi Linear" or "all MLA"),
    ``context`` (tokens), ``published`` and ``model`` (the report's unit), ``role`` ("fitted on" for the
    points the fit saw, "held out" for those it predicts), ``rel_error`` = model / published - 1."""

    figure: str
    curve: str
    context: int
    published: float
    model: float
    role: str

    @property
    def rel_error(self) -> float:
        return self.model / self.published - 1


class PrefillFit(NamedTuple):
    """Time scales fitted on the published Kimi Linear prefill points: roofline attention-kind time x
    alpha, every other kind x beta (dimensionless; 1 = at peak)."""

    alpha: float
    beta: float


def _setup(hw: Hardware | None, tp: int | None, default: tuple[str, int]) -> tuple[Hardware, int]:
    return hw or hardware_preset(default[0]), tp or default[1]


def _shapes() -> tuple[ModelShape, ModelShape]:
    kl = preset(FIT_MODEL)
    return kl, kl.all_mla()


def _split_prefill(shape: ModelShape, hw: Hardware, tp: int, context: int) -> tuple[float, float]:
    """(attention-kind seconds, every other kind's seconds) of the pure roofline."""
    step = prefill_time(shape, hw, tp, context)
    attn = step.kind("mla").time_s if shape.num_mla_layers else 0.0
    return attn, step.total_s - attn


def fit_setup_title() -> str:
    """:data:`FIT_SETUP` as the pages write a setup: "H100 x TP8"."""
    return f"{FIT_SETUP[0]} x TP{FIT_SETUP[1]}"


def fit_prefill(published: PublishedCurve | None = None) -> PrefillFit:
    """alpha, beta by least squares on relative error, minimising sum_i (alpha a_i + beta l_i) / y_i - 1)^2
    over ``published``'s Kimi Linear points only (a_i, l_i: the roofline's attention and other seconds at
    context i on :data:`FIT_SETUP`; y_i the published seconds). The MLA points are never read. A negative
    scale (not physical) is clamped to 0 and the other refitted alone. ``published`` None = Fig. 7a.
    There is no per-setup refit: other setups carry these factors (:func:`fitted_prefill_s`)."""
    hw, tp = _setup(None, None, FIT_SETUP)
    kl, _ = _shapes()
    y = np.array(getattr(published or PREFILL_FIG7A, FIT_CURVE), dtype=float)
    a = np.array([_split_prefill(kl, hw, tp, c) for c in CONTEXTS]) / y[:, None]  # [points, 2], relative
    coef, *_ = np.linalg.lstsq(a, np.ones(len(y)), rcond=None)
    if (coef < 0).any():
        keep = int(np.argmax(coef))
        coef = np.zeros(2)
        coef[keep] = a[:, keep].sum() / (a[:, keep] ** 2).sum()
    return PrefillFit(alpha=float(coef[0]), beta=float(coef[1]))


def fitted_prefill_s(shape: ModelShape, hw: Hardware, tp: int, fit: PrefillFit, new_tokens: int,
                     cached_tokens: int = 0) -> float:
    """Seconds: roofline prefill of ``new_tokens`` after ``cached_tokens`` (:func:`prefill_time`) with the
    attention kind ("mla") x ``fit.alpha`` and every other kind x ``fit.beta``."""
    step = prefill_time(shape, hw, tp, new_tokens, cached_tokens)
    attn = step.kind("mla").time_s if shape.num_mla_layers else 0.0
    return fit.alpha * attn + fit.beta * (step.total_s - attn)


def prefill_points(fit: PrefillFit | None = None, contexts: tuple[int, ...] = CONTEXTS) -> list[PointRow]:
    """Fitted prefill seconds of Kimi-Linear-48B-A3B and its all-MLA counterfactual at :data:`FIT_SETUP` (where
    the fit was made: the roles below hold only there) against every Fig. 7a point at ``contexts``, each marked
    "fitted on" (Kimi Linear's, :data:`FIT_CURVE`) or "held out" (MLA's). ``fit`` None = :func:`fit_prefill`.
    Raises ValueError for a context the report does not plot."""
    hw, tp = _setup(None, None, FIT_SETUP)
    fit = fit or fit_prefill()
    shapes = dict(zip(("kimi_linear", "mla"), _shapes()))
    rows = []
    for attr, shape in shapes.items():
        for c in contexts:
            check_choice("context", c, CONTEXTS)
            rows.append(PointRow(PREFILL_FIG7A.figure, CURVE_NAMES[attr], c,
                                 getattr(PREFILL_FIG7A, attr)[CONTEXTS.index(c)],
                                 fitted_prefill_s(shape, hw, tp, fit, c),
                                 "fitted on" if attr == FIT_CURVE else "held out"))
    return rows


def prefill_ratios(fit: PrefillFit | None = None, hw: Hardware | None = None, tp: int | None = None,
                   contexts: tuple[int, ...] = CONTEXTS) -> list[RatioRow]:
    """Prefill MLA / Kimi Linear at each context on ``hw`` x ``tp`` (None = :data:`FIT_SETUP`); ``fit`` None =
    :func:`fit_prefill` (carried to ``hw`` x ``tp``, not refitted), or pass ``PrefillFit(1, 1)`` for the pure
    roofline. The ratio's numerator is held out (MLA's points are not fitted)."""
    hw, tp = _setup(hw, tp, FIT_SETUP)
    fit = fit or fit_prefill()
    kl, mla = _shapes()
    return [RatioRow(PREFILL_FIG7A.figure, c, PREFILL_FIG7A.ratio(c),
                     fitted_prefill_s(mla, hw, tp, fit, c) / fitted_prefill_s(kl, hw, tp, fit, c)) for c in contexts]


def decode_ratios(curve: PublishedCurve = TPOT_FIG7B, hw: Hardware | None = None, tp: int | None = None,
                  contexts: tuple[int, ...] = CONTEXTS) -> list[RatioRow]:
    """Pure-roofline TPOT MLA / Kimi Linear at batch 1 on ``hw`` x ``tp`` against ``curve``'s plotted ratios
    (nothing fitted: every row is a prediction)."""
    hw, tp = _setup(hw, tp, DECODE_SETUP)
    kl, mla = _shapes()
    return [RatioRow(curve.figure, c, curve.ratio(c),
                     decode_time(mla, hw, tp, 1, c).total_s / decode_time(kl, hw, tp, 1, c).total_s)
            for c in contexts]
