"""07 Prefix cache anatomy: blocks, chained keys and each group's checkpoints; the two-phase lookup step by step."""
import plotly.graph_objects as go
import streamlit as st

from app_pages.charts import num, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.params import Choice, Int, Text, Toggle
from lab.prefix_anatomy import (
    MAX_INTERVALS,
    MAX_PROMPTS,
    MAX_TEXT_BYTES,
    MAX_TEXT_CHARS,
    anatomy_view,
    prompt_intervals,
)

st.title("Prefix cache anatomy")
st.write(
    "Each line below is a prompt (bytes are tokens). All but the last run through the engine and fill the cache: "
    "one KV block per N tokens, keyed by a **chained** SHA-256 of (previous key, block tokens), and checkpoints of "
    "each KDA group's state at block boundaries (every C tokens, the replay boundary ⌊(L−1)/N⌋·N and the end of "
    "the prompt). The last prompt is then looked up in two phases: walk KV blocks left to right, then fall back "
    "right to left to the deepest boundary where **every** group has a checkpoint.")

DEFAULT = ("System: you are a terse assistant for inference engineers; always give units.\n"
           "System: you are a terse assistant for inference engineers; always give units. User: size of a KV block?\n"
           "System: you are a terse assistant for inference engineers; always give units. User: size of a KDA state?")
MAX_GROUPS = 4
MARKER_ROW, MARKER_STEP = 0.3, 0.15   # checkpoint markers above a prompt's bar (rows), one row per group
links = declare(
    Text("p07_prompts", DEFAULT, max_chars=MAX_TEXT_CHARS),
    Choice("p07_block", 16, [4, 8, 16, 32]),
    Choice("p07_every", 2, [1, 2, 4]),
    Int("p07_groups", 2, 1, MAX_GROUPS),
    Toggle("p07_drop", False),
    Choice("p07_drop_at", 0, range(MAX_TEXT_BYTES + 1)),   # a checkpoint boundary: tokens of the previous prompt
    Choice("p07_drop_group", 0, range(MAX_GROUPS)),        # a group below G
)
text = links.text_area(st, "Prompts, one per line (the last one is looked up)", "p07_prompts", height=110)
c1, c2, c3 = st.columns(3)
block = links.select_slider(c1, "Block size N (tokens)", "p07_block")
every = links.select_slider(c2, "Checkpoint every C / N blocks", "p07_every")
groups = links.slider(c3, "KDA groups G", "p07_groups")
lines = text.splitlines()
prompts = [line for line in lines if line.strip()]
st.caption(f"At most {MAX_PROMPTS} prompts, {MAX_TEXT_BYTES:,} bytes and {MAX_INTERVALS} checkpoint intervals in all "
           "(bytes are tokens; in UTF-8 an accent takes 2 bytes, an emoji 4; intervals: the sum of ⌈tokens / C⌉): the "
           "engine prefills each earlier prompt up to every checkpoint boundary, and the caps bound the wait and the "
           f"memory. These prompts are {sum(len(p.encode()) for p in prompts):,} bytes and "
           f"{prompt_intervals(prompts, block * every)} intervals at C = {block * every}.")
if len(prompts) < 2:
    st.info(f"Type at least two prompts, one per line: the earlier ones fill the cache and the last one is looked "
            f"up. Blank lines are ignored; there {'is' if len(prompts) == 1 else 'are'} {len(prompts)} non-blank "
            f"line{'' if len(prompts) == 1 else 's'} now.")
    st.stop()
if len(prompts) < len(lines):
    st.caption(f"{len(lines) - len(prompts)} blank line(s) ignored: {len(prompts)} prompts.")
_anatomy = st.cache_data(anatomy_view, show_spinner="Filling the cache…", max_entries=32, ttl="1h")
base = engine_call(_anatomy, prompts, block, block * every, groups, None)  # the what-if below reruns it with a drop
options = base.droppable
drop = None
d1, d2, d3 = st.columns(3)
if options and links.checkbox(d1, "What if: drop one group's checkpoint", "p07_drop"):
    hit_at = max((b for b in options if b <= base.num_tokens), default=options[-1])   # the one the lookup stops at
    boundary = links.selectbox(d2, "at boundary (tokens of the previous prompt)", "p07_drop_at", options=options,
                               default=hit_at)
    drop = (boundary, links.selectbox(d3, "group", "p07_drop_group", options=range(groups)))
