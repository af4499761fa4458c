"""13 Fleet budgets: per-class token buckets + a VTC fair scheduler vs plain FCFS under a burst."""
import math

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from app_pages.caching import upload_parts
from app_pages.charts import num, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.params import Choice, Int
from app_pages.replica import real_replica, replica_params
from lab.budgets import (
    BATCH_BUDGET,
    BATCH_LOAD,
    BUCKET_DEPTH_S,
    BURST_CLASSES,
    CLASS_LABELS,
    DECODE_SPEEDUP,
    DEFAULTS,
    LOAD_BASES,
    PREFILL_SPEEDUP,
    REPLICA_MODELS,
    TOKENS,
    WITH,
    WITHOUT,
    budget_page,
    vtc_frame,
)
from lab.fleet import ANCHORS
from lab.fleet_simulation import RealReplica

st.title("Fleet budgets")
st.write(
    "Three classes share the fleet: VIP, Standard and Batch. A burst from one class should not wreck another "
    "class's latency. *Without isolation* every replica serves FCFS and nothing is rate-limited; *with "
    "isolation* each class passes a token bucket at admission (cost = prompt + output tokens) and every replica "
    "runs the virtual-token-counter fair scheduler (VTC, OSDI'24) with the class weights. Same traffic, same "
    "simulated replicas (discrete-event simulation); by default each replica is Kimi-Linear on 8 × H200 with "
    "roofline step times. Every rate is a share of a capacity: by default a reference fleet's (the model on 8 × "
    "H200), so another GPU or TP gets the same requests/s and its roofline service times set the seconds.")


def _pct(key: str) -> int:
    return round(100 * DEFAULTS[key])   # loads and budgets: shown in % of capacity


REPLICAS = list(REPLICA_MODELS)
BASES = list(LOAD_BASES)
BURST_LABELS = [CLASS_LABELS[k] for k in BURST_CLASSES]
links = declare(
    Choice("p13_replica", REPLICAS[0], REPLICAS),
    *replica_params("p13", policy=False),
    Choice("p13_load_basis", BASES[0], BASES, format_func=LOAD_BASES.get),
    Int("p13_vip_load", _pct("vip_load"), 1, 20),
    Int("p13_standard_load", _pct("standard_load"), 5, 50, step=5),
    Int("p13_vip_weight", DEFAULTS["vip_weight"], 1, 8),
    Int("p13_standard_budget", _pct("standard_budget"), 10, 100, step=5),
    Choice("p13_burst_class", BURST_LABELS[0], BURST_LABELS),
    Int("p13_burst_load", _pct("burst_load"), 0, 400, step=25),
    Int("p13_burst_duration_s", DEFAULTS["burst_duration_s"], 5, 30, step=5),
    Int("p13_num_replicas", DEFAULTS["num_replicas"], 1, 8),
)
replica_label = links.selectbox(st, "Replica", "p13_replica")
service_model = REPLICA_MODELS[replica_label]
replica = RealReplica()
load_basis = "own"   # the A10G replica has no hardware choice: its loads are shares of its own capacity
if service_model == "roofline":   # the GPUs and TP sizes offered are those the model's weights fit in
    replica = real_replica(links, policy=False)
    load_basis = links.radio(st, "Loads are shares of", "p13_load_basis", horizontal=True)
else:
    st.caption(f"This replica's speed is **assumed**, not derived: the VTC artifact's A10G calibration (Llama-7B, "
               f"measured) sped up by prefill × {PREFILL_SPEEDUP:g} and decode × {DECODE_SPEEDUP:g}. The roofline "
               "cannot set it (it has neither Llama-7B's shape nor an A10G preset), so no GPU is offered and the loads "
               "are shares of this replica's own capacity.")
c1, c2, c3, c4 = st.columns(4)
vip_load = links.slider(c1, "VIP load (% of capacity)", "p13_vip_load")
std_load = links.slider(c2, "Standard load (% of capacity)", "p13_standard_load")
vip_weight = links.slider(c3, "VIP weight", "p13_vip_weight")
std_budget = links.slider(c4, "Standard budget (% of capacity)", "p13_standard_budget")
b1, b2, b3, b4 = st.columns(4)
burst_label = links.selectbox(b1, "Burst class", "p13_burst_class")
burst_class = BURST_CLASSES[BURST_LABELS.index(burst_label)]
burst_load = links.slider(b2, "Burst load (% of capacity)", "p13_burst_load")
burst_s = links.slider(b3, "Burst duration (s)", "p13_burst_duration_s")
replicas = links.slider(b4, "Replicas", "p13_num_replicas")
azure = st.file_uploader("Burst shape from an Azure LLM trace CSV (optional; default: uniform generator)",
                         type=["csv"], key="p13_azure")


