"""15 Real scale: Kimi Linear vs full MLA on datacenter GPUs, and the production prefix-cache policies at real bytes."""
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from app_pages.caching import upload_parts
from app_pages.charts import num, pct, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import run_on_request
from app_pages.params import Int, Multi
from app_pages.replica import real_replica, replica_params
from lab.real_scale import (
    BUDGET_FRACTIONS,
    CACHE_POLICIES,
    DEFAULT_POLICIES,
    EXTRA_BUFFER_CHUNK,
    EXTRA_CACHE_POLICIES,
    INTERVAL_BUDGET_FRACTION,
    MEMORY_FRACTION,
    OURS_C,
    REPORT_THROUGHPUT_CLAIM,
    TIE_TOLERANCE,
    policy_title,
    policy_view,
    preset_title,
    roofline_view,
)

st.title("Real scale")
st.write(
    "The real models on real GPUs, by roofline: each layer kind costs max(FLOPs / peak, bytes / bandwidth) on a "
    "TP group. Part 1 puts Kimi Linear beside its all-MLA counterfactual (same layers and heads, every layer MLA) "
    "with the Kimi Linear report's published points. Part 2 replays a trace through the prefix caches of our "
    "engine, SGLang and vLLM, each counted in the chosen model's bytes under one memory budget per replica.")
links = declare(
    *replica_params("p15", policy=False),
    Int("p15_requests", 3000, 1000, 6000, step=500),
    Multi("p15_policies", DEFAULT_POLICIES, CACHE_POLICIES + EXTRA_CACHE_POLICIES, format_func=policy_title),
)
replica = real_replica(links, policy=False)   # only the GPUs and TP sizes the weights fit in
model, hw, tp = replica.model, replica.gpu, replica.tp
_roofline = st.cache_data(roofline_view, show_spinner=False, max_entries=64, ttl="1h")
view = engine_call(_roofline, replica)
st.subheader("1 · Kimi Linear vs full MLA, 4K to 1M tokens")
st.write(
    "Three kinds of number, kept apart: the **physical roofline** (no constant), the **fitted** prefill (two time "
    f"scales fitted once, on {view.fit_setup}, on the report's Kimi Linear points only; the all-MLA points are held "
    "out and predicted) and the **published** points of Kimi-Linear-48B-A3B. The same fit gives the service times "
    f"of pages 13–15. The fit is checked at {view.fit_setup}; the ratio errors are on the setup you chose, "
    f"{view.setup}.")
m1, m2, m3, m4, m5 = st.columns(5)
m1.metric("Weights (GB)", f"{view.weights_gb:,.0f}")
m2.metric(f"HBM of {tp} × {hw} (GB)", f"{view.hbm_gb:,.0f}")
m3.metric("Left after weights (GB)", f"{view.free_gb:,.0f}")
m4.metric("Prefill scales α · β", f"{view.fit.alpha:.2f} · {view.fit.beta:.2f}", f"fitted on {view.fit_setup}",
          delta_color="off", delta_arrow="off", help="Roofline time × α for attention, × β for every other layer kind (1 = at peak), least squares on "
               f"the nine published Kimi Linear prefill points on {view.fit_setup}, and carried unchanged to every "
               "other GPU and TP; see \"How the roofline is fitted\".")
errors = view.errors.set_index("group").max_abs_error
m5.metric("Prefill error, held out", f"±{errors['prefill points held out (all MLA)']:.0%}",
          f"fitted points: ±{errors['prefill points the fit saw (Kimi Linear)']:.0%}", delta_color="off",
          delta_arrow="off",
          help=f"Largest |fitted / published − 1| of the prefill seconds on {view.fit_setup}, where the fit was made: "
               "at the nine all-MLA Fig. 7a points (4K to 1M) the fit never saw (the value) and at the nine Kimi "
               "Linear points it was fitted to (under it). Seconds, not the MLA ÷ Kimi Linear ratios of the table "
               "below.")
if view.predicted_only:
    st.info(view.fit_note)
else:
    st.caption(view.fit_note)
if view.fit_caveat:
    st.warning(view.fit_caveat)
