"""Benchmark of continuous batching: ``python -m bench.batch``.

Decode throughput of ``ServeEngine`` on the demo model (8 layers: 6 KDA + 2 MLA, d = 128) at batch
B = 1, 2, 4, ..., 64 (B requests with 32-token prompts, all decoding; one step = one token per request),
and the batch-1 baseline at B = 8 (the same engine with ``rows_per_forward=1``: the same 8 rows, each in its
own forward, one after the other), all in one run: after a warm-up, every repeat times ``--steps`` decode steps
of every configuration in turn
(interleaved, so machine load hits all alike). Reported: median tokens/s with min-max over repeats,
ms per step, speedup against batch 1 of the same run, and a least-squares fit
``ms/step = fixed + per_row * B`` (fitted, on the measured B <= 64) separating the per-step fixed cost
from the per-row cost. On a shared machine the medians carry the other jobs' load, so the ratio of the
fastest repeats (least disturbed) is reported next to the medians. One torch thread.
Writes ``bench/results/batch.json``.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from kda_core.model import HybridLM
from lab.batching import DECODE_PROMPT_TOKENS, decoding_engine, time_steps
from serve.config import ServeConfig
from serve.engine import EngineArgs, build_engine

OUT = Path(__file__).parent / "results" / "batch.json"
BATCHES = (1, 2, 4, 8, 16, 32, 64)
BASELINE_BATCH = 8          # B of the one-row-per-forward baseline


def run(batches=BATCHES, steps: int = 5, repeats: int = 5, warmup: int = 2) -> dict:
    torch.set_num_threads(1)
    model = HybridLM()
    budget = warmup + steps * repeats + 2
    configs = [("new", b) for b in batches] + [("old", BASELINE_BATCH)]
    engines = {c: decoding_engine(model, c[1], budget, rows_per_forward=None if c[0] == "new" else 1)
               for c in configs}
    for eng in engines.values():
        time_steps(eng, warmup)
    secs = {c: [] for c in configs}
    for _ in range(repeats):                                   # interleaved: every config once per repeat
        for c in configs:
            secs[c].append(time_steps(engines[c], steps))
    rows = []
    base = statistics.median(steps * 1 / s for s in secs[("new", 1)])
    for c in configs:
        tps = [steps * c[1] / s for s in secs[c]]
        rows.append({"engine": "batched" if c[0] == "new" else "one row per forward", "batch": c[1],
                     "tokens_per_s": statistics.median(tps), "tokens_per_s_min": min(tps),
                     "tokens_per_s_max": max(tps), "ms_per_step": statistics.median(secs[c]) / steps * 1e3,
                     "speedup_vs_batch1": statistics.median(tps) / base,
                     "speedup_vs_batch1_best": max(tps) / max(steps / s for s in secs[("new", 1)])})
    old, new = secs[("old", BASELINE_BATCH)], secs[("new", BASELINE_BATCH)]
    ratios = [n / o for n, o in zip(new, old)]                 # paired per repeat
    xs = [r["batch"] for r in rows if r["engine"] == "batched"]
    ys = [r["ms_per_step"] for r in rows if r["engine"] == "batched"]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    per_row = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"rows": rows,
            "batched_over_one_row_per_forward_time": {
                "batch": BASELINE_BATCH, "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                "best_over_best": min(new) / min(old)},
            "fit_ms_per_step": {"fixed_ms": my - per_row * mx, "per_row_ms": per_row, "kind": "fitted"},
            "conditions": {"model": "demo", "prompt_tokens": DECODE_PROMPT_TOKENS, "steps_per_repeat": steps,
                           "repeats": repeats, "warmup_steps": warmup, "torch_threads": 1,
                           "context_tokens": [DECODE_PROMPT_TOKENS + warmup, DECODE_PROMPT_TOKENS + budget],
                           "machine": platform.processor() or platform.machine(), "torch": torch.__version__}}


def trace_prompts(trace, block_size: int = 16) -> list[list[int]]:
    """Byte prompts for trace requests: block i of a prompt is 16 seeded bytes of its ``hash_ids[i]``
    (requests that share blocks share those bytes), cut to ``input_length``."""
    out = []
    for r in trace:
        toks = []
        for h in r.hash_ids:
            toks += torch.randint(0, 256, (block_size,), generator=torch.Generator().manual_seed(int(h))).tolist()
        out.append(toks[: r.input_length] or [0])
    return out


def run_trace(model: HybridLM, trace, prompts, max_num_seqs: int, num_state_slots: int,
              time_scale: float = 1.0) -> dict:
    """Replay ``trace`` in wall-clock time (arrival ms x ``time_scale``) through a batched engine;
    returns requests/s, TTFT and TPOT P50 / P99 (ms, measured) and the peak running requests."""
    eng = build_engine(EngineArgs(model, 4096, ServeConfig(16, 16, page_policy="unified"), max_num_seqs=max_num_seqs,
                                  num_state_slots=num_state_slots))
    pending = sorted(zip((r.timestamp_ms * time_scale for r in trace), prompts, (r.output_length for r in trace)),
                     key=lambda x: x[0])
    t0, rids, peak = time.perf_counter(), [], 0
    while pending or eng.waiting or eng.running:
        now_ms = (time.perf_counter() - t0) * 1e3
        while pending and pending[0][0] <= now_ms:
            _, p, n = pending.pop(0)
            rids.append(eng.submit(p, n))
        if not eng.step() and pending:
            time.sleep(min(0.002, max(0.0, (pending[0][0] - now_ms) / 1e3)))
        peak = max(peak, len(eng.running))
    wall = time.perf_counter() - t0
    reqs = [eng.requests[r] for r in rids]
    ttft = sorted((q.first_token_t - q.submit_t) * 1e3 for q in reqs)
    tpot = sorted((q.finish_t - q.first_token_t) * 1e3 / (len(q.output) - 1) for q in reqs if len(q.output) > 1)
    pct = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")  # noqa: E731
    return {"max_num_seqs": max_num_seqs, "num_state_slots": num_state_slots, "requests": len(reqs),
            "requests_per_s": len(reqs) / wall, "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p99": pct(ttft, 0.99),
            "tpot_ms_p50": pct(tpot, 0.5), "tpot_ms_p99": pct(tpot, 0.99), "peak_running": peak}


MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def mooncake_scaled(num_requests: int = 32, span_s: float = 2.0) -> list:
    """The first ``num_requests`` of the Mooncake conversation trace scaled to the demo model's context:
    one 512-token hash block becomes 16 tokens (lengths / 32; outputs kept in [2, 48]) and the arrivals
    are squeezed into ``span_s`` seconds keeping their shape."""
    from serve.traces.mooncake import load_mooncake
    trace = load_mooncake(MOONCAKE)[:num_requests]
    t0 = trace[0].timestamp_ms
    span = max(1, trace[-1].timestamp_ms - t0)
    return [t._replace(timestamp_ms=int((t.timestamp_ms - t0) * span_s * 1e3 / span),
                       input_length=max(1, t.input_length // 32),
                       output_length=max(2, min(48, t.output_length // 32))) for t in trace]


def trace_sweep(num_requests: int = 32, seqs=(1, 4, 16), slots=(4, 16)) -> list[dict]:
    """Two traces through the engine for every (max_num_seqs, num_state_slots): the synthetic
    conversation-like trace (``serve.traces.mooncake.synthesize``) scaled to the demo model's context (prompts
    ~64 tokens, outputs ~16, arrivals within ~1 s), and the first requests of the Mooncake conversation
    trace scaled by :func:`mooncake_scaled`."""
    from serve.traces.mooncake import synthesize
    torch.set_num_threads(1)
    model = HybridLM()
    synth = synthesize(num_requests, duration_s=1.0, seed=0, block_size=16, median_first_prompt_tokens=64,
                       median_turn_tokens=24, median_output_tokens=16, max_input_tokens=256)
    synth = [t._replace(output_length=max(2, min(t.output_length, 48))) for t in synth]
    out = []
    for name, trace in (("synthetic", synth), ("mooncake conversation", mooncake_scaled(num_requests))):
        prompts = trace_prompts(trace)
        out += [{"trace": name, **run_trace(model, trace, prompts, s, k)} for s in seqs for k in slots]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--trace", action="store_true", help="also replay the synthetic trace (TTFT / TPOT sweep)")
    args = ap.parse_args(argv)
    res = run(steps=args.steps, repeats=args.repeats)
    print(f"{'engine':<32}{'B':>4}{'tok/s':>10}{'(min-max)':>18}{'ms/step':>10}{'x batch 1':>11}{'best/best':>11}")
    for r in res["rows"]:
        print(f"{r['engine']:<32}{r['batch']:>4}{r['tokens_per_s']:>10.0f}"
              f"{r['tokens_per_s_min']:>9.0f}-{r['tokens_per_s_max']:<8.0f}{r['ms_per_step']:>10.2f}"
              f"{r['speedup_vs_batch1']:>11.2f}{r['speedup_vs_batch1_best']:>11.2f}")
    q, f = res["batched_over_one_row_per_forward_time"], res["fit_ms_per_step"]
    print(f"B = {q['batch']} step time, one forward / one row per forward (paired per repeat): median {q['median']:.3f} "
          f"(min {q['min']:.3f}, max {q['max']:.3f}); fastest repeat / fastest repeat {q['best_over_best']:.3f}")
    print(f"fitted ms/step = {f['fixed_ms']:.2f} fixed + {f['per_row_ms']:.3f} per row")
    if args.trace:
        res["trace"] = trace_sweep()
        print(f"{'trace':<22}{'max_num_seqs':>12}{'slots':>6}{'req/s':>8}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}"
              f"{'peak run':>9}")
        for r in res["trace"]:
            print(f"{r['trace']:<22}{r['max_num_seqs']:>12}{r['num_state_slots']:>6}{r['requests_per_s']:>8.1f}"
                  f"{r['ttft_ms_p50']:>10.0f}{r['ttft_ms_p99']:>8.0f}{r['tpot_ms_p50']:>10.1f}"
                  f"{r['tpot_ms_p99']:>8.1f}{r['peak_running']:>9}")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
