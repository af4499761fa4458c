"""10 KCP: KDA context parallel on real torch.distributed ranks, measured on this CPU."""
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from app_pages.charts import num, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import measured_stamp, remeasure_button
from app_pages.params import Choice, Int, Toggle
from lab.kcp import (
    BANDWIDTHS_GBPS,
    DEFAULT_VARIANT,
    MODELS,
    REPEATS,
    SERVER_RESERVE_MIB,
    VARIANTS,
    kcp_experiment,
    kcp_limits,
    one_rank_baselines,
    speedup_vs_best,
)

st.title("KDA context parallel (KCP)")
st.write(
    "One long prompt is split across ranks. Every KDA step is affine in the state, so each rank's block collapses "
    "to a pair (M, S_ext); the pairs are exchanged, each rank folds its predecessors' pairs into its true initial "
    "state and runs the ordinary chunk kernel. Below, real processes talk over gloo on 127.0.0.1: we check every "
    "rank against a single-rank run, time each phase, and count the bytes passed to the collectives.")
limits = kcp_limits()
st.info(
    f"This host gives the app {limits.cores} CPU core(s) and {limits.memory_bytes / 2 ** 20:,.0f} MiB "
    f"({limits.memory_source}), so the page offers up to {limits.max_world} rank(s) (one thread each, one per core) "
    f"and T up to {limits.seq_options[-1]:,}: a rank's estimated peak at H = 4, K = V = 128 must fit in what is left "
    f"after ~{SERVER_RESERVE_MIB} MiB for the app's server. Ranks are processes forked from the server itself "
    "(copy-on-write: they share its loaded torch; nothing stays behind after the run), one run at a time per "
    "server. Same code across machines: `torchrun --nproc-per-node 2 -m serve.parallel --seq-len 65536`.")

links = declare(
    Choice("p10_seq_len", 512, limits.seq_options),   # the T this host's memory fits (512 always)
    Int("p10_world", 2, 1, 4),                         # at most one rank per core of this host
    Int("p10_heads", 4, 1, 4),
    Choice("p10_head_k", 128, [32, 64, 128]),
    Choice("p10_head_v", 128, [32, 64, 128]),
    Choice("p10_variant", DEFAULT_VARIANT, VARIANTS),
    Toggle("p10_prefix", False),
    Choice("p10_model", next(iter(MODELS)), MODELS),
    Choice("p10_bandwidth", 25, BANDWIDTHS_GBPS),
)
c1, c2, c3, c4, c5 = st.columns(5)
seq_len = links.select_slider(c1, "Sequence length T (tokens)", "p10_seq_len")
world = links.slider(c2, "World size (ranks)", "p10_world", max_value=limits.max_world,
                     disabled=limits.max_world < 2)
heads = links.slider(c3, "Heads H", "p10_heads")
head_k = links.select_slider(c4, "Key dim K", "p10_head_k")
head_v = links.select_slider(c5, "Value dim V", "p10_head_v")
d1, d2 = st.columns(2)
variant = VARIANTS[links.selectbox(d1, "Exchange variant", "p10_variant")]
prefix = links.checkbox(d2, "Seed rank 0 with a prefix-cache state", "p10_prefix")

@st.cache_data(show_spinner=f"Running one rank, then the ranks, {REPEATS} timed repeats each, on this CPU…",
               max_entries=16, ttl="1h")
def _run(seq_len, world, heads, head_k, head_v, variant, prefix):
    return kcp_experiment(seq_len, world, heads, head_k, head_v, variant, prefix, start_method="fork")
_baselines = st.cache_data(one_rank_baselines, show_spinner="Timing one rank in this process, interleaved repeats…",
                           max_entries=16, ttl="1h")
run = engine_call(_run, seq_len, world, heads, head_k, head_v, variant, prefix)
remeasure_button(_run, "p10_remeasure")
base, runs, worst, tol = pd.DataFrame(run.single), pd.DataFrame(run.ranks), run.worst_error, run.tolerance
tol_text = f"{tol:.0e}".replace("e-0", "e-")  # 1e-5

st.subheader("1 · Exactness per rank vs the single-rank run")
fig = go.Figure()
for col, name in [("max_abs_err_o", "outputs o of the rank's block"), ("max_abs_err_state", "final state (last rank)")]:
    shown = runs[runs[col].notna()]
    fig.add_trace(go.Bar(x=[f"rank {r}" for r in shown["rank"]], y=shown[col].clip(lower=1e-12), name=name,
                         text=["0 (bitwise)" if v == 0 else f"{v:.1e}" for v in shown[col]], textposition="outside"))
fig.add_hline(y=tol, line_dash="dash", line_color="gray", annotation_text=f"{tol_text} (fp32 tolerance)",
              annotation_position="top left")