colours = {"Kimi Linear": "#1b9e77", "all MLA": "#d95f02"}
left, right = st.columns(2)
prefill = go.Figure()
for name, colour in colours.items():
    pts, c = view.prefill_points[view.prefill_points.curve == name], view.curves[view.curves.model == name]
    seen = (pts.role == "fitted on").all()
    if view.predicted_only:   # a wide, faint band under the fitted line it follows, so neither hides the other
        prefill.add_trace(go.Scatter(x=c.context_tokens, y=c.prefill_s, mode="lines", opacity=0.45,
                                     line=dict(color=colour, dash="dash", width=6),
                                     name=f"{name}: predicted, α · β of {view.fit_setup}, no refit "
                                          f"({preset_title(model)}, {view.setup})"))
    prefill.add_trace(go.Scatter(
        x=pts.context, y=pts.model, mode="lines", line=dict(color=colour),
        name=f"{name}: fitted on these points ({view.fit_setup})" if seen
        else f"{name}: fit's prediction, points held out ({view.fit_setup})"))
    prefill.add_trace(go.Scatter(x=pts.context, y=pts.published, mode="markers", marker=dict(color=colour, symbol="x"),
                                 name=f"{name}: published (48B-A3B{', the fit saw these' if seen else ', held out'})"))
    prefill.add_trace(go.Scatter(x=c.context_tokens, y=c.prefill_roofline_s, mode="lines",
                                 line=dict(color=colour, dash="dot"),
                                 name=f"{name}: physical roofline ({preset_title(model)}, {view.setup})"))
prefill.update_layout(title="prefill latency (s)", xaxis_type="log", yaxis_type="log",
                      xaxis_title="context (tokens, log)", yaxis_title="prefill latency (s, log)",
                      legend=dict(orientation="h", y=-0.35))
tpot = go.Figure()
for name, colour in colours.items():
    c, p = view.curves[view.curves.model == name], view.published[view.published.model == name]
    tpot.add_trace(go.Scatter(x=c.context_tokens, y=c.tpot_ms, mode="lines", line=dict(color=colour, dash="dot"),
                              name=f"{name}: physical roofline ({preset_title(model)}, {view.setup})"))
    tpot.add_trace(go.Scatter(x=p.context_tokens, y=p.tpot_ms, mode="markers", marker=dict(color=colour, symbol="x"),
                              name=f"{name}: published (48B-A3B)"))
tpot.update_layout(title="TPOT, batch 1 (ms)", xaxis_type="log", yaxis_type="log", xaxis_title="context (tokens, log)",
                   yaxis_title="TPOT, batch 1 (ms, log)", legend=dict(orientation="h", y=-0.35))
with left:
    checked = view.prefill_points.rename(columns={"curve": "model", "context": "context_tokens", "model": "prefill_s",
                                                  "published": "published_prefill_s"})
    show_chart(prefill, pd.concat([view.curves.drop(columns="tpot_ms").assign(
        setup=view.setup, role="predicted" if view.predicted_only else "fitted"), checked]), key="p15_prefill_chart")
with right:
    show_chart(tpot, pd.concat([view.curves.assign(source="roofline"), view.published.assign(source="published")]),
               key="p15_tpot_chart")
ratio = go.Figure()
model_label = {"prefill (Fig. 7a)": f"predicted, α · β of {view.fit_setup}" if view.setup != view.fit_setup
               else "fitted (MLA held out)", "TPOT, batch 1 (Fig. 7b)": "physical roofline"}
for (q, dash), src in ((("prefill (Fig. 7a)", "solid"), "model"), (("TPOT, batch 1 (Fig. 7b)", "dot"), "model"),
                       (("prefill (Fig. 7a)", "solid"), "published"), (("TPOT, batch 1 (Fig. 7b)", "dot"), "published")):
    r = view.ratios[view.ratios.quantity == q]
    ratio.add_trace(go.Scatter(x=r.context_tokens, y=r[src], name=f"{q}: {model_label[q] if src == 'model' else src}",
                               mode="lines+markers" if src == "model" else "markers", line=dict(dash=dash),
                               marker_symbol="circle" if src == "model" else "x"))
ratio.update_layout(xaxis_type="log", xaxis_title="context (tokens, log)", yaxis_title="MLA / Kimi Linear (×)",
                    legend=dict(orientation="h", y=-0.3))
show_chart(ratio, view.ratios, key="p15_ratio_chart")
prefill_kind = ("fitted Kimi Linear over held-out MLA" if view.setup == view.fit_setup else
                f"both predicted with the α, β of {view.fit_setup}, no refit")
