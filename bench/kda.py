"""Benchmark of the KDA kernels: ``python -m bench.kda``.

Part 1, the roofline ratio (what the kernel is judged by): at T = 4,096, B = 1, H = 4, K = V = 128, fp32,
for torch threads 1 and this machine's default (``os.cpu_count()``), each of ``--repeats`` rounds runs,
interleaved after a warm-up: this CPU's fp32 matmul (1,024 x 1,024 @ 1,024 x 1,024, the roofline
reference), ``kda_chunk`` forward without autograd (what serving runs: the fused C form of
:mod:`kda_core.cpu_kernel` where it is available, on the widest vector path this CPU runs or ``$KDA_CPU_ISA``),
the same forward on every other fused path this CPU runs (AVX2 on an AVX-512 host) and in the torch form (the
baseline), forward with autograd (what training runs; always the torch form) and its backward. Each round's
ratio is the kernel's GFLOP/s over that round's matmul GFLOP/s; the median and the range over rounds are
printed, with the load average before and after. The legend names the path that ran and the CPU's vector width.
Wall-clock times; with 1 thread the thread's CPU time too (what preemption by other processes on a
shared machine does not inflate).

FLOP counts: forward = the paper's count per head ``6 T d^2 + 3 T C d + T C^2`` (Kimi Linear,
arXiv:2510.26692); backward = 2x forward (each matmul's backward is two matmuls of its size: the
"2N forward, 4N backward" split of Kaplan et al., arXiv:2001.08361). Both are counts of the
algorithm, not of what this implementation executes (it runs ~1.3x the paper's forward count).

Then where the torch form's time goes at one thread (:func:`phases`): prepare / scan / outputs by thread CPU
time, the matmul FLOPs each executes and the floor those FLOPs set at the matmul rate (why an unfused form
stays far from the matmul rate, and what the fused form removes).

Part 2, tokens/s of ``kda_chunk``, ``kda_recurrent`` and fla's ``naive_chunk_kda`` (when fla-core is
installed) at T in {1024, 4096, 16384} (``--table-threads``, default 1; medians of 3, the loops 1).
Writes ``bench/results/kda.json``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kda_core import cpu_kernel
from kda_core.chunk import (
    CHUNK_SIZE,
    kda_chunk,
    kda_chunk_outputs,
    kda_chunk_prepare,
    kda_chunk_states,
    kernel_in_use,
    piece_tokens_for,
)
from kda_core.cpu_build import ISAS, cpu_vector_bits, host_isas
from kda_core.kda import kda_recurrent

OUT = Path(__file__).parent / "results" / "kda.json"
B, H, K, V = 1, 4, 128, 128
MATMUL_N = 1024


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def paper_flops(T, d, C=CHUNK_SIZE, H=H):
    """Forward FLOPs of chunked KDA over H heads (Kimi Linear, arXiv:2510.26692): ``6 T d^2 + 3 T C d + T C^2`` per head."""
    return H * (6 * T * d * d + 3 * T * C * d + T * C * C)


def inputs(T, seed=0):
    """q, k (L2-normalised), v, g (mild decay in [-0.1, 0]), beta: ``[B, T, H, *]`` fp32, seeded."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * 0.1
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta


def _timed(fn):
    """(wall seconds, this thread's CPU seconds) of one call."""
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0


