"""What a KDA state loses in each storage format on the trained model: ``python -m bench.state_precision``.

Runs :func:`lab.state_precision.precision_run` on a whole held-out file (default ``chunk.py``, 5,500 bytes:
the longest held-out code file whose token-by-token decode of every format fits about half an hour on one
shared core; the MLA decode re-reads every latent, so a run grows as T^2: ``opcode.py``, 10,447 bytes, was
on course for 105 minutes), then ``--continue`` free-running tokens. Prints and writes ``bench/results/state_precision.json``: the per-format summary, the drift curves at
log-spaced positions, the low-decay probe (:func:`lab.state_capacity.low_decay_probe`) and the capacity
table at Kimi-Linear-48B-A3B / Kimi K3 bytes on an H200 (:func:`lab.state_capacity.capacity_table`).

Accuracy figures, not timings: they do not depend on the load; the wall time and load average are recorded.
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

import numpy as np
import pandas as pd
import torch

from lab.models import TRAINED_WEIGHTS
from lab.state_capacity import capacity_table, low_decay_probe
from lab.state_precision import precision_run

OUT = Path(__file__).parent / "results" / "state_precision.json"
CONTEXTS = (0, 4096, 32768, 131072)
DECAYS = (1e-2, 1e-4, 1e-6)


def dump(result: dict) -> str:
    """``result`` as indented JSON with each curve column on one line (768 values per column)."""
    text = json.dumps({k: v for k, v in result.items() if k != "curves"}, indent=1, default=str)
    columns = ",\n".join(f"  {json.dumps(c)}: {json.dumps(v)}" for c, v in result["curves"].items())
    return text[:-2] + ',\n "curves": {\n' + columns + "\n }\n}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--document", default="chunk.py")
    ap.add_argument("--tokens", type=int, default=None, help="teacher-forced tokens (default: the whole file)")
    ap.add_argument("--continue", dest="cont", type=int, default=128)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--sr-seeds", type=int, default=0,
                    help="instead: fp32, fp8 e4m3 and fp8 e4m3 + stochastic rounding over this many seeds "
                         "(--tokens, default 1024), written to bench/results/state_precision_sr.json")
    args = ap.parse_args()
    if args.sr_seeds:
        return sr_seeds(args)
    from lab.state_precision import heldout_documents
    n = args.tokens or len(heldout_documents()[args.document])
    load0, t0 = os.getloadavg()[0], time.time()

    def progress(f):
        print(f"{f:6.1%}  {time.time() - t0:7.0f} s", flush=True)

    run = precision_run(args.document, n, args.cont, draft_len=args.draft_len, seed=args.seed, progress=progress)
    wall = time.time() - t0
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 30)
    print(run.summary.to_string(index=False))
    print("fp32 row bitwise equal to plain batch-1 decode:", run.fp32_bitwise)
    positions = sorted(set(np.unique(np.geomspace(1, n, 120).astype(int)).tolist()) | {n})
    curves = run.curves[run.curves.position.isin(positions)]
    probe = [dict(decay=d, **low_decay_probe(4096, decay=d).drop(columns="position").max().to_dict()) for d in DECAYS]
    print(pd.DataFrame(probe).to_string(index=False))
    cap = pd.concat([capacity_table(c) for c in CONTEXTS])
    print(cap.to_string(index=False))
    weights = TRAINED_WEIGHTS["demo"] / "model.safetensors"
    result = dict(
        weights_sha256=hashlib.sha256(weights.read_bytes()).hexdigest(),
        document=run.document, num_tokens=n, continue_tokens=args.cont, draft_len=args.draft_len, seed=args.seed,
        fp32_bitwise=run.fp32_bitwise, summary=run.summary.to_dict(orient="records"),
        curves={c: [float(f"{v:.4g}") if isinstance(v, float) else v for v in curves[c].tolist()] for c in curves}, continuations=run.continuations, low_decay=probe,
        capacity=cap.to_dict(orient="records"),
        conditions=dict(wall_s=round(wall, 1), torch_threads=1, load_avg_1m_start=load0,
                        load_avg_1m_end=os.getloadavg()[0], python=sys.version.split()[0], torch=torch.__version__,
                        machine=platform.machine()))
    args.out.write_text(dump(result))
    print("wrote", args.out)


def sr_seeds(args) -> None:
    """Stochastic rounding's spread over seeds: one run per seed (the round-to-nearest row is the same every
    time), the drift at the end and the agreement, printed as median [min, max]."""
    n, rows = args.tokens or 1024, []
    t0, load0 = time.time(), os.getloadavg()[0]
    for seed in range(args.sr_seeds):
        run = precision_run(args.document, n, args.cont, formats=("fp32", "fp8_e4m3", "fp8_e4m3_sr"),
                            draft_len=args.draft_len, seed=seed)
        rows += [dict(seed=seed, **r) for r in run.summary.to_dict(orient="records")]
        print(f"seed {seed} done, {time.time() - t0:.0f} s", flush=True)
    df = pd.DataFrame(rows)
    spread = df.groupby("format")[["final_state_rel_err", "agreement", "top1", "first_divergence"]].agg(
        ["median", "min", "max"])
    print(spread.to_string())
    out = args.out if args.out != OUT else OUT.with_name("state_precision_sr.json")
    out.write_text(json.dumps(dict(document=args.document, num_tokens=n, continue_tokens=args.cont,
                                   seeds=args.sr_seeds, runs=rows,
                                   conditions=dict(wall_s=round(time.time() - t0, 1), torch_threads=1,
                                                   load_avg_1m_start=load0, load_avg_1m_end=os.getloadavg()[0])),
                              indent=1, default=str) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