st.markdown(
    f"**Kimi-Linear-48B-A3B against the report on {view.setup}** (the setup you chose), at the nine contexts 4K to "
    f"1M. The ratio MLA ÷ Kimi Linear (the table) is off by up to {errors['prefill (Fig. 7a) ratio']:.0%} for "
    f"prefill ({prefill_kind}) and by up to {errors['TPOT, batch 1 (Fig. 7b) ratio']:.0%} for "
    f"TPOT (physical roofline, nothing fitted). The prefill seconds themselves, on {view.fit_setup} where the fit "
    f"was made: the nine Kimi Linear points the fit saw are off by up to "
    f"{errors['prefill points the fit saw (Kimi Linear)']:.0%}, the nine held-out all-MLA points by up to "
    f"{errors['prefill points held out (all MLA)']:.0%} (both in the headline above).")
show_table(view.validated[view.validated.quantity != "time per token, largest batch (Fig. 1b)"], {
    "context_tokens": num("Context (tokens)"), "quantity": "Quantity", "setup": "Setup", "role": "Role",
    "published": num("Published ratio", "%.2f×", help="MLA ÷ Kimi Linear, from the report's published points."),
    "model": num("Model ratio", "%.2f×", help="MLA ÷ Kimi Linear by the roofline (prefill: the fitted α, β)."),
    "rel_error": pct("Ratio error", help="Model ratio vs published ratio, relative to the published one.")})
# short headers, the detail in each column's help: with the long ones the grid was wider than the page, last cut
st.caption(
    "What to notice: the report states no GPU, count or parallelism, so the ratios MLA / Kimi Linear are compared, "
    "not the seconds. TP splits the weights but every rank reads MLA's whole latent KV, so the TPOT ratio grows "
    "with TP: the report's batch-1 points sit closest to a single GPU.")
with st.expander("How the roofline is fitted, and what is held out"):
    st.markdown(
        "- Source: the Kimi Linear report (arXiv 2510.26692, Figs. 1b, 7a, 7b); the published points are always "
        "those of Kimi-Linear-48B-A3B.\n"
        f"- Prefill: α = {view.fit.alpha:.2f} (attention) and β = {view.fit.beta:.2f} (every other kind), least "
        f"squares on relative error over the nine Kimi Linear points of Fig. 7a, once, on {view.fit_setup} (the "
        "report states no setup; this one is assumed). The nine all-MLA points are held out: the fitted all-MLA "
        "curve predicts them. Every other GPU and TP carries the same α, β (a prediction, never a refit), as the "
        "service times of pages 13–15 do: a refit per GPU would force every GPU to the report's seconds.\n"
        "- TPOT is the physical roofline at batch 1: nothing is fitted.\n"
        "- TP above 8 spans two 8-GPU nodes: its all-reduces run over InfiniBand (400 Gb/s NDR = 50 GB/s per GPU; "
        "200 Gb/s HDR on A100), not NVLink.")
    show_table(view.prefill_points, {
        "curve": "Curve", "context": num("Context (tokens)"), "role": "Role",
        "published": num("Published (s)", "%.3f"), "model": num(f"Fitted, {view.fit_setup} (s)", "%.3f"),
        "rel_error": pct("Fitted vs published")})

st.subheader("Largest batch each model fits: the report's 6.3× and 6×")
bt = view.batch
per_token = go.Figure()
for name, colour in colours.items():
    g = bt[bt.model == name]
    per_token.add_trace(go.Scatter(x=g.context_tokens, y=g.time_per_token_ms, mode="lines+markers",
                                   line=dict(color=colour, dash="dot"), customdata=g.batch,
                                   hovertemplate="%{y:.3f} ms per token at batch %{customdata}",
                                   name=f"{name}: physical roofline, largest batch ({preset_title(model)})"))
    p = view.published[view.published.model == name]
    per_token.add_trace(go.Scatter(x=p.context_tokens, y=p.time_per_token_ms, mode="markers", marker=dict(color=colour, symbol="x"),
                                   name=f"{name}: published Fig. 1b (48B-A3B, batches unstated)"))
