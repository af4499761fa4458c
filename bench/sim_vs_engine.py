"""The fleet simulator's error against the real engine behind the HTTP server: ``python -m bench.sim_vs_engine``.

1. Calibrate the engine (Vidur-style operator profiling through its public API, :mod:`bench.engine_calibration`),
   once: single steps of the BATCHED engine as the server builds it (prefill of 1, 4 and 8 prompts, after a hit,
   decode at 1 / 4 / 16 rows and 32 / 512 tokens of context; mixed steps and more held out, NOT fitted), timed
   as wall and engine-thread CPU time; the step model is fitted to the CPU time, which the other jobs on the
   shared cores hardly move.
2. Per rate, a fresh ``python -m serve.http --step-trace``: first its calibration traffic (separate requests of
   random bytes), on which the server's own terms are fitted (:func:`bench.engine_timeline.fit_server_terms`:
   the engine's CPU in the server against alone, wall / CPU time of its steps, the engine thread's work after
   each step, ingress and egress), then the Mooncake-conversation-shaped replay of :mod:`bench.serve_http`
   (Poisson arrivals, seeded; streaming client in this process, the server in its own).
3. Predict: the same requests (same sends, lengths and prefix hashes) through
   :func:`serve.fleet.sim.simulation.simulate` with one replica: the CPU step model with the server's terms,
   and the engine's own prefix-cache policy (checkpoints every 64 tokens + the replay boundary + the prompt's
   end, :class:`serve.scale.policies.OursPolicy`).
Reports per rate and metric the measured value, the prediction and the error, the MAPE over rates, and where the
error comes from: the replay predicted with each piece added in turn (``variants``; the last, a diagnostic, uses
the wall / CPU share measured DURING the replay), every replay step against the step model for the same
composition, and the measured TTFT split (ingress / wait for the step in flight / engine / egress). Fitted,
predicted and measured are kept apart. Writes ``bench/results/sim_vs_engine.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import torch

from bench.engine_calibration import REPEATS, calibrate
from bench.engine_timeline import (
    fit_server_terms,
    in_window,
    match_requests,
    request_parts,
    step_table,
    summary,
    wall_per_cpu,
)
from bench.serve_http import BLOCK_BYTES, TRACE, local_server, mooncake_workload, one_request, run_rate
from serve.fleet.routing.policy_cache import PolicyReplicaCache
from serve.fleet.sim.service_model import ServiceModel
from serve.fleet.sim.simulation import simulate
from serve.fleet.sim.types import FleetConfig, FleetRequest, percentile
from serve.http.model import EngineSpec, load_model
from serve.http.step_trace import read_step_trace
from serve.scale.policies import OursPolicy
from serve.traces.mooncake import load_mooncake

OUT = Path(__file__).parent / "results" / "sim_vs_engine.json"


SPEC = EngineSpec()                       # the server's engine: block N, checkpoint interval C, max_num_seqs 64
CACHE_BUDGET_BYTES = 1e12                 # the server's pool never evicts at 48 requests: no cache limit


def server_cache() -> PolicyReplicaCache:
    """The simulated replica's prefix cache: the engine's own policy (:class:`serve.scale.policies.OursPolicy`:
    blocks of N = 16 tokens, checkpoints every C = 64 tokens + the replay boundary + the prompt's end, the same
    index and placement rule as the engine's :class:`serve.prefix.cache.PrefixCache`), unbounded."""
    return PolicyReplicaCache(OursPolicy("demo", SPEC.checkpoint_interval, block_size=SPEC.block_size),
                              CACHE_BUDGET_BYTES, max_running=SPEC.max_num_seqs)


async def server_traffic(url: str, records: list, batch: int = 16, prompt_tokens: int = 32,
                         rounds: int = REPEATS) -> None:
    """Calibration traffic for the server's own terms (separate from the replayed trace): ``rounds``
    rounds of one streaming request at an idle server, then ``batch`` concurrent streams of 16 tokens, then 4
    concurrent 256-token prompts; prompts of random printable bytes (no prefix hits). Every request's client
    record goes to ``records``, the lone requests' marked ``alone``."""
    rng = np.random.default_rng(1)
    prompt = lambda n: [int(x) for x in rng.integers(32, 127, n)]          # noqa: E731
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for _ in range(rounds):
            records.append({**await one_request(client, "kda-demo", prompt(prompt_tokens), 2), "alone": True})
            records += await asyncio.gather(*[one_request(client, "kda-demo", prompt(prompt_tokens), 16)
                                              for _ in range(batch)])
            records += await asyncio.gather(*[one_request(client, "kda-demo", prompt(256), 4) for _ in range(4)])


def served_model(svc: ServiceModel, server: dict, wall_per_cpu: float) -> ServiceModel:
    """``svc`` (fitted to the engine thread's CPU time, steps alone) as the server runs it: every step
    ``cpu_slowdown`` x ``wall_per_cpu`` times longer, plus ``after_fixed_ms`` per step and ``per_output_row_ms``
    per output row (the engine thread's work after each step), all from :func:`fit_server_terms`."""
    k = server["cpu_slowdown"] * wall_per_cpu
    out = svc.scaled(1 / k, 1 / k)
    return replace(out, decode_step_base_ms=out.decode_step_base_ms + server["after_fixed_ms"],
                   prefill_overhead_ms=out.prefill_overhead_ms + server["after_fixed_ms"],
                   per_output_row_ms=server["per_output_row_ms"],
                   source=svc.source + " + the server's terms fitted on its calibration traffic")


def predict(svc: ServiceModel, workload, hash_ids, rate: float, seed: int, ingress_ms: float = 0.0,
            egress_ms: float = 0.0, engine_cache: bool = True) -> dict:
    """The simulator's figures for the replay :func:`bench.serve_http.run_rate` sends at ``rate``: each request
    reaches the engine ``ingress_ms`` after it was sent and its first token reaches the client ``egress_ms``
    after the engine emits it. ``engine_cache``: the engine's checkpoint placement (:func:`server_cache`), else
    (the previous model) a block cache on the 64-token checkpoint grid only. Also returns the hit tokens."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(workload))
    arrivals = np.cumsum(gaps) * 1e3 + ingress_ms
    N, C = SPEC.block_size, SPEC.checkpoint_interval
    per = C // BLOCK_BYTES
    reqs = [FleetRequest(i, float(t), len(p), n, tuple(h[: -(-len(p) // N)]) if engine_cache else
                         tuple(hash(tuple(h[: per * (j + 1)])) for j in range((len(p) - 1) // C)))
            for i, ((p, n), h, t) in enumerate(zip(workload, hash_ids, arrivals))]
    cfg = FleetConfig(svc, num_replicas=1, router="round_robin", block_size=N if engine_cache else C,
                      cache_factory=server_cache if engine_cache else None)
    done = [r for r in simulate(reqs, cfg).results if r.status == "completed"]
    ttft = np.array([r.ttft_ms + ingress_ms + egress_ms for r in done])
    tpot = [(r.finish_ms - r.first_token_ms) / (r.output_length - 1) for r in done if r.output_length > 1]
    return dict(ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
                tpot_mean_ms=float(np.mean(tpot)), tpot_p50_ms=percentile(np.array(tpot), 50),
                request_throughput_rps=len(done) / (max(r.finish_ms for r in done)
                                                                                        / 1e3),
                hit_tokens=int(sum(r.hit_tokens for r in done)))


METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p50_ms", "request_throughput_rps")
# TPOT mean over 48 requests of 1-32 tokens is carried by the few 2-token requests whose one decode step lands
# behind a long prefill, which a timing difference of milliseconds decides; the P50 is reported beside it.


def errors(predicted: dict, measured: dict) -> dict:
    return {m: abs(predicted[m] - measured[m]) / measured[m] * 100 for m in METRICS}


def one_rate(svc: ServiceModel, wall_svc: ServiceModel, workload, hash_ids, rate: float, seed: int,
             tmp: Path) -> dict:
    """One fresh server: calibration traffic, the replay, calibration traffic again (all logged by
    ``--step-trace``); fit the server's terms on the calibration traffic around the replay (the other jobs'
    load drifts: before and after brackets it); predict the replay from ``svc`` (the engine-thread CPU-time
    step model) with them, and the variants."""
    load = os.getloadavg()[0]
    trace, cal, rec = tmp / f"steps_{rate}.jsonl", [], []
    half = -(-REPEATS // 2)
    with local_server(1024, 64, trace) as url:
        asyncio.run(server_traffic(url, [], rounds=1))       # warm-up; random bytes: the replay starts cold
        t_cal = time.perf_counter()
        asyncio.run(server_traffic(url, cal, rounds=half))
        t_replay = time.perf_counter()
        measured = asyncio.run(run_rate(url, "kda-demo", workload, rate, seed, rec))
        t_after = time.perf_counter()
        asyncio.run(server_traffic(url, cal, rounds=half))
    steps, reqs = read_step_trace(trace)
    before, after = in_window(steps, reqs, t_cal, t_replay), in_window(steps, reqs, t_after)
    cal_steps, cal_reqs = before[0] + after[0], before[1] + after[1]
    server = fit_server_terms(step_table(svc, cal_steps))
    alone = request_parts([(c, r) for c, r in match_requests(cal, cal_reqs) if c.get("alone")])
    # the lone requests' HTTP path: a burst of 16 queues each request behind the others' parsing, which the
    # replay's Poisson arrivals rarely see
    server.update(ingress_ms=statistics.median(alone["ingress"]), egress_ms=statistics.median(alone["egress"]))
    rep_steps, rep_reqs = in_window(steps, reqs, t_replay, t_after)
    parts = request_parts(match_requests(rec, rep_reqs))
    table = step_table(svc, rep_steps)
    replay_share = wall_per_cpu(table)
    step_check = {}
    for kind in ("decode", "prefill", "mixed"):
        g = [r for r in table if r["kind"] == kind]
        if g:
            k = server["cpu_slowdown"]
            step_check[kind] = dict(
                steps=len(g), measured_wall_ms=summary([r["measured_ms"] for r in g]),
                measured_cpu_ms=summary([r["cpu_ms"] for r in g]),
                predicted_cpu_ms=summary([k * r["predicted_ms"] for r in g]),
                cpu_abs_error_pct=summary([abs(k * r["predicted_ms"] / r["cpu_ms"] - 1) * 100 for r in g]),
                wall_per_cpu=wall_per_cpu(g), step_wall_per_cpu=summary([r["measured_ms"] / r["cpu_ms"] for r in g]),
                after_ms=summary([r["after_ms"] for r in g if r["after_ms"] is not None]),
                event_loop_cpu_share=sum(r["others_cpu_ms"] for r in g) / sum(r["measured_ms"] for r in g))
    ing, eg = server["ingress_ms"], server["egress_ms"]
    variants = {                                   # the same replay predicted with each piece added in turn
        "engine alone (wall-time steps), 64-token grid cache, ingress": predict(wall_svc, workload, hash_ids, rate,
                                                                               seed, ing, engine_cache=False),
        "+ the engine's checkpoint placement": predict(wall_svc, workload, hash_ids, rate, seed, ing),
        PREDICTION: predict(served_model(svc, server, server["wall_per_cpu"]), workload, hash_ids, rate, seed, ing,
                            eg),
        DIAGNOSTIC: predict(served_model(svc, server, replay_share), workload, hash_ids, rate, seed, ing, eg)}
    return dict(rate=rate, server=server, measured=measured, predicted=variants[PREDICTION],
                variants={k: {**v, "error_pct": errors(v, measured)} for k, v in variants.items()},
                step_check=step_check, replay_wall_per_cpu=replay_share, load_before=load,
                load_after=os.getloadavg()[0], parts={k: summary(v) for k, v in parts.items()},
                measured_hit_tokens=int(sum(parts["hit_tokens"])))


PREDICTION = "+ the server's terms fitted on its calibration traffic (the prediction)"
DIAGNOSTIC = "diagnostic, not a prediction: the same with the wall/CPU share measured during the replay"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.sim_vs_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--trace-dir", type=Path, default=None, help="keep the servers' step traces here (default: a "
                   "temporary folder)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)                                    # as the server (OMP_NUM_THREADS=1)
    load_before = os.getloadavg()
    model, fits, rows = load_model("demo"), {}, []
    workload = mooncake_workload(args.requests, 1024)
    hash_ids = [r.hash_ids for r in load_mooncake(TRACE)[: args.requests]]
    cal_load = os.getloadavg()[0]
    svc, wall_svc, points = calibrate(model)       # once: the CPU-time fit hardly moves with the other jobs' load
    calibration = {**points, "load_average_1min": [round(cal_load, 2), round(os.getloadavg()[0], 2)],
                   "cpu_model": {f: getattr(svc, f) for f in FIT_FIELDS},
                   "wall_model": {f: getattr(wall_svc, f) for f in FIT_FIELDS}}
    print("step model (engine-thread CPU time): " + ", ".join(f"{f} {getattr(svc, f):.4g}" for f in FIT_FIELDS))
    for row in points["steps"]:
        print(f"  {row['role']:8s} prefill {row['prompts']} x {row['prefill_tokens']:4d} after {row['cached_tokens']:3d}"
              f" + decode {row['decode_rows']:3d} x {row['decode_context']:3d}: measured "
              f"{row['measured_median_ms']:7.1f} ms  predicted {row['predicted_ms']:7.1f} ms (wall); measured "
              f"{row['cpu_median_ms']:7.1f} ms  predicted {row['cpu_predicted_ms']:7.1f} ms (CPU)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = args.trace_dir or Path(tmp)
        trace_dir.mkdir(parents=True, exist_ok=True)
        for rate in args.rates:
            res = one_rate(svc, wall_svc, workload, hash_ids, rate, args.seed, trace_dir)
            server = res["server"]
            fits[str(rate)] = {"server_terms": server,
                               "load_average_1min": [round(res["load_before"], 2), round(res["load_after"], 2)],
                               "replay_step_check": res["step_check"], "replay_request_parts_ms": res["parts"],
                               "replay_wall_per_cpu": res["replay_wall_per_cpu"],
                               "hit_tokens": {"measured": res["measured_hit_tokens"],
                                              "predicted": res["predicted"]["hit_tokens"]},
                               "variants": res["variants"]}
            print(f"rate {rate}: load {res['load_before']:.2f} -> {res['load_after']:.2f}", flush=True)
            print("  server (fitted on its calibration traffic): " + ", ".join(f"{k} {v:.3g}" for k, v in server.items()))
            for kind, c in res["step_check"].items():
                print(f"  replay {kind:7s} steps {c['steps']:4d}: CPU measured p50 {c['measured_cpu_ms']['p50']:6.1f} "
                      f"ms, predicted p50 {c['predicted_cpu_ms']['p50']:6.1f} ms, |error| p50 "
                      f"{c['cpu_abs_error_pct']['p50']:5.1f} %; wall p50 {c['measured_wall_ms']['p50']:6.1f} ms, "
                      f"wall/CPU {c['wall_per_cpu']:.2f} (per step P50 {c['step_wall_per_cpu']['p50']:.2f}, P99 "
                      f"{c['step_wall_per_cpu']['p99']:.2f}), event-loop CPU / wall {c['event_loop_cpu_share']:.2f}")
            print(f"  replay wall/CPU {res['replay_wall_per_cpu']:.2f} (calibration traffic "
                  f"{server['wall_per_cpu']:.2f})")
            print("  replay parts p50 / p99 (ms): " + ", ".join(f"{k} {v['p50']:.1f} / {v['p99']:.1f}"
                                                              for k, v in res["parts"].items() if k != "hit_tokens"))
            print(f"  hit tokens: measured {res['measured_hit_tokens']}, predicted {res['predicted']['hit_tokens']}")
            for name, v in res["variants"].items():
                print(f"  {name[:60]:60s} " + ", ".join(f"{m} {e:5.1f} %" for m, e in v["error_pct"].items()))
            for m in METRICS:
                meas, pred = res["measured"][m], res["predicted"][m]
                rows.append(dict(rate_rps=rate, metric=m, measured=meas, predicted=pred,
                                 error_pct=abs(pred - meas) / meas * 100))
                print(f"rate {rate:4.1f}  {m:24s} measured {meas:9.2f}  predicted {pred:9.2f}  "
                      f"error {rows[-1]['error_pct']:6.1f} %", flush=True)
    mape = {m: statistics.fmean(r["error_pct"] for r in rows if r["metric"] == m) for m in METRICS}
    print("MAPE over rates: " + ", ".join(f"{m} {v:.1f} %" for m, v in mape.items()))
    out = {"meta": {"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "requests": args.requests,
                    "rates_rps": args.rates, "seed": args.seed, "calibration_repeats": REPEATS,
                    "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, torch threads 1",
                    "load_average_1min": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
                    "server": "python -m serve.http, batched engine, max_num_seqs 64, prefix cache on",
                    "calibration": calibration, "fitted_service_model_per_rate": fits},
           "rows": rows, "mape_pct": mape}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return out


FIT_FIELDS = ("prefill_tokens_per_s", "prefill_overhead_ms", "prefill_per_row_ms", "prefill_per_token_pair_ms",
              "prefill_off_grid_per_token_ms",
              "decode_step_base_ms",
              "decode_step_per_seq_ms", "decode_per_context_token_ms")


if __name__ == "__main__":
    main()
