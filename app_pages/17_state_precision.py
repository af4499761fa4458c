"""17 State precision: what a KDA state loses in each storage format on the trained model, the requests
per GPU each format buys at the real models' bytes, and the serving engine itself with bf16 / fp16 states."""
import plotly.graph_objects as go
import streamlit as st

from app_pages.charts import num, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import run_on_request
from app_pages.params import Choice
from lab.shipped import missing_note
from lab.state_capacity import (
    CONTEXTS,
    DECAYS,
    FP16_MAX,
    GPU_NAMES,
    VALUE_SCALES,
    capacity_table,
    low_decay_probe,
    slot_parts,
)
from lab.state_dtype import divergence_text, shipped_run
from lab.state_precision import (
    DRAFT_LENS,
    PAGE_CONTINUE,
    PAGE_DOCUMENTS,
    PAGE_TOKENS,
    bench_run,
    field_claims,
    precision_run,
)

st.title("State precision")
st.write(
    "A KDA layer keeps one fixed state per request; storing it in fewer bytes admits more requests. The recurrence "
    "still computes in fp32: only the **stored** slot changes. vLLM offers that choice for Mamba2 and GDN states "
    "(`--mamba-ssm-cache-dtype`) but pins KDA's recurrent state to fp32 (`MambaStateDtypeCalculator.kda_state_dtype`, "
    "vllm/model_executor/layers/mamba/mamba_utils.py): this page measures what a 16-bit or 8-bit KDA state would "
    "lose and buy. After every token the trained model's states are stored in each format and read back; what "
    "drifts, and what it buys, is below.")

SUMMARY_COLUMNS = {   # 12 columns: shown wrapped (show_table(..., wrap=True)); a grid cut the last ones
    "label": "Format", "bytes_per_layer": num("Bytes per slot per layer", "%,d"),
    "capacity_vs_fp32": num("Slots vs fp32 (×)", "%.2f"), "agreement": num("Greedy agreement with fp32", "%.4f"),
    "top1": num("Top-1 on the file", "%.4f"), "final_state_rel_err": num("State drift at the end", "%.2e"),
    "max_logit_drift": num("Max |Δ logit|", "%.3f"), "first_divergence": num("Free-run tokens equal to fp32", "%d"),
    "accept_per_token": num("Draft acceptance per token", "%.3f"),
    "accepted_per_verify": num("Accepted drafts per verify", "%.2f"), "max_abs_state": num("Max |S|", "%.2f"),
    "first_nonfinite": num("First non-finite token (0 = none)", "%d")}


LEGEND_ON_TOP = dict(orientation="h", yanchor="bottom", y=1.02, x=0)   # below, it covered the rotated format names
CLAIM_COLUMNS = {"source": "Source", "claim": "Reported", "ours": "Measured here", "verdict": "Verdict"}


def drift_charts(curves, key: str) -> None:
    """State and logit drift vs tokens, one line per format (fp32 is the reference: zero, off the log axis)."""
    left, right = st.columns(2)
    for col, column, title in ((left, "state_rel_err", "state drift ‖S − S_fp32‖ / ‖S_fp32‖ (ratio, log)"),
                               (right, "logit_max_abs", "logit drift max |Δz| (logits, log)")):
        fig = go.Figure()
        for label, c in curves[curves.format != "fp32"].groupby("label", sort=False):
            fig.add_trace(go.Scatter(x=c.position, y=c[column].where(c[column] > 0), name=label, mode="lines"))
        fig.update_layout(xaxis_title="tokens decoded (log)", yaxis_title=title, xaxis_type="log", yaxis_type="log",
                          yaxis_tickformat="~e", legend=dict(orientation="h", y=-0.3))   # 5e-4, not "500µ"
        with col:
            show_chart(fig, curves, key=f"{key}_{column}")


def agreement_chart(summary, key: str) -> None:
    """Greedy agreement, top-1 on the file and draft acceptance per format, as grouped bars."""
    fig = go.Figure()
    for column, name in (("agreement", "greedy agreement with fp32 (teacher-forced)"), ("top1", "top-1 on the file"),
                         ("accept_per_token", "draft acceptance per token (fp32's tokens as drafts)")):
        fig.add_trace(go.Bar(x=summary.label, y=summary[column], name=name))
    fig.update_layout(barmode="group", yaxis_title="fraction of positions (0–1)", xaxis_title="state format",
                      yaxis_range=[0, 1.05], legend=LEGEND_ON_TOP)
    show_chart(fig, summary, key=key)


