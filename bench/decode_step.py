"""Where a decode step's time goes, and the step before / after: ``python -m bench.decode_step``.

The engine's batched decode step (``lab.batching.decoding_engine`` + ``time_steps``: B requests of 32-token
prompts all decoding, one token each per step; ``--page-policy multi_page`` builds the same engine on the server's
default pages instead of ``decoding_engine``'s unified ones) on the shipped demo model (``weights/kda-demo``: 8 layers =
6 KDA + 2 MLA, d = 128, MoE 8 experts top-2 + 1 shared), one torch thread, at B = 1, 8, 32, 64.

Each tree (this one, and with ``--baseline DIR`` another checkout of the repo, e.g. ``git archive <rev>``
extracted there) runs in its own worker process that loads the model, builds one engine per batch size and
warms up; then every repeat asks each worker in turn for ``--steps`` steps of every batch size (interleaved:
a slow phase of the machine hits both trees). Reported per (tree, batch): wall ms per step and tokens/s
(median, min, max over the repeats) and the worker's CPU ms per step (``time.thread_time``: what the step
cost this thread, less sensitive to the other jobs of a shared machine than wall time) and the torch ops
per step (top-level ops of a ``torch.profiler`` run of 5 steps: a count, the same under any load), with the
load average before and after.

The breakdown: one cProfile run of 20 steps per (tree, batch), cumulative time of each part as a share of
the profiled step, scaled to the median CPU ms per step of that tree and batch (cProfile slows Python-heavy
parts more than the torch ops, so the shares are approximate):

- kda mixers: ``varlen._kda_layer`` (projections, conv, step, gated norm, o_proj) of the 6 KDA layers, or for an
  all-decode batch ``varlen._kda_decode_block`` (the same and the pre-norm and residual add, one C call);
- mla mixers: ``varlen._mla_layer`` of the 2 MLA layers (latents, per-row attention, o_proj), or
  ``varlen._mla_decode_block`` (with the pre-norm and residual add, one C call);
- ffn: ``HybridLM.mlp`` (layer 0 dense SwiGLU, the 7 MoE layers), or ``HybridLM.feed_forward`` (with the
  post-attention norm and residual add, one C call);
- norms + head: the pre-norms and post-attention norms the parts above do not run, and the final norm + lm_head;
- batch metadata: the rest of ``forward_batch`` (positions, slot mapping, packed latents, checks);
- engine: the rest of ``ServeEngine.step`` (scheduling, state gather / scatter, sampling).

Writes ``bench/results/decode_step.json`` (with the forms of ``invariant.linear`` and of the KDA decode step that
ran) and, when it writes that tracked file, the tables of ``bench/README.md``'s section ``decode_step.json``
(``--readme`` rewrites the section from the file alone).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from bench.readme import write_section

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "decode_step.json"
BATCHES = (1, 8, 32, 64)

# Runs in a worker process with the tree under test on sys.path; uses only APIs both trees have.
WORKER = r'''
import cProfile, json, pstats, sys, time
import torch
from kda_core.model import HybridLM
from lab.batching import BLOCK, DECODE_PROMPT_TOKENS, decoding_engine, time_steps
from serve.config import ServeConfig
from serve.engine import EngineArgs, RequestStatus, build_engine
torch.set_num_threads(1)
batches, steps, budget, policy = json.loads(sys.argv[1])
model = HybridLM.from_pretrained("weights/kda-demo")
def engine(b):
    if policy == "unified":
        return decoding_engine(model, b, budget)
    config = ServeConfig(BLOCK, BLOCK, page_policy=policy)                 # decoding_engine's, on other pages
    per_req = config.layout(model.cfg).state_pages + -(-(DECODE_PROMPT_TOKENS + budget) // BLOCK) + 1
    eng = build_engine(EngineArgs(model, b * per_req + 8, config))
    for i in range(b):
        eng.submit([(i * 7 + j) % 256 for j in range(DECODE_PROMPT_TOKENS)], budget)
    while any(eng.requests[r].status is not RequestStatus.DECODE for r in eng.running) or eng.waiting:
        eng.step()
    return eng
engines = {b: engine(b) for b in batches}
for e in engines.values():
    time_steps(e, 2)
PARTS = {"kda mixers": [("varlen.py", "_kda_layer"), ("varlen.py", "_kda_decode_block")],
         "mla mixers": [("varlen.py", "_mla_layer"), ("varlen.py", "_mla_decode_block")],
         "ffn": [("model.py", "mlp"), ("model.py", "feed_forward")], "norms + head": [("model.py", "input_norm"),
         ("model.py", "post_attention_norm"), ("model.py", "head")], "forward": ("varlen.py", "forward_batch"),
         "step": ("engine.py", "step")}
def profile(b):
    pr = cProfile.Profile()
    pr.enable()
    time_steps(engines[b], 20)
    pr.disable()
    stats = pstats.Stats(pr).stats
    cum = lambda f, n: sum(v[3] for k, v in stats.items() if k[0].endswith(f) and k[2] == n)
    got = {p: sum(cum(*x) for x in (w if isinstance(w, list) else [w])) for p, w in PARTS.items()}
    inner = sum(got[p] for p in ("kda mixers", "mla mixers", "ffn", "norms + head"))
    parts = {p: got[p] for p in ("kda mixers", "mla mixers", "ffn", "norms + head")}
    parts["batch metadata"] = got["forward"] - inner
    parts["engine"] = got["step"] - got["forward"]
    total = sum(parts.values())
    return {p: v / total for p, v in parts.items()}
def ops(b):
    from torch.profiler import ProfilerActivity, profile as tprofile
    with tprofile(activities=[ProfilerActivity.CPU]) as p:
        time_steps(engines[b], 5)
    return sum(e.cpu_parent is None for e in p.events()) / 5
print("ready", flush=True)
for line in sys.stdin:
    if line.startswith("time"):
        out = {}
        for b in batches:
            w0, c0 = time.perf_counter(), time.thread_time()
            time_steps(engines[b], steps)
            out[b] = [time.perf_counter() - w0, time.thread_time() - c0]
    elif line.startswith("ops"):
        out = {b: ops(b) for b in batches}
    else:
        out = {b: profile(b) for b in batches}
    print(json.dumps(out), flush=True)
'''


class Worker:
    """A worker process of one tree (see :data:`WORKER`)."""

    def __init__(self, tree: Path, batches, steps: int, budget: int, page_policy: str = "unified"):
        env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER,
                                      json.dumps([list(batches), steps, budget, page_policy])],
                                     cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the worker of {tree} did not start (exit code {self.proc.wait()})")

    def ask(self, what: str) -> dict:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return {int(k): v for k, v in json.loads(self.proc.stdout.readline()).items()}

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run(batches=BATCHES, steps: int = 5, repeats: int = 5, baseline: Path | None = None,
        baseline_label: str | None = None, page_policy: str = "unified") -> dict:
    trees = {"this tree": REPO} | ({"baseline": Path(baseline).resolve()} if baseline else {})
    load_before = os.getloadavg()
    budget = 2 + steps * repeats + 20 + 5 + 4                               # warm-up, timed, profiled, counted, spare
    workers = {name: Worker(tree, batches, steps, budget, page_policy) for name, tree in trees.items()}
    samples = {name: {b: [] for b in batches} for name in trees}
    try:
        for r in range(repeats):                                           # interleaved, order alternating
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                for b, wc in workers[name].ask("time").items():
                    samples[name][b].append(wc)
        shares = {name: w.ask("profile") for name, w in workers.items()}
        op_counts = {name: w.ask("ops") for name, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    load_after = os.getloadavg()
    rows, profile = [], {}
    for name in trees:
        for b in batches:
            wall = [s[0] / steps * 1e3 for s in samples[name][b]]
            cpu = [s[1] / steps * 1e3 for s in samples[name][b]]
            tps = [b * 1e3 / w for w in wall]
            rows.append({"tree": name, "batch": b, "ms_per_step": statistics.median(wall), "ms_min": min(wall),
                         "ms_max": max(wall), "tokens_per_s": statistics.median(tps), "tokens_per_s_min": min(tps),
                         "tokens_per_s_max": max(tps), "cpu_ms_per_step": statistics.median(cpu),
                         "cpu_ms_min": min(cpu), "torch_ops_per_step": op_counts[name][b]})
            med = statistics.median(cpu)
            profile.setdefault(name, {})[b] = {p: round(f * med, 3) for p, f in shares[name][b].items()}
    return {"rows": rows, "profile_ms": profile, "decode_backend": _backend(), "linear_backend": _linear_backend(),
            "conditions": {"model": "weights/kda-demo", "batches": list(batches), "steps_per_repeat": steps,
                           "repeats": repeats, "warmup_steps": 2, "torch_threads": 1, "page_policy": page_policy,
                           "load_avg_before": load_before, "load_avg_after": load_after,
                           "cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine(),
                           "baseline": (baseline_label or str(baseline)) if baseline else None}}


def _backend() -> str:
    from kda_core import decode
    from lab.models import demo_model
    model = demo_model("demo")
    layer = model.mixers[model.cfg.kda_layers[0]]
    return decode.backend(layer) + ("" if decode.reason(layer) is None else f" ({decode.reason(layer)})")


def _linear_backend() -> str:
    from kda_core import cpu_invariant
    gemm = cpu_invariant.backend()
    return gemm.name if gemm is not None else f"torch (MKL padded to 16 rows: {cpu_invariant.reason()})"


def report(res: dict) -> str:
    c = res["conditions"]
    lines = [f"load average {c['load_avg_before'][0]:.2f} -> {c['load_avg_after'][0]:.2f}, {c['cpu_count']} CPUs, "
             f"1 torch thread, {c.get('page_policy', 'unified')} pages, KDA decode: {res['decode_backend']}, "
             f"linear: {res.get('linear_backend', '?')}",
             "tree        batch  ms/step (min-max)      tokens/s (min-max)     CPU ms/step  torch ops/step"]
    for r in res["rows"]:
        lines.append(f"{r['tree']:<11} {r['batch']:>5}  {r['ms_per_step']:6.2f} ({r['ms_min']:.2f}-{r['ms_max']:.2f})"
                     f"  {r['tokens_per_s']:8.0f} ({r['tokens_per_s_min']:.0f}-{r['tokens_per_s_max']:.0f})"
                     f"  {r['cpu_ms_per_step']:6.2f}  {r['torch_ops_per_step']:8.0f}")
    for tree, by_batch in res["profile_ms"].items():
        for b, parts in by_batch.items():
            lines.append(f"{tree} B={b}: " + ", ".join(f"{p} {v:.2f}" for p, v in parts.items()) + " (CPU ms, cProfile shares)")
    return "\n".join(lines)


PART_NAMES = {"kda mixers": "KDA mixers", "mla mixers": "MLA mixers", "ffn": "feed-forward",
              "norms + head": "norms + head", "batch metadata": "batch metadata",
              "engine": "engine (schedule, state writes, sampling)"}


def readme_section(res: dict) -> str:
    """The body of bench/README.md's ``decode_step.json`` section for ``res`` (a results dict of :func:`run`)."""
    c = res["conditions"]
    trees = list(dict.fromkeys(r["tree"] for r in res["rows"]))
    batches = sorted({r["batch"] for r in res["rows"]})
    row = {(r["tree"], r["batch"]): r for r in res["rows"]}
    label = {t: (f"baseline ({c['baseline']})" if t == "baseline" else t) for t in trees}

    specs = [("CPU ms per step, {} (median / min)", lambda r: f"{r['cpu_ms_per_step']:.2f} / {r['cpu_ms_min']:.2f}"),
             ("torch ops per step, {}", lambda r: f"{r['torch_ops_per_step']:,.0f}"),
             ("wall ms per step, {} (median, min-max)",
              lambda r: f"{r['ms_per_step']:.1f} ({r['ms_min']:.1f}-{r['ms_max']:.1f})"),
             ("tokens/s from CPU ms, {}", lambda r: f"{1000 * r['batch'] / r['cpu_ms_per_step']:,.0f}")]

    out = [f"`python -m bench.decode_step --steps {c['steps_per_repeat']} --repeats {c['repeats']}"
           + (" --baseline DIR --baseline-label LABEL" if "baseline" in trees else "") + "`: the engine's "
           "batched decode step on the shipped weights (`weights/kda-demo`), B requests of 32-token prompts all "
           "decoding, one torch thread, each tree in its own worker process, "
           f"{c['repeats']} repeats of {c['steps_per_repeat']} steps of every B interleaved after "
           f"{c['warmup_steps']} warm-up steps. The CPU time of the step's thread (`time.thread_time`) and the torch "
           "op count (the same under any load) are the comparable figures. This section is written by the command.",
           "",
           f"Latest run: load average {c['load_avg_before'][0]:.2f} -> {c['load_avg_after'][0]:.2f} (1 min), "
           f"{c['cpu_count']} CPUs ({c['machine']}), {c.get('page_policy', 'unified')} pages; `invariant.linear` ran on {res.get('linear_backend', '?')}, "
           f"the KDA decode on {res['decode_backend']}.", "",
           "| B | " + " | ".join(str(b) for b in batches) + " |", "|---|" + "---|" * len(batches)]
    for name, cell in specs:
        out += [f"| {name.format(label[t])} | " + " | ".join(cell(row[t, b]) for b in batches) + " |" for t in trees]
    t0, first = trees[0], batches[0]
    per_s = {b: 1000 * b / row[t0, b]["cpu_ms_per_step"] for b in batches}
    out += ["", f"Tokens/s (from CPU ms, {label[t0]}) against batch {first}'s: "
            + ", ".join(f"batch {b} {per_s[b] / per_s[first]:.1f}x" for b in batches[1:]) + ".", "",
            "Where the CPU time goes (ms per step, cProfile shares of one 20-step run scaled to the median CPU ms; "
            "approximate and noisy):", ""]
    cols = [(t, b) for b in batches for t in trees]
    out += ["| part | " + " | ".join(f"B = {b}, {t}" for t, b in cols) + " |", "|---|" + "---|" * len(cols)]
    for part, name in PART_NAMES.items():
        shares = [res["profile_ms"][t].get(str(b), res["profile_ms"][t].get(b)) for t, b in cols]
        out.append(f"| {name} | " + " | ".join(f"{p[part]:.2f}" for p in shares) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="decode steps per batch size in each repeat (default 5)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats after the warm-up (default 5)")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout of the repo to time beside this one")
    ap.add_argument("--baseline-label", default=None, help="what the baseline is (e.g. 'main at 87924d0')")
    ap.add_argument("--out", type=Path, default=OUT, help="results file (default: the tracked "
                    "bench/results/decode_step.json, overwritten)")
    ap.add_argument("--page-policy", choices=("unified", "multi_page"), default="unified",
                    help="pages of the engines timed (default unified, decoding_engine's; the server runs multi_page)")
    ap.add_argument("--readme", action="store_true", help="only rewrite bench/README.md's section from --out")
    args = ap.parse_args()
    if args.readme:
        res = json.loads(args.out.read_text())
        write_section("## decode_step.json", readme_section(res), "## drafters.json")
        print(report(res))
        return
    res = run(steps=args.steps, repeats=args.repeats, baseline=args.baseline, baseline_label=args.baseline_label,
              page_policy=args.page_policy)
    print(report(res))
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    if args.out == OUT:
        write_section("## decode_step.json", readme_section(res), "## drafters.json")


if __name__ == "__main__":
    main()
