"""Budget-isolation scenario for page 13: steady classes plus a burst, run with and without isolation.

Traffic (seeded): each class in ``steady`` is a Poisson stream (rate, prompt and output lengths
jittered ±25 %); the burst adds ``burst_requests`` requests of ``burst_class`` spread over
``burst_duration_s`` starting at ``burst_start_s`` — either uniformly at random ("generator") or
following the arrival pattern and lengths of the Azure 2023 code trace (its first requests, time
rescaled into the burst window). Prompts share no prefix (block ids are fresh).

"Without isolation" = FCFS, no buckets. "With isolation" = the classes' token buckets at admission
and the VTC scheduler with the classes' weights on every replica.

:func:`budget_page` assembles page 13's scenario from its widgets in one call. Its rates are not fixed
numbers: each is a load factor (this lab's choice, named below) times the fleet's capacity at that
class's request lengths (:func:`fleet_capacity_rps`): by default of a reference fleet (the model on 8 x H200,
:data:`LOAD_BASES`), so every hardware choice gets the same requests/s and its roofline service times set the
seconds; or of the chosen fleet itself, the same overload on any hardware. Replicas: a real model on real GPUs with
roofline step times and a policy cache at real bytes (:func:`lab.fleet_simulation.real_replica`; the
default, Kimi-Linear-48B-A3B on 8 x H200), or the VTC artifact's A10G calibration
(:func:`serve.fleet.vtc.on_off_less_service`) sped up by assumed factors that the page states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd

from lab.fleet import PAGE_TRACE_BLOCKS, default_service, fitting_tps, results_frame
from lab.fleet_simulation import HARDWARE, MODELS, REAL_DEFAULTS, SERVICE_MODELS, TP_SIZES, real_replica
from serve.azure_trace import read_azure_csv
from serve.errors import check_choice
from serve.fleet.budgets import PriorityClass
from serve.fleet.service_model import saturated_throughput_rps
from serve.fleet.sim_types import FleetConfig, FleetRequest, FleetSimResult, fresh_block_requests, percentile
from serve.fleet.simulation import simulate
from serve.fleet.vtc import on_off_less_service, replay_on_off_less
from serve.traces import TraceRequest, named_bytes


class Stream(NamedTuple):
    """Steady Poisson traffic of one class: ``rate_rps``, mean ``prompt_tokens`` / ``output_tokens``."""

    klass: str
    rate_rps: float
    prompt_tokens: int
    output_tokens: int


class BudgetRun(NamedTuple):
    """The two runs on identical traffic."""

    without: FleetSimResult
    with_isolation: FleetSimResult
    requests: list[FleetRequest]


class BudgetTraffic(NamedTuple):
    """The scenario's ``requests`` (sorted by arrival, ids 0..N-1), the number of ``burst_requests``
    actually in them, and ``note``: "" or a sentence saying why the burst is smaller than asked."""

    requests: list[FleetRequest]
    burst_requests: int
    note: str


def budget_traffic(steady: Sequence[Stream], duration_s: float, burst_class: str, burst_requests: int,
                   burst_start_s: float, burst_duration_s: float, burst_prompt_tokens: int,
                   burst_output_tokens: int, seed: int = 0, azure: Sequence[TraceRequest] | None = None,
                   block_size: int = 512, burst_label: str | None = None) -> BudgetTraffic:
    """Requests of the scenario (see module doc). With ``azure``, the burst is its first
    ``burst_requests`` requests — fewer when the trace is shorter, which ``note`` then says (naming the class
    ``burst_label``, by default ``burst_class``).
    Raises ValueError for non-positive durations or negative counts, or prompts over the limits of
    :func:`serve.fleet.sim_types.fresh_block_requests`."""
    if duration_s <= 0 or burst_duration_s <= 0 or burst_requests < 0:
        raise ValueError("durations must be > 0 and burst_requests >= 0")
    rng = np.random.default_rng(seed)
    raw: list[tuple[float, int, int, str]] = []
    for s in steady:
        n = rng.poisson(s.rate_rps * duration_s)
        for t in rng.uniform(0, duration_s * 1000.0, size=n):
            raw.append((float(t), _jitter(rng, s.prompt_tokens), _jitter(rng, s.output_tokens), s.klass))
    start_ms, span_ms = burst_start_s * 1000.0, burst_duration_s * 1000.0
    note = ""
    if azure is not None:
        picked = list(azure[:burst_requests])
        t_end = max(picked[-1].timestamp_ms, 1) if picked else 1
        for r in picked:
            raw.append((start_ms + r.timestamp_ms / t_end * span_ms, max(1, r.input_length),
                        max(1, r.output_length), burst_class))
        if len(picked) < burst_requests:
            note = (f"The burst has {len(picked):,} {burst_label or burst_class} requests, not the {burst_requests:,} asked for: "
                    f"the Azure trace gave only {len(picked):,}.")
        burst = len(picked)
    else:
        for t in rng.uniform(start_ms, start_ms + span_ms, size=burst_requests):
            raw.append((float(t), _jitter(rng, burst_prompt_tokens), _jitter(rng, burst_output_tokens), burst_class))
        burst = burst_requests
    raw.sort(key=lambda x: x[0])
    return BudgetTraffic(fresh_block_requests(raw, block_size), burst, note)


def _jitter(rng: np.random.Generator, mean: int) -> int:
    return max(1, int(round(mean * rng.uniform(0.75, 1.25))))


def run_budget_scenario(requests: Sequence[FleetRequest], classes: Sequence[PriorityClass],
                        base: FleetConfig) -> BudgetRun:
    """Run ``requests`` twice on ``base``: FCFS without buckets, then VTC with ``classes``' weights
    and buckets."""
    plain = tuple(PriorityClass(c.name, 1.0) for c in classes)
    without = simulate(requests, FleetConfig(**{**base.__dict__, "scheduler": "fcfs", "classes": plain}))
    isolated = simulate(requests, FleetConfig(**{**base.__dict__, "scheduler": "vtc", "classes": tuple(classes)}))
    return BudgetRun(without, isolated, list(requests))


def budget_frames(run: BudgetRun, classes: Sequence[PriorityClass]):
    """DataFrames for page 13: (per-request results (:func:`lab.fleet.results_frame`, ms) with an
    ``isolation`` column (:data:`WITHOUT` / :data:`WITH`), per (isolation, class): ``completed`` and TTFT
    ``ttft_min_ms`` / ``ttft_p25_ms`` / ``ttft_p50_ms`` / ``ttft_p75_ms`` / ``ttft_p99_ms`` and
    ``queue_wait_p99_ms`` over completed requests (rows in ``classes``' order), cumulative admitted tokens vs each bucket's budget line)."""
    frames = []
    for label, sim in ((WITHOUT, run.without), (WITH, run.with_isolation)):
        df = results_frame(sim)
        df.insert(0, "isolation", label)
        frames.append(df)
    per_request = pd.concat(frames, ignore_index=True)
    done = per_request[per_request.status == "completed"]
    summary = []
    for (label, klass), g in done.groupby(["isolation", "klass"], sort=False):
        ttft = g.ttft_ms.to_numpy()
        summary.append({"isolation": label, "class": klass, "completed": len(g), "ttft_min_ms": float(ttft.min()),
                        **{f"ttft_p{q}_ms": percentile(ttft, q) for q in (25, 50, 75, 99)},
                        "queue_wait_p99_ms": percentile(g.queue_wait_ms.to_numpy(), 99)})
    rank = {c.name: i for i, c in enumerate(classes)}  # rows: without then with isolation, classes in given order
    summary.sort(key=lambda r: (r["isolation"] == WITH, rank.get(r["class"], len(rank))))
    budget_rows = []
    for c in classes:
        if not c.has_bucket:
            continue
        admitted = 0
        for adm in run.with_isolation.admissions:
            if adm.klass == c.name:
                admitted += adm.tokens
                budget_rows.append({"class": c.name, "time_s": adm.time_ms / 1000.0, "admitted_tokens": admitted,
                                    "budget_tokens": c.burst_tokens + c.rate_tokens_per_s * adm.time_ms / 1000.0})
    return per_request, pd.DataFrame(summary), pd.DataFrame(budget_rows)


# The scenario of page 13: this lab's choices, not measurements. Lengths in tokens (prompt, output); a load is
# a fraction of the fleet's capacity (fleet_capacity_rps) at that class's lengths.
DURATION_S = 40.0  # simulated steady traffic (s)
BURST_START_S = 10.0  # the burst starts after 10 s of steady traffic, so the "before" state is settled
TOKENS = {"vip": (512, 64),  # short interactive requests
          "standard": (8192, 256),  # long-context chat / RAG turns: the regime Kimi-Linear is built for
          "batch": (16384, 512)}  # long documents, long outputs
CLASS_LABELS = {"vip": "VIP", "standard": "Standard", "batch": "Batch"}  # how the page names the classes
BURST_CLASSES = ("standard", "batch", "vip")
BATCH_LOAD = 0.10  # steady batch traffic: 10 % of the fleet's capacity at batch lengths
BATCH_WEIGHT = 0.5  # VTC weight of the batch class (half a standard request's share)
BATCH_BUDGET = 0.15  # batch bucket refill: 15 % of the fleet's token throughput at batch lengths
BUCKET_DEPTH_S = 5.0  # every bucket holds 5 s of its refill (and at least one request of its class)
MAX_BURST_REQUESTS = 3_000  # a burst (generated or read from an Azure file) has at most this many requests: the
# simulation budget of one page run (the rest of the burst load is not offered; the note says so)
ROUTER = "least_loaded"  # no prefix is shared (fresh block ids), so routing is by load only
# Page defaults (the widgets start here): the steady classes use 30 % of the fleet; the burst offers twice
# the fleet's capacity for 10 s, so without isolation a backlog of ~10 s of the whole fleet's work builds.
DEFAULTS = {"vip_load": 0.05, "standard_load": 0.25, "vip_weight": 4, "standard_budget": 0.40,
            "burst_class": "standard", "burst_load": 2.0, "burst_duration_s": 10, "num_replicas": 2}
REPLICA_MODELS = {label: key for label, key in SERVICE_MODELS.items() if key in ("roofline", "a10g")}
# The A10G option: the VTC artifact's FCFS calibration sped up by ASSUMED factors (prefill x8, decode x5) with
# KV room for 400,000 tokens (a larger GPU), as page 14's A10G replica; the page says so. They cannot come from the
# roofline: the calibration is Llama-7B measured on an A10G, and serve.scale has neither that model's shape nor an
# A10G datasheet preset, so there is no hardware choice for this replica.
PREFILL_SPEEDUP, DECODE_SPEEDUP, KV_CAPACITY_TOKENS = 8.0, 5.0, 400_000
# What a load (a slider's %) is a share of. "reference": the capacity of a fixed reference fleet of the same replica
# count (the real-model replica: the chosen model on :data:`REFERENCE_GPU`, :func:`reference_tp`; the A10G replica:
# itself), so every hardware choice
# gets the same requests/s and its roofline service times set the seconds. "own": the chosen fleet's own capacity,
# the same overload on any hardware; the backlog is then load x burst length and the seconds hardly move.
LOAD_BASES = {"reference": "a reference fleet (the model on 8 × H200): the same requests/s on any hardware",
              "own": "the chosen fleet's own capacity: the same overload on any hardware"}
REFERENCE_GPU = "H200"


def reference_tp(model: str) -> int:
    """TP of the reference replica of ``model`` on :data:`REFERENCE_GPU`: 8 where the weights fit in 8 GPUs, else the
    fewest they fit in (Kimi K3: 16). Raises ValueError for an unknown model or one that fits no TP size."""
    tps = fitting_tps(model, REFERENCE_GPU)
    if not tps:
        raise ValueError(f"model {model!r} fits on no TP size of {REFERENCE_GPU}: no reference fleet")
    return 8 if 8 in tps else min(tps)
WITHOUT, WITH = "Without isolation", "With isolation"  # the two runs, as the page labels them


def budget_classes(vip_weight: float, standard_rate_tokens_per_s: float, batch_rate_tokens_per_s: float
                   ) -> tuple[PriorityClass, ...]:
    """The three classes: VIP (weight ``vip_weight``, no bucket), standard (weight 1) and batch
    (:data:`BATCH_WEIGHT`) with buckets refilled at the given rates (prompt + output tokens per s),
    :data:`BUCKET_DEPTH_S` seconds deep and never shallower than one request of the class (a request larger
    than its bucket would be rejected). Raises ValueError for non-positive weights or rates."""
    def depth(rate: float, klass: str) -> float:
        return max(BUCKET_DEPTH_S * rate, 1.25 * sum(TOKENS[klass]))  # 1.25: the lengths' +25 % jitter

    return (PriorityClass("vip", float(vip_weight)),
            PriorityClass("standard", 1.0, rate_tokens_per_s=float(standard_rate_tokens_per_s),
                          burst_tokens=depth(standard_rate_tokens_per_s, "standard")),
            PriorityClass("batch", BATCH_WEIGHT, rate_tokens_per_s=float(batch_rate_tokens_per_s),
                          burst_tokens=depth(batch_rate_tokens_per_s, "batch")))


def budget_service(service_model: str = "roofline", model: str = REAL_DEFAULTS["model"],
                   gpu: str = REAL_DEFAULTS["gpu"], tp: int = REAL_DEFAULTS["tp"]):
    """(service, cache_factory) of one replica: "roofline" = :func:`lab.fleet_simulation.real_replica` of
    ``model`` on ``tp`` x ``gpu`` with page 14's default cache policy and budget (the budget also bounds the
    running requests' KV room); "a10g" = the VTC artifact's
    calibration sped up by :data:`PREFILL_SPEEDUP` / :data:`DECODE_SPEEDUP` (no prefix cache: none is shared).
    Raises ValueError for an unknown option or weights that do not fit."""
    for name, value, allowed in (("service_model", service_model, tuple(REPLICA_MODELS.values())),
                                 ("model", model, MODELS), ("gpu", gpu, HARDWARE), ("tp", tp, TP_SIZES)):
        check_choice(name, value, tuple(allowed))
    if service_model == "a10g":
        return default_service(on_off_less_service(), PREFILL_SPEEDUP, DECODE_SPEEDUP, KV_CAPACITY_TOKENS), None
    return real_replica(model, gpu, tp, REAL_DEFAULTS["cache_policy"], REAL_DEFAULTS["budget_fraction"])


def fleet_capacity_rps(service, num_replicas: int) -> dict[str, float]:
    """Requests/s the fleet serves when saturated, per class at that class's :data:`TOKENS`: ``num_replicas``
    x :func:`serve.fleet.service_model.saturated_throughput_rps` (a full batch, one prefill per request; on
    the roofline that is prefill-bound, decode adds under 10 % at these lengths)."""
    return {k: num_replicas * saturated_throughput_rps(service, *TOKENS[k]) for k in TOKENS}


@dataclass(frozen=True)
class BudgetPage:
    """Everything page 13 draws.

    per_request / summary / budget: :func:`budget_frames` (ms, tokens, s); service_source: what the replicas
    are; capacity_rps: :func:`fleet_capacity_rps`; rates_rps: each class's steady rate (req/s);
    budget_tokens_per_s: each bucket's refill (tokens/s); num_requests: all requests; burst_requests: burst
    requests actually in them; note: what an Azure file's budget cut or why the burst is smaller ("" if
    nothing); basis_capacity_rps: the capacity the loads are shares of (:data:`LOAD_BASES`; req/s per class; equal
    to capacity_rps with "own" and on the A10G replica); duration_s / burst_start_s: the scenario's times."""

    per_request: pd.DataFrame
    summary: pd.DataFrame
    budget: pd.DataFrame
    service_source: str
    capacity_rps: dict
    rates_rps: dict
    budget_tokens_per_s: dict
    num_requests: int
    burst_requests: int
    note: str
    basis_capacity_rps: dict | None = None
    duration_s: float = DURATION_S
    burst_start_s: float = BURST_START_S


