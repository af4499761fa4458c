"""03 KDA state vs KV cache: bytes per sequence vs context, and measured decode cost per token."""
import math

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from app_pages.charts import num, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import measured_stamp, remeasure_button
from app_pages.params import Choice, Int, Range
from lab.state_vs_kv import (
    CONTEXTS,
    KV_DTYPES,
    MEASURE_REPEATS,
    MEASURED_CONTEXTS,
    MODELS,
    STATE_DTYPES,
    HeadCost,
    fit_table,
    state_vs_kv,
)

st.title("KDA state vs KV cache")
st.write(
    "An MLA layer keeps a latent KV entry **per token**, so its cache grows with context; a KDA layer keeps a "
    "**fixed** recurrent state (H x K x V) plus a short-conv window per sequence. Kimi hybrids put 3 KDA layers "
    "per MLA layer. Below: exact byte counts for the real configs, then decode cost measured live on this CPU.")

links = declare(
    Choice("p03_preset", next(iter(MODELS)), MODELS),
    Choice("p03_state_dtype", next(iter(STATE_DTYPES)), STATE_DTYPES),
    Choice("p03_kv_dtype", next(iter(KV_DTYPES)), KV_DTYPES),
    Int("p03_layers", 48, 4, 128),
    Int("p03_ratio", 3, 0, 7),
    Int("p03_heads", 32, 1, 128),
    Choice("p03_head_dim", 128, [32, 64, 128, 256]),
    Range("p03_context", (1024, 2 ** 20), CONTEXTS),
    Int("p03_meas_heads", 4, 1, 16),
    Choice("p03_meas_max", 16384, MEASURED_CONTEXTS),
    Choice("p03_table_ctx", 131072, CONTEXTS),
)
c1, c2, c3 = st.columns(3)
preset = MODELS[links.selectbox(c1, "Model", "p03_preset")]
state_dt = links.selectbox(c2, "KDA state dtype", "p03_state_dtype")
kv_dt = links.selectbox(c3, "MLA KV dtype", "p03_kv_dtype")
custom = None
if preset == "custom":
    d1, d2, d3, d4 = st.columns(4)
    custom = (links.slider(d1, "Layers", "p03_layers"),
              links.slider(d2, "KDA layers per MLA layer", "p03_ratio"),
              links.slider(d3, "KDA heads", "p03_heads"),
              links.select_slider(d4, "Head dim", "p03_head_dim"))
