"""06 MLA paging: page tables, internal fragmentation, measured gather overhead, prefix sharing."""
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from app_pages.charts import show_chart
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import measured_stamp, remeasure_button
from app_pages.params import Choice, Int
from lab.mla_paging import DEMO_LATENT, DEMO_LAYERS, GATHER_REPEATS, KIMI, gather_grid, page06

st.title("MLA paging")
st.write(
    "MLA keeps `kv_lora_rank + qk_rope_head_dim` latent values per token and MLA layer. Paged, a request's "
    "tokens are cut into blocks of N tokens, and a page table maps each logical block to any free physical page "
    "(`serve.memory.paged_mla.PagedMLACache` over the engine's `CacheLayout` and `read_kv` / `write_kv`). Attention "
    "then gathers the pages with one `index_select` over the page table, as the engine does. Below: a real page table, what block size costs in slack, the gather overhead measured on this CPU, "
    "and the bytes that reference-counted prefix sharing saves.")

BLOCKS = [1, 2, 4, 8, 16, 32, 64]
links = declare(
    Choice("p06_block_size", 16, BLOCKS),
    Int("p06_tokens_a", 100, 8, 256),
    Int("p06_shared_pct", 50, 0, 100),
    Int("p06_own_b", 30, 0, 128),
    Choice("p06_max_ctx", 2048, [1024, 2048, 4096, 8192, 16384]),
    Int("p06_requests", 16, 1, 64),
    Int("p06_prefix", 2048, 0, 8192, step=64),
    Int("p06_unique", 128, 0, 2048, step=16),
)


def _bars(df, col):
    """Error bars from a ratio of medians to the quartiles of its per-round ratio (never negative)."""
    return dict(type="data", symmetric=False, array=(df[f"{col}_q3"] - df[col]).clip(lower=0),
                arrayminus=(df[col] - df[f"{col}_q1"]).clip(lower=0))


part1, part2, part3, part4 = st.container(), st.container(), st.container(), st.container()   # in page order
part1.subheader("1 · A request's page table (logical block → physical page)")
c1, c2, c3, c4 = part1.columns(4)
bs = links.select_slider(c1, "Block size N (tokens)", "p06_block_size")
tokens_a = links.slider(c2, "Request A (tokens)", "p06_tokens_a")
shared_pct = links.slider(c3, "B shares A's first (%)", "p06_shared_pct")
own_b = links.slider(c4, "B's own tokens", "p06_own_b")
shared_tokens = tokens_a * shared_pct // 100
part3.subheader("3 · Gather overhead: paged vs contiguous, measured")
max_ctx = links.select_slider(part3, "Longest context measured (tokens)", "p06_max_ctx")
part4.subheader("4 · Bytes saved by sharing a prefix")
e2, e3, e4 = part4.columns(3)   # drawn now (the one lab call below needs them), shown above section 4's chart
n_req = links.slider(e2, "Requests sharing the prefix", "p06_requests")
prefix = links.slider(e3, "Shared prefix (tokens)", "p06_prefix")
unique = links.slider(e4, "Unique tail per request (tokens)", "p06_unique")

_run = st.cache_data(page06, show_spinner="Building page tables…", max_entries=16, ttl="1h")
_p06_gather = st.cache_data(gather_grid,
                            show_spinner=f"Timing gathers on this CPU: {GATHER_REPEATS} interleaved repeats after a warm-up…",
                            max_entries=4, ttl="1h")
