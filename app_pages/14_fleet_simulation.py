"""14 Fleet simulation: router → replicas with prefix caches and schedulers, policies side by side."""
import math

import plotly.graph_objects as go
import streamlit as st

from app_pages.caching import upload_parts
from app_pages.charts import inside_if_tall, num, pct, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import run_on_request
from app_pages.params import Choice, Int, Multi
from app_pages.replica import real_replica, replica_params
from lab.fleet import DISPLAY_NAMES
from lab.fleet_simulation import (
    ARRIVAL_RATES,
    BOUND_C,
    CAPACITIES,
    CLASS_LABELS,
    DEFAULT_ARRIVAL_RPS,
    QUEUE_GROWTH_MS,
    ROUTING_POLICIES,
    SCALE_EVENTS,
    SCHEDULER_LABELS,
    SCHEDULERS,
    SERVICE_MODELS,
    SWEEP_RATES,
    RealReplica,
    fleet_simulation,
    load_sweep,
    replica_title,
)
from lab.sim_vs_engine import CLOCK_TITLES, GOAL_PCT, sim_vs_engine_record

st.title("Fleet simulation")
st.write(
    "The whole chain on a trace: each request is routed on its first k blocks, waits in its replica's scheduler, "
    "prefills only the tokens its replica has not cached, then decodes under continuous batching. By default each "
    "replica is Kimi-Linear on 8 × H200: step times from the roofline, and a prefix cache that is a production "
    "policy model (ours, SGLang, vLLM) at real bytes, where a hit needs a KDA state at the boundary. The VTC-"
    "calibrated A10G replica (block LRU cache) stays selectable: it is the setup that reproduces the VTC artifact. Several routing policies run on the same trace so hit ratio, TTFT per class and load "
    "balance can be compared side by side. Default trace: synthetic (Mooncake schema, arrivals like the "
    "conversation trace), re-timed to the offered load; upload a Mooncake JSONL file to use your own. At the "
    "conversation trace's own ~3.4 req/s the fleet is nearly idle and the policies differ only by cache hits; the "
    "default load is where queues form and routing decides TTFT.")

SERVICES = list(SERVICE_MODELS)
TRACE_RATE = "trace's own"
RATE_OPTIONS = [TRACE_RATE] + [str(r) for r in ARRIVAL_RATES]
SCHEDULER_NAMES = [SCHEDULER_LABELS[s] for s in SCHEDULERS]
POLICY_NAMES = [DISPLAY_NAMES[p] for p in ROUTING_POLICIES]
links = declare(
    Choice("p14_model", SERVICES[0], SERVICES),
    *replica_params("p14", model_key="p14_real_model"),
    Choice("p14_rate", str(DEFAULT_ARRIVAL_RPS), RATE_OPTIONS),
    Int("p14_requests", 600, 200, 5000, step=100),
    Int("p14_replicas", 8, 1, 16),
    Int("p14_k", 2, 1, 4),
    Choice("p14_capacity", "8000", CAPACITIES),
    Choice("p14_scheduler", SCHEDULER_LABELS["vtc"], SCHEDULER_NAMES),
    Int("p14_vip", 10, 0, 50, step=5),
    Choice("p14_scale", "none", SCALE_EVENTS),
    Int("p14_speed", 8, 1, 20),
    Multi("p14_policies", [DISPLAY_NAMES[p] for p in ("ring", "round_robin", "cache_aware", "bounded_load")],
          POLICY_NAMES),
)
service_label = links.selectbox(st, "Replica", "p14_model")
real = SERVICE_MODELS[service_label] == "roofline"
if real:   # the GPUs and TP sizes offered are those the model's weights fit in
    replica = real_replica(links, model_key="p14_real_model")
else:
    replica = RealReplica()
rate_label = links.select_slider(st, "Offered load (requests / s across the fleet)", "p14_rate")
arrival_rps = None if rate_label == TRACE_RATE else float(rate_label)
c1, c2, c3, c4 = st.columns(4)
num_requests = links.slider(c1, "Requests (cap)", "p14_requests")
replicas = links.slider(c2, "Replicas", "p14_replicas")
k = links.slider(c3, "Routing prefix depth k (blocks)", "p14_k")
capacity = "8000" if real else links.select_slider(  # a real-model replica's cache is its byte budget (above)
    c4, "Cache per replica (blocks of 512 tokens)", "p14_capacity")