@st.cache_data(show_spinner="Simulating both runs…", max_entries=32, ttl="1h")
def _run(vip_load, std_load, vip_weight, std_budget, burst_class, burst_load, burst_s, replicas, azure_bytes,
         azure_name, service_model, replica, load_basis):
    return budget_page(vip_load / 100, std_load / 100, vip_weight, std_budget / 100, burst_class, burst_load / 100,
                       burst_s, replicas, azure_bytes, azure_name, service_model, replica, load_basis)


_vtc = st.cache_data(vtc_frame, show_spinner="Replaying the VTC artifact's suite…", max_entries=1, ttl="1h")


def _decimals(v: float) -> int:
    """Decimals that keep two significant digits of ``v`` (0.017, 0.25, 6.5), none from 10 (41, 1,234)."""
    return max(0, 1 - math.floor(math.log10(abs(v)))) if v and math.isfinite(v) else 0


def secs(v: float) -> str:
    return f"{v:,.{_decimals(v)}f}"


run = engine_call(_run, vip_load, std_load, vip_weight, std_budget, burst_class, burst_load, burst_s, replicas,
                  *upload_parts(azure), service_model, replica, load_basis)
summary, budget, source, cap = run.summary, run.budget, run.service_source, run.capacity_rps
basis = run.basis_capacity_rps
if run.note:
    st.info(run.note)
offered = run.burst_requests / burst_s
of_what = ("of the reference fleet's capacity, "
           f"{basis[burst_class]:,.1f} req/s" if basis != cap else "of it")
st.caption(f"Fleet: {replicas} × {source}. Its capacity at {burst_label} lengths: {cap[burst_class]:,.1f} req/s; the "
           f"burst offers {burst_load}% {of_what} for {burst_s} s ({run.burst_requests:,} {burst_label} requests, "
           f"{offered:,.1f} req/s = {offered / cap[burst_class]:.0%} of this fleet's capacity).")
with st.expander("How the rates are derived from the fleet's capacity"):
    rows = pd.DataFrame([{"class": CLASS_LABELS[k], "prompt": TOKENS[k][0], "output": TOKENS[k][1],
                          "capacity_rps": cap[k], "basis_rps": basis[k], "rate_rps": run.rates_rps[k],
                          "budget": run.budget_tokens_per_s.get(k, math.nan)} for k in TOKENS])
    show_table(rows, {"class": "Class", "prompt": num("Prompt (tokens)", "%,d"), "output": num("Output (tokens)", "%,d"),
                      "capacity_rps": num("This fleet's capacity (req/s)", "%.1f"),
                      "basis_rps": num("Capacity the loads are shares of (req/s)", "%.1f"),
                      "rate_rps": num("Steady rate (req/s)", "%.2f"),
                      "budget": num("Bucket refill (tokens/s)", "%,.0f")})
    st.markdown(
        f"A class's capacity is the fleet's saturated throughput at its lengths (±25 % jitter per request): replicas "
        "× requests/s of one always-full replica, one prefill per request plus its share of full-batch decode steps. "
        "Rates are the lab's load factors times the capacity the loads are shares of (above: the reference fleet, "
        "the model on 8 × H200, or this fleet itself): VIP and "
        f"Standard from the sliders, Batch {BATCH_LOAD:.0%}. Buckets refill at the Standard budget (slider) and Batch "
        f"{BATCH_BUDGET:.0%} of the capacity in tokens/s, and hold {BUCKET_DEPTH_S:.0f} s of refill. Prompts share no "
        "prefix, so the replicas run without a prefix cache. With the loads shares of the fleet's own capacity, the backlog "
        "a burst leaves is its load × its length in seconds of the fleet's work on any hardware, so the seconds hardly "
        "move with the GPU; with the reference fleet the same requests/s meet the chosen GPU's roofline service times. "
        f"The A10G replica is the VTC artifact's calibration sped up by **assumed** factors (prefill × "
        f"{PREFILL_SPEEDUP:g}, decode × {DECODE_SPEEDUP:g}), with room for 400,000 tokens of KV.")

st.subheader("1 · TTFT per class, with and without isolation")
ORDER = [k for k in TOKENS if k in set(summary["class"])]
fig = go.Figure()
for label in (WITHOUT, WITH):
    s = summary[summary.isolation == label].set_index("class").loc[ORDER]
    fig.add_trace(go.Box(x=[CLASS_LABELS[k] for k in ORDER], name=label, q1=s.ttft_p25_ms / 1000,
                         median=s.ttft_p50_ms / 1000, q3=s.ttft_p75_ms / 1000, lowerfence=s.ttft_min_ms / 1000,
                         upperfence=s.ttft_p99_ms / 1000))
