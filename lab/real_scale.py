"""Page 15 in two calls, one per view: the roofline of a real Kimi model against the Kimi Linear tech
report's curves (:func:`roofline_view`), and the production prefix-cache policies replayed on a trace at
that model's real bytes (:func:`policy_view`).

Roofline (:mod:`serve.scale.roofline`): the chosen model and its all-MLA counterfactual
(:meth:`serve.scale.model_shape.ModelShape.all_mla`) at the report's contexts, 4K to 1M tokens, batch 1.
Three kinds of number, kept apart: the physical roofline (no constant), the fitted prefill and the
published points. The prefill fit has one meaning, the one every service time uses
(:func:`serve.scale.validation.fit_prefill`: attention-kind time x alpha, every other kind x beta, fitted
once at the report's assumed setup :data:`~serve.scale.validation.FIT_SETUP`, H100 x TP8, on Fig. 7a's
Kimi Linear points only, the MLA points held out). The view checks that fit at its own setup against the
published seconds (``prefill_points``: fitted-on vs held-out); on any other setup the fitted curves are
predictions with the same alpha, beta, nothing refitted (``predicted_only``). TPOT is the physical
roofline. The ratio errors are at the setup the caller chose. The fit comes from Kimi-Linear-48B-A3B's
points; for Kimi K3 the same alpha, beta are reused, unchecked (no K3 point is published), and the view
says so (``fit_note``). The largest-batch decode
(:mod:`serve.scale.capacity`) sets the report's Fig. 1b / "up to 6x decoding throughput" beside the roofline.

Policies (:mod:`serve.scale.policies`): each policy replays the trace under a memory budget per replica
(KV pages + state checkpoints + the running request's state slots, in the model's real bytes on ``tp``
ranks). Default budgets are fractions of what the replica's HBM leaves after the weights
(:func:`weight_bytes`). TTFT of a request = fitted roofline prefill of its uncached tokens after its hit
(:func:`serve.scale.roofline.prefill_time` with ``cached_tokens`` = hit) + the checkpoint restore
(:func:`serve.scale.roofline.checkpoint_restore_time`) when it hits; batch 1, no queueing.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Real

import numpy as np
import pandas as pd

from kda_core.config import REAL_PRESETS
from kda_core.config import preset_title as preset_title  # re-exported: pages 14 and 15's model labels
from lab.fleet import page_trace
from serve.errors import check_int
from serve.fleet.real_replica import TP_SIZES, RealReplica, free_bytes  # noqa: F401  (re-exported for the pages)
from serve.scale.capacity import MEMORY_FRACTION as MEMORY_FRACTION  # re-exported: page 15's caption
from serve.scale.capacity import largest_batch_decode
from serve.scale.capacity import weight_bytes as weight_bytes  # re-exported: the policy view and lab.fleet use it
from serve.scale.hardware import GPUS, Hardware, hardware
from serve.scale.model_shape import ModelShape, preset
from serve.scale.policies import (
    CACHE_POLICIES,
    EXTRA_BUFFER_CHUNK,
    EXTRA_CACHE_POLICIES,
    OURS_C,
    PolicyResult,
    make_policy,
    replay,
    vllm_block_size,
)
from serve.scale.published import CONTEXTS, PREFILL_FIG7A, TPOT_FIG1B, TPOT_FIG7B
from serve.scale.roofline import MAX_TOKENS, checkpoint_restore_time, prefill_time
from serve.scale.roofline import decode_time as roofline_decode
from serve.scale.validation import (
    FIT_MODEL,
    FIT_SETUP,
    PrefillFit,
    decode_ratios,
    fit_prefill,
    fit_setup_title,
    fitted_prefill_s,
    prefill_points,
    prefill_ratios,
)
from serve.traces.mooncake import TraceRequest

MODELS = REAL_PRESETS
HARDWARE = tuple(GPUS)
# The default sweep: what the engines serve Kimi models with ("vllm all" stays an opt-in counterfactual).
DEFAULT_POLICIES = ("ours", "sglang no_buffer", "sglang extra_buffer", "vllm align")
POLICY_TITLES = {"ours": "ours", "sglang no_buffer": "SGLang no_buffer", "sglang extra_buffer": "SGLang extra_buffer",
                 "vllm align": "vLLM align", "vllm all": "vLLM all (counterfactual: not served for Kimi)",
                 "vllm none": "vLLM none", "vllm align +replay stop": "vLLM align + replay stop"}


def policy_title(name: str) -> str:
    """A prefix-cache policy as its engine spells it ("SGLang no_buffer", "vLLM align"); any other text is returned
    as is (a widget's format_func may be applied to a label again)."""
    return POLICY_TITLES.get(name, name)
BUDGET_FRACTIONS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)   # of the HBM left after weights
INTERVALS = (512, 1024, 2048, 4096, 8192)      # ours' C and extra_buffer's chunked_prefill_size (tokens)
INTERVAL_BUDGET_FRACTION = 1 / 8               # the budget the interval sweep runs at
DEFAULT_INTERVAL = {"ours": OURS_C, "sglang extra_buffer": EXTRA_BUFFER_CHUNK}


