"""Pages 05 and 06: each live timing is stamped, drawn with error bars, and its Re-measure button clears only
that page's measurement (cached measurements are shared by every visitor); page 16's measured TTFT / TPOT can be
measured again the same way; page 09's miss TTFT is labelled as the one run it is."""
import time
from pathlib import Path

import streamlit as st
from streamlit.testing.v1 import AppTest

from tests.app.page_helpers import chart_spec, open_page, open_revealed


def _stamp(at: AppTest) -> str:
    return next(c.value for c in at.caption if c.value.startswith("Measured ") and "interleaved repeats" in c.value)


def _button(at: AppTest, key: str):
    return next(b for b in at.button if b.key == key)


def test_p05_p06_stamped_with_error_bars_and_remeasure_only_their_own():
    pool = open_revealed("app_pages/05_page_pool.py")
    paging = open_page("app_pages/06_mla_paging.py")
    pool_stamp, paging_stamp = _stamp(pool), _stamp(paging)
    assert "5 interleaved repeats" in pool_stamp
    assert "7 interleaved repeats" in paging_stamp and "1 torch thread(s)" in paging_stamp
    gather = chart_spec(paging, "p06_gather")["data"]
    assert gather and all(t.get("error_y", {}).get("type") == "data" for t in gather)       # median + IQR bars
    latency = [t for t in chart_spec(pool, "p05_latency")["data"] if t.get("error_x")]
    assert sorted(t["name"].split(" = ")[0] for t in latency) == ["alloc p50", "alloc p99", "free p50", "free p99"]

    time.sleep(1.1)                                                    # stamps are to the second
    _button(paging, "p06_remeasure").click().run()
    assert not paging.exception and _stamp(paging) != paging_stamp, "Re-measure did not measure page 06 again"
    again = open_revealed("app_pages/05_page_pool.py")
    assert _stamp(again) == pool_stamp, "page 06's Re-measure cleared page 05's measurement"
    paging_stamp = _stamp(paging)
    time.sleep(1.1)
    _button(again, "p05_remeasure").click().run()
    assert not again.exception and _stamp(again) != pool_stamp, "Re-measure did not measure page 05 again"
    assert _stamp(open_page("app_pages/06_mla_paging.py")) == paging_stamp, "page 05's Re-measure cleared page 06's"


def test_p16_remeasure_replays_the_trace_again():
    """Page 16's TTFT / TPOT come from one cached replay shared by every visitor for an hour; its Re-measure button
    clears that replay so the click measures afresh (there was no such button). The page runs as a file: in AppTest
    a click on a page reached by ``switch_page`` does not reach the script."""
    st.cache_data.clear()
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app_pages" / "16_continuous_batching.py"),
                           default_timeout=300)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    stamp = next(c.value for c in at.caption if c.value.startswith("One replay, measured "))
    time.sleep(1.1)                                                    # stamps are to the second
    _button(at, "p16_remeasure").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert next(c.value for c in at.caption if c.value.startswith("One replay, measured ")) != stamp
    st.cache_data.clear()


def test_p09_miss_metric_points_to_repeated_ttft():
    """Page 09 runs the miss once: its metric shows no single-sample time and says where TTFT is repeated
    (it headlined "one run's TTFT" before; tests/app/test_live_timings.py pins that it no longer does)."""
    at = open_page("app_pages/09_prefix_miss.py")
    m = next(m for m in at.metric if m.label == "Miss: prefill tokens")
    assert " ms" not in m.proto.delta and "interleaved repeats" in m.help
