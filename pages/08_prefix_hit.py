"""08 Prefix hit: measured TTFT cold vs warm for requests sharing a prefix, tokens skipped, bytes reused by kind."""
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from lab.prefix import prefix_hit
from pages._common import engine_call, persist, show_chart

st.title("Prefix hit")
st.write(
    "Two requests share a prefix and differ in their tails. The second one runs **cold** (a cache-off engine) and "
    "**warm** (after the first request filled the cache) on the demo model, three times each on fresh engines; "
    "TTFT is measured by the engine from submit to first token. A hit restores the KDA state from a checkpoint and "
    "shares the MLA KV blocks, so only the tokens after the hit boundary b are prefilled.")

c1, c2, c3 = st.columns(3)
shared = c1.slider("Shared prefix (tokens)", 0, 512, step=32, key=persist("p08_shared", 384, min_value=0, max_value=512), persist_state="session")
unique = c2.slider("Unique tail (tokens)", 16, 256, step=16, key=persist("p08_unique", 64, min_value=16, max_value=256), persist_state="session")
new_tokens = c3.slider("Tokens to generate", 1, 8, key=persist("p08_new", 4, min_value=1, max_value=8), persist_state="session")
d1, d2, d3 = st.columns(3)
block = d1.select_slider("Block size N (tokens)", [8, 16, 32], key=persist("p08_block", 16, options=[8, 16, 32]), persist_state="session")
interval = d2.select_slider("Checkpoint interval C (tokens)", [32, 64, 128, 256], key=persist("p08_interval", 64, options=[32, 64, 128, 256]), persist_state="session")
groups = d3.slider("KDA groups G", 1, 3, key=persist("p08_groups", 1, min_value=1, max_value=3), persist_state="session")


@st.cache_data(show_spinner="Measuring cold and warm runs…", max_entries=32, ttl="1h")
def _measure(shared, unique, new_tokens, block, interval, groups):
    return prefix_hit(shared, unique, new_tokens, block, interval, groups, repeats=3)


run = engine_call(_measure, shared, unique, new_tokens, block, interval, groups)
rows, check, summary, warm = run.rows, run.check, run.summary, pd.Series(run.warm)
m1, m2, m3, m4 = st.columns(4)
m1.metric("TTFT reduction (median)", f"{summary['ttft_reduction']:.0%}",
          f"{summary['cold_ttft_ms']:.1f} → {summary['warm_ttft_ms']:.1f} ms", delta_color="off")
m2.metric("Prefill tokens skipped", f"{warm.hit_tokens:,} of {warm.prompt_tokens:,}")
m3.metric("Warm vs cache-off output", ("bitwise" if check.bitwise else "NO" if check.verdict == "different" else "within 1e-5"),
          f"max |Δ logits| {check.max_logit_diff:.1e}", delta_color="off")
m4.metric("KV run (phase 1)", f"{warm.kv_hit_tokens:,} tokens", f"hit b = {warm.hit_tokens}", delta_color="off")
st.caption(f"Warm output {check.verdict}: {check.reason}.")

st.subheader("1 · TTFT, cold vs warm (3 repeats each)")
label = {"cold": "cold (no cache)", "first": "request 1 (fills the cache)", "warm": "warm (after request 1)"}
fig = go.Figure([go.Box(y=rows[rows.kind == k].ttft_ms, name=label[k], boxpoints="all") for k in label])
fig.update_layout(yaxis_title="time to first token (ms)", xaxis_title="run", showlegend=False)
show_chart(fig, rows, key="p08_ttft_chart")

st.subheader("2 · What the hit reused, by kind")
reuse = pd.DataFrame([
    dict(kind="MLA KV pages (shared by reference)", bytes=warm.shared_kv_bytes),
    dict(kind="KDA state (copied from the checkpoint)", bytes=warm.restored_bytes),
])
fig2 = go.Figure(go.Bar(x=reuse.kind, y=reuse.bytes / 1024, text=[f"{b / 1024:,.1f} KiB" for b in reuse.bytes]))
fig2.update_layout(yaxis_title="bytes reused (KiB)", xaxis_title="cache kind")
show_chart(fig2, reuse, key="p08_bytes_chart")
st.caption("What to notice: the KV bytes shared grow with b (one page per block), the state copied is the same "
           "for any b. Warm TTFT ≈ TTFT_cold · (L − b) / L plus the restore and checkpoint copies: the remaining "
           "prompt runs as one chunked forward, and every checkpoint boundary inside it is taken from that same "
           "forward (the chunk states of `kda_chunk` are the state after exactly b tokens), so a smaller C adds "
           "state copies, not forward calls. A boundary on the "
           f"{run.chunk_size}-token chunk grid is a chunk edge; one off the grid costs one short extra chunk per KDA layer. A larger C gives coarser hits. "
           "Measured on this CPU, single thread.")
