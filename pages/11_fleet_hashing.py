"""11 Fleet hashing: where each request's prefix lands, load per replica, balance vs vnodes, lookup cost."""
import plotly.graph_objects as go
import streamlit as st

from lab.fleet import (
    ANCHORS,
    ideal_ratio,
    measure_lookup_us,
    page_trace,
    ring_balance_vs_vnodes,
    routing_load,
    where_prefix_lands,
)
from pages._common import engine_call, persist, show_chart
from serve.fleet import ROUTERS
from serve.traces import upload_parts

st.title("Fleet hashing")
st.write(
    "Each request is routed on the chained hash of its first **k** prompt blocks, so requests that share that "
    "prefix land on the replica that already caches it. Below: the load each algorithm puts on every replica for "
    "a trace, how the consistent-hash ring's balance improves with virtual nodes, and the lookup cost measured "
    "on this CPU. The default trace is synthetic (Mooncake schema); upload a Mooncake JSONL file to use your own.")

VNODES = [1, 4, 10, 40, 100, 160, 400, 1000]
c1, c2, c3, c4 = st.columns(4)
replicas = c1.slider("Replicas", 2, 32, key=persist("p11_replicas", 8, min_value=2, max_value=32), persist_state="session")
vnodes = c2.select_slider("Virtual nodes per replica (ring)", VNODES, key=persist("p11_vnodes", 160, options=VNODES), persist_state="session")
algorithm = c3.selectbox("Algorithm", list(ROUTERS), key=persist("p11_algorithm", "ring", options=list(ROUTERS)), persist_state="session")
k = c4.slider("Routing prefix depth k (blocks)", 1, 8, key=persist("p11_k", 2, min_value=1, max_value=8), persist_state="session")
d1, d2 = st.columns([1, 2])
num_requests = d1.slider("Requests (cap)", 200, 5000, step=100, key=persist("p11_requests", 2000, min_value=200, max_value=5000), persist_state="session")
upload = d2.file_uploader("Mooncake trace (JSONL, optional)", type=["jsonl", "json"], key="p11_upload")


@st.cache_data(show_spinner="Routing the trace…", max_entries=16, ttl="1h")
def _load(upload_bytes, upload_name, n, algorithm, replicas, k, vnodes):
    trace, note, _ = page_trace(upload_bytes, n, name=upload_name)
    return trace, routing_load(trace, algorithm, replicas, k, vnodes=vnodes), ideal_ratio(trace), note


trace, load, ideal, cut = engine_call(_load, *upload_parts(upload), num_requests, algorithm, replicas, k, vnodes)
if cut:
    st.info(cut)
hit = load.hit_tokens.sum() / max(1, load.tokens.sum())
st.subheader("1 · Requests per replica")
fig = go.Figure(go.Bar(x=load.replica, y=load.requests, name="requests"))
fig.add_hline(y=load.requests.mean(), line_dash="dot", annotation_text="mean")
fig.update_layout(xaxis_title="replica", yaxis_title="requests routed (count)")
show_chart(fig, load, key="p11_load_chart")
m1, m2, m3 = st.columns(3)
m1.metric("max / mean load", f"{load.requests.max() / load.requests.mean():.2f}")
m2.metric("token hit ratio (per-replica caches)", f"{hit:.3f}")
m3.metric("ideal (one shared cache)", f"{ideal:.3f}")
if load.requests.max() == len(trace):
    st.warning(f"Every request went to one replica: all prompts share their first {k} block(s) (a shared system "
               "prompt), so a routing key that short has a single value. Route on more blocks.")
st.caption(f"{len(trace):,} requests (cap {num_requests:,}). Routing-only replay: each request's blocks are cached on "
           "its replica as soon as it is routed (no timing; page 14 adds queues and service times).")

st.subheader("2 · Ring balance vs virtual nodes")


@st.cache_data(max_entries=16, ttl="1h")
def _balance(replicas):
    return ring_balance_vs_vnodes(replicas, VNODES)


bal = _balance(replicas)
fig2 = go.Figure()
fig2.add_trace(go.Scatter(x=bal.vnodes, y=bal.relative_spread, name="measured spread (std / mean share)", mode="lines+markers"))
fig2.add_trace(go.Scatter(x=bal.vnodes, y=bal.one_over_sqrt_v, name="1/√V reference", mode="lines", line=dict(dash="dot")))
fig2.add_trace(go.Scatter(x=bal.vnodes, y=bal.max_over_mean - 1, name="max/mean − 1", mode="lines+markers"))
fig2.update_layout(xaxis_title="virtual nodes per replica V (log)", yaxis_title="imbalance (fraction, log)",
                   xaxis=dict(type="log", tickvals=VNODES), yaxis=dict(type="log", tickvals=[m * 10.0 ** e for e in range(-3, 2) for m in (1, 2, 5)], tickformat="~r"),
                   legend=dict(orientation="h", y=-0.25))
show_chart(fig2, bal, key="p11_balance_chart")
st.caption(f"Exact arc shares of a ketama ring with {replicas} replicas (md5 points, as libketama / uhashring). "
           f"Published: {ANCHORS['ring_spread']}. {ANCHORS['maglev_balance']}.")

st.subheader("3 · Lookup cost, measured on this CPU")


@st.cache_data(show_spinner="Timing lookups…", max_entries=16, ttl="1h")
def _lookup(replicas, vnodes):
    return measure_lookup_us(replicas, vnodes)


cost = _lookup(replicas, vnodes)
fig3 = go.Figure(go.Bar(x=cost.algorithm, y=cost.us_per_key))
fig3.update_layout(xaxis_title="algorithm", yaxis_title="time per lookup (µs, median of 3 × 2,000 keys)")
show_chart(fig3, cost, key="p11_cost_chart")
st.caption("Pure-Python route() per key: ring = binary search over V·n points; rendezvous = n hashes; jump = "
           "O(log n) loop; Maglev = one table read; bounded loads walks the ring past full replicas.")

st.subheader("4 · Where one request's prefix lands")
if type(st.session_state.get("p11_index")) is int and st.session_state["p11_index"] > len(trace) - 1:  # cap shrank
    st.session_state["p11_index"] = len(trace) - 1
idx = st.number_input("Request index", 0, len(trace) - 1, key=persist("p11_index", 1, min_value=0, max_value=len(trace) - 1), persist_state="session")
where = engine_call(where_prefix_lands, trace, int(idx), replicas, k, vnodes)
st.dataframe(where, hide_index=True, width="stretch")
st.caption(f"What to notice: the key is blake2b chained over the first {k} block ids, so every request sharing "
           "those blocks gets the same key and the same replica under every key-based algorithm.")
