"""05 Unified page pool: a live request stream on the real PagePool, unified vs statically split."""
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from pages._common import engine_call, persist, show_chart
from serve.pool_workload import WorkloadConfig, policy_waste, simulate

st.title("Unified page pool")
st.write(
    "A hybrid model caches MLA latents **per token** and KDA states **per sequence**. One pool of equal-size "
    "pages, each tagged MLA_KV or KDA_STATE, serves both (vLLM's hybrid allocator, SGLang's unified arena). "
    "Below, a seeded stream of short and long requests runs on the real `PagePool` of the demo model; halfway "
    "through the mix flips, and the same arrivals also run on a static split of the same bytes.")

POLICY = {"unified page size": "unified", "multi-page state": "multi_page"}
c1, c2, c3 = st.columns(3)
pool_mib = c1.slider("Pool size (MiB)", 4, 128, key=persist("p05_pool_mib", 32))
policy = POLICY[c2.selectbox("Page-size policy", list(POLICY), key=persist("p05_policy", "unified page size"))]
arrival = c3.selectbox("Arrival pattern", ["steady", "bursty"], key=persist("p05_arrival", "steady"))
d1, d2, d3, d4 = st.columns(4)
long_share = d1.slider("Long requests, first half (share)", 0.0, 1.0, step=0.05, key=persist("p05_long_share", 0.1))
groups = d2.slider("KDA groups G", 1, 6, key=persist("p05_groups", 1))
seed = d3.number_input("Seed", 0, 9999, key=persist("p05_seed", 0))
step = d4.slider("Grid at step", 0, 199, key=persist("p05_step", 60))


@st.cache_data(show_spinner="Running the request stream on the pool…")
def _run(pool_mib, policy, long_share, arrival, groups, seed, step):
    cfg = WorkloadConfig(pool_mib=pool_mib, policy=policy, long_share=long_share, arrival=arrival,
                         num_groups=groups, seed=seed)
    res = simulate(cfg, snapshot_step=step)
    return {"layout": res.layout, "num_pages": res.num_pages, "kv_static": res.kv_pages_static,
            "timeline": pd.DataFrame(res.timeline), "outcomes": pd.DataFrame(res.outcomes),
            "snapshot": res.snapshot, "latency": res.latency_ns, "waste": res.waste}


r = engine_call(_run, float(pool_mib), policy, long_share, arrival, groups, int(seed), step)
lay = r["layout"]
st.caption(f"{r['num_pages']:,} pages of {lay.page_bytes:,} B · MLA_KV block = {lay.block_size} tokens · a group "
           f"state spans {lay.state_pages} page(s) · static split: {r['kv_static']:,} KV pages + "
           f"{r['num_pages'] - r['kv_static']:,} state pages (sized for the first half's mix).")

