"""12 Fleet scaling: keys moved when a replica joins or leaves, and the hit-ratio dip while caches refill."""
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from lab.fleet_scaling import ACTIONS, CAPACITIES, SMOOTH_WINDOWS, fleet_scaling
from pages._common import engine_call, persist, show_chart, upload_parts

st.title("Fleet scaling")
st.write(
    "Adding or removing a replica should move as few routing keys as possible: every moved key is a prefix "
    "whose cache is now on the wrong replica. First the fraction of random keys each algorithm moves, against "
    "the ideal 1/(n+1) and naive mod-N; then a trace replayed across the scale event, showing the hit ratio dip "
    "and how fast the caches refill.")

c1, c2, c3, c4 = st.columns(4)
replicas = c1.slider("Replicas before the event", 2, 32, value=8, key=persist("p12_replicas", 8, min_value=2, max_value=32), bind="query-params", persist_state="session")
action = c2.selectbox("Event", list(ACTIONS), index=list(ACTIONS).index("add"), key=persist("p12_action", "add", options=list(ACTIONS)), bind="query-params", persist_state="session")
vnodes = c3.select_slider("Ring vnodes", [10, 40, 160, 400, 1000], value=160, key=persist("p12_vnodes", 160, options=[10, 40, 160, 400, 1000]), bind="query-params", persist_state="session")
num_keys = c4.select_slider("Random keys", [10_000, 30_000, 100_000], value=100_000, key=persist("p12_keys", 100_000, options=[10_000, 30_000, 100_000]), bind="query-params", persist_state="session")

part1, part2 = st.container(), st.container()
part2.subheader("2 · Hit ratio across the scale event (trace replay)")
d1, d2, d3, d4 = part2.columns(4)
num_requests = d1.slider("Requests (cap)", 500, 5000, step=100, value=3000, key=persist("p12_requests", 3000, min_value=500, max_value=5000), bind="query-params", persist_state="session")
k = d2.slider("Routing prefix depth k (blocks)", 1, 4, value=2, key=persist("p12_k", 2, min_value=1, max_value=4), bind="query-params", persist_state="session")
at = d3.slider("Event at (fraction of the trace)", 0.1, 0.9, step=0.05, value=0.5, key=persist("p12_at", 0.5, min_value=0.1, max_value=0.9), bind="query-params", persist_state="session")
window = d4.slider("Window (requests)", 50, 500, step=50, value=100, key=persist("p12_window", 100, min_value=50, max_value=500), bind="query-params", persist_state="session")
capacity = part2.select_slider("Cache per replica (blocks of 512 tokens)", list(CAPACITIES),
                               value="unlimited", key=persist("p12_capacity", "unlimited", options=list(CAPACITIES)), bind="query-params", persist_state="session")
upload = part2.file_uploader("Mooncake trace (JSONL, optional)", type=["jsonl", "json"], key="p12_upload")


@st.cache_data(show_spinner="Moving keys and replaying the trace…", max_entries=32, ttl="1h")
def _run(replicas, action, num_keys, vnodes, n, k, at, window, capacity, upload_bytes, upload_name):
    return fleet_scaling(replicas, action, num_keys, vnodes, n, k, at, window, capacity, upload_bytes, upload_name)


run = engine_call(_run, replicas, action, num_keys, vnodes, num_requests, k, at, window, capacity, *upload_parts(upload))
moved, n_after, anchors = run.moved, run.replicas_after, run.anchors
with part1:
    st.subheader(f"1 · Keys moved going from {replicas} to {n_after} replicas")
    fig = go.Figure(go.Bar(x=moved.algorithm, y=moved.moved_fraction, name="measured here"))
    fig.add_hline(y=moved.ideal.iloc[0], line_dash="dash", annotation_text=f"ideal 1/{max(replicas, n_after)}")
    fig.add_hline(y=moved.mod_n_expected.iloc[0], line_dash="dot", annotation_text="mod-N expected n/(n+1)")
    fig.update_layout(xaxis_title="algorithm", yaxis_title="keys that change replica", yaxis_tickformat=".0%")
    show_chart(fig, moved, key="p12_moved_chart")
    st.caption(f"Published: {anchors['ring_moves']}; {anchors['jump_moves']}; {anchors['mod_n_moves']}. Maglev refills "
               "its table, so it moves a little more than the minimum. Jump hash can only drop the last bucket cheaply: "
               "removing the last replica here is its best case.")

