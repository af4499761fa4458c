"""Chart and label defects a fresh tester found on pages 03, 10, 16 and 09: "10k" ticks on a MiB axis (read as
10 kMiB), a bar label on its error bar, the batch-32 throughput point clipped at the top edge, and a slider labelled
"Checkpoint every C / 512 blocks"."""
import math

import pandas as pd
import streamlit as st

import lab.batching
from lab.timing import conditions
from tests.app.page_helpers import chart_spec, open_page, plotly_values


def test_p03_bytes_axis_ticks_read_in_mib():
    """Plotly's default SI format labelled the log MiB axis "10k": the ticks carry full numbers and the unit."""
    yaxis = chart_spec(open_page("app_pages/03_kda_state_vs_kv.py"), "p03_bytes_chart")["layout"]["yaxis"]
    assert yaxis["tickformat"] == "," and yaxis["ticksuffix"] == " MiB", yaxis


def test_p10_bar_labels_clear_of_their_error_bars():
    """The "32 ms" label sat "outside" the bar, on top of its IQR whisker: now inside, at the bar's base."""
    bars = chart_spec(open_page("app_pages/10_kcp.py"), "p10_timing_chart")["data"][0]
    assert bars["textposition"] == "inside" and bars["insidetextanchor"] == "start", bars


def test_p16_throughput_range_holds_every_point_and_bar(monkeypatch):
    """The y range (log10 units) pads the largest max and smallest min of the table: nothing at the plot's edge.
    The table is hand-made (the sweep takes ~10 s): tokens/s rising to 4,000 at batch 32."""
    batches = [1, 2, 4, 8, 16, 32]
    tps = [150.0 * b ** 0.95 for b in batches]
    table = pd.DataFrame({"batch": batches, "tokens_per_s": tps, "min": [t * 0.9 for t in tps],
                          "max": [t * 1.05 for t in tps], "ms_per_step": [b / t * 1e3 for b, t in zip(batches, tps)]})
    table["speedup"] = table.tokens_per_s / table.tokens_per_s.iloc[0]
    monkeypatch.setattr(lab.batching, "decode_throughput",
                        lambda progress=None: lab.batching.Throughput(table, conditions(5, 1)))
    st.cache_data.clear()
    try:
        at = open_page("app_pages/16_continuous_batching.py")
        at.session_state["p16_sweep"] = True
        at.run()
    finally:
        st.cache_data.clear()
    assert not at.exception, [e.value for e in at.exception]
    fig = chart_spec(at, "p16_throughput")
    assert plotly_values(fig["data"][0]["y"]) == tps
    lo, hi = fig["layout"]["yaxis"]["range"]
    assert 10 ** lo < table["min"].min() and 10 ** hi > table["max"].max() * 1.1, (10 ** lo, 10 ** hi)
    assert hi - math.log10(table["max"].max()) >= 0.05, "the top bar touches the edge"


def test_p09_checkpoint_slider_label_reads_plainly():
    """"Checkpoint every C / 512 blocks" read as a division: a plain label, the unit (512-token blocks) in its help."""
    every = next(w for w in open_page("app_pages/09_prefix_miss.py").select_slider if w.key == "p09_every")
    assert "/" not in every.label and len(every.label) <= 32 and "512-token blocks" in every.help, every.label