per_token.update_layout(xaxis_type="log", yaxis_type="log", xaxis_title="context (tokens, log)",
                        yaxis_title="time per output token = TPOT ÷ batch (ms, log)",
                        legend=dict(orientation="h", y=-0.3))
show_chart(per_token, bt, key="p15_batch_chart")
tc = view.throughput
unfit = {"all MLA": "the all-MLA model cannot", "Kimi Linear": "Kimi Linear cannot"}
missing = " and ".join(unfit[u] for u in tc.unfit)


def _tokens(c: int) -> str:
    return f"{c / 2 ** 20:g}M" if c >= 2 ** 20 else f"{c / 2 ** 10:g}K"


st.markdown(
    (f"On {view.setup}, {missing} hold one {_tokens(tc.largest_context)}-token sequence in what "
     f"{MEMORY_FRACTION:.0%} of HBM leaves after the weights: no throughput to compare there. " if tc.unfit else "")
    + (f"At {_tokens(tc.context_tokens or 1)} tokens{', the largest context both fit,' if tc.unfit else ''} on "
       f"{view.setup}, each model at the largest batch its memory holds after the weights ({MEMORY_FRACTION:.0%} of "
       f"HBM, vLLM's default), Kimi-Linear-48B-A3B's roofline throughput is **{tc.model:.2f}×** the all-MLA model's, "
       f"against the report's **{tc.published:.2f}×** (Fig. 1b) and "
       if tc.context_tokens else "Neither model holds one sequence of any report context here; the report claims ")
    + f"\"up to **{REPORT_THROUGHPUT_CLAIM:.0f}×** decoding throughput\". What the roofline reproduces: the bytes "
    "argument, a ratio near MLA's KV bytes per token over Kimi Linear's (27 / 7 ≈ 3.9×) once the KV dominates. What "
    "it cannot: the rest is kernel efficiency at long context (MLA's attention kernels below peak bandwidth at 1M), "
    "which a roofline runs at peak by construction.")

st.subheader("2 · Policy comparison at real scale")
d1, d2 = st.columns([1, 2])
num_requests = links.slider(d1, "Requests (cap)", "p15_requests")
policies = links.multiselect(d2, "Policies", "p15_policies")
data, upload_name = upload_parts(st.file_uploader("Mooncake trace (JSONL, optional; the synthetic generator "
                                                  "otherwise)", type=["jsonl", "json"], key="p15_upload"))
fractions = ", ".join(f"1/{round(1 / f)}" if f < 1 else "1" for f in BUDGET_FRACTIONS)
st.caption(f"Budgets per replica: {fractions} × the {view.free_gb:,.0f} GB the {tp} × {hw} HBM leaves after the "
           f"weights ({view.hbm_gb:,.0f} − {view.weights_gb:,.0f} GB), for cached KV + checkpoints + the running "
           f"request's state slots; ours at C = {OURS_C}, extra_buffer at chunked_prefill_size = {EXTRA_BUFFER_CHUNK}. "
           f"The interval sweep runs at {INTERVAL_BUDGET_FRACTION:g} × the same.")
if not policies:
    st.info("Choose at least one policy.")
    st.stop()


@st.cache_data(show_spinner=False, max_entries=16, ttl="1h")
def _policies(replica, num_requests, data, upload_name, policies):
    bar = st.progress(0.0, text="Replaying the trace…")
    out = policy_view(replica, num_requests, data, upload_name, policies,
                      progress=lambda done, total: bar.progress(done / total, text=f"Replaying… {done}/{total} runs"))
    bar.empty()
    return out


run_on_request("p15_sweep_on", "p15_sweep_button", "Run the policy sweep", "Replays the trace once per policy and "
               "budget and per interval: seconds of CPU the first time, cached afterwards (shared by every visitor).")
pv = engine_call(_policies, replica, num_requests, data, upload_name, tuple(policies))
if pv.note:
    st.info(pv.note)
b = pv.budgets
hit = go.Figure([go.Scatter(x=g.budget_gb, y=g.token_hit_ratio, mode="lines+markers", name=policy_title(p)) for p, g in b.groupby("policy", sort=False)])
hit.add_trace(go.Scatter(x=[b.budget_gb.min(), b.budget_gb.max()], y=[pv.ideal_hit_ratio] * 2, mode="lines",
                         line=dict(dash="dash", color="grey"), name=f"block ideal, unlimited cache: {pv.ideal_hit_ratio:.3f}"))
