"""Page 11's lookup cost is a live timing like pages 03, 04 and 10: median with IQR error bars, the stamp of
its conditions under the chart, and a Re-measure button that takes it again."""
import time

from tests.app.page_helpers import chart_spec, open_page


def _stamp(at) -> str:
    return next(c.value for c in at.caption if c.value.startswith("Measured ") and "interleaved repeats" in c.value)


def test_lookup_cost_is_stamped_and_remeasurable():
    at = open_page("app_pages/11_fleet_hashing.py")
    stamp = _stamp(at)
    assert "median of 5 interleaved repeats after 1 warm-up" in stamp, stamp
    bars = chart_spec(at, "p11_cost_chart")["data"][0]
    assert bars["error_y"]["type"] == "data" and "array" in bars["error_y"] and "arrayminus" in bars["error_y"]
    time.sleep(1.1)                                       # stamps are to the second
    next(b for b in at.button if b.key == "p11_remeasure").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert _stamp(at) != stamp, "Re-measure did not time the lookups again"