REPORT_THROUGHPUT_CLAIM = 6.0  # the report's abstract: "up to 6x decoding throughput" at 1M
PREFILL_Q, TPOT_Q, BATCH_Q = ("prefill (Fig. 7a)", "TPOT, batch 1 (Fig. 7b)",
                              "time per token, largest batch (Fig. 1b)")


@dataclass(frozen=True)
class ThroughputCompare:
    """Kimi-Linear-48B-A3B's roofline throughput over its all-MLA counterfactual's, each at the largest batch its
    memory holds, beside the report's Fig. 1b ratio. ``context_tokens``: the largest report context at which both
    models hold at least one sequence (None when there is none), where ``model`` (roofline ratio) and ``published``
    are taken (both NaN when None). ``largest_context``: the report's largest context (1M tokens). ``unfit``: the
    models ("Kimi Linear", "all MLA") that cannot hold one sequence of ``largest_context`` tokens on this setup."""

    context_tokens: int | None
    model: float
    published: float
    largest_context: int
    unfit: tuple[str, ...]


@dataclass(frozen=True)
class RooflineView:
    """The roofline view. Every frame but ``prefill_points`` is computed on the chosen hardware and TP (``setup``,
    e.g. "H200 x TP8"); ``prefill_points`` is at ``fit_setup`` ("H100 x TP8"), the one setup the fit was made on.

    curves: one row per (model, context) of the chosen model and its all-MLA counterfactual:
    ``context_tokens``, ``model``, ``prefill_roofline_s`` (physical roofline), ``prefill_s`` (the fit's alpha, beta
    on this setup: a prediction, not refitted, unless ``setup`` is ``fit_setup``), ``tpot_ms`` (batch 1, physical
    roofline). predicted_only: True when ``curves``' fitted prefill is a prediction only (another setup than
    ``fit_setup``, or another model than the published one), with no published point of its own to check. published: the report's points of Kimi-Linear-48B-A3B
    (``context_tokens``, ``model``, ``prefill_s`` Fig. 7a, ``tpot_ms`` Fig. 7b, ``time_per_token_ms`` Fig. 1b). ratios: the chosen model's MLA / Kimi Linear per
    context and quantity against the report's (``published``, ``model``, ``rel_error`` = model / published - 1).
    prefill_points: every Fig. 7a point of Kimi-Linear-48B-A3B against the fitted roofline at ``fit_setup``
    (``curve``, ``context``, ``published``, ``model``, ``role`` "fitted on" (Kimi Linear's) or "held out" (all
    MLA's), ``rel_error``, ``setup``). validated: Kimi-Linear-48B-A3B's ratios at ``setup``, one row per
    (quantity, context), ``role`` "held out" (prefill at ``fit_setup``: the MLA numerator is not fitted) or
    "predicted" (prefill on any other setup; TPOT and Fig. 1b: no constant). errors: max |rel_error| per group (``group``, ``max_abs_error``, ``points``). batch: the chosen
    model and its all-MLA counterfactual at the largest batch each fits after the weights
    (:mod:`serve.scale.capacity`): ``context_tokens``, ``model``, ``batch``, ``tpot_ms``, ``time_per_token_ms``,
    ``throughput_tok_s``. throughput: :class:`ThroughputCompare` (never a NaN ratio at a context where a model
    holds no sequence). fit: the one prefill fit (:func:`serve.scale.validation.fit_prefill`, at ``fit_setup``
    whatever ``setup`` is). fit_caveat: "" when alpha and beta are both >= 1, else what a scale below 1 means (the
    fitted curve is faster than the physical roofline, a lower bound on time). fit_note: where the fit comes from
    and whether ``curves`` are predictions only (says so when the chosen model is not the one the points were
    measured on). weights_gb / hbm_gb / free_gb: per replica
    (1e9 bytes)."""

    setup: str
    curves: pd.DataFrame
    published: pd.DataFrame
    ratios: pd.DataFrame
    prefill_points: pd.DataFrame
    validated: pd.DataFrame
    errors: pd.DataFrame
    batch: pd.DataFrame
    fit: PrefillFit
    fit_setup: str
    predicted_only: bool
    fit_note: str
    weights_gb: float
    hbm_gb: float
    free_gb: float
    throughput: ThroughputCompare | None = None
    fit_caveat: str = ""