lo, hi = links.select_slider(st, "Context range (tokens)", "p03_context")
part1, part2 = st.container(), st.container()
part2.subheader("2 · Decode cost per token, measured on this CPU")
e1, e2 = part2.columns(2)
heads_meas = links.slider(e1, "Heads in the measurement (scaled down from the model)", "p03_meas_heads")
max_meas = links.select_slider(e2, "Largest measured context (tokens)", "p03_meas_max")
_p03_measure = st.cache_data(state_vs_kv, show_spinner="Measuring on this CPU…", max_entries=32, ttl="1h")
run = engine_call(_p03_measure, preset, state_dt, kv_dt, (lo, hi), heads_meas, max_meas, custom)
cfg, df, be, be_rec = run.cfg, run.bytes, run.break_even_tokens, run.recurrent_break_even_tokens
with part1:
    st.subheader("1 · Cache bytes per sequence vs context")
    series = [("mla_kv_bytes", "MLA latent KV (grows)", None), ("kda_state_bytes", "KDA fixed state (flat)", None),
              ("total_bytes", "Total (hybrid)", None), ("all_mla_bytes", "Counterfactual: all layers at MLA width", "dot")]
    fig = go.Figure()
    if lo == hi:   # one context: lines over a single x would be flat and tickless, so one bar per kind instead
        st.info(f"Context range (tokens) has both ends at {lo:,} tokens: the bytes at that one context are below; "
                "move one end to see how they grow with context.")
        fig.add_trace(go.Bar(x=[name for _, name, _ in series], y=[float(df[col].iloc[0]) / 2 ** 20 for col, _, _ in series],
                             text=[f"{float(df[col].iloc[0]) / 2 ** 20:,.1f} MiB" for col, _, _ in series],
                             textposition="outside"))
        fig.update_layout(xaxis_title=f"cache kind, at a context of {lo:,} tokens", yaxis_title="bytes per sequence (MiB, log)",
                          yaxis_type="log")
    else:
        for col, name, dash in series:
            fig.add_trace(go.Scatter(x=df.num_tokens, y=df[col] / 2 ** 20, name=name, mode="lines", line=dict(dash=dash)))
        if math.isfinite(be) and lo <= be <= hi:
            fig.add_vline(x=be, line_dash="dash", line_color="gray", annotation_text=f"break-even ≈ {be:,.0f} tokens")
        fig.update_layout(xaxis_title="context length (tokens, log)", yaxis_title="bytes per sequence (MiB, log)",
                          xaxis_type="log", yaxis_type="log", legend=dict(orientation="h", y=-0.25))
    fig.update_yaxes(tickformat=",", ticksuffix=" MiB")   # "10,000 MiB", not Plotly's SI "10k" on a MiB axis
    show_chart(fig, df, key="p03_bytes_chart")

    m1, m2, m3, m4 = st.columns(4)
    m1.metric("MLA KV per token (whole model)", f"{run.kv_bytes_per_token:,} B")
    m2.metric("KDA state per layer", f"{run.state_bytes_per_layer / 2 ** 20:,.2f} MiB",
              help=f"{run.state_bytes_per_layer:,} B = H × K × V × dtype bytes")
    m3.metric("Fixed state per sequence", f"{run.fixed_state_bytes / 2 ** 20:,.1f} MiB",
              help=f"Recurrent state + bf16 conv window. {run.fixed_state_bytes:,} B: every KDA layer's recurrent state in {state_dt} + its conv window "
                   f"in bf16 (page 17 section 1 counts the conv window the same way; the engine's own layout keeps the conv window in fp32).")
    m4.metric("Break-even context", "∞" if not math.isfinite(be) else f"{be:,.0f} tokens",
              "∞ (recurrent only)" if not math.isfinite(be_rec) else f"{be_rec:,.0f} tokens recurrent only",
              delta_color="off", delta_arrow="off",
              help="Fixed state (recurrent + conv) ÷ MLA KV per token; the recurrent state alone below it.")
    st.caption(f"Break-even = fixed state ÷ MLA KV per token: {be:,.0f} tokens with the conv state, {be_rec:,.0f} for the "
               "recurrent state only. Dotted: every layer at MLA width, a counterfactual. Source: " + cfg.source + ".")
    with st.expander("How the bytes are computed"):
        st.markdown(
            f"- MLA KV per token = {cfg.num_mla_layers} MLA layers × ({cfg.kv_lora_rank} + {cfg.qk_rope_head_dim}) × "
            f"{run.kv_dtype_bytes} B.\n"
            f"- KDA state per layer = {cfg.num_heads} × {cfg.head_k_dim} × {cfg.head_v_dim} × {run.state_dtype_bytes} B; "
            f"conv state per layer = (2HK + HV) × (W−1) × {run.conv_dtype_bytes} B (bf16).\n"
            f"- The dotted line counts every layer at MLA width ({run.all_mla_kv_bytes_per_token:,} B/token), as public "
            "calculators did before fixing it (LMCache PR #4278; inference-sim issue #1635, Kimi K3).")

    with st.expander("Per-layer table"):
        n_table = links.select_slider(st, "Context for the table (tokens)", "p03_table_ctx")
        tdf = run.layers[run.layers.context_tokens == n_table].drop(columns="context_tokens")
        show_table(tdf, {"layer": num("Layer", "%d"), "kind": "Kind", "bytes_per_token": num("Per token (B)"),
                         "fixed_bytes": num("Fixed state (B)"),
                         "bytes_at_context": num(f"At {n_table:,} tokens (B)")})
        st.download_button("Download CSV", tdf.to_csv(index=False).encode(), "p03_layers.csv", "text/csv", key="p03_layers_csv")

