"""04 RawInputRing: cache raw layer inputs instead of states; memory vs recompute, the ring, its overflow."""
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from app_pages.acceptance import acceptance_params, acceptance_section, draft, drafter_params, drafter_selector, label
from app_pages.caching import built_by_loaded_code
from app_pages.charts import int_tick_step, num, pct, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import measured_stamp, remeasure_button, requested
from app_pages.params import Choice, Int
from lab.ring import DEMO, RUN_TOKENS, WIDTHS, commit_timing, is_trained_width, ring_model, ring_view
from lab.timing import MIN_REPEATS

st.title("RawInputRing")
st.write(
    "Instead of a state per draft token, the ring keeps each token's **layer input** (one d-wide vector per KDA "
    "layer) in a fixed number of slots and rebuilds the state when committing: re-project the accepted tokens and "
    "replay the recurrence. It is the smallest buffer and the most recompute. It is not ReplaySSM: ReplaySSM "
    "(pages 01 and 02) stores post-projection per-step records (k, u = β(v − S'ᵀk), g) plus a checkpoint and replays "
    "only the recurrence, never the projections. All numbers are measured now on the demo hybrid "
    f"({DEMO.num_kda_layers} KDA + {DEMO.num_mla_layers} MLA layers) at the chosen width; the commit times on "
    "request.")

links = declare(
    Int("p04_capacity", 16, 1, 32),
    Int("p04_window", 6, 1, 16),   # at most the capacity
    Int("p04_draft", 4, 1, 15),    # a verify of 1 + n fits a window <= 16
    *drafter_params("p04"),
    Choice("p04_width", 128, WIDTHS),
    *acceptance_params("p04"),
)
c1, c2, c3, c4 = st.columns(4)
capacity = links.slider(c2, "Ring capacity (slots)", "p04_capacity")
window = links.slider(c1, "Rollback window (verify tokens, ≤ capacity)", "p04_window", max_value=min(16, capacity),
                      disabled=capacity < 2,
                      help="A 1-slot ring rolls back one verify token at most (the slider stays, disabled, so the "
                           "window it had comes back clamped when the ring grows again).")
num_draft = links.slider(c3, "Draft length n", "p04_draft",
                         help="A verify is 1 + n tokens and the rollback window holds at most 16, so n <= 15.")
d1, _ = st.columns(2)                                                  # a row below the four above
drafter, acceptance = drafter_selector(links, d1)
width = links.select_slider(c4, "Model width d (H = d / 32 heads)", "p04_width")
_model = st.cache_resource(ring_model, validate=built_by_loaded_code, max_entries=4)   # rebuilt after a source reload
st.caption(f"At d = {DEMO.hidden_size} the model is the trained demo model; no trained weights ship at d = "
           f"{' or '.join(str(w) for w in WIDTHS if not is_trained_width(w))}, so those widths run a seeded random "
           "init (bytes and times depend on the shapes, not on the weights).")


@st.cache_data(show_spinner="Measuring bytes and running the ring…", max_entries=16, ttl="1h")
def _view(width: int, capacity: int, window: int, num_draft: int, drafter: str, acceptance: float):
    return ring_view(_model(width), capacity, window, num_draft, drafter, acceptance,
                     draft() if drafter == "draft model" else None)


@st.cache_data(show_spinner=f"Timing commits: {MIN_REPEATS} interleaved repeats after a warm-up…", max_entries=16,
               ttl="1h")
def _p04_timing(width: int, num_draft: int):   # the ring's capacity, window and drafter do not enter a commit time
    return commit_timing(_model(width), num_draft)


COLORS = {"snapshot": "#d62728", "raw-input ring": "#1f77b4", "projection replay": "#2ca02c", "ReplaySSM": "#9467bd"}
# projection replay and ReplaySSM hold the same bytes: ReplaySSM is drawn first, wide and pale, projection replay
# dashed with open diamonds on top of it, so both stay visible where they coincide
DRAW_ORDER = ["snapshot", "raw-input ring", "ReplaySSM", "projection replay"]
LINES = {"ReplaySSM": dict(width=7, color="rgba(148, 103, 189, 0.45)"), "projection replay": dict(dash="dash", width=2)}
MARKERS = {"ReplaySSM": dict(size=11, opacity=0.5), "projection replay": dict(symbol="diamond-open", size=10)}
page = engine_call(_view, width, capacity, window, num_draft, drafter, acceptance)
bdf = pd.DataFrame(page.bytes_rows)
sdf, slots, run = pd.DataFrame(page.run.steps), pd.DataFrame(page.run.slots), page.run
left, right = st.columns(2)
with left:
    st.subheader("1 · Bytes held per verify")
    parts = dict(list(bdf.groupby("strategy", sort=False)))
    fig = go.Figure([go.Scatter(x=parts[name].draft_tokens, y=parts[name].bytes, mode="lines+markers",
                                line=dict(color=COLORS[name]) | LINES.get(name, {}), marker=MARKERS.get(name, {}),
                                name="snapshot (hypothetical per-position)" if name == "snapshot" else name)
                     for name in sorted(parts, key=lambda n: DRAW_ORDER.index(n) if n in DRAW_ORDER else -1)])
    fig.update_layout(xaxis_title="draft length n (verify = 1 + n tokens)", yaxis_title="bytes, all KDA layers (log)",
                      yaxis_type="log", legend=dict(orientation="h", y=-0.3))
    show_chart(fig, bdf, key="p04_bytes_chart")
