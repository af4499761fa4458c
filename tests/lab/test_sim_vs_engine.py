"""Page 14's "predicted vs measured on the real engine": the lab reads the recorded bench run and recomputes every
error and the MAPE per clock and metric from the recorded per-rate measured / predicted values (never copies them)."""
import json
import math

import pytest

from lab.sim_vs_engine import GOAL_PCT, SIM_METRICS, SIM_VS_ENGINE_JSON, sim_vs_engine_record
from serve.fleet.engine_replay.metrics import METRICS


def _block(values: dict, measured_key: str) -> list:
    """``{rate: (measured, predicted)}`` -> per-rate rows with every metric at those values."""
    return [{"rate": rate, measured_key: dict.fromkeys(METRICS, meas), "predicted": dict.fromkeys(METRICS, pred),
             "error_pct": dict.fromkeys(METRICS, 999.0)} for rate, (meas, pred) in values.items()]


def _record(strict: dict, wall: dict) -> dict:
    return {"meta": {"measured": "2026-01-01 00:00 UTC"},
            "strict": {"rows": _block(strict, "measured"), "mape_pct": dict.fromkeys(METRICS, 0.0)},
            "wall": {"rows": _block(wall, "measured_median")}}


def test_errors_and_mape_are_recomputed_per_clock(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_record({2.0: (100.0, 104.0), 8.0: (200.0, 188.0)}, {2.0: (100.0, 120.0)})))
    rec = sim_vs_engine_record(path)
    assert rec["strict"].error_pct.tolist() == pytest.approx([4.0] * len(METRICS) + [6.0] * len(METRICS))
    mape = rec["mape"].set_index(["clock", "metric"])
    assert mape.mape_pct[("strict", "ttft_p50_ms")] == pytest.approx(5.0)               # not the recorded 0
    assert mape.worst_rate_pct[("strict", "ttft_p50_ms")] == pytest.approx(6.0)
    assert not mape.meets[("strict", "ttft_p50_ms")]                                    # 6 % at one rate > 5 %
    assert mape.mape_pct[("wall", "tpot_p50_ms")] == pytest.approx(20.0) and not mape.meets[("wall", "tpot_p50_ms")]
    assert set(rec["strict"].label) == set(SIM_METRICS.values())


@pytest.mark.parametrize("content", [None, "{}", '{"strict": {"rows": []}, "wall": {"rows": []}}',
                                     json.dumps(_record({1.0: (0.0, 1.0)}, {1.0: (1.0, 1.0)}))],
                         ids=["missing", "empty", "no-rows", "zero-measured"])
def test_bad_record_names_the_path(tmp_path, content):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match="bad.json"):
        sim_vs_engine_record(path)


def test_the_recorded_run_is_consistent_with_its_rows():
    rec = sim_vs_engine_record()
    raw = json.loads(SIM_VS_ENGINE_JSON.read_text())
    mape = rec["mape"].set_index(["clock", "metric"])
    for clock in GOAL_PCT:
        for m, v in raw[clock]["mape_pct"].items():          # the bench's own summary agrees with the recomputation
            assert math.isclose(mape.mape_pct[(clock, m)], v, rel_tol=1e-9)
    assert len(rec["strict"].rate_rps.unique()) >= 4 and rec["meta"]["measured"]
    checks = rec["step_check"]
    assert checks.fitted.any() and (~checks.fitted).any()   # fitted on some replays, checked on others