def _check_contexts(contexts) -> tuple[int, ...]:
    if isinstance(contexts, (str, bytes)) or not isinstance(contexts, Sequence) or not contexts:
        raise ValueError(f"contexts must be a non-empty list of token counts, got {contexts!r}")
    for c in contexts:
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_TOKENS:
            raise ValueError(f"contexts must hold ints in [1, {MAX_TOKENS}], got {c!r} in {list(contexts)!r}")
    return tuple(sorted(set(contexts)))


def _ratio_rows(wide: pd.DataFrame, contexts: Sequence[int]) -> list[dict]:
    rows = []
    for quantity, col, curve in ((PREFILL_Q, "prefill_s", PREFILL_FIG7A), (TPOT_Q, "tpot_ms", TPOT_FIG7B)):
        for c in contexts:
            if c in CONTEXTS:
                m = wide.loc[c, (col, "all MLA")] / wide.loc[c, (col, "Kimi Linear")]
                rows.append({"context_tokens": c, "quantity": quantity, "published": curve.ratio(c), "model": m,
                             "rel_error": m / curve.ratio(c) - 1})
    return rows


def _batch_rows(shapes: dict[str, ModelShape], hw: Hardware, tp: int, contexts: Sequence[int]) -> pd.DataFrame:
    rows = []
    for name, s in shapes.items():
        for c in contexts:
            d = largest_batch_decode(s, hw, tp, c)
            rows.append({"context_tokens": c, "model": name, "batch": d.batch, "tpot_ms": 1e3 * d.tpot_s,
                         "time_per_token_ms": 1e3 * d.time_per_token_s, "throughput_tok_s": d.throughput_tok_s})
    return pd.DataFrame(rows)


def _validated(hw: Hardware, tp: int, setup: str, fit: PrefillFit, at_fit_setup: bool) -> pd.DataFrame:
    """Kimi-Linear-48B-A3B (the published model) at this setup: prefill and TPOT ratios, and Fig. 1b's. The prefill
    ratio's MLA numerator is held out where the fit was made, a prediction (the fit carried) anywhere else."""
    role = "held out" if at_fit_setup else "predicted"
    rows = [{"context_tokens": r.context, "quantity": PREFILL_Q, "role": role, "published": r.published,
             "model": r.model, "rel_error": r.rel_error} for r in prefill_ratios(fit, hw, tp)]
    rows += [{"context_tokens": r.context, "quantity": TPOT_Q, "role": "predicted", "published": r.published,
              "model": r.model, "rel_error": r.rel_error} for r in decode_ratios(hw=hw, tp=tp)]
    kl = preset(FIT_MODEL)
    wide = _batch_rows({"Kimi Linear": kl, "all MLA": kl.all_mla()}, hw, tp, CONTEXTS).pivot(
        index="context_tokens", columns="model", values="time_per_token_ms")
    for c in CONTEXTS:
        m = wide.loc[c, "all MLA"] / wide.loc[c, "Kimi Linear"]   # NaN where all MLA fits no sequence
        rows.append({"context_tokens": c, "quantity": BATCH_Q, "role": "predicted", "published": TPOT_FIG1B.ratio(c),
                     "model": m, "rel_error": m / TPOT_FIG1B.ratio(c) - 1})
    return pd.DataFrame(rows).assign(setup=setup)


