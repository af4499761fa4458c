"""A live request stream on real page pools (page 05): one unified pool vs a statically split pair.

Each step, requests arrive (Poisson, steady or bursty), each with a short or a long prompt and an
output length. A request is admitted when its pages can be allocated, all at once: its group states
(``G * state_pages`` KDA_STATE pages) and the MLA_KV blocks of prompt + output
(``ceil((prompt + output) / block_size)``); otherwise it is rejected (no queue). It then decodes
``decode_tokens_per_step`` tokens per step and frees every page when done. Halfway through, the
short/long mix flips (``long_share`` -> ``1 - long_share``).

The same arrivals run on (1) one :class:`PagePool` serving both kinds and (2) a static split of the
same bytes: a KV-only pool and a state-only pool sized for the first half's expected demand.
Sizes come from the engine's own :class:`serve.memory.layout.CacheLayout` (fp32, the block size kept,
the page size from the chosen policy); ``alloc`` / ``decref`` call latencies on the unified pool are
measured with ``time.perf_counter_ns``. :func:`page05` is page 05's one call: the run, the same run
under the other policy for the waste comparison, the real presets' page sizes and vLLM's picks;
:func:`call_latency` is its measurement (repeated runs after a warm-up), cached and re-measured apart.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kda_core.config import PRESETS, REAL_PRESETS, preset_title
from lab.pool_timing import LatencyHistogram, latency_histogram
from lab.timing import Conditions, conditions, summarize
from serve.errors import check_choice, check_fraction, check_positive
from serve.memory.layout import PAGE_POLICIES, REAL_DTYPES, CacheLayout
from serve.memory.pool import PageKind, PagePool
from serve.memory.vllm_block import vllm_vs_ours

ARRIVALS = ("steady", "bursty")
MIB = 2 ** 20


@dataclass(frozen=True)
class WorkloadConfig:
    """Workload knobs (tokens, steps, MiB). Frozen; validated in ``__post_init__``.

    short_tokens / long_tokens / output_tokens: inclusive uniform ranges of prompt and output lengths.
    arrival_rate: mean requests per step; "bursty" sends 3x the rate one step in three, none otherwise.
    """

    pool_mib: float = 32.0
    policy: str = "unified"   # page 05 opens on vLLM's unified page (ServeConfig serves multi_page): the waste shown first
    long_share: float = 0.2
    arrival: str = "steady"
    seed: int = 0
    num_groups: int = 1
    preset: str = "demo"
    block_size: int = 16
    num_steps: int = 200
    arrival_rate: float = 2.0
    decode_tokens_per_step: int = 8
    short_tokens: tuple[int, int] = (64, 512)
    long_tokens: tuple[int, int] = (2048, 8192)
    output_tokens: tuple[int, int] = (32, 256)

    def __post_init__(self):
        if not 0 < self.pool_mib <= 1024:
            raise ValueError(f"pool_mib must be in (0, 1024], got {self.pool_mib}")
        check_choice("policy", self.policy, PAGE_POLICIES)
        check_fraction("long_share", self.long_share)
        check_choice("arrival", self.arrival, ARRIVALS)
        check_choice("preset", self.preset, sorted(PRESETS))
        for name in ("num_steps", "decode_tokens_per_step", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        check_positive("arrival_rate", self.arrival_rate)
        for name in ("short_tokens", "long_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} must be a range 0 < lo <= hi, got {(lo, hi)}")

    @property
    def layout(self) -> CacheLayout:
        """The engine's layout for this config (fp32; page size from ``policy``)."""
        return CacheLayout.for_policy(PRESETS[self.preset], self.block_size, self.num_groups, self.policy)


@dataclass
class WorkloadResult:
    """What page 05 draws. ``timeline``: per step and pool variant, pages by kind; ``outcomes``: per
    phase and variant, admitted / rejected; ``snapshot``: ``(kind, owner, refcount)`` per page of the
    unified pool at ``snapshot_step``; ``latency_ns``: measured alloc / free call times on the unified
    pool; ``waste``: time-averaged bytes (state padding or tail, KV page padding, KV last-block slack,
    used)."""

    layout: CacheLayout
    num_pages: int
    kv_pages_static: int
    timeline: list[dict] = field(default_factory=list)
    outcomes: list[dict] = field(default_factory=list)
    snapshot: list[tuple] = field(default_factory=list)
    latency_ns: dict[str, list[int]] = field(default_factory=lambda: {"alloc": [], "free": []})
    waste: dict[str, float] = field(default_factory=dict)


