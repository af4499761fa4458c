"""Ours beside llama.cpp and transformers on the shipped checkpoint: ``python -m bench.peers``.

    python -m bench.peers              # the full run: bench/results/peers.json + README sections
    python -m bench.peers --quick      # fewer steps, transformers' prefill at 128 tokens only (a temp file)
    python -m bench.peers --readme     # regenerate the README sections from the committed results, no measuring

Wall time depends on the machine's load more than on the sizes: the rows at 2 threads on a 2-core machine shared with
other work oversubscribe the cores, and a step then waits for a descheduled thread. On the shared 2-core development
VM the full run took 4.5 min at load average 4 -> 2.6, ``--quick`` 18 min at load average 5-14.

Same checkpoint (``weights/kda-demo``: real Kimi-Linear format, fp32, byte tokenizer), same machine, one run:
prefill tokens/s at 128 and 1,024-token prompts (one request) and decode tokens/s at batch 1, 8, 32 and 64, at 1
and 2 threads, for our engine, llama.cpp and transformers (:mod:`bench.peer_engines` says what one measurement of
each is). Beside them the limit: this machine's fp32 matmul rate (1,024^3, torch) at each thread count, measured in
the same rounds, over the model's FLOPs per token (:func:`model_flops`).

Rounds: one warm-up round, then ``repeats`` rounds; each round runs every task once (every engine, measure, size and
thread count; the llama.cpp programs one process per round), in an order rotated by one task per round, so a slow
phase of the shared machine hits every engine. Reported: median, min and max over the rounds; the ratios ours /
peer of the medians, judged against the goals of :mod:`lab.peers`; the load average before and after.
When llama.cpp is not built (CI does not build it) or transformers lacks the model, that column stays empty and
the results say why and how to get it; the run goes on.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from bench import llama_cpp
from bench.kda import cpu_model
from bench.peer_engines import HF, HF_DECODE_PROMPT_TOKENS, LlamaCpp, Ours, cached_gguf, llama_cpp_missing
from bench.readme import replace_section
from lab.batching import DECODE_PROMPT_TOKENS
from lab.models import TRAINED_WEIGHTS
from lab.peers import caveats, markdown, peers_table, stamp, verdicts

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "peers.json"
FOLDER = Path(TRAINED_WEIGHTS["demo"])
MATMUL_N = 1024


class Size(NamedTuple):
    """What a run measures: ``prefill`` prompt sizes (tokens) and decode ``batches`` for ours and llama.cpp;
    ``hf_prefill`` / ``hf_batches`` the subsets transformers runs; ``steps`` decode steps per measurement (ours),
    ``hf_steps`` (transformers), ``ntg`` (llama-batched-bench's generated tokens per sequence); ``threads``;
    ``repeats`` measured rounds after one warm-up round."""

    prefill: tuple[int, ...] = (128, 1024)
    batches: tuple[int, ...] = (1, 8, 32, 64)
    hf_prefill: tuple[int, ...] = (128, 1024)
    hf_batches: tuple[int, ...] = (1, 8, 32, 64)
    steps: int = 8
    hf_steps: int = 8
    ntg: int = 32
    threads: tuple[int, ...] = (1, 2)
    repeats: int = 5


FULL = Size()
QUICK = Size(hf_prefill=(128,), steps=4, hf_steps=4, ntg=16)


class ModelFlops(NamedTuple):
    """The model's arithmetic per token (FLOP): ``weights`` 2 x the weights a token multiplies (routed experts at
    top-k / experts, the lm_head in, the embedding lookup out), ``kda_state`` the recurrence's 7 H K V per KDA
    layer (decay 1, k^T S 2, rank-1 update 2, q^T S 2), ``mla_per_context`` 2 H (d_qk + d_v) per MLA layer per
    token of context (scores and weighted values)."""

    weights: int
    kda_state: int
    mla_per_context: int

    def per_token(self, context: float) -> float:
        """FLOPs of one token at ``context`` tokens of context."""
        return self.weights + self.kda_state + self.mla_per_context * context


def model_flops(folder: Path = FOLDER) -> ModelFlops:
    """:class:`ModelFlops` of a real-format Kimi-Linear folder (``config.json`` and the safetensors' shapes)."""
    from safetensors import safe_open

    cfg = json.loads((Path(folder) / "config.json").read_text())
    routed = cfg["num_experts_per_token"] / cfg["num_experts"]
    weights = 0.0
    with safe_open(Path(folder) / "model.safetensors", "pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            if name.endswith(".weight") and len(shape) >= 2 and name != "model.embed_tokens.weight":
                weights += math.prod(shape) * (routed if ".experts." in name else 1.0)
    lin = cfg["linear_attn_config"]
    kda = len(lin["kda_layers"]) * 7 * lin["num_heads"] * lin["head_dim"] ** 2
    mla = len(lin["full_attn_layers"]) * 2 * cfg["num_attention_heads"] * (
        cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"])
    return ModelFlops(round(2 * weights), kda, mla)


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


Task = Callable[[], dict]          # one measurement -> {(engine, measure, size, threads): tokens/s or GFLOP/s}


def tasks(size: Size, ours: Ours | None, hf: HF | None, llama: LlamaCpp | None) -> list[Task]:
    """Every task of one round, in the unrotated order."""
    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)

    def matmul(t):
        torch.set_num_threads(t)
        t0 = time.perf_counter()
        a @ b
        return {("matmul", "", 0, t): 2 * MATMUL_N ** 3 / (time.perf_counter() - t0) / 1e9}

    out: list[Task] = [lambda t=t: matmul(t) for t in size.threads]
    for eng, prefill, batches, steps in ((ours, size.prefill, size.batches, size.steps),
                                         (hf, size.hf_prefill, size.hf_batches, size.hf_steps)):
        if eng is None:
            continue
        for t in size.threads:
            out += [lambda e=eng, n=n, t=t: {(e.name, "prefill", n, t): e.prefill(n, t)} for n in prefill]
            out += [lambda e=eng, b=b, t=t, s=steps: {(e.name, "decode", b, t): e.decode(b, t, s)} for b in batches]
    if llama is not None:
        out.append(lambda: {("llama.cpp", "prefill", n, t): v
                            for (n, t), v in llama.prefill(size.prefill, size.threads).items()})
        out += [lambda t=t: {("llama.cpp", "decode", b, t): v for (b, t), v in
                             llama.decode(size.batches, t, size.ntg).items()} for t in size.threads]
    return out


def run(size: Size = FULL, engines: tuple[str, ...] = ("ours", "llama.cpp", "transformers"),
        cache: Path = llama_cpp.CACHE, progress: Callable[[str], None] | None = None, quick: bool = False) -> dict:
    """One interleaved run of ``engines`` at ``size`` (see the module docstring); ``quick`` is recorded with it.
    Returns the results dict :mod:`lab.peers` reads."""
    progress = progress or (lambda msg: print(msg, flush=True))
    threads_before = torch.get_num_threads()
    notes, host = [], {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                       "torch": torch.__version__}
    ours = hf = llama = None
    if "ours" in engines:
        ours = Ours(size.prefill, size.batches, size.steps * (size.repeats + 1) * len(size.threads) + 2)
    if "llama.cpp" in engines:
        missing = llama_cpp_missing(cache)
        if missing is None:
            llama = LlamaCpp(cached_gguf(FOLDER, cache), cache)
            host["llama_cpp"] = llama_cpp.version(cache)["server_version"]
        else:
            notes.append(f"llama.cpp not run: {missing}.")
    if "transformers" in engines:
        try:
            hf = HF(FOLDER)
            host["transformers"] = hf.version
        except ImportError as err:
            notes.append(f"transformers not run: {err} (pip install -r requirements-dev.txt).")
    for note in notes:
        progress(note)
    todo = tasks(size, ours, hf, llama)
    load_before, started = _load(), time.perf_counter()
    samples: dict[tuple, list[float]] = {}
    for rnd in range(size.repeats + 1):                       # round 0: the warm-up, not kept
        k = rnd % len(todo)
        for task in todo[k:] + todo[:k]:
            for key, value in task().items():
                if rnd > 0:
                    samples.setdefault(key, []).append(value)
        progress(f"round {rnd}/{size.repeats}{' (warm-up)' if rnd == 0 else ''} done, "
                 f"{time.perf_counter() - started:.0f} s, load {_load():.2f}")
    torch.set_num_threads(threads_before)
    flops = model_flops(FOLDER)
    rows = []
    for measure, sizes in (("prefill", size.prefill), ("decode", size.batches)):
        for n in sizes:
            # mean context: half the prompt for a prefill; the decode prompt plus half of what is generated
            context = (n - 1) / 2 if measure == "prefill" else DECODE_PROMPT_TOKENS + size.ntg / 2
            for t in size.threads:
                rows.append({"measure": measure, "size": n, "threads": t, "flops_per_token": flops.per_token(context),
                             **{e: (_spread(samples[(e, measure, n, t)]) if (e, measure, n, t) in samples else None)
                                for e in ("ours", "llama.cpp", "transformers")}})
    return {"measured_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"), "host": host,
            "load_avg_1m": {"before": load_before, "after": _load()}, "repeats": size.repeats, "warmup": 1,
            "wall_s": time.perf_counter() - started, "quick": quick, "size": size._asdict(),
            "model": {"folder": str(FOLDER.relative_to(REPO)) if FOLDER.is_relative_to(REPO) else str(FOLDER),
                      **flops._asdict()},
            "matmul_gflops": {str(t): _spread(samples[("matmul", "", 0, t)]) for t in size.threads},
            "rows": rows, "notes": notes + conditions(size)}


def conditions(size: Size) -> list[str]:
    """How each engine was run, one line each (kept in the results, shown with the table)."""
    return [
        f"ours: ServeEngine on weights/kda-demo, no prefix cache, 16-token blocks; prefill = prompt tokens / time to "
        f"the first token of one request (whole prompt in one chunk); decode = B requests of {DECODE_PROMPT_TOKENS}-token "
        f"prompts all decoding, B x {size.steps} / the time of {size.steps} engine steps.",
        "llama.cpp: the same folder converted to an f32 GGUF by its convert_hf_to_gguf.py, flash attention off; "
        "prefill = llama-bench -p ... -n 0 -r 1 (one warm-up run of its own; K/V cache f16: llama-bench takes no "
        f"f32 cache type); decode = llama-batched-bench -npp {DECODE_PROMPT_TOKENS} -ntg {size.ntg} -npl "
        f"{','.join(map(str, size.batches))} (f32 K/V cache), speed_tg = B x ntg / generation time.",
        f"transformers: KimiLinearForCausalLM fp32 (its pure-torch fallbacks: no fla, no causal-conv1d); prefill = one "
        f"forward with the cache on; decode = generate (greedy) on B prompts of {HF_DECODE_PROMPT_TOKENS} token (its torch "
        f"chunk fallback made a batched {DECODE_PROMPT_TOKENS}-token prefill cost 11 s at batch 64; equal lengths: the "
        f"left-padded batch has no pad), B x {size.hf_steps} / the time from the first token's step to "
        f"the last (a StoppingCriteria stamps each step); batches {', '.join(map(str, size.hf_batches))}, prefill "
        f"{', '.join(map(str, size.hf_prefill))}.",
        f"limit: torch fp32 matmul {MATMUL_N}^3 at each thread count in the same rounds / the model's FLOPs per "
        "token (2 x active weights + KDA recurrence + MLA attention at the row's mean context).",
    ]


# ---- README sections, regenerated from the results file -----------------------------------------------------
def bench_readme_section(result: dict) -> str:
    """``## peers.json`` of bench/README.md (heading included)."""
    met = [v for v in verdicts(result) if v.status != "not run"]
    return "\n".join([
        "## peers.json", "",
        "`python -m bench.peers` (`--quick`: fewer steps; `--readme`: rewrite this section "
        "and the README's from the file): ours, llama.cpp and transformers on the shipped weights, same machine, one "
        "run. " + stamp(result) + ".", "",
        *[f"- {c}" for c in result["notes"]], "",
        markdown(peers_table(result)), "",
        *[f"{c}\n" for c in caveats(result)],
        f"Goals met: {sum(v.status == 'met' for v in met)} of {len(met)} judged "
        f"(model: {result['model']['weights']:,} weight FLOPs per token; matmul "
        + ", ".join(f"{s['median']:.0f} GFLOP/s at {t} thread(s)" for t, s in result["matmul_gflops"].items())
        + ").", ""])


def readme_section(result: dict) -> str:
    """``## Performance`` of the top-level README.md (heading included)."""
    return "\n".join([
        "## Performance", "",
        "Our engine beside llama.cpp and transformers on the shipped weights (`weights/kda-demo`, fp32), same "
        "machine, one run; tokens/s, median (min–max); the limit is this machine's fp32 matmul rate over the "
        "model's FLOPs per token. " + stamp(result) + ". Regenerated by `python -m bench.peers` (conditions in "
        "`bench/README.md`); page 16 shows it.", "",
        markdown(peers_table(result)), "",
        *[f"{c}\n" for c in caveats(result)]])


def write_readmes(result: dict, repo: Path = REPO) -> None:
    """Rewrite bench/README.md's ``## peers.json`` and README.md's ``## Performance`` from ``result``."""
    bench = repo / "bench" / "README.md"
    bench.write_text(replace_section(bench.read_text(), "## peers.json", bench_readme_section(result),
                                     "## pool.json"))
    top = repo / "README.md"
    top.write_text(replace_section(top.read_text(), "## Performance", readme_section(result), "## Conformance suite"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps, transformers' prefill at 128 tokens only")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds after the warm-up (>= 5)")
    p.add_argument("--engines", default="ours,llama.cpp,transformers", help="comma-separated subset")
    p.add_argument("--out", default=None, help="results file (default: bench/results/peers.json; --quick: a temp "
                   "file, and the READMEs are left alone)")
    p.add_argument("--readme", action="store_true", help="only regenerate the README sections from --out")
    args = p.parse_args(argv)
    engines = tuple(e for e in args.engines.split(",") if e)
    if bad := set(engines) - {"ours", "llama.cpp", "transformers"}:
        p.error(f"--engines: unknown {sorted(bad)}; choose from ours, llama.cpp, transformers")
    if args.repeats < 5:
        p.error(f"--repeats must be >= 5, got {args.repeats}")
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "peers-quick.json" if args.quick else OUT)
    if args.readme:
        if not out.is_file():
            sys.exit(f"{out} not found: run `python -m bench.peers` first")
        write_readmes(json.loads(out.read_text()))
        print("README.md and bench/README.md regenerated from", out)
        return
    result = run((QUICK if args.quick else FULL)._replace(repeats=args.repeats), engines, quick=args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(peers_table(result)))
    for v in verdicts(result):
        print(f"{v.row:>22} @ {v.threads} thread(s): ours {v.goal}: {v.status}"
              + ("" if v.ratio is None else f" ({v.ratio:.3g}x)"))
    print(stamp(result), "->", out)
    if out == OUT:
        write_readmes(result)
        print("README.md and bench/README.md regenerated")


if __name__ == "__main__":
    main()
