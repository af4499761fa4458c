"""09 Prefix miss: what a miss costs and leaves behind, then a trace through capacity-limited caches."""
import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from app_pages.caching import upload_parts
from app_pages.charts import pct, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import run_on_request
from app_pages.params import Choice, Int
from lab.fleet import synthetic_trace_description
from lab.prefix_miss import CAPACITY_FRACTIONS, MODELS, prefix_miss, preset_title

st.title("Prefix miss")
st.write(
    "A miss prefills the whole prompt, and on the way writes checkpoints — each boundary atomically for every KDA "
    "group — that the next request can hit. Part 1 runs that on the demo engine. Part 2 replays a trace (synthetic "
    "by default, or your Mooncake JSONL) through capacity-limited caches sized with a real preset's bytes: one hash "
    "id = one 512-token KV block, a checkpoint = the whole KDA state of a group.")

links = declare(
    Int("p09_prompt", 256, 64, 512, step=32),
    Int("p09_next", 200, 0, 512, step=16),
    Choice("p09_block", 16, [8, 16, 32]),
    Choice("p09_interval", 64, [32, 64, 128]),
    Int("p09_groups", 2, 1, 3),
    Choice("p09_preset", MODELS[0], MODELS, format_func=preset_title),
    Choice("p09_every", 1, [1, 2, 4, 8]),
    Int("p09_tgroups", 1, 1, 4),
    Int("p09_requests", 1500, 500, 3000, step=250),
)

st.subheader("1 · A miss, what it writes, and the next request's hit")
c1, c2, c3, c4, c5 = st.columns(5)
prompt_tokens = links.slider(c1, "Prompt (tokens)", "p09_prompt")
next_shared = links.slider(c2, "Next request shares (tokens)", "p09_next")
block = links.select_slider(c3, "Block size N", "p09_block")
interval = links.select_slider(c4, "Interval C (tokens)", "p09_interval")
groups = links.slider(c5, "KDA groups G", "p09_groups")
part1, part2 = st.container(), st.container()
part2.subheader("2 · A trace through capacity-limited caches")
d1, d2, d3, d4 = part2.columns(4)
preset = links.selectbox(d1, "Byte sizes of", "p09_preset")
every = links.select_slider(d2, "Checkpoint interval (blocks)", "p09_every",
                            help="A checkpoint every this many of the trace's 512-token blocks: 1 = at every block "
                                 "boundary (C = 512 tokens), 8 = every 4,096 tokens.")
tgroups = links.slider(d3, "Groups G", "p09_tgroups")
num_requests = links.slider(d4, "Requests (cap)", "p09_requests")
data, upload_name = upload_parts(part2.file_uploader("Mooncake trace (JSONL, optional)", type=["jsonl", "json"], key="p09_upload"))


replay_on = bool(st.session_state.get("p09_replay_on"))   # 16 trace replays: on request, not on every first visit


@st.cache_data(show_spinner=False, max_entries=16, ttl="1h")
def _run(prompt_tokens, next_shared, block, interval, groups, preset, every, tgroups, num_requests, data, upload_name,
         replay):
    bar = st.progress(0.0, text="Running the miss and the next request…")  # made here: replayed on a cache hit
    run = prefix_miss(prompt_tokens, next_shared, block, interval, groups, preset, every, tgroups, num_requests, data,
                      upload_name, progress=lambda done, total: bar.progress(done / total,
                                                                             text=f"Replaying the trace… {done}/{total} runs"),
                      replay=replay)
    bar.empty()
    return run


run = engine_call(_run, prompt_tokens, next_shared, block, interval, groups, preset, every, tgroups, num_requests,
                  data, upload_name, replay_on)