links = declare(
    Choice("p17_gpu", "H200", GPU_NAMES),
    Choice("p17_context", 4096, CONTEXTS),
    Choice("p17_decay", 1e-4, DECAYS),
    Choice("p17_vscale", 1.0, VALUE_SCALES),
    Choice("p17_doc", PAGE_DOCUMENTS[0], PAGE_DOCUMENTS),
    Choice("p17_tokens", 64, PAGE_TOKENS),
    Choice("p17_continue", 16, PAGE_CONTINUE),
    Choice("p17_draft", 4, DRAFT_LENS),
)

st.subheader("1 · Requests per GPU at real bytes")
c1, c2 = st.columns(2)
gpu = links.selectbox(c1, "GPU", "p17_gpu")
context = links.select_slider(c2, "Context beside each slot (tokens of MLA latent KV)", "p17_context")
cap = engine_call(st.cache_data(capacity_table, show_spinner=False, max_entries=32, ttl="1h"), context, gpu)
fig = go.Figure()
for model, c in cap.groupby("model", sort=False):
    fig.add_trace(go.Bar(x=c.label, y=c.max_requests, name=f"{model} (TP {int(c.tp.iloc[0])})",
                         text=[f"{v:.2f}×" for v in c.vs_fp32], textposition="outside"))
fig.update_layout(barmode="group", yaxis_title="max concurrent requests (sequences)", xaxis_title="state format",
                  legend=LEGEND_ON_TOP)
show_chart(fig, cap, key="p17_capacity_chart")
show_table(cap[["model", "label", "tp", "slot_bytes", "slots_per_gb", "max_requests", "vs_fp32"]],
           {"model": "Model", "label": "Format", "tp": num("TP", "%d"), "slot_bytes": num("Slot bytes per GPU", "%,.0f"),
            "slots_per_gb": num("Slots per GB", "%,.1f"), "max_requests": num("Max requests", "%,d"),
            "vs_fp32": num("× fp32", "%.2f")})
kimi = slot_parts("kimi-linear-48b-a3b")
st.caption("Slot = every KDA layer's recurrent state in the format (with its scales) + its **bf16** "
           "conv window, split over TP by heads (as on page 03). Kimi-Linear fp32 at TP 1: "
           f"{kimi.recurrent_fp32:,} B recurrent + {kimi.conv_bf16:,} B bf16 conv = "
           f"{kimi.recurrent_fp32 + kimi.conv_bf16:,} B ({(kimi.recurrent_fp32 + kimi.conv_bf16) / 2 ** 20:,.1f} MiB). "
           "Requests = (0.9 × HBM − weights / TP) ÷ (MLA KV at the context + slot).")

st.subheader("2 · Drift on the trained model (shipped long run)")
shipped = bench_run()
if shipped is None:
    st.info(missing_note("state_precision"))
else:
    m = shipped.meta
    st.write(f"`python -m bench.state_precision`: the whole held-out **{m['document']}** ({m['num_tokens']:,} "
             f"tokens, teacher-forced), then {m['continue_tokens']} free-running tokens; drafts of "
             f"{m['draft_len']} are fp32's greedy tokens. fp32 row bitwise equal to plain decode: "
             f"{'yes' if m['fp32_bitwise'] else 'NO'}.")
    cond = m["conditions"]
    st.caption(f"Accuracy figures (not timings): {cond['wall_s']:,.0f} s wall, {cond['torch_threads']} torch thread, "
               f"load average {cond['load_avg_1m_start']:.1f} → {cond['load_avg_1m_end']:.1f}, torch {cond['torch']}.")
    if not m["weights_match"]:
        st.warning("These figures were measured on other weights than weights/kda-demo holds now: rerun the bench.")
    drift_charts(shipped.curves, "p17_bench")
    agreement_chart(shipped.summary, "p17_bench_agreement")
    show_table(shipped.summary[list(SUMMARY_COLUMNS)], SUMMARY_COLUMNS, wrap=True)
    st.markdown("**What the field reports, on our model** (verdicts by top-1 on the file: a drop over 5 points is a "
                "collapse, within 1 point a match)")
    show_table(field_claims(shipped.summary, cap), CLAIM_COLUMNS, wrap=True)

