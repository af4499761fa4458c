"""01 Snapshot vs projection bytes: what each speculative-decoding rollback strategy holds per verify."""
import math

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from app_pages.acceptance import acceptance_section, drafter_selector
from app_pages.charts import num, pct, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import url_widget
from lab.rollback import DTYPES, LAYER_PRESETS, preset_title, rollback_page

st.title("Snapshot vs projection bytes")
st.write(
    "A rejected draft token has already been folded into a KDA state, so speculative decoding must be able to "
    "rebuild the state at the last accepted token. **Snapshot** keeps the full state (and conv window) after every "
    "verify token; **projection replay** keeps only what the kernel consumed (k, v, g, β and the raw conv inputs) "
    "and replays; **ReplaySSM** keeps one checkpoint plus a ring of per-step records (k, u = β(v − S'ᵀk), g and the raw "
    "conv inputs), so a step writes a record instead of the state and a rollback is a cursor move; the **raw-input "
    "ring** keeps one hidden vector per token and re-projects. Bytes below are read "
    "with `nbytes()` from the buffers each strategy filled after a real one-layer verify run now on this CPU.")

c1, c2, c3 = st.columns(3)
preset = url_widget(c1.selectbox, "Layer size", "p01_preset", list(LAYER_PRESETS)[2], [*LAYER_PRESETS, "Custom"])
num_draft = url_widget(c2.slider, "Draft length n (verify = 1 + n tokens)", "p01_draft", 4, 1, 16)
dtype_name = url_widget(c3.selectbox, "Stored dtype s", "p01_dtype", "fp32", list(DTYPES))
if preset == "Custom":
    d1, d2, d3, d4 = st.columns(4)
    heads = url_widget(d1.slider, "Heads H", "p01_heads", 8, 1, 96)
    k_dim = url_widget(d2.select_slider, "Key dim K", "p01_k", 64, [16, 32, 64, 128])
    v_dim = url_widget(d3.select_slider, "Value dim V", "p01_v", 64, [16, 32, 64, 128])
    width = url_widget(d4.select_slider, "Layer input width d", "p01_d", 1024, [64, 256, 1024, 2304, 4096, 7168])
    shape = (heads, k_dim, v_dim, 4, width)
else:
    shape = tuple(LAYER_PRESETS[preset])
_measure = st.cache_data(rollback_page, show_spinner="Running a one-layer verify…", max_entries=32, ttl="1h")
page = engine_call(_measure, shape, num_draft, dtype_name)
shape = page.shape
df = pd.DataFrame(page.layer, columns=page.layer[0]._fields)
st.subheader(f"1 · One KDA layer (H={shape.num_heads}, K={shape.head_k_dim}, V={shape.head_v_dim}, "
             f"d={shape.hidden_size}), {1 + num_draft} verify tokens, {dtype_name}")
fig = go.Figure(go.Bar(x=df.strategy, y=df.vs_snapshot, marker_color=["#d62728", "#2ca02c", "#1f77b4", "#9467bd"],
                       text=[f"{b:,} B" for b in df.measured_bytes], textposition="outside"))
low, high = math.log10(df.vs_snapshot.min()), math.log10(df.vs_snapshot.max())   # decades spanned by the bars
fig.update_layout(xaxis_title="rollback strategy", yaxis_title="bytes held ÷ snapshot bytes (log)",
                  yaxis_type="log", yaxis_range=[math.floor(low) - 0.2, high + 0.4], yaxis_dtick=1, height=380)
show_chart(fig, df, key="p01_layer_chart")
show_table(df.assign(matches=df.measured_bytes == df.formula_bytes), {
    "strategy": "Strategy", "measured_bytes": num("Measured (B)", "%,d"), "formula_bytes": num("Formula (B)", "%,d"),
    "formula": "Formula", "matches": "Measured = formula", "vs_snapshot": pct("Share of the snapshot's bytes", 2)})
st.caption(
    f"Formula bytes = (1 + n) × per-token bytes with s = {page.elem_bytes} B; conv channels "
    f"2HK + HV = {shape.conv_dim}, window W − 1 = {shape.conv_kernel - 1}. Measured here: the snapshot holds "
    f"{df.measured_bytes[0] / df.measured_bytes[1]:,.1f}× the projections' bytes and "
    f"{df.measured_bytes[0] / df.measured_bytes[2]:,.1f}× the raw inputs' and "
    f"{df.measured_bytes[0] / df.measured_bytes[3]:,.1f}× ReplaySSM's records. State H·K·V grows with K·V; "
    "projections and records with H·(2K + V); raw inputs with d.")

