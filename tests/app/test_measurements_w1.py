"""Live timings on Home, page 03 and page 08: a Re-measure button clears only its own page's cached
measurement (cached measurements are shared by every visitor), each measured chart carries its stamp,
and the view's parameters come from the URL (``app_pages.links``: declared parameters).

Cache entries are counted per cached function through Streamlit's cache statistics (the function names
are unique per page: ``_p00_timing``, ``_p03_measure``, ``_p08_verdict``, ...), and by the data itself:
a cached measurement shows the same stamp and samples again, a new one does not.
"""
from collections import Counter
from pathlib import Path

import pytest
import streamlit as st
from streamlit.runtime.caching.cache_data_api import _data_caches
from streamlit.testing.v1 import AppTest

from tests.app.page_helpers import chart_spec, plotly_values

REPO = Path(__file__).resolve().parents[2]
APP = str(REPO / "app.py")
STAMP = "interleaved repeats after 1 warm-up"


def _entries() -> Counter:
    """Cached entries per ``st.cache_data`` function (the short name after the module), read from each
    function cache's per-item statistics (Streamlit's public stats group them per function)."""
    caches = [c for by_key in _data_caches._function_caches.values() for c in by_key.values()]
    return Counter(stat.cache_name.rsplit(".", 1)[-1] for c in caches
                   for stat in c.get_stats().get("cache_memory_bytes", []))


def _set(at: AppTest, **values) -> None:
    for key, value in values.items():
        next(w for w in [*at.slider, *at.select_slider] if w.key == key).set_value(value)
    at.run()
    assert not at.exception, [e.value for e in at.exception]


def _stamps(at: AppTest) -> list[str]:
    return [c.value for c in at.caption if STAMP in c.value]


def test_remeasure_clears_only_this_pages_measurement():
    """Page 08's Re-measure clears page 08's timing cache (all its settings) and nothing else: page 08's
    verdict cache and page 03's measurement keep their entries, and page 03 shows the same measurement.
    The pages run as files here: in AppTest, a button click on a page reached by ``switch_page`` from
    app.py does not reach the script (sliders do), so the click is made on the page itself."""
    st.cache_data.clear()
    p03 = AppTest.from_file(str(REPO / "app_pages" / "03_kda_state_vs_kv.py"), default_timeout=300)
    p03.query_params.update(p03_meas_heads="1", p03_meas_max="1024")
    p03.run()
    assert not p03.exception, [e.value for e in p03.exception]
    stamp03, data03 = _stamps(p03), chart_spec(p03, "p03_decode_chart")["data"]
    assert len(stamp03) == 2, [c.value for c in p03.caption]     # the decode chart and the head-count chart
    at = AppTest.from_file(str(REPO / "app_pages" / "08_prefix_hit.py"), default_timeout=300)
    at.query_params.update(p08_shared="64", p08_unique="16", p08_new="1")   # small runs
    at.session_state["p08_timing_on"] = True                    # page 08 measures after its button (test_heavy_extras)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    _set(at, p08_interval=32)                                    # a second setting: two entries each on page 08
    before = _entries()
    assert before["state_vs_kv"] == 1 and before["prefix_hit"] == 2 and before["_p08_timing"] == 2, before
    medians = plotly_values(chart_spec(at, "p08_ttft_chart")["data"][0]["y"])
    assert len(_stamps(at)) == 1

    at.button(key="p08_remeasure").click().run()
    assert not at.exception, [e.value for e in at.exception]
    after = _entries()
    assert after["_p08_timing"] == 1, after                       # cleared, then measured again for this setting
    assert after["prefix_hit"] == 2 and after["state_vs_kv"] == 1, after    # the other caches keep their entries
    assert plotly_values(chart_spec(at, "p08_ttft_chart")["data"][0]["y"]) != medians   # a new measurement

    p03.run()                                                     # page 03 shows its cached measurement
    assert _stamps(p03) == stamp03 and chart_spec(p03, "p03_decode_chart")["data"] == data03
    assert _entries()["state_vs_kv"] == 1
    st.cache_data.clear()


@pytest.mark.parametrize("page, params, want", [
    ("app_pages/03_kda_state_vs_kv.py", dict(p03_meas_heads="1", p03_meas_max="1024", p03_preset="Kimi K3"),
     dict(p03_meas_heads=1, p03_meas_max=1024, p03_preset="Kimi K3")),
    ("app_pages/08_prefix_hit.py", dict(p08_shared="96", p08_unique="16", p08_new="1"),
     dict(p08_shared=96, p08_unique=16, p08_new=1)),
    ("app_pages/00_home.py", dict(p00_new="1", p00_block="32"), dict(p00_new=1, p00_block=32)),
], ids=["03", "08", "home"])
def test_query_params_set_the_view(page, params, want):
    """Every value in the URL reaches its widget, a widget's minimum too (p08_unique=16, p08_new=1,
    p00_new=1: Streamlit drops a URL value equal to the widget's declared default, which was its minimum
    while the page default came from session state)."""
    at = AppTest.from_file(APP, default_timeout=300)
    at.query_params.update(params)
    if page != "app_pages/00_home.py":
        at.switch_page(page)
        if page == "app_pages/08_prefix_hit.py":
            at.session_state["p08_timing_on"] = True            # page 08 measures after its button (test_heavy_extras)
    else:
        at.session_state["p00_timing_on"] = True                # Home measures after its button (test_heavy_extras)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    widgets = {w.key: w.value for w in [*at.slider, *at.select_slider, *at.selectbox]}
    assert {k: widgets[k] for k in want} == want, widgets
    assert len(_stamps(at)) == (2 if "03_" in page else 1)       # each measured chart is stamped (03: two)
    if page == "app_pages/03_kda_state_vs_kv.py":
        assert [m.label for m in at.metric if m.label.endswith("(measured)")] == [   # medians, not the fit's a, b
            f"{kind} at N = {n:,} (measured)" for kind in ("KDA step", "MLA decode") for n in (256, 1024)]
    if page == "app_pages/08_prefix_hit.py":
        assert _metric_value(at, "Prefill tokens skipped") == "96 of 112"          # b = 96: 6 blocks of 16
    if page == "app_pages/00_home.py":
        assert any(s.value.startswith("Outputs identical to the cache-off run: 1 greedy tokens") for s in at.success)


def _metric_value(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def test_p08_no_hit_reads_no_hit_not_a_reduction():
    """With no shared prefix the warm run prefills every token (hit b = 0): the cold/warm TTFT difference is noise,
    so the headline says "no hit" instead of a (possibly negative) reduction; with a hit it is a percentage."""
    from tests.app.page_helpers import open_page
    first = {m.label: m.value for m in open_page("app_pages/08_prefix_hit.py", p08_shared=0).metric}
    assert first["TTFT reduction (median)"] == "no hit" and first["Prefill tokens skipped"].startswith("0 of")
    at = open_page("app_pages/08_prefix_hit.py")      # with a hit: a percentage, or "not resolved" and a warning
    assert at.metric[0].value == "on request"          # ... once measured (its button)
    at.session_state["p08_timing_on"] = True
    at.run()
    headline = at.metric[0]
    assert headline.value.endswith("%") or (headline.value == "not resolved" and any(
        w.value.startswith("Not resolved at this load") for w in at.warning)), headline.value
    assert "paired IQR" in headline.proto.delta
