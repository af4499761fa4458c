"""16 Continuous batching: a trace through the real batched engine; batch composition, state slots, TTFT / TPOT."""

import plotly.graph_objects as go
import streamlit as st

from app_pages.charts import int_tick_step, num, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import measured_stamp, remeasure_button, run_on_request
from app_pages.params import Choice, Int, Toggle
from lab.batching import DEFAULTS, OUTPUT_TOKENS, PROMPT_TOKENS, batching_run, decode_throughput
from lab.peers import recorded_peers
from lab.shipped import missing_note

st.title("Continuous batching")
st.write(
    "Requests arrive at engine steps and share each forward: every step the scheduler puts all decoding requests "
    "first (one token each, padded to a bucket of 1, 2, 4 … 64 rows; a pad row has state slot −1 and is never read "
    "or written), then prefill chunks in what is left of the token budget. Each running request holds one KDA "
    "state slot (pages of the unified pool), so the slots cap the running requests. Afterwards every request is "
    "rerun alone on a fresh engine (one sequence, one slot, the same token budget and speculation): batching must "
    "change the speed, never a token or a logit.")
st.caption(f"The trace: {DEFAULTS['num_requests']} seeded requests, prompts of {PROMPT_TOKENS[0]}–{PROMPT_TOKENS[1]} "
           f"tokens, {OUTPUT_TOKENS[0]}–{OUTPUT_TOKENS[1]} output tokens each, one arrival every 0–2 engine steps. It "
           "is kept small because every request runs twice on this CPU, batched and alone; a request's run alone "
           "depends only on the budget and speculation, so it is reused when the other settings change.")

links = declare(
    Int("p16_seqs", DEFAULTS["max_num_seqs"], 1, 16),
    Choice("p16_budget", DEFAULTS["max_num_batched_tokens"], [64, 128, 256, 512]),
    Int("p16_slots", DEFAULTS["num_state_slots"], 1, 16),
    Toggle("p16_spec", DEFAULTS["speculation"]),
)
c1, c2, c3, c4 = st.columns(4)
seqs = links.slider(c1, "max_num_seqs", "p16_seqs")
budget = links.select_slider(c2, "Token budget per step (tokens)", "p16_budget")
slots = links.slider(c3, "State slots", "p16_slots")
spec = links.toggle(c4, "Speculation", "p16_spec",
                    help="prompt lookup (n-gram) drafts, verified in the batch alongside decode and prefill rows.")


@st.cache_data(show_spinner="Replaying the trace, then every request alone…", max_entries=32, ttl="1h")
def _p16_run(seqs, budget, slots, spec):
    return batching_run(seqs, budget, slots, DEFAULTS["num_requests"], spec)


run = engine_call(_p16_run, seqs, budget, slots, spec)
steps, reqs = run.steps, run.requests
m1, m2, m3 = st.columns(3)
m1.metric("Every request bitwise equal to its batch-1 run", "yes" if run.all_bitwise else "NO")
m2.metric("Steps", f"{len(steps):,}")
m3.metric("Peak running requests", f"{int(steps['running (state slots held)'].max())} of {run.slot_ceiling} slots")
if run.all_bitwise:
    st.success("Every request's tokens and logits are bitwise equal to the same request run alone.")
else:
    st.error("Some request differs from its run alone: " +
             ", ".join(str(r) for r in reqs.loc[~reqs["bitwise equal to alone"], "rid"]))

st.subheader("1 · What each step's forward holds")
fig = go.Figure([go.Bar(x=steps["step"], y=steps["decode rows"], name="decode rows"),
                 go.Bar(x=steps["step"], y=steps["verify rows"], name="verify rows (1 + drafts each)"),
                 go.Bar(x=steps["step"], y=steps["pad rows"], name="pad rows (slot −1)")])
fig.add_trace(go.Scatter(x=steps["step"], y=steps["prefill tokens"], name="prefill tokens", yaxis="y2",
                         mode="lines+markers"))
rows_max = int((steps["decode rows"] + steps["verify rows"] + steps["pad rows"]).max())
fig.update_layout(barmode="stack", xaxis_title="engine step", legend=dict(orientation="h", y=-0.25),
                  yaxis=dict(title="rows in the forward (rows)", rangemode="tozero", tick0=0, dtick=int_tick_step(rows_max)),
                  yaxis2=dict(title="prefill tokens (tokens)", overlaying="y", side="right", rangemode="tozero",
                              tick0=0, dtick=int_tick_step(int(steps["prefill tokens"].max())), showgrid=False))