st.subheader("2 · Whole model, per draft token")
tdf = pd.DataFrame(page.models)
k3 = tdf.set_index("model").loc["kimi-k3"]
tdf = tdf.assign(model=tdf.model.map(preset_title))                  # shown by the models' names
MIB_COLUMNS = ["snapshot state MiB", "snapshot conv window MiB", "projections k,v,g,beta MiB", "conv inputs MiB",
               "raw inputs MiB", "ReplaySSM k,u,g MiB"]
lo_mib, hi_mib = float(tdf[MIB_COLUMNS].min().min()), float(tdf[MIB_COLUMNS].max().max())
fig2 = go.Figure()
for col, name, color in [("snapshot state MiB", "snapshot: state", "#d62728"),
                         ("snapshot conv window MiB", "snapshot: conv window", "#ff9896"),
                         ("projections k,v,g,beta MiB", "projections k, v, g, β", "#2ca02c"),
                         ("conv inputs MiB", "conv inputs", "#98df8a"), ("raw inputs MiB", "raw inputs", "#1f77b4"),
                         ("ReplaySSM k,u,g MiB", "ReplaySSM k, u, g", "#9467bd")]:
    fig2.add_trace(go.Bar(x=tdf.model, y=tdf[col], name=name, marker_color=color))
fig2.update_layout(barmode="group", xaxis_title="model", yaxis_title="MiB per draft token, all KDA layers (log)",
                   yaxis_type="log", yaxis_dtick=1, legend=dict(orientation="h", y=-0.25),
                   yaxis_range=[math.floor(math.log10(lo_mib)), math.log10(hi_mib) + 0.3])   # headroom above K3
show_chart(fig2, tdf, key="p01_model_chart")
show_table(tdf, {"model": "Model", "KDA layers": num("KDA layers", "%d"),
                 "snapshot state MiB": num("Snapshot state (MiB)", "%,.3f"),
                 "snapshot conv window MiB": num("Snapshot conv (MiB)", "%,.3f"),
                 "projections k,v,g,beta MiB": num("Projections (MiB)", "%,.3f"),
                 "conv inputs MiB": num("Conv inputs (MiB)", "%,.3f"), "raw inputs MiB": num("Raw inputs (MiB)", "%,.3f"),
                 "ReplaySSM k,u,g MiB": num("ReplaySSM k, u, g (MiB)", "%,.3f")})
st.caption("Per draft token, all KDA layers; snapshot state in fp32, everything else in bf16. Snapshot ÷ projections: "
           + ", ".join(f"{r['snapshot / projections']:.0f}× ({r.model})" for _, r in tdf.iterrows())
           + "; snapshot ÷ raw inputs: " + ", ".join(f"{r['snapshot / raw inputs']:.0f}×" for _, r in tdf.iterrows()) + ".")
K3 = page.k3
n, h, kd, vd = K3.num_kda_layers, K3.num_heads, K3.head_k_dim, K3.head_v_dim
st.write(
    f"**What to notice.** Kimi K3 ({n} KDA layers, {h} heads × {kd}): a snapshot holds "
    f"**{k3['snapshot state MiB']:,.0f} MiB** of fp32 state per draft token ({n} × {h}·{kd}·{vd}·4 B), projections "
    f"**{k3['projections k,v,g,beta MiB']:.1f} MiB** ({n} × {h}·(2·{kd}+{vd}+1)·2 B, bf16) plus "
    f"{k3['conv inputs MiB']:.1f} MiB of raw conv inputs, and raw layer inputs **{k3['raw inputs MiB']:.2f} MiB** "
    f"({n} × {K3.hidden_size}·2 B); ReplaySSM's k, u, g **{k3['ReplaySSM k,u,g MiB']:.1f} MiB** ({n} × {h}·(2·{kd}+{vd})·2 B) "
    "plus the same conv inputs. Sources: SGLang's intermediate SSM state cache and vLLM's per-draft state slots "
    "(snapshot); ReplaySSM (vLLM RFC #46187, PRs #47572 / #47576; SGLang's KDA ring with a per-K gate; "
    "TensorRT-LLM #18294 for Kimi K3), which caches post-projection per-step records (k, u, g) plus one checkpoint; "
    f"the raw-input ring caches layer inputs before the projections; model sizes from {K3.source}.")

st.subheader("3 · How many of the n drafts a verify keeps")
st.write("Every strategy above records all 1 + n verify tokens, but only the accepted prefix is committed: the "
         "bytes spent on rejected drafts are the price of speculation. How long that prefix is depends on the drafter "
         "and the text, measured here with the trained target at the draft length n above.")
a1, _ = st.columns(2)
drafter, acceptance = drafter_selector(a1, "p01")
acceptance_section("p01", drafter, acceptance, num_draft, "Acceptance per draft position: held-out code vs prose")