fences = summary[summary["class"].isin(ORDER)]
lo_s, hi_s = fences.ttft_min_ms.min() / 1000, fences.ttft_p99_ms.max() / 1000
BOX_TICKS_S = [m * 10.0 ** e for e in range(-4, 5) for m in (1, 3)]   # 1-3-10: a label in every half decade
bottom = max([t for t in BOX_TICKS_S if t <= lo_s], default=BOX_TICKS_S[0])       # the ticks bracket the data
top_s = min([t for t in BOX_TICKS_S if t >= hi_s], default=BOX_TICKS_S[-1])
shown = [t for t in BOX_TICKS_S if bottom <= t <= top_s]
fig.update_layout(boxmode="group", xaxis_title="Class", legend=dict(orientation="h", y=-0.25),
                  yaxis=dict(type="log", title="TTFT (s, log)", tickvals=shown, ticktext=[f"{t:g} s" for t in shown],
                             range=[math.log10(shown[0]), math.log10(shown[-1])]))
show_chart(fig, run.per_request[["isolation", "klass", "request_id", "arrival_ms", "status", "queue_wait_ms", "ttft_ms",
                                  "e2e_ms"]], key="p13_ttft_chart")
missing = [k for k in TOKENS if k not in ORDER]
for k in missing:   # a class with no completed request in either run has no TTFT to draw
    seen = run.per_request[run.per_request.klass == k].groupby("status").size()
    st.info(f"No {CLASS_LABELS[k]} request completed in the simulated time, so it has no TTFT to show: "
            + (f"at its steady rate of {run.rates_rps[k]:.2f} req/s none arrived." if seen.empty else
               "its requests ended " + ", ".join(f"{status} ({n:,})" for status, n in seen.items()) + "."))
by = summary.set_index(["isolation", "class"])


def _s(col: str, iso: str, klass: str) -> float:
    return by[col].get((iso, klass), float("nan")) / 1000


m1, m2, m3 = st.columns(3)
for col, label, q, klass in ((m1, "VIP P99 TTFT with isolation", "p99", "vip"),
                             (m2, f"{burst_label} (bursting) P50 TTFT with isolation", "p50", burst_class),
                             (m3, f"{burst_label} (bursting) P99 TTFT with isolation", "p99", burst_class)):
    on, off = _s(f"ttft_{q}_ms", WITH, klass), _s(f"ttft_{q}_ms", WITHOUT, klass)
    d = secs(on - off)   # ASCII minus: Streamlit reads the sign of a string delta from it
    col.metric(label, f"{secs(on)} s", delta=f"{'' if d.startswith('-') else '+'}{d} s vs without",
               delta_color="inverse", delta_arrow="auto" if float(d.replace(",", "")) else "off")
table = summary.assign(klass=summary["class"].map(CLASS_LABELS), **{   # seconds to two significant digits
    c: (summary[f"{c}_ms"] / 1000).map(lambda v: round(v, _decimals(v))) for c in ("ttft_p50", "ttft_p99", "queue_wait_p99")})
show_table(table, {"isolation": "Isolation", "klass": "Class", "completed": num("Completed (requests)", "%,d"),
                   "ttft_p50": num("TTFT P50 (s)", "%g"), "ttft_p99": num("TTFT P99 (s)", "%g"),
                   "queue_wait_p99": num("Queue wait P99 (s)", "%g")})
p50_on, p50_off = _s("ttft_p50_ms", WITH, burst_class), _s("ttft_p50_ms", WITHOUT, burst_class)
vip_on, vip_off = _s("ttft_p99_ms", WITH, "vip"), _s("ttft_p99_ms", WITHOUT, "vip")
paid = (f"isolation is not free: the bursting {burst_label} class pays, its P50 going from {secs(p50_off)} s to "
        f"{secs(p50_on)} s, held in its own bucket and VTC share" if p50_on > p50_off else
        f"here the bursting {burst_label} class does not pay (P50 {secs(p50_on)} s with isolation vs "
        f"{secs(p50_off)} s without): its burst fits its bucket and VTC share")
st.caption(f"Box: P25–P75, line: P50, whiskers: min to P99 (completed requests). What to notice: with isolation "
           f"the VIP P99 TTFT is {secs(vip_on)} s instead of {secs(vip_off)} s; {paid}.")