res = engine_call(_anatomy, prompts, block, block * every, groups, drop) if drop else base

st.subheader("1 · Blocks and checkpoints along the token axis")
blocks, tails, pts = res.blocks, res.tails, res.checkpoints
if blocks.empty:
    st.info(f"Every prompt is shorter than one block (N = {block} tokens; the longest has "
            f"{max(res.prompt_tokens)} token{'' if max(res.prompt_tokens) == 1 else 's'}): the cache keys whole blocks only, so nothing is cached and the "
            "hit is 0. Lower N or lengthen the prompts.")
fig = go.Figure()
for cached, colour in ((True, "#4292c6"), (False, "#d9d9d9")):
    part = blocks[blocks.cached == cached]
    fig.add_trace(go.Bar(x=[block] * len(part), base=part.start, y=part.prompt, orientation="h", width=0.35,
                         marker_color=colour, name="KV block cached" if cached else "block not cached",
                         text=part.key, customdata=part.end, textposition="inside",   # hidden where too narrow
                         hovertemplate="prompt %{y} · tokens %{base}–%{customdata} · key %{text}<extra></extra>"))
if len(tails):
    fig.add_trace(go.Bar(x=tails.tokens, base=tails.start, y=tails.prompt, orientation="h", width=0.35,
                         marker=dict(color="#f0f0f0", line=dict(color="#969696", width=1),
                                     pattern=dict(shape="/", fgcolor="#969696")),
                         name="partial block (never cached)",
                         hovertemplate="prompt %{y} · partial block from token %{base}, %{x} tokens<extra></extra>"))
last = len(prompts) - 1
# The two phases' lines cross the last prompt's bar and stop below its checkpoint markers (drawn above the bar, one
# row per group, further apart than a marker is wide); where they coincide, the dotted one is drawn over the wider.
same = res.kv_tokens == res.num_tokens
for x, name, line in ((res.num_tokens, "phase 2: hit b", dict(color="#ff7f0e", width=6)),
                      (res.kv_tokens, "phase 1: KV run", dict(color="#252525", width=3, dash="dot"))):
    fig.add_trace(go.Scatter(x=[x, x], y=[last - 0.4, last + MARKER_ROW - 0.08], mode="lines", line=line,
                             name=f"{name} = {x}" + (" (the lines coincide)" if same else "")))
for g in range(groups):
    sub = pts[pts.group == g]
    fig.add_trace(go.Scatter(x=sub.boundary, y=sub.prompt + MARKER_ROW + MARKER_STEP * g, mode="markers",
                             marker_symbol="diamond", marker_size=9, name=f"checkpoint, group {g}", text=sub.key,
                             hovertemplate="boundary %{x} · key %{text}"))
top = max(block, *res.prompt_tokens)
fig.update_layout(barmode="overlay", xaxis_title="token position (tokens)", yaxis_title="prompt (0 = first)",
                  xaxis=dict(range=[-0.01 * top, 1.02 * top]), uniformtext=dict(minsize=9, mode="hide"),   # b = 0 seen
                  yaxis=dict(tickmode="array", tickvals=list(range(len(prompts)))),
                  height=200 + (50 + 15 * groups) * len(prompts),       # a marker row per group between the bars
                  legend=dict(orientation="h", y=-0.3))
show_chart(fig, blocks, key="p07_blocks_chart")

st.subheader("2 · The lookup of the last prompt, step by step")
steps = res.steps
show_table(steps, {"phase": num("Phase", "%d"), "block": num("Block", "%d"), "boundary": num("Boundary (tokens)"),
                   "found": "Found", "groups": "Groups with a checkpoint", "note": "Note"})
why = steps.iloc[-1].note if len(steps) else "prompt shorter than one block"
st.write(f"**Hit b = {res.num_tokens} tokens** (phase-1 KV run {res.kv_tokens}). Why it stops there: {why}."
         + (f" Dropped group {drop[1]}'s checkpoint at {drop[0]}: that boundary is incomplete now." if drop else ""))
st.caption("What to notice: keys are chained, so one changed byte changes every later key (the prompts diverge "
           "where the blue runs end). b = max{ jN ≤ min(KV run, L − 1) : all G groups have a checkpoint at jN }. "
           "Phase 2 needs all groups (`all()`), as in vLLM's hybrid KV cache coordinator.")