with right:
    st.subheader("2 · Commit (rebuild) time")
    timing = None
    if requested("p04_timing_on", "p04_measure_button", "Measure commit times",
                 f"Times every strategy's commit for each accepted length 0 … n = {num_draft}: {MIN_REPEATS} "
                 f"interleaved rounds after a warm-up round, each sample on a fresh verify ({4 * (num_draft + 1)} "
                 "samples a round, a fraction of a second of CPU), then keeps them for every visitor at this width "
                 "and n."):
        timing = engine_call(_p04_timing, width, num_draft)
        remeasure_button(_p04_timing, "p04_remeasure")
        cdf = pd.DataFrame(timing.commit_rows)
        fig2 = go.Figure()
        for name, part in cdf.groupby("strategy", sort=False):
            fig2.add_trace(go.Scatter(x=part.accepted, y=part.commit_ms, name=name, mode="lines+markers",
                                      line_color=COLORS.get(name), error_y=dict(
                                          type="data", symmetric=False, array=part.q3_ms - part.commit_ms,
                                          arrayminus=part.commit_ms - part.q1_ms)))
        fig2.update_layout(xaxis_title=f"accepted drafts (of n = {num_draft})", xaxis_dtick=1,
                           yaxis_title="commit ms (median; bars: IQR; 1 thread)", legend=dict(orientation="h", y=-0.3))
        show_chart(fig2, cdf, key="p04_commit_chart")
        measured_stamp(timing.conditions)
        st.caption("Fit t(a) = a₀ + b·a over the medians (a = accepted drafts): " + "; ".join(
            f"{name} a₀ = {f.a_s:.2f} ms, " + (f"b = {1e3 * f.b_s:,.1f} ± {1e3 * f.b_se_s:,.1f} µs/token"
                                                if f.b_measurable else "no measurable per-token cost")
            + (f" (R² {f.r2:.2f})" if f.r2 == f.r2 else "") for name, f in timing.fits.items()) + ".")
        with st.expander("How b is read"):
            st.markdown("b is the least-squares slope, ± its standard error (ms in the fit, shown in µs). When b is "
                        "negative or not larger than its standard error (always with two points: no residual to "
                        "estimate it), the commit time does not measurably grow with the accepted drafts, and the "
                        "caption says so instead of printing a slope that is noise.")

st.subheader("3 · When to use which (measured above)")
refused = run.overflow.startswith("ValueError")   # sections 2 and 3 time rings sized for n; section 4's may not fit it
if timing is None:
    st.caption("Bytes against commit time per strategy, once section 2 has measured the commit times.")
else:
    MEDIAN = "median of the repeats in section 2"
    tdf, ring_fit = pd.DataFrame(timing.tradeoff), timing.fits["raw-input ring"]
    show_table(tdf, {"strategy": "Strategy", "bytes per verify": num("Bytes / verify (B)"),
                     "memory vs snapshot": pct("Memory vs snapshot"),
                     "commit ms (all accepted)": num("Commit, all accepted (ms)", "%.2f", help=MEDIAN),
                     "commit ms (none accepted)": num("Commit, none accepted (ms)", "%.2f", help=MEDIAN),
                     "commit time vs snapshot": num("Commit vs snapshot", "%.1f×", help=MEDIAN)})
    ring_row, snap_row = tdf.set_index("strategy").loc["raw-input ring"], tdf.set_index("strategy").loc["snapshot"]
    st.write(
        (f"(Measured on rings sized for n = {num_draft}, {num_draft + 1} slots: section 4's ring of {capacity} "
         "slot(s) refuses such a verify.) " if refused else "")
        + f"At n = {num_draft} the ring holds {ring_row['memory vs snapshot']:.1%} of the snapshot's bytes but its "
        f"commit takes {ring_row['commit ms (all accepted)']:.2f} ms against {snap_row['commit ms (all accepted)']:.2f} "
        f"ms for a snapshot copy. Of the ring's commit, {ring_fit.a_s:.2f} ms is a fixed per-commit cost (eager torch "
        "calls, "
        + (f"the replay's set-up) and {1e3 * ring_fit.b_s:,.1f} µs is the cost per accepted token (the fit above): at "
           f"this width the per-token re-projection is "
           f"{'the smaller' if ring_fit.b_s * num_draft < ring_fit.a_s else 'the larger'} part of a commit of all "
           f"n = {num_draft} drafts." if ring_fit.b_measurable else
           "the replay's set-up); the fit above finds no measurable cost per accepted token at this width.")
        + " Snapshot wins when memory is free and commits must be "
        "instant; projection replay keeps the kernel inputs and replays only the recurrence; the ring fits the most "
        "requests (or the longest windows) per byte — worth it when memory bandwidth, not FLOPs, limits decode.")

