"""Home: what the second request saves — two prompts through the full serving engine, cold vs warm, on the chunk grid."""
import plotly.graph_objects as go
import streamlit as st

from app_pages.charts import show_chart, show_forward_fit
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import measured_stamp, remeasure_button, run_on_request
from app_pages.params import Choice, Int, Text
from app_pages.registry import SECTIONS, TABS
from lab.trained import home_prompts, model_card

st.title("KDA Serve Lab — what the second request saves")
st.write(
    "How **Kimi Delta Attention** changes LLM serving, measured live on a real torch engine on this CPU. A hybrid "
    "KDA/MLA model can reuse a cached prefix only at a block boundary where *every* layer's data exists: the MLA "
    "latents of each token (KV pages, shared by reference) **and** the KDA recurrent + conv state after exactly that "
    "many tokens (a checkpoint, copied into the request). Below, two prompts (bytes are tokens) go through our "
    "`ServeEngine` on the demo model: the second one cold (no cache) and warm (after the first filled the cache). "
    "As an editor's completion requests do, both send one Python file up to a function body, the second one "
    "further down; the file is held out from the model's training. With blocks of N = 64 tokens, the KDA chunk, "
    "the hit lands on the chunk grid, so the warm run's logits are **bitwise equal** to the cold run's, and it "
    "skips most of the prefill: timed below, wall clock and CPU time side by side.")

PROMPTS, CARD = home_prompts(), model_card()   # read from files, no torch
# fp32 logits of the warm run may differ from the cache-off run in the last bits: the warm prefill starts
# from a restored checkpoint, so its chunked sums are split at other token positions.
LOGIT_TOL = 5e-5   # = lab.prefix.WARM_TOLERANCE (read here without importing torch; tests pin them equal)
FIRST, SECOND = PROMPTS.first, PROMPTS.second
TOL_TEXT = f"{LOGIT_TOL:.0e}".replace("e-0", "e-")  # 5e-5
MAX_PROMPT_BYTES = 2_000  # = tokens (byte-level model): bounds the prefills below
links = declare(
    Text("p00_first", FIRST, max_chars=MAX_PROMPT_BYTES),
    Text("p00_second", SECOND, max_chars=MAX_PROMPT_BYTES),
    Int("p00_new", 24, 1, 64),   # 24 of the 48 bytes the prompt rule judged; 3 runs (cold, fill, warm) decode each
    Choice("p00_block", 64, [8, 16, 32, 64]),   # 64 = the KDA chunk: every hit on the chunk grid (bitwise)
    Choice("p00_interval_c", 64, [64, 128, 256, 512]),
)
c1, c2 = st.columns(2)
first = links.text_area(c1, "Request 1 (fills the cache)", "p00_first", height=170)
second = links.text_area(c2, "Request 2 (cold vs warm)", "p00_second", height=170)
d1, d2, d3 = st.columns(3)
max_new = links.slider(d1, "Tokens to generate", "p00_new")
block = links.select_slider(d2, "Block size N (tokens)", "p00_block",
                            help="N = 64, the KDA chunk: every block boundary is a chunk edge, so a hit is on the "
                                 "chunk grid and the warm run is bitwise equal to the cold run. With N < 64 (16 was "
                                 "the earlier default) the hit can fall between chunk edges: the warm logits then agree "
                                 f"within {TOL_TEXT}, not bitwise.")
interval = links.select_slider(d3, "Checkpoint interval C (tokens)", "p00_interval_c")
sizes = {name: len(prompt.encode()) for name, prompt in (("Request 1", first), ("Request 2", second))}
st.caption(f"Each prompt is capped at {MAX_PROMPT_BYTES:,} bytes (bytes are tokens; in UTF-8 an accent takes 2 bytes, "
           "an emoji 4): the page runs one verified cold / warm pair (and, on request, times both over repeats); the cap bounds "
           f"the wait. These prompts are {sizes['Request 1']:,} and {sizes['Request 2']:,} bytes.")
