"""The serving engine with bf16 / fp16 stored KDA states on the trained model: ``python -m bench.state_dtype``.

Runs :func:`lab.state_dtype.engine_agreement` (every held-out prompt of the Home rule's step 1 served through
``ServeEngine`` once with fp32 states and once per 16-bit dtype: greedy agreement with fp32 at generation lengths
1 / 16 / 64 / 256, tokens until the first divergence, logit drift) and :func:`lab.state_dtype.slot_table` (state
slots and requests per pool, same pages, by dtype). Then the cost of the conversions: wall time of serving
``--time-prompts`` prompts for ``--time-tokens`` tokens per dtype, ``--repeats`` interleaved repeats after one
warm-up, one torch thread, printed as median [min, max] and as a ratio to fp32 measured in the same run.

Writes ``bench/results/state_dtype.json``. Agreement and slots are exact figures (they do not depend on the load);
the timings do, and the load average and threads are recorded beside them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from lab.models import TRAINED_WEIGHTS
from lab.state_dtype import BENCH_RESULT, engine_agreement, heldout_prompts, serve_greedy, slot_table

DTYPES = ("fp32", "bf16", "fp16")


def time_dtypes(num_prompts: int, max_new_tokens: int, repeats: int) -> pd.DataFrame:
    """Wall seconds of :func:`serve_greedy` per dtype: one warm-up round, then ``repeats`` rounds with the dtypes
    interleaved (fp32, bf16, fp16, fp32, ...). One row per dtype: median, min, max, repeats, ratio of medians to
    fp32's."""
    prompts = [p for _, p in heldout_prompts(num_prompts)]
    for d in DTYPES:
        serve_greedy(prompts, max_new_tokens, d)
    wall = {d: [] for d in DTYPES}
    for _ in range(repeats):
        for d in DTYPES:
            t0 = time.perf_counter()
            serve_greedy(prompts, max_new_tokens, d)
            wall[d].append(time.perf_counter() - t0)
    df = pd.DataFrame([dict(state_dtype=d, median_s=float(pd.Series(w).median()), min_s=min(w), max_s=max(w),
                            repeats=len(w)) for d, w in wall.items()])
    df["vs_fp32"] = df.median_s / df.median_s.iloc[0]
    return df


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=48, help="held-out prompts (default: all %(default)s cuts)")
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens per prompt (default: %(default)s)")
    ap.add_argument("--time-prompts", type=int, default=8)
    ap.add_argument("--time-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=BENCH_RESULT)
    args = ap.parse_args()
    pd.set_option("display.width", 220)
    load0, t0 = os.getloadavg()[0], time.time()
    run = engine_agreement(args.prompts, args.tokens)
    print(run.summary.to_string(index=False))
    print(run.per_prompt.groupby("state_dtype").first_divergence.describe().to_string())
    slots = slot_table()
    print(slots.to_string(index=False))
    load1 = os.getloadavg()[0]
    timing = time_dtypes(args.time_prompts, args.time_tokens, args.repeats)
    print(timing.to_string(index=False))
    weights = TRAINED_WEIGHTS["demo"] / "model.safetensors"
    result = dict(
        weights_sha256=hashlib.sha256(weights.read_bytes()).hexdigest(), num_prompts=args.prompts,
        max_new_tokens=args.tokens, engine="ServeEngine batched, max_num_seqs 16, no prefix cache, ServeConfig() "
        "(16-token blocks, multi_page)", summary=run.summary.to_dict(orient="records"),
        per_prompt=run.per_prompt.to_dict(orient="records"), slots=slots.to_dict(orient="records"),
        timing=dict(num_prompts=args.time_prompts, max_new_tokens=args.time_tokens,
                    rows=timing.to_dict(orient="records")),
        conditions=dict(wall_s=round(time.time() - t0, 1), torch_threads=1, cpu_count=os.cpu_count(),
                        load_avg_1m_start=load0, load_avg_1m_before_timing=load1, load_avg_1m_end=os.getloadavg()[0],
                        python=sys.version.split()[0], torch=torch.__version__, machine=platform.machine()))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
