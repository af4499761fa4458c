"""Home's verdict checks the logit tolerance it prints (the lab's WARM_TOLERANCE): max |Δ logits| above it is an
error, not a success. At its defaults Home shows the trained model's code continuation of a held-out file."""
import pytest
import streamlit as st
from streamlit.proto.Metric_pb2 import Metric

import lab.prefix as prefix_runs
from lab.prefix import WARM_TOLERANCE
from lab.trained import home_prompts, model_card
from tests.app.page_helpers import open_page

TOL_TEXT = f"{WARM_TOLERANCE:.0e}".replace("e-0", "e-")    # 5e-5


@pytest.mark.parametrize("diff, ok", [pytest.param(WARM_TOLERANCE / 2, True, id="within"),
                                      pytest.param(WARM_TOLERANCE * 2, False, id="above")])
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
        assert any(s.startswith("Outputs identical to the cache-off run") and f"≤ {TOL_TEXT} required" in s
                   for s in success), success
        assert not errors
    else:
        assert not success
        assert any(f"exceeds the {TOL_TEXT} tolerance" in e for e in errors), errors


def test_home_shows_the_trained_models_code_continuation():
    """Warm output = the continuation the prompt rule judged (train/prompts.py), beside the file's own bytes,
    with the model's size and held-out nats/byte next to xz's; nothing says the weights are random."""
    at = open_page("app_pages/00_home.py")
    prompts, card = home_prompts(), model_card()
    n = next(s.value for s in at.slider if s.key == "p00_new")
    model_code, file_code = (c.value for c in at.code[:2])
    assert n >= 16 and model_code.endswith(prompts.continuation[:n]) and file_code.endswith(prompts.file_continuation[:n])
    text = " ".join(c.value for c in at.caption)
    assert f"{card.num_parameters / 1e6:.2f} M parameters" in text and f"xz {card.code_xz:.3f}" in text
    assert "random" not in " ".join(s.value for s in at.success) + text


@pytest.mark.parametrize("cold_ms, warm_ms, resolved", [
    pytest.param([100, 130, 90, 120, 110], [105, 95, 125, 100, 115], False, id="overlapping"),
    pytest.param([120, 125, 118, 130, 122], [80, 85, 79, 90, 82], True, id="separated")])
def test_home_ttft_headline_claims_only_a_resolved_change(monkeypatch, cold_ms, warm_ms, resolved):
    """The tester saw "-10% vs cold" with the warm run's IQR three times the difference: the measured TTFT's headline
    states a change only when the per-repeat cold - warm differences resolve it, else "not resolved" and a warning."""
    real = prefix_runs.ttft_summary

    def hand_made(rows):   # the engine's rows, with hand-made TTFTs per (kind, repeat)
        times = {"cold": cold_ms, "warm": warm_ms}
        return real([dict(r, ttft_ms=times[r["kind"]][r["repeat"]]) if r["kind"] in times else r for r in rows])

    monkeypatch.setattr(prefix_runs, "ttft_summary", hand_made)
    st.cache_data.clear()
    try:
        at = open_page("app_pages/00_home.py", p00_new=1)
        at.session_state["p00_timing_on"] = True
        at.run()
    finally:
        st.cache_data.clear()
    assert not at.exception, [e.value for e in at.exception]
    headline = next(m.proto for m in at.metric if m.label == "TTFT warm (median, measured)")
    warnings = [w.value for w in at.warning if w.value.startswith("Cold vs warm TTFT is not resolved")]
    if resolved:
        assert headline.delta.startswith("-33% vs cold 122.0 ms; cold − warm 40.0 ms"), headline.delta
        assert not warnings
    else:
        assert headline.delta.startswith("not resolved at this load: cold − warm −5.0 ms (paired IQR −5.0 to 20.0 ms)")
        assert "%" not in headline.delta and headline.direction == Metric.MetricDirection.NONE and len(warnings) == 1, (headline, warnings)