too_long = [name for name, n in sizes.items() if n > MAX_PROMPT_BYTES]
if too_long:
    st.error(f"{' and '.join(too_long)} exceed{'s' if len(too_long) == 1 else ''} {MAX_PROMPT_BYTES:,} bytes in "
             f"UTF-8; shorten {'it' if len(too_long) == 1 else 'them'}.")
    st.stop()
if not all(sizes.values()):
    st.info("Type both prompts (each at least one character).")
    st.stop()


# ttl in seconds: a string ("1h") makes Streamlit import pandas to parse it, 0.3 s of a fresh server's first render
CACHE_TTL_S = 3600


@st.cache_data(show_spinner="Running both requests through the engine…", max_entries=32, ttl=CACHE_TTL_S)
def _p00_verdict(first, second, max_new, block, interval):
    from lab.prefix import home  # here: on a fresh server torch loads while the text and the chart above show
    return home(first, second, max_new, block, interval)


REPEATS = 7   # interleaved rounds: the paired quartiles need 6 of 7 rounds on one side of zero
PAIRED_RULE = ("A change vs cold is stated only when the paired differences cold − warm of the rounds (each round runs "
               "both, so a slow moment of the machine hits both) have their first and third quartiles on the same "
               "side of zero; otherwise it is not resolved at this load.")


@st.cache_data(show_spinner=f"Timing cold and warm runs: {REPEATS} interleaved repeats after a warm-up…",
               max_entries=32, ttl=CACHE_TTL_S)
def _p00_timing(first, second, max_new, block, interval):
    from lab.prefix import home_timing
    return home_timing(first, second, max_new, block, interval, repeats=REPEATS)


first_bytes, second_bytes = first.encode(), second.encode()
shared = next((i for i, (a, b) in enumerate(zip(first_bytes, second_bytes)) if a != b),
              min(len(first_bytes), len(second_bytes)))              # bytes request 2 shares with request 1
kv_blocks = shared // block * block                                   # whole blocks of that prefix (KV pages)
tokens_part = st.empty()   # now: the prompts; after the engine run: its counters (the same rows, measured)
preview = go.Figure([go.Bar(y=["request 1", "request 2"], x=[shared, shared], orientation="h", marker_color="#bbf7d0",
                            name="shared prefix (same bytes in both prompts)"),
                     go.Bar(y=["request 1", "request 2"], x=[len(first_bytes) - shared, len(second_bytes) - shared],
                            orientation="h", marker_color="#e5e7eb", name="own tokens")])
preview.add_vline(x=kv_blocks, line_dash="dot", annotation_text=f"{kv_blocks // block} whole blocks of N = {block}")
preview.update_layout(barmode="stack", height=230, xaxis_title="prompt tokens (bytes), read from the prompts before the engine run",
                      yaxis_autorange="reversed", legend=dict(orientation="h", y=-0.45), margin=dict(l=10, r=10, t=40, b=10))
tokens_part.plotly_chart(preview, key="p00_prompts_chart", width="stretch")   # replaced below, so no CSV button
run = engine_call(_p00_verdict, first, second, max_new, block, interval)
check, warm, cold = run.check, run.warm, run.cold
m1, m2, m3, m4 = st.columns(4)   # the engine's counters of the verified run: shown at first render, no timing needed
saved_tokens = warm['prefill_tokens'] - cold['prefill_tokens']
m1.metric("Prefill tokens skipped (warm)", f"{warm['hit_tokens']:,} of {warm['prompt_tokens']:,}",
          f"{warm['hit_tokens'] / warm['prompt_tokens']:.0%} of the prompt, output verified", delta_color="off",
          delta_arrow="off", help="Counted by the engine in the verification run below; TTFT is timed on request "
                                  "(section 'Where the time goes').")
