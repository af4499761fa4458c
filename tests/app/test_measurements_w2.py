"""Pages 02, 04 and 10: live timings carry their stamp, Re-measure clears only that page's measurement,
and the URL's query parameters set the page's widgets."""
import time

from streamlit.testing.v1 import AppTest

from tests.app.page_helpers import APP, open_page


def _stamp(at: AppTest) -> str:
    return next(c.value for c in at.caption if c.value.startswith("Measured ") and "interleaved repeats" in c.value)


def _button(at: AppTest, key: str):
    return next(b for b in at.button if b.key == key)


def _timed_ring() -> AppTest:
    """Page 04 at n = 2 with its commit times measured (the flag its button sets)."""
    at = open_page("app_pages/04_raw_input_ring.py", p04_draft=2)
    at.session_state["p04_timing_on"] = True
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_remeasure_clears_only_this_pages_measurement():
    ring = _timed_ring()
    ring_stamp = _stamp(ring)
    kcp = open_page("app_pages/10_kcp.py", p10_seq_len=512)
    kcp_stamp = _stamp(kcp)
    assert "5 interleaved repeats" in kcp_stamp and "1 torch thread(s)" in kcp_stamp
    time.sleep(1.1)                                       # stamps are to the second
    _button(kcp, "p10_remeasure").click().run()
    assert not kcp.exception
    assert _stamp(kcp) != kcp_stamp, "Re-measure did not measure page 10 again"
    again = _timed_ring()
    assert _stamp(again) == ring_stamp, "page 10's Re-measure cleared page 04's measurement"
    time.sleep(1.1)
    _button(again, "p04_remeasure").click().run()
    assert not again.exception and _stamp(again) != ring_stamp


def test_query_params_set_the_widgets():
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["p04_draft"] = "3"
    at.run()
    at.switch_page("app_pages/04_raw_input_ring.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.slider(key="p04_draft").value == 3
