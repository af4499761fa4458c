"""12 Fleet scaling: keys moved when a replica joins or leaves, and the hit-ratio dip while caches refill."""
import plotly.graph_objects as go
import streamlit as st

from app_pages.caching import upload_parts
from app_pages.charts import num, pct, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.params import Choice, Float, Int, Multi
from app_pages.replica import real_replica, replica_params
from lab.fleet import REPLICA_CACHES, display_name
from lab.fleet_scaling import ACTIONS, CAPACITIES, KEY_ROUTERS, MAX_SEEDS, SMOOTH_WINDOWS, TRACE_SEEDS, fleet_scaling
from lab.fleet_simulation import RealReplica, replica_title

st.title("Fleet scaling")
st.write(
    "Adding or removing a replica should move as few routing keys as possible: every moved key is a prefix "
    "whose cache is now on the wrong replica. First the fraction of random keys each algorithm moves, against "
    "the ideal 1/(n+1) and naive mod-N; then a trace replayed across the scale event, showing the hit ratio dip "
    "and how fast the caches refill. By default each replica's cache is Kimi-Linear's prefix cache at real bytes "
    "on 8 × H200, where a hit needs a KDA state.")

LABELS = {display_name(a): a for a in KEY_ROUTERS}
CACHES = list(REPLICA_CACHES)
links = declare(
    Int("p12_replicas", 8, 2, 32),
    Choice("p12_action", "add", ACTIONS),
    Choice("p12_vnodes", 160, [10, 40, 160, 400, 1000]),
    Choice("p12_keys", 30_000, [10_000, 30_000, 100_000]),
    Int("p12_requests", 800, 200, 3000, step=100),
    Int("p12_k", 2, 1, 4),
    Float("p12_at", 0.5, 0.1, 0.9, step=0.05),
    Int("p12_window", 50, 50, 500, step=50),
    Int("p12_seeds", TRACE_SEEDS, 1, MAX_SEEDS),
    Multi("p12_algorithms", [display_name(a) for a in ("ring", "mod_n")], LABELS),
    Choice("p12_cache", CACHES[0], CACHES),
    *replica_params("p12"),
    Choice("p12_capacity", "unlimited", CAPACITIES),
)
c1, c2, c3, c4 = st.columns(4)
replicas = links.slider(c1, "Replicas before the event", "p12_replicas")
action = links.selectbox(c2, "Event", "p12_action")
vnodes = links.select_slider(c3, "Ring vnodes", "p12_vnodes")
num_keys = links.select_slider(c4, "Random keys", "p12_keys")

part1, part2 = st.container(), st.container()
part2.subheader("2 · Hit ratio across the scale event (trace replay)")
d1, d2, d3, d4, d5 = part2.columns(5)
num_requests = links.slider(d1, "Requests (cap)", "p12_requests")
k = links.slider(d2, "Routing prefix depth k (blocks)", "p12_k")
at = links.slider(d3, "Event at (fraction of the trace)", "p12_at")
window = links.slider(d4, "Window (requests)", "p12_window")
seeds = links.slider(d5, "Synthetic traces averaged", "p12_seeds")
algo_labels = links.multiselect(part2, "Algorithms replayed (each costs a replay per trace)", "p12_algorithms")
cache_label = links.selectbox(part2, "Replica cache", "p12_cache")
real = REPLICA_CACHES[cache_label] == "policy"
replica = RealReplica()
capacity = "unlimited"
if real:   # the GPUs and TP sizes offered are those the model's weights fit in
    replica = real_replica(links, part2)
else:
    capacity = links.select_slider(part2, "Cache per replica (blocks of 512 tokens)", "p12_capacity")
upload = part2.file_uploader("Mooncake trace (JSONL, optional)", type=["jsonl", "json"], key="p12_upload")
if not algo_labels:
    part2.info("Pick at least one algorithm to replay.")
    st.stop()


@st.cache_data(show_spinner="Moving keys and replaying the trace…", max_entries=32, ttl="1h")
def _run(replicas, action, num_keys, vnodes, n, k, at, window, capacity, upload_bytes, upload_name, replica_cache,
         algorithms, seeds, replica):
    return fleet_scaling(replicas, action, num_keys, vnodes, n, k, at, window, capacity, upload_bytes, upload_name,
                         replica_cache=replica_cache, algorithms=algorithms, seeds=seeds, replica=replica)


algorithms = tuple(a for a in KEY_ROUTERS if display_name(a) in algo_labels)
run = engine_call(_run, replicas, action, num_keys, vnodes, num_requests, k, at, window, capacity, *upload_parts(upload),
                  REPLICA_CACHES[cache_label], algorithms, seeds, replica)
moved, n_after, anchors = run.moved, run.replicas_after, run.anchors
with part1:
    st.subheader(f"1 · Keys moved going from {replicas} to {n_after} replicas")
    fig = go.Figure(go.Bar(x=moved.algorithm.map(display_name), y=moved.moved_fraction, name="measured here"))
    big = max(replicas, n_after)   # ideal 1/big and mod-N 1 - 1/big meet at big = 2: labels on opposite ends,
    fig.add_hline(y=moved.ideal.iloc[0], line_dash="dash", annotation_text=f"ideal 1/{big}",   # each above the end
                  annotation_position="top right")            # whose bar stops at its line (on the mod-N bar: hidden)
    fig.add_hline(y=moved.mod_n_expected.iloc[0], line_dash="dot", annotation_text=f"mod-N expected 1 − 1/{big}",
                  annotation_position="top left")
    fig.update_layout(xaxis_title="algorithm", yaxis_title="keys that change replica (% of keys)",
                      yaxis_tickformat=".0%")
    show_chart(fig, moved, key="p12_moved_chart")
    st.caption(f"{num_keys:,} random keys. Published: {anchors['ring_moves']}; {anchors['jump_moves']}; "
               f"{anchors['mod_n_moves']}.")
    with st.expander("Why Maglev and jump hash differ from the minimum"):
        st.markdown("Maglev refills its lookup table, so it moves a little more than the minimum. Jump hash can only "
                    "drop the last bucket cheaply: removing the last replica here is its best case.")

