"""Benchmark of the prefix cache: ``python -m bench.prefix``.

(a) Replay of the whole Mooncake conversation trace (``../shared/traces``) through the block-granularity
    cache simulator (:mod:`serve.prefix.sim`) with Kimi-Linear-48B-A3B byte sizes: wall seconds (median
    of repeats) for an unlimited cache with a checkpoint every block and for a 200 GB cache; target < 3 s.
(b) TTFT cold vs warm on the demo model: a 1,024-token prompt sharing 25 / 50 / 75 / 90 % with an
    earlier request (N = 16, C = 128). Cold = the prompt through a cache-off engine; warm = the same
    prompt after the earlier one filled the cache. Medians of repeats, single-threaded, same process.
    Target: at 75 % shared, at least a 60 % TTFT reduction.
Writes ``bench/results/prefix.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from lab.pool_timing import one_thread
from lab.prefix import cold_vs_warm, shared_prefix_prompts, time_cold_warm, ttft_summary
from serve.config import ServeConfig
from serve.prefix.sim import TraceReplayConfig, replay_trace
from serve.traces.mooncake import ideal_hit_ratio, load_mooncake

OUT = Path(__file__).parent / "results" / "prefix.json"
TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def trace_replay(repeats: int) -> list[dict]:
    trace = load_mooncake(TRACE)
    ideal = ideal_hit_ratio(trace)
    out = []
    for label, cap in (("unlimited", None), ("200 GB", 200e9)):
        cfg = TraceReplayConfig.for_preset("kimi-linear-48b-a3b", ServeConfig(512, 512), capacity_bytes=cap)
        runs = [replay_trace(trace, cfg) for _ in range(repeats)]
        res = runs[0]
        out.append(dict(cache=label, requests=len(trace), blocks=res.total_blocks,
                        seconds_median=statistics.median(r.seconds for r in runs),
                        block_hit_ratio=res.block_hit_ratio, ideal_block_hit_ratio=ideal.block_hit_ratio,
                        token_hit_ratio=res.token_hit_ratio, miss_tokens=res.miss_tokens,
                        peak_kv_gb=res.peak_kv_bytes / 1e9, peak_state_gb=res.peak_state_bytes / 1e9))
    return out


def ttft(prompt_tokens: int, fractions, repeats: int) -> list[dict]:
    out = []
    for f in fractions:
        shared = round(prompt_tokens * f)
        first, second = shared_prefix_prompts(shared, prompt_tokens - shared, seed=1)
        run = cold_vs_warm(first, second, max_new_tokens=4, config=ServeConfig(16, 128))
        timed = time_cold_warm(first, second, max_new_tokens=4, config=ServeConfig(16, 128), repeats=max(5, repeats),
                               fit=False)
        warm = [r for r in timed.rows if r["kind"] == "warm"]
        out.append(dict(shared_fraction=f, shared_tokens=shared, hit_tokens=warm[0]["hit_tokens"],
                        warm_prefill_tokens=warm[0]["prefill_tokens"], **ttft_summary(timed.rows),
                        outputs_identical=run.check.outputs_identical, max_logit_diff=run.check.max_logit_diff,
                        warm_phase_ms={k: statistics.median(r[k] for r in warm) for k in warm[0] if k.endswith("_ms")}))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75, 0.9])
    args = ap.parse_args(argv)
    replay = trace_replay(max(1, args.repeats // 2))
    for r in replay:
        print(f"trace replay ({r['cache']}): {r['requests']} requests, {r['blocks']} blocks in "
              f"{r['seconds_median']:.2f} s; block hit {r['block_hit_ratio']:.4f} (ideal "
              f"{r['ideal_block_hit_ratio']:.4f}), token hit {r['token_hit_ratio']:.4f}")
    with one_thread():
        rows = ttft(args.prompt_tokens, args.fractions, args.repeats)
    print(f"{'shared':>7} {'hit':>5} {'cold ms':>8} {'warm ms':>8} {'reduction':>9} identical  max|dlogit|")
    for r in rows:
        print(f"{r['shared_fraction']:>7.0%} {r['hit_tokens']:>5} {r['cold_ttft_ms']:>8.1f} {r['warm_ttft_ms']:>8.1f} "
              f"{r['ttft_reduction']:>9.1%} {str(r['outputs_identical']):>9}  {r['max_logit_diff']:.2e}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(dict(trace_replay=replay, ttft=rows, repeats=args.repeats,
                                   prompt_tokens=args.prompt_tokens), indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
