"""Benchmark of KDA context parallel on real gloo ranks: ``python -m bench.kcp``.

For T in {4,096, 16,384, 65,536}, B = 1, H = 4, K = V = 128, fp32: one rank (the ordinary chunk path)
and two ranks with each exchange variant, every rank on one intra-op thread (a rank = one core).
Reported per run: per-phase wall times of every rank (medians of ``--repeats`` timed runs inside the
ranks, after one barrier; process start-up excluded), the run time (slowest rank), speedup vs the
one-rank run of the same T measured in this same invocation, bytes each rank passed to collectives,
and max |delta| vs a single-rank run (computed in the ranks after the timed runs). As an extra
reference, one rank with as many threads as this machine has cores (intra-op parallelism instead of
ranks). Writes ``bench/results/kcp.json``.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from serve.parallel.comm import PHASES
from serve.parallel.run import KCPConfig, run_kcp

OUT = Path(__file__).parent / "results" / "kcp.json"


def _row(run, baseline_ms: float | None) -> dict:
    cfg = run.config
    return {
        "seq_len": cfg.seq_len, "world_size": cfg.world_size, "variant": cfg.variant if cfg.world_size > 1 else "-",
        "threads_per_rank": cfg.threads_per_rank, "wall_ms": round(run.wall_ms, 2),
        "speedup_vs_1_rank": None if baseline_ms is None else round(baseline_ms / run.wall_ms, 3),
        "max_abs_err": None if run.max_abs_err != run.max_abs_err else run.max_abs_err,
        "ranks": [{"rank": r.rank, "tokens": [r.start, r.end], "total_ms": round(r.total_ms, 2),
                   **{f"{p}_ms": round(t, 2) for p, t in zip(PHASES, r.times)},
                   "sent_bytes": r.sent_bytes, "received_bytes": r.received_bytes} for r in run.ranks],
    }


def _print(row: dict) -> None:
    speed = "" if row["speedup_vs_1_rank"] is None else f"{row['speedup_vs_1_rank']:.2f}x"
    err = "" if row["max_abs_err"] is None else f"{row['max_abs_err']:.1e}"
    print(f"T={row['seq_len']:>6,} W={row['world_size']} {row['variant']:>9} threads/rank={row['threads_per_rank']} "
          f"wall {row['wall_ms']:9.1f} ms  speedup {speed:>6}  max|d| {err}")
    for r in row["ranks"]:
        phases = " ".join(f"{p}={r[f'{p}_ms']:.0f}" for p in PHASES)
        print(f"    rank {r['rank']} {str(r['tokens']):>16} {phases}  sent={r['sent_bytes']:,} B "
              f"recv={r['received_bytes']:,} B")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    base = dict(num_heads=a.heads, head_k_dim=a.head_dim, head_v_dim=a.head_dim, repeats=a.repeats, timeout_s=1800)
    rows = []
    for T in a.seq_lens:
        one = run_kcp(KCPConfig(seq_len=T, world_size=1, **base))
        rows.append(_row(one, one.wall_ms))
        _print(rows[-1])
        if cores > 1:
            rows.append(_row(run_kcp(KCPConfig(seq_len=T, world_size=1, threads_per_rank=cores, **base)), one.wall_ms))
            _print(rows[-1])
        for variant in ("allgather", "ring"):
            run = run_kcp(KCPConfig(seq_len=T, world_size=2, variant=variant, check=True, **base))
            rows.append(_row(run, one.wall_ms))
            _print(rows[-1])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"cores": cores, "heads": a.heads, "head_dim": a.head_dim, "repeats": a.repeats,
                                 "runs": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
