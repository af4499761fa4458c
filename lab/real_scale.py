"""Page 15 in two calls, one per view: the roofline of a real Kimi model against the Kimi Linear tech
report's curves (:func:`roofline_view`), and the production prefix-cache policies replayed on a trace at
that model's real bytes (:func:`policy_view`).

Roofline (:mod:`serve.scale.roofline`): the chosen model and its all-MLA counterfactual
(:meth:`serve.scale.model_shape.ModelShape.all_mla`) at the report's contexts, 4K to 1M tokens, batch 1.
Prefill uses the named fit :func:`serve.scale.validation.fit_prefill` solved on the chosen hardware and
TP (attention-kind time x alpha, every other kind x beta, from Fig. 7a's two MLA points at 512K and 1M);
TPOT is the pure roofline. The report states no hardware, so the ratios MLA / Kimi Linear are what is
compared, not the absolute times.

Policies (:mod:`serve.scale.policies`): each policy replays the trace under a memory budget per replica
(KV pages + state checkpoints + the running request's state slots, in the model's real bytes on ``tp``
ranks). Default budgets are fractions of what the replica's HBM leaves after the weights
(:func:`weight_bytes`). TTFT of a request = fitted roofline prefill of its uncached tokens after its hit
(:func:`serve.scale.roofline.prefill_time` with ``cached_tokens`` = hit) + the checkpoint restore
(:func:`serve.scale.roofline.checkpoint_restore_time`) when it hits; batch 1, no queueing.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kda_core.config import REAL_PRESETS
from kda_core.config import preset_title as preset_title  # re-exported: pages 14 and 15's model labels
from lab.fleet import page_trace
from serve.errors import check_choice
from serve.scale.hardware import PRESETS as HARDWARE_PRESETS
from serve.scale.hardware import Hardware, hardware
from serve.scale.model_shape import ModelShape, preset
from serve.scale.policies import (
    OursPolicy,
    PolicyResult,
    ReplicaBytes,
    SGLangExtraBuffer,
    SGLangNoBuffer,
    VLLMMambaPolicy,
    replay,
    vllm_block_size,
)
from serve.scale.published import CONTEXTS, PREFILL_FIG7A, TPOT_FIG7B
from serve.scale.roofline import checkpoint_restore_time, prefill_time
from serve.scale.roofline import decode_time as roofline_decode
from serve.scale.validation import (
    DECODE_SETUP,
    PREFILL_SETUP,
    PrefillFit,
    decode_ratios,
    fit_prefill,
    fitted_prefill_s,
    prefill_ratios,
)
from serve.traces import TraceRequest

MODELS = REAL_PRESETS
HARDWARE = tuple(HARDWARE_PRESETS)
TP_SIZES = (1, 2, 4, 8, 16)
POLICIES = ("ours", "sglang no_buffer", "sglang extra_buffer", "vllm align", "vllm all")   # the default sweep
EXTRA_POLICIES = ("vllm none", "vllm align +replay stop")                                  # opt-in
POLICY_TITLES = {"ours": "ours", "sglang no_buffer": "SGLang no_buffer", "sglang extra_buffer": "SGLang extra_buffer",
                 "vllm align": "vLLM align", "vllm all": "vLLM all", "vllm none": "vLLM none",
                 "vllm align +replay stop": "vLLM align + replay stop"}


def policy_title(name: str) -> str:
    """A prefix-cache policy as its engine spells it ("SGLang no_buffer", "vLLM align"); any other text is returned
    as is (a widget's format_func may be applied to a label again)."""
    return POLICY_TITLES.get(name, name)
BUDGET_FRACTIONS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)   # of the HBM left after weights
INTERVALS = (512, 1024, 2048, 4096, 8192)      # ours' C and extra_buffer's chunked_prefill_size (tokens)
INTERVAL_BUDGET_FRACTION = 1 / 8               # the budget the interval sweep runs at
OURS_C, EXTRA_BUFFER_CHUNK = 2048, 8192        # the knobs' values in the budget sweep
DEFAULT_INTERVAL = {"ours": OURS_C, "sglang extra_buffer": EXTRA_BUFFER_CHUNK}


def weight_bytes(shape: ModelShape) -> float:
    """Weight bytes of the whole model: routed experts at ``routed_expert_weight_bytes`` per parameter
    (K3: MXFP4), everything else at ``weight_bytes`` (bf16)."""
    routed = shape.num_moe_layers * shape.num_experts * shape.expert_params
    return routed * shape.routed_expert_weight_bytes + (shape.total_params - routed) * shape.weight_bytes


def free_bytes(model: str, hw: Hardware, tp: int) -> float:
    """HBM of ``tp`` GPUs minus the model's weights (bytes per replica; <= 0 when the weights do not fit)."""
    return hw.hbm_bytes * tp - weight_bytes(preset(model))


def _check_setup(model: str, hw_name: str, tp: int) -> Hardware:
    check_choice("model", model, MODELS)
    check_choice("tp", tp, TP_SIZES)
    return hardware(hw_name)