m2.metric("Prefill tokens computed", f"{warm['prefill_tokens']:,}", f"{saved_tokens:,} vs cold",
          delta_color="inverse" if saved_tokens else "off",   # no change: grey, no arrow (a string "0 …" reads as up)
          delta_arrow="auto" if saved_tokens else "off")
m3.metric("Restored from checkpoint", f"{warm['restored_bytes'] / 1024:,.1f} KiB", "KDA state, copied", delta_color="off", delta_arrow="off")
m4.metric("Shared through KV pages", f"{warm['shared_kv_bytes'] / 1024:,.1f} KiB", "MLA latents, by reference",
          delta_color="off", delta_arrow="off")
if check.outputs_identical and check.max_logit_diff <= LOGIT_TOL:
    st.success(f"Outputs identical to the cache-off run: {run.num_generated} greedy tokens, max |Δ logits| = "
               f"{check.max_logit_diff:.1e} (≤ {TOL_TEXT} required), logits {check.verdict}: {check.reason}.")
elif check.outputs_identical:
    st.error(f"Warm tokens equal the cache-off run's, but max |Δ logits| = {check.max_logit_diff:.1e} exceeds the "
             f"{TOL_TEXT} tolerance.")
else:
    st.error("Warm output differs from the cache-off run.")
tail = "\n".join(second.split("\n")[-3:])          # the prompt's last lines, for context
o1, o2 = st.columns(2)
o1.markdown(f"**Request 2's warm output**: {run.num_generated} greedy bytes of {CARD.name} after the prompt's last "
            "lines (control bytes as ·)")
o1.code(tail + run.warm_text, language="python", wrap_lines=True)   # long lines cut at the column
if (first, second) == (FIRST, SECOND):
    o2.markdown(f"**What `{PROMPTS.path}` really holds there** (held out from training; first {max_new} bytes)")
    o2.code(tail + PROMPTS.file_continuation.encode()[:max_new].decode(errors="ignore"), language="python", wrap_lines=True)
st.caption(f"The model: **{CARD.name}**, {CARD.num_parameters / 1e6:.2f} M parameters, one token per byte, trained "
           f"{CARD.hours:.1f} h on a CPU over {CARD.bytes_trained / 1e6:.1f} M bytes of the Python standard library. "
           f"Held-out code: {CARD.code_nats_per_byte:.3f} nats per byte, xz {CARD.code_xz:.3f} (prose "
           f"{CARD.prose_nats_per_byte:.3f} vs xz {CARD.prose_xz:.3f}): Python-like code, not correct code.")
with st.expander("How the default prompts are chosen"):
    st.markdown(f"They are cut from `{PROMPTS.path}` (held out from training) by a fixed rule (`train/prompts.py`): "
                f"the first held-out function body whose {PROMPTS.continuation_bytes}-byte greedy continuation reads "
                f"as code; the {PROMPTS.cuts_rejected} cuts before it gave a docstring, blanks, a loop or a template "
                "that is also in the training files. Lower nats per byte is better.")
runs = [r for r in run.rows if r["kind"] in ("cold", "first", "warm")]   # the verification run, in PHASE_RUNS order
names = {"cold": "request 2 cold", "first": "request 1 (fills)", "warm": "request 2 warm"}
fig_tokens = go.Figure([
    go.Bar(y=[names[r["kind"]] for r in runs], x=[r["hit_tokens"] for r in runs], orientation="h", marker_color="#2ca02c",
           name="reused: restored at the hit b (checkpoint + KV pages)"),
    go.Bar(y=[names[r["kind"]] for r in runs], x=[r["prefill_tokens"] for r in runs], orientation="h",
           marker_color="#9ca3af", name="prefilled (computed)")])
fig_tokens.add_trace(go.Scatter(y=[names["warm"]], x=[warm["kv_hit_tokens"]], mode="markers", name="KV-page match (phase 1)",
                                marker=dict(symbol="line-ns-open", size=26, color="#111827", line_width=2)))