def _throughput(hw: Hardware, tp: int) -> ThroughputCompare:
    """Fig. 1b's comparison at the largest report context where both models hold one sequence."""
    kl = preset(FIT_MODEL)
    last = max(CONTEXTS)
    unfit = tuple(name for name, s in (("Kimi Linear", kl), ("all MLA", kl.all_mla()))
                  if largest_batch_decode(s, hw, tp, last).batch == 0)
    for c in sorted(CONTEXTS, reverse=True):
        if all(largest_batch_decode(s, hw, tp, c).batch > 0 for s in (kl, kl.all_mla())):
            a, m = (largest_batch_decode(s, hw, tp, c).time_per_token_s for s in (kl, kl.all_mla()))
            return ThroughputCompare(c, m / a, TPOT_FIG1B.ratio(c), last, unfit)
    return ThroughputCompare(None, math.nan, math.nan, last, unfit)


def _fit_caveat(fit: PrefillFit, setup: str) -> str:
    """What a fitted scale below 1 means: the curve runs faster than the physical roofline (a lower bound)."""
    low = [f"{name} = {v:.2f}" for name, v in (("α (attention)", fit.alpha), ("β (every other kind)", fit.beta))
           if v < 1]
    if not low:
        return ""
    return (f"Fitted {' and '.join(low)} < 1 on {setup}: the fitted prefill is faster than the physical roofline, "
            "which runs every layer at peak FLOPs or bandwidth and so is a lower bound on time. The published "
            "points are faster than this roofline's assumptions (the report's GPU count, parallelism and kernels "
            "are not stated), and the fit absorbs what the roofline leaves out; read the fitted curve as a fit to "
            "the report's points, not as a physically attainable time.")


def _errors(points: pd.DataFrame, validated: pd.DataFrame) -> pd.DataFrame:
    groups = [("prefill points the fit saw (Kimi Linear)", points[points.role == "fitted on"].rel_error),
              ("prefill points held out (all MLA)", points[points.role == "held out"].rel_error)]
    groups += [(f"{q} ratio", validated[validated.quantity == q].rel_error.dropna()) for q in (PREFILL_Q, TPOT_Q,
                                                                                               BATCH_Q)]
    return pd.DataFrame([{"group": g, "max_abs_error": float(e.abs().max()) if len(e) else float("nan"),
                          "points": len(e)} for g, e in groups])


def roofline_view(replica: RealReplica, contexts: Sequence[int] = CONTEXTS) -> RooflineView:
    """Prefill latency and TPOT of ``replica``'s model and its all-MLA counterfactual on its ``tp`` x ``gpu``
    (module docstring), Kimi-Linear-48B-A3B's ratio errors against the report at that same setup, and the one
    prefill fit against the report's seconds at the setup it was made on (a replica's weights fit by
    construction: a roofline of a model that cannot be loaded means nothing).

    Raises ValueError naming bad ``contexts`` (a non-empty list of ints in [1, MAX_TOKENS])."""
    model, hw_name, tp, hw = replica.model, replica.gpu, replica.tp, hardware(replica.gpu)
    contexts = _check_contexts(contexts)
    kl = preset(model)
    w = weight_bytes(kl)
    setup = f"{hw_name} x TP{tp}"
    shapes = {"Kimi Linear": kl, "all MLA": kl.all_mla()}
    fit, fit_setup = fit_prefill(), fit_setup_title()     # one fit, at the report's setup, whatever the replica
    at_fit_setup = (hw_name, tp) == FIT_SETUP
    rows = [{"context_tokens": c, "model": name,
             "prefill_roofline_s": prefill_time(s, hw, tp, c).total_s,
             "prefill_s": fitted_prefill_s(s, hw, tp, fit, c),
             "tpot_ms": 1e3 * roofline_decode(s, hw, tp, 1, c).total_s}
            for name, s in shapes.items() for c in contexts]
    curves = pd.DataFrame(rows)
    published = pd.DataFrame([{"context_tokens": c, "model": name, "prefill_s": getattr(PREFILL_FIG7A, attr)[i],
                               "tpot_ms": getattr(TPOT_FIG7B, attr)[i],
                               "time_per_token_ms": getattr(TPOT_FIG1B, attr)[i]}
                              for name, attr in (("Kimi Linear", "kimi_linear"), ("all MLA", "mla"))
                              for i, c in enumerate(CONTEXTS)])
    ratios = pd.DataFrame(_ratio_rows(curves.pivot(index="context_tokens", columns="model"), contexts),
                          columns=["context_tokens", "quantity", "published", "model", "rel_error"])
    points = pd.DataFrame([r._asdict() | {"rel_error": r.rel_error, "setup": fit_setup} for r in prefill_points(fit)])
    validated = _validated(hw, tp, setup, fit, at_fit_setup)
    fit_note = (f"α, β fitted once, on {fit_setup} (the setup assumed for the report, which states none), on the "
                "nine published Kimi Linear prefill points (Fig. 7a); the nine all-MLA points are held out.")
    if not at_fit_setup:
        fit_note += (f" On {setup} the fitted curves are predictions: the same α, β carried to this GPU and TP, "
                     "nothing refitted, and no published point measured there to check them against.")
    if model != FIT_MODEL:
        fit_note += (f" {preset_title(model)} has no published points: its fitted curve reuses the α, β fitted to "
                     f"{preset_title(FIT_MODEL)}'s points, unchecked; read its physical roofline as the model.")
    return RooflineView(setup=setup, curves=curves, published=published, ratios=ratios, prefill_points=points,
                        validated=validated, errors=_errors(points, validated),
                        batch=_batch_rows(shapes, hw, tp, contexts), fit=fit, fit_setup=fit_setup,
                        predicted_only=not at_fit_setup or model != FIT_MODEL, fit_note=fit_note, weights_gb=w / 1e9,
                        hbm_gb=hw.hbm_bytes * tp / 1e9, free_gb=(hw.hbm_bytes * tp - w) / 1e9,
                        throughput=_throughput(hw, tp), fit_caveat=_fit_caveat(fit, fit_setup))