d1, d2, d3, d4 = st.columns(4)
scheduler = SCHEDULERS[SCHEDULER_NAMES.index(links.selectbox(d1, "Replica scheduler", "p14_scheduler"))]
vip_pct = links.slider(d2, "VIP share of requests (%)", "p14_vip")
scale = links.selectbox(d3, "Scale event at half time", "p14_scale")
speed = 8 if real else links.slider(  # an assumption for the A10G / CPU replicas; a real model's times: the roofline
    d4, "Replica speed-up, assumed (prefill ×; decode × 5/8 of it)", "p14_speed")
policies = [ROUTING_POLICIES[POLICY_NAMES.index(name)] for name in links.multiselect(st, "Routing policies",
                                                                                     "p14_policies")]
upload = st.file_uploader("Mooncake trace (JSONL, optional)", type=["jsonl", "json"], key="p14_upload")
if not policies:
    st.info("Pick at least one routing policy.")
    st.stop()


@st.cache_data(show_spinner=False, max_entries=16, ttl="1h")
def _run(policies, n, replicas, k, capacity, scheduler, vip_pct, scale, speed, service, replica, upload_bytes,
         upload_name, arrival_rps):
    bar = st.progress(0.0, text="Simulating…")  # made here: replayed on a cache hit
    run = fleet_simulation(policies, n, replicas, k, capacity, scheduler, vip_pct, scale, speed, SERVICE_MODELS[service],
                           upload_bytes, upload_name, progress=lambda f: bar.progress(min(f, 1.0), text="Simulating…"),
                           replica=replica, arrival_rps=arrival_rps)
    bar.empty()
    return run


@st.cache_data(show_spinner=False, max_entries=4, ttl="1h")
def _sweep(policies, n, replicas, k, capacity, scheduler, vip_pct, scale, speed, service, replica, upload_bytes,
           upload_name):
    bar = st.progress(0.0, text="Sweeping the load…")
    frame = load_sweep(policies, SWEEP_RATES, n, replicas, k, capacity, scheduler, vip_pct, scale, speed,
                       SERVICE_MODELS[service], upload_bytes, upload_name, replica=replica,
                       progress=lambda f: bar.progress(min(f, 1.0), text="Sweeping the load…"))
    bar.empty()
    return frame


setup = (tuple(policies), num_requests, replicas, k, capacity, scheduler, vip_pct, scale, speed, service_label,
         replica, *upload_parts(upload))
run = engine_call(_run, *setup, arrival_rps)
per_request, summary, ideal, n_trace, source = run.per_request, run.summary, run.ideal_ratio, run.num_requests, \
    run.service_source
if run.note:
    st.info(run.note)


def _labelled(df):
    """``df`` with display names for the policy and class code names (the CSVs keep the code names)."""
    out = df.assign(policy=df.policy.map(DISPLAY_NAMES))
    return out.assign(**{"class": out["class"].map(CLASS_LABELS)}) if "class" in out else out


overall = summary[summary["class"] == "all"]
st.subheader("1 · Prefix-cache hit ratio per policy")
fig = go.Figure(go.Bar(x=overall.policy.map(DISPLAY_NAMES), y=overall.hit_ratio, name="measured here",
                       text=[f"{v:.1%}" for v in overall.hit_ratio], insidetextanchor="end",   # clear of the ideal line
                       textposition=inside_if_tall(overall.hit_ratio, max(ideal, overall.hit_ratio.max()))))
fig.add_hline(y=ideal, line_dash="dash", annotation_text=f"ideal (one infinite shared cache) {ideal:.1%}")
fig.update_layout(xaxis_title="routing policy", yaxis_title="token hit ratio (cached ÷ prompt tokens)",
                  yaxis_tickformat=".0%", yaxis_range=[0, max(ideal, overall.hit_ratio.max(), 0.05) * 1.15])
show_chart(fig, overall, key="p14_hit_chart")
st.caption(f"Published anchor: {run.anchors['mooncake_cache']}.")

