"""Replay a VTC-artifact suite through our simulator and put our latencies beside the measured ones.

The artifact (Ying1123/VTC-artifact, OSDI'24) ran S-LoRA with Llama-7B on one A10G under FCFS and
VTC; each file lists every request's client, lengths, send time and measured latencies. We rebuild
the arrivals and lengths from the records, run one replica (no prefix cache: S-LoRA had none) with a
service model calibrated on the FCFS run's measured throughput (``vtc_a10g_preset``), once with FCFS
and once with our VTC scheduler, and report per-client TTFT percentiles for both sides.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np

from serve.fleet.sim.service_model import ServiceModel, vtc_a10g_preset
from serve.fleet.sim.simulation import simulate
from serve.fleet.sim.types import FleetConfig, FleetRequest, FleetSimResult, fresh_block_requests, percentile
from serve.traces.vtc_artifact import VTCRecord, VTCRun, load_vtc_artifact


def requests_from_vtc(run: VTCRun, block_size: int = 512) -> list[FleetRequest]:
    """One fleet request per record: arrival = ``req_time``, class = client, fresh (unshared) block ids."""
    return fresh_block_requests(((r.req_time_s * 1000.0, r.prompt_len, r.output_len, r.client)
                                 for r in sorted(run.records, key=lambda r: r.req_time_s)), block_size)


class ClientLatency(NamedTuple):
    """TTFT statistics of one client, seconds: ``measured_*`` from the artifact, ``ours_*`` simulated."""

    scheduler: str
    client: str
    requests: int
    measured_p50_s: float
    measured_p99_s: float
    ours_p50_s: float
    ours_p99_s: float


class VTCComparison(NamedTuple):
    """``rows`` per scheduler × client; throughputs (req/s) measured and ours per scheduler;
    ``light_client`` (fewest requests); ``service`` used; simulation results per scheduler."""

    rows: list[ClientLatency]
    measured_throughput_rps: dict[str, float]
    ours_throughput_rps: dict[str, float]
    light_client: str
    service: ServiceModel
    sims: dict[str, FleetSimResult]

    def p99(self, scheduler: str, client: str, side: str = "ours") -> float:
        row = next(r for r in self.rows if r.scheduler == scheduler and r.client == client)
        return row.ours_p99_s if side == "ours" else row.measured_p99_s


def compare(requests: list[FleetRequest], service: ServiceModel,
            measured: dict[str, dict[str, tuple[float, float]]],
            measured_throughput_rps: dict[str, float]) -> VTCComparison:
    """Simulate ``requests`` on one replica with FCFS and with VTC; put our per-client TTFT P50/P99
    beside ``measured[scheduler][client] = (p50_s, p99_s)``."""
    counts = Counter(r.klass for r in requests)
    light = min(counts, key=counts.get)
    rows, ours_tp, sims = [], {}, {}
    for sched in ("FCFS", "VTC"):
        cfg = FleetConfig(service=service, num_replicas=1, router="round_robin", scheduler=sched.lower(),
                          cache_capacity_blocks=0)
        sim = simulate(requests, cfg)
        sims[sched] = sim
        ours_tp[sched] = sim.throughput_rps()
        for client in sorted(counts):
            ours = sim.column("ttft_ms", klass=client) / 1000.0
            m50, m99 = measured[sched][client]
            rows.append(ClientLatency(sched, client, counts[client], m50, m99,
                                      percentile(ours, 50), percentile(ours, 99)))
    return VTCComparison(rows, dict(measured_throughput_rps), ours_tp, light, service, sims)


def replay_vtc_suite(directory: str | Path, suite: str = "on_off_less") -> VTCComparison:
    """Replay ``FCFS_<suite>.jsonl`` and ``VTC_<suite>.jsonl`` from ``directory`` (see module doc).
    Raises ValueError if a file is missing or malformed."""
    directory = Path(directory)
    runs = {}
    for sched in ("FCFS", "VTC"):
        path = directory / f"{sched}_{suite}.jsonl"
        if not path.exists():
            raise ValueError(f"VTC artifact file not found: {path}")
        runs[sched] = load_vtc_artifact(path)
    measured: dict[str, dict[str, tuple[float, float]]] = {}
    for sched, run in runs.items():
        measured[sched] = {}
        for client in sorted({r.client for r in run.records}):
            ttft = np.array([r.ttft_s for r in run.records if r.client == client and r.ttft_s >= 0])
            measured[sched][client] = (percentile(ttft, 50), percentile(ttft, 99))
    return compare(requests_from_vtc(runs["FCFS"]), vtc_a10g_preset(runs["FCFS"]), measured,
                   {k: v.throughput_rps for k, v in runs.items()})


# --- the on_off_less suite without the files (for the app, which ships no trace) -----------------
LIGHT, HEAVY = "dummy-lora-7b-rank-8-0", "dummy-lora-7b-rank-8-1"
# Measured in Ying1123/VTC-artifact fair_bench/{FCFS,VTC}/all_results_on_off_less.jsonl; the tests
# recompute every number from ../shared/traces/vtc_artifact and compare.
ON_OFF_LESS_MEASURED = {
    "FCFS": {LIGHT: (84.68188846111298, 173.5478834748268), HEAVY: (96.2125335931778, 182.6393851161003)},
    "VTC": {LIGHT: (2.677807927131653, 8.339656662940978), HEAVY: (110.56682288646698, 181.12108162641525)},
}
ON_OFF_LESS_THROUGHPUT_RPS = {"FCFS": 1.7090327278411699, "VTC": 1.7135710939248088}
ON_OFF_LESS_FCFS_MIN_TTFT_S = 0.1363966464996338
# Client phases of the suite's arrival generator (first request at phase + period).
_PHASES_S = {LIGHT: 0.749080237694725, HEAVY: 0.4753571532049581}


def on_off_less_requests(block_size: int = 512) -> list[FleetRequest]:
    """Rebuild the suite's 1,350 arrivals: the heavy client sends every 0.5 s (2 req/s) for 600 s;
    the light client every 2 s (0.5 req/s) but only during the "on" half of each 120 s period
    (on_off = 60 s); all prompts and outputs are 256 tokens. Equal to the artifact's ``req_time``s."""
    raw = []
    for client, period in ((HEAVY, 0.5), (LIGHT, 2.0)):
        j = 1
        while (t := _PHASES_S[client] + j * period) <= 600.0 + period + 1e-9:
            if client == HEAVY or math.floor((t - _PHASES_S[client]) / 60.0) % 2 == 0:
                raw.append((t, client))
            j += 1
    raw.sort()
    return fresh_block_requests(((t * 1000.0, 256, 256, client) for t, client in raw), block_size)


def on_off_less_service() -> ServiceModel:
    """``vtc_a10g_preset`` of the FCFS on_off_less run, from the recorded constants: one record carries all the
    calibration reads of the run's records (the suite's 256 / 256 lengths and its smallest TTFT)."""
    record = VTCRecord(LIGHT, 256, 256, 0.0, ON_OFF_LESS_FCFS_MIN_TTFT_S, 0.0)
    return vtc_a10g_preset(VTCRun({}, ON_OFF_LESS_THROUGHPUT_RPS["FCFS"], math.nan, [record]))


def replay_on_off_less() -> VTCComparison:
    """The on_off_less comparison from the recorded constants (no files needed)."""
    return compare(on_off_less_requests(), on_off_less_service(), ON_OFF_LESS_MEASURED, ON_OFF_LESS_THROUGHPUT_RPS)
