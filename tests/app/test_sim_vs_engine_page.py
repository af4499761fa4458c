"""Page 14's "predicted vs measured on the real engine": the section renders the recorded strict (CPU-time clock)
and wall-clock replays, labelled as recorded (date, conditions); its tables show the JSON's numbers with the error
recomputed, and its chart shows each clock's worst-rate error per metric against that clock's goal."""
import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from lab.sim_vs_engine import GOAL_PCT, SIM_METRICS, SIM_VS_ENGINE_JSON
from tests.app.page_helpers import chart_spec, plotly_values

PAGE = str(Path(__file__).resolve().parents[2] / "app_pages" / "14_fleet_simulation.py")


def test_predicted_vs_measured_section_shows_both_recorded_replays():
    raw = json.loads(SIM_VS_ENGINE_JSON.read_text())
    at = AppTest.from_file(PAGE, default_timeout=300).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(h.value == "5 · Predicted vs measured on the real engine" for h in at.subheader)
    assert any("Recorded bench run" in c.value and raw["meta"]["measured"] in c.value for c in at.caption)
    worst = {}
    tables = [d.value for d in at.dataframe if {"predicted", "error_pct", "rate_rps"} <= set(d.value.columns)]
    assert len(tables) == 2                                              # strict first, then wall clock
    for shown, (clock, key) in zip(tables, (("strict", "measured"), ("wall", "measured_median"))):
        rows = raw[clock]["rows"]
        assert shown.measured.tolist() == pytest.approx([r[key][m] for r in rows for m in SIM_METRICS])
        assert shown.predicted.tolist() == pytest.approx([r["predicted"][m] for r in rows for m in SIM_METRICS])
        want = [abs(r["predicted"][m] - r[key][m]) / r[key][m] * 100 for r in rows for m in SIM_METRICS]
        assert shown.error_pct.tolist() == pytest.approx(want)
        worst[clock] = [max(abs(r["predicted"][m] - r[key][m]) / r[key][m] * 100 for r in rows) for m in SIM_METRICS]
    bars = chart_spec(at, "p14_sim_engine_chart")["data"]
    assert [plotly_values(b["y"]) for b in bars] == [pytest.approx(worst["strict"]), pytest.approx(worst["wall"])]
    for clock, goal in GOAL_PCT.items():
        meets = sum(w <= goal for w in worst[clock])
        assert any(f"{meets} of {len(SIM_METRICS)} metrics within {goal:.0f} %" in m.value for m in at.markdown), clock