fig.update_layout(barmode="group", xaxis_title="rank", yaxis_title="max |Δ| vs single-rank kda_chunk (log)",
                  yaxis_type="log", yaxis_range=[-12.5, -3], yaxis_exponentformat="power",
                  legend=dict(orientation="h", y=-0.25))
show_chart(fig, runs[["rank", "start", "end", "max_abs_err_o", "max_abs_err_state"]], key="p10_exact_chart")
verdict = f"equal within {tol_text}" if worst <= tol else f"NOT equal within {tol_text}"
st.write(f"**{world} rank(s), {variant}: {verdict}** (worst max |Δ| = {worst:.1e}, fp32). Reference: the one-rank "
         "run of the same seeded inputs, which is exactly `kda_chunk` (bitwise; asserted in the tests). Bars at "
         "1e-12 marked 0 are bitwise equal.")

st.subheader("2 · Measured phase times per rank")
bars = pd.concat([runs.assign(run=[f"rank {r.rank} [{r.start:,}, {r.end:,})" for r in runs.itertuples()]),
                  base.assign(run=[f"1 rank [0, {seq_len:,}) baseline"])])
fig2 = go.Figure()
for p in run.phases:
    fig2.add_trace(go.Bar(x=bars.run, y=bars[f"{p}_ms"], name=p))
fig2.update_layout(barmode="stack", xaxis_title="rank (tokens [start, end))", yaxis_title="wall time (ms)",
                   legend=dict(orientation="h", y=-0.25))
show_chart(fig2, bars[["run", "start", "end", *[f"{p}_ms" for p in run.phases], "total_ms"]], key="p10_phase_chart")


def _ms(seconds: float) -> str:
    """Milliseconds with the digits a sub-millisecond run needs (a tiny T ran in 0.4 ms, shown as "0 ms")."""
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 10 else f"{ms:.1f}" if ms >= 1 else f"{ms:.2f}"


def _spread(t) -> str:
    return f"IQR {_ms(t.q1_s)}–{_ms(t.q3_s)} ms · min–max {_ms(t.min_s)}–{_ms(t.max_s)} ms"


one, kcp = run.single_timing, run.kcp_timing
timings = [one]


def _time_baselines() -> None:   # the button's callback, before the run it starts: the click is never lost to a rerun
    _baselines.clear()
    st.session_state["p10_all_cores_shown"] = True


st.button(f"Also time one rank in this process on all {limits.cores} core(s), interleaved with 1 thread",
          key="p10_all_cores_button", on_click=_time_baselines)
# At every render one rank in this process at 1 thread is timed too (as cheap as the one-rank process, ~0.1 s at
# the defaults): the one-rank process alone pays process start-up effects and is not the best one rank.
threads = (1, limits.cores) if st.session_state.get("p10_all_cores_shown") else (1,)
extra, _ = engine_call(_baselines, seq_len, heads, head_k, head_v, prefix, threads)
timings += extra
timings.append(kcp)
sp = speedup_vs_best(timings[:-1], kcp)
speedup = sp.speedup
superlinear = speedup > world
m1, m2, m3 = st.columns(3)
m1.metric("Best one-rank baseline (median)", f"{_ms(sp.baseline.median_s)} ms",
          help=f"{sp.baseline.label}: the fastest of the {sp.baselines} one-rank runs timed on this page.")
m1.caption(f"{sp.baseline.label} · {_spread(sp.baseline)}")
ranks = f"{world} rank{'' if world == 1 else 's'}"   # "1 rank", "2 ranks"
m2.metric(f"{ranks} (slowest rank, median)" if world > 1 else "1 rank through KCP (median)", f"{_ms(kcp.median_s)} ms",
          help="Each rank runs 1 torch thread; per repeat, the slowest rank's total.")
m2.caption(_spread(kcp))
m3.metric("Speedup vs best one rank" if world > 1 else "KCP path vs best one rank", f"{speedup:.2f}×",
          "slower than one rank" if speedup < 1 else None, delta_color="off", delta_arrow="off",
          help=f"Ratio of the medians, against the fastest of the {sp.baselines} one-rank configurations measured "
               "on this page (never a slower one: a rank given more threads than free cores is oversubscribed).")
m3.caption(f"IQR pairing {sp.iqr_low:.2f}×–{sp.iqr_high:.2f}× · per-repeat range {sp.worst:.2f}×–{sp.best:.2f}× "
           f"(worst / best pairing) · best of {sp.baselines} baseline(s)")
why_superlinear = (
    f"Above the ideal {world}× on {world} ranks: " + (
        f"the IQR pairing reaches down to {sp.iqr_low:.2f}×, so this is within the timing spread of a shared host"
        if sp.iqr_low <= world else
        "each rank's block of T / W tokens has a smaller working set than one rank's whole prompt (caches), and "
        f"the baselines ran one after the other on a shared host at load average {run.conditions.load_avg_1m:.1f}")
    + "; it is not a gain of the method.")
