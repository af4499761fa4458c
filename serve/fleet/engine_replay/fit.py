"""The simulator's step-time terms fitted to the CPU time of logged engine steps (calibration replays only).

Each :class:`serve.fleet.engine_replay.driver.StepRecord` is one row of a least-squares problem whose columns are
the :class:`serve.fleet.sim.service_model.ServiceModel` terms, so the fitted model predicts a step exactly as the
simulation computes it (:func:`predicted_step_ms` calls the model's own ``mixed_step_ms`` / ``prefill_batch_ms`` /
``decode_step_ms``):

====================================  ==================================  ==========================================
column (per step)                     ServiceModel field                  what it stands for
====================================  ==================================  ==========================================
1 if the step has prefill rows        ``prefill_overhead_ms``             fixed cost of a step with prompts
1 if decode rows only                 ``decode_step_base_ms``             fixed cost of a decode-only step
new prompt tokens                     1000 / ``prefill_tokens_per_s``     per-token forward (projections, MoE, KDA)
prompts                               ``prefill_per_row_ms``              admission, checkpoint restore, per-row work
attention pairs of the prompts        ``prefill_per_token_pair_ms``       MLA prefill's quadratic part
new tokens after an off-grid hit      ``prefill_off_grid_per_token_ms``   KDA chunks off the 64-token grid
decode rows padded to a bucket        ``decode_step_per_seq_ms``          per decode row (pad rows included)
decode rows x their context           ``decode_per_context_token_ms``     MLA decode reading the cache
checkpoints the prompts publish       ``prefill_per_checkpoint_ms``       checkpoint publish (state copy)
rows that emit a token                ``per_output_row_ms``               sampling, append, a slot's state write
====================================  ==================================  ==========================================
Coefficients are non-negative (an active-set least squares: a column whose coefficient comes out negative is
dropped and the rest refitted).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from serve.engine.model_runner import DECODE_BUCKETS
from serve.fleet.sim.service_model import ServiceModel, attention_pairs

TERMS = ("prefill_overhead_ms", "decode_step_base_ms", "ms_per_prefill_token", "prefill_per_row_ms",
         "prefill_per_token_pair_ms", "prefill_off_grid_per_token_ms", "decode_step_per_seq_ms",
         "decode_per_context_token_ms", "prefill_per_checkpoint_ms", "per_output_row_ms")
GRID_TOKENS = 64                  # the KDA chunk grid = the engine's checkpoint interval
PASSES = 1


def _padded(rows: int) -> int:
    return min((b for b in DECODE_BUCKETS if b >= rows), default=rows) if rows else 0


def checkpoints(new: int, cached: int, interval: int = GRID_TOKENS) -> int:
    """Checkpoint intervals a prefill of ``new`` tokens after ``cached`` crosses (the state copies it publishes)."""
    return (cached + new) // interval - cached // interval


def features(prefill: Sequence[tuple[int, int]], decode_rows: int, decode_context: int,
             terms: Sequence[str] = TERMS) -> np.ndarray:
    """One step's row of the fit: the columns of ``terms`` (module table) for prompts ``prefill``
    ``((new, cached), ...)`` and ``decode_rows`` rows of ``decode_context`` tokens in cache, summed."""
    col = dict(prefill_overhead_ms=float(bool(prefill)), decode_step_base_ms=float(not prefill),
               ms_per_prefill_token=sum(n for n, _ in prefill), prefill_per_row_ms=len(prefill),
               prefill_per_token_pair_ms=sum(attention_pairs(n, c) for n, c in prefill),
               prefill_off_grid_per_token_ms=sum(n for n, c in prefill if c % GRID_TOKENS),
               decode_step_per_seq_ms=_padded(decode_rows), decode_per_context_token_ms=decode_context,
               prefill_per_checkpoint_ms=sum(checkpoints(n, c) for n, c in prefill),
               per_output_row_ms=decode_rows + len(prefill))
    return np.array([col[t] for t in terms], dtype=float)


def fit_terms(steps, terms: Sequence[str] = TERMS) -> dict[str, float]:
    """Non-negative least squares of the steps' ``cpu_ms`` on :func:`features` (module docstring); terms left
    out (or dropped) are 0. Raises ValueError with fewer steps than terms."""
    if len(steps) < len(terms):
        raise ValueError(f"fit_terms needs >= {len(terms)} steps, got {len(steps)}")
    a = np.stack([features(s.prefill, s.decode_rows, s.decode_context, terms) for s in steps])
    y = np.array([s.cpu_ms for s in steps])
    rows = np.ones(len(y), dtype=bool)
    for _ in range(PASSES):                  # refit without the outliers (> 3 scaled MADs: a descheduled step)
        keep = [j for j in range(len(terms)) if a[rows, j].any()]
        while True:
            coef, *_ = np.linalg.lstsq(a[rows][:, keep], y[rows], rcond=None)
            if (coef >= 0).all():
                break
            keep = [j for j, c in zip(keep, coef) if c >= 0]
        resid = y - a[:, keep] @ coef
        mad = np.median(np.abs(resid - np.median(resid))) * 1.4826
        rows = np.abs(resid) <= max(3 * mad, 1e-6)
    out = dict.fromkeys(TERMS, 0.0)
    out.update({terms[j]: float(c) for j, c in zip(keep, coef)})
    return out


def service_model(terms: dict[str, float], num_state_slots: int, source: str) -> ServiceModel:
    """The simulator's :class:`ServiceModel` of fitted ``terms``: mixed steps, the engine's decode buckets,
    ``num_state_slots`` running requests at most, no KV limit (the replay's pool never fills)."""
    return ServiceModel(prefill_tokens_per_s=1000.0 / max(terms["ms_per_prefill_token"], 1e-9),
                        decode_step_base_ms=max(terms["decode_step_base_ms"], 1e-3),
                        decode_step_per_seq_ms=terms["decode_step_per_seq_ms"],
                        prefill_overhead_ms=terms["prefill_overhead_ms"], max_batch_requests=num_state_slots,
                        mixed_steps=True, decode_per_context_token_ms=terms["decode_per_context_token_ms"],
                        decode_buckets=DECODE_BUCKETS, prefill_per_token_pair_ms=terms["prefill_per_token_pair_ms"],
                        prefill_per_row_ms=terms["prefill_per_row_ms"],
                        prefill_off_grid_per_token_ms=terms["prefill_off_grid_per_token_ms"],
                        prefill_grid_tokens=GRID_TOKENS, prefill_per_checkpoint_ms=terms["prefill_per_checkpoint_ms"],
                        checkpoint_interval_tokens=GRID_TOKENS, per_output_row_ms=terms["per_output_row_ms"],
                        source=source)


def predicted_step_ms(svc: ServiceModel, prefill, decode_rows: int, decode_context: int) -> float:
    """The step as the simulation times it: ``mixed_step_ms`` with prompts and decode rows, ``prefill_batch_ms``
    with prompts only, ``decode_step_ms`` with decode rows only (mean context per row)."""
    ctx = decode_context // decode_rows if decode_rows else 0
    if prefill and decode_rows:
        return svc.mixed_step_ms(prefill, decode_rows, ctx)
    if prefill:
        return svc.prefill_batch_ms(prefill)
    return svc.decode_step_ms(decode_rows, ctx)


def step_errors_pct(svc: ServiceModel, steps) -> np.ndarray:
    """|predicted − measured CPU ms| / measured × 100 per step (the held-out check of the terms)."""
    return np.array([abs(predicted_step_ms(svc, s.prefill, s.decode_rows, s.decode_context) / s.cpu_ms - 1) * 100
                     for s in steps])


def wall_per_cpu(steps) -> float:
    """Wall ms the clock moved per CPU ms of the engine's work, over a wall-clock replay's back-to-back boundaries
    (a step with requests still in flight, to the next step's start: its own wall time plus the driver's
    bookkeeping between steps, both slowed by the other jobs on the cores). Raises ValueError with no such step."""
    pairs = [(b.start_ms - a.start_ms, a.cpu_ms) for a, b in zip(steps, steps[1:]) if a.in_flight > 0]
    if not pairs:
        raise ValueError("wall_per_cpu needs back-to-back steps of a wall-clock replay")
    return sum(p for p, _ in pairs) / sum(c for _, c in pairs)


def scaled_terms(terms: dict[str, float], factor: float) -> dict[str, float]:
    """Every term (all in ms) times ``factor``: the CPU-time terms as the wall clock sees them."""
    return {t: v * factor for t, v in terms.items()}