st.subheader("3 · Can the state outgrow fp16? (constructed low-decay input)")
e1, e2 = st.columns(2)
decay = links.select_slider(e1, "Decay per token, 1 − exp(g)", "p17_decay")
vscale = links.select_slider(e2, "Value scale σ of v ~ N(0, σ²)", "p17_vscale")
probe = engine_call(st.cache_data(low_decay_probe, show_spinner=False, max_entries=16, ttl="1h"), 1024, decay, vscale)
fig = go.Figure()
for column, name in (("max_abs_state", "max |S|"), ("max_abs_readout", "max |o| (readout)"),
                     ("max_abs_value", "max |v| so far")):
    fig.add_trace(go.Scatter(x=probe.position, y=probe[column], name=name, mode="lines"))
fig.add_hline(y=FP16_MAX, line_dash="dash", annotation_text="fp16 max 65,504")
fig.update_layout(xaxis_title="tokens (log)", yaxis_title="magnitude (state units, log)", xaxis_type="log",
                  yaxis_type="log", legend=dict(orientation="h", y=-0.3))
show_chart(fig, probe, key="p17_probe_chart")
over = int((probe.max_abs_state > FP16_MAX).sum())
st.caption(f"β = 1, random unit keys, H = 4, K = V = 32: max |S| ends at {probe.max_abs_state.iloc[-1]:,.2f} for max "
           f"|v| {probe.max_abs_value.iloc[-1]:,.2f}; {over} of {len(probe):,} states exceed fp16's range. The delta "
           "rule overwrites what a key holds, so |S| tracks |v|, not the token count.")

st.subheader("4 · In the engine: bf16 / fp16 stored states")
engine_run = shipped_run()
if engine_run is None:
    st.info(missing_note("state_dtype"))
else:
    m = engine_run.meta
    st.write(f"`python -m bench.state_dtype`: the serving engine itself (`ServeEngine(state_dtype=...)`, "
             f"`python -m serve.http --state-dtype bf16`) served {m['num_prompts']} held-out prompts (Home's rule, "
             f"step 1) for {m['max_new_tokens']} greedy tokens with each stored state dtype. Compute stays fp32: a "
             "state is upcast when gathered into the batch and rounded to nearest when written back (prefill end, "
             "every decode step, verify commit, checkpoints); conv windows and latents stay fp32.")
    fig = go.Figure()
    for dtype, c in engine_run.summary.groupby("state_dtype", sort=False):
        fig.add_trace(go.Scatter(x=c.length, y=c.agreement, name=dtype, mode="lines+markers"))
    fig.update_layout(xaxis_title="generated tokens (log)", xaxis_type="log", yaxis_range=[0, 1.05],
                      yaxis_title="prompts whose tokens all equal the fp32 engine's (fraction)", legend=LEGEND_ON_TOP)
    show_chart(fig, engine_run.summary, key="p17_engine_agreement")
    show_table(divergence_text(engine_run.summary), {
        "state_dtype": "Stored state", "length": num("Generated tokens", "%d"),
        "agreement": num("Prompts equal to fp32 (fraction)", "%.3f"),
        "median_first_divergence": "Median tokens before first divergence (within the row's length)",
        "min_first_divergence": "Fewest tokens before a divergence (within the row's length)",
        "median_max_logit_diff": num("Median max |Δ logit| (logits)", "%.4f")}, wrap=True)   # long headers
    show_table(engine_run.slots, {
        "model": "Model (our engine's layout)", "state_dtype": "Stored state", "state_bytes": num("State bytes (recurrent in the stored dtype + fp32 conv)", "%,d"),
        "state_pages": num("State pages", "%d"), "requests": num("Requests at 1,024 tokens", "%,d"),
        "requests_vs_fp32": num("× fp32", "%.2f"), "state_slots": num("State slots", "%,d"),
        "state_slots_vs_fp32": num("Slots × fp32", "%.2f")}, wrap=True)   # 8 columns: the grid cut the last
    cond, t = m["conditions"], engine_run.timing
    st.caption(f"Serving wall time vs fp32, same run: bf16 {t.vs_fp32['bf16']:.2f}×, fp16 {t.vs_fp32['fp16']:.2f}× "
               f"(median of {int(t.repeats['fp32'])} interleaved repeats, {m['timing']['num_prompts']} prompts × "
               f"{m['timing']['max_new_tokens']} tokens, {cond['torch_threads']} torch thread, load average "
               f"{cond['load_avg_1m_before_timing']:.1f} → {cond['load_avg_1m_end']:.1f}).")
    with st.expander("Slots, and what vLLM stores"):
        st.markdown(
            "- Same pool for every dtype (`python -m serve.http`'s fp32 sizing; its /metrics reports "
            "`kda:state_slots_capacity`, while `--max-num-seqs` caps the slots in use). Slots grow by the stored bytes: ×2 "
            "for the recurrent state, less overall while the fp32 conv windows stay (22 % of the demo's fp32 state, "
            "7 % of Kimi-Linear's) and, per request, the fp32 MLA latents of its context. Kimi-Linear fp32 here: "
            f"{kimi.recurrent_fp32:,} B recurrent + {kimi.conv_fp32:,} B **fp32** conv = "
            f"{kimi.recurrent_fp32 + kimi.conv_fp32:,} B; section 1 and page 03 count the conv window in bf16 "
            f"({kimi.recurrent_fp32 + kimi.conv_bf16:,} B).\n"
            "- vLLM keeps KDA's recurrent state fp32 whatever `--mamba-cache-dtype` says "
            "(`MambaStateDtypeCalculator.kda_state_dtype`, vllm/model_executor/layers/mamba/mamba_utils.py); "
            "`--mamba-ssm-cache-dtype` picks the SSM state dtype for Mamba2 and GDN (vllm/config/cache.py).\n"
            "- Bitwise with a 16-bit state: a request in any batch equals its batch-1 run. Only in fp32: a warm "
            "run equals the cold one (the restored checkpoint is rounded), chunked prefill equals unchunked.")

