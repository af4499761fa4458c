"""Home's verdict checks the logit tolerance it prints: max |Δ logits| above it is an error, not a success."""
import pytest
import streamlit as st

import lab.prefix as prefix_runs
from tests.app.page_helpers import open_page


@pytest.mark.parametrize("diff, ok", [pytest.param(5e-6, True, id="within-1e-5"),
                                      pytest.param(2e-5, False, id="above-1e-5")])
def test_home_verdict_checks_tolerance(monkeypatch, diff, ok):
    real = prefix_runs.cold_vs_warm

    def with_diff(*args, **kwargs):
        run = real(*args, **kwargs)
        return run._replace(check=prefix_runs.Comparison(True, diff))

    monkeypatch.setattr(prefix_runs, "cold_vs_warm", with_diff)
    st.cache_data.clear()
    try:
        at = open_page("app_pages/00_home.py", expect_error=not ok, p00_new=1)
    finally:
        st.cache_data.clear()
    success = [s.value for s in at.success]
    errors = [e.value for e in at.error]
    if ok:
        assert any(s.startswith("Outputs identical to the cache-off run") and "≤ 1e-5 required" in s
                   for s in success), success
        assert not errors
    else:
        assert not success
        assert any("exceeds the 1e-5 tolerance" in e for e in errors), errors