show_chart(fig, steps, key="p16_composition")

st.subheader("2 · State slots held against the ceiling")
fig = go.Figure([go.Scatter(x=steps["step"], y=steps["running (state slots held)"], name="running (slots held)",
                            mode="lines", line_shape="hv"),
                 go.Scatter(x=steps["step"], y=steps["waiting"], name="waiting", mode="lines", line_shape="hv")])
fig.add_hline(y=run.slot_ceiling, line_dash="dash", annotation_text=f"{run.slot_ceiling} state slots")
fig.update_layout(xaxis_title="engine step", yaxis_title="requests")
show_chart(fig, steps, key="p16_slots_chart")

st.subheader("3 · TTFT and TPOT, measured")
fig = go.Figure([go.Box(y=reqs["TTFT ms"], name="TTFT (ms)", boxpoints="all"),
                 go.Box(y=reqs["TPOT ms"], name="TPOT (ms)", boxpoints="all")])
fig.update_layout(yaxis_title="wall-clock time (ms)", yaxis_type="log")
show_chart(fig, reqs, key="p16_latency")
st.caption(run.stamp)
remeasure_button(_p16_run, key="p16_remeasure")   # the replay is kept an hour for every visitor with these settings

st.subheader("4 · Beside llama.cpp and transformers, recorded")
peers = recorded_peers()
if peers is None:
    st.info(missing_note("peers"))
else:
    st.write("The same checkpoint (`weights/kda-demo`, fp32) in our engine, llama.cpp and transformers on one "
             "machine in one run, recorded by `python -m bench.peers`, not measured now. Tokens/s, median (min–max); "
             "ratios are ours ÷ the peer; the limit is the machine's fp32 matmul rate over the model's FLOPs per "
             "token, each row judged against the engine's goals.")
    st.caption(peers.stamp)
    for caveat in peers.caveats:
        st.warning(caveat)
    against = ["limit (tokens/s)", "ours % of limit", "goals"]   # ten columns overflowed the grid: these beside it
    st.dataframe(peers.table.drop(columns=against), hide_index=True, key="p16_peers")
    show_table(peers.table, {"measure": "Measure", "threads": num("Threads", "%d"), "limit (tokens/s)": "Limit (tokens/s)",
                             "ours % of limit": "Ours, % of the limit", "goals": "Goals on the row"}, wrap=True)
    met = peers.verdicts[peers.verdicts["status"] != "not run"]
    st.caption(f"Goals met in the recorded run: {(met['status'] == 'met').sum()} of {len(met)}.")
    with st.expander("How each engine ran"):
        st.markdown("\n".join(f"- {c}" for c in peers.conditions))

st.subheader("5 · Decode throughput against the batch size, measured")
run_on_request("p16_sweep", "p16_sweep_button", "Measure decode tokens/s at batch 1 … 32",
               "About 10 s: B requests all decoding, 5 interleaved repeats of 4 steps each after a warm-up.")
bar = st.progress(0.0, text="Measuring…")
tp = engine_call(decode_throughput, progress=lambda f: bar.progress(f, text=f"Measuring… {f:.0%}"))
bar.empty()
tab = tp.table
fig = go.Figure(go.Scatter(x=tab["batch"], y=tab["tokens_per_s"], mode="lines+markers", name="median",
                           error_y=dict(type="data", symmetric=False, array=tab["max"] - tab["tokens_per_s"],
                                        arrayminus=tab["tokens_per_s"] - tab["min"])))
fig.update_layout(xaxis_title="decode batch (requests)", yaxis_title="decode throughput (tokens/s; bars = min–max)",
                  xaxis_type="log", yaxis_type="log")   # show_chart spans labelled ticks around every bar's end
show_chart(fig, tab, key="p16_throughput")
measured_stamp(tp.conditions)
st.caption(f"Batch {int(tab['batch'].iloc[-1])} decodes {tab['speedup'].iloc[-1]:.1f}× the tokens/s of batch 1 "
           "(one request on the same engine) in the same run: the per-step fixed cost (Python, weights read once per layer) is shared by the rows.")