written = run.written
with part1:
    m1, m2, m3, m4 = st.columns(4)
    m1.metric("Miss: prefill tokens", f"{run.miss['prefill_tokens']:,}",
              f"of {run.miss['prompt_tokens']:,}: the whole prompt", delta_color="off", delta_arrow="off",
              help="Counted by the engine. This part runs each request once, so it shows no time: Home and page 08 "
                   "time TTFT over interleaved repeats, with its spread.")
    m2.metric("Checkpoints (boundaries × groups)", f"{written.boundary.nunique()} × {groups}",
              f"{run.miss['checkpoints_written']} boundaries published atomically", delta_color="off", delta_arrow="off")
    m3.metric("Next request: hit b", f"{run.hit['hit_tokens']} tokens", f"KV run {run.hit['kv_hit_tokens']}", delta_color="off", delta_arrow="off")
    m4.metric("Next output identical", "yes" if run.check.outputs_identical else "NO",
              f"max |Δ logits| {run.check.max_logit_diff:.1e}", delta_color="off", delta_arrow="off")
    fig = go.Figure(go.Scatter(x=written.boundary, y=written.group, mode="markers", marker_symbol="diamond",
                               marker_size=12, name="checkpoint (written at = boundary)", text=written.written_at))
    lines = ((run.next_shared, "next request shares", "top right"), (run.hit["hit_tokens"], "its hit b =", "top left"))
    if run.next_shared == run.hit["hit_tokens"]:      # one line, one label (two labels at one x sat on each other)
        lines = ((run.next_shared, "next request shares = its hit b =", "top right"),)
    for x, name, pos in lines:                         # labels above the plot: no marker hidden
        fig.add_vline(x=x, line_dash="dot", annotation_text=f"{name} {x}", annotation_position=pos,
                      annotation_yanchor="bottom")
    fig.update_layout(xaxis_title="boundary (tokens)", yaxis_title="KDA group",
                      yaxis=dict(tickvals=list(range(groups)), range=[-0.6, groups - 0.4]),   # groups only, no -1
                      xaxis_range=[-0.02 * (prompt_tokens + 8), prompt_tokens + 8],   # a line at 0 off the edge
                      height=160 + 40 * groups, margin=dict(t=40, b=10))
    show_chart(fig, written, key="p09_written_chart")

if run.capacity is None:
    run_on_request("p09_replay_on", "p09_replay_button", "Replay the trace", "Replays the trace through 16 cache "
                   "configurations: several seconds of CPU the first time, cached afterwards (shared by every visitor).",
                   part2)