def _arrivals(cfg: WorkloadConfig, rng: np.random.Generator) -> list[list[tuple[int, int, bool]]]:
    """Per step, the arriving requests as (prompt_tokens, output_tokens, is_long)."""
    out = []
    for step in range(cfg.num_steps):
        rate = cfg.arrival_rate if cfg.arrival == "steady" else (3 * cfg.arrival_rate if step % 3 == 0 else 0.0)
        share = cfg.long_share if step < cfg.num_steps // 2 else 1.0 - cfg.long_share
        reqs = []
        for _ in range(rng.poisson(rate)):
            is_long = bool(rng.random() < share)
            lo, hi = cfg.long_tokens if is_long else cfg.short_tokens
            reqs.append((int(rng.integers(lo, hi + 1)),
                         int(rng.integers(cfg.output_tokens[0], cfg.output_tokens[1] + 1)), is_long))
        out.append(reqs)
    return out


def static_kv_share(cfg: WorkloadConfig) -> float:
    """Share of pages a static split gives to KV: expected KV pages / (KV + state pages) per request
    under the first half's mix (mean lengths)."""
    lay = cfg.layout
    mean = {k: (lo + hi) / 2 for k, (lo, hi) in
            (("s", cfg.short_tokens), ("l", cfg.long_tokens), ("o", cfg.output_tokens))}
    kv = (1 - cfg.long_share) * (mean["s"] + mean["o"]) + cfg.long_share * (mean["l"] + mean["o"])
    kv_pages = kv / lay.block_size
    return kv_pages / (kv_pages + lay.state_pages)


