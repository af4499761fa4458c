"""The fleet simulator against the real engine, on two clocks: ``python -m bench.sim_vs_engine [--quick]``.

calibrate -> replay -> score, re-runnable on any engine (:mod:`serve.fleet.engine_replay`):
1. Warm-up: one replay, discarded (allocator, lazy initialisation).
2. Strict replays (the engine's clock advances by each step's thread CPU time, 1 torch thread): the CALIBRATION
   replays (other Mooncake windows, other rates), the HELD-OUT replay (another window and rate) and the SCORED
   replays (window 0 at each of ``--rates``), interleaved so that the host's state drifts over all of them alike.
3. Fit the service model's step-time terms (:mod:`serve.fleet.engine_replay.fit`) on the calibration replays'
   steps only; check them step by step on the held-out and the scored replays (never fitted on them).
4. Predict each scored replay with the simulator (:mod:`serve.fleet.engine_replay.predict`) on the same clock;
   error per metric and rate, MAPE over the rates.
5. Wall-clock replays: the first ``--wall-requests`` of the scored traces on ``time.perf_counter``,
   ``--wall-repeats`` rounds, each a wall-clock CALIBRATION replay (another window) and then every rate once; the
   simulator predicts them with the CPU-time terms times the wall / CPU ratio of the calibration replays (the
   host's share of the cores in those minutes, and the driver's bookkeeping between steps).
   Reported: the measured spread over the repeats, the error of the prediction against the median and each
   repeat, the load average, and the host's noise (each step's wall / CPU time).
Writes ``bench/results/sim_vs_engine.json`` and its section of ``bench/README.md`` (``--readme-only`` rewrites
the section from the file).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from bench.readme import write_section
from serve.fleet.engine_replay.driver import replay, replay_lockstep
from serve.fleet.engine_replay.fit import (
    TERMS,
    fit_terms,
    scaled_terms,
    service_model,
    step_errors_pct,
    wall_per_cpu,
)
from serve.fleet.engine_replay.metrics import METRICS, abs_pct_error, replay_metrics
from serve.fleet.engine_replay.predict import predict
from serve.fleet.engine_replay.workload import mooncake_requests
from serve.http.model import load_model

OUT = Path(__file__).parent / "results" / "sim_vs_engine.json"
README = Path(__file__).parent / "README.md"
CALIBRATION = ((400, 3.0), (600, 12.0), (800, 6.0), (1400, 20.0))   # (trace window start, rate req/s): fitted on
HELD_OUT = ((1000, 5.0),)                                 # checked on, never fitted
WALL_CALIBRATION = (1200, 10.0)                           # wall clock: the host's wall / CPU, each round
SCORED_START = 0


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _summary(x) -> dict:
    x = np.asarray(x, dtype=float)
    return dict(median=float(np.median(x)), p10=float(np.percentile(x, 10)), p90=float(np.percentile(x, 90)),
                min=float(x.min()), max=float(x.max()), n=int(len(x)))


def run(requests: int, rates: list[float], slots: int, strict_repeats: int, wall_repeats: int,
        wall_requests: int, log=print) -> dict:
    """Run the whole comparison (module docstring); returns the results record."""
    model, t_start, load_start = load_model("demo"), time.perf_counter(), _load()
    cal = [mooncake_requests(s, requests, r) for s, r in CALIBRATION]
    held = [mooncake_requests(s, requests, r) for s, r in HELD_OUT]
    scored = {r: mooncake_requests(SCORED_START, requests, r) for r in rates}
    replay(cal[0], slots, "cpu", model=model)                                           # warm-up
    plan = ([("calibration", i, q) for i, q in enumerate(cal)] + [("held out", i, q) for i, q in enumerate(held)]
            + [("scored", (r, k), scored[r]) for k in range(strict_repeats) for r in rates])
    load = _load()
    t0 = time.perf_counter()
    runs = replay_lockstep([q for *_, q in plan], slots, model=model)
    strict = {(role, key): r for (role, key, _), r in zip(plan, runs)}
    log(f"strict: {len(plan)} replays in lockstep, {sum(len(r.steps) for r in runs)} steps, "
        f"{sum(s.cpu_ms for r in runs for s in r.steps) / 1e3:.1f} s CPU in {time.perf_counter() - t0:.0f} s, "
        f"load {load} -> {_load()}")
    cal_steps = [s for (role, _), r in strict.items() if role == "calibration" for s in r.steps]
    terms = fit_terms(cal_steps)
    svc = service_model(terms, slots, "fitted to the thread CPU time of the calibration replays' steps")
    step_check = {}
    for (role, key), r in strict.items():
        name = f"{role} {key[0]:g} #{key[1]}" if role == "scored" else f"{role} {key}"
        step_check[name] = _summary(step_errors_pct(svc, r.steps))
    rows = []
    for rate in rates:
        reps = [strict[("scored", (rate, k))] for k in range(strict_repeats)]
        ms = [replay_metrics(r.times) for r in reps]
        pred = predict(scored[rate], svc)
        m, p = {k: statistics.median(x[k] for x in ms) for k in METRICS}, replay_metrics(pred.times)
        rows.append(dict(rate=rate, measured=m, predicted=p, error_pct=abs_pct_error(p, m),
                         measured_spread={k: [min(x[k] for x in ms), max(x[k] for x in ms)] for k in METRICS},
                         hit_tokens={"measured": sum(reps[0].hit_tokens), "predicted": sum(pred.hit_tokens)},
                         steps=len(reps[0].steps), busy_cpu_s=sum(s.cpu_ms for s in reps[0].steps) / 1e3))
    wall_runs, wall_cal = {r: [] for r in rates}, []
    wall_scored = {r: q[:wall_requests] for r, q in scored.items()}
    wall_cal_reqs = mooncake_requests(WALL_CALIBRATION[0], wall_requests, WALL_CALIBRATION[1])
    for k in range(wall_repeats):                       # round k: a calibration replay, then every rate once
        wall_cal.append(replay(wall_cal_reqs, slots, "wall", model=model))
        for rate in rates:
            load = _load()
            run_ = replay(wall_scored[rate], slots, "wall", model=model)
            wall_runs[rate].append(dict(metrics=replay_metrics(run_.times), load=load,
                                        wall_per_cpu=[s.wall_ms / s.cpu_ms for s in run_.steps if s.cpu_ms > 0]))
            log(f"wall round {k + 1} rate {rate}: load {load}")
    factor = wall_per_cpu([s for r in wall_cal for s in r.steps])
    wall_terms = scaled_terms(terms, factor)
    wall_svc = service_model(wall_terms, slots, f"the CPU-time terms x {factor:.3f}, the wall / CPU of the wall-clock "
                             "calibration replays")
    log(f"wall / CPU of the wall-clock calibration replays: {factor:.3f}")
    wall_rows = []
    for rate in rates:
        reps = wall_runs[rate]
        med = {m: statistics.median(r["metrics"][m] for r in reps) for m in METRICS}
        pred = replay_metrics(predict(wall_scored[rate], wall_svc).times)
        wall_rows.append(dict(rate=rate, measured_median=med, predicted=pred, error_pct=abs_pct_error(pred, med),
                              measured_spread={m: [min(r["metrics"][m] for r in reps),
                                                   max(r["metrics"][m] for r in reps)] for m in METRICS},
                              error_pct_per_repeat={m: [abs(pred[m] / r["metrics"][m] - 1) * 100 for r in reps]
                                                    for m in METRICS},
                              load_average_1min=[r["load"] for r in reps],
                              step_wall_per_cpu=_summary([x for r in reps for x in r["wall_per_cpu"]])))
    strict_cpu = [s.wall_ms / s.cpu_ms for r in runs for s in r.steps if s.cpu_ms > 0]
    mape = lambda rs: {m: float(np.mean([r["error_pct"][m] for r in rs])) for m in METRICS}      # noqa: E731
    return dict(
        meta=dict(measured=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), requests=requests, rates_rps=rates,
                  state_slots=slots, strict_repeats=strict_repeats, wall_repeats=wall_repeats,
                  wall_requests=wall_requests, machine=f"{platform.machine()} CPU, "
                  f"{os.cpu_count()} cores, torch threads 1", load_average_1min=[load_start, _load()],
                  seconds=round(time.perf_counter() - t_start, 1),
                  engine="serve.http.model.build_engine: batched, prefix cache on, whole-prompt prefill, fp32 states, "
                         f"{slots} state slots",
                  trace="Mooncake conversation trace: window from line 0 (scored), lengths / 32, shared 64-token "
                        "system prefix, arrivals stretched to the rate",
                  calibration=[dict(window=s, rate=r) for s, r in CALIBRATION],
                  held_out=[dict(window=s, rate=r) for s, r in HELD_OUT]),
        terms=dict(cpu=terms, wall=wall_terms, names=list(TERMS), wall_per_cpu=factor,
                   wall_calibration=dict(window=WALL_CALIBRATION[0], rate=WALL_CALIBRATION[1])),
        step_check_pct=step_check,
        strict=dict(rows=rows, mape_pct=mape(rows)),
        wall=dict(rows=wall_rows, mape_pct=mape(wall_rows),
                  host_noise=dict(step_wall_per_cpu_strict=_summary(strict_cpu),
                                  step_wall_per_cpu_wall=_summary([x for r in wall_runs.values() for rep in r
                                                                   for x in rep["wall_per_cpu"]]))))


NAMES = {"ttft_p50_ms": "TTFT P50", "ttft_p99_ms": "TTFT P99", "tpot_mean_ms": "TPOT mean", "tpot_p50_ms": "TPOT P50",
         "e2e_mean_ms": "E2E mean", "request_throughput_rps": "req/s"}


def tables(rec: dict) -> str:
    """Both comparisons as markdown: per rate, measured / predicted (error %) per metric; MAPE per metric."""
    def fmt(v):
        return f"{v:,.3g}" if v < 100 else f"{v:,.0f}"

    meta, out = rec["meta"], []
    for name, key, mkey in (("Strict replay (CPU-time clock)", "strict", "measured"),
                            ("Wall-clock replay (median of the repeats)", "wall", "measured_median")):
        out += [f"**{name}**: measured / predicted (error)", "",
                "| rate (req/s) | " + " | ".join(NAMES[m] for m in METRICS) + " |",
                "|---" * (len(METRICS) + 1) + "|"]
        for r in rec[key]["rows"]:
            out.append(f"| {r['rate']:g} | " + " | ".join(
                f"{fmt(r[mkey][m])} / {fmt(r['predicted'][m])} ({r['error_pct'][m]:.1f} %)" for m in METRICS) + " |")
        out.append("| **MAPE** | " + " | ".join(f"**{rec[key]['mape_pct'][m]:.1f} %**" for m in METRICS) + " |")
        out.append("")
    noise = rec["wall"]["host_noise"]
    out.append(f"{meta['requests']} requests per replay, {meta['state_slots']} state slots, load average "
               f"{meta['load_average_1min'][0]} -> {meta['load_average_1min'][1]}, {meta['wall_repeats']} wall-clock "
               f"repeats; a step's wall / CPU time: median {noise['step_wall_per_cpu_wall']['median']:.2f} "
               f"(P10 {noise['step_wall_per_cpu_wall']['p10']:.2f}, P90 {noise['step_wall_per_cpu_wall']['p90']:.2f}) "
               "in the wall-clock replays.")
    return "\n".join(out)


def write_readme_section(rec: dict, path: Path = README) -> None:
    """Replace the ``## sim_vs_engine.json`` section of ``path`` with one made from ``rec``."""
    meta = rec["meta"]
    held = ", ".join(f"{k} {v['median']:.1f} %" for k, v in rec["step_check_pct"].items() if k.startswith("held"))
    body = (f"`python -m bench.sim_vs_engine` ({meta['measured']}, {meta['seconds']:.0f} s; `--quick` for a short "
            "run) replays a Mooncake-shaped trace with shared prefixes through the real engine, on a strict clock "
            "(each step's thread CPU time) and on the wall clock, and predicts the same replays with the fleet "
            "simulator. The simulator's step-time terms are fitted on calibration replays (other trace windows and "
            f"rates) and checked step by step on a held-out replay (median step error {held}), never on the "
            f"scored replays. Prefix-cache hits and the {meta['state_slots']} state slots are in play; preemption "
            "is not (the engine reserves a request's final pages at admission and preempts only when asked).\n\n"
            + tables(rec) + "\n")
    write_section("## sim_vs_engine.json", body, "## state_dtype.json", path)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.sim_vs_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0, 8.0, 16.0])
    p.add_argument("--slots", type=int, default=4, help="state slots (most running requests)")
    p.add_argument("--strict-repeats", type=int, default=3, help="strict replays of each scored rate (median)")
    p.add_argument("--wall-repeats", type=int, default=5)
    p.add_argument("--wall-requests", type=int, default=16, help="the first N requests of each scored replay")
    p.add_argument("--quick", action="store_true", help="16 requests, 1 strict and 3 wall-clock repeats")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--readme-only", action="store_true", help="rewrite bench/README.md's section from --out")
    args = p.parse_args(argv)
    if args.readme_only:
        rec = json.loads(args.out.read_text())
    else:
        if args.quick:
            args.requests, args.strict_repeats, args.wall_repeats, args.wall_requests = 16, 1, 3, 8
        rec = run(args.requests, args.rates, args.slots, args.strict_repeats, args.wall_repeats, args.wall_requests)
        args.out.write_text(json.dumps(rec, indent=1) + "\n")
    print(tables(rec))
    if args.out == OUT:
        write_readme_section(rec)
    return rec


if __name__ == "__main__":
    main()