@dataclass(frozen=True)
class PolicyView:
    """The policy view. budgets: one row per (policy, budget), intervals: one per (policy, interval) at
    ``interval_budget_gb``; columns ``policy``, ``budget_gb``, ``interval_tokens``, ``token_hit_ratio``,
    ``mean_ttft_s``, ``p99_ttft_s``, ``prefill_saved`` (fraction of the cache-off prefill time), ``kv_gb``, ``state_gb``,
    ``running_gb`` (held by kind at the moment the total held peaked: they add up to at most ``budget_gb``),
    ``peak_kv_gb``, ``peak_state_gb`` (each kind's own peak, reached at different times), ``states_written``,
    ``states_evicted``, ``kv_evicted_tokens``, ``replay_s``. ideal_hit_ratio: the block ideal (unlimited cache). cold_ttft_s: mean TTFT with no
    cache. free_gb / weights_gb: per replica. vllm_block_tokens: vLLM's block for this model and TP.
    num_requests / total_tokens: the trace; note: what a budget cut from an upload ("" if nothing).
    choice: what to pick, one row per budget (``budget_gb``, ``policy`` with the lowest mean TTFT there,
    its ``mean_ttft_s`` and ``token_hit_ratio``) and one per interval-swept policy (``budget_gb`` = the
    interval budget, ``interval_tokens`` with the lowest mean TTFT, ``mean_ttft_s``, ``token_hit_ratio``)."""

    budgets: pd.DataFrame
    intervals: pd.DataFrame
    ideal_hit_ratio: float
    cold_ttft_s: float
    free_gb: float
    weights_gb: float
    interval_budget_gb: float
    vllm_block_tokens: int
    num_requests: int
    total_tokens: int
    note: str
    choice: pd.DataFrame | None = None


class _TTFT:
    """Per-request fitted roofline TTFT for a trace, memoised on (new, cached) tokens. A request with no token
    left to prefill (``input_length`` 0, which the Mooncake format allows) still runs one prefill step for its
    first decode input, as the fleet simulator's replicas charge it (``max(1, input_length - hit)``,
    :mod:`serve.fleet.sim.replica`)."""

    def __init__(self, shape: ModelShape, hw: Hardware, tp: int, requests: Sequence[TraceRequest]):
        # factors fitted once at the report's assumed setup and carried to ``hw`` (as the fleet's RooflineService):
        # a fit on the chosen GPU would force every GPU to the report's seconds
        self.shape, self.hw, self.tp, self.fit = shape, hw, tp, fit_prefill()
        self.restore_s = checkpoint_restore_time(shape, hw, tp)
        self.lengths = np.array([r.input_length for r in requests], dtype=np.int64)
        self.memo: dict[tuple[int, int], float] = {}
        self.cold = np.array([self.prefill(max(1, int(L)), 0) for L in self.lengths])

    def prefill(self, new: int, cached: int) -> float:
        key = (new, cached)
        if key not in self.memo:
            self.memo[key] = fitted_prefill_s(self.shape, self.hw, self.tp, self.fit, new, cached)
        return self.memo[key]

    def per_request(self, hits: np.ndarray) -> np.ndarray:
        out = self.cold.copy()
        for i in np.flatnonzero(hits):
            h = int(hits[i])
            out[i] = self.prefill(max(1, int(self.lengths[i]) - h), h) + self.restore_s
        return out


