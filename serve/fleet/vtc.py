"""Replay a VTC-artifact suite through our simulator and put our latencies beside the measured ones.

The artifact (Ying1123/VTC-artifact, OSDI'24) ran S-LoRA with Llama-7B on one A10G under FCFS and
VTC; each file lists every request's client, lengths, send time and measured latencies. We rebuild
the arrivals and lengths from the records, run one replica (no prefix cache: S-LoRA had none) with a
service model calibrated on the FCFS run's measured throughput (``vtc_a10g_preset``), once with FCFS
and once with our VTC scheduler, and report per-client TTFT percentiles for both sides.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import numpy as np

from serve.fleet.service_model import ServiceModel, vtc_a10g_preset
from serve.fleet.sim_types import FleetConfig, FleetRequest, SimResult, percentile
from serve.fleet.simulation import simulate
from serve.traces import VTCRun, load_vtc_artifact


def requests_from_vtc(run: VTCRun, block_size: int = 512) -> list[FleetRequest]:
    """One fleet request per record: arrival = ``req_time``, class = client, fresh (unshared) block ids."""
    out, next_id = [], 0
    for i, r in enumerate(sorted(run.records, key=lambda r: r.req_time_s)):
        n = math.ceil(r.prompt_len / block_size)
        out.append(FleetRequest(i, r.req_time_s * 1000.0, r.prompt_len, r.output_len,
                                tuple(range(next_id, next_id + n)), r.client))
        next_id += n
    return out


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
    sims: dict[str, SimResult]

    def p99(self, scheduler: str, client: str, side: str = "ours") -> float:
        row = next(r for r in self.rows if r.scheduler == scheduler and r.client == client)
        return row.ours_p99_s if side == "ours" else row.measured_p99_s


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
    service = vtc_a10g_preset(runs["FCFS"])
    requests = requests_from_vtc(runs["FCFS"])
    counts: dict[str, int] = {}
    for r in requests:
        counts[r.klass] = counts.get(r.klass, 0) + 1
    light = min(counts, key=counts.get)
    rows, ours_tp, sims = [], {}, {}
    for sched in ("FCFS", "VTC"):
        cfg = FleetConfig(service=service, num_replicas=1, router="round_robin", scheduler=sched.lower(),
                          cache_capacity_blocks=0)
        sim = simulate(requests, cfg)
        sims[sched] = sim
        ours_tp[sched] = sim.throughput_rps()
        for client in sorted(counts):
            measured = np.array([r.ttft_s for r in runs[sched].records if r.client == client and r.ttft_s >= 0])
            ours = sim.column("ttft_ms", klass=client) / 1000.0
            rows.append(ClientLatency(sched, client, counts[client], percentile(measured, 50),
                                      percentile(measured, 99), percentile(ours, 50), percentile(ours, 99)))
    return VTCComparison(rows, {k: v.throughput_rps for k, v in runs.items()}, ours_tp, light, service, sims)