st.subheader(f"1 · The pool at step {step}, coloured by kind and owner")
cols = 64
snap = r["snapshot"]
z = np.full(-(-len(snap) // cols) * cols, np.nan)
text = np.full(z.shape, "", dtype=object)
for p, (kind, owner, ref) in enumerate(snap):
    z[p] = 0 if owner is None else int(kind) * 5 - 4 + owner % 5     # 0 free, 1-5 MLA_KV, 6-10 KDA_STATE
    text[p] = f"page {p}: {kind.name}" + ("" if owner is None else f", request {owner}, ref {ref}")
blues, oranges = ["#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c"], ["#fdae6b", "#fd8d3c", "#f16913", "#d94801", "#a63603"]
palette = ["#e5e5e5"] + blues + oranges
scale = [[v, c] for i, c in enumerate(palette) for v in (i / 11, (i + 1) / 11)]
fig = go.Figure(go.Heatmap(z=z.reshape(-1, cols), text=text.reshape(-1, cols), hoverinfo="text", colorscale=scale,
                           zmin=-0.5, zmax=10.5, showscale=False, xgap=1, ygap=1))
fig.update_layout(xaxis_title="page id mod 64", yaxis_title="page id ÷ 64 (row)", yaxis_autorange="reversed",
                  height=min(700, 120 + 6 * len(z) // cols))
grid_df = pd.DataFrame([(p, k.name, o, rf) for p, (k, o, rf) in enumerate(snap)], columns=["page", "kind", "owner", "refcount"])
show_chart(fig, grid_df, key="p05_grid")
st.caption("Grey = free, blues = MLA_KV, oranges = KDA_STATE; shades tell owners apart (request id mod 5).")

st.subheader("2 · Utilisation by kind over time")
tl = r["timeline"]
uni, spl = tl[tl.variant == "unified"], tl[tl.variant == "static split"]
n = r["num_pages"]
fig2 = go.Figure()
fig2.add_trace(go.Scatter(x=uni.step, y=100 * uni.kda_state_pages / n, name="unified: KDA_STATE", stackgroup="u",
                          line=dict(color="#f16913")))
fig2.add_trace(go.Scatter(x=uni.step, y=100 * uni.mla_kv_pages / n, name="unified: MLA_KV", stackgroup="u",
                          line=dict(color="#2171b5")))
fig2.add_trace(go.Scatter(x=spl.step, y=100 * spl.mla_kv_pages / r["kv_static"], name="static split: KV pool used",
                          line=dict(color="#08519c", dash="dot")))
fig2.add_trace(go.Scatter(x=spl.step, y=100 * spl.kda_state_pages / (n - r["kv_static"]),
                          name="static split: state pool used", line=dict(color="#a63603", dash="dot")))
fig2.add_vline(x=100, line_dash="dash", line_color="gray", annotation_text="mix flips")
fig2.add_vline(x=step, line_color="black", annotation_text="grid")
fig2.update_layout(xaxis_title="step", yaxis_title="pages in use (% of the pool)", legend=dict(orientation="h", y=-0.3))
show_chart(fig2, tl, key="p05_util")

st.subheader("3 · Admitted vs rejected: unified vs static split")
oc = r["outcomes"].assign(bar=lambda d: "phase " + d.phase.astype(str) + " · " + d.variant)
fig3 = go.Figure([go.Bar(x=sub.bar, y=sub.requests, name=outcome, marker_color=color)
                  for (outcome, sub), color in zip(oc.groupby("outcome", sort=False), ["#41ab5d", "#cb181d"])])
fig3.update_layout(xaxis_title="half of the run (phase 2 = after the mix flips) · pool", yaxis_title="requests",
                   barmode="stack", legend=dict(orientation="h", y=-0.3))
show_chart(fig3, oc, key="p05_outcomes")

st.subheader("4 · Waste of each page-size policy")
rows = []
for name, pol in POLICY.items():
    w = engine_call(_run, float(pool_mib), pol, long_share, arrival, groups, int(seed), step)["waste"]
    used = max(w["used_bytes"], 1.0)
    rows += [{"policy": name, "waste": "KDA state padding / tail", "pct_of_used": 100 * w["state_waste_bytes"] / used},
             {"policy": name, "waste": "MLA last-block slack", "pct_of_used": 100 * w["kv_slack_bytes"] / used}]
wdf = pd.DataFrame(rows)
fig4 = go.Figure([go.Bar(x=sub.policy, y=sub.pct_of_used, name=kind) for kind, sub in wdf.groupby("waste")])
fig4.update_layout(xaxis_title="policy (demo model, this workload)", yaxis_title="unused bytes (% of used pool bytes, time-average)",
                   barmode="stack", legend=dict(orientation="h", y=-0.3))
show_chart(fig4, wdf, key="p05_waste")
real = pd.DataFrame([{"model": m, **row} for m in ("kimi-linear-48b-a3b", "kimi-k3")
                     for row in policy_waste(m, 16, min(groups, 20))])
st.dataframe(real, hide_index=True, width="stretch")
st.caption("Real presets at 16-token blocks, G groups (bf16 KV, fp32 state, bf16 conv). With the unified block rounded "
           "to 16 tokens, both policies leave the same state tail (⌈state / 16-token page⌉ pages either way); what "
           "differs is the MLA block: thousands of tokens per page under the unified policy at G = 1.")

st.subheader("5 · Measured alloc / free call latency")
lat = r["latency"]
ldf = pd.DataFrame([(k, v) for k, vs in lat.items() for v in vs], columns=["call", "latency_ns"])
fig5 = go.Figure([go.Histogram(x=sub.latency_ns, name=k, nbinsx=60, opacity=0.7) for k, sub in ldf.groupby("call")])
fig5.update_layout(xaxis_title="latency per call (ns, log)", yaxis_title="calls", xaxis_type="log", barmode="overlay")
show_chart(fig5, ldf, key="p05_latency")
pct = ldf.groupby("call").latency_ns.quantile([0.5, 0.99]).unstack()
st.write(" · ".join(f"**{k}** p50 {row[0.5]:,.0f} ns, p99 {row[0.99]:,.0f} ns" for k, row in pct.iterrows()))

st.info(
    "What to notice: the unified pool lends pages to whichever kind needs them, so when the mix flips it keeps "
    "admitting while one half of the static split runs dry and the other idles. Unified page size (vLLM: grow the "
    "block until one KV page ≥ one state, `block = ⌈state / (KV bytes per token)⌉` rounded to 16) wastes little on "
    "the state but makes MLA blocks hundreds of tokens long, so the last block of every request is mostly slack; "
    "multi-page state (`⌈state / page⌉` pages) keeps 16-token blocks. Latencies are one `alloc`/`decref` call per "
    "request per kind, measured with `perf_counter_ns` on this shared CPU (p99 shows the jitter). "
    "Sizes from `kda_core.config`; policies in `serve/page_policy.py`.")
