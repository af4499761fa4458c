"""The fleet simulator's error against the real engine behind the HTTP server: ``python -m bench.sim_vs_engine``.

1. Calibrate (Vidur-style operator profiling, here through the engine's public API on this machine), right
   before each rate's replay (the shared CPU's speed drifts): steps of the BATCHED engine, built as the server
   builds it: prefill of one prompt at 32 / 128 / 256 / 512 tokens, decode at batch 1 / 4 / 16 with 32- and
   512-token contexts, each the median of 5 interleaved repeats after a warm-up round; fitted by least squares
   to :class:`serve.fleet.sim.service_model.ServiceModel` with ``mixed_steps`` (step = fixed cost, larger with
   prefill rows, + prefill tokens / rate + padded decode rows * per_seq + rows * context * per_context_token).
   Two mixed steps (prefill + decode rows) are measured and NOT fitted: the step model's held-out check.
2. Measure: the Mooncake-conversation-shaped replay of :mod:`bench.serve_http` through a fresh
   ``python -m serve.http`` per rate (Poisson arrivals, seeded; streaming client in another process).
3. Predict: the same requests (same arrival times, lengths and prefix hashes, grouped by the engine's
   64-token checkpoint interval since the engine resumes only from a checkpoint) through
   :func:`serve.fleet.sim.simulation.simulate` with one replica and the calibrated model.
Reports per rate and metric the measured value, the prediction and the error, and the MAPE over rates per
metric (TTFT P50 / P99, TPOT mean, request throughput). Fitted, predicted and measured are kept apart. The
server's own costs (ingress, per streaming row per step) are measured through HTTP on separate requests before
each replay and added to the prediction. What the simulator still leaves out: how the HTTP event loop and the
engine thread contend for the GIL and the cores as streams multiply, checkpoint restores and publishes on
prefix hits, and the shared CPU's speed drifting during a replay. TPOT mean is fragile on this trace: outputs
are short (mean 11 tokens), so one mixed step with a long prefill dominates a 2-token request's TPOT.
Writes ``bench/results/sim_vs_engine.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import torch

from bench.serve_http import BLOCK_BYTES, TRACE, local_server, mooncake_workload, one_request, run_rate
from serve.fleet.sim.service_model import ServiceModel
from serve.fleet.sim.simulation import simulate
from serve.fleet.sim.types import FleetConfig, FleetRequest, percentile
from serve.http.model import EngineSpec, build_engine, load_model
from serve.model_runner import DECODE_BUCKETS
from serve.request import RequestStatus
from serve.traces.mooncake import load_mooncake

OUT = Path(__file__).parent / "results" / "sim_vs_engine.json"
REPEATS = 5


def calibrate(model, prefill_lengths=(32, 128, 256, 512), batches=(1, 4, 16), contexts=(32, 512),
              held_out=((128, 4, 256), (256, 16, 128))) -> tuple[ServiceModel, dict]:
    """Fit the simulator's step model to steps of the BATCHED engine timed on this machine.

    Points: a prefill step of one prompt of each of ``prefill_lengths`` tokens (no decode rows) and a decode
    step of ``batches`` running requests of each of ``contexts`` tokens (no prefill rows); each the median of
    :data:`REPEATS` timings after one warm-up round, the points interleaved (round r times every point once),
    on the server's engine (prefix cache on, max_num_seqs 64). Fitted by least squares to
    ``step_ms = fixed + prefill_tokens / rate * 1000 + rows * (per_seq + per_context_token * context)`` (one
    fixed cost per step, larger when the step has a prefill row; the attention layers' decode reads each row's
    KV), the engine's mixed step. The
    ``held_out`` (prefill tokens, decode rows, context) steps are mixed steps measured the same way and NOT
    fitted: their prediction error validates the additive step model.
    Returns the :class:`ServiceModel` (``mixed_steps=True``) and the measured points with their spread."""
    rng = np.random.default_rng(0)

    def step(n: int, b: int, ctx: int) -> float:
        """ms of the one engine step that runs ``b`` decode rows of ``ctx`` tokens and one ``n``-token prefill row."""
        engine = build_engine(EngineSpec(max_num_seqs=64), model)
        rids = [engine.submit(rng.integers(0, 256, ctx).tolist(), 8) for _ in range(b)]
        while any(engine.result(r).status is not RequestStatus.DECODE for r in rids):
            engine.step()
        if n:
            engine.submit(rng.integers(0, 256, n).tolist(), 2)
        t0 = time.perf_counter()
        engine.step()
        return (time.perf_counter() - t0) * 1e3

    fitted = [(n, 0, 0) for n in prefill_lengths] + [(0, b, c) for c in contexts for b in batches]
    points = fitted + list(held_out)
    times: dict[tuple, list] = {pt: [] for pt in points}
    for r in range(REPEATS + 1):                           # round 0 is the warm-up
        for pt in points:
            t = step(*pt)
            if r:
                times[pt].append(t)
    med = {pt: statistics.median(v) for pt, v in times.items()}
    a = np.array([[n > 0, n == 0, n, b, b * c] for n, b, c in fitted], dtype=float)
    (fixed_p, fixed, per_tok, per_seq, per_ctx), *_ = np.linalg.lstsq(a, np.array([med[pt] for pt in fitted]),
                                                                      rcond=None)
    fixed_p, fixed = max(fixed_p, 0.0), max(fixed, 1e-3)
    per_tok, per_seq, per_ctx = max(per_tok, 1e-6), max(per_seq, 0.0), max(per_ctx, 0.0)
    svc = ServiceModel(prefill_tokens_per_s=1000.0 / per_tok, prefill_overhead_ms=fixed_p,
                       decode_step_base_ms=fixed, decode_step_per_seq_ms=per_seq, max_batch_requests=64,
                       decode_per_context_token_ms=per_ctx, decode_buckets=DECODE_BUCKETS,
                       mixed_steps=True, source="fitted to batched-engine steps measured on this machine")
    rows = [dict(prefill_tokens=n, decode_rows=b, decode_context=c, role="fitted" if (n, b, c) in fitted
                 else "held out", measured_median_ms=med[(n, b, c)], measured_min_ms=min(times[(n, b, c)]),
                 measured_max_ms=max(times[(n, b, c)]), predicted_ms=(fixed_p + n * per_tok if n else fixed) + b * (per_seq + per_ctx * c))
            for n, b, c in points]
    return svc, {"steps": rows, "repeats": REPEATS}


CHECKPOINT_INTERVAL = EngineSpec().checkpoint_interval     # the server's KDA checkpoint grid (tokens)


def _checkpoint_hashes(block_hashes, chunks: int, per: int) -> tuple[int, ...]:
    """One id per whole checkpoint interval of the prompt, naming its prefix: the engine resumes a prompt only
    from a KDA checkpoint (every ``CHECKPOINT_INTERVAL`` tokens, at least one token left to compute), so the
    simulator's block cache gets blocks of that size instead of the trace's 16-byte hash blocks."""
    return tuple(hash(tuple(block_hashes[: per * (i + 1)])) for i in range(chunks))


async def serving_overhead(url: str, svc: ServiceModel, batch: int = 16, prompt_tokens: int = 32) -> dict:
    """The server's own costs beyond the engine steps, timed through HTTP (not on the replayed trace):
    ``ingress_ms`` = median TTFT of one streaming request of ``prompt_tokens`` at an idle server minus the
    fitted prefill step of that prompt (parse, hand-off to the engine thread, first SSE event);
    ``per_row_ms`` = (median inter-token gap of ``batch`` concurrent streams minus the fitted decode step of
    ``batch`` rows) / ``batch`` (each row's SSE event, sharing the GIL with the engine thread). Medians of
    :data:`REPEATS` interleaved rounds after a warm-up round; never negative."""
    rng = np.random.default_rng(1)
    prompt = lambda: [int(x) for x in rng.integers(32, 127, prompt_tokens)]          # noqa: E731  (no prefix hits)
    ttfts, gaps = [], []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for r in range(REPEATS + 1):
            one = await one_request(client, "kda-demo", prompt(), 2)
            many = await asyncio.gather(*[one_request(client, "kda-demo", prompt(), 16) for _ in range(batch)])
            if r:
                ttfts.append(one["ttft"] * 1e3)
                gaps.append(statistics.median(g for m in many for g in m["itl"][2:]) * 1e3)
    ttft, gap = statistics.median(ttfts), statistics.median(gaps)
    step = svc.decode_step_ms(batch, prompt_tokens + 8)
    return dict(ingress_ms=max(0.0, ttft - svc.prefill_ms(prompt_tokens)), per_row_ms=max(0.0, (gap - step) / batch),
                idle_ttft_ms=ttft, batch_gap_ms=gap, batch=batch)


def predict(svc: ServiceModel, workload, hash_ids, rate: float, seed: int, ingress_ms: float = 0.0) -> dict:
    """The simulator's figures for the replay :func:`bench.serve_http.run_rate` sends at ``rate``; each request
    reaches the engine ``ingress_ms`` after it was sent (its TTFT counts from the send)."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(workload))
    arrivals = np.cumsum(gaps) * 1e3 + ingress_ms
    per = CHECKPOINT_INTERVAL // BLOCK_BYTES
    reqs = [FleetRequest(i, float(t), len(p), n, _checkpoint_hashes(h, (len(p) - 1) // CHECKPOINT_INTERVAL, per))
            for i, ((p, n), h, t) in enumerate(zip(workload, hash_ids, arrivals))]
    res = simulate(reqs, FleetConfig(svc, num_replicas=1, router="round_robin", block_size=CHECKPOINT_INTERVAL))
    done = [r for r in res.results if r.status == "completed"]
    ttft = np.array([r.ttft_ms + ingress_ms for r in done])
    tpot = [(r.finish_ms - r.first_token_ms) / (r.output_length - 1) for r in done if r.output_length > 1]
    return dict(ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
                tpot_mean_ms=float(np.mean(tpot)), request_throughput_rps=len(done) / (max(r.finish_ms for r in done)
                                                                                        / 1e3))


METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms", "request_throughput_rps")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.sim_vs_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)                                    # as the server (OMP_NUM_THREADS=1)
    load_before = os.getloadavg()
    model, fits = load_model("demo"), {}
    workload = mooncake_workload(args.requests, 1024)
    hash_ids = [r.hash_ids for r in load_mooncake(TRACE)[: args.requests]]
    rows = []
    for rate in args.rates:
        svc, points = calibrate(model)            # right before its replay: the shared CPU's speed drifts
        fits[str(rate)] = {**points, "prefill_tokens_per_s": svc.prefill_tokens_per_s,
                           "prefill_overhead_ms": svc.prefill_overhead_ms,
                           "decode_step_base_ms": svc.decode_step_base_ms,
                           "decode_step_per_seq_ms": svc.decode_step_per_seq_ms,
                           "decode_per_context_token_ms": svc.decode_per_context_token_ms}
        print(f"fitted: step {svc.decode_step_base_ms:.1f} ms ({svc.prefill_overhead_ms:.1f} ms with prefill rows) + prefill {svc.prefill_tokens_per_s:.0f} tok/s + "
              f"{svc.decode_step_per_seq_ms:.2f} ms x decode rows + {svc.decode_per_context_token_ms * 1e3:.2f} us x "
              f"decode rows x context", flush=True)
        for row in points["steps"]:
            print(f"  {row['role']:8s} prefill {row['prefill_tokens']:4d} + decode {row['decode_rows']:3d} x "
                  f"{row['decode_context']:3d}: measured "
                  f"{row['measured_median_ms']:7.1f} ms  predicted {row['predicted_ms']:7.1f} ms", flush=True)
        with local_server(1024, 64) as url:
            asyncio.run(run_rate(url, "kda-demo", workload[:2], rate, args.seed))          # warm-up
            overhead = asyncio.run(serving_overhead(url, svc))
            measured = asyncio.run(run_rate(url, "kda-demo", workload, rate, args.seed))
        fits[str(rate)]["server_overhead"] = overhead
        print(f"server: ingress {overhead['ingress_ms']:.1f} ms, {overhead['per_row_ms']:.2f} ms per streaming row "
              "per step", flush=True)
        served = replace(svc, decode_step_per_seq_ms=svc.decode_step_per_seq_ms + overhead["per_row_ms"],
                         source=svc.source + " + the server's measured per-row streaming cost")
        predicted = predict(served, workload, hash_ids, rate, args.seed, overhead["ingress_ms"])
        for m in METRICS:
            err = abs(predicted[m] - measured[m]) / measured[m] * 100
            rows.append(dict(rate_rps=rate, metric=m, measured=measured[m], predicted=predicted[m], error_pct=err))
            print(f"rate {rate:4.1f}  {m:24s} measured {measured[m]:9.2f}  predicted {predicted[m]:9.2f}  "
                  f"error {err:6.1f} %", flush=True)
    mape = {m: statistics.fmean(r["error_pct"] for r in rows if r["metric"] == m) for m in METRICS}
    print("MAPE over rates: " + ", ".join(f"{m} {v:.1f} %" for m, v in mape.items()))
    out = {"meta": {"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "requests": args.requests,
                    "rates_rps": args.rates, "seed": args.seed, "calibration_repeats": REPEATS,
                    "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, torch threads 1",
                    "load_average_1min": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
                    "server": "python -m serve.http, batched engine, max_num_seqs 64, prefix cache on",
                    "fitted_service_model_per_rate": fits},
           "rows": rows, "mape_pct": mape}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