st.subheader("5 · Your run")
d1, d2, d3, d4 = st.columns(4)
doc = links.selectbox(d1, "Held-out file", "p17_doc")
tokens = links.select_slider(d2, "Teacher-forced tokens", "p17_tokens")
cont = links.select_slider(d3, "Free-running tokens", "p17_continue")
draft = links.select_slider(d4, "Drafts per verify", "p17_draft")
run_on_request("p17_run_on", "p17_run_button", "Decode with every format",
               "Decodes the file token by token once per format on this CPU (a few seconds at the defaults; longer runs grow as tokens squared).")
run = engine_call(st.cache_data(precision_run, show_spinner="Decoding with every format…", max_entries=8, ttl="1h"),
                  doc, tokens, cont, draft_len=draft)
if run.fp32_bitwise:
    st.success(f"fp32 storage is bitwise today's decode: logits of {run.num_tokens} tokens equal a plain batch-1 "
               "decode_step loop.")
else:
    st.error("fp32 storage differs from plain decode: a bug in the storage path.")
drift_charts(run.curves, "p17_run")
agreement_chart(run.summary, "p17_run_agreement")
show_table(run.summary[list(SUMMARY_COLUMNS)], SUMMARY_COLUMNS, wrap=True)
with st.expander("Free-running text per format"):
    st.code("\n".join(f"{f:12s} {t!r}" for f, t in run.continuations.items()), language=None, wrap_lines=True)

with st.expander("Formats, formulas and sources"):
    st.markdown(
        "- Drift = ‖S_x − S_fp32‖_F / ‖S_fp32‖_F over all 6 KDA layers after each token; logit drift = max |z_x − z_fp32|.\n"
        "- fp8 e4m3 and int8 keep one fp32 scale per head row (h, k) = amax over V / 448 (fp8) or / 127 (int8), "
        "as vllm#52962 stores one per (head, head_dim): KDA decays each key row at its own rate, so one scale per head "
        "(int8 head scale) rounds the small rows away. Stochastic rounding picks the upper or lower e4m3 neighbour "
        "with probability by distance (seeded; unbiased).\n"
        "- Error feedback (vllm#55196): the residual of one store, kept as int4 with its own row scale, is added to "
        "the next store's state. vllm#55196 reports uniform int8 state collapsing GSM8K 81 % → 41 % and error "
        "feedback recovering 81 %; vllm#52962 reports fp8 e4m3 + stochastic rounding within one answer of fp32 at "
        "2.109× the admitted cache tokens.\n"
        "- fp16 overflows above 65,504: vllm#54146 found the GDN readout of an fp32 state overflowing fp16 on long "
        "low-decay context. fp32 became the default state dtype after vllm#22928 (the `mamba_ssm_cache_dtype` "
        "option) and vllm#34489 (Qwen3-Next / Qwen3.5 must run with an fp32 SSM state).\n"
        "- Acceptance: fp32's greedy tokens are the drafts; a draft is accepted while the format's argmax equals it; "
        "accepted per verify is the measured run of matches from every start, capped at the draft length.")
