"""Heavy extras stay off the first render and still work on request, then stay on for the session: page 09's
trace replay (16 cache configurations), Home's and page 08's TTFT measurements (30 engine runs each), page 04's
commit times and page 05's alloc / free latencies run only after their buttons."""
import json
from pathlib import Path

from streamlit.testing.v1 import AppTest

from tests.app.page_helpers import chart_spec, open_page
from tests.app.verdicts import VERDICTS

TIMEOUT_S = 300
REPO = Path(__file__).resolve().parents[2]


def _chart_keys(at: AppTest) -> set[str]:
    return {c.proto.id for c in at.get("plotly_chart")}


def _chart_has_data(at: AppTest) -> bool:
    return all(json.loads(c.proto.spec).get("data") for c in at.get("plotly_chart"))


def test_prefix_miss_replay_behind_button():
    at = AppTest.from_file(str(REPO / "app_pages" / "09_prefix_miss.py"), default_timeout=TIMEOUT_S).run()
    assert not at.exception, [e.value for e in at.exception]
    before = _chart_keys(at)
    assert len(before) == 1, f"only section 1's chart before the button, got {len(before)}"
    assert [b.label for b in at.button] == ["Replay the trace"]
    at.button(key="p09_replay_button").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(_chart_keys(at)) == 4 and _chart_has_data(at)        # + capacity, causes, interval charts
    VERDICTS["app_pages/09_prefix_miss.py"](at)                         # incl. no capacity beats the ideal
    at.run()                                                        # a rerun (any widget) keeps the replay on
    assert len(_chart_keys(at)) == 4 and not at.button


def test_home_timing_behind_button():
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=TIMEOUT_S)     # Home links every tab: routed
    at.query_params.update(p00_new="1")                             # a short run
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert {k.rsplit("-", 1)[-1] for k in _chart_keys(at)} == {"p00_tokens_chart"}, "no TTFT chart before the button"
    assert [b.label for b in at.button] == ["Measure TTFT cold vs warm"]
    assert not [m.label for m in at.metric if m.label.startswith("TTFT")], "no TTFT metric before the button"
    VERDICTS["app_pages/00_home.py"](at)                                # the verification run is on the first render
    at.button(key="p00_measure_button").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert sorted(k.rsplit("-", 1)[-1] for k in _chart_keys(at)) == ["p00_breakdown_chart", "p00_fit_chart",
                                                                     "p00_tokens_chart", "p00_ttft_chart"]
    assert _chart_has_data(at)
    assert next(m for m in at.metric if m.label == "TTFT, wall clock").value.endswith(" ms")
    assert next(m for m in at.metric if m.label == "CPU time, same runs").value.endswith(" ms")
    assert any("interleaved repeats after 1 warm-up" in c.value for c in at.caption)   # the measured stamp
    at.run()                                                        # a rerun keeps the measurement on
    assert len(_chart_keys(at)) == 4 and not [b for b in at.button if b.key == "p00_measure_button"]