st.subheader(f"4 · The ring after a {RUN_TOKENS}-token run")
used = min(num_draft, window - 1)
capped = f" (n = {num_draft} capped at window − 1 = {window - 1})" if used < num_draft else ""
accepted = sum(r["accepted"] for r in run.steps)
st.write(f"{capacity} slot{'' if capacity == 1 else 's'} × {DEMO.num_kda_layers} KDA layers × d = {width} × "
         f"{run.ring_bytes // (capacity * DEMO.num_kda_layers * width)} B = **{run.ring_bytes:,} B**; "
         f"drafts of up to {used} tokens{capped} from the {label(drafter, acceptance)} drafter "
         f"({accepted} accepted over {len(run.steps)} verifies); "
         f"**{run.num_write_backs} forced write-back{'' if run.num_write_backs == 1 else 's'}** during the run, "
         "the red crosses below "
         "(ring full: the committed state becomes the new checkpoint and the history slots are freed).")
fig3 = go.Figure(go.Bar(x=slots.slot, y=[1] * len(slots), marker_color=slots.status.map(
    {"free": "#e0e0e0", "committed": "#1f77b4", "pending": "#ff7f0e"}), text=slots.counter.where(slots.counter >= 0, ""),
    textposition="inside", name="slots", customdata=slots[["status", "position"]],
    hovertemplate="slot %{x}: %{customdata[0]}, ring counter %{text}, token position %{customdata[1]}<extra></extra>"))
for text, at_slot, rise_px in page.labels:
    fig3.add_annotation(x=at_slot, y=1.02, text=text, showarrow=True, arrowhead=2, ay=-rise_px)
fig3.update_layout(xaxis_title="slot index = ring counter mod capacity (colour: blue committed, grey free; text: the "
                               "ring counter; hover: the token's position in the sequence)",
                   yaxis_title="ring slots", yaxis_range=[0, 1.8], yaxis_showticklabels=False, height=280,
                   xaxis_dtick=1 if capacity <= 32 else None)
show_chart(fig3, slots, key="p04_slots_chart")
fig4 = go.Figure(go.Scatter(x=sdf.step, y=sdf.slots_in_use, mode="lines+markers", name="slots in use after commit"))
wb = sdf[sdf.forced_write_back]
fig4.add_trace(go.Scatter(x=wb.step, y=wb.slots_in_use, mode="markers", marker=dict(symbol="x", size=12, color="red"),
                          name="forced write-back before this verify"))
fig4.add_hline(y=capacity, line_dash="dot", annotation_text="capacity")
fig4.update_layout(xaxis_title="speculative step", yaxis_title="ring slots in use (tokens)", yaxis_rangemode="tozero",
                   yaxis_tickformat="d", yaxis_dtick=max(1, capacity // 4),   # whole slots: no repeated rounded ticks
                   xaxis=dict(tick0=0, dtick=int_tick_step(int(sdf.step.max()))),   # whole steps (two read 0, 0.2 …)
                   legend=dict(orientation="h", y=-0.3))
show_chart(fig4, sdf, key="p04_occupancy_chart")
if refused:
    st.warning(f"Overflow — a verify of n = {num_draft} drafts is refused by the ring: "
               f"{run.overflow.removeprefix('ValueError: ')}")
else:
    st.info(f"Overflow check — a verify of n = {num_draft} drafts {run.overflow}.")
st.write(
    "**What to notice.** Slot index = token counter mod capacity, so history wraps around (head: the oldest slot "
    "kept since the last write-back; tail: the next slot to write); a slot is reused only "
    "after a write-back has folded it into the checkpoint — never silently. A draft longer than the window is "
    "refused with a ValueError. Bytes: snapshot H·K·V·s + (2HK+HV)(W−1)·s, projections H·(2K+V+1)·s + (2HK+HV)·s, "
    "raw inputs d·s per token per KDA layer. The checkpoint-plus-ring layout follows ReplaySSM (vLLM RFC #46187), "
    "but the ring here caches layer inputs, not ReplaySSM's post-projection records; the ring itself is `serve/spec_decode/raw_input_ring.py`.")

acceptance_section(links, drafter, acceptance, num_draft, "5 · Acceptance per draft position: held-out code vs prose")
