"""08 Prefix hit: measured TTFT cold vs warm for requests sharing a prefix, tokens skipped, bytes reused by kind."""
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from app_pages.charts import show_chart, show_forward_fit
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import measured_stamp, remeasure_button, run_on_request
from app_pages.params import Choice, Int
from lab.prefix import WARM_TOLERANCE, paired_spread, prefix_hit, prefix_hit_timing

st.title("Prefix hit")
st.write(
    "Two requests share a prefix and differ in their tails. The second one runs **cold** (a cache-off engine) and "
    "**warm** (after the first request filled the cache) on the demo model: once to compare outputs, then, on "
    "request, timed over interleaved repeats on fresh engines; TTFT is measured by the engine from submit to first "
    "token. A hit restores the KDA state from a checkpoint and "
    "shares the MLA KV blocks, so only the tokens after the hit boundary b are prefilled.")

REPEATS = 5
links = declare(
    Int("p08_shared", 128, 0, 512, step=32),
    Int("p08_unique", 16, 16, 256, step=16),
    Int("p08_new", 4, 1, 8),
    Choice("p08_block", 16, [8, 16, 32]),
    Choice("p08_interval", 64, [32, 64, 128, 256]),
    Int("p08_groups", 1, 1, 3),
)
c1, c2, c3 = st.columns(3)
shared = links.slider(c1, "Shared prefix (tokens)", "p08_shared")
unique = links.slider(c2, "Unique tail (tokens)", "p08_unique")
new_tokens = links.slider(c3, "Tokens to generate", "p08_new")
d1, d2, d3 = st.columns(3)
block = links.select_slider(d1, "Block size N (tokens)", "p08_block")
interval = links.select_slider(d2, "Checkpoint interval C (tokens)", "p08_interval")
groups = links.slider(d3, "KDA groups G", "p08_groups")
_p08_verdict = st.cache_data(prefix_hit, show_spinner="Running the cold and warm requests…", max_entries=32, ttl="1h")


@st.cache_data(show_spinner=f"Timing cold and warm runs: {REPEATS} interleaved repeats after a warm-up…",
               max_entries=32, ttl="1h")
def _p08_timing(shared, unique, new_tokens, block, interval, groups):
    return prefix_hit_timing(shared, unique, new_tokens, block, interval, groups, repeats=REPEATS)


run = engine_call(_p08_verdict, shared, unique, new_tokens, block, interval, groups)
check, warm = run.check, pd.Series(run.warm)
m1, m2, m3, m4 = st.columns([2, 1, 1, 1])   # the headline's delta: "cold − warm … (paired IQR … to … ms)"
reduction = m1.empty()
reduction.metric("TTFT reduction (median)", "no hit" if not warm.hit_tokens else "on request",  # b = 0: nothing skipped
                 "hit b = 0: nothing skipped" if not warm.hit_tokens else "measured in section 1",
                 delta_color="off", delta_arrow="off")
m2.metric("Prefill tokens skipped", f"{warm.hit_tokens:,} of {warm.prompt_tokens:,}")
m3.metric("Warm vs cache-off output", ("bitwise" if check.bitwise else "NO" if check.verdict == "different" else f"within {WARM_TOLERANCE:.0e}".replace("e-0", "e-")),
          f"max |Δ logits| {check.max_logit_diff:.1e}", delta_color="off", delta_arrow="off")
m4.metric("KV run (phase 1)", f"{warm.kv_hit_tokens:,} tokens", f"hit b = {warm.hit_tokens}", delta_color="off", delta_arrow="off")
st.caption(f"Warm output {check.verdict}: {check.reason}.")
timing_part = st.container()   # filled last: section 2 shows while the repeats run

st.subheader("2 · What the hit reused, by kind")
reuse = pd.DataFrame([
    dict(kind="MLA KV pages (shared by reference)", bytes=warm.shared_kv_bytes),
    dict(kind="KDA state (copied from the checkpoint)", bytes=warm.restored_bytes),
])
if reuse.bytes.any():
    fig2 = go.Figure(go.Bar(x=reuse.kind, y=reuse.bytes / 1024, text=[f"{b / 1024:,.1f} KiB" for b in reuse.bytes]))
    fig2.update_layout(yaxis_title="bytes reused (KiB)", xaxis_title="cache kind")
    show_chart(fig2, reuse, key="p08_bytes_chart")
else:   # shared prefix under one block: no KV page and no checkpoint to reuse, so no chart of zeros
    st.info(f"No whole {block}-token block shared (shared prefix {shared} tokens): nothing reused, 0 bytes of "
            "either kind.")
st.caption("What to notice: the KV bytes shared grow with b (one page per block); the state copied is the same for "
           "any b. Warm TTFT ≈ a fixed cost per forward + a cost per token × (L − b) + the restore and checkpoint "
           "copies (both costs fitted in section 1), not TTFT_cold · (L − b) / L, which leaves the fixed cost out.")