if superlinear:
    st.warning(why_superlinear)
gap = run.gap.set_index("phase")
per_token = gap.loc[["prepare", "scan", "output"]]            # the work a split shares out
contention = per_token.measured_ms.sum() / per_token.one_rank_ms.sum()
extra = gap.loc[["summary", "exchange", "fold"]].measured_ms   # the work a split adds
if world == 1:
    st.caption("World size 1 runs the KCP code path on one rank in its own process: its time against the best "
               "one-rank baseline is the path's own cost, not a speedup. Move the world size to split the prompt.")
elif speedup < 1:
    added = ", ".join(f"{phase} {ms:,.1f} ms" for phase, ms in extra.items() if ms >= 0.05)
    shared = (f", and the shared phases ran {contention:.2f}× one rank's per-token cost" if contention > 1.1 else "")
    st.warning(
        f"Slower than one rank here ({speedup:.2f}×). On the slowest rank the split adds {added or 'nothing'} "
        f"(the exchange mostly waits for the other rank){shared}: {world} ranks share {run.conditions.cores} "
        f"core(s) at load average {run.conditions.load_avg_1m:.1f}. With a free core per rank the split pays off as "
        "section 4 projects.")
if len(timings) > 2:
    st.write(f"One rank in the server process, {REPEATS} interleaved repeats after a warm-up: "
             + "; ".join(f"{t.label} **{_ms(t.median_s)} ms** ({_spread(t)})" for t in timings[1:-1])
             + f". The fastest one-rank configuration measured is **{sp.baseline.label}**, so {ranks} "
             f"{'are' if world > 1 else 'through the KCP path is'} **{speedup:.2f}×** as fast as the best one rank (IQR pairing {sp.iqr_low:.2f}×–{sp.iqr_high:.2f}×). "
             "A one-rank run with more threads than free cores is oversubscribed, so a slower baseline is never "
             "the one divided by.")
if len(timings) <= 3:
    st.caption(f"One rank on all {limits.cores} core(s) in the server process is a further baseline; it runs "
               f"{limits.cores} threads for a few seconds on a shared host, so it waits for the button. The "
               "speedup is always against the fastest one-rank configuration measured.")
fig_t = go.Figure(go.Bar(x=[t.label for t in timings], y=[t.median_s * 1e3 for t in timings],
                         error_y=dict(type="data", symmetric=False, array=[(t.q3_s - t.median_s) * 1e3 for t in timings],
                                      arrayminus=[(t.median_s - t.q1_s) * 1e3 for t in timings]),
                         text=[f"{_ms(t.median_s)} ms" for t in timings], textposition="inside",
                         insidetextanchor="start"))   # at the base: clear of the IQR whisker at the top
fig_t.update_layout(xaxis_title="run", yaxis_title="wall time, median (ms; bars: IQR)", height=320)
show_chart(fig_t, pd.DataFrame([t._asdict() for t in timings]).drop(columns="samples_s"), key="p10_timing_chart")
measured_stamp(run.conditions)
st.caption(f"Each bar is the median of {REPEATS} timed repeats per rank after an untimed one-chunk warm-up; process "
           "start excluded. The one-rank process and the KCP ranks run one after the other, not interleaved (the "
           "in-process baselines are interleaved with each other): on a loaded host, read the spreads.")
with st.expander("What each phase does"):
    st.markdown(
        "- **prepare**: intra-chunk WY work (shared by the summary and the local run).\n"
        "- **summary**: chaining M_c = diag(γ_c) − K̃_cᵀW_c and S_ext over the block's chunks.\n"
        "- **exchange**: the collective, including waiting for peers.\n"
        "- **fold**: S ← M_p S + S_ext,p over predecessors.\n"
        "- **scan + output**: the ordinary chunk kernel from the true initial state.")

st.subheader("3 · Bytes each rank receives vs context: KCP against MLA's KV all-gather")
model = MODELS[links.selectbox(st, "Model for the byte comparison", "p10_model")]
cfg, w_bytes = run.models[model], run.bytes_world_size
bdf = run.bytes[run.bytes.model == model].drop(columns="model")
fig3 = go.Figure()
fig3.add_trace(go.Scatter(x=bdf.num_tokens, y=bdf.kcp_bytes / 2 ** 20, name=f"KCP: {cfg.num_kda_layers} KDA layers (flat)"))
fig3.add_trace(go.Scatter(x=bdf.num_tokens, y=bdf.mla_bytes / 2 ** 20, name=f"MLA: {cfg.num_mla_layers} layers' latent KV"))
fig3.update_layout(xaxis_title="prompt length T (tokens, log)", yaxis_title=f"MiB received per rank, {w_bytes} ranks (log)",
                   xaxis_type="log", yaxis_type="log", legend=dict(orientation="h", y=-0.25))