st.subheader("2 · TTFT per class (P50 and P99)")
per_class = summary[summary["class"] != "all"]
fig2 = go.Figure()
for stat in ("ttft_p50_ms", "ttft_p99_ms"):
    for klass, g in per_class.groupby("class", sort=False):
        fig2.add_trace(go.Bar(x=g.policy.map(DISPLAY_NAMES), y=g[stat], name=f"{CLASS_LABELS[klass]} {stat[5:8].upper()}",
                              texttemplate="%{y:,.0f}" if len(per_class) <= 16 else None,   # 44 bars: unreadable,
                              textposition="outside", textfont_size=10))                       # the table has them
lo_ms = max(1.0, float(per_class[["ttft_p50_ms", "ttft_p99_ms"]].min().min()))
hi_ms = max(lo_ms * 10, float(per_class[["ttft_p50_ms", "ttft_p99_ms"]].max().max()))
fig2.update_layout(barmode="group", xaxis_title="routing policy", yaxis_title="TTFT (ms, log scale)",
                   yaxis=dict(type="log", tickvals=[m * 10 ** e for e in range(8) for m in (1, 2, 5)], tickformat=",~r",
                              range=[math.floor(math.log10(lo_ms)), math.log10(hi_ms * 2)]),
                   legend=dict(orientation="h", y=-0.25))
show_chart(fig2, summary, key="p14_ttft_chart")
show_table(_labelled(summary), {
    "policy": "Policy", "class": "Class", "completed": num("Completed"), "hit_ratio": pct("Token hit ratio"),
    "ttft_p50_ms": num("TTFT P50 (ms)", "%,.0f"), "ttft_p99_ms": num("TTFT P99 (ms)", "%,.0f"),
    "queue_wait_p99_ms": num("Queue wait P99 (ms)", "%,.0f")})
st.download_button("Download per-request results (CSV)", lambda: per_request.to_csv(index=False).encode(),  # on click:
                   file_name="p14_requests.csv", mime="text/csv", key="p14_requests_csv")  # not each render (24 ms)
HASHING = ("mod_n", "ring", "jump", "rendezvous", "maglev")   # routing by a hash of the first k blocks


def _what_to_notice() -> str:
    """What this run shows, read off its own numbers (true for any replica count, policy set or trace)."""
    hits, over_cap = dict(zip(overall.policy, overall.hit_ratio)), dict(zip(inf.policy, inf.over_cap_share))
    used = per_request.groupby("policy").replica.nunique()
    if used.max() == 1:
        return (f"every request went to the one replica, whatever the policy: routing has no choice to make, so "
                f"each policy shows the same hit ratio ({overall.hit_ratio.iloc[0]:.1%}). Add replicas to see it "
                "decide.")
    notes = []
    if "round_robin" in hits and len(hits) > 1:
        best = max((p for p in hits if p != "round_robin"), key=hits.get)
        notes.append(f"round robin scatters a session's turns over the replicas: {hits['round_robin']:.1%} of prompt "
                     f"tokens hit vs {hits[best]:.1%} with {DISPLAY_NAMES[best]}")
    for h in [p for p in policies if p in HASHING][:1]:
        share = per_request[per_request.policy == h].replica.value_counts(normalize=True).iloc[0]
        notes.append(f"{DISPLAY_NAMES[h]} on the first k = {k} block(s) sent {share:.0%} of the requests to its busiest "
                     f"replica" + (" (k = 1 hashes only the first block, which these prompts share)"
                                   if k == 1 and share > 0.9 else ""))
    if "cache_aware" in hits:
        notes.append(f"cache-aware routing reached {hits['cache_aware']:.1%} hits with {over_cap['cache_aware']:.1%} "
                     "of the requests routed above the load cap (section 3)")
    return "; ".join(notes) + "." if notes else "compare the policies' hit ratios above with the ideal line."


inf = run.in_flight
load_text = "at the trace's own arrival times" if arrival_rps is None else f"offered at {arrival_rps:g} req/s"
st.caption(f"{n_trace:,} requests (cap {num_requests:,}) {load_text}, {replicas} replica{'s' if replicas > 1 else ''} (service model below); "
           f"mean in-flight per replica at routing {inf.mean_in_flight.mean():.1f}.")
st.caption("What to notice: " + _what_to_notice())

st.subheader("3 · Load balance: in-flight requests at routing time")
fig3 = go.Figure(go.Bar(x=inf.policy.map(DISPLAY_NAMES), y=inf.over_cap_share,
                        text=[f"{v:.1%}" for v in inf.over_cap_share], textposition="outside"))
