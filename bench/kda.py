"""Benchmark of the KDA kernels: ``python -m bench.kda``.

tokens/s of ``kda_chunk``, ``kda_recurrent`` and fla's ``naive_chunk_kda`` (when fla-core is
installed) at T in {1024, 4096, 16384}, B = 1, H = 4, K = V = 128, fp32, in one process; this CPU's
fp32 matmul GFLOP/s as the roofline reference; each kernel's achieved GFLOP/s using the paper's FLOP
count per head ``6 T d^2 + 3 T C d + T C^2`` (Kimi Linear, arXiv:2510.26692). Medians of repeats.
Writes ``bench/results/kda.json``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kda_core.chunk import kda_chunk
from kda_core.kda import kda_recurrent

OUT = Path(__file__).parent / "results" / "kda.json"


def _median_s(fn, repeats):
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _fla_naive():
    try:
        import fla
    except ImportError:
        return None
    spec = importlib.util.spec_from_file_location("fla_kda_naive", Path(fla.__file__).parent / "ops/kda/naive.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def matmul_gflops(n=1024, repeats=5):
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / _median_s(lambda: a @ b, repeats) / 1e9


def paper_flops(T, d, C=64, H=4):
    return H * (6 * T * d * d + 3 * T * C * d + T * C * C)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-recurrent-T", type=int, default=16384)
    args = ap.parse_args(argv)
    naive = _fla_naive()
    B, H, K, V = 1, 4, 128, 128
    peak = matmul_gflops()
    rows = []
    for T in args.seq_lens:
        gen = torch.Generator().manual_seed(0)
        q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
        k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
        v = torch.randn(B, T, H, V, generator=gen)
        g = -torch.rand(B, T, H, K, generator=gen) * 0.1
        beta = torch.rand(B, T, H, generator=gen)
        res, xs = {"T": T}, (q, k, v, g, beta)
        t_chunk = _median_s(lambda xs=xs: kda_chunk(*xs), args.repeats)
        res["kda_chunk_tok_s"] = T / t_chunk
        if T <= args.max_recurrent_T:
            t_rec = _median_s(lambda xs=xs: kda_recurrent(*xs), 1)
            res["kda_recurrent_tok_s"] = T / t_rec
        if naive is not None:
            t_naive = _median_s(lambda xs=xs: naive.naive_chunk_kda(*xs), 1)
            res["fla_naive_chunk_tok_s"] = T / t_naive
            o_ref = naive.naive_chunk_kda(q, k, v, g, beta)[0]
            res["max_abs_diff_vs_fla"] = float((kda_chunk(q, k, v, g, beta).o - o_ref).abs().max())
        res["kda_chunk_gflops"] = paper_flops(T, K) / t_chunk / 1e9
        rows.append(res)
    print(f"fp32 matmul roofline on this CPU: {peak:,.1f} GFLOP/s")
    print(f"{'T':>7} {'chunk tok/s':>13} {'recurrent':>11} {'fla naive':>11} {'chunk/naive':>11} {'chunk/rec':>9} {'GFLOP/s':>8}")
    for r in rows:
        rec, nv = r.get("kda_recurrent_tok_s"), r.get("fla_naive_chunk_tok_s")
        print(f"{r['T']:>7} {r['kda_chunk_tok_s']:>13,.0f} {rec or 0:>11,.0f} {nv or 0:>11,.0f} "
              f"{(r['kda_chunk_tok_s'] / nv) if nv else float('nan'):>11.2f} "
              f"{(r['kda_chunk_tok_s'] / rec) if rec else float('nan'):>9.2f} {r['kda_chunk_gflops']:>8.1f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"matmul_gflops": peak, "B": B, "H": H, "K": K, "V": V, "rows": rows}, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