with part2:
    remeasure_button(_p03_measure, key="p03_remeasure")
    mdf, fits = run.decode, {"KDA": run.kda_fit, "MLA": run.mla_fit}
    fig2 = go.Figure()
    for name, label, color in [("KDA", "KDA: one kda_step", "#636efa"),
                               ("MLA", "MLA: absorbed decode over N latents", "#ef553b")]:
        fit, col, q1, q3 = fits[name], *(f"{name.lower()}_{c}_us" for c in ("step" if name == "KDA" else "decode", "q1", "q3"))
        fig2.add_trace(go.Scatter(
            x=mdf.context_tokens, y=mdf[col], name=label, mode="markers", marker=dict(color=color),
            error_y=dict(type="data", symmetric=False, array=mdf[q3] - mdf[col], arrayminus=mdf[col] - mdf[q1])))
        fig2.add_trace(go.Scatter(x=mdf.context_tokens, y=[fit.at(n) * 1e6 if fit.at(n) > 0 else None   # log axis:
                                                              for n in mdf.context_tokens], mode="lines",  # gap, not a drop
                                  line=dict(dash="dash", color=color), name=f"{name} fit a + b·N"))
    fig2.update_layout(xaxis_title="context length N (tokens, log)",
                       yaxis_title="time per token per layer (µs; median, bars = IQR; log)",
                       xaxis_type="log", yaxis_type="log", legend=dict(orientation="h", y=-0.25))
    show_chart(fig2, mdf, key="p03_decode_chart")
    measured_stamp(run.conditions)
    first, last = mdf.iloc[0], mdf.iloc[-1]
    n0, n1 = int(first.context_tokens), int(last.context_tokens)
    f1, f2, f3, f4 = st.columns(4)
    for (c_a, c_b), name, col in (((f1, f2), "KDA step", "kda_step_us"), ((f3, f4), "MLA decode", "mla_decode_us")):
        c_a.metric(f"{name} at N = {n0:,} (measured)", f"{first[col]:,.1f} µs", "median", delta_color="off",
                   delta_arrow="off")
        c_b.metric(f"{name} at N = {n1:,} (measured)", f"{last[col]:,.1f} µs", f"{last[col] / first[col]:,.1f}× N = {n0:,}",
                   delta_color="off", delta_arrow="off")
    show_table(fit_table(fits), {"kind": "Fitted line", "a_us": num("a (µs)", "%,.2f"),
                                 "b_ns": num("b (ns per context token)", "%,.3f"),
                                 "b_se_ns": num("± b (standard error, ns)", "%,.3f"), "r2": num("R²", "%.3f"),
                                 "reading": "What it means"}, wrap=True)
    st.caption(
        f"Measured now with {heads_meas} head{'' if heads_meas == 1 else 's'} (the model has {cfg.num_heads}; scaled down to keep the run under a "
        f"second). At N = {int(last.context_tokens):,}: KDA {last.kda_step_us:,.0f} µs vs MLA {last.mla_decode_us:,.0f} µs "
        "(medians). KDA's step touches only its state, so its b ≈ 0; MLA reads all N latents, so its b is the cache's "
        "per-token cost.")
    hs = run.heads
    hdf = pd.DataFrame(hs.rows, columns=HeadCost._fields)
    one = hdf.iloc[0]
    st.markdown(f"**MLA decode vs heads, at N = {hs.context_tokens:,}, all head counts in one run**")
    fig3 = go.Figure()
    fig3.add_trace(go.Scatter(
        x=hdf.num_heads, y=hdf.mla_decode_us / 1e3, name="measured (median, bars = IQR)", mode="markers+lines",
        marker=dict(color="#ef553b"), error_y=dict(type="data", symmetric=False,
                                                   array=(hdf.mla_q3_us - hdf.mla_decode_us) / 1e3,
                                                   arrayminus=(hdf.mla_decode_us - hdf.mla_q1_us) / 1e3)))
    fig3.add_trace(go.Scatter(x=hdf.num_heads, y=one.mla_decode_us / 1e3 * hdf.num_heads, mode="lines",
                              name="H × the 1-head time", line=dict(dash="dot", color="gray")))
    fig3.update_layout(xaxis_title="MLA heads H (all reading the same N latents)", yaxis_title="time per decode (ms)",
                       legend=dict(orientation="h", y=-0.3), height=360)
    fig3.update_xaxes(tickvals=list(hdf.num_heads))
    show_chart(fig3, hdf, key="p03_heads_chart")
    measured_stamp(hs.conditions)
    top = int(hdf.num_heads.max())
    h1, h2 = st.columns(2)
    k = max(heads_meas, 2)                              # the measured head count (2 when it is 1) against one head
    h1.metric(f"{k} heads ÷ 1 head", f"{hs.ratio(k):,.2f}×",
              help="Medians of the same run (head counts interleaved), so a change of load moves both alike.")
    h2.metric(f"{top} heads ÷ 2 heads", f"{hs.ratio(top, 2):,.2f}×", f"{top // 2}× as many heads", delta_color="off",
              delta_arrow="off", help="If every head cost a full decode, this would be the heads' ratio.")
    st.caption(
        f"Absorbed MLA's heads share one latent cache: a decode reads the {hs.context_tokens:,} latents "
        f"({hs.latent_bytes / 2 ** 20:,.1f} MiB fp32) once whatever H; a head adds only its dot products, so the "
        f"time grows far slower than H (dotted: H × 1 head). Here 1 → 2 heads took {hs.ratio(2):,.2f}×"
        + (" (a matrix-vector product becomes a matrix product)" if hs.ratio(2) > 1.3 else "")
        + f", 2 → {top} heads {hs.ratio(top, 2):,.2f}×. Compare head counts within one run only.")
    with st.expander("How the decode cost is measured and fitted"):
        st.markdown(
            f"- Real dims K = {cfg.head_k_dim}, V = {cfg.head_v_dim}, latent {cfg.latent_dim}; MLA reads N × "
            "(r + rope) values per step, and its line bends up where the latents no longer fit in the CPU cache.\n"
            "- Dashed: the least-squares fit t(N) = a + b·N over the medians. R² near 0 for KDA means a flat line: "
            "no part of its time follows N. The metrics above are measured medians; a, b and R² are fitted to them, "
            "and the table says what each line means.\n"
            f"- Each point is the median of {MEASURE_REPEATS} interleaved repeats (contexts in rotating order, one "
            "torch thread) after a warm-up; KDA and MLA are timed in separate sweeps so the MLA pass does not evict "
            "the KDA state from the CPU cache. A run-to-run drift of the KDA step (the machine is shared) moves a, "
            "not b.")
    if any(fit.a_s < 0 for fit in fits.values()):
        st.caption("A fitted line is not drawn below zero (log axis): where a < 0 the dashed line stops at small N.")
