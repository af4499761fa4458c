"""Page 14's offered load: at the defaults the fleet is loaded enough that routing decides TTFT, and the load sweep
(TTFT P50 / P99 per policy against requests / s) stays off the first render and runs on request."""
from pathlib import Path

from streamlit.testing.v1 import AppTest

from lab.fleet import DISPLAY_NAMES
from tests.app.page_helpers import chart_spec, plotly_values

PAGE = str(Path(__file__).resolve().parents[2] / "app_pages" / "14_fleet_simulation.py")
IN_FLIGHT = "Fleet in\\-flight per replica, mean"   # the balance table's column (a wrapped st.table: Markdown-escaped)


def _keys(at: AppTest) -> set[str]:
    return {c.proto.id.rsplit("-", 1)[-1] for c in at.get("plotly_chart")}


def test_default_load_is_where_routing_matters_and_the_sweep_runs_on_request():
    at = AppTest.from_file(PAGE, default_timeout=300).run()
    assert not at.exception, [e.value for e in at.exception]
    balance = next(t.value for t in at.table if IN_FLIGHT in t.value.columns)
    assert balance[IN_FLIGHT].astype(float).min() > 1.0, f"the default fleet is idle: {balance[IN_FLIGHT].tolist()} in flight"
    assert "p14_load_chart" not in _keys(at) and [b.label for b in at.button] == ["Sweep the load"]
    from lab.fleet_simulation import SWEEP_RATES  # here: the idle assertion above is the one red on the old page
    at.button(key="p14_sweep_button").click().run()
    assert not at.exception, [e.value for e in at.exception]
    traces = chart_spec(at, "p14_load_chart")["data"]
    names = {t["name"] for t in traces}
    for policy in ("ring", "round_robin", "cache_aware", "bounded_load"):      # the page's default policies
        assert {f"{DISPLAY_NAMES[policy]} P50", f"{DISPLAY_NAMES[policy]} P99"} <= names
    for t in traces:
        assert plotly_values(t["x"]) == [float(r) for r in SWEEP_RATES]
        y = plotly_values(t["y"])
        assert y[-1] > y[0] > 0, (t["name"], y)        # the last rate saturates the fleet: TTFT grows with the load
    at.run()
    assert "p14_load_chart" in _keys(at) and not at.button          # a rerun keeps the sweep on
