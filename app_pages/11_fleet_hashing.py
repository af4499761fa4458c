"""11 Fleet hashing: where each request's prefix lands, load per replica, balance vs vnodes, lookup cost."""
import plotly.graph_objects as go
import streamlit as st

from app_pages.caching import upload_parts
from app_pages.charts import num, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import measured_stamp, remeasure_button
from app_pages.params import Choice, Int
from app_pages.replica import real_replica, replica_params
from lab.fleet import LOOKUP_KEYS, REPLICA_CACHES, display_name
from lab.fleet_hashing import ALGORITHMS, VNODES, fleet_hashing, lookup_cost
from lab.fleet_simulation import RealReplica, replica_title

st.title("Fleet hashing")
st.write(
    "Each request is routed on the chained hash of its first **k** prompt blocks, so requests that share that "
    "prefix land on the replica that already caches it. Below: the load each algorithm puts on every replica for "
    "a trace and the hit ratio of the replicas' caches (by default Kimi-Linear's prefix cache at real bytes on "
    "8 × H200, where a hit needs a KDA state), how the consistent-hash ring's balance improves with virtual nodes, "
    "and the lookup cost measured on this CPU. The default trace is synthetic (Mooncake schema); upload a "
    "Mooncake JSONL file to use your own.")

LABELS = {display_name(a): a for a in ALGORITHMS}
CACHES = list(REPLICA_CACHES)
MAX_REQUESTS = 5000
links = declare(
    Int("p11_replicas", 8, 2, 32),
    Choice("p11_vnodes", 160, VNODES),
    Choice("p11_algorithm", display_name("ring"), LABELS),
    Int("p11_k", 2, 1, 8),
    Choice("p11_cache", CACHES[0], CACHES),
    *replica_params("p11"),
    Int("p11_requests", 2000, 200, MAX_REQUESTS, step=100),
    Int("p11_index", 1, 0, MAX_REQUESTS - 1),   # a request of the trace (at most the cap)
)
c1, c2, c3, c4 = st.columns(4)
replicas = links.slider(c1, "Replicas", "p11_replicas")
vnodes = links.select_slider(c2, "Virtual nodes per replica (ring)", "p11_vnodes")
algorithm = LABELS[links.selectbox(c3, "Algorithm", "p11_algorithm")]
k = links.slider(c4, "Routing prefix depth k (blocks)", "p11_k")

cache_label = links.selectbox(st, "Replica cache", "p11_cache")
real = REPLICA_CACHES[cache_label] == "policy"
replica = real_replica(links) if real else RealReplica()
d1, d2 = st.columns([1, 2])
num_requests = links.slider(d1, "Requests (cap)", "p11_requests")
upload = d2.file_uploader("Mooncake trace (JSONL, optional)", type=["jsonl", "json"], key="p11_upload")


@st.cache_data(show_spinner="Routing the trace…", max_entries=32, ttl="1h")
def _run(algorithm, replicas, k, vnodes, n, upload_bytes, upload_name, replica_cache, replica):
    return fleet_hashing(algorithm, replicas, k, vnodes, n, upload_bytes, upload_name, replica_cache=replica_cache,
                         replica=replica)


run = engine_call(_run, algorithm, replicas, k, vnodes, num_requests, *upload_parts(upload), REPLICA_CACHES[cache_label],
                  replica)
load, hit, ideal, n_trace, anchors = run.load, run.hit_ratio, run.ideal_ratio, run.num_requests, run.anchors
if run.note:
    st.info(run.note)
st.subheader("1 · Requests per replica")
fig = go.Figure(go.Bar(x=load.replica, y=load.requests, name="requests"))
fig.add_hline(y=load.requests.mean(), line_dash="dot", annotation_text=f"mean {load.requests.mean():,.0f}")
fig.update_layout(xaxis_title="replica", yaxis_title="requests routed (count)")
show_chart(fig, load, key="p11_load_chart")
m1, m2, m3, m4 = st.columns(4)
m1.metric("max / mean load", f"{load.requests.max() / load.requests.mean():.2f}")
m2.metric("token hit ratio (per-replica caches)", f"{hit:.1%}")
m3.metric("block ideal", f"{ideal:.1%}", help="The token hit ratio of one shared, infinite block cache: the most "
          "any routing can reach on this trace.")