def _saved(ttft_s: np.ndarray, cold_s: np.ndarray) -> float:
    """Fraction of the cache-off prefill time saved; 0.0 when there was none (every prompt empty)."""
    cold = float(cold_s.sum())
    return 1 - float(ttft_s.sum()) / cold if cold else 0.0


def _row(res: PolicyResult, ttft: _TTFT, **extra) -> dict:
    t = ttft.per_request(res.request_hit_tokens)
    return {"policy": extra.pop("policy"), **extra, "token_hit_ratio": res.token_hit_ratio,
            "mean_ttft_s": float(t.mean()), "p99_ttft_s": float(np.percentile(t, 99)), "prefill_saved": _saved(t, ttft.cold),
            "kv_gb": res.held_at_peak["kv"] / 1e9, "state_gb": res.held_at_peak["state"] / 1e9,
            "running_gb": res.held_at_peak["running"] / 1e9, "peak_kv_gb": res.peak_bytes["kv"] / 1e9,
            "peak_state_gb": res.peak_bytes["state"] / 1e9, "states_written": res.states_written,
            "states_evicted": res.states_evicted, "kv_evicted_tokens": res.kv_evicted_tokens,
            "replay_s": res.seconds}


def policy_view(replica: RealReplica, num_requests: int, upload: bytes | None = None,
                upload_name: str = "uploaded file", policies: Sequence[str] = DEFAULT_POLICIES,
                budgets_gb: Sequence[float] | None = None, intervals: Sequence[int] = INTERVALS,
                progress: Callable[[int, int], None] | None = None, seed: int = 0,
                requests: Sequence[TraceRequest] | None = None) -> PolicyView:
    """Replay the page's trace (:func:`lab.fleet.page_trace`: synthetic, or the uploaded Mooncake JSONL)
    through each of ``policies`` at each budget (GB per replica; None = :data:`BUDGET_FRACTIONS` of
    :func:`free_bytes`), then ours and extra_buffer at each of ``intervals`` at the
    :data:`INTERVAL_BUDGET_FRACTION` budget. ``progress(done, total)`` after each replay. ``requests``: a
    trace already loaded (the bench's whole Mooncake trace), used instead of ``upload`` / ``num_requests``.

    ``replica``: the model on its ``tp`` x ``gpu`` (its own policy and budget are what this view sweeps).

    Raises ValueError for no policy or an unknown one, a non-positive budget, an interval that is not an
    int >= 1; TraceFormatError (ValueError) for a malformed upload."""
    model, tp, hw = replica.model, replica.tp, hardware(replica.gpu)
    if isinstance(policies, str) or not len(policies):
        raise ValueError(f"policies must name at least one of {CACHE_POLICIES + EXTRA_CACHE_POLICIES}, got {policies!r}")
    for p in policies:
        if p not in CACHE_POLICIES + EXTRA_CACHE_POLICIES:
            raise ValueError(f"policies must be drawn from {CACHE_POLICIES + EXTRA_CACHE_POLICIES}, got {p!r}")
    for c in intervals:
        check_int("intervals", c)
    shape, free = preset(model), replica.free_bytes
    if budgets_gb is None:
        budgets_gb = [free * f / 1e9 for f in BUDGET_FRACTIONS]
    if isinstance(budgets_gb, str) or not len(budgets_gb) or any(
            isinstance(b, bool) or not isinstance(b, Real) or not 0 < b < math.inf for b in budgets_gb):
        raise ValueError(f"budgets_gb must be finite positive numbers, got {list(budgets_gb)!r}")
    interval_budget = free * INTERVAL_BUDGET_FRACTION / 1e9
    note = ""
    if requests is None:
        loaded = page_trace(upload, num_requests, seed=seed, name=upload_name)
        requests, note = loaded.requests, loaded.note
    elif not requests:
        raise ValueError("requests must not be empty")
    ttft = _TTFT(shape, hw, tp, requests)
    swept = [p for p in ("ours", "sglang extra_buffer") if p in policies]
    total, done = len(policies) * len(budgets_gb) + len(swept) * len(intervals), 0
    rows, irows, ideal = [], [], 0.0
    memo: dict[tuple, PolicyResult] = {}   # (policy, interval, budget): the interval sweep meets the budget sweep

    def run(p: str, interval: int | None, budget_gb: float) -> PolicyResult:
        nonlocal done
        key = (p, DEFAULT_INTERVAL.get(p) if interval is None else interval, budget_gb)
        if key not in memo:
            memo[key] = replay(requests, make_policy(p, model, tp, interval), budget_gb * 1e9)
        done += 1
        if progress:
            progress(done, total)
        return memo[key]

    for p in policies:
        for b in budgets_gb:
            res = run(p, None, b)
            ideal = res.ideal_hit_tokens / res.total_tokens if res.total_tokens else 0.0   # only empty prompts
            rows.append(_row(res, ttft, policy=p, budget_gb=b))
    for p in swept:
        for c in intervals:
            res = run(p, c, interval_budget)
            irows.append(_row(res, ttft, policy=p, interval_tokens=c, budget_gb=interval_budget))
    budgets, ivs = pd.DataFrame(rows), pd.DataFrame(irows)
    return PolicyView(budgets=budgets, intervals=ivs, ideal_hit_ratio=ideal, cold_ttft_s=float(ttft.cold.mean()),
                      free_gb=free / 1e9, weights_gb=weight_bytes(shape) / 1e9, interval_budget_gb=interval_budget,
                      vllm_block_tokens=vllm_block_size(model, "align", tp_size=tp), num_requests=len(requests),
                      total_tokens=int(ttft.lengths.sum()), note=note, choice=choose(budgets, ivs))


