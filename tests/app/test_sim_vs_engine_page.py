"""Page 14's "predicted vs measured on the real engine": the section renders the recorded bench run, labelled as
such (date, conditions), and its table and MAPE chart show exactly the JSON's numbers; throughput below
saturation is marked uninformative (grey), not a pass, and the verdict counts only informative metrics."""
import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app_pages.charts import literal
from lab.fleet_simulation import SIM_VS_ENGINE_JSON
from tests.app.page_helpers import chart_spec, plotly_values

PAGE = str(Path(__file__).resolve().parents[2] / "app_pages" / "14_fleet_simulation.py")


def test_predicted_vs_measured_section_shows_the_recorded_run():
    raw = json.loads(SIM_VS_ENGINE_JSON.read_text())
    at = AppTest.from_file(PAGE, default_timeout=300).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(h.value == "5 · Predicted vs measured on the real engine" for h in at.subheader)
    assert any("Recorded bench run" in c.value and raw["meta"]["measured"] in c.value for c in at.caption)
    table = next(d.value for d in at.dataframe if "predicted" in d.value.columns and "rate_rps" in d.value.columns)
    assert len(table) == len(raw["rows"])
    for shown, rec in zip(table.itertuples(), raw["rows"]):
        assert (shown.rate_rps, shown.measured, shown.predicted) == (rec["rate_rps"], rec["measured"],
                                                                     rec["predicted"])
        assert shown.error_pct == pytest.approx(abs(rec["predicted"] - rec["measured"]) / rec["measured"] * 100)
    (bar,) = chart_spec(at, "p14_sim_engine_chart")["data"]
    expected = {}
    for rec in raw["rows"]:
        expected.setdefault(rec["metric"], []).append(abs(rec["predicted"] - rec["measured"]) / rec["measured"] * 100)
    assert plotly_values(bar["y"]) == pytest.approx([sum(v) / len(v) for v in expected.values()])
    assert plotly_values(bar["y"]) == pytest.approx(list(raw["mape_pct"].values()))
    fits = raw["meta"]["fitted_service_model_per_rate"]
    variants = next(t.value for t in at.table if "Simulator" in t.value.columns)   # wrapped: its names are sentences
    names = list(next(iter(fits.values()))["variants"])
    assert variants.Simulator.tolist() == [literal(n) for n in names]   # one row per piece, in the bench's order
    last = names[-2]                                             # the prediction (the last one is a diagnostic)
    err = [abs(fits[str(r["rate_rps"])]["variants"][last][r["metric"]] - r["measured"]) / r["measured"] * 100
           for r in raw["rows"] if r["metric"] == "ttft_p50_ms"]
    shown_mape = float(variants.set_index("Simulator").loc[literal(last), "TTFT P50 (ms)"])   # shown as "%.1f"
    assert shown_mape == pytest.approx(sum(err) / len(err), abs=0.05)
    steps = next(d.value for d in at.dataframe if "wall_per_cpu" in d.value.columns and "kind" in d.value.columns)
    assert set(steps.kind) <= {"decode", "prefill", "mixed"} and (steps.wall_per_cpu > 0).all()
    assert chart_spec(at, "p14_sim_engine_parts")["data"]

    goal = 10.0
    thr = [r for r in raw["rows"] if r["metric"] == "request_throughput_rps"]
    assert thr and all(r["measured"] > 0.75 * r["rate_rps"] and r["predicted"] > 0.75 * r["rate_rps"] for r in thr)
    i = list(expected).index("request_throughput_rps")          # completed ≈ offered at every rate: says nothing
    assert bar["text"][i] == "uninformative" and bar["marker"]["color"][i] not in ("#2ca02c", "green")
    latency = {m: v for m, v in raw["mape_pct"].items() if m != "request_throughput_rps"}
    meets = sum(v <= goal for v in latency.values())
    verdict = " ".join(m.value for m in at.markdown if "Verdict" in m.value)
    assert f"{meets} of {len(latency)} informative metrics meet the 10 % goal" in verdict
    assert "Throughput (req/s): uninformative below saturation: completed ≈ offered" in verdict
