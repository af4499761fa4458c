"""13 Fleet budgets: per-class token buckets + a VTC fair scheduler vs plain FCFS under a burst."""
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from pages._common import engine_call, persist, show_chart
from serve.fleet.budgets import PriorityClass
from serve.fleet.experiments import ANCHORS, default_service
from serve.fleet.scenarios import Stream, budget_frames, budget_traffic, run_budget_scenario
from serve.fleet.sim_types import FleetConfig
from serve.fleet.vtc import on_off_less_service, replay_on_off_less
from serve.traces import load_azure_csv

st.title("Fleet budgets")
st.write(
    "Three classes share the fleet: VIP, standard and batch. A burst from one class should not wreck another "
    "class's latency. *Without isolation* every replica serves FCFS and nothing is rate-limited; *with "
    "isolation* each class passes a token bucket at admission (cost = prompt + output tokens) and every replica "
    "runs the virtual-token-counter fair scheduler (VTC, OSDI'24) with the class weights. Same traffic, same "
    "simulated replicas (discrete-event simulation).")

c1, c2, c3, c4 = st.columns(4)
vip_rate = c1.slider("VIP rate (req/s)", 0.2, 5.0, step=0.2, key=persist("p13_vip_rate", 1.0))
std_rate = c2.slider("Standard rate (req/s)", 0.5, 10.0, step=0.5, key=persist("p13_std_rate", 3.0))
vip_weight = c3.slider("VIP weight", 1, 8, key=persist("p13_vip_weight", 4))
std_budget = c4.slider("Standard budget (tokens/s)", 1000, 40000, step=1000, key=persist("p13_std_budget", 8000))
b1, b2, b3, b4 = st.columns(4)
burst_class = b1.selectbox("Burst class", ["standard", "batch", "vip"], key=persist("p13_burst_class", "standard"))
burst_n = b2.slider("Burst size (requests)", 0, 3000, step=100, key=persist("p13_burst_n", 1500))
burst_s = b3.slider("Burst duration (s)", 5, 60, step=5, key=persist("p13_burst_s", 30))
replicas = b4.slider("Replicas", 1, 8, key=persist("p13_replicas", 2))
azure = st.file_uploader("Burst shape from an Azure LLM trace CSV (optional; default: uniform generator)",
                         type=["csv"], key="p13_azure")

CLASSES = (PriorityClass("vip", float(vip_weight)),
           PriorityClass("standard", 1.0, rate_tokens_per_s=float(std_budget), burst_tokens=5.0 * std_budget),
           PriorityClass("batch", 0.5, rate_tokens_per_s=3000.0, burst_tokens=20000.0))


@st.cache_data(show_spinner="Simulating both runs…")
def _run(vip_rate, std_rate, classes, burst_class, burst_n, burst_s, replicas, azure_bytes):
    import io

    steady = [Stream("vip", vip_rate, 256, 64), Stream("standard", std_rate, 1024, 128), Stream("batch", 0.5, 2048, 256)]
    shape = load_azure_csv(io.BytesIO(azure_bytes)) if azure_bytes else None
    requests = budget_traffic(steady, 120.0, burst_class, burst_n, 30.0, float(burst_s), 1024, 128, azure=shape)
    service = default_service(on_off_less_service(), 8, 5, 400_000)
    run = run_budget_scenario(requests, classes, FleetConfig(service=service, num_replicas=replicas,
                                                             router="least_loaded", cache_capacity_blocks=0))
    return budget_frames(run, classes), service.source, len(requests)


(per_request, summary, budget), source, n_req = engine_call(
    _run, vip_rate, std_rate, CLASSES, burst_class, burst_n, burst_s, replicas, azure.getvalue() if azure else None)

st.subheader("1 · TTFT per class, with and without isolation")
done = per_request[per_request.status == "completed"]
fig = go.Figure()
for label, g in done.groupby("isolation", sort=False):
    fig.add_trace(go.Box(x=g.klass, y=g.ttft_ms, name=label, boxpoints=False))
fig.update_layout(boxmode="group", xaxis_title="class", yaxis_title="TTFT (ms, log)", yaxis_type="log",
                  legend=dict(orientation="h", y=-0.25))
show_chart(fig, done[["isolation", "klass", "request_id", "ttft_ms", "queue_wait_ms", "e2e_ms"]], key="p13_ttft_chart")
p99 = summary.set_index(["isolation", "class"]).ttft_p99_ms
m1, m2 = st.columns(2)
m1.metric("VIP P99 TTFT with isolation", f"{p99.get(('with isolation', 'vip'), float('nan')):,.0f} ms")
m2.metric("VIP P99 TTFT without isolation", f"{p99.get(('without isolation', 'vip'), float('nan')):,.0f} ms")
st.dataframe(summary, hide_index=True, width="stretch")
st.caption(f"{n_req:,} requests over 120 s; burst of {burst_n:,} {burst_class} requests from t = 30 s. Replicas: "
           f"{source}. What to notice: VTC serves the class with the smallest token counter first and the bucket "
           "caps what the bursting class can admit, so VIP keeps its TTFT while the burst waits in its own queue.")

st.subheader("2 · Tokens admitted vs budget (with isolation)")
if budget.empty:
    st.info("No bucketed class admitted anything in this run.")
else:
    fig2 = go.Figure()
    for klass, g in budget.groupby("class", sort=False):
        fig2.add_trace(go.Scatter(x=g.time_s, y=g.admitted_tokens, name=f"{klass}: admitted", mode="lines"))
        fig2.add_trace(go.Scatter(x=g.time_s, y=g.budget_tokens, name=f"{klass}: budget (burst + rate·t)",
                                  mode="lines", line=dict(dash="dot")))
    fig2.update_layout(xaxis_title="time (s)", yaxis_title="cumulative tokens (prompt + output)",
                       legend=dict(orientation="h", y=-0.25))
    show_chart(fig2, budget, key="p13_budget_chart")
    st.caption("The admitted line never crosses the budget line: a class's admitted tokens ≤ burst + rate · t.")

st.subheader("3 · Our simulator vs the VTC artifact's measurements")


@st.cache_data(show_spinner="Replaying the VTC on_off_less suite…")
def _vtc():
    cmp = replay_on_off_less()
    return cmp.rows, cmp.measured_throughput_rps, cmp.ours_throughput_rps, cmp.light_client


rows, tp_measured, tp_ours, light = _vtc()
vdf = pd.DataFrame([r._asdict() for r in rows])
vdf["client"] = vdf.client.map(lambda c: "light (0.5 req/s, on/off)" if c == light else "heavy (2 req/s)")
fig3 = go.Figure()
fig3.add_trace(go.Bar(x=vdf.scheduler + " · " + vdf.client, y=vdf.measured_p99_s, name="published (measured, A10G)"))
fig3.add_trace(go.Bar(x=vdf.scheduler + " · " + vdf.client, y=vdf.ours_p99_s, name="measured here (our simulator)"))
fig3.update_layout(barmode="group", xaxis_title="scheduler · client", yaxis_title="P99 TTFT (s, log)", yaxis_type="log",
                   legend=dict(orientation="h", y=-0.25))
show_chart(fig3, vdf, key="p13_vtc_chart")
st.caption(f"Published: {ANCHORS['vtc']}. Our replay rebuilds the suite's 1,350 arrivals (256/256 tokens) and runs "
           f"one replica calibrated to the measured FCFS throughput: ours {tp_ours['FCFS']:.3f} vs measured "
           f"{tp_measured['FCFS']:.3f} req/s (FCFS), {tp_ours['VTC']:.3f} vs {tp_measured['VTC']:.3f} (VTC).")