def simulate_workload(cfg: WorkloadConfig, snapshot_step: int | None = None) -> WorkloadResult:
    """Run the stream on the unified pool and on the static split. Deterministic for a seed, except the
    measured latencies. Raises ValueError for a config or a pool too small for one page."""
    lay = cfg.layout
    num_pages = int(cfg.pool_mib * MIB // lay.page_bytes)
    if num_pages < 2:
        raise ValueError(f"a {cfg.pool_mib} MiB pool holds {num_pages} pages of {lay.page_bytes:,} bytes; need >= 2")
    snap = cfg.num_steps // 2 if snapshot_step is None else snapshot_step
    if not 0 <= snap < cfg.num_steps:
        raise ValueError(f"snapshot_step must be in [0, {cfg.num_steps}), got {snapshot_step}")
    kv_static = min(num_pages - 1, max(1, round(num_pages * static_kv_share(cfg))))
    res = WorkloadResult(lay, num_pages, kv_static)
    unified = PagePool(num_pages, lay.page_bytes)
    split = {PageKind.MLA_KV: PagePool(kv_static, lay.page_bytes),
             PageKind.KDA_STATE: PagePool(num_pages - kv_static, lay.page_bytes)}
    state_n = lay.state_pages
    slot_bytes = lay.kv_block_bytes // lay.block_size
    live = {"unified": {}, "static split": {}}  # rid -> (end_step, {kind: pages}, reserved tokens)
    counts = {(v, ph, o): 0 for v in live for ph in (1, 2) for o in ("admitted", "rejected")}
    waste_sum = {"state_waste_bytes": 0.0, "kv_padding_bytes": 0.0, "kv_slack_bytes": 0.0, "used_bytes": 0.0}
    clock = time.perf_counter_ns
    rid = 0
    for step, reqs in enumerate(_arrivals(cfg, np.random.default_rng(cfg.seed))):
        phase = 1 if step < cfg.num_steps // 2 else 2
        for variant, table in live.items():  # departures first
            for r in [r for r, (end, _, _) in table.items() if end <= step]:
                for kind, pages in table.pop(r)[1].items():
                    pool = unified if variant == "unified" else split[kind]
                    t0 = clock()
                    pool.decref(pages, r)
                    if variant == "unified":
                        res.latency_ns["free"].append(clock() - t0)
        for prompt, output, _ in reqs:
            rid += 1
            tokens = prompt + output
            need = {PageKind.KDA_STATE: state_n, PageKind.MLA_KV: -(-tokens // lay.block_size)}
            end = step + -(-output // cfg.decode_tokens_per_step)
            for variant in live:
                pools = {k: unified if variant == "unified" else split[k] for k in need}
                if any(sum(n for k, n in need.items() if pools[k] is p) > p.num_free for p in set(pools.values())):
                    counts[(variant, phase, "rejected")] += 1
                    continue
                got = {}
                for kind, n in need.items():
                    t0 = clock()
                    got[kind] = pools[kind].alloc(kind, n, rid)
                    if variant == "unified":
                        res.latency_ns["alloc"].append(clock() - t0)
                live[variant][rid] = (end, got, tokens)
                counts[(variant, phase, "admitted")] += 1
        res.timeline.append({"step": step, "phase": phase, "variant": "unified",
                             "mla_kv_pages": unified.num_used(PageKind.MLA_KV),
                             "kda_state_pages": unified.num_used(PageKind.KDA_STATE), "free_pages": unified.num_free})
        res.timeline.append({"step": step, "phase": phase, "variant": "static split",
                             "mla_kv_pages": split[PageKind.MLA_KV].num_used(),
                             "kda_state_pages": split[PageKind.KDA_STATE].num_used(),
                             "free_pages": sum(p.num_free for p in split.values())})
        n_live = len(live["unified"])
        waste_sum["state_waste_bytes"] += n_live * lay.state_waste_bytes
        waste_sum["kv_padding_bytes"] += unified.num_used(PageKind.MLA_KV) * lay.kv_page_padding_bytes
        waste_sum["kv_slack_bytes"] += sum(len(g[PageKind.MLA_KV]) * lay.block_size - t
                                           for _, g, t in live["unified"].values()) * slot_bytes
        waste_sum["used_bytes"] += unified.num_used() * lay.page_bytes
        if step == snap:
            res.snapshot = unified.page_table()
        if step % 50 == 0:
            unified.check_integrity()
    res.outcomes = [{"variant": v, "phase": ph, "outcome": o, "requests": n} for (v, ph, o), n in counts.items()]
    res.waste = {k: v / cfg.num_steps for k, v in waste_sum.items()}
    for variant, table in live.items():  # drain: every pool must end empty (no leak)
        for r, (_, got, _) in table.items():
            for kind, pages in got.items():
                (unified if variant == "unified" else split[kind]).decref(pages, r)
    if unified.num_free != num_pages or any(p.num_free != p.num_pages for p in split.values()):
        raise RuntimeError("page leak in the workload simulation")
    return res


def policy_waste(preset: str, block_size: int, num_groups: int) -> list[dict]:
    """Both policies for a real preset in its real dtypes (:data:`serve.memory.layout.REAL_DTYPES`):
    page bytes, state pages, and the unused share of a state's pages and of every KV page."""
    rows = []
    for policy in PAGE_POLICIES:
        lay = CacheLayout.for_policy(PRESETS[preset], block_size, num_groups, policy, **REAL_DTYPES)
        rows.append({"model": preset, "policy": policy, "block_size": lay.block_size, "page_bytes": lay.page_bytes,
                     "state_pages": lay.state_pages, "state_waste_pct": 100 * lay.state_waste_bytes / (
                         lay.state_pages * lay.page_bytes), "kv_page_padding_pct": 100 * lay.kv_page_padding_bytes /
                     lay.page_bytes})
    return rows


@dataclass(frozen=True)
class Page05:
    """Everything page 05 draws, from one call of :func:`page05`. ``layout``: the engine's layout of
    the run; ``timeline`` / ``outcomes``: :class:`WorkloadResult` rows as frames; ``snapshot``: the
    unified pool's ``(kind, owner, refcount)`` per page at the grid step; ``waste``: per policy and waste kind, % of used pool bytes (time-average);
    ``real``: :func:`policy_waste` of the real presets; ``vllm``: :func:`serve.memory.vllm_block.vllm_vs_ours`."""

    layout: CacheLayout
    num_pages: int
    kv_pages_static: int
    timeline: pd.DataFrame
    outcomes: pd.DataFrame
    snapshot: list
    waste: pd.DataFrame
    real: pd.DataFrame
    vllm: pd.DataFrame


WASTE_KINDS = {"state_waste_bytes": "KDA state padding / tail", "kv_padding_bytes": "KV page padding",
               "kv_slack_bytes": "MLA last-block slack"}


def page05(pool_mib: float, policy: str, long_share: float, arrival: str, num_groups: int, seed: int,
           snapshot_step: int) -> Page05:
    """Page 05's one call: the demo-model stream under ``policy`` (and under the other policy for the
    waste chart), the real presets at 16-token blocks with ``min(num_groups, 20)`` groups, and vLLM's
    picks. The call latencies are measured apart, by :func:`call_latency`. Raises ValueError as
    :class:`WorkloadConfig` and :func:`simulate_workload`."""
    runs = {p: simulate_workload(WorkloadConfig(pool_mib=pool_mib, policy=p, long_share=long_share, arrival=arrival,
                                       num_groups=num_groups, seed=seed), snapshot_step=snapshot_step)
            for p in sorted(PAGE_POLICIES, key=lambda p: p != policy)}
    res = runs[policy]
    waste = pd.DataFrame([{"policy": p, "waste": label, "pct_of_used": 100 * r.waste[k] / max(r.waste["used_bytes"], 1.0)}
                          for p, r in runs.items() for k, label in WASTE_KINDS.items()])
    real = pd.DataFrame([row for m in REAL_PRESETS for row in policy_waste(m, 16, min(num_groups, 20))])
    vllm = pd.DataFrame([row for m in REAL_PRESETS for row in vllm_vs_ours(PRESETS[m], 16, 1)])
    real["model"], vllm["model"] = real.model.map(preset_title), vllm.model.map(preset_title)
    return Page05(res.layout, res.num_pages, res.kv_pages_static, pd.DataFrame(res.timeline),
                  pd.DataFrame(res.outcomes), res.snapshot, waste, real, vllm)


LATENCY_REPEATS = 5
PERCENTILES = (50, 99)


@dataclass(frozen=True)
class CallLatency:
    """Page 05's measured ``alloc`` / ``decref`` call latencies on the unified pool, over ``repeats`` runs of the
    same (seeded) stream after a warm-up run. histogram: every timed call of every run (ns, log bins);
    percentiles: one row per (call, percentile in :data:`PERCENTILES`): the median over the runs of that run's
    percentile (``median_ns``) and its spread over the runs (``q1_ns``, ``q3_ns``, ``min_ns``, ``max_ns``),
    ``runs``; conditions: when and how (:class:`lab.timing.Conditions`)."""

    histogram: LatencyHistogram
    percentiles: pd.DataFrame
    conditions: Conditions


def call_latency(pool_mib: float, policy: str, long_share: float, arrival: str, num_groups: int, seed: int,
                 repeats: int = LATENCY_REPEATS, warmup: int = 1) -> CallLatency:
    """Run the stream of :func:`page05` (``policy`` only) ``warmup`` times untimed, then ``repeats`` times, each
    ``alloc`` and ``decref`` call on the unified pool timed with ``time.perf_counter_ns`` (the two calls
    interleave within a run, as requests arrive and leave). Raises ValueError as :class:`WorkloadConfig`, and for
    ``repeats`` < :data:`lab.timing.MIN_REPEATS` or ``warmup`` < 0."""
    cond = conditions(repeats, warmup)
    cfg = WorkloadConfig(pool_mib=pool_mib, policy=policy, long_share=long_share, arrival=arrival,
                         num_groups=num_groups, seed=seed)
    for _ in range(warmup):
        simulate_workload(cfg)
    runs = [simulate_workload(cfg).latency_ns for _ in range(repeats)]
    pooled = {call: [t for run in runs for t in run[call]] for call in runs[0]}
    rows = []
    for call in pooled:
        for q in PERCENTILES:
            t = summarize(f"{call} p{q}", [float(np.percentile(run[call], q)) * 1e-9 for run in runs])   # s
            rows.append({"call": call, "percentile": q, "median_ns": t.median_s * 1e9, "q1_ns": t.q1_s * 1e9,
                         "q3_ns": t.q3_s * 1e9, "min_ns": t.min_s * 1e9, "max_ns": t.max_s * 1e9, "runs": repeats})
    return CallLatency(latency_histogram(pooled, bins_per_decade=10), pd.DataFrame(rows), cond)
