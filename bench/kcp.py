"""Benchmark of KDA context parallel on real gloo ranks: ``python -m bench.kcp``.

For T in {4,096, 16,384, 65,536}, B = 1, H = 4, K = V = 128, fp32: one rank (the ordinary chunk path,
bitwise ``kda_chunk``) and two ranks with each exchange variant, every rank on one intra-op thread
(a rank = one core). As an extra reference, one rank with as many threads as the machine has cores
(intra-op parallelism instead of ranks). Every configuration runs in two modes: each rank's chunk
kernel on its whole block, and in 2,048-token pieces with the state carried (``piece_tokens``): the
whole-block intra-chunk step costs ~2-3x more per token at 65K tokens than in pieces on this CPU, so
the whole-block speedup of two ranks includes a working-set effect; the speedup within the pieces
mode is the parallel speedup alone. The configurations are run in interleaved rounds (round 1:
all configs, round 2: all configs, ...) so that load from other processes on this shared machine hits
them alike; each run is one timed pass after an untimed one-chunk warm-up and a barrier (process
start-up excluded). Reported per configuration: the median over rounds of the run time (slowest
rank) and of every rank's phases, the speedup vs one rank (ratio of medians, and the median of the
per-round ratios), the bytes each rank passed to collectives, and max |delta| vs a single-rank run
(first round, computed in the ranks after the timed pass). The load average before and after is
recorded. Writes ``bench/results/kcp.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from kda_core import cpu_kernel
from serve.parallel.comm import PHASES
from serve.parallel.run import KCPConfig, run_kcp

OUT = Path(__file__).parent / "results" / "kcp.json"


MODES = {"whole": None, "pieces": 2048}   # each rank's chunk kernel on its whole block | in 2,048-token pieces


def _configs(T: int, cores: int, base: dict) -> dict[str, KCPConfig]:
    out = {}
    for mode, piece in MODES.items():
        kw = dict(seq_len=T, piece_tokens=piece if piece and piece < T else None, **base)
        out[f"1 rank, {mode}"] = KCPConfig(world_size=1, **kw)
        if cores > 1:
            out[f"1 rank x {cores} threads, {mode}"] = KCPConfig(world_size=1, threads_per_rank=cores, **kw)
        for variant in ("allgather", "ring"):
            out[f"2 ranks {variant}, {mode}"] = KCPConfig(world_size=2, variant=variant, **kw)
    return out


def _summary(name: str, runs: list, baseline_ms: list[float], whole_ms: list[float]) -> dict:
    walls = [r.wall_ms for r in runs]
    cfg = runs[0].config
    ranks = []
    for i, first in enumerate(runs[0].ranks):
        per = [run.ranks[i] for run in runs]
        ranks.append({"rank": i, "tokens": [first.start, first.end],
                      "total_ms": round(statistics.median(r.total_ms for r in per), 2),
                      **{f"{p}_ms": round(statistics.median(r.times[j] for r in per), 2) for j, p in enumerate(PHASES)},
                      "sent_bytes": first.sent_bytes, "received_bytes": first.received_bytes})
    err = max((run.max_abs_err for run in runs if run.max_abs_err == run.max_abs_err), default=None)
    return {"config": name, "seq_len": cfg.seq_len, "world_size": cfg.world_size,
            "variant": cfg.variant if cfg.world_size > 1 else "-", "threads_per_rank": cfg.threads_per_rank,
            "piece_tokens": cfg.piece_tokens,
            "wall_ms_per_round": [round(w, 2) for w in walls], "wall_ms": round(statistics.median(walls), 2),
            "speedup_vs_1_rank": round(statistics.median(baseline_ms) / statistics.median(walls), 3),
            "speedup_median_of_rounds": round(statistics.median(b / w for b, w in zip(baseline_ms, walls)), 3),
            "speedup_vs_1_rank_whole_block": round(statistics.median(whole_ms) / statistics.median(walls), 3),
            "max_abs_err": err, "ranks": ranks}


def _print(row: dict) -> None:
    err = "" if row["max_abs_err"] is None else f"max|d| {row['max_abs_err']:.1e}"
    print(f"T={row['seq_len']:>6,} {row['config']:<32} wall {row['wall_ms']:9.1f} ms (rounds "
          f"{', '.join(f'{w:.0f}' for w in row['wall_ms_per_round'])})  speedup {row['speedup_vs_1_rank']:.2f}x "
          f"(per-round median {row['speedup_median_of_rounds']:.2f}x; vs 1 rank whole block "
          f"{row['speedup_vs_1_rank_whole_block']:.2f}x)  {err}")
    for r in row["ranks"]:
        phases = " ".join(f"{p}={r[f'{p}_ms']:.0f}" for p in PHASES)
        print(f"    rank {r['rank']} {str(r['tokens']):>16} {phases} ms  sent={r['sent_bytes']:,} B "
              f"recv={r['received_bytes']:,} B")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    cpu_kernel.backend()      # build the fused chunk kernel once here, not in every rank (each loads it in its warm-up)
    load_before = os.getloadavg()
    base = dict(num_heads=a.heads, head_k_dim=a.head_dim, head_v_dim=a.head_dim, start_method="forkserver",
                timeout_s=1800)
    rows = []
    for T in a.seq_lens:
        configs = _configs(T, cores, base)
        runs = {name: [] for name in configs}
        for i in range(a.rounds):
            for name, cfg in configs.items():
                check = i == 0 and cfg.world_size > 1
                runs[name].append(run_kcp(KCPConfig(**{**cfg.__dict__, "check": check})))
        whole = [r.wall_ms for r in runs["1 rank, whole"]]
        for name in configs:
            mode = name.rsplit(", ", 1)[1]
            rows.append(_summary(name, runs[name], [r.wall_ms for r in runs[f"1 rank, {mode}"]], whole))
            _print(rows[-1])
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after} on {cores} cores")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"cores": cores, "heads": a.heads, "head_dim": a.head_dim, "rounds": a.rounds,
                                 "load_average_before": load_before, "load_average_after": load_after,
                                 "runs": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