r = engine_call(_run, bs, tokens_a, shared_tokens, own_b, n_req, prefix, unique)
d = r.demo
with part1:
    ROLE_COLOR = {"A": "#2171b5", "B": "#41ab5d", "shared": "#807dba", "other": "#bdbdbd", "free": "#f0f0f0"}
    n_log = max(len(d.table_a), len(d.table_b), 1)
    stretch = (d.num_pages - 1) / max(n_log - 1, 1)       # spread logical blocks over the width of the pool row
    fig = go.Figure()
    for name, table, y, color in (("A", d.table_a, 2, ROLE_COLOR["A"]), ("B", d.table_b, 0, ROLE_COLOR["B"])):
        xs, ys = [], []
        for i, p in enumerate(table):
            xs += [i * stretch, p, None]
            ys += [y, 1, None]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(color=color, width=1), name=f"{name}: block → page",
                                 hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=[i * stretch for i in range(len(table))], y=[y] * len(table), mode="markers",
                                 marker=dict(symbol="square", size=9, color=color), name=f"{name} logical blocks",
                                 text=[f"{name} block {i} → page {p}" for i, p in enumerate(table)], hoverinfo="text"))
    for role, color in ROLE_COLOR.items():
        pages = [p for p, r in enumerate(d.page_roles) if r == role]
        fig.add_trace(go.Scatter(x=pages, y=[1] * len(pages), mode="markers", name=f"page: {role}",
                                 marker=dict(symbol="square", size=9, color=color, line=dict(color="#636363", width=0.5)),
                                 text=[f"page {p}: {role}" for p in pages], hoverinfo="text"))
    fig.update_layout(xaxis_title="logical block (rows A, B; stretched) / physical page id (middle row)",
                      yaxis=dict(title="", tickvals=[0, 1, 2], ticktext=["B blocks", "pool pages", "A blocks"]),
                      height=330, legend=dict(orientation="h", y=-0.35))
    table_df = pd.DataFrame([("A", i, p) for i, p in enumerate(d.table_a)] + [("B", i, p) for i, p in enumerate(d.table_b)],
                            columns=["request", "logical_block", "physical_page"])
    show_chart(fig, table_df, key="p06_table")
    st.caption(f"A: {d.tokens_a} tokens in {len(d.table_a)} blocks; B: {d.tokens_b} tokens in {len(d.table_b)} blocks, "
               f"{len(d.shared_pages)} page(s) shared by reference count. Other requests (grey) were allocated and half "
               "freed first, so pages are scattered. B's partial shared block is copied on write when B appends.")

with part2:
    st.subheader("2 · Internal fragmentation vs block size")


    fdf = r.fragmentation
    fig2 = go.Figure()
    fig2.add_trace(go.Scatter(x=fdf.block_size, y=100 * fdf.unused_fraction, name="unused KV slots (% of allocated)",
                              mode="lines+markers"))
    fig2.add_trace(go.Scatter(x=fdf.block_size, y=fdf.mean_table_entries, name="page-table entries per request",
                              mode="lines+markers", yaxis="y2", line=dict(dash="dot")))
    TICKS = [m * 10 ** e for e in range(0, 6) for m in (1, 2, 5)]         # 1, 2, 5, 10, 20, 50, ...
    fig2.update_layout(xaxis=dict(title="block size N (tokens, log)", type="log", tickvals=fdf.block_size.tolist()),
                       yaxis=dict(title="unused slots in last blocks (% of allocated)"),
                       yaxis2=dict(title="page-table entries per request (log)", overlaying="y", side="right", type="log",
                                   tickvals=TICKS, ticktext=[f"{t:,}" for t in TICKS], showgrid=False),
                       legend=dict(orientation="h", y=-0.3))
    show_chart(fig2, fdf, key="p06_frag")
    st.caption("1,000 requests with context lengths log-uniform in [16, 8192] tokens (seeded). Unused slots = "
               "⌈L / N⌉ · N − L per request: on average about N / 2 tokens.")

