"""03 KDA state vs KV cache: bytes per sequence vs context, and measured decode cost per token."""
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import streamlit as st
import torch

from kda_core import config as kc
from lab.state_vs_kv import measure_decode_cost
from pages._common import engine_call, persist, show_chart

st.title("KDA state vs KV cache")
st.write(
    "An MLA layer keeps a latent KV entry **per token**, so its cache grows with context; a KDA layer keeps a "
    "**fixed** recurrent state (H x K x V) plus a short-conv window per sequence. Kimi hybrids put 3 KDA layers "
    "per MLA layer. Below: exact byte counts for the real configs, then decode cost measured live on this CPU.")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8 (e4m3)": torch.float8_e4m3fn}
MODELS = {"Kimi-Linear-48B-A3B": "kimi-linear-48b-a3b", "Kimi K3": "kimi-k3", "Custom": "custom"}

c1, c2, c3 = st.columns(3)
preset = MODELS[c1.selectbox("Model", list(MODELS), key=persist("p03_preset", options=list(MODELS)), persist_state="session", bind="query-params")]
state_dt = c2.selectbox("KDA state dtype", ["fp32", "bf16"], key=persist("p03_state_dtype", options=["fp32", "bf16"]), persist_state="session")
kv_dt = c3.selectbox("MLA KV dtype", ["bf16", "fp8 (e4m3)", "fp16", "fp32"], key=persist("p03_kv_dtype", options=["bf16", "fp8 (e4m3)", "fp16", "fp32"]), persist_state="session")
if preset == "custom":
    d1, d2, d3, d4 = st.columns(4)
    n_layers = d1.slider("Layers", 4, 128, key=persist("p03_layers", 48, min_value=4, max_value=128), persist_state="session")
    ratio = d2.slider("KDA layers per MLA layer", 0, 7, key=persist("p03_ratio", 3, min_value=0, max_value=7), persist_state="session")
    heads = d3.slider("KDA heads", 1, 128, key=persist("p03_heads", 32, min_value=1, max_value=128), persist_state="session")
    head_dim = d4.select_slider("Head dim", [32, 64, 128, 256], key=persist("p03_head_dim", 128, options=[32, 64, 128, 256]), persist_state="session")
    cfg = engine_call(kc.custom_config, n_layers, ratio, heads, head_dim)
else:
    cfg = kc.PRESETS[preset]
lo, hi = st.select_slider("Context range (tokens)", options=[2 ** i for i in range(6, 21)],
                          value=(1024, 2 ** 20), key="p03_context", persist_state="session")

sd, kd = DTYPES[state_dt], DTYPES[kv_dt]
CONV_DTYPE = torch.bfloat16  # conv window dtype used by kda_core.config's defaults
ctx = np.unique(np.geomspace(lo, max(hi, lo + 1), 60).astype(int))
rows = [engine_call(kc.sequence_bytes, cfg, int(n), sd, kd) for n in ctx]
df = pd.DataFrame(rows, columns=kc.SequenceBytes._fields)
be = kc.break_even_tokens(cfg, sd, kd)
be_rec = kc.recurrent_break_even_tokens(cfg, sd, kd)

st.subheader("1 · Cache bytes per sequence vs context")
fig = go.Figure()
for col, name, dash in [("mla_kv_bytes", "MLA latent KV (grows)", None), ("kda_state_bytes", "KDA fixed state (flat)", None),
                        ("total_bytes", "Total (hybrid)", None), ("all_mla_bytes", "Counterfactual: all layers at MLA width", "dot")]:
    fig.add_trace(go.Scatter(x=df.num_tokens, y=df[col] / 2 ** 20, name=name, mode="lines", line=dict(dash=dash)))
if np.isfinite(be) and lo <= be <= hi:
    fig.add_vline(x=be, line_dash="dash", line_color="gray", annotation_text=f"break-even ≈ {be:,.0f} tokens")
fig.update_layout(xaxis_title="context length (tokens, log)", yaxis_title="bytes per sequence (MiB, log)",
                  xaxis_type="log", yaxis_type="log", legend=dict(orientation="h", y=-0.25))
show_chart(fig, df, key="p03_bytes_chart")

m1, m2, m3, m4 = st.columns(4)
m1.metric("MLA KV per token (whole model)", f"{kc.mla_kv_bytes_per_token(cfg, kd):,} B")
m2.metric("KDA state per layer", f"{kc.kda_state_bytes_per_layer(cfg, sd):,} B")
m3.metric("Fixed state per sequence", f"{kc.fixed_state_bytes_per_sequence(cfg, sd) / 2 ** 20:,.1f} MiB")
m4.metric("Break-even context (recurrent + conv)", "∞" if not np.isfinite(be) else f"{be:,.0f} tokens",
          "∞ (recurrent only)" if not np.isfinite(be_rec) else f"{be_rec:,.0f} tokens recurrent only", delta_color="off")
