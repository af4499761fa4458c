"""Live timings that mean what their text says: page 10's speedup is against the best one-rank baseline,
Home's headline is measured at first render, page 09 does not headline an unrepeated TTFT, and Home and page 08
show the fitted fixed + per-token cost of a forward next to predicted and measured warm TTFT."""
import re

import streamlit as st

import lab.kcp
from lab.timing import summarize
from tests.app.page_helpers import open_page


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
        at = open_page("pages/10_kcp.py", p10_seq_len=512)
        next(b for b in at.button if b.key == "p10_all_cores_button").click().run()
    finally:
        st.cache_data.clear()
    assert not at.exception, [e.value for e in at.exception]
    text = " ".join(m.value for m in at.markdown)
    said = re.search(r"The fastest one-rank configuration measured is \*\*(.+?)\*\*, so \d+ ranks are \*\*([\d.]+)×\*\*",
                     text)
    assert said, text
    assert "thread(s)" not in said.group(1) or said.group(1).endswith(" 1 thread(s)")
    speedup = next(m for m in at.metric if m.label.startswith("Measured speedup"))
    assert speedup.value == f"{float(said.group(2)):.2f}×"
    assert float(said.group(2)) < 4                              # 2 ranks on <= 2 shared cores: never 6.65x


def test_p09_headlines_no_unrepeated_ttft():
    """Page 09 headlined "one run's TTFT", a single sample (55 ms and 701 ms for the same settings in one session)."""
    at = open_page("pages/09_prefix_miss.py")
    shown = [f"{m.label} {m.value} {m.proto.delta}" for m in at.metric]
    assert shown and not any("TTFT" in s or " ms" in s for s in shown), shown
    miss = next(m for m in at.metric if m.label == "Miss: prefill tokens")
    assert miss.value == "256" and "whole prompt" in miss.proto.delta
