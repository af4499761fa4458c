"""The roofline against the Kimi Linear tech report's published curves (``published.py``).

Absolute times depend on the report's unstated setup (GPU, count, parallelism, framework
overheads), so only the ratios MLA / Kimi Linear are compared; the target is within +-25 %.

- Decode (Fig. 7b, batch 1): the pure roofline, no fitted constant, TP1 (``DECODE_SETUP``).
- Prefill (Fig. 7a, batch 1): the pure roofline overshoots at 512K (3.5x vs 2.3x on one GPU), because
  it runs everything but attention at peak; the measured MLA curve says otherwise. One named fit,
  ``PrefillFit``: two time scales, alpha for the attention layers' kind ("mla") and beta for every
  other kind, solved from the two MLA points at 512K and 1M only; Kimi Linear's curve is then
  predicted, not fitted. On H100 TP8 the fit gives alpha ~ 1.47 (attention at ~68 % of peak, in line
  with FlashAttention-3's reported 75 % of H100 bf16 peak, Shah et al. 2024) and beta ~ 5.9 (the
  rest at ~17 % of peak). With fewer than 8 H100s alpha < 1, i.e. faster than peak: the published
  times need at least 8 GPUs, which is why TP8 is the assumed setup.
- Fig. 1b (larger batches, "theoretical") is not reproduced: its 4.8-6.3x exceed what any
  bytes-based model at equal batch gives (the KV ratio, 27 / 7 = 3.86x, bounds it); the batch sizes
  behind it are not stated.
"""
from __future__ import annotations

from typing import NamedTuple

from serve.scale.hardware import Hardware
from serve.scale.hardware import hardware as hardware_preset
from serve.scale.model_shape import ModelShape, preset
from serve.scale.published import CONTEXTS, PREFILL_FIG7A, TPOT_FIG7B, PublishedCurve
from serve.scale.roofline import decode_time, prefill_time

RATIO_TOLERANCE = 0.25  # +-25 % on MLA / Kimi Linear
DECODE_SETUP = ("H100", 1)  # (hardware, tp): batch 1 on one GPU
PREFILL_SETUP = ("H100", 8)
FIT_CONTEXTS = (512 * 1024, 1024 * 1024)  # the MLA points the prefill fit uses


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


class PrefillFit(NamedTuple):
    """Time scales fitted on the published MLA prefill points: roofline attention-kind time x alpha,
    every other kind x beta (dimensionless; 1 = at peak)."""

    alpha: float
    beta: float


def _shapes() -> tuple[ModelShape, ModelShape]:
    kl = preset("kimi-linear-48b-a3b")
    return kl, kl.all_mla()


def _split_prefill(shape: ModelShape, hw: Hardware, tp: int, context: int) -> tuple[float, float]:
    step = prefill_time(shape, hw, tp, context)
    attn = step.kind("mla").time_s
    return attn, step.total_s - attn


def fit_prefill(hw: Hardware | None = None, tp: int | None = None) -> PrefillFit:
    """Solve alpha, beta from Fig. 7a's MLA latencies at ``FIT_CONTEXTS`` (2 equations, 2 unknowns)."""
    hw = hw or hardware_preset(PREFILL_SETUP[0])
    tp = tp or PREFILL_SETUP[1]
    _, mla = _shapes()
    (a1, l1), (a2, l2) = (_split_prefill(mla, hw, tp, c) for c in FIT_CONTEXTS)
    y1, y2 = (PREFILL_FIG7A.mla[CONTEXTS.index(c)] for c in FIT_CONTEXTS)
    det = a1 * l2 - a2 * l1
    return PrefillFit(alpha=(y1 * l2 - y2 * l1) / det, beta=(a1 * y2 - a2 * y1) / det)


def fitted_prefill_s(shape: ModelShape, hw: Hardware, tp: int, fit: PrefillFit, new_tokens: int,
                     cached_tokens: int = 0) -> float:
    """Seconds: roofline prefill of ``new_tokens`` after ``cached_tokens`` (:func:`prefill_time`) with the
    attention kind ("mla") x ``fit.alpha`` and every other kind x ``fit.beta``."""
    step = prefill_time(shape, hw, tp, new_tokens, cached_tokens)
    attn = step.kind("mla").time_s if shape.num_mla_layers else 0.0
    return fit.alpha * attn + fit.beta * (step.total_s - attn)


def prefill_ratios(fit: PrefillFit | None = None, hw: Hardware | None = None, tp: int | None = None,
                   contexts: tuple[int, ...] = CONTEXTS) -> list[RatioRow]:
    """Prefill MLA / Kimi Linear at each context; ``fit`` None = ``fit_prefill()``, or pass
    ``PrefillFit(1, 1)`` for the pure roofline."""
    hw = hw or hardware_preset(PREFILL_SETUP[0])
    tp = tp or PREFILL_SETUP[1]
    fit = fit or fit_prefill(hw, tp)
    kl, mla = _shapes()
    return [RatioRow(PREFILL_FIG7A.figure, c, PREFILL_FIG7A.ratio(c),
                     fitted_prefill_s(mla, hw, tp, fit, c) / fitted_prefill_s(kl, hw, tp, fit, c)) for c in contexts]


def decode_ratios(curve: PublishedCurve = TPOT_FIG7B, hw: Hardware | None = None, tp: int | None = None,
                  contexts: tuple[int, ...] = CONTEXTS) -> list[RatioRow]:
    """Pure-roofline TPOT MLA / Kimi Linear at batch 1 against ``curve``'s plotted ratios."""
    hw = hw or hardware_preset(DECODE_SETUP[0])
    tp = tp or DECODE_SETUP[1]
    kl, mla = _shapes()
    return [RatioRow(curve.figure, c, curve.ratio(c),
                     decode_time(mla, hw, tp, 1, c).total_s / decode_time(kl, hw, tp, 1, c).total_s)
            for c in contexts]