fig3.update_layout(xaxis_title="routing policy", yaxis_tickformat=".0%", yaxis_title="routed above the load cap",
                   yaxis_range=[0, max(0.05, float(inf.over_cap_share.max())) * 1.2])
show_chart(fig3, inf, key="p14_balance_chart")
balance = overall.merge(inf[["policy", "over_cap_share", "p99_in_flight", "mean_in_flight"]], on="policy")
show_table(_labelled(balance), {
    "policy": "Policy", "over_cap_share": pct("Routed above the cap"),
    "p99_in_flight": num("Chosen replica's in-flight, P99 (requests)", "%.0f"),
    "mean_in_flight": num("Fleet in-flight per replica, mean", "%.2f"),
    "max_over_mean_requests": num("Requests per replica, max ÷ mean", "%.2f"),
    "throughput_rps": num("Throughput (req/s)", "%.2f")}, wrap=True)   # six long headers: the grid cut the last
st.caption(f"The load cap is bounded loads' ⌈c × fleet in-flight ÷ replicas⌉, c = {BOUND_C} (requests routed, not "
           "finished); the bars count, per policy, how often a request landed above it"
           + (" (requests routed after the removal)." if scale == "remove" else "."))
if run.kda is not None:
    kda, rb = run.kda, run.replica_bytes
    st.subheader(f"4 · What KDA changes: {replica_title(replica)}")
    fig4 = go.Figure([go.Bar(x=kda.policy.map(DISPLAY_NAMES), y=kda.hit_ratio, name="token hit ratio"),
                      go.Bar(x=kda.policy.map(DISPLAY_NAMES), y=kda.lost_to_missing_state,
                             name="KV cached on the replica, no state to use it")])
    fig4.add_hline(y=run.ideal_ratio, line_dash="dash", annotation_text=f"block ideal {run.ideal_ratio:.1%}")
    fig4.update_layout(barmode="stack", xaxis_title="routing policy", yaxis_title="share of prompt tokens",
                       yaxis_tickformat=".0%",
                       yaxis_range=[0, max(run.ideal_ratio, float((kda.hit_ratio + kda.lost_to_missing_state).max()))
                                    * 1.15], legend=dict(orientation="h", y=-0.25))
    show_chart(fig4, kda, key="p14_kda_chart")
    bars_x = [list(rb.policy.map(DISPLAY_NAMES)), list(rb.replica.str.replace("replica-", "r"))]  # policy, then replica
    fig5 = go.Figure([go.Bar(x=bars_x, y=rb[col], name=name)
                      for col, name in (("kv_gb", "cached KV"), ("state_gb", "cached states"),
                                        ("running_gb", "running request's state slots"))])
    budget_gb = float(rb.budget_gb.iloc[0])   # one cache budget per replica, the same on every replica
    fig5.add_hline(y=budget_gb, line_dash="dash", annotation_text=f"budget per replica: {budget_gb:,.1f} GB")
    fig5.update_layout(barmode="stack", xaxis_title="routing policy and replica",
                       yaxis_title="GB held when the replica's cache peaked", xaxis_tickangle=0,
                       yaxis_range=[0, budget_gb * 1.15], legend=dict(orientation="h", y=-0.3))
    show_chart(fig5, rb, key="p14_bytes_chart")
    st.caption("Each bar splits the bytes a replica held when its cached KV + states peaked, so it stays under the "
               "budget line (each kind's own peak comes at a different time: stacked, they could pass it).")
    if {"precise_kv", "precise_state"} <= set(kda.policy):
        by = kda.set_index("policy")
        kv_only, aware = by.loc["precise_kv"], by.loc["precise_state"]
        st.metric("Checkpoint-aware vs KV-only routing (token hit ratio)", f"{aware.hit_ratio:.1%}",
                  f"{(aware.hit_ratio - kv_only.hit_ratio) * 100:+.1f} points vs {kv_only.hit_ratio:.1%}")
        st.caption(f"TTFT P99 {aware.ttft_p99_ms:,.0f} ms checkpoint-aware vs {kv_only.ttft_p99_ms:,.0f} ms KV-only. "
                   "The KV-only score counts the prompt tokens whose KV a replica holds (what a router built for full "
                   "attention sees); the checkpoint-aware one the tokens it would really skip (see below).")
        with st.expander("How the two scores route"):
            st.markdown("A hit needs a KDA state at the restore boundary, so a replica holding the KV but no state "
                        "there saves nothing. Both scores send a request to the best replica only above 30 % of the "
                        "prompt (sgl-router's cache threshold), else to the least loaded.")
    else:
        st.caption(f"Add the routing policies {DISPLAY_NAMES['precise_kv']} and {DISPLAY_NAMES['precise_state']} to "
                   "compare routing that ignores where the replicas placed their KDA checkpoints with routing that "
                   "uses it.")