fig_tokens.update_layout(barmode="stack", height=230, xaxis_title="prompt tokens (the engine's counters of the verification run)",
                         yaxis_autorange="reversed", legend=dict(orientation="h", y=-0.45))
with tokens_part.container():
    show_chart(fig_tokens, [{k: r[k] for k in ("kind", "prompt_tokens", "hit_tokens", "kv_hit_tokens", "prefill_tokens")}
                            for r in runs], key="p00_tokens_chart")
st.caption(f"Hit: {warm['hit_tokens']} of {warm['prompt_tokens']} tokens (phase-1 KV run {warm['kv_hit_tokens']}): the "
           "largest boundary ≤ min(KV run, L − 1) with a complete checkpoint (as in vLLM's and SGLang's hybrid prefix "
           f"caching). A whole-model KDA state is {run.state_bytes:,} B whatever the prefix length; the KV shared grows "
           "with it.")
st.caption("What to notice: warm TTFT ≈ a + b·(L − hit) + restore, with a the fixed cost of one forward and b the cost "
           "per prefilled token (both fitted when you measure below), so skipping most tokens cuts TTFT by less.")

timing_part = st.container()   # filled last: the tab list below shows while the repeats run
st.subheader("Tabs")
for section in SECTIONS:
    tabs = [tab for tab in TABS if tab.section == section]
    if tabs:
        st.write(f"**{section}**")
    for tab in tabs:
        st.page_link(tab.path, label=f"{tab.title} — {tab.blurb}", icon=tab.icon)