if real:
    m4.metric("KV cached, no state to reuse it", f"{run.lost_ratio:.1%}",
              help="Prompt tokens whose KV the serving replica held but that no KDA state let it skip, as a share "
                   "of all prompt tokens (the policy cache's lost-to-missing-state counter).")
if load.requests.max() == n_trace:
    st.warning(f"Every request went to one replica: all prompts share their first {k} block(s) (a shared system "
               "prompt), so a routing key that short has a single value. Route on more blocks.")
where_cache = (f"{replica_title(replica)}: {run.budget_gb:,.0f} GB per replica" if real else
               "an unlimited block LRU cache per replica")
st.caption(f"{n_trace:,} requests (cap {num_requests:,}); {where_cache}. Routing-only replay: each request is "
           "cached on its replica as soon as it is routed (no timing; page 14 adds queues and service times).")
with st.expander("Hit ratio vs the block ideal"):
    st.markdown("The **block ideal** counts, per request, the tokens of its leading blocks seen in any earlier "
                "request: one infinite cache shared by all replicas. A replica's cache misses what other replicas "
                "hold (routing), what its budget evicted and, with a KDA model, what it holds as KV but cannot "
                "reuse without a state at that boundary (the policy caches a state only at its checkpoints). "
                "So hit ratio + KV cached without a state ≤ block ideal.")

st.subheader("2 · Ring balance vs virtual nodes")


bal = run.balance
fig2 = go.Figure()
fig2.add_trace(go.Scatter(x=bal.vnodes, y=bal.relative_spread, name="measured spread (std / mean share)", mode="lines+markers"))
fig2.add_trace(go.Scatter(x=bal.vnodes, y=bal.one_over_sqrt_v, name="1/√V reference", mode="lines", line=dict(dash="dot")))
fig2.add_trace(go.Scatter(x=bal.vnodes, y=bal.max_over_mean - 1, name="max/mean − 1", mode="lines+markers"))
fig2.update_layout(xaxis_title="virtual nodes per replica V (log)", yaxis_title="imbalance (fraction, log)",
                   xaxis=dict(type="log", tickvals=list(VNODES)), yaxis=dict(type="log", tickvals=[m * 10.0 ** e for e in range(-3, 2) for m in (1, 2, 5)], tickformat="~r"),
                   legend=dict(orientation="h", y=-0.25))
show_chart(fig2, bal, key="p11_balance_chart")
st.caption(f"Exact arc shares of a ketama ring with {replicas} replicas (md5 points, as libketama / uhashring). "
           f"Published: {anchors['ring_spread']}. {anchors['maglev_balance']}.")

st.subheader("3 · Lookup cost, measured on this CPU")
_p11_lookup = st.cache_data(lookup_cost, show_spinner="Timing every router's lookups…", max_entries=32, ttl="1h")
remeasure_button(_p11_lookup, key="p11_remeasure")
lookup = engine_call(_p11_lookup, replicas, vnodes)
cost = lookup.table
fig3 = go.Figure(go.Bar(x=cost.algorithm.map(display_name), y=cost.us_per_key, name="median", error_y=dict(
    type="data", symmetric=False, array=cost.q3_us - cost.us_per_key, arrayminus=cost.us_per_key - cost.q1_us)))
fig3.update_layout(xaxis_title="algorithm", yaxis_title="time per lookup (µs; median, bars = IQR)")
show_chart(fig3, cost, key="p11_cost_chart")
measured_stamp(lookup.conditions)
st.caption(f"Each repeat routes {LOOKUP_KEYS:,} random keys; time per lookup = the repeat's time ÷ {LOOKUP_KEYS:,}. "
           "Pure-Python route() per key: ring = binary search over V·n points; rendezvous = n hashes; jump = "
           "O(log n) loop; Maglev = one table read; bounded loads walks the ring past full replicas.")

st.subheader("4 · Where one request's prefix lands")
idx = links.number_input(st, "Request index", "p11_index", max_value=n_trace - 1)   # the cap may shrink
where = run.landing[run.landing.request == idx].assign(algorithm=lambda d: d.algorithm.map(display_name))
show_table(where, {"algorithm": "Algorithm", "replica": "Replica", "routing_key": "Routing key (hex)",
                   "prefix_blocks": num("Prefix (blocks)"), "requests_sharing_prefix": num("Requests sharing the prefix")})
st.caption(f"What to notice: the key is blake2b chained over the first {k} block ids, so every request sharing "
           "those blocks gets the same key and the same replica under every key-based algorithm.")
