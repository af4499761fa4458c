"""Live timings that mean what their text says: page 10's speedup is against the best one-rank baseline,
Home's headline is measured at first render, page 09 does not headline an unrepeated TTFT, and Home and page 08
show the fitted fixed + per-token cost of a forward next to predicted and measured warm TTFT."""
import re

import streamlit as st
from streamlit.testing.v1 import AppTest

import lab.kcp
from lab.timing import summarize
from tests.app.page_helpers import APP, open_page, open_revealed


def test_p10_speedup_against_the_fastest_one_rank_baseline(monkeypatch):
    """An oversubscribed many-thread one-rank baseline (8x slower here) must not be the one divided by."""
    real = lab.kcp.one_rank_baselines

    def oversubscribed(*args, **kwargs):
        timings, cond = real(*args, **kwargs)
        slow = [t if t.label.endswith(" 1 thread(s)") else summarize(t.label, [8 * x for x in t.samples_s])
                for t in timings]
        return slow, cond

    monkeypatch.setattr(lab.kcp, "one_rank_baselines", oversubscribed)
    st.cache_data.clear()
    try:
        at = open_page("app_pages/10_kcp.py", p10_seq_len=512)
        next(b for b in at.button if b.key == "p10_all_cores_button").click().run()
    finally:
        st.cache_data.clear()
    assert not at.exception, [e.value for e in at.exception]
    text = " ".join(m.value for m in at.markdown)
    said = re.search(r"The fastest one-rank configuration measured is \*\*(.+?)\*\*, so \d+ ranks are \*\*([\d.]+)×\*\*",
                     text)
    assert said, text
    assert "thread(s)" not in said.group(1) or said.group(1).endswith(" 1 thread(s)")
    speedup = next(m for m in at.metric if m.label.startswith("Speedup vs best"))
    assert speedup.value == f"{float(said.group(2)):.2f}×"
    assert float(said.group(2)) < 4                              # 2 ranks on <= 2 shared cores: never 6.65x


def test_p09_headlines_no_unrepeated_ttft():
    """Page 09 headlined "one run's TTFT", a single sample (55 ms and 701 ms for the same settings in one session)."""
    at = open_page("app_pages/09_prefix_miss.py")
    shown = [f"{m.label} {m.value} {m.proto.delta}" for m in at.metric]
    assert shown and not any("TTFT" in s or " ms" in s for s in shown), shown
    miss = next(m for m in at.metric if m.label == "Miss: prefill tokens")
    assert miss.value == "256" and "whole prompt" in miss.proto.delta


def test_home_headline_is_measured_at_first_render():
    """Home's headline metric read "not measured" until a button was pressed: at first render every metric now
    shows the engine's counters of the verified run (tokens skipped), and TTFT comes with the button."""
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    values = [m.value for m in at.metric]
    assert values and not any(v in ("not measured", "measuring…") for v in values), values
    head = at.metric[0]
    assert head.label == "Prefill tokens skipped (warm)" and re.fullmatch(r"[\d,]+ of [\d,]+", head.value)
    hit, prompt = (int(x.replace(",", "")) for x in head.value.split(" of "))
    assert 0 < hit < prompt and head.proto.delta.startswith(f"{hit / prompt:.0%} of the prompt")


def _fit_caption(at) -> str:
    return next(c.value for c in at.caption if c.value.startswith("**Fixed cost per forward a = "))


def test_home_warm_ttft_formula_has_the_fixed_cost():
    """Home said "warm TTFT ≈ restore + (L − b) tokens of prefill", leaving out the fixed cost of a forward;
    measured, it shows a fitted fixed + per-token cost, checked on the held-out cold run, next to the warm TTFT."""
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update(p00_new="1")
    at.run()
    text = " ".join(c.value for c in at.caption)
    assert "restore + (L − b) tokens of prefill" not in text and "fixed cost of one forward" in text
    at.button(key="p00_measure_button").click().run()
    assert not at.exception, [e.value for e in at.exception]
    fit = _fit_caption(at)
    assert "(estimated)" in fit and "two-point estimate" in fit and "Held out, not in the fit: the cold run" in fit
    assert any("By this two-point estimate, the fixed cost is" in c.value and "held-out error" in c.value
               for c in at.caption)                           # the conclusion carries its only check beside it
    assert any(c.value.startswith("Warm, ") and "predicted a + b·(L − hit)" in c.value for c in at.caption)
    labels = {m.label: m.value for m in at.metric}
    assert labels["Fixed cost per forward a"].endswith(" ms") and labels["Saved per request (wall)"].endswith(" ms")
    assert all(re.fullmatch(r"\d+ → \d+ ms", labels[k]) for k in ("TTFT, wall clock", "CPU time, same runs")), labels


def test_p08_shows_the_fitted_forward_cost():
    at = open_revealed("app_pages/08_prefix_hit.py")
    fit = _fit_caption(at)
    assert "Held out, not in the fit: the cold run, 144 tokens" in fit and "two-point estimate" in fit
    assert any("By this two-point estimate" in c.value and "held-out error" in c.value for c in at.caption)
    assert any(c.value.startswith("Request 1 − cold, the same 144 tokens: ") and "looks up" in c.value
               and "checkpoint(s)" in c.value for c in at.caption)   # what the cache-on run does extra, measured
    assert any(c.value.startswith("Warm, 16 tokens prefilled: measured ") for c in at.caption)
    assert any(c.proto.id.endswith("p08_fit_chart") for c in at.get("plotly_chart"))
    text = " ".join(c.value for c in at.caption)
    assert "TTFT_cold · (L − b) / L plus" not in text
