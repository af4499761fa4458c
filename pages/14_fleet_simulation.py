"""14 Fleet simulation: router → replicas with prefix caches and schedulers, policies side by side."""
import math

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from lab.fleet import ANCHORS, default_service, ideal_ratio, page_trace, scale_events_for, simulate_policies
from pages._common import engine_call, persist, show_chart
from serve.fleet import ROUTERS
from serve.fleet.budgets import PriorityClass
from serve.fleet.service_model import cpu_engine_preset, measure_cpu_engine
from serve.fleet.sim_types import FleetConfig
from serve.fleet.vtc import on_off_less_service
from serve.traces import upload_parts

st.title("Fleet simulation")
st.write(
    "The whole chain on a trace: each request is routed on its first k blocks, waits in its replica's scheduler, "
    "prefills only the tokens its replica has not cached (per-replica LRU block cache), then decodes under "
    "continuous batching. Several routing policies run on the same trace so hit ratio, TTFT per class and load "
    "balance can be compared side by side. Default trace: synthetic (Mooncake schema, ~3.4 req/s like the "
    "conversation trace); upload a Mooncake JSONL file to use your own.")

c1, c2, c3, c4 = st.columns(4)
num_requests = c1.slider("Requests (cap)", 200, 5000, step=100, key=persist("p14_requests", 2000, min_value=200, max_value=5000), persist_state="session")
replicas = c2.slider("Replicas", 1, 16, key=persist("p14_replicas", 8, min_value=1, max_value=16), persist_state="session")
k = c3.slider("Routing prefix depth k (blocks)", 1, 4, key=persist("p14_k", 2, min_value=1, max_value=4), persist_state="session")
capacity = c4.select_slider("Cache per replica (blocks of 512 tokens)", ["0", "500", "2000", "8000", "unlimited"],
                            key=persist("p14_capacity", "8000", options=["0", "500", "2000", "8000", "unlimited"]), persist_state="session")
d1, d2, d3, d4 = st.columns(4)
scheduler = d1.selectbox("Replica scheduler", ["fcfs", "vtc"], key=persist("p14_scheduler", "vtc", options=["fcfs", "vtc"]), persist_state="session")
vip_pct = d2.slider("VIP share of requests (%)", 0, 50, step=5, key=persist("p14_vip", 10, min_value=0, max_value=50), persist_state="session")
scale = d3.selectbox("Scale event at half time", ["none", "add", "remove"], key=persist("p14_scale", "none", options=["none", "add", "remove"]), persist_state="session")
speed = d4.slider("Replica speed-up (prefill ×; decode × 5/8 of it)", 1, 20, key=persist("p14_speed", 8, min_value=1, max_value=20), persist_state="session")
MODELS = ["A10G · Llama-7B (VTC artifact, measured)", "this CPU · our KDA demo engine (measured now)"]
model = st.selectbox("Replica service model (before the speed-up)", MODELS, key=persist("p14_model", MODELS[0], options=MODELS), persist_state="session")
policies = st.multiselect("Routing policies", list(ROUTERS), key=persist("p14_policies", ["ring", "round_robin",
                                                                                          "cache_aware", "bounded_load"], options=list(ROUTERS)), persist_state="session")
upload = st.file_uploader("Mooncake trace (JSONL, optional)", type=["jsonl", "json"], key="p14_upload")
if not policies:
    st.info("Pick at least one routing policy.")
    st.stop()


@st.cache_data(show_spinner="Timing our engine on this CPU…", max_entries=16, ttl="1h")
def _cpu_service():
    return cpu_engine_preset(measure_cpu_engine())


@st.cache_data(show_spinner=False, max_entries=16, ttl="1h")
def _run(upload_bytes, upload_name, n, replicas, k, capacity, scheduler, vip_pct, scale, speed, policy, model):
    trace, note, _ = page_trace(upload_bytes, n, name=upload_name)
    base = on_off_less_service() if model == MODELS[0] else _cpu_service()
    service = default_service(base, float(speed), max(1.0, speed * 5 / 8), 400_000)
    cfg = FleetConfig(service=service, num_replicas=replicas, routing_k=k, scheduler=scheduler,
                      router_params={"vnodes": 160},
                      cache_capacity_blocks=None if capacity == "unlimited" else int(capacity),
                      classes=(PriorityClass("vip", 4.0), PriorityClass("standard", 1.0)),
                      scale_events=scale_events_for(replicas, None if scale == "none" else scale,
                                                    trace[-1].timestamp_ms / 2))
    every = round(100 / vip_pct) if vip_pct else 0

    def class_of(i):
        return "vip" if every and i % every == 0 else "standard"

    per_request, summary = simulate_policies(trace, [policy], cfg, class_of)
    return per_request, summary, ideal_ratio(trace), len(trace), service.source, note


