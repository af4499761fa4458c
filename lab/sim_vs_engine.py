"""Page 14's "predicted vs measured on the real engine": the recorded ``python -m bench.sim_vs_engine`` run.

The run replays a Mooncake-shaped trace through the real engine on two clocks (strict: each step's thread CPU time;
wall) and predicts the same replays with the fleet simulator (:mod:`serve.fleet.engine_replay`). This module reads
``bench/results/sim_vs_engine.json`` and RECOMPUTES every error and MAPE from the recorded measured / predicted
values (the file's own summary is not trusted).
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from serve.fleet.engine_replay.metrics import METRICS

SIM_VS_ENGINE_JSON = Path(__file__).resolve().parents[1] / "bench" / "results" / "sim_vs_engine.json"
SIM_METRICS = {"ttft_p50_ms": "TTFT P50 (ms)", "ttft_p99_ms": "TTFT P99 (ms)", "tpot_mean_ms": "TPOT mean (ms)",
               "tpot_p50_ms": "TPOT P50 (ms)", "e2e_mean_ms": "E2E mean (ms)",
               "request_throughput_rps": "Throughput (req/s)"}
GOAL_PCT = {"strict": 5.0, "wall": 10.0}          # MAPE per metric and per rate
CLOCK_TITLES = {"strict": "strict replay (CPU-time clock)", "wall": "wall-clock replay (median of the repeats)"}
TERM_TITLES = {"prefill_overhead_ms": "fixed cost of a step with prompts (ms)",
               "decode_step_base_ms": "fixed cost of a decode-only step (ms)",
               "ms_per_prefill_token": "per prompt token (ms)", "prefill_per_row_ms": "per prompt (ms)",
               "prefill_per_token_pair_ms": "per MLA attention pair (ms)",
               "prefill_off_grid_per_token_ms": "per token after an off-grid hit (ms)",
               "decode_step_per_seq_ms": "per decode row, padded to its bucket (ms)",
               "decode_per_context_token_ms": "per decode row x context token (ms)",
               "prefill_per_checkpoint_ms": "per checkpoint published (ms)",
               "per_output_row_ms": "per row that emits a token (ms)"}


def _rows(block: list, measured_key: str) -> pd.DataFrame:
    out = []
    for r in block:
        for m in METRICS:
            meas, pred = float(r[measured_key][m]), float(r["predicted"][m])
            if not meas > 0:
                raise ValueError(f"non-positive measured {m} at rate {r['rate']}")
            lo, hi = r.get("measured_spread", {}).get(m, [meas, meas])
            out.append(dict(rate_rps=float(r["rate"]), metric=m, label=SIM_METRICS[m], measured=meas,
                            measured_min=float(lo), measured_max=float(hi), predicted=pred,
                            error_pct=abs(pred - meas) / meas * 100.0))
    return pd.DataFrame(out)


def sim_vs_engine_record(path: Path | str = SIM_VS_ENGINE_JSON) -> dict:
    """The recorded run: ``{"meta": dict, "strict": DataFrame, "wall": DataFrame, "mape": DataFrame, "terms":
    DataFrame, "step_check": DataFrame, "host_noise": dict}``. ``strict`` / ``wall``: one row per rate and metric
    ``[rate_rps, metric, label, measured, measured_min, measured_max, predicted, error_pct]`` (the wall rows'
    measured value is the median over the repeats, min / max their spread; error_pct = |predicted − measured| /
    measured × 100, recomputed); ``mape``: per clock and metric ``[clock, metric, label, mape_pct, worst_rate_pct,
    goal_pct, meets]`` (meets: every rate's error within the goal, :data:`GOAL_PCT`); ``terms``: the fitted
    step-time terms (CPU and wall); ``step_check``: per replay the median / P90 step error of the CPU-time model
    (calibration replays fitted, the others not). Raises ValueError naming ``path`` when it is missing, unreadable,
    or lacks a clock's rows or a metric."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        strict = _rows(data["strict"]["rows"], "measured")
        wall = _rows(data["wall"]["rows"], "measured_median")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"sim_vs_engine record {path}: unreadable, or a strict / wall row is missing or bad "
                         f"({err!r})") from None
    if strict.empty or wall.empty:
        raise ValueError(f"sim_vs_engine record {path}: no strict or no wall rows")
    mape = []
    for clock, rows in (("strict", strict), ("wall", wall)):
        for m, g in rows.groupby("metric", sort=False):
            mape.append(dict(clock=clock, metric=m, label=SIM_METRICS[m], mape_pct=g.error_pct.mean(),
                             worst_rate_pct=g.error_pct.max(), goal_pct=GOAL_PCT[clock],
                             meets=bool(g.error_pct.max() <= GOAL_PCT[clock])))
    terms = data.get("terms", {})
    term_rows = [dict(term=TERM_TITLES.get(t, t), cpu=terms.get("cpu", {}).get(t), wall=terms.get("wall", {}).get(t))
                 for t in terms.get("names", [])]
    checks = [dict(replay=k, median_pct=v["median"], p90_pct=v["p90"], steps=v["n"],
                   fitted=k.startswith("calibration")) for k, v in data.get("step_check_pct", {}).items()]
    return {"meta": data.get("meta", {}), "strict": strict, "wall": wall, "mape": pd.DataFrame(mape),
            "terms": pd.DataFrame(term_rows), "step_check": pd.DataFrame(checks),
            "host_noise": data.get("wall", {}).get("host_noise", {})}
