"""Page 03 headlines measured medians, not a fit: the decode section's metrics are the medians at the smallest and
largest measured context, and the fitted a, b and R² sit in a table that says what each line means (a KDA line is
flat, so its R² is near 0; a negative MLA intercept is no fixed cost)."""
from pathlib import Path

from streamlit.testing.v1 import AppTest

PAGE = str(Path(__file__).resolve().parents[2] / "app_pages" / "03_kda_state_vs_kv.py")


def test_decode_metrics_are_measured_and_the_fit_is_read():
    at = AppTest.from_file(PAGE, default_timeout=300)
    at.query_params.update(p03_meas_heads="1", p03_meas_max="1024")     # a short measurement
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    decode = [m for m in at.metric if "at N = " in m.label]
    assert [m.label for m in decode] == [f"{kind} at N = {n:,} (measured)" for kind in ("KDA step", "MLA decode")
                                        for n in (256, 1024)]
    assert all(m.value.endswith(" µs") for m in decode)
    assert not [m.label for m in at.metric if "fixed cost" in m.label or "R²" in str(m.delta)]
    fits = next(t.value for t in at.table if "What it means" in t.value.columns)   # wrapped: a sentence per line
    assert list(fits["Fitted line"]) == ["KDA", "MLA"] and fits["What it means"].str.len().gt(20).all()