st.subheader("2 · Tokens admitted vs budget (with isolation)")
if budget.empty:
    st.info("No bucketed class admitted anything in this run.")
else:
    fig2 = go.Figure()
    for klass, g in budget.groupby("class", sort=False):
        name = CLASS_LABELS[klass]
        fig2.add_trace(go.Scatter(x=g.time_s, y=g.admitted_tokens, name=f"{name}: admitted", mode="lines"))
        fig2.add_trace(go.Scatter(x=g.time_s, y=g.budget_tokens, name=f"{name}: budget (burst + rate·t)",
                                  mode="lines", line=dict(dash="dot")))
    fig2.update_layout(xaxis_title="Time (s)", yaxis_title="Cumulative tokens (prompt + output)",
                       legend=dict(orientation="h", y=-0.25))
    show_chart(fig2, budget, key="p13_budget_chart")
    st.caption("The admitted line never crosses the budget line: a class's admitted tokens ≤ burst + rate · t.")

st.subheader("3 · Our simulator vs the VTC artifact's measurements")
vdf, tp_measured, tp_ours = _vtc()
labels = vdf.scheduler + " · " + vdf.client
top = max(vdf.measured_p99_s.max(), vdf.ours_p99_s.max())
TICKS_S = [v for v in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if v <= top * 2.5]
fig3 = go.Figure()
for col, name in (("measured_p99_s", "VTC artifact raw files (A10G; computed here, not printed in the paper)"),
                  ("ours_p99_s", "Our simulator (A10G calibration)")):
    fig3.add_trace(go.Bar(x=labels, y=vdf[col], name=name, text=[f"{secs(v)} s" for v in vdf[col]],
                          textposition="outside"))
fig3.update_layout(barmode="group", xaxis_title="Scheduler · client", legend=dict(orientation="h", y=-0.25),
                   yaxis=dict(type="log", title="P99 TTFT (s, log; bars start at 1 s)", range=[0, math.log10(top * 2.5)],
                              tickvals=TICKS_S, ticktext=[f"{v:,} s" for v in TICKS_S]))
show_chart(fig3, vdf, key="p13_vtc_chart")
lt = vdf[vdf.client.str.startswith("Light")].set_index("scheduler")
gap = lt.measured_p99_s["VTC"] / lt.ours_p99_s["VTC"]
fcfs = vdf[vdf.scheduler == "FCFS"]
fcfs_err = ((fcfs.ours_p99_s - fcfs.measured_p99_s).abs() / fcfs.measured_p99_s).max()
st.caption(f"Both show the headline: FCFS → VTC cuts the light client's P99 TTFT from "
           f"{secs(lt.measured_p99_s['FCFS'])} s to {secs(lt.measured_p99_s['VTC'])} s in the artifact's raw files "
           f"({lt.measured_p99_s['FCFS'] / lt.measured_p99_s['VTC']:.0f}×) and "
           f"{lt.ours_p99_s['FCFS'] / lt.ours_p99_s['VTC']:.0f}× here; under FCFS our P99s are within "
           f"{fcfs_err:.0%} of the artifact's.")
with st.expander("How the replay is set up"):
    st.markdown(f"Source: {ANCHORS['vtc']}. Our replay rebuilds the suite's 1,350 arrivals (256/256 tokens) and runs "
                f"one replica calibrated to the measured FCFS throughput: ours {tp_ours['FCFS']:.3f} vs measured "
                f"{tp_measured['FCFS']:.3f} req/s (FCFS), {tp_ours['VTC']:.3f} vs {tp_measured['VTC']:.3f} (VTC).")
with st.expander(f"Gap: under VTC our light-client P99 is {gap:.1f}× below the artifact's"):
    st.markdown(f"Under VTC the light client's P99 TTFT is {lt.ours_p99_s['VTC']:.1f} s here against "
                f"{lt.measured_p99_s['VTC']:.1f} s in the artifact, {gap:.1f}× lower (P50 {lt.ours_p50_s['VTC']:.1f} s vs "
                f"{lt.measured_p50_s['VTC']:.1f} s). Likely cause: our replica is calibrated on throughput only. A request's "
                "decode time matches the measured one, so FCFS, where the wait is the backlog, agrees; but under VTC the "
                "light client's wait is only the admission delay, and there our model is simpler than S-LoRA. We admit a "
                "waiting request at the next step as soon as KV room frees; S-LoRA's router looks for new requests only "
                "every 10 decode steps (its max-wait-tokens setting, slora/server/router/manager.py), checks the running "
                "batch's future KV need, and loads the LoRA adapters of each new mini-batch. None of that is modelled, so "
                "our VTC latencies for a light client are optimistic.")