show_chart(fig3, bdf, key="p10_bytes_chart")
sent, recv = run.formula_sent, run.formula_received
st.caption(f"Measured in this run (H={heads}, K={head_k}, V={head_v}): the last rank sent "
           f"{int(runs.sent_bytes.iloc[-1]):,} B and received {int(runs.received_bytes.iloc[-1]):,} B, counted from the "
           f"tensors passed to the collectives; the formula gives {sent:,} B / {recv:,} B, the same at any T.")
with st.expander("Byte formulas"):
    st.markdown(
        "- KCP, per KDA layer: all-gather payload H·K·(K+V)·4 B per rank (received W−1 times); ring H·K·V·4 B per "
        "hop; plus the conv halo (2HK+HV)·(W_conv−1)·4 B.\n"
        f"- MLA all-gather: (T − own tokens)·({cfg.kv_lora_rank} + {cfg.qk_rope_head_dim})·2 B per MLA layer (bf16).\n"
        f"- Model: {cfg.source}.")

st.subheader("4 · Speedup vs one rank: measured, and a projection to more ranks")
bw = links.select_slider(st, "Interconnect bandwidth for the projection (GB/s)", "p10_bandwidth")
if world < 2:
    st.info("The projection needs the summary and fold costs of a run with at least 2 ranks: move the world size.")
else:
    costs = run.costs
    pdf = run.projection[run.projection.bandwidth_gbps == bw]
    fig4 = go.Figure()
    fig4.add_trace(go.Scatter(x=pdf.world_size, y=pdf.speedup, name="projection (model, not measured)",
                              mode="lines+markers", line=dict(dash="dash")))
    fig4.add_trace(go.Scatter(x=[1, world], y=[1.0, speedup], name="measured on this CPU (vs the best one rank)",
                              mode="markers+text" if superlinear else "markers",
                              text=["", "above ideal: see the note"] if superlinear else None,
                              textposition="top center", hovertext=["", why_superlinear],
                              marker=dict(size=12, symbol="diamond")))
    fig4.add_trace(go.Scatter(x=pdf.world_size, y=pdf.world_size, name="ideal: speedup = ranks", mode="lines",
                              line=dict(dash="dot", color="gray")))
    fig4.update_layout(xaxis_title="ranks", yaxis_title="speedup vs one rank (×)", legend=dict(orientation="h", y=-0.25))
    show_chart(fig4, pdf, key="p10_speedup_chart")
    measured_stamp(run.conditions)
    projected = float(pdf[pdf.world_size == world].speedup.iloc[0]) if (pdf.world_size == world).any() else None
    if projected is not None:
        st.write(
            f"**Measured {speedup:.2f}× vs projected {projected:.2f}× at {world} ranks.** Phase by phase on the "
            f"slowest rank: prepare + scan + output took {per_token.measured_ms.sum():,.0f} ms where one rank's "
            f"per-token cost predicts {per_token.one_rank_ms.sum():,.0f} ms for its block ({contention:.2f}×: "
            f"the ranks share {run.conditions.cores} core(s) at load average {run.conditions.load_avg_1m:.1f}, and "
            f"the projection assumes a free core per rank); summary {extra['summary']:,.0f} ms and fold "
            f"{extra['fold']:,.1f} ms are in the projection; exchange {extra['exchange']:,.0f} ms (mostly waiting "
            "for the other rank) is not.")
    show_table(run.gap, {"phase": "Phase", "one_rank_ms": num("One rank's per-token cost × block (ms)", "%,.1f"),
                         "measured_ms": num("Measured on the slowest rank (ms, median)", "%,.1f")})
    st.caption(f"Projection (a model, not measured): this run's per-token phase costs and {bw} GB/s, one core per rank, "
               "no latency term. The summary is the price of parallel start — the ring skips it but its hops "
               "serialise the scans.")
    with st.expander("How the projection is computed"):
        st.markdown(
            f"- Per-token costs, medians of {REPEATS} repeats: prepare {costs.prepare_ms_per_token * 1e3:.1f}, summary "
            f"{costs.summary_ms_per_token * 1e3:.1f}, scan {costs.scan_ms_per_token * 1e3:.1f}, output "
            f"{costs.output_ms_per_token * 1e3:.1f} µs/token; fold {costs.fold_ms_per_rank * 1e3:.0f} µs per predecessor.\n"
            "- All-gather: L·(prepare + summary + scan + output) + (N−1)·fold + (N−1)·payload/bw.\n"
            "- Ring: L·prepare + N·L·scan + (N−1)·state/bw + L·output (L = T/N).\n"
            "- Sources: fla `fla/ops/cp/KCP.md`; SGLang PR #34059; LASP-2 (arXiv:2502.07563).")