with part2:
    df, dip, at_request, n_trace, n_keys = run.dip, run.recovery, run.at_request, run.num_requests, run.routing_keys
    if run.note:
        st.info(run.note)
    st.caption(f"Mean of {run.seeds} synthetic trace(s) (seeds 0–{run.seeds - 1}); band: lowest to highest trace. "
               "Each trace is also replayed without the event, and the chart shows the difference, so the trace's own "
               "window-to-window swing cancels: 0 before the event by construction." if run.seeds > 1 else
               "One uploaded trace, also replayed without the event; the chart shows the difference (0 before the event).")
    fig2 = go.Figure()
    palette = ["#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a"]
    for (name, g), color in zip(df.groupby("algorithm", sort=False), palette):
        if run.seeds > 1:
            fig2.add_trace(go.Scatter(x=[*g.request, *g.request[::-1]], y=[*(100 * g.change_hi), *(100 * g.change_lo[::-1])],
                                      fill="toself", fillcolor=color, opacity=0.15, line=dict(width=0),
                                      hoverinfo="skip", showlegend=False, legendgroup=name))
        fig2.add_trace(go.Scatter(x=g.request, y=100 * g.change, name=name, mode="lines", line=dict(color=color),
                                  legendgroup=name))
    fig2.add_vline(x=at_request, line_dash="dash", annotation_text=f"{action} a replica")
    fig2.add_hline(y=0, line_dash="dot", annotation_text="no event", annotation_position="bottom left")
    fig2.update_layout(xaxis_title="request index (window start)",
                       yaxis_title=f"hit ratio change vs no event (points, per {window} requests)",
                       legend=dict(orientation="h", y=-0.25))
    show_chart(fig2, df, key="p12_dip_chart")
    if n_keys == 1:
        st.warning(f"All requests share their first {k} block(s) (a shared system prompt), so there is one routing key: "
                   "every algorithm sends the whole trace to one replica and the lines coincide. Route on more blocks.")
    st.dataframe(pd.DataFrame({
        "Algorithm": dip.algorithm,
        "Hit ratio before": dip.hit_ratio_before,
        "Lowest window after": dip.lowest_after,
        f"Hit ratio lost (first {run.dip_windows} windows)": dip.hit_ratio_lost,
        "Requests to recover half the loss": [f"{int(v):,}" if v == v else "not within the trace"
                                              for v in dip.requests_to_recover],
    }), hide_index=True, width="stretch", column_config={
        c: st.column_config.NumberColumn(format="percent") for c in
        ["Hit ratio before", "Lowest window after", f"Hit ratio lost (first {run.dip_windows} windows)"]})
    st.caption(f"{n_trace:,} requests per trace (cap {num_requests:,}); the trace ends {n_trace - at_request:,} requests "
               "after the event. What to notice: mod-N reshuffles almost every prefix and loses most of its hit ratio; "
               "the consistent schemes lose only the moved share (~1/(n+1)) of prefixes.")
    with st.expander("How the loss and the recovery are computed"):
        st.markdown(
            f"- **Hit ratio lost**: the mean, over the first {run.dip_windows} windows ({run.dip_windows * window:,} "
            "requests) from the event, of max(0, hit ratio without the event − hit ratio with it), averaged over the "
            "traces. Pairing each trace with its own no-event replay removes the trace's swing from the measure.\n"
            "- **Requests to recover half the loss**: requests from the event to the first window from which the "
            f"loss, averaged over {SMOOTH_WINDOWS} windows, is at most half the hit ratio lost, in whole windows.\n"
            "- Routing-only replay with per-replica LRU block caches (512-token blocks); the synthetic traces are "
            "`serve.traces.synthesize` with seeds 0, 1, …")