def vtc_frame() -> tuple[pd.DataFrame, dict, dict]:
    """The VTC artifact's on_off_less suite against our simulator (:func:`serve.fleet.vtc.replay_on_off_less`,
    the A10G calibration): one row per (scheduler, client) with P50/P99 TTFT measured and ours (s) and a
    readable ``client``; then the measured and our throughput (req/s) per scheduler."""
    cmp = replay_on_off_less()
    vdf = pd.DataFrame([r._asdict() for r in cmp.rows])
    vdf["client"] = vdf.client.map(lambda c: "Light (0.5 req/s, on/off)" if c == cmp.light_client else "Heavy (2 req/s)")
    return vdf, dict(cmp.measured_throughput_rps), dict(cmp.ours_throughput_rps)


def budget_page(vip_load: float, standard_load: float, vip_weight: float, standard_budget: float,
                burst_class: str, burst_load: float, burst_duration_s: float, num_replicas: int,
                azure: bytes | None = None, azure_name: str = "uploaded file", service_model: str = "roofline",
                model: str = REAL_DEFAULTS["model"], gpu: str = REAL_DEFAULTS["gpu"],
                tp: int = REAL_DEFAULTS["tp"], load_basis: str = "reference") -> BudgetPage:
    """Page 13's scenario on ``num_replicas`` replicas of :func:`budget_service`: steady VIP / standard / batch
    traffic at ``vip_load`` / ``standard_load`` / :data:`BATCH_LOAD` of the fleet's capacity at each class's
    lengths, and from :data:`BURST_START_S` a burst of ``burst_class`` offering ``burst_load`` x the fleet's
    capacity for ``burst_duration_s`` (at most :data:`MAX_BURST_REQUESTS`; uniform, or shaped by an Azure LLM trace CSV ``azure``: its arrival
    pattern and lengths); run without isolation and with it (standard bucket refilled at ``standard_budget``
    x the fleet's token throughput at standard lengths, batch at :data:`BATCH_BUDGET`). Every "capacity" here is
    that of the fleet ``load_basis`` names (:data:`LOAD_BASES`): with "reference" (default) the offered requests/s
    are the same for every ``gpu`` / ``tp`` / ``model``, and the chosen replica's service times decide the queues.

    Raises: ValueError for an unknown burst class or option, negative loads, non-positive budget, duration
    or replicas, weights that do not fit, or a bad Azure file (TraceFormatError naming the file and line)."""
    check_choice("burst_class", burst_class, BURST_CLASSES)
    for name, value in (("vip_load", vip_load), ("standard_load", standard_load), ("burst_load", burst_load)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0 (a fraction of the fleet's capacity), got {value}")
    if not standard_budget > 0 or not burst_duration_s > 0 or not num_replicas >= 1:
        raise ValueError(f"standard_budget and burst_duration_s must be > 0 and num_replicas >= 1, got "
                         f"{standard_budget}, {burst_duration_s}, {num_replicas}")
    check_choice("load_basis", load_basis, tuple(LOAD_BASES))
    service, _ = budget_service(service_model, model, gpu, tp)  # no prompt shares a prefix: no prefix cache
    own = fleet_capacity_rps(service, num_replicas)
    capacity = own if load_basis == "own" or service_model == "a10g" else fleet_capacity_rps(
        budget_service(service_model, model, REFERENCE_GPU, reference_tp(model))[0], num_replicas)
    rates = {"vip": vip_load * capacity["vip"], "standard": standard_load * capacity["standard"],
             "batch": BATCH_LOAD * capacity["batch"]}
    budget_rates = {"standard": standard_budget * capacity["standard"] * sum(TOKENS["standard"]),
                    "batch": BATCH_BUDGET * capacity["batch"] * sum(TOKENS["batch"])}
    classes = budget_classes(vip_weight, budget_rates["standard"], budget_rates["batch"])
    steady = [Stream(k, rates[k], *TOKENS[k]) for k in TOKENS]
    offered = round(burst_load * capacity[burst_class] * burst_duration_s)
    asked = min(offered, MAX_BURST_REQUESTS)
    capped = (f"The burst is capped at {MAX_BURST_REQUESTS:,} requests (the page's simulation budget), not the "
              f"{offered:,} its load and duration ask for." if offered > asked else "")
    shape, cut = None, ""
    if azure is not None:
        shape, cut, _ = read_azure_csv(named_bytes(azure, azure_name), max_requests=max(1, asked),
                                       max_total_blocks=PAGE_TRACE_BLOCKS)
    traffic = budget_traffic(steady, DURATION_S, burst_class, asked, BURST_START_S, float(burst_duration_s),
                             *TOKENS[burst_class], azure=shape, burst_label=CLASS_LABELS[burst_class])
    run = run_budget_scenario(traffic.requests, classes, FleetConfig(
        service=service, num_replicas=num_replicas, router=ROUTER, cache_capacity_blocks=0))
    notes = (capped, cut if asked else "", traffic.note)  # with no burst the file is only checked: nothing "cut"
    return BudgetPage(*budget_frames(run, classes), service.source, own, rates, budget_rates,
                      len(traffic.requests), traffic.burst_requests, " ".join(filter(None, notes)),
                      basis_capacity_rps=capacity)
