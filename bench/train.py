"""Training throughput of the demo model's shape family: ``python -m bench.train``.

One AdamW training step (forward, backward, update; the loop of ``python -m train``) per candidate shape and
batch, interleaved over ``--rounds`` rounds after one warm-up step each, on ``--threads`` torch threads.
Prints per candidate the median bytes (tokens) per second with the min and max over rounds, and CPU seconds
per 1,000 bytes (process time, so a loaded machine shows in wall time but less in CPU time), with the load
average before and after. Writes ``bench/results/train.json``. This sizes the trained models (target and draft): ``train/model_config.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch

from kda_core.config import PRESETS, kimi_pattern
from kda_core.model import HybridLM
from train.evaluate import loss_of
from train.loop import TrainArgs, make_optimizer

OUT = Path(__file__).parent / "results" / "train.json"
# name -> (config changes to the demo preset, batch B, window T)
CANDIDATES = {
    "demo f256 (1.49 M) B4xT512": ({}, 4, 512),
    "kda-demo f512 (2.28 M) B4xT512": ({"intermediate_size": 512}, 4, 512),
    "kda-demo f512 (2.28 M) B8xT256": ({"intermediate_size": 512}, 8, 256),
    "d192 H6 f512 (3.82 M) B4xT512": ({"hidden_size": 192, "num_heads": 6, "num_mla_heads": 6,
                                       "kv_lora_rank": 96, "intermediate_size": 512}, 4, 512),
    "kda-draft 1 KDA + 1 MLA f512 (0.61 M) B4xT512": ({"num_layers": 2, "mla_layers": kimi_pattern(2),
                                                       "intermediate_size": 512}, 4, 512),
    "draft 2 KDA f512 (0.63 M) B4xT512": ({"num_layers": 2, "mla_layers": (), "intermediate_size": 512}, 4, 512),
    "draft 1 KDA + 1 MLA f512 (0.61 M) B8xT512": ({"num_layers": 2, "mla_layers": kimi_pattern(2),
                                                   "intermediate_size": 512}, 8, 512),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    ns = p.parse_args(argv)
    torch.set_num_threads(ns.threads)
    runs = {}
    for name, (change, B, T) in CANDIDATES.items():
        model = HybridLM(dataclasses.replace(PRESETS["demo"], **change)).requires_grad_(True).train()
        x = torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(0))
        runs[name] = (model, make_optimizer(model, TrainArgs()), x)

    def step(name):
        model, opt, x = runs[name]
        loss = loss_of(model(x[:, :-1]).logits, x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    load_before = os.getloadavg()[0]
    for name in runs:
        step(name)                                                            # warm-up
    wall, cpu = {n: [] for n in runs}, {n: [] for n in runs}
    for _ in range(ns.rounds):
        for name in runs:
            w0, c0 = time.perf_counter(), time.process_time()
            step(name)
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    rows = []
    for name, (_, B, T) in CANDIDATES.items():
        n_tok = B * T
        tps = sorted(n_tok / w for w in wall[name])
        rows.append({"candidate": name, "parameters": sum(q.numel() for q in runs[name][0].parameters()),
                     "tokens_per_step": n_tok, "tokens_per_s_median": statistics.median(tps),
                     "tokens_per_s_min": tps[0], "tokens_per_s_max": tps[-1],
                     "cpu_s_per_1k_tokens_median": statistics.median(c / n_tok * 1000 for c in cpu[name])})
        r = rows[-1]
        print(f"{name:34s} {r['parameters']:>9,} params  {r['tokens_per_s_median']:7.0f} bytes/s "
              f"[{r['tokens_per_s_min']:.0f}, {r['tokens_per_s_max']:.0f}]  "
              f"{r['cpu_s_per_1k_tokens_median']:.3f} CPU-s per 1k bytes")
    conditions = {"threads": ns.threads, "rounds": ns.rounds, "torch": torch.__version__,
                  "load_average_1min_before": load_before, "load_average_1min_after": os.getloadavg()[0]}
    print(f"conditions: {conditions}")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"conditions": conditions, "candidates": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