with st.expander("Service model"):
    st.markdown("A real-model replica: prefill step = fitted roofline prefill of each request's uncached tokens "
                "after its cached ones (+ one checkpoint restore per hit); decode step = roofline TPOT at the batch's "
                "mean context; the cache is the chosen policy under its byte budget (KV + states + the running "
                "request's state slots). A10G / CPU replica: prefill time = uncached tokens ÷ prefill rate; decode "
                "step time per batch size, calibrated on the VTC artifact's A10G measurements or timed on this CPU "
                "with our engine, then sped up by the stated (assumed) factors.")
    st.markdown(f"This run: {source}.")

st.subheader("5 · Predicted vs measured on the real engine")
record = engine_call(sim_vs_engine_record)
meta = record["meta"]
st.caption(f"Recorded bench run (`python -m bench.sim_vs_engine`, {meta.get('measured', '?')}), not computed on "
           f"this render. The real engine replays {meta.get('requests', '?')} Mooncake-shaped requests (a shared "
           f"64-token system prefix: prefix-cache hits) with {meta.get('state_slots', '?')} state slots at "
           f"{', '.join(f'{r:g}' for r in meta.get('rates_rps', []))} req/s, from light load to past saturation; "
           "the simulator predicts them on the same clock.")
with st.expander("Conditions of the recorded run"):
    load = meta.get("load_average_1min", ["?", "?"])
    st.markdown(
        f"Machine: {meta.get('machine', '?')}; load average {load[0]} → {load[1]} (other jobs share the cores). "
        "**Strict replay**: the engine's clock advances by each step's own thread CPU time and arrivals are placed "
        "on that clock, so other processes change little; "
        f"{meta.get('strict_repeats', '?')} replays per rate (median), run step-interleaved with the calibration "
        "replays so the host's drift hits all alike. **Wall-clock replay**: the first "
        f"{meta.get('wall_requests', '?')} requests on `time.perf_counter`, {meta.get('wall_repeats', '?')} "
        "repeats per rate interleaved over the rates; the spread is the min–max columns. The simulator's step-time "
        "terms are fitted on calibration replays (other trace windows and rates), never on the scored ones. "
        "Slot limits are in play (past 4 running requests arrivals queue for a state slot); preemption is not: the "
        "engine reserves a request's final pages when it admits it and preempts only when asked.")
mape = record["mape"]
fig_mape = go.Figure([go.Bar(name=CLOCK_TITLES[c], x=g.label, y=g.worst_rate_pct,
                             text=[f"{v:.1f} %" for v in g.worst_rate_pct],
                             textposition=inside_if_tall(g.worst_rate_pct, mape.worst_rate_pct.max()))
                      for c, g in mape.groupby("clock", sort=False)])
for goal in GOAL_PCT.values():     # named in the axis title: a label on the line sat on the bars' labels
    fig_mape.add_hline(y=goal, line_dash="dot")
goals = ", ".join(f"{goal:.0f} % {clock}" for clock, goal in GOAL_PCT.items())
fig_mape.update_layout(barmode="group", xaxis_title="metric", height=340,
                       yaxis_title=f"worst rate's error (%)<br>dotted: goals, {goals}",
                       legend=dict(orientation="h", y=-0.3))
show_chart(fig_mape, mape, key="p14_sim_engine_chart")
for clock in GOAL_PCT:
    g = mape[mape.clock == clock]
    st.markdown(f"**{CLOCK_TITLES[clock].capitalize()}: {int(g.meets.sum())} of {len(g)} metrics within "
                f"{GOAL_PCT[clock]:.0f} % at every rate.**")
    show_table(record[clock].drop(columns="metric"), {
        "rate_rps": num("Offered (req/s)", "%.0f"), "label": "Metric",
        "measured": num("Measured (real engine)", "%,.2f"), "measured_min": num("Measured min", "%,.2f"),
        "measured_max": num("Measured max", "%,.2f"), "predicted": num("Predicted (simulator)", "%,.2f"),
        "error_pct": num("Error (%)", "%.1f")})