@dataclass(frozen=True)
class RooflineView:
    """The roofline view. curves: one row per (model, context): ``context_tokens``, ``model``,
    ``prefill_s`` (fitted), ``prefill_roofline_s`` (pure), ``tpot_ms`` (batch 1, pure). published: the
    report's points (``context_tokens``, ``model``, ``prefill_s``, ``tpot_ms``). ratios: MLA / Kimi Linear
    per context and quantity (``published``, ``model``, ``rel_error`` = model / published - 1) on this
    setup; validated: the same for Kimi-Linear-48B-A3B at the setups the tests pin (``setup`` column:
    :data:`serve.scale.validation.PREFILL_SETUP`, :data:`~serve.scale.validation.DECODE_SETUP`). fit: the
    prefill fit on this hardware and TP. weights_gb / hbm_gb / free_gb: per replica (1e9 bytes)."""

    curves: pd.DataFrame
    published: pd.DataFrame
    ratios: pd.DataFrame
    validated: pd.DataFrame
    fit: PrefillFit
    weights_gb: float
    hbm_gb: float
    free_gb: float


def roofline_view(model: str, hw_name: str, tp: int, contexts: Sequence[int] = CONTEXTS) -> RooflineView:
    """Prefill latency and TPOT of ``model`` and its all-MLA counterfactual on ``tp`` x ``hw_name``
    (module docstring). Raises ValueError naming a bad model, hardware or TP."""
    hw = _check_setup(model, hw_name, tp)
    kl = preset(model)
    shapes = {"Kimi Linear": kl, "all MLA": kl.all_mla()}
    fit = fit_prefill(hw, tp)
    rows = [{"context_tokens": c, "model": name,
             "prefill_s": fitted_prefill_s(s, hw, tp, fit, c),
             "prefill_roofline_s": prefill_time(s, hw, tp, c).total_s,
             "tpot_ms": 1e3 * roofline_decode(s, hw, tp, 1, c).total_s}
            for name, s in shapes.items() for c in contexts]
    curves = pd.DataFrame(rows)
    published = pd.DataFrame([{"context_tokens": c, "model": name, "prefill_s": getattr(PREFILL_FIG7A, attr)[i],
                               "tpot_ms": getattr(TPOT_FIG7B, attr)[i]}
                              for name, attr in (("Kimi Linear", "kimi_linear"), ("all MLA", "mla"))
                              for i, c in enumerate(CONTEXTS)])
    wide = curves.pivot(index="context_tokens", columns="model")
    ratios = []
    for quantity, col, curve in (("prefill (Fig. 7a)", "prefill_s", PREFILL_FIG7A),
                                 ("TPOT, batch 1 (Fig. 7b)", "tpot_ms", TPOT_FIG7B)):
        for c in contexts:
            if c in CONTEXTS:
                m = wide.loc[c, (col, "all MLA")] / wide.loc[c, (col, "Kimi Linear")]
                ratios.append({"context_tokens": c, "quantity": quantity, "published": curve.ratio(c), "model": m,
                               "rel_error": m / curve.ratio(c) - 1})
    validated = pd.DataFrame(
        [{"context_tokens": r.context, "quantity": q, "setup": f"{setup[0]} x TP{setup[1]}", "published": r.published,
          "model": r.model, "rel_error": r.rel_error}
         for q, setup, rows in (("prefill (Fig. 7a)", PREFILL_SETUP, prefill_ratios()),
                                ("TPOT, batch 1 (Fig. 7b)", DECODE_SETUP, decode_ratios())) for r in rows])
    w = weight_bytes(kl)
    return RooflineView(curves, published, pd.DataFrame(ratios), validated, fit, w / 1e9, hw.hbm_bytes * tp / 1e9,
                        (hw.hbm_bytes * tp - w) / 1e9)


def make_policy(name: str, model: str, tp: int, interval: int | None = None):
    """A fresh policy ``name`` (:data:`POLICIES` + :data:`EXTRA_POLICIES`) for ``model`` on ``tp`` ranks;
    ``interval`` sets ours' C or extra_buffer's ``chunked_prefill_size`` (tokens; None = the default)."""
    if name == "ours":
        return OursPolicy(model, interval or OURS_C, tp_size=tp)
    if name.startswith("sglang"):
        replica = ReplicaBytes.for_preset(model, tp)
        if name == "sglang no_buffer":
            return SGLangNoBuffer(replica)
        if name == "sglang extra_buffer":
            return SGLangExtraBuffer(replica, chunked_prefill_size=interval or EXTRA_BUFFER_CHUNK)
    if name in ("vllm none", "vllm align", "vllm all"):
        return VLLMMambaPolicy(model, name.split()[1], tp)
    if name == "vllm align +replay stop":
        return VLLMMambaPolicy(model, "align", tp, replay_stop=True)
    raise ValueError(f"policy must be one of {POLICIES + EXTRA_POLICIES}, got {name!r}")