TIE_TOLERANCE = 0.01   # choose(): policies whose mean TTFT is within 1 % of the best are a tie, not a loss


def choose(budgets: pd.DataFrame, intervals: pd.DataFrame) -> pd.DataFrame:
    """:class:`PolicyView`'s ``choice``: the lowest mean TTFT per budget (over policies) and per interval-swept
    policy (over intervals); ties to the first row. ``tied`` (budget rows): the other policies whose mean TTFT is
    within :data:`TIE_TOLERANCE` (relative) of the best, as ``(policy, mean_ttft_s)`` fastest first, () if none:
    a difference below the roofline's rounding is no winner. ``still_falls`` (interval rows): the best interval is
    the largest swept and the mean TTFT still falls there (a larger interval may be better still)."""
    cols = ["budget_gb", "policy", "interval_tokens", "mean_ttft_s", "token_hit_ratio", "tied", "still_falls"]
    best = budgets.loc[budgets.groupby("budget_gb", sort=True).mean_ttft_s.idxmin()].assign(interval_tokens=np.nan)
    best["tied"] = [tuple((r.policy, r.mean_ttft_s) for r in budgets[
        (budgets.budget_gb == b.budget_gb) & (budgets.index != i)
        & (budgets.mean_ttft_s <= b.mean_ttft_s * (1 + TIE_TOLERANCE))].sort_values("mean_ttft_s").itertuples())
        for i, b in best.iterrows()]
    best["still_falls"] = False
    parts = [best.reindex(columns=cols)]
    if len(intervals):
        iv = intervals.loc[intervals.groupby("policy", sort=False).mean_ttft_s.idxmin()].copy()
        falls = []
        for b in iv.itertuples():
            g = intervals[intervals.policy == b.policy].sort_values("interval_tokens")
            falls.append(bool(len(g) > 1 and b.interval_tokens == g.interval_tokens.iloc[-1]
                              and g.mean_ttft_s.iloc[-1] < g.mean_ttft_s.iloc[-2]))
        parts.append(iv.assign(tied=[()] * len(iv), still_falls=falls).reindex(columns=cols))
    return pd.concat(parts, ignore_index=True)
