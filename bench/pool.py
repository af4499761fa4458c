"""Benchmark of the page pool: ``python -m bench.pool``.

(a) Page alloc + free throughput of ``serve.memory.pool.PagePool`` (one op = one page allocated and
freed again) in single-page and batched calls, against ``NaiveListPool`` (a Python list free list,
one page per step) in the same run; pool half occupied. Target: >= 1,000,000 ops/s batched.
(b) Per-call latency p50 / p99 (ns) of single-page alloc and free.
(c) The engine's paged read (``serve.memory.pages.read_kv``: one ``index_select`` over a scattered page
table) vs a contiguous copy of the same latents, and a naive ``torch.cat`` of per-token tensors, fp32,
width 576 (Kimi's 512 + 64); plus decode attention over contiguous latents vs read + attention. Target: paged / contiguous <= 1.5
at block size >= 16. Medians; single-threaded torch (see ``lab.pool_timing``).
Writes ``bench/results/pool.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from lab.pool_timing import alloc_free_throughput, call_latencies_ns, gather_timing, latency_histogram

OUT = Path(__file__).parent / "results" / "pool.json"
TARGET_OPS_S = 1_000_000
TARGET_GATHER_RATIO = 1.5


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)

    thr = [alloc_free_throughput(b, num_pages=4096, loops=max(20, 4096 // b), repeats=args.repeats)
           for b in args.batches]
    print("(a) page alloc+free throughput (ops/s; one op = one page allocated and freed)")
    print(f"{'batch':>6} {'PagePool':>12} {'naive list':>12} {'pool/naive':>10}")
    for t in thr:
        print(f"{t.batch_pages:>6} {t.pool_ops_s:>12,.0f} {t.naive_ops_s:>12,.0f} {t.speedup:>10.2f}")
    batched = max(t.pool_ops_s for t in thr if t.batch_pages > 1)
    print(f"    best batched: {batched:,.0f} ops/s (target >= {TARGET_OPS_S:,}): "
          f"{'MET' if batched >= TARGET_OPS_S else 'MISSED'}")

    lat = call_latencies_ns(1, samples=5000)
    hist = latency_histogram(lat)
    lat_row = {k: {"p50_ns": hist.p50_ns[k], "p99_ns": hist.p99_ns[k], "mean_ns": statistics.fmean(v)}
               for k, v in lat.items()}
    print("(b) single-page call latency: " + "; ".join(
        f"{k} p50 {r['p50_ns']:,.0f} ns, p99 {r['p99_ns']:,.0f} ns" for k, r in lat_row.items()))

    gat = [gather_timing(L, bs, repeats=args.repeats) for L in args.contexts for bs in args.block_sizes]
    print("(c) read one layer's latents [L, 576] fp32 into a buffer allocated before the timing (us, median)")
    print(f"{'L':>6} {'bs':>4} {'contig':>9} {'paged':>9} {'cat':>9} {'paged/contig':>12} "
          f"{'cat/contig':>10} {'attn paged/contig':>17}")
    for g in gat:
        print(f"{g.context_tokens:>6} {g.block_size:>4} {g.contiguous_us:>9.1f} {g.paged_us:>9.1f} "
              f"{g.naive_cat_us:>9.1f} {g.gather_ratio:>12.2f} {g.naive_cat_us / g.contiguous_us:>10.2f} "
              f"{g.attention_ratio:>17.2f}")
    worst = max(g.gather_ratio for g in gat if g.block_size >= 16)
    print(f"    worst paged/contiguous at block size >= 16: {worst:.2f} (target <= {TARGET_GATHER_RATIO}): "
          f"{'MET' if worst <= TARGET_GATHER_RATIO else 'MISSED'}")

    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "throughput": [t._asdict() | {"speedup": t.speedup} for t in thr],
        "best_batched_ops_s": batched, "target_ops_s": TARGET_OPS_S,
        "latency_single_page": lat_row,
        "gather": [g._asdict() | {"gather_ratio": g.gather_ratio, "attention_ratio": g.attention_ratio} for g in gat],
        "worst_gather_ratio_bs_ge_16": worst, "target_gather_ratio": TARGET_GATHER_RATIO,
    }, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