def test_prefix_hit_timing_behind_button():
    """Page 08's verification run (counters, warm vs cache-off output) is on the first render; its TTFT repeats and
    the forward-cost fit run after the button, and the headline says so until then."""
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=TIMEOUT_S)
    at.query_params.update(p08_shared="64", p08_new="1")            # a short run
    at.run()
    at.switch_page("app_pages/08_prefix_hit.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert {k.rsplit("-", 1)[-1] for k in _chart_keys(at)} == {"p08_bytes_chart"}, "no TTFT chart before the button"
    assert [b.label for b in at.button] == ["Measure TTFT cold vs warm"]
    assert at.metric[0].value == "on request"
    VERDICTS["app_pages/08_prefix_hit.py"](at)                          # the verification run is on the first render
    at.button(key="p08_measure_button").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert sorted(k.rsplit("-", 1)[-1] for k in _chart_keys(at)) == ["p08_bytes_chart", "p08_fit_chart",
                                                                     "p08_ttft_chart"]
    assert _chart_has_data(at) and at.metric[0].value != "on request"
    at.run()                                                        # a rerun keeps the measurement on
    assert len(_chart_keys(at)) == 3 and not [b for b in at.button if b.key == "p08_measure_button"]


def test_ring_commit_timing_behind_button():
    """Page 04's bytes and ring run are on the first render; its commit times (and the trade-off table built on them)
    after the button. The timing depends on width and n only: a new capacity keeps it, without measuring again."""
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=TIMEOUT_S)
    at.query_params.update(p04_draft="2")                           # a short timing
    at.run()
    at.switch_page("app_pages/04_raw_input_ring.py").run()
    assert not at.exception, [e.value for e in at.exception]
    keys = {k.rsplit("-", 1)[-1] for k in _chart_keys(at)}
    assert {"p04_bytes_chart", "p04_slots_chart", "p04_occupancy_chart"} <= keys and "p04_commit_chart" not in keys
    assert "Measure commit times" in [b.label for b in at.button] and not at.get("arrow_data_frame")
    VERDICTS["app_pages/04_raw_input_ring.py"](at)                      # the ring run is on the first render
    at.button(key="p04_measure_button").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "p04_commit_chart" in {k.rsplit("-", 1)[-1] for k in _chart_keys(at)} and _chart_has_data(at)
    stamp = next(c.value for c in at.caption if c.value.startswith("Measured "))
    at.slider(key="p04_capacity").set_value(8).run()                # the same width and n: the same measurement
    assert not at.exception and next(c.value for c in at.caption if c.value.startswith("Measured ")) == stamp


def test_pool_latency_behind_button():
    """Page 05's pool run (grid, utilisation, outcomes, waste) is on the first render, its timed alloc / free calls
    after the button; the note after the section shows either way."""
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=TIMEOUT_S)
    at.run()
    at.switch_page("app_pages/05_page_pool.py").run()
    assert not at.exception, [e.value for e in at.exception]
    keys = {k.rsplit("-", 1)[-1] for k in _chart_keys(at)}
    assert "p05_grid" in keys and "p05_latency" not in keys
    assert "Measure alloc / free latency" in [b.label for b in at.button]
    assert any(i.value.startswith("What to notice") for i in at.info)
    VERDICTS["app_pages/05_page_pool.py"](at)
    at.button(key="p05_measure_button").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "p05_latency" in {k.rsplit("-", 1)[-1] for k in _chart_keys(at)} and _chart_has_data(at)


def test_state_precision_run_behind_button():
    """Page 17's live decode (one batch row per storage format) runs only after its button; the capacity, shipped
    run and probe charts are on the first render."""
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=TIMEOUT_S)
    at.run()
    at.switch_page("app_pages/17_state_precision.py").run()
    assert not at.exception, [e.value for e in at.exception]
    keys = {k.rsplit("-", 1)[-1] for k in _chart_keys(at)}
    assert "p17_capacity_chart" in keys and "p17_probe_chart" in keys and not any("p17_run" in k for k in keys)
    assert [b.label for b in at.button] == ["Decode with every format"]
    at.button(key="p17_run_button").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert {"p17_run_state_rel_err", "p17_run_logit_max_abs"} <= {k.rsplit("-", 1)[-1] for k in _chart_keys(at)}
    VERDICTS["app_pages/17_state_precision.py"](at)                    # fp32 storage bitwise a plain decode


def test_state_precision_charts_keep_their_labels():
    """Regression: page 17's legends sat under the rotated format names, on the x title "state format", and cut
    "… stochastic rounding"; the drift axis read ratios as "500µ". Legends of the format bar charts now sit above
    the plot, and both drift axes print exponents (5e-4)."""
    at = open_page("app_pages/17_state_precision.py")
    assert not at.exception, [e.value for e in at.exception]
    for key in ("p17_capacity_chart", "p17_bench_agreement"):
        legend = chart_spec(at, key)["layout"]["legend"]
        assert legend["yanchor"] == "bottom" and legend["y"] > 1, (key, legend)
    for key in ("p17_bench_state_rel_err", "p17_bench_logit_max_abs"):
        assert chart_spec(at, key)["layout"]["yaxis"]["tickformat"] == "~e", key
