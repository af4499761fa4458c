"""Page 14's "predicted vs measured on the real engine": the lab reads the recorded bench run and recomputes every
error and the MAPE per metric from the recorded per-rate measured / predicted values (never copies them)."""
import json
import math

import pytest

from lab.fleet_simulation import SIM_METRICS, SIM_VS_ENGINE_JSON, sim_vs_engine_record


def _rows(values):
    return [dict(rate_rps=rate, metric=m, measured=meas, predicted=pred, error_pct=999.0)
            for rate, m, meas, pred in values]


def test_mape_is_recomputed_from_the_per_rate_values(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"meta": {"measured": "2026-01-01 00:00 UTC"}, "mape_pct": {"ttft_p50_ms": 0.0},
                                "rows": _rows([(1.0, "ttft_p50_ms", 100.0, 110.0), (2.0, "ttft_p50_ms", 200.0, 150.0),
                                               (1.0, "tpot_mean_ms", 10.0, 10.0), (2.0, "tpot_mean_ms", 20.0, 21.0)])}))
    rec = sim_vs_engine_record(path)
    assert rec["rows"].error_pct.tolist() == pytest.approx([10.0, 25.0, 0.0, 5.0])      # not the recorded 999
    mape = rec["mape"].set_index("metric")
    assert mape.mape_pct["ttft_p50_ms"] == pytest.approx(17.5)                            # not the recorded 0
    assert mape.mape_pct["tpot_mean_ms"] == pytest.approx(2.5)
    assert mape.rates.tolist() == [2, 2] and mape.label["tpot_mean_ms"] == SIM_METRICS["tpot_mean_ms"]


def test_the_recorded_run_is_consistent_with_its_rows():
    rec = sim_vs_engine_record()
    raw = json.loads(SIM_VS_ENGINE_JSON.read_text())
    assert set(rec["mape"].metric) == set(SIM_METRICS) and rec["meta"]["measured"]
    for m, v in raw["mape_pct"].items():          # the bench's own summary agrees with the recomputation
        assert math.isclose(rec["mape"].set_index("metric").mape_pct[m], v, rel_tol=1e-9)
    assert {"fitted", "held out"} <= set(rec["steps"].role)      # calibrated on some steps, validated on others


@pytest.mark.parametrize("content", [None, "{}", '{"rows": [{"rate_rps": 1, "metric": "nope", "measured": 1, '
                                     '"predicted": 1}]}', '{"rows": [{"rate_rps": 1, "metric": "tpot_mean_ms", '
                                     '"measured": 0, "predicted": 1}]}'])
def test_bad_record_names_the_path(tmp_path, content):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match="bad.json"):
        sim_vs_engine_record(path)