@dataclass(frozen=True)
class PolicyView:
    """The policy view. budgets: one row per (policy, budget), intervals: one per (policy, interval) at
    ``interval_budget_gb``; columns ``policy``, ``budget_gb``, ``interval_tokens``, ``token_hit_ratio``,
    ``mean_ttft_s``, ``p99_ttft_s``, ``prefill_saved`` (fraction of the cache-off prefill time), ``kv_gb``, ``state_gb``,
    ``running_gb`` (peak held per kind), ``states_written``, ``states_evicted``, ``kv_evicted_tokens``,
    ``replay_s``. ideal_hit_ratio: the block ideal (unlimited cache). cold_ttft_s: mean TTFT with no
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
    :mod:`serve.fleet.replica`)."""

    def __init__(self, shape: ModelShape, hw: Hardware, tp: int, requests: Sequence[TraceRequest]):
        self.shape, self.hw, self.tp, self.fit = shape, hw, tp, fit_prefill(hw, tp)
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


def _row(res: PolicyResult, ttft: _TTFT, **extra) -> dict:
    t = ttft.per_request(res.request_hit_tokens)
    return {"policy": extra.pop("policy"), **extra, "token_hit_ratio": res.token_hit_ratio,
            "mean_ttft_s": float(t.mean()), "p99_ttft_s": float(np.percentile(t, 99)), "prefill_saved": 1 - float(t.sum() / ttft.cold.sum()),
            "kv_gb": res.peak_bytes["kv"] / 1e9, "state_gb": res.peak_bytes["state"] / 1e9,
            "running_gb": res.peak_bytes["running"] / 1e9, "states_written": res.states_written,
            "states_evicted": res.states_evicted, "kv_evicted_tokens": res.kv_evicted_tokens,
            "replay_s": res.seconds}


def policy_view(model: str, hw_name: str, tp: int, num_requests: int, upload: bytes | None = None,
                upload_name: str = "uploaded file", policies: Sequence[str] = POLICIES,
                budgets_gb: Sequence[float] | None = None, intervals: Sequence[int] = INTERVALS,
                progress: Callable[[int, int], None] | None = None, seed: int = 0,
                requests: Sequence[TraceRequest] | None = None) -> PolicyView:
    """Replay the page's trace (:func:`lab.fleet.page_trace`: synthetic, or the uploaded Mooncake JSONL)
    through each of ``policies`` at each budget (GB per replica; None = :data:`BUDGET_FRACTIONS` of
    :func:`free_bytes`), then ours and extra_buffer at each of ``intervals`` at the
    :data:`INTERVAL_BUDGET_FRACTION` budget. ``progress(done, total)`` after each replay. ``requests``: a
    trace already loaded (the bench's whole Mooncake trace), used instead of ``upload`` / ``num_requests``.

    Raises ValueError when the weights do not fit (no budget left), for an unknown policy, a non-positive
    budget, or a bad model / hardware / TP; TraceFormatError (ValueError) for a malformed upload."""
    hw = _check_setup(model, hw_name, tp)
    for p in policies:
        if p not in POLICIES + EXTRA_POLICIES:
            raise ValueError(f"policies must be drawn from {POLICIES + EXTRA_POLICIES}, got {p!r}")
    shape, free = preset(model), free_bytes(model, hw, tp)
    if budgets_gb is None:
        if free <= 0:
            raise ValueError(f"{model} weights ({weight_bytes(shape) / 1e9:,.0f} GB) do not fit in {tp} x {hw_name} "
                             f"({hw.hbm_bytes * tp / 1e9:,.0f} GB): choose more GPUs (tp) or larger ones")
        budgets_gb = [free * f / 1e9 for f in BUDGET_FRACTIONS]
    if not budgets_gb or any(not b > 0 for b in budgets_gb):
        raise ValueError(f"budgets_gb must be positive numbers, got {list(budgets_gb)!r}")
    interval_budget = (free * INTERVAL_BUDGET_FRACTION / 1e9 if free > 0 else float(np.median(budgets_gb)))
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
        key = (p, interval or DEFAULT_INTERVAL.get(p), budget_gb)
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
    return PolicyView(budgets, ivs, ideal, float(ttft.cold.mean()), free / 1e9,
                      weight_bytes(shape) / 1e9, interval_budget, vllm_block_size(model, "align", tp_size=tp),
                      len(requests), int(ttft.lengths.sum()), note, choose(budgets, ivs))


def choose(budgets: pd.DataFrame, intervals: pd.DataFrame) -> pd.DataFrame:
    """:class:`PolicyView`'s ``choice``: the lowest mean TTFT per budget (over policies) and per interval-swept
    policy (over intervals); ties to the first row."""
    cols = ["budget_gb", "policy", "interval_tokens", "mean_ttft_s", "token_hit_ratio"]
    best = budgets.loc[budgets.groupby("budget_gb", sort=True).mean_ttft_s.idxmin()].assign(interval_tokens=np.nan)
    parts = [best.reindex(columns=cols)]
    if len(intervals):
        parts.append(intervals.loc[intervals.groupby("policy", sort=False).mean_ttft_s.idxmin()].reindex(columns=cols))
    return pd.concat(parts, ignore_index=True)