with part2:
    df, dip, at_request, n_trace, n_keys = run.dip, run.recovery, run.at_request, run.num_requests, run.routing_keys
    if run.note:
        st.info(run.note)
    fig2 = go.Figure()
    palette = ["#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a"]
    for (name, g), color in zip(df.groupby("algorithm", sort=False), palette):
        label = display_name(name)
        if run.seeds > 1:
            fig2.add_trace(go.Scatter(x=[*g.request, *g.request[::-1]], y=[*(100 * g.change_hi), *(100 * g.change_lo[::-1])],
                                      fill="toself", fillcolor=color, opacity=0.15, line=dict(width=0),
                                      hoverinfo="skip", showlegend=False, legendgroup=label))
        fig2.add_trace(go.Scatter(x=g.request, y=100 * g.change, name=label, mode="lines", line=dict(color=color),
                                  legendgroup=label))
    # the event's label inside the top of the plot, beside its line on the side with room (at the bottom it sat on
    # the x axis); "no event" above the zero line, which after a dip is the top of the axis
    fig2.add_vline(x=at_request, line_dash="dash", annotation_text=f"{action} a replica",
                   annotation_position="top right" if at_request < 0.7 * n_trace else "top left")
    fig2.add_hline(y=0, line_dash="dot", annotation_text="no event", annotation_position="top left")
    fig2.update_layout(xaxis_title="request index (window start)",
                       yaxis_title=f"hit ratio change vs no event (percentage points, per {window} requests)",
                       legend=dict(orientation="h", y=-0.25))
    show_chart(fig2, df, key="p12_dip_chart")
    st.caption(f"Mean of {run.seeds} synthetic traces (seeds 0–{run.seeds - 1}); band: lowest to highest trace. Each "
               "trace is also replayed without the event and the chart shows the difference: 0 before the event."
               if run.seeds > 1 else "One trace, also replayed without the event; the chart shows the difference "
               "(0 before the event).")
    if n_keys == 1:
        st.warning(f"All requests share their first {k} block(s) (a shared system prompt), so there is one routing key: "
                   "every algorithm sends the whole trace to one replica and the lines coincide. Route on more blocks.")
    table = dip.assign(algorithm=dip.algorithm.map(display_name), points_lost=100 * dip.hit_ratio_lost,
                       recover=[f"{int(v):,}" if v == v else "not within the trace" for v in dip.requests_to_recover])
    columns = {"algorithm": "Algorithm", "hit_ratio_before": pct("Hit before"), "lowest_after": pct("Lowest after"),
               "points_lost": num(f"Points lost ({run.dip_windows} windows)", "%.1f"),
               "recover": "Requests to recover ½", "hit_ratio_no_event": pct("Hit, no-event run")}
    if real:
        columns["lost_no_event"] = pct("KV without state")
    show_table(table, columns)
    m1, m2 = st.columns(2)
    m1.metric("block ideal", f"{run.ideal_ratio:.1%}", help="The token hit ratio of one shared, infinite block "
          "cache: the most any routing can reach on this trace.")
    m2.metric("cache per replica", f"{run.budget_gb:,.0f} GB" if real else
              ("unlimited" if capacity == "unlimited" else f"{int(capacity):,} blocks"))
    st.caption(f"{n_trace:,} requests per trace (cap {num_requests:,}); the trace ends {n_trace - at_request:,} requests "
               "after the event. What to notice: mod-N reshuffles almost every prefix and loses most of its hit ratio; "
               "the consistent schemes lose only the moved share (~1/(n+1)) of prefixes.")
    with st.expander("How the table's columns are computed"):
        st.markdown(
            "- **Hit before** / **Lowest after**: token hit ratio of the windows before the event / the lowest window "
            "after it. **Hit, no-event run**: the whole trace replayed without the event. **KV without state**: prompt "
            "tokens whose KV the replica held but no KDA state let it reuse (no-event run).\n"
            f"- **Points lost** (hit ratio lost): the mean, over the first {run.dip_windows} windows ({run.dip_windows * window:,} "
            "requests) from the event, of max(0, hit ratio without the event − hit ratio with it), averaged over the "
            "traces. Pairing each trace with its own no-event replay removes the trace's swing from the measure.\n"
            "- **Requests to recover ½** (half the loss): requests from the event to the first window from which the "
            f"loss, averaged over {SMOOTH_WINDOWS} windows, is at most half the hit ratio lost, in whole windows.\n"
            "- Routing-only replay (no timing): each request is cached on its replica as soon as it is routed. "
            + (f"Each replica is the {replica_title(replica)} (a prefix-cache policy model) at real "
               "bytes (KV + KDA states + the running request's state slots within the budget); a hit needs a state "
               "at its boundary, so hit ratio + KV cached without a state ≤ the block ideal (one infinite shared "
               "cache). " if real else "Each replica's cache is an LRU set of 512-token blocks. ")
            + "The synthetic traces are `serve.traces.mooncake.synthesize` with seeds 0, 1, …")
