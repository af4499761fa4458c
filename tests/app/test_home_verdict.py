"""Home's verdict checks the logit tolerance it prints (the lab's WARM_TOLERANCE): max |Δ logits| above it is an
error, not a success. At its defaults Home shows the trained model's code continuation of a held-out file."""
import pytest
import streamlit as st
from streamlit.proto.Metric_pb2 import Metric

import lab.prefix as prefix_runs
from lab.prefix import WARM_TOLERANCE
from lab.timing import summarize
from lab.trained import home_prompts, model_card
from serve.config import ServeConfig
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


OVERLAP = ([100, 130, 90, 120, 110, 105, 115], [105, 95, 125, 100, 115, 110, 100])   # paired diffs straddle 0
APART = ([120, 125, 118, 130, 122, 121, 124], [80, 85, 79, 90, 82, 81, 84])          # every round: warm 40 ms faster


def _hand_timed(real, wall, cpu):
    """time_cold_warm on a tiny model (fast), its cold / warm TTFT and CPU time replaced by hand-made ms per round."""
    def fake(first, second, max_new_tokens=8, config=None, repeats=5, **kwargs):
        run = real(first[:96], second[:150], max_new_tokens=1, config=ServeConfig(16, 32), repeats=repeats,
                   preset="demo-tiny")
        made = {"ttft_ms": dict(zip(("cold", "warm"), wall)), "cpu_ms": dict(zip(("cold", "warm"), cpu))}
        rows = [dict(r, **{c: made[c][r["kind"]][r["repeat"]] for c in made}) if r["kind"] in ("cold", "warm") else r
                for r in run.rows]
        timings = [summarize(k, [r["ttft_ms"] / 1e3 for r in rows if r["kind"] == k]) for k in prefix_runs.PHASE_RUNS]
        return run._replace(rows=rows, timings=timings)
    return fake


@pytest.mark.parametrize("wall, cpu, shown", [
    pytest.param(OVERLAP, OVERLAP, "none", id="neither"),
    pytest.param(OVERLAP, APART, "cpu", id="cpu-only"),
    pytest.param(APART, APART, "both", id="both")])
def test_home_ttft_headline_claims_only_a_resolved_change(monkeypatch, wall, cpu, shown):
    """The tester saw "-10% vs cold" with the warm run's IQR three times the difference, and a delta cut to "not
    resolved … (pai…": each of wall clock and CPU time states a change only when the per-round cold - warm differences
    resolve it, else "not resolved" (short: nothing cut), and one message says which resolved, with the spreads."""
    monkeypatch.setattr(prefix_runs, "time_cold_warm", _hand_timed(prefix_runs.time_cold_warm, wall, cpu))
    st.cache_data.clear()
    try:
        at = open_page("app_pages/00_home.py", p00_new=1)
        at.session_state["p00_timing_on"] = True
        at.run()
    finally:
        st.cache_data.clear()
    assert not at.exception, [e.value for e in at.exception]
    metrics = {m.label: m.proto for m in at.metric}
    for label, resolved in (("TTFT, wall clock", shown == "both"), ("CPU time, same runs", shown != "none")):
        m = metrics[label]
        if resolved:
            assert (m.body, m.delta) == ("122 → 82 ms", "-33% (medians)"), (label, m.body, m.delta)
        else:
            assert m.delta == "not resolved" and m.direction == Metric.MetricDirection.NONE, (label, m)
    texts = [w.value for w in at.warning] + [s.value for s in at.success]
    said = [t for t in texts if t.startswith(("Resolved at load", "Not resolved at load", "Partly resolved at load"))]
    want = {"none": "Not resolved", "cpu": "Partly resolved", "both": "Resolved"}[shown]
    assert len(said) == 1 and said[0].startswith(want), said
    spread = "cold − warm 40.0 ms (paired IQR 40.0 to 40.0 ms)"
    assert (spread in said[0]) is (shown != "none"), said[0]
