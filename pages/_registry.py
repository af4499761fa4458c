"""The tabs of the app, in order: (section, page file, title, icon, one-line description).

``app.py`` builds ``st.navigation`` from this list and the home page links to every entry, so a tab
is added in exactly one place. Only pages that exist and work are listed.
"""
from typing import NamedTuple


class Tab(NamedTuple):
    section: str
    path: str
    title: str
    icon: str
    blurb: str


HOME = Tab("Overview", "pages/00_home.py", "Home", ":material/home:", "what the second request saves")

TABS: list[Tab] = [
    Tab("Speculative decoding", "pages/01_snapshot_vs_projection.py", "01 Snapshot vs projection bytes",
        ":material/compare:", "rollback bytes per strategy, measured after a real verify; whole-model table"),
    Tab("Speculative decoding", "pages/02_verify_and_replay.py", "02 verify_and_replay", ":material/fact_check:",
        "live speculative decoding: every committed state bitwise equal to plain decoding, in three modes"),
    Tab("Memory", "pages/03_kda_state_vs_kv.py", "03 KDA state vs KV cache", ":material/stacked_bar_chart:",
        "bytes per sequence vs context; decode cost per token measured"),
    Tab("Memory", "pages/04_raw_input_ring.py", "04 RawInputRing", ":material/autorenew:",
        "cache layer inputs, not states: bytes vs draft length, commit time, the ring and its overflow"),
    Tab("Memory", "pages/05_page_pool.py", "05 Unified page pool", ":material/grid_view:",
        "one pool of MLA_KV and KDA_STATE pages under a shifting request mix; page-size policies; alloc latency"),
    Tab("Memory", "pages/06_mla_paging.py", "06 MLA paging", ":material/account_tree:",
        "page tables, fragmentation vs block size, measured paged gather vs contiguous, prefix sharing by refcount"),
    Tab("Prefix cache", "pages/07_prefix_anatomy.py", "07 Prefix cache anatomy", ":material/account_tree:",
        "blocks, chained keys, per-group checkpoints; the two-phase lookup step by step"),
    Tab("Prefix cache", "pages/08_prefix_hit.py", "08 Prefix hit", ":material/bolt:",
        "measured TTFT cold vs warm, prefill tokens skipped, bytes reused by kind, identical outputs"),
    Tab("Prefix cache", "pages/09_prefix_miss.py", "09 Prefix miss", ":material/trending_down:",
        "what a miss costs and leaves behind; trace replay: hit ratio vs capacity, miss causes, interval trade-off"),
    Tab("Parallel & fleet", "pages/10_kcp.py", "10 KCP", ":material/call_split:",
        "one prompt across real torch.distributed ranks: exact vs one rank, phase times, bytes, speedup"),
    Tab("Parallel & fleet", "pages/11_fleet_hashing.py", "11 Fleet hashing", ":material/hub:",
        "prefix-aware routing: load per replica, ring balance vs vnodes, lookup cost"),
    Tab("Parallel & fleet", "pages/12_fleet_scaling.py", "12 Fleet scaling", ":material/open_in_full:",
        "keys moved per algorithm when a replica joins or leaves; hit-ratio dip and recovery"),
    Tab("Parallel & fleet", "pages/13_fleet_budgets.py", "13 Fleet budgets", ":material/savings:",
        "token buckets and a VTC fair scheduler vs FCFS under a burst; vs the VTC artifact"),
    Tab("Parallel & fleet", "pages/14_fleet_simulation.py", "14 Fleet simulation", ":material/lan:",
        "router, prefix caches and schedulers on a trace: hit ratio, TTFT per class, balance per policy"),
    Tab("At real scale", "pages/15_real_scale.py", "15 Real scale", ":material/speed:",
        "Kimi Linear vs full MLA to 1M tokens on real GPUs; SGLang, vLLM and our prefix caches at real bytes"),
    Tab("Engine", "pages/16_continuous_batching.py", "16 Continuous batching", ":material/view_agenda:",
        "a trace through the batched engine: batch composition, state slots, TTFT / TPOT, bitwise vs alone"),
]

SECTIONS = ["Overview", "Speculative decoding", "Memory", "Prefix cache", "Parallel & fleet", "At real scale",
            "Engine"]

if __name__ == "__main__":  # run as a legacy auto-discovered page: route through st.navigation
    from pages._common import route_through_navigation

    route_through_navigation()
