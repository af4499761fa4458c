"""01 Snapshot vs projection bytes: what each speculative-decoding rollback strategy holds per verify."""
import math

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from app_pages.acceptance import acceptance_params, acceptance_section, drafter_params, drafter_selector
from app_pages.charts import num, pct, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import measured_stamp, run_on_request
from app_pages.params import Choice, Int
from lab.rollback import DTYPES, LAYER_PRESETS, preset_title, rollback_page
from lab.state_write import predicted_bytes, state_write_sweep

st.title("Snapshot vs projection bytes")
st.write(
    "A rejected draft token has already been folded into a KDA state, so speculative decoding must be able to "
    "rebuild the state at the last accepted token. **Snapshot** keeps the full state (and conv window) after every "
    "verify token; **projection replay** keeps only what the kernel consumed (k, v, g, β and the raw conv inputs) "
    "and replays; **ReplaySSM** keeps one checkpoint plus a ring of per-step records (k, u = β(v − S'ᵀk), g and the raw "
    "conv inputs), so a step writes a record instead of the state and a rollback is a cursor move; the **raw-input "
    "ring** keeps one hidden vector per token and re-projects. Bytes below are read "
    "with `nbytes()` from the buffers each strategy filled after a real one-layer verify run now on this CPU.")

links = declare(
    Choice("p01_preset", list(LAYER_PRESETS)[2], [*LAYER_PRESETS, "Custom"]),
    Int("p01_draft", 4, 1, 16),
    Choice("p01_dtype", "fp32", DTYPES),
    Int("p01_heads", 8, 1, 96),
    Choice("p01_k", 64, [16, 32, 64, 128]),
    Choice("p01_v", 64, [16, 32, 64, 128]),
    Choice("p01_d", 1024, [64, 256, 1024, 2304, 4096, 7168]),
    *drafter_params("p01"),
    *acceptance_params("p01"),
    Choice("p01_ring", 16, [4, 8, 16, 32, 64]),
)
c1, c2, c3 = st.columns(3)
preset = links.selectbox(c1, "Layer size", "p01_preset")
num_draft = links.slider(c2, "Draft length n (verify = 1 + n tokens)", "p01_draft")
dtype_name = links.selectbox(c3, "Stored dtype s", "p01_dtype")
if preset == "Custom":
    d1, d2, d3, d4 = st.columns(4)
    heads = links.slider(d1, "Heads H", "p01_heads")
    k_dim = links.select_slider(d2, "Key dim K", "p01_k")
    v_dim = links.select_slider(d3, "Value dim V", "p01_v")
    width = links.select_slider(d4, "Layer input width d", "p01_d")
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
                 "ReplaySSM k,u,g MiB": num("ReplaySSM k, u, g (MiB)", "%,.3f")}, wrap=True)   # 8 columns: the grid cut the last
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
drafter, acceptance = drafter_selector(links, a1)
acceptance_section(links, drafter, acceptance, num_draft, "Acceptance per draft position: held-out code vs prose")

st.subheader("4 · In the batched engine: ReplaySSM as the decode-time state write")
st.write(
    "The same records can replace the state write of **plain** decode (vLLM #47572 / #48792): with "
    "`ServeEngine(state_write=\"replay_ssm\", ring_size=R)` a decode step appends one k, u, g record per KDA layer "
    "and writes only the conv window; the state pages keep a checkpoint, the step's state is the checkpoint with "
    "its records replayed, and the whole state is written once every R steps (or when a prefix-cache checkpoint is "
    "published). With fp32 states, the engine's default, tokens and logits are bitwise those of the slot write "
    "(`tests/serve/test_engine_replay_ssm.py`); with bf16 / fp16 states they may differ (fewer roundings).")
ring = links.select_slider(st, "Ring size R (decode steps per state write)", "p01_ring")
pb = pd.DataFrame(engine_call(predicted_bytes))
fig3 = go.Figure([go.Scatter(x=d.ring_size[d.ring_size > 0], y=d.vs_slot[d.ring_size > 0], mode="lines+markers",
                             name=preset_title(m)) for m, d in pb.groupby("model", sort=False)])
fig3.add_vline(x=ring, line_dash="dot", annotation_text=f"R = {ring}")
fig3.update_layout(xaxis_title="ring size R (decode steps per state write, log)", xaxis_type="log",
                   yaxis_title="bytes written per decode step ÷ slot write", yaxis_range=[0, 1.05], height=340)
show_chart(fig3, pb, key="p01_state_write_bytes")
st.caption("Predicted per request and decode step, all KDA layers, fp32: slot write = state H·K·V + conv window "
           "(2HK + HV)(W − 1) every step; ReplaySSM = conv window + record H(2K + V) on R − 1 steps + state on one.")
run_on_request("p01_sweep", "p01_sweep_button", f"Measure the batched engine at R = {ring} (batch 1, 4, 16)",
               "About 10–30 s: B requests all decoding, slot write and ReplaySSM engines interleaved, 8 windows after "
               "a warm-up window, covering whole flush periods; bytes counted by the engine.")
bar = st.progress(0.0, text="Measuring…")
sweep = engine_call(state_write_sweep, (1, 4, 16), (ring,), max(4, ring // 8), 8,
                    progress=lambda f: bar.progress(f, text=f"Measuring… {f:.0%}"))
bar.empty()
sw = pd.DataFrame(sweep.rows)
fig4 = go.Figure([go.Bar(x=d.batch.astype(str), y=d.step_ms, name=name,
                         error_y=dict(type="data", symmetric=False, array=d.step_q3_ms - d.step_ms,
                                      arrayminus=d.step_ms - d.step_q1_ms))
                  for name, d in sw.groupby("state_write", sort=False)])
fig4.update_layout(barmode="group", xaxis_title="decode batch (requests)", xaxis_type="category",   # bars at 1, 4, 16 only
                   yaxis_title="decode step time (ms; bars = q1–q3)", height=340)
show_chart(fig4, sw, key="p01_state_write_steps")
measured_stamp(sweep.conditions)
rs = sw[sw.ring_size > 0]
st.write(
    f"**What to notice.** Counted bytes per decode step fall to {rs.total_B.iloc[0] / sw.total_B.iloc[0]:.0%} of the "
    f"slot write's, yet ReplaySSM decodes at {', '.join(f'{x:.2f}×' for x in rs.speedup_vs_slot)} the slot "
    f"write's speed (slot step time ÷ ReplaySSM step time) at batch {', '.join(str(b) for b in rs.batch)} on this "
    "CPU. vLLM #47572 reports 0.99× at batch 1 and 1.31–1.67× at batch 512 on GPU, where decode is bound by HBM "
    "traffic and a fused kernel replays the "
    "records in registers, writing nothing but the record. Here eager torch replays each record as two passes over "
    "a state-sized tensor in memory (decay, rank-1 write), about R/2 records per step on average, while the state "
    "write it saves is one cache-resident copy: the trade only pays where the state write is the bottleneck "
    "(`python -m bench.replay_ssm_batch` sweeps batch 1…64 and ring 4…64).")