st.caption(
    f"Formulas: MLA KV/token = {cfg.num_mla_layers} MLA layers × ({cfg.kv_lora_rank} + {cfg.qk_rope_head_dim}) × "
    f"{kc.dtype_bytes(kd)} B; KDA state/layer = {cfg.num_heads} × {cfg.head_k_dim} × {cfg.head_v_dim} × {kc.dtype_bytes(sd)} B; "
    f"conv state/layer = (2HK + HV) × (W−1) × {kc.dtype_bytes(CONV_DTYPE)} B (bf16); break-even = fixed state ÷ KV "
    f"per token: {be:,.0f} tokens with the conv state, {be_rec:,.0f} counting the recurrent state only. The dotted line "
    f"counts every layer at MLA width ({kc.all_mla_kv_bytes_per_token(cfg, kd):,} B/token), as public calculators did "
    "before fixing it (LMCache PR #4278; inference-sim issue #1635, Kimi K3) — shown only as a counterfactual. "
    f"Source: {cfg.source}.")

with st.expander("Per-layer table"):
    n_table = st.select_slider("Context for the table (tokens)", options=[2 ** i for i in range(6, 21)],
                               key=persist("p03_table_ctx", 131072, options=[2 ** i for i in range(6, 21)]), persist_state="session")
    tdf = pd.DataFrame(kc.layer_table(cfg, n_table, sd, kd))
    st.dataframe(tdf, hide_index=True, width="stretch")
    st.download_button("Download CSV", tdf.to_csv(index=False).encode(), "p03_layers.csv", "text/csv", key="p03_layers_csv")

st.subheader("2 · Decode cost per token, measured on this CPU")
e1, e2 = st.columns(2)
heads_meas = e1.slider("Heads in the measurement (scaled down from the model)", 1, 16, key=persist("p03_meas_heads", 4, min_value=1, max_value=16), persist_state="session")
max_meas = e2.select_slider("Largest measured context (tokens)", options=[2 ** i for i in range(10, 16)],
                            key=persist("p03_meas_max", 16384, options=[2 ** i for i in range(10, 16)]), persist_state="session")


@st.cache_data(show_spinner="Measuring on this CPU…", max_entries=16, ttl="1h")
def _measure(cfg_key: tuple, contexts: tuple, heads: int):
    rows = measure_decode_cost(kc.ModelConfig(*cfg_key), list(contexts), num_heads=heads, repeats=5)
    return pd.DataFrame(rows, columns=rows[0]._fields)


meas_ctx = tuple(2 ** i for i in range(8, int(np.log2(max_meas)) + 1))
cfg_key = tuple(getattr(cfg, f) for f in kc.ModelConfig.__dataclass_fields__)
mdf = engine_call(_measure, cfg_key, meas_ctx, heads_meas)
fig2 = go.Figure()
fig2.add_trace(go.Scatter(x=mdf.context_tokens, y=mdf.kda_step_us, name="KDA: one kda_step", mode="lines+markers"))
fig2.add_trace(go.Scatter(x=mdf.context_tokens, y=mdf.mla_decode_us, name="MLA: absorbed decode over N latents",
                          mode="lines+markers"))
fig2.update_layout(xaxis_title="context length N (tokens, log)", yaxis_title="time per token per layer (µs, min of runs, log)",
                   xaxis_type="log", yaxis_type="log", legend=dict(orientation="h", y=-0.25))
show_chart(fig2, mdf, key="p03_decode_chart")
last = mdf.iloc[-1]
st.caption(
    f"Measured now with {heads_meas} heads (real dims K = {cfg.head_k_dim}, V = {cfg.head_v_dim}, latent "
    f"{cfg.latent_dim}; the model has {cfg.num_heads} KDA heads — heads are scaled down to keep the run under a second). "
    f"At N = {int(last.context_tokens):,}: KDA {last.kda_step_us:,.0f} µs vs MLA {last.mla_decode_us:,.0f} µs. "
    "KDA's step touches only its H×K×V state, so its line is flat; MLA reads all N latents (N × (r + rope) values), "
    "so its work grows linearly with N — and its time faster where the latents no longer fit in the CPU cache. "
    "Each point is the minimum of 5 back-to-back runs on one thread (perf_counter_ns): on a shared CPU, contention only "
    "adds time, so the least-disturbed run is the cost of the work.")
