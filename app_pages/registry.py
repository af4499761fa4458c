"""The tabs of the app, in order: (section, page file, URL path, title, icon, one-line description).

The sidebar lists them by section (``SECTIONS`` order), so each section holds the next pages by number and the
sidebar reads 01, 02, ... 18 (the state-precision page, 17, sits with the engine it measures, before conformance).

``app.py`` builds ``st.navigation`` from this list and the home page links to every entry, so a tab
is added in exactly one place. Only pages that exist and work are listed. The URL path is stated, not
derived from the file name: a deep link (``/kcp?p10_world=4``) keeps working when a file is renamed.
"""
from typing import NamedTuple


class Tab(NamedTuple):
    section: str
    path: str
    url_path: str
    title: str
    icon: str
    blurb: str

    @property
    def link_prefix(self) -> str:
        """The prefix of the tab's URL keys: ``p05_`` for ``05_page_pool.py`` (``app_pages.links.declare``)."""
        return f"p{self.path.rsplit('/', 1)[-1][:2]}_"


HOME = Tab("Overview", "app_pages/00_home.py", "home", "Home", ":material/home:", "what the second request saves")

TABS: list[Tab] = [
    Tab("Speculative decoding", "app_pages/01_snapshot_vs_projection.py", "snapshot_vs_projection",
        "01 Snapshot vs projection bytes", ":material/compare:",
        "rollback bytes per strategy, measured after a real verify; whole-model table"),
    Tab("Speculative decoding", "app_pages/02_verify_and_replay.py", "verify_and_replay",
        "02 verify_and_replay", ":material/fact_check:",
        "live speculative decoding: every committed state bitwise equal to plain decoding, in three modes"),
    Tab("Memory", "app_pages/03_kda_state_vs_kv.py", "kda_state_vs_kv",
        "03 KDA state vs KV cache", ":material/stacked_bar_chart:",
        "bytes per sequence vs context; decode cost per token measured"),
    Tab("Memory", "app_pages/04_raw_input_ring.py", "raw_input_ring", "04 RawInputRing", ":material/autorenew:",
        "cache layer inputs, not states: bytes vs draft length, commit time, the ring and its overflow"),
    Tab("Memory", "app_pages/05_page_pool.py", "page_pool", "05 Unified page pool", ":material/grid_view:",
        "one pool of MLA_KV and KDA_STATE pages under a shifting request mix; page-size policies; alloc latency"),
    Tab("Memory", "app_pages/06_mla_paging.py", "mla_paging", "06 MLA paging", ":material/account_tree:",
        "page tables, fragmentation vs block size, measured paged gather vs contiguous, prefix sharing by refcount"),
    Tab("Prefix cache", "app_pages/07_prefix_anatomy.py", "prefix_anatomy",
        "07 Prefix cache anatomy", ":material/account_tree:",
        "blocks, chained keys, per-group checkpoints; the two-phase lookup step by step"),
    Tab("Prefix cache", "app_pages/08_prefix_hit.py", "prefix_hit", "08 Prefix hit", ":material/bolt:",
        "measured TTFT cold vs warm, prefill tokens skipped, bytes reused by kind, identical outputs"),
    Tab("Prefix cache", "app_pages/09_prefix_miss.py", "prefix_miss", "09 Prefix miss", ":material/trending_down:",
        "what a miss costs and leaves behind; trace replay: hit ratio vs capacity, miss causes, interval trade-off"),
    Tab("Parallel & fleet", "app_pages/10_kcp.py", "kcp", "10 KCP", ":material/call_split:",
        "one prompt across real torch.distributed ranks: exact vs one rank, phase times, bytes, speedup"),
    Tab("Parallel & fleet", "app_pages/11_fleet_hashing.py", "fleet_hashing", "11 Fleet hashing", ":material/hub:",
        "prefix-aware routing: load per replica, ring balance vs vnodes, lookup cost"),
    Tab("Parallel & fleet", "app_pages/12_fleet_scaling.py", "fleet_scaling",
        "12 Fleet scaling", ":material/open_in_full:",
        "keys moved per algorithm when a replica joins or leaves; hit-ratio dip and recovery"),
    Tab("Parallel & fleet", "app_pages/13_fleet_budgets.py", "fleet_budgets", "13 Fleet budgets", ":material/savings:",
        "token buckets and a VTC fair scheduler vs FCFS under a burst; vs the VTC artifact"),
    Tab("Parallel & fleet", "app_pages/14_fleet_simulation.py", "fleet_simulation",
        "14 Fleet simulation", ":material/lan:",
        "router, prefix caches and schedulers on a trace: hit ratio, TTFT per class, balance per policy"),
    Tab("At real scale", "app_pages/15_real_scale.py", "real_scale", "15 Real scale", ":material/speed:",
        "Kimi Linear vs full MLA to 1M tokens on real GPUs; SGLang, vLLM and our prefix caches at real bytes"),
    Tab("Engine", "app_pages/16_continuous_batching.py", "continuous_batching", "16 Continuous batching",
        ":material/view_agenda:",
        "a trace through the batched engine: batch composition, state slots, TTFT / TPOT, bitwise vs alone"),
    Tab("Engine", "app_pages/17_state_precision.py", "state_precision", "17 State precision", ":material/tune:",
        "KDA state stored in fp32 / bf16 / fp16 / fp8 / int8: drift and agreement on the trained model, requests per GPU"),
    Tab("Engine", "app_pages/18_conformance.py", "conformance", "18 Conformance", ":material/rule:",
        "the invariants a recurrent state must keep in any serving engine: ours checked live, llama.cpp recorded"),
]

SECTIONS = ["Overview", "Speculative decoding", "Memory", "Prefix cache", "Parallel & fleet", "At real scale",
            "Engine"]