bar = st.progress(0.0, text="Simulating…")
parts = []
for i, policy in enumerate(policies):  # one cached simulation per policy; the bar advances between them
    bar.progress(i / len(policies), text=f"Simulating {policy} ({i + 1}/{len(policies)})…")
    parts.append(engine_call(_run, *upload_parts(upload), num_requests, replicas, k, capacity,
                             scheduler, vip_pct, scale, speed, policy, model))
bar.empty()
per_request = pd.concat([p[0] for p in parts], ignore_index=True)
summary = pd.concat([p[1] for p in parts], ignore_index=True)
ideal, n_trace, source, cut = parts[0][2:]
if cut:
    st.info(cut)

overall = summary[summary["class"] == "all"]
st.subheader("1 · Prefix-cache hit ratio per policy")
fig = go.Figure(go.Bar(x=overall.policy, y=overall.hit_ratio, name="measured here",
                       text=[f"{v:.3f}" for v in overall.hit_ratio], textposition="outside"))
fig.add_hline(y=ideal, line_dash="dash", annotation_text=f"ideal (one infinite shared cache) {ideal:.3f}")
fig.update_layout(xaxis_title="routing policy", yaxis_title="token hit ratio (cached / prompt tokens)",
                  yaxis_range=[0, max(ideal, overall.hit_ratio.max(), 0.05) * 1.15])
show_chart(fig, overall, key="p14_hit_chart")
st.caption(f"Published anchor: {ANCHORS['mooncake_cache']}.")

st.subheader("2 · TTFT per class (P50 and P99)")
per_class = summary[summary["class"] != "all"]
fig2 = go.Figure()
for stat in ("ttft_p50_ms", "ttft_p99_ms"):
    for klass, g in per_class.groupby("class", sort=False):
        fig2.add_trace(go.Bar(x=g.policy, y=g[stat], name=f"{klass} {stat[5:8].upper()}", texttemplate="%{y:,.0f}",
                              textposition="outside", textfont_size=10))
lo_ms = max(1.0, float(per_class[["ttft_p50_ms", "ttft_p99_ms"]].min().min()))
hi_ms = max(lo_ms * 10, float(per_class[["ttft_p50_ms", "ttft_p99_ms"]].max().max()))
fig2.update_layout(barmode="group", xaxis_title="routing policy", yaxis_title="TTFT (ms, log; values on the bars)",
                   yaxis=dict(type="log", tickvals=[m * 10 ** e for e in range(8) for m in (1, 2, 5)], tickformat=",~r",
                              range=[math.floor(math.log10(lo_ms)), math.log10(hi_ms * 2)]),
                   legend=dict(orientation="h", y=-0.25))
show_chart(fig2, summary, key="p14_ttft_chart")

st.subheader("3 · Load balance")
fig3 = go.Figure(go.Bar(x=overall.policy, y=overall.max_over_mean_requests,
                        text=[f"{v:.2f}" for v in overall.max_over_mean_requests], textposition="outside"))
fig3.add_hline(y=1.0, line_dash="dot")
fig3.update_layout(xaxis_title="routing policy", yaxis_title="max / mean requests per replica (1 = perfect balance)")
show_chart(fig3, overall, key="p14_balance_chart")
st.dataframe(summary.style.format(precision=3, thousands=","), hide_index=True, width="stretch")
st.download_button("Download per-request results (CSV)", per_request.to_csv(index=False).encode(),
                   file_name="p14_requests.csv", mime="text/csv", key="p14_requests_csv")
st.caption(f"{n_trace:,} requests (cap {num_requests:,}), {replicas} replicas: {source}. Service model: prefill "
           "time = uncached tokens ÷ prefill rate; decode step time per batch size; rates calibrated on the VTC "
           "artifact's A10G measurements or timed on this CPU with our engine, then sped up by the stated (assumed) "
           "factors. What to notice: round-robin scatters "
           "sessions and loses most hits; hashing on k = 1 sends everything to one replica (shared system prompt); "
           "cache-aware routing trades some balance for hits.")