with part2:
    if run.note:
        part2.info(run.note)
    cap, tr_free, tr_cap, ideal = run.capacity, run.free, run.limited, run.ideal
    n = run.num_requests
    fig2 = go.Figure()
    for unit, name, colour in (("block", "block hit ratio (hash ids)", "#08519c"),
                               ("token", "token hit ratio (engine rules)", "#4eb3d3")):
        fig2.add_trace(go.Scatter(x=cap.capacity_gb, y=cap[f"{unit}_hit_ratio"], mode="lines+markers", name=name,
                                  line_color=colour))
        level = getattr(ideal, f"{unit}_hit_ratio")
        fig2.add_trace(go.Scatter(x=[cap.capacity_gb.min(), cap.capacity_gb.max()], y=[level, level], mode="lines",
                                  line=dict(color=colour, dash="dash"), name=f"ideal {unit} ratio, infinite cache: {level:.3f}"))
    fig2.update_layout(xaxis_type="log", xaxis_title="cache capacity (GB, log)", yaxis_title="hit ratio (fraction)",
                       legend=dict(orientation="h", y=-0.3))
    show_chart(fig2, cap.assign(ideal_block_hit_ratio=ideal.block_hit_ratio, ideal_token_hit_ratio=ideal.token_hit_ratio),
               key="p09_capacity_chart")
    trace_name = upload_name if data is not None else "synthetic generator (default)"
    st.caption(f"Capacities: {', '.join(f'{f:g}' for f in CAPACITY_FRACTIONS)} × the bytes (KV + checkpoints) the "
               f"unlimited cache peaked at on this trace, so the sweep runs from a cache that holds almost nothing "
               "to one that never evicts, whatever the trace and preset.")
    if data is None:
        with st.expander("How the synthetic trace is generated"):
            st.markdown(synthetic_trace_description(n) + " Seed 0.")
    show_table(pd.DataFrame([
        {"figure": "Mooncake FAST'25, Table 2 “cache ratio”", "trace": f"{t} trace (kvcache-ai/Mooncake)",
         "ratio": r, "what it counts": "not defined in the paper"} for t, r in run.paper_ratios.items()] + [
        {"figure": "block ideal, computed now", "trace": trace_name, "ratio": ideal.block_hit_ratio,
         "what it counts": f"leading-run hash ids seen before / all ({ideal.hit_blocks:,} / "
                           f"{ideal.total_blocks:,})"},
        {"figure": "token ideal, computed now", "trace": trace_name, "ratio": ideal.token_hit_ratio,
         "what it counts": f"their tokens / all ({ideal.hit_tokens:,} / {ideal.total_tokens:,})"}]),
        {"figure": "Figure", "trace": "Trace", "ratio": pct("Ratio"), "what it counts": "What it counts"})
    st.caption("The paper's cache ratio and our block ideal are different counts: upload the paper's "
               "`conversation_trace.jsonl` or `synthetic_trace.jsonl` (kvcache-ai/Mooncake, `FAST25-release/traces`) "
               "to compute the block ideal of the same file; `tests/serve/traces/test_mooncake_ratios.py` does it for both.")
    causes = go.Figure([go.Bar(x=[f"{c:,.0f} GB" for c in cap.capacity_gb], y=cap[f"miss_{k}"], name=k.replace("_", " "))
                        for k in run.miss_causes])
    causes.update_layout(barmode="stack", xaxis_title="cache capacity", yaxis_title="missed tokens (fraction of all tokens)",
                         legend=dict(orientation="h", y=-0.3))
    show_chart(causes, cap[["capacity_gb"] + [f"miss_{k}" for k in run.miss_causes]], key="p09_causes_chart")

    trade = make_subplots(specs=[[{"secondary_y": True}]])
    labels = [f"{c:,}" for c in run.intervals]
    trade.add_trace(go.Bar(x=labels, y=tr_free.peak_state_gb, name="checkpoint state held, unlimited (GB)",
                           opacity=0.5), secondary_y=False)
    trade.add_trace(go.Scatter(x=labels, y=tr_free.token_hit_ratio, mode="lines+markers",
                               name="token hit, unlimited"), secondary_y=True)
    trade.add_trace(go.Scatter(x=labels, y=tr_cap.token_hit_ratio, mode="lines+markers",
                               name=f"token hit at {tr_cap.capacity_gb.iloc[0]:,.0f} GB"), secondary_y=True)
    trade.update_xaxes(type="category", title_text="checkpoint interval C (tokens)")
    trade.update_yaxes(title_text="state held (GB)", tickformat=",", secondary_y=False)   # 16,000 GB, not "16k"
    trade.update_yaxes(title_text="token hit ratio (fraction)", secondary_y=True, showgrid=False, tickmode="auto", tickformat=".2f",
                       range=[0, 1.1 * max(tr_free.token_hit_ratio.max(), tr_cap.token_hit_ratio.max())])
    trade.update_layout(legend=dict(orientation="h", y=-0.3))
    show_chart(trade, pd.concat([tr_free.assign(cache="unlimited"), tr_cap.assign(cache="limited")]), key="p09_interval_chart")
    st.caption(f"{n:,} requests. What to notice: a {preset_title(preset)} checkpoint costs far more than a KV block, so at a fixed "
               "capacity a larger C holds more blocks and can hit more, while unlimited it only loses the interior "
               "boundaries.")
    with st.expander("Miss causes and the two ideals"):
        st.markdown(
            "- **Causes**: no KV block = never seen; evicted = seen, no longer cached; KV but no complete checkpoint; "
            "below one block = partial tail and the len − 1 cap.\n"
            "- **Ideals**: an unlimited cache hits every request's leading run of hash ids seen before. Block ideal = "
            "those ids / all ids (Mooncake, FAST'25); token ideal = their tokens (the last id's partial block counted "
            "at its length) / all tokens. They differ because a partial last block counts as one id but fewer "
            "tokens; the engine's token ratio stays a little below its ideal because it never hits the partial "
            "block or the last token.")
