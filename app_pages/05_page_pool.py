"""05 Unified page pool: a live request stream on the real PagePool, unified vs statically split."""
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from app_pages.charts import num, pct, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import measured_stamp, remeasure_button, requested
from app_pages.params import Choice, Float, Int
from lab.pool import LATENCY_REPEATS, call_latency, page05

st.title("Unified page pool")
st.write(
    "A hybrid model caches MLA latents **per token** and KDA states **per sequence**. One pool of equal-size "
    "pages, each tagged MLA_KV or KDA_STATE, serves both (vLLM's hybrid allocator, SGLang's unified arena). "
    "Below, a seeded stream of short and long requests runs on the real `PagePool` of the demo model, with the "
    "engine's own `CacheLayout` sizing its pages; halfway through the mix flips, and the same arrivals also run on "
    "a static split of the same bytes.")

POLICY = {"multi-page state": "multi_page", "unified page size": "unified"}
# Defaults where the flip shows the claim below (measured, seed 0): a long-heavy first half sizes the static split
# for few states; after the flip to short requests the unified pool admits 210 of 211 while the static split admits
# 130 (its state pages run dry, its KV pages idle). From a short-heavy start (10 % long) both pools reject alike.
links = declare(
    Int("p05_pool_mib", 64, 4, 128),
    Choice("p05_policy", "multi-page state", POLICY),
    Choice("p05_arrival", "steady", ["steady", "bursty"]),
    Float("p05_long_share", 0.8, 0.0, 1.0, step=0.05),
    Int("p05_groups", 1, 1, 6),
    Int("p05_seed", 0, 0, 9999),
    Int("p05_step", 60, 0, 199),
)
c1, c2, c3 = st.columns(3)
pool_mib = links.slider(c1, "Pool size (MiB)", "p05_pool_mib")
policy = POLICY[links.selectbox(c2, "Page-size policy", "p05_policy")]
arrival = links.selectbox(c3, "Arrival pattern", "p05_arrival")
d1, d2, d3, d4 = st.columns(4)
long_share = links.slider(d1, "Long requests, first half (share; the second half has the rest)", "p05_long_share")
groups = links.slider(d2, "KDA groups G", "p05_groups")
seed = links.number_input(d3, "Seed", "p05_seed")
step = links.slider(d4, "Grid at step", "p05_step")
_run = st.cache_data(page05, show_spinner="Running the request stream on the pool…", max_entries=16, ttl="1h")
_p05_latency = st.cache_data(call_latency,
                             show_spinner=f"Timing alloc / free calls: {LATENCY_REPEATS} runs of the stream after a warm-up…",
                             max_entries=16, ttl="1h")
r = engine_call(_run, float(pool_mib), policy, long_share, arrival, groups, int(seed), step)
lay = r.layout
st.caption(f"{r.num_pages:,} pages of {lay.page_bytes:,} B · MLA_KV block = {lay.block_size} tokens "
           f"({lay.kv_block_bytes:,} B, {lay.kv_page_padding_bytes:,} B of padding per KV page) · a model's KDA state "
           f"spans {lay.state_pages} page(s) in {lay.num_groups} group(s) · static split: {r.kv_pages_static:,} KV pages + "
           f"{r.num_pages - r.kv_pages_static:,} state pages (sized for the first half's mix).")

