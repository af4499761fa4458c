"""bench.app's first-render timing in a real browser: a new session's lazily loaded Plotly chart is waited for.

A new browser session fetches Plotly's 4.7 MB chunk only when the first chart arrives; until then the chart is an
``stSkeleton``, and the script can be idle long before the chart is drawn (on a loaded host the chunk's parse takes
seconds). The test throttles the browser's network to 4 MB/s, so the chunk takes about a second to arrive, as on a
busy host or a slow link, and the timing must end after the draw.
Skips when Chromium or Playwright is missing, unless ``REQUIRE_BROWSER=1``.
"""
import os
import shutil

import pytest

from bench.app import ALL_DRAWN, TIMELINE, open_timed, render_phases
from bench.app_server import CHROMIUM, FLAGS, streamlit_server

pytestmark = pytest.mark.browser

ONE_CHART = '''import plotly.graph_objects as go
import streamlit as st

st.title("one chart")
st.plotly_chart(go.Figure(go.Bar(x=[1, 2, 3], y=[3, 1, 2])), key="chart")
'''


@pytest.fixture(scope="module")
def browser():
    if not (os.path.exists(CHROMIUM) and shutil.which(CHROMIUM)):
        if os.environ.get("REQUIRE_BROWSER") == "1":
            pytest.fail(f"REQUIRE_BROWSER=1 but no Chromium at {CHROMIUM}")
        pytest.skip(f"no Chromium at {CHROMIUM}")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


def test_open_waits_for_a_new_sessions_lazily_loaded_chart(browser, tmp_path):
    script = tmp_path / "one_chart.py"
    script.write_text(ONE_CHART)
    with streamlit_server(script=str(script)) as (url, _pid):
        ctx = browser.new_context(viewport={"width": 1000, "height": 800})   # a new session: no HTTP cache
        page = ctx.new_page()
        page.add_init_script(TIMELINE)
        cdp = ctx.new_cdp_session(page)
        cdp.send("Network.enable")
        cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": 4e6,
                                                      "uploadThroughput": 4e6})   # bytes/s: Plotly's chunk ~1.2 s
        first_render_s = open_timed(page, url, "/")
        assert page.locator("[data-testid='stPlotlyChart'] .main-svg").count() > 0, "returned before the chart drew"
        assert page.evaluate(ALL_DRAWN)
        drawn = [t for t, _, n in page.evaluate("window.__kdaTimeline") if n]
        phases = render_phases(page, page.evaluate("performance.timeOrigin") / 1e3)
        ctx.close()
    assert drawn, "the timeline saw no chart drawn"
    assert first_render_s > 0
    assert phases["frontend_s"] >= 0 and phases["script_s"] >= 0 and phases["after_idle_s"] >= 0, phases