hit.update_layout(xaxis_type="log", xaxis_title="memory budget per replica (GB, log)", yaxis_title="token hit ratio (fraction)",
                  legend=dict(orientation="h", y=-0.3))
show_chart(hit, b.assign(ideal_hit_ratio=pv.ideal_hit_ratio), key="p15_hit_chart")
saved = go.Figure([go.Scatter(x=g.budget_gb, y=g.mean_ttft_s * 1e3, mode="lines+markers", name=policy_title(p),
                              customdata=g.prefill_saved, hovertemplate="%{y:.1f} ms, saved %{customdata:.1%}")
                   for p, g in b.groupby("policy", sort=False)])
saved.add_hline(y=pv.cold_ttft_s * 1e3, line_dash="dash", annotation_text=f"no cache: {pv.cold_ttft_s * 1e3:.1f} ms")
saved.update_layout(xaxis_type="log", xaxis_title="memory budget per replica (GB, log)",
                    yaxis_title="mean TTFT, roofline (ms)", legend=dict(orientation="h", y=-0.3))
show_chart(saved, b[["policy", "budget_gb", "mean_ttft_s", "prefill_saved"]], key="p15_ttft_chart")
mid = b[b.budget_gb == b.budget_gb.unique()[len(b.budget_gb.unique()) // 2]]
kinds = go.Figure([go.Bar(x=mid.policy.map(policy_title), y=mid[f"{k}_gb"], name=name) for k, name in
                   (("kv", "KV pages"), ("state", "state checkpoints"), ("running", "running state slots"))])
kinds.add_hline(y=mid.budget_gb.iloc[0], line_dash="dash", layer="below", annotation_text=f"budget: {mid.budget_gb.iloc[0]:,.0f} GB")
kinds.update_layout(barmode="stack", title=f"bytes held when the total peaked, {mid.budget_gb.iloc[0]:,.0f} GB budget",
                    xaxis_title="policy", yaxis_title="bytes held (GB)", legend=dict(orientation="h", y=-0.3))
show_chart(kinds, mid[["policy", "budget_gb", "kv_gb", "state_gb", "running_gb", "peak_kv_gb", "peak_state_gb",
                      "states_written", "states_evicted", "kv_evicted_tokens"]], key="p15_bytes_chart")
if len(pv.intervals):
    iv = go.Figure([go.Scatter(x=g.interval_tokens, y=g.token_hit_ratio, mode="lines+markers", name=policy_title(p))
                    for p, g in pv.intervals.groupby("policy", sort=False)])
    iv.update_layout(xaxis_type="log", title=f"token hit ratio against the state interval, at "
                     f"{pv.interval_budget_gb:,.0f} GB per replica",
                     xaxis_title="state interval (tokens, log): ours' C / extra_buffer's chunked_prefill_size",
                     yaxis_title="token hit ratio (fraction)", legend=dict(orientation="h", y=-0.3))
    show_chart(iv, pv.intervals, key="p15_interval_chart")
    ivt = go.Figure([go.Scatter(x=g.interval_tokens, y=g.mean_ttft_s * 1e3, mode="lines+markers", name=policy_title(p),
                                customdata=g.p99_ttft_s * 1e3, hovertemplate="mean %{y:.1f} ms, P99 %{customdata:.0f} ms")
                     for p, g in pv.intervals.groupby("policy", sort=False)])
    ivt.update_layout(xaxis_type="log", title=f"mean TTFT against the state interval, at "
                      f"{pv.interval_budget_gb:,.0f} GB per replica",
                      xaxis_title="state interval (tokens, log): ours' C / extra_buffer's chunked_prefill_size",
                      yaxis_title="mean TTFT, roofline (ms)", legend=dict(orientation="h", y=-0.3))
    show_chart(ivt, pv.intervals[["policy", "interval_tokens", "mean_ttft_s", "p99_ttft_s", "token_hit_ratio"]],
               key="p15_interval_ttft_chart")
ch = pv.choice
by_budget = ch[ch.interval_tokens.isna()]
by_interval = ch[ch.interval_tokens.notna()]


def _pick(r) -> str:
    best = f"{policy_title(r.policy)} ({r.mean_ttft_s * 1e3:.1f} ms, hit {r.token_hit_ratio:.3f})"
    if not r.tied:
        return f"{r.budget_gb:,.0f} GB → {best}"
    others = ", ".join(f"{policy_title(p)} ({t * 1e3:.1f} ms)" for p, t in r.tied)
    return f"{r.budget_gb:,.0f} GB → tie within {TIE_TOLERANCE:.0%}: {best}, {others}"


st.markdown("**What to choose on this trace.** Lowest mean TTFT per budget (within "
            f"{TIE_TOLERANCE:.0%} is a tie: below the roofline's precision): " + "; ".join(
    _pick(r) for r in by_budget.itertuples()) + (". Best interval at " f"{pv.interval_budget_gb:,.0f} GB: " + "; ".join(
    f"{policy_title(r.policy)} → {int(r.interval_tokens):,} tokens ({r.mean_ttft_s * 1e3:.1f} ms"
    + (": the largest swept; the curve still falls)" if r.still_falls else ")") for r in by_interval.itertuples())
    if len(by_interval) else "") + ".")
show_table(b.assign(mean_ttft_ms=b.mean_ttft_s * 1e3, policy=b.policy.map(policy_title)), {"policy": "Policy", "budget_gb": num("Budget / replica (GB)", "%,.0f"),
               "token_hit_ratio": pct("Token hit ratio"), "mean_ttft_ms": num("Mean TTFT (ms)", "%.1f"),
               "prefill_saved": pct("Prefill saved"), "kv_gb": num("KV held (GB)", "%,.1f"),
               "state_gb": num("Checkpoints (GB)", "%,.1f"),
               "kv_evicted_tokens": num("KV evicted (tokens)")})
st.download_button("Download CSV", b.to_csv(index=False).encode(), "p15_policies.csv", "text/csv", key="p15_policies_csv",
                   help="Every column, including running state slots, checkpoints written and evicted, and the replay's run time")
st.caption(
    f"{pv.num_requests:,} requests, {pv.total_tokens:,} prompt tokens. What to notice: every policy stays below the "
    "block ideal; more states per request (ours at small C) spend the budget on state instead of KV. The bars "
    "split the bytes held when the total peaked, so they stay under the budget line.")
with st.expander("What the replay models"):
    st.markdown(
        "- Block ideal (Mooncake, FAST'25): an unlimited cache hits each request's leading run of hash ids seen "
        "before.\n"
        "- vLLM all is not in the default sweep: vLLM's Kimi-Linear model class does not declare "
        "SupportsMambaPrefixCaching, so vLLM serves Kimi models in align. Pick it to see the counterfactual of one "
        f"state per block of {pv.vllm_block_tokens} tokens.\n"
        "- Each kind's own peak (reached at different times, so their sum can pass the budget) is in the CSV.\n"
        "- The budget buys KV pages and checkpoints in the model's real bytes. TTFT is the fitted roofline of part 1 "
        "at batch 1 without queueing, plus a checkpoint restore on a hit.\n"
        "- SGLang's mamba_track_interval only acts in decode, which a prompt-only replay never reaches: in prefill "
        "extra_buffer tracks one state per chunk, so its interval here is chunked_prefill_size. Only extra_buffer "
        "caches a state at the branching point (SGLang PR #14792); no_buffer caches at chunk ends and the request "
        "end.\n"
        "- vLLM align caches the state at each chunk's last full block and, when the attention cache holds a longer "
        "prefix than any cached state, ends the first chunk where that shared prefix ends (vLLM PR #37898), so the "
        "next request sharing it hits there. A vLLM state costs one page per layer of its KV-cache groups, padding "
        "included (Kimi-Linear: 21 pages for 20 KDA layers; K3: 72 for 69).\n"
        "- Outputs are not modelled (a trace does not say which later prompt holds them), so a state an engine saves "
        "at a request's end or while decoding sits at the prompt's end here. In a chat the next turn repeats the "
        "previous prompt and output, and SGLang no_buffer (request-end state) and vLLM align (decode-time blocks, "
        "vLLM PR #30877) would hit it; here the next turn's 512-token block match seldom reaches the prompt's end, so "
        "their lines are lower bounds on chat traffic, no_buffer's most.\n"
        "- Sources: SGLang mamba_radix_cache.py, vLLM single_type_kv_cache_manager.py (mamba_cache_mode), "
        "serve/scale/policies.")