st.subheader(f"1 · The pool at step {step}, coloured by kind and owner")
cols, max_rows = 64, 48
snap = r.snapshot
per = -(-len(snap) // (cols * max_rows))         # pages per cell: 1 up to 3,072 pages, then cells aggregate pages
n_cells = -(-len(snap) // per)
z = np.full(-(-n_cells // cols) * cols, np.nan)
text = np.full(z.shape, "", dtype=object)
kinds_held = sorted({k for k, _, _ in snap}, key=int)   # once: per cell it made the loop quadratic in the pages
for c in range(n_cells):
    cell = snap[c * per:(c + 1) * per]
    if per == 1:
        kind, owner, ref = cell[0]
        z[c] = 0 if owner is None else int(kind) * 5 - 4 + owner % 5     # 0 free, 1-5 MLA_KV, 6-10 KDA_STATE
        text[c] = f"page {c}: {kind.name}" + ("" if owner is None else f", request {owner}, ref {ref}")
        continue
    used = [k for k, o, _ in cell if o is not None]
    counts = {k: used.count(k) for k in set(used)}
    if counts:                       # the majority kind; the shade says how full of it the cell is
        kind = max(counts, key=lambda k: (counts[k], int(k)))
        z[c] = int(kind) * 5 - 4 + min(4, int(5 * counts[kind] / len(cell) - 1e-9))
    else:
        z[c] = 0
    text[c] = (f"pages {c * per:,}–{c * per + len(cell) - 1:,}: " +
               ", ".join(f"{counts.get(k, 0)} {k.name}" for k in kinds_held) +
               f", {len(cell) - len(used)} free")
blues, oranges = ["#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c"], ["#fdae6b", "#fd8d3c", "#f16913", "#d94801", "#a63603"]
palette = ["#e5e5e5"] + blues + oranges
scale = [[v, c] for i, c in enumerate(palette) for v in (i / 11, (i + 1) / 11)]
fig = go.Figure(go.Heatmap(z=z.reshape(-1, cols), text=text.reshape(-1, cols), hoverinfo="text", colorscale=scale,
                           zmin=-0.5, zmax=10.5, showscale=False, xgap=1, ygap=1))
unit = "page" if per == 1 else f"cell of {per} pages"
fig.update_layout(xaxis_title=f"{unit} index mod 64", yaxis_title=f"{unit} index ÷ 64 (row)", yaxis_autorange="reversed",
                  height=120 + 12 * (len(z) // cols))
grid_df = pd.DataFrame([(p, k.name, o, rf) for p, (k, o, rf) in enumerate(snap)], columns=["page", "kind", "owner", "refcount"])
show_chart(fig, grid_df, key="p05_grid")
st.caption("Grey = free, blues = MLA_KV, oranges = KDA_STATE; shades tell owners apart (request id mod 5)." if per == 1 else
           f"{len(snap):,} pages, {per} per cell. A cell takes the colour of its majority kind, darker when more of "
           "its pages hold that kind; grey = all free. Hover for the counts; the CSV has every page.")

st.subheader("2 · Utilisation by kind over time")
tl = r.timeline
uni, spl = tl[tl.variant == "unified"], tl[tl.variant == "static split"]
n, kv_static = r.num_pages, r.kv_pages_static
fig2 = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12, subplot_titles=(   # the dashed lines
    f"MLA_KV pages (dashed: static KV pool size, {kv_static:,} pages)",                    # named above the panel,
    f"KDA_STATE pages (dashed: static state pool size, {n - kv_static:,} pages)"))         # not over its data
PANELS = ((1, "mla_kv_pages", "MLA_KV", "#2171b5", kv_static, "KV pool"),
          (2, "kda_state_pages", "KDA_STATE", "#f16913", n - kv_static, "state pool"))
for row, col, kind, color, cap, cap_name in PANELS:
    fig2.add_trace(go.Scatter(x=uni.step, y=100 * uni[col] / n, name=f"unified: {kind}", fill="tozeroy",
                              line=dict(color=color)), row=row, col=1)
    fig2.add_trace(go.Scatter(x=spl.step, y=100 * spl[col] / n, name=f"static split: {cap_name} used",
                              line=dict(color=color, dash="dot")), row=row, col=1)
    fig2.add_hline(y=100 * cap / n, line_dash="dash", line_color=color, row=row, col=1)
    fig2.add_vline(x=100, line_dash="dash", line_color="gray", row=row, col=1)
    fig2.add_vline(x=step, line_color="black", row=row, col=1)
    fig2.update_yaxes(title_text="% of the whole pool", rangemode="tozero", row=row, col=1)
fig2.update_xaxes(title_text=f"step (black: step {step}, the grid above; grey dashed: step 100, the mix flips)",
                  row=2, col=1)                                          # named here, not written over the data
fig2.update_layout(height=560, legend=dict(orientation="h", y=-0.18))
show_chart(fig2, tl, key="p05_util")
st.caption(f"Both panels count pages as a share of all {n:,} pages, for both pools. A static pool cannot go above "
           "its dashed line; the unified pool can lend any free page to either kind.")

st.subheader("3 · Admitted vs rejected: unified vs static split")
oc = r.outcomes.assign(bar=lambda d: "phase " + d.phase.astype(str) + " · " + d.variant)
fig3 = go.Figure([go.Bar(x=sub.bar, y=sub.requests, name=outcome, marker_color=color)
                  for (outcome, sub), color in zip(oc.groupby("outcome", sort=False), ["#41ab5d", "#cb181d"])])
fig3.update_layout(xaxis_title="half of the run (phase 2 = after the mix flips) · pool", yaxis_title="requests",
                   barmode="stack", legend=dict(orientation="h", y=-0.3))
show_chart(fig3, oc, key="p05_outcomes")

st.subheader("4 · Waste of each page-size policy")
NAME = {v: k for k, v in POLICY.items()}
wdf = r.waste.assign(policy=lambda d: d.policy.map(NAME))
WASTE_COLOR = {"KDA state padding / tail": "#f16913", "KV page padding": "#6baed6", "MLA last-block slack": "#2171b5"}
fig4 = go.Figure([go.Bar(x=sub.policy, y=sub.pct_of_used, name=kind, marker_color=WASTE_COLOR[kind])
                  for kind, sub in wdf.groupby("waste")])
fig4.update_layout(xaxis_title="policy (demo model, this workload)", yaxis_title="unused bytes (% of used pool bytes, time-average)",
                   barmode="stack", legend=dict(orientation="h", y=-0.3))
show_chart(fig4, wdf, key="p05_waste")
real = r.real
show_table(real.assign(policy=real.policy.map(NAME), state_waste_pct=real.state_waste_pct / 100,
                       kv_page_padding_pct=real.kv_page_padding_pct / 100), {
    "model": "Model", "policy": "Policy", "block_size": num("Block (tokens)"), "page_bytes": num("Page (B)"),
    "state_pages": num("Pages per state"), "state_waste_pct": pct("State padding / tail", 2),
    "kv_page_padding_pct": pct("KV page padding")})
st.caption("Real presets at 16-token blocks (the prefix-cache granularity), G groups: multi-page state wastes only "
           "the tail of a state's last page; unified page size makes every KV page almost all padding unless G is large.")
with st.expander("How the real pages are sized"):
    st.markdown("Bytes: bf16 KV, fp32 state, bf16 conv, sized by the engine's own `CacheLayout.page_bytes_for`. The "
                "block stays 16 tokens under both policies; a unified page is as large as a whole group state.")
vdf = r.vllm
show_table(vdf, {"model": "Model", "vLLM backend": "vLLM backend", "kernel block": num("Kernel block (tokens)"),
                 "vLLM block (tokens)": num("vLLM block (tokens)"), "vLLM page, one layer (B)": num("vLLM page, one layer (B)"),
                 "vLLM state padding": pct("vLLM state padding", 2),
                 "our KV page padding": pct("Our KV page padding", help="unified page size, 16-token blocks")})
st.download_button("Download CSV", vdf.to_csv(index=False).encode(), "p05_vllm_block.csv", "text/csv",
                   key="p05_vllm_csv", help="Every column, ours included (block, page bytes, state padding)")
st.caption("What vLLM itself picks (G = 1 on our side): it grows the block so the state padding is small; our "
           "unified policy keeps the block and pads the KV pages instead.")
with st.expander("How vLLM sizes its block"):
    st.markdown(
        "- vLLM sizes pages per layer: one attention page = block × one MLA layer's latent (r + rope) × 2 B, one KDA "
        "page = one layer's recurrent (fp32) + conv (bf16) state.\n"
        "- It aligns the block to the attention backend's kernel block size (`get_supported_kernel_block_sizes`: "
        "FlashInfer MLA 32, FlashMLA 64, CUTLASS MLA 128), not to 16: block = align · ⌈state / (align · page per "
        "token)⌉ (`Platform._align_hybrid_block_size`, vllm/platforms/interface.py), then pads the state page to the "
        "attention page.\n"
        "- Ours: `serve.memory.vllm_block.vllm_block_pick`.")

st.subheader("5 · Measured alloc / free call latency")
if requested("p05_latency_on", "p05_measure_button", "Measure alloc / free latency",
             f"Replays the stream on a fresh unified pool {LATENCY_REPEATS} times after a warm-up run, each alloc and "
             "decref call timed with perf_counter_ns (a fraction of a second of CPU), then keeps the result for every "
             "visitor with these settings."):
    lat = engine_call(_p05_latency, float(pool_mib), policy, long_share, arrival, groups, int(seed))
    remeasure_button(_p05_latency, key="p05_remeasure")
    h, qs = lat.histogram, lat.percentiles
    edges = np.asarray(h.edges_ns)
    top = max(max(c) for c in h.counts.values()) * 1.05                   # height of the p50 / p99 markers
    fig5 = go.Figure()
    for (call, counts), color in zip(h.counts.items(), ["#2171b5", "#f16913"]):
        # bars spanning [edges[i], edges[i+1]): centre and width in ns, so they sit exactly on the log axis
        fig5.add_trace(go.Bar(x=(edges[:-1] + edges[1:]) / 2, y=counts, width=np.diff(edges), name=call, opacity=0.6,
                              marker_color=color, customdata=np.stack([edges[:-1], edges[1:]], axis=1),
                              hovertemplate="%{customdata[0]:,.0f}–%{customdata[1]:,.0f} ns: %{y} calls"))
        for q, dash in ((50, "dot"), (99, "dash")):
            row = qs[(qs.call == call) & (qs.percentile == q)].iloc[0]
            v, name = row.median_ns, f"{call} p{q}"
            fig5.add_trace(go.Scatter(x=[v, v], y=[0, top], mode="lines", line=dict(color=color, dash=dash, width=2),
                                      name=f"{name} = {v:,.0f} ns", legendgroup=name, hovertemplate=f"{name}: {v:,.0f} ns"))
            fig5.add_trace(go.Scatter(x=[v], y=[top], mode="markers", marker=dict(color=color, size=7), showlegend=False,
                                      name=f"{name} = {v:,.0f} ns",
                                      legendgroup=name, error_x=dict(type="data", symmetric=False, array=[row.q3_ns - v],
                                                                     arrayminus=[v - row.q1_ns], color=color),
                                      hovertemplate=f"{name}: median {v:,.0f} ns, IQR {row.q1_ns:,.0f}–{row.q3_ns:,.0f} "
                                                    f"ns over {row.runs} runs<extra></extra>"))
    TICKS_NS = [m * 10 ** e for e in range(0, 8) for m in (1, 2, 5)]
    fig5.update_layout(xaxis=dict(title="latency per call (ns, log scale)", type="log", tickvals=TICKS_NS,
                                  ticktext=[f"{t:,}" for t in TICKS_NS]),
                       yaxis_title=f"calls per bin (10 bins per decade, all {LATENCY_REPEATS} runs)", barmode="overlay",
                       bargap=0)
    ldf = pd.DataFrame([(call, lo, hi, c) for call, counts in h.counts.items()
                        for lo, hi, c in zip(edges[:-1], edges[1:], counts)], columns=["call", "lo_ns", "hi_ns", "calls"])
    show_chart(fig5, ldf, key="p05_latency")
    measured_stamp(lat.conditions)
    st.write(" · ".join(f"**{row.call}** p{row.percentile} {row.median_ns:,.0f} ns (IQR {row.q1_ns:,.0f}–{row.q3_ns:,.0f})"
                        for row in qs.itertuples()))
    st.caption(f"Each run replays the same seeded stream on a fresh pool; a line is the median over the {LATENCY_REPEATS} "
               "runs of that run's percentile, the bar at its top the IQR over the runs.")

st.info(
    "What to notice: the unified pool lends pages to whichever kind needs them, so when the mix flips it keeps "
    "admitting while one half of the static split runs dry and the other idles. The page size decides the waste: "
    "multi-page state keeps one 16-token KV block per page and spreads a KDA state over ⌈state / page⌉ pages "
    "(only the last page's tail is unused); unified page size makes one page hold a whole group state, so each "
    "KV page carries page − block bytes of padding (more groups G → smaller states → less padding). vLLM instead "
    "grows the block (table above). Latencies are one `alloc`/`decref` call per request per kind, measured with "
    "`perf_counter_ns` on this shared CPU (p99 shows the jitter). Sizes from `kda_core.config`; the layout and "
    "both policies in `serve/memory/layout.py`, the engine's own.")