def _spread(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def other_paths() -> list[str]:
    """The fused vector paths this host runs besides the one ``kda_chunk`` uses (timed in the same rounds)."""
    fused = cpu_kernel.backend()
    return [isa for isa in host_isas() if fused is not None and isa != fused.isa]


def roofline(threads: int, T: int, repeats: int) -> dict:
    """Matmul, forward (the path ``kda_chunk`` runs, every other fused path this host runs as ``fwd_<path>``, the
    torch form), forward with autograd and backward, interleaved in ``repeats`` rounds (one warm-up round first)
    at ``threads`` torch threads. Returns per-measure spreads of ms, GFLOP/s and ratio."""
    torch.set_num_threads(threads)
    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    xs = inputs(T)
    leaves = [x.clone().requires_grad_(True) for x in xs]
    w_o = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(1))
    graph = {}

    def fwd_graph():
        graph["loss"] = (kda_chunk(*leaves).o * w_o).sum()

    def bwd():
        graph.pop("loss").backward()
        for t in leaves:
            t.grad = None

    def fwd_torch():
        kda_chunk(*xs, backend="torch")

    paths = {f"fwd_{isa}": (lambda isa=isa: kda_chunk(*xs, backend=f"fused-{isa}")) for isa in other_paths()}
    steps = {"matmul": lambda: a @ b, "fwd": lambda: kda_chunk(*xs), **paths, "fwd_torch": fwd_torch,
             "fwd_autograd": fwd_graph, "bwd": bwd}
    flops = {"matmul": 2 * MATMUL_N ** 3, "bwd": 2 * paper_flops(T, K),
             **{n: paper_flops(T, K) for n in ("fwd", *paths, "fwd_torch", "fwd_autograd")}}
    load_before = os.getloadavg()
    for fn in steps.values():                                   # warm-up round
        fn()
    wall = {n: [] for n in steps}
    cpu = {n: [] for n in steps}
    for _ in range(repeats):
        for n, fn in steps.items():
            w, c = _timed(fn)
            wall[n].append(w)
            cpu[n].append(c)
    res = {"threads": threads, "T": T, "repeats": repeats, "load_before": load_before, "load_after": os.getloadavg()}
    for n in steps:
        gf = [flops[n] / t / 1e9 for t in wall[n]]
        res[n] = {"flops": flops[n], "ms": _spread([t * 1e3 for t in wall[n]]), "gflops": _spread(gf)}
        if threads == 1:
            res[n]["cpu_ms"] = _spread([t * 1e3 for t in cpu[n]])
        if n != "matmul":
            res[n]["ratio"] = _spread([f / m for f, m in zip(gf, res["matmul"]["gflops_rounds"])])
        else:
            res[n]["gflops_rounds"] = gf
    for n in ("fwd", *paths):
        res[n]["speedup_vs_torch_form"] = _spread([t / f for f, t in zip(wall[n], wall["fwd_torch"])])
    if threads == 1:                                            # CPU-time ratio: immune to preemption
        for n in ("fwd", *paths, "fwd_torch", "fwd_autograd", "bwd"):
            res[n]["ratio_cpu"] = _spread([(flops[n] / c) / (flops["matmul"] / m)
                                           for c, m in zip(cpu[n], cpu["matmul"])])
    return res