with timing_part:
    st.subheader(f"Where the time goes: wall clock and CPU time ({REPEATS} interleaved rounds)")
    run_on_request("p00_timing_on", "p00_measure_button", "Measure TTFT cold vs warm",
                   f"Times request 2 cold and warm on fresh engines, {REPEATS} interleaved rounds after a warm-up, "
                   "the CPU time of the same requests beside the wall clock, and two shorter cache-off prefills for "
                   "the fixed + per-token cost fit (40 engine runs, about 6 s of CPU: 20 s of wall clock at load average 10), "
                   "then keeps the result for every visitor with these settings.")
    remeasure_button(_p00_timing, key="p00_remeasure")
    timed = engine_call(_p00_timing, first, second, max_new, block, interval)
    from lab.prefix import paired_spread  # torch is loaded by now (the verification run)
    summary, ttft, fit = timed.summary, timed.ttft, timed.fit
    resolved = {c: summary[f"{p}verdict"] != "not resolved" for c, p in (("wall", ""), ("cpu", "cpu_"))}
    t1, t2, t3, t4 = st.columns(4)
    for col, c, name in ((t1, "ttft", "TTFT, wall clock"), (t2, "cpu", "CPU time, same runs")):
        ok = resolved["wall" if c == "ttft" else "cpu"]
        col.metric(name, f"{summary[f'cold_{c}_ms']:.0f} → {summary[f'warm_{c}_ms']:.0f} ms",
                   f"{-summary[f'{c}_reduction']:+.0%} (medians)" if ok else "not resolved",
                   delta_color="inverse" if ok else "off", delta_arrow="auto" if ok else "off", help=PAIRED_RULE)
    t3.metric("Saved per request (wall)", f"{summary['saved_ms']:.0f} ms",
              f"{summary['saved_ms'] / fit.fixed_ms:.1f}× the fixed cost a" if fit.fixed_ms > 0 else "fixed cost a ≤ 0",
              delta_color="off", delta_arrow="off", help="Median of the paired differences cold − warm; a is the fixed "
              "cost of one forward, fitted below.")
    t4.metric("Fixed cost per forward a", f"{fit.fixed_ms:.1f} ms", f"+ {fit.per_token_ms:.3f} ms per token",
              delta_color="off", delta_arrow="off",
              help=(f"{'A two-point estimate' if fit.two_point else 'Least squares'} over cache-off prefills of "
                    f"n = {', '.join(map(str, fit.fit_tokens))} tokens; held-out error on the cold run "
                    f"{fit.held_out_error:+.0%}."))
    load = timed.conditions.load_avg_1m
    spreads = f"wall clock {paired_spread(summary)}; CPU time {paired_spread(summary, 'cpu_')}"
    if resolved["wall"] and resolved["cpu"] and summary["verdict"] == summary["cpu_verdict"] == "warm faster":
        st.success(f"Resolved at load average {load:.1f}: in each of the {REPEATS} rounds the cold and warm runs ran back "
                   f"to back, and the paired differences have both quartiles above zero: {spreads}.")
    elif not resolved["wall"] and not resolved["cpu"]:
        st.warning(f"Not resolved at load average {load:.1f}: in the {REPEATS} interleaved rounds the paired differences "
                   f"straddle zero ({spreads}), so the medians' difference is within the noise. The prefill tokens "
                   "skipped above are counted, not timed; re-measure on a quieter machine.")
    else:
        st.warning(f"Partly resolved at load average {load:.1f}: wall clock {summary['verdict']}, CPU time "
                   f"{summary['cpu_verdict']} ({spreads}). The wall clock adds the time a run waits for one of this "
                   "host's shared cores; the CPU time counts only the work.")
    label = {"cold": "cold (no cache)", "first": "request 1 (fills)", "warm": "warm"}
    rows = ttft.to_dict("records")
    fig = go.Figure()
    for name, col, colour in (("wall clock (TTFT)", "", "#2563eb"), ("CPU time (same request)", "cpu_", "#f59e0b")):
        pts = [r for r in rows if r[f"{col}median_ms"] == r[f"{col}median_ms"]]    # the fill has no CPU time (NaN)
        fig.add_trace(go.Bar(name=name, x=[r[f"{col}median_ms"] for r in pts], y=[label[r["kind"]] for r in pts],
                             orientation="h", marker_color=colour,
                             error_x=dict(type="data", symmetric=False,
                                          array=[r[f"{col}q3_ms"] - r[f"{col}median_ms"] for r in pts],
                                          arrayminus=[r[f"{col}median_ms"] - r[f"{col}q1_ms"] for r in pts]),
                             text=[f"{r[f'{col}median_ms']:.0f} ms" for r in pts], textposition="inside",
                             insidetextanchor="start"))   # at the base: clear of the IQR whisker
    fig.update_layout(barmode="group", xaxis_title="time to first token (ms; median, bars = IQR)", yaxis_title="run",
                      yaxis_autorange="reversed", legend=dict(orientation="h", y=-0.35), height=320)
    show_chart(fig, rows, key="p00_ttft_chart")
    measured_stamp(timed.conditions)
    st.caption("Wall clock: the engine's TTFT (submit → first token). CPU time: the engine thread's CPU time over the "
               "same one-token request (`time.thread_time`, one torch thread), the work without the time spent waiting "
               "for a core: on a loaded host the wall clock grows with the load, the CPU time much less. Fresh engines "
               f"every round. IQR of the warm TTFT {summary['warm_ttft_iqr_ms']:.1f} ms, of the cold "
               f"{summary['cold_ttft_iqr_ms']:.1f} ms; the raw samples are in the CSV.")
    med = timed.phases_ms
    fig2 = go.Figure([go.Bar(name=p, y=[label[k] for k in med.kind], x=med[f"{p}_ms"], orientation="h")
                      for p in timed.phases])
    fig2.update_layout(barmode="stack", xaxis_title="time to first token, by phase (ms, median per phase)",
                       yaxis_title="run", legend=dict(orientation="h", y=-0.3), height=300)
    show_chart(fig2, med, key="p00_breakdown_chart")
    show_forward_fit(fit, key="p00_fit_chart")