noise = record["host_noise"].get("step_wall_per_cpu_wall", {})
if noise:
    st.caption(f"What separates the two clocks is the host: in the wall-clock replays a step took {noise['median']:.2f}"
               f"× its CPU time at the median (P10 {noise['p10']:.2f}, P90 {noise['p90']:.2f}): the engine thread "
               "waited for a core. The strict clock counts only the CPU time.")
with st.expander("The simulator's step-time terms and their held-out check"):
    show_table(record["terms"], {"term": "Term", "cpu": num("Fitted on CPU time", "%.4f"),
                                 "wall": num("Fitted on wall time", "%.4f")})
    show_table(record["step_check"], {"replay": "Replay", "median_pct": num("Step error, median (%)", "%.1f"),
                                      "p90_pct": num("Step error, P90 (%)", "%.1f"), "steps": num("Steps", "%d"),
                                      "fitted": "Fitted on it"})
    st.caption("Every step of every strict replay against the fitted terms for the same composition; only the "
               "calibration replays were fitted. MAPE per metric = mean over rates of |predicted − measured| / "
               "measured, recomputed here from the recorded values.")

st.subheader("6 · TTFT against offered load")
run_on_request("p14_sweep_on", "p14_sweep_button", "Sweep the load",
               f"Runs the settings above at {', '.join(map(str, SWEEP_RATES))} req/s ({len(SWEEP_RATES)} fleet "
               "simulations, seconds of CPU the first time, cached afterwards) and draws TTFT P50 / P99 per routing "
               "policy against the load.")
sweep = engine_call(_sweep, *setup)
fig_load = go.Figure()
for policy, g in sweep.groupby("policy", sort=False):
    for stat, dash in (("ttft_p50_ms", "solid"), ("ttft_p99_ms", "dash")):
        fig_load.add_trace(go.Scatter(x=g.rate_rps, y=g[stat], mode="lines+markers", line_dash=dash,
                                      name=f"{DISPLAY_NAMES[policy]} {stat[5:8].upper()}"))
fig_load.update_layout(xaxis_title="offered load (requests / s across the fleet)", yaxis_title="TTFT (ms, log scale)",
                       yaxis_type="log", legend=dict(orientation="h", y=-0.25))
show_chart(fig_load, sweep, key="p14_load_chart")
show_table(_labelled(sweep), {
    "policy": "Policy", "rate_rps": num("Offered (req/s)", "%.0f"), "ttft_p50_ms": num("TTFT P50 (ms)", "%,.0f"),
    "ttft_p99_ms": num("TTFT P99 (ms)", "%,.0f"), "hit_ratio": pct("Token hit ratio"),
    "throughput_rps": num("Completed (req/s)", "%.1f"), "drain_s": num("Drain after the last arrival (s)", "%.2f"),
    "mean_in_flight": num("Fleet in-flight per replica, mean", "%.2f"),
    "wait_first_ms": num("Queue wait P50, first quarter (ms)", "%,.1f"),
    "wait_last_ms": num("Queue wait P50, last quarter (ms)", "%,.1f"), "saturated": "Queue growing (saturated)"},
    wrap=True)   # eleven long headers: the grid cut the columns after "Drain after the last arrival (s)"
hot = sweep[sweep.saturated]
verdict = ("no policy's queue grows at these rates" if hot.empty else "; ".join(
    f"{DISPLAY_NAMES[p]} from {g.rate_rps.min():g} req/s" for p, g in hot.groupby("policy", sort=False)))
st.caption(f"Saturated (the queue grows through the run): {verdict}. Completed sits below offered even without a "
           "queue, by the drain tail of a finite run, so it is not the criterion (see below).")
with st.expander("How saturation is judged"):
    st.markdown("Each rate re-times the same trace (same prompts and sessions, gaps scaled), so the hit ratios move "
                "only through routing under load. Completed = completed requests ÷ (last finish − first arrival): the "
                "requests still decoding after the last arrival stretch the span (the drain column), so completed < "
                "offered holds at any load. Saturated here means the queue grows: the median queue wait of the last "
                f"quarter of arrivals is over twice the first quarter's and over {QUEUE_GROWTH_MS:.0f} ms above it.")