with part3:
    grid = engine_call(_p06_gather, max_ctx)
    remeasure_button(_p06_gather, key="p06_remeasure")
    gdf, ndf = grid.rows, grid.naive
    fig3 = go.Figure()
    for b, sub in gdf.groupby("block_size"):
        fig3.add_trace(go.Scatter(x=sub.context_tokens, y=sub.gather_ratio, name=f"paged, N = {b}", mode="lines+markers",
                                  error_y=_bars(sub, "gather_ratio")))
    fig3.add_trace(go.Scatter(x=ndf.context_tokens, y=ndf.naive_ratio, name="naive torch.cat per token", mode="lines+markers",
                              line=dict(dash="dot", color="gray"), error_y=_bars(ndf, "naive_ratio")))
    fig3.update_layout(xaxis=dict(title="context length (tokens, log)", type="log",
                                  tickvals=sorted(gdf.context_tokens.unique().tolist()), tickformat=","),  # not 16.384k
                       yaxis=dict(title="time ÷ contiguous copy (×; bars: IQR)"),   # longer: cut
                       legend=dict(orientation="h", y=-0.3))
    fig3.add_hline(y=1, line_dash="dash", line_color="gray", annotation_text="contiguous copy = 1×",
                   annotation_position="bottom right")
    show_chart(fig3, gdf, key="p06_gather")
    measured_stamp(grid.conditions)
    st.caption(f"Each point: the ratio of the medians; bars: the quartiles of the per-round ratio. One MLA layer's "
               f"latents [L, {KIMI.latent_dim}] fp32 read into a buffer allocated before the timing: contiguous `copy_` "
               "vs the engine's `read_kv` (one `index_select` over a scattered page table) vs `torch.cat` of per-token "
               "tensors.")
    with st.expander("How the gather is timed"):
        st.markdown(f"Latent width {KIMI.latent_dim} = Kimi's {KIMI.kv_lora_rank} + {KIMI.qk_rope_head_dim} (rope). "
                    f"Per cell, every contender runs once untimed, then {GATHER_REPEATS} rounds in a rotating order, "
                    "single-threaded, each writing into its own buffer allocated and written beforehand (a fresh "
                    "tensor of 1 MiB or more per call would time the allocator's page faults, not the copy). "
                    "A point is the ratio of the two medians; its bars span the quartiles of the "
                    "per-round ratio (both contenders ran in the same round, so a slow phase of the shared CPU hits "
                    "both). The naive line pools the cells of every block size at a context (it does not depend on "
                    "N). The CSV holds the medians (µs) and decode attention over contiguous latents vs read + "
                    "attention (`attention_ratio`).")

with part4:
    if prefix + unique == 0:
        st.info("Shared prefix + unique tail is 0 tokens: there is nothing to page. Move either slider above 0.")
    else:
        sdf = r.sharing
        fig4 = go.Figure()
        fig4.add_trace(go.Scatter(x=sdf.num_requests, y=sdf.shared_bytes / 2 ** 20, name="shared by reference count",
                                  mode="lines+markers"))
        fig4.add_trace(go.Scatter(x=sdf.num_requests, y=sdf.private_bytes / 2 ** 20, mode="lines+markers", fill="tonexty",
                                  name="private copies (shaded gap = bytes saved)"))
        fig4.update_layout(xaxis=dict(title="requests sharing the prefix", dtick=max(1, round(n_req / 8))),
                           yaxis_title="MLA_KV bytes in the pool (MiB)",
                           yaxis_rangemode="tozero", legend=dict(orientation="h", y=-0.3))
        show_chart(fig4, sdf, key="p06_sharing")
        last = sdf.iloc[-1]
        st.metric(f"Saved at {n_req} requests", f"{last.saved_bytes / 2 ** 20:,.2f} MiB",
                  f"{100 * last.saved_bytes / max(last.private_bytes, 1):.0f}% of private copies", delta_color="off",
                  delta_arrow="off")

worst16 = gdf[gdf.block_size >= 16].gather_ratio.max()
st.info(
    "What to notice: pages scatter, yet a page table makes them one logical sequence. Smaller blocks waste fewer "
    "slots (≈ N/2 tokens per request) but need longer page tables and more, smaller copies: the gather is slowest "
    f"relative to a contiguous copy at N = 1, and from N = 16 on it is at most {worst16:.2f}× here. Sharing: n "
    f"requests hold ⌊P/N⌋ shared blocks once plus n · ⌈(P mod N + U)/N⌉ own blocks (N = {r.sharing_block_size} here, the "
    f"demo's {DEMO_LAYERS} MLA layers × {DEMO_LATENT} fp32 values per token); the shared partial block is copied on "
    "write. Sources: vLLM PagedAttention (Kwon et al., SOSP 2023); `serve/memory/paged_mla.py`, "
    "`serve/memory/pages.py`.")