with st.expander("Why warm TTFT is a fixed cost plus (L − b) tokens"):
    st.markdown(
        "The remaining prompt runs as one chunked forward, and every checkpoint boundary inside it is taken from that "
        "same forward (the chunk states of `kda_chunk` are the state after exactly b tokens), so a smaller C adds "
        f"state copies, not forward calls. A boundary on the {run.chunk_size}-token chunk grid is a chunk edge; one "
        "off the grid costs one short extra chunk per KDA layer. A larger C gives coarser hits. Measured on this CPU, "
        "single thread.")

with timing_part:
    st.subheader(f"1 · TTFT, cold vs warm (median of {REPEATS} interleaved repeats)")
    run_on_request("p08_timing_on", "p08_measure_button", "Measure TTFT cold vs warm",
                   f"Times the cold run, the (request 1, warm) pair and two shorter cache-off prefills for the fixed + "
                   f"per-token cost fit, {REPEATS} interleaved repeats after a warm-up on fresh engines (30 engine runs, "
                   "about a second of CPU at the defaults), then keeps the result for every visitor with these settings.")
    remeasure_button(_p08_timing, key="p08_remeasure")
    timed = engine_call(_p08_timing, shared, unique, new_tokens, block, interval, groups)
    summary, ttft = timed.summary, timed.ttft
    resolved = summary["verdict"] != "not resolved"   # paired cold − warm quartiles clear of zero (lab.prefix)
    reduction.metric("TTFT reduction (median)", "no hit" if not warm.hit_tokens else   # b = 0: nothing skipped
                     f"{summary['ttft_reduction']:.0%}" if resolved else "not resolved",
                     paired_spread(summary), delta_color="off", delta_arrow="off",
                     help="Stated only when the paired differences cold − warm of the rounds (each round runs both, so "
                          "a slow moment of the machine hits both) have their first and third quartiles on the same "
                          "side of zero; otherwise not resolved at this load.")
    if warm.hit_tokens and not resolved:
        st.warning(f"Not resolved at this load: in the {REPEATS} interleaved rounds, {paired_spread(summary)} "
                   "straddles zero, so the medians' difference is within the noise; re-measure on a quieter machine.")
    label = {"cold": "cold (no cache)", "first": "request 1 (fills the cache)", "warm": "warm (after request 1)"}
    fig = go.Figure(go.Bar(x=[label[k] for k in ttft.kind], y=ttft.median_ms,
                           error_y=dict(type="data", symmetric=False, array=ttft.q3_ms - ttft.median_ms,
                                        arrayminus=ttft.median_ms - ttft.q1_ms),
                           text=[f"{m:.1f} ms" for m in ttft.median_ms], textposition="inside",
                           insidetextanchor="start"))   # at the base: clear of the IQR whisker
    fig.update_layout(yaxis_title="TTFT, engine-measured (ms; median, bars = IQR)", xaxis_title="run")
    show_chart(fig, ttft, key="p08_ttft_chart")
    measured_stamp(timed.conditions)
    st.caption("Fresh engines every repeat; in each round the cold run and the (request 1, warm) pair run in "
               "rotating order. The samples are the engine's own TTFT (submit → first token), so engine set-up "
               f"is not counted. Median TTFT cold {summary['cold_ttft_ms']:.1f} → warm {summary['warm_ttft_ms']:.1f} ms; "
               f"IQR cold {summary['cold_ttft_iqr_ms']:.1f} ms, warm {summary['warm_ttft_iqr_ms']:.1f} ms; the raw samples "
               "are in the CSV.")
    extra = timed.cache_on_extra_ms("first")
    no_hit = (f" No hit: warm pays the same for nothing (warm − cold {timed.cache_on_extra_ms('warm')['ttft']:+.1f} ms)."
              if not warm.hit_tokens else "")
    st.caption(f"Request 1 − cold, the same {warm.prompt_tokens:,} tokens: {extra['ttft']:+.1f} ms (medians): the "
               f"cache-on engine also hashes and looks up the prompt's blocks ({extra['lookup']:+.2f} ms) and copies "
               f"{extra['checkpoints']:.0f} KDA state checkpoint(s) out ({extra['checkpoint']:+.2f} ms)." + no_hit)
    with st.expander("What else differs between request 1 and the cold run"):
        st.markdown(f"The prefill phase differs by {extra['prefill']:+.2f} ms (medians). The forward is the same, "
                    "except that the cache-on one also returns the chunk states at the checkpoint boundaries inside "
                    "the prompt; a gap beyond that is not extra work we can name. Phases are the engine's own "
                    "timings (lookup, queue, admit, restore, prefill, checkpoint) of the same runs as the TTFT.")
    st.write("**Fixed vs per-token cost of a forward**: fitted to cache-off runs of shorter prompts, checked on the "
             "cold run (not in the fit), then used to predict the warm run.")
    show_forward_fit(timed.fit, key="p08_fit_chart")
