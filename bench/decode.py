"""Benchmark of the speculative-decoding rollback strategies: ``python -m bench.decode``.

For draft lengths n = 1..8, on the demo model (8 layers: 6 KDA + 2 MLA, d = 128) and on a single KDA
layer at Kimi K3 width (d = 7168, H = 96, K = V = 128, lower-bound gate): the bytes each strategy holds
after a real verify of 1 + n tokens (fp32, ``nbytes()``) and its commit time with all n drafts accepted
and with none (median of repeats, one torch thread, every repeat on a freshly recorded verify).
Ratios are within one run: snapshot bytes / projection bytes, snapshot bytes / raw-input bytes,
replay commit ms / snapshot commit ms, ring commit ms / snapshot commit ms.
Writes ``bench/results/decode.json``.
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from kda_core.config import ModelConfig
from kda_core.model import HybridLM
from lab.ring import bytes_vs_draft, commit_times
from lab.verify import STRATEGIES

OUT = Path(__file__).parent / "results" / "decode.json"
SNAP, PROJ, RING = STRATEGIES[:3]            # display names, in the order of serve.spec_decode.verify.STRATEGIES


def k3_layer() -> HybridLM:
    """One KDA layer at Kimi K3 width (weights ~1.4 GB fp32, generated from the seed)."""
    return HybridLM(ModelConfig(name="k3-width-layer", num_layers=1, mla_layers=(), hidden_size=7168, num_heads=96,
                                head_k_dim=128, head_v_dim=128, kv_lora_rank=512, qk_rope_head_dim=64,
                                gate="lower_bound", lower_bound=-5.0, intermediate_size=256,
                                source="Kimi K3 KDA layer width (moonshotai/Kimi-K3 config.json)"))


def run(model: HybridLM, max_draft: int, repeats: int) -> list[dict]:
    held = {(r["draft_tokens"], r["strategy"]): r["bytes"] for r in bytes_vs_draft(model, max_draft)}
    rows = []
    for n in range(1, max_draft + 1):
        ms = {(r["accepted"], r["strategy"]): r["commit_ms"] for r in commit_times(model, n, repeats, accepted=(0, n))[0]}
        row = {"draft_tokens": n}
        for s in (SNAP, PROJ, RING):
            row[f"{s} bytes"] = held[(n, s)]
            row[f"{s} commit ms (all accepted)"] = ms[(n, s)]
            row[f"{s} commit ms (none accepted)"] = ms[(0, s)]
        row["snapshot/projection bytes"] = held[(n, SNAP)] / held[(n, PROJ)]
        row["snapshot/raw bytes"] = held[(n, SNAP)] / held[(n, RING)]
        row["replay/snapshot commit ms"] = ms[(n, PROJ)] / ms[(n, SNAP)]
        row["ring/snapshot commit ms"] = ms[(n, RING)] / ms[(n, SNAP)]
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-k3", action="store_true", help="only the demo model (the K3 layer needs ~1.4 GB)")
    args = ap.parse_args(argv)
    results = {"meta": {"torch": torch.__version__, "machine": platform.machine(), "threads": 1,
                        "repeats": args.repeats, "dtype": "fp32"}, "models": {}}
    models = [("demo", HybridLM)] + ([] if args.skip_k3 else [("k3-width-layer", k3_layer)])
    for name, build in models:
        rows = run(build(), args.max_draft, args.repeats)
        results["models"][name] = rows
        print(f"\n{name}: bytes held after the verify, commit ms with all drafts accepted (median of {args.repeats})")
        print(f"{'n':>2} {'snap B':>12} {'proj B':>11} {'raw B':>10} {'snap/proj':>9} {'snap/raw':>8} "
              f"{'snap ms':>8} {'proj ms':>8} {'ring ms':>8} {'proj/snap':>9} {'ring/snap':>9}")
        for r in rows:
            print(f"{r['draft_tokens']:>2} {r[f'{SNAP} bytes']:>12,} {r[f'{PROJ} bytes']:>11,} {r[f'{RING} bytes']:>10,} "
                  f"{r['snapshot/projection bytes']:>9.1f} {r['snapshot/raw bytes']:>8.1f} "
                  f"{r[f'{SNAP} commit ms (all accepted)']:>8.3f} {r[f'{PROJ} commit ms (all accepted)']:>8.3f} "
                  f"{r[f'{RING} commit ms (all accepted)']:>8.3f} {r['replay/snapshot commit ms']:>9.1f} "
                  f"{r['ring/snapshot commit ms']:>9.1f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