def executed_flops(T, C=CHUNK_SIZE, d=K):
    """FLOPs this implementation's matmuls execute per phase over H heads (units of C tokens, d = K = V):
    prepare = cumsum as a matmul ``2 C^2 d`` + ``[k; q] exp(G)`` times ``(k exp(-G))^T`` ``4 C^2 d`` + the UT
    inverse ``~2 C^3 / 3`` + ``w, u`` ``4 C^2 d``; scan = ``w S`` and ``K~^T v_new`` ``4 C d^2``; outputs =
    ``Aqk v_new`` ``2 C^2 d`` + ``(q exp(G)) h`` ``2 C d^2``. Elementwise work is not counted."""
    units = H * -(-T // C)
    return {"prepare": units * (10 * C * C * d + 2 * C ** 3 // 3), "scan": units * 4 * C * d * d,
            "outputs": units * (2 * C * C * d + 2 * C * d * d)}


def phases(T: int, repeats: int, matmul_gflops: float) -> dict:
    """Where the forward's time goes at one thread: the split API (prepare / scan / outputs) run piece by
    piece as ``kda_chunk`` runs them, ``repeats`` rounds after a warm-up; per phase the median thread CPU
    ms, the executed matmul GFLOP (:func:`executed_flops`) and the rate they ran at, against the matmul
    rate of the same run. ``floor_ms``: the executed matmul FLOPs at that rate (no elementwise work,
    no overhead): what an unfused implementation of this algorithm cannot go below."""
    torch.set_num_threads(1)
    xs = inputs(T)
    piece = piece_tokens_for(B, H, K, V)

    def run(acc):
        S = None
        for s in range(0, T, piece):
            part = [x[:, s:s + piece] for x in xs]
            c0 = time.thread_time()
            prep = kda_chunk_prepare(*part, backend="torch")
            c1 = time.thread_time()
            st = kda_chunk_states(prep, S, backend="torch")
            c2 = time.thread_time()
            kda_chunk_outputs(prep, st, backend="torch")
            c3 = time.thread_time()
            S = st.final_state
            for name, dt in (("prepare", c1 - c0), ("scan", c2 - c1), ("outputs", c3 - c2)):
                acc[name] += dt

    run(dict.fromkeys(("prepare", "scan", "outputs"), 0.0))
    rounds = []
    for _ in range(repeats):
        acc = dict.fromkeys(("prepare", "scan", "outputs"), 0.0)
        run(acc)
        rounds.append(acc)
    fl = executed_flops(T)
    out = {"T": T, "piece_tokens": piece, "matmul_gflops": matmul_gflops,
           "paper_flops": paper_flops(T, K), "executed_flops": sum(fl.values()),
           "floor_ms": sum(fl.values()) / matmul_gflops / 1e6}
    for name in fl:
        ms = statistics.median(r[name] for r in rounds) * 1e3
        out[name] = {"cpu_ms": ms, "executed_gflop": fl[name] / 1e9, "gflops": fl[name] / ms / 1e6}
    return out


def _print_phases(p):
    total = sum(p[n]["cpu_ms"] for n in ("prepare", "scan", "outputs"))
    print(f"where the torch form's time goes (1 thread, thread CPU time): kda_chunk's three phases run apart, piece by piece "
          f"({p['piece_tokens']} tokens) as kda_chunk runs them: kda_chunk_prepare (in-chunk WY / UT work), "
          f"kda_chunk_states (the sequential scan over chunks), kda_chunk_outputs. Its matmuls execute "
          f"{p['executed_flops'] / 1e9:.2f} GFLOP, the paper counts {p['paper_flops'] / 1e9:.2f}:")
    for n in ("prepare", "scan", "outputs"):
        x = p[n]
        print(f"  {n:<8} {x['cpu_ms']:6.1f} ms ({100 * x['cpu_ms'] / total:4.1f} %)  {x['executed_gflop']:5.2f} GFLOP "
              f"at {x['gflops']:6.1f} GFLOP/s")
    print(f"  floor: the executed matmul FLOPs at the matmul rate ({p['matmul_gflops']:.0f} GFLOP/s), nothing else: "
          f"{p['floor_ms']:.1f} ms = ratio {100 * p['paper_flops'] / 1e9 / p['matmul_gflops'] / (p['floor_ms'] / 1e3):.0f} %")


def table(seq_lens, repeats, max_recurrent_T, naive):
    rows = []
    for T in seq_lens:
        q, k, v, g, beta = xs = inputs(T)
        res = {"T": T}
        t_chunk = _median_s(lambda xs=xs: kda_chunk(*xs), repeats)
        res["kda_chunk_tok_s"] = T / t_chunk
        if T <= max_recurrent_T:
            res["kda_recurrent_tok_s"] = T / _median_s(lambda xs=xs: kda_recurrent(*xs), 1)
        if naive is not None:
            res["fla_naive_chunk_tok_s"] = T / _median_s(lambda xs=xs: naive.naive_chunk_kda(*xs), 1)
            o_ref = naive.naive_chunk_kda(q, k, v, g, beta)[0]
            res["max_abs_diff_vs_fla"] = float((kda_chunk(q, k, v, g, beta).o - o_ref).abs().max())
        res["kda_chunk_gflops"] = paper_flops(T, K) / t_chunk / 1e9
        rows.append(res)
    return rows


NOISY = 1.5   # a measure whose slowest round took over 1.5x its fastest is flagged as noisy


def _print_legend(T):
    print(f"kda_chunk forward at B {B}, T {T:,}, H {H}, K = V = {K}, chunk C {CHUNK_SIZE}, fp32 (CPU).")
    for line in (
            "ratio = the kernel's GFLOP/s over this CPU's fp32 matmul GFLOP/s in the same round, the kernel's FLOPs",
            "  being the paper's count, not what this implementation executes: forward 6 T d^2 + 3 T C d + T C^2 per",
            "  head (Kimi Linear, arXiv:2510.26692), backward 2x forward (Kaplan et al., arXiv:2001.08361).",
            "  'by CPU time': the same ratio from this thread's CPU time, which preemption by other processes does",
            "  not inflate. Medians over interleaved rounds after a warm-up; ranges are min-max over the rounds."):
        print(line)
    print("forward (no autograd) runs " + (f"the {kernel_in_use()} form (kda_core/cpu_kernel); 'torch form' is the "
          "same call with backend='torch'" if cpu_kernel.available() else f"the torch form: the fused C form is "
          f"unavailable ({cpu_kernel.reason()})") + "; with autograd it is always the torch form.")
    print(f"this CPU: {cpu_model()}, {cpu_vector_bits()}-bit vector registers; fused paths it runs: "
          f"{', '.join(ISAS[i].label for i in host_isas()) or 'none'} (the path is chosen when the library is built: "
          f"the widest, or $KDA_CPU_ISA; the others are timed in the same rounds as 'forward, <path> path').")


def _print_roofline(r):
    print(f"threads {r['threads']}, T {r['T']:,}, {r['repeats']} interleaved rounds, load average "
          f"{r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f}")
    m = r["matmul"]["gflops"]
    print(f"  fp32 matmul {MATMUL_N}^2: {m['median']:.1f} GFLOP/s (range {m['min']:.1f}-{m['max']:.1f})")
    paths = [(n, f"  the same, {ISAS[n[4:]].label} path") for n in r if n.startswith("fwd_") and n[4:] in ISAS]
    for n, label in (("fwd", f"forward, {kernel_in_use()}"), *paths, ("fwd_torch", "  the same, torch form"),
                     ("fwd_autograd", "forward with autograd"), ("bwd", "backward")):
        x = r[n]
        line = (f"  {label:<30} {x['ms']['median']:7.1f} ms (range {x['ms']['min']:.1f}-{x['ms']['max']:.1f})  "
                f"{x['gflops']['median']:6.1f} GFLOP/s  ratio {100 * x['ratio']['median']:5.1f} % "
                f"(range {100 * x['ratio']['min']:.1f}-{100 * x['ratio']['max']:.1f} %)")
        if "ratio_cpu" in x:
            line += f"  by CPU time {100 * x['ratio_cpu']['median']:.1f} %"
        if x["ms"]["max"] > NOISY * x["ms"]["min"]:
            line += "  [noisy: rounds differ > 1.5x, other processes ran]"
        print(line)
    for n, label in (("fwd", kernel_in_use()), *((n, f"the {ISAS[n[4:]].label} path") for n, _ in paths)):
        sp = r[n]["speedup_vs_torch_form"]
        print(f"  {label}: {sp['median']:.2f}x the torch form's speed in the same rounds "
              f"(range {sp['min']:.2f}-{sp['max']:.2f})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384],
                    help="sequence lengths T of the tokens/s table (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds for the roofline ratio (>= 5)")
    ap.add_argument("--ratio-T", type=int, default=4096, help="T of the roofline ratio (default: %(default)s)")
    ap.add_argument("--max-recurrent-T", type=int, default=16384,
                    help="longest T at which the table also times kda_recurrent, the token loop (default: %(default)s)")
    ap.add_argument("--no-table", action="store_true", help="only the roofline ratio (part 1)")
    ap.add_argument("--table-threads", type=int, default=1, help="torch threads of the table (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=OUT, help="results JSON (default: bench/results/kda.json, tracked)")
    args = ap.parse_args(argv)
    if args.repeats < 5:
        ap.error("--repeats must be >= 5")
    default_threads = os.cpu_count() or 1
    cpu_kernel.backend()          # build / load / self-check the fused form now, outside every timed region
    cond = {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "cpu_count": default_threads, "B": B, "H": H, "K": K, "V": V, "C": CHUNK_SIZE, "dtype": "float32",
            "flops_forward": "Kimi Linear (arXiv:2510.26692): 6 T d^2 + 3 T C d + T C^2 per head",
            "flops_backward": "2x forward (Kaplan et al., arXiv:2001.08361: 2N forward + 4N backward)",
            "forward_kernel": f"{kernel_in_use()} (kda_core/cpu_kernel)" if cpu_kernel.available() else
            f"torch form (fused C unavailable: {cpu_kernel.reason()})",
            "cpu_model": cpu_model(), "cpu_vector_bits": cpu_vector_bits(), "fused_paths": host_isas(),
            "other_paths_timed": other_paths()}
    _print_legend(args.ratio_T)
    ratios = [roofline(t, args.ratio_T, args.repeats) for t in sorted({1, default_threads})]
    for r in ratios:
        r["matmul"].pop("gflops_rounds")
        _print_roofline(r)
    split = phases(args.ratio_T, args.repeats, ratios[0]["matmul"]["gflops"]["median"])
    _print_phases(split)
    rows = []
    if not args.no_table:
        torch.set_num_threads(args.table_threads)
        rows = table(args.seq_lens, 3, args.max_recurrent_T, _fla_naive())
        print(f"tokens/s at {args.table_threads} thread(s):")
        print(f"{'T':>7} {'chunk tok/s':>13} {'recurrent':>11} {'fla naive':>11} {'chunk/naive':>11} {'chunk/rec':>9} {'GFLOP/s':>8}")
        for r in rows:
            rec, nv = r.get("kda_recurrent_tok_s"), r.get("fla_naive_chunk_tok_s")
            print(f"{r['T']:>7} {r['kda_chunk_tok_s']:>13,.0f} {rec or 0:>11,.0f} {nv or 0:>11,.0f} "
                  f"{(r['kda_chunk_tok_s'] / nv) if nv else float('nan'):>11.2f} "
                  f"{(r['kda_chunk_tok_s'] / rec) if rec else float('nan'):>9.2f} {r['kda_chunk_gflops']:>8.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cond["table_threads"] = args.table_threads
    args.out.write_text(json.dumps({"conditions": cond, "roofline": ratios, "phases": split, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
