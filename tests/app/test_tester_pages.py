"""Defects a browser tester found on pages 10, 16, 08 and 03: a headline "vs the best" over one baseline, labels
cut off at 1400 px, an unreadable right axis, a "bitwise equal" reason for a hit that is not there, and a
one-point context range."""
import dataclasses
import re

import streamlit as st

import lab.kcp
from lab.timing import summarize
from tests.app.page_helpers import chart_spec, open_page, plotly_values

LABEL_CHARS = 32       # what a metric label / toggle shows un-truncated in a quarter to a third of 1400 px


def test_p10_headline_speedup_is_against_more_than_one_baseline():
    """At the defaults the only baseline was the one-rank process (36 ms); the in-process rank (15 ms) waited for a
    button, and the headline said 2.11x "vs the best" on 2 ranks, with "best of 1 baseline(s)" in the small print."""
    at = open_page("app_pages/10_kcp.py")
    world = next(s for s in at.slider if s.key == "p10_world").value
    labels = [m.label for m in at.metric]
    assert all(len(label) <= LABEL_CHARS for label in labels), labels
    speedup = next(m for m in at.metric if m.label.startswith("Speedup vs best"))
    caption = " ".join(c.value for c in at.caption)
    best_of = re.search(r"best of (\d+) baseline\(s\)", caption)
    assert best_of and int(best_of.group(1)) >= 2, caption
    assert "1 rank in this process, 1 thread(s)" in " ".join(m.value for m in at.markdown), "in-process rank untimed"
    if float(speedup.value.rstrip("×")) > world:                  # a superlinear point is explained where it is drawn
        assert any(w.value.startswith(f"Above the ideal {world}×") for w in at.warning)
        measured = next(t for t in chart_spec(at, "p10_speedup_chart")["data"] if t["name"].startswith("measured"))
        assert "above ideal" in measured["text"][1]


def test_p10_superlinear_point_is_explained(monkeypatch):
    """A measured point above ideal (2.11x on 2 ranks) was drawn with no word on why: here the ranks' samples are
    scaled 20x faster so the point is superlinear whatever the host does."""
    real = lab.kcp.kcp_experiment

    def fast_ranks(*args, **kwargs):
        run = real(*args, **kwargs)
        t = run.kcp_timing
        return dataclasses.replace(run, kcp_timing=summarize(t.label, [x / 20 for x in t.samples_s]))

    monkeypatch.setattr(lab.kcp, "kcp_experiment", fast_ranks)
    st.cache_data.clear()
    try:
        at = open_page("app_pages/10_kcp.py")
    finally:
        st.cache_data.clear()
    speedup = float(next(m for m in at.metric if m.label.startswith("Speedup vs best")).value.rstrip("×"))
    assert speedup > 2
    warning = next(w.value for w in at.warning if w.value.startswith("Above the ideal 2×"))
    measured = next(t for t in chart_spec(at, "p10_speedup_chart")["data"] if t["name"].startswith("measured"))
    assert "above ideal" in measured["text"][1] and measured["hovertext"][1] == warning


def test_p16_composition_axes_readable():
    """Chart 1's right axis read "-8.2" tokens under the legend, and the speculation toggle's label was cut off."""
    at = open_page("app_pages/16_continuous_batching.py")
    toggle = next(t for t in at.toggle if t.key == "p16_spec")
    assert len(toggle.label) <= LABEL_CHARS and toggle.help, toggle.label
    layout = chart_spec(at, "p16_composition")["layout"]
    legend = layout["legend"]
    # below the plot, off the ticks: at the container's bottom (show_chart moves a legend below the plot there)
    assert legend["orientation"] == "h" and (legend.get("yref") == "container" and legend["y"] == 0
                                             and legend.get("yanchor") == "bottom" or legend["y"] < 0), legend
    for axis in ("yaxis", "yaxis2"):
        ax = layout[axis]
        assert ax["rangemode"] == "tozero", axis                                   # no negative counts
        assert ax["tick0"] == 0 and isinstance(ax["dtick"], int) and ax["dtick"] >= 1, axis   # integer ticks


def test_int_tick_step():
    from app_pages.charts import int_tick_step
    assert [int_tick_step(n) for n in (0, 8, 9, 16, 17, 40, 41, 128, 1000)] == [1, 1, 2, 2, 5, 5, 10, 20, 200]
    assert all(n / int_tick_step(n) <= 8 for n in range(0, 5000, 7))


def test_p08_no_shared_prefix_says_no_hit():
    """?p08_shared=0 still said "bitwise equal: the hit b = 0 is a multiple of the 64-token KDA chunk"."""
    at = open_page("app_pages/08_prefix_hit.py", p08_shared=0)
    said = next(c.value for c in at.caption if c.value.startswith("Warm output "))
    assert "there is no hit (b = 0)" in said and "multiple" not in said, said


def test_p03_one_point_context_range():
    """The range 1024-1024 drew four flat lines with no x tick: now one bar per cache kind at that context, and a
    note naming the widget."""
    at = open_page("app_pages/03_kda_state_vs_kv.py", p03_context=(1024, 1024))
    assert any(i.value.startswith("Context range (tokens) has both ends at 1,024 tokens") for i in at.info)
    fig = chart_spec(at, "p03_bytes_chart")
    assert [t["type"] for t in fig["data"]] == ["bar"], fig["data"]
    bars = fig["data"][0]
    assert len(bars["x"]) == 4 and all(v > 0 for v in plotly_values(bars["y"]))
    assert "1,024 tokens" in fig["layout"]["xaxis"]["title"]["text"]
