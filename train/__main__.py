"""``python -m train --out DIR [--model NAME] [...]``: train (or resume) a shipped model on the stdlib corpus.

``--model`` picks the shape (``train/model_config.py``): ``kda-demo`` (the target, default) or ``kda-draft``
(its 2-layer draft model). Examples (the shipped runs)::

    nohup nice -n 10 python -m train --out /work/train_runs/kda-demo > /work/train_runs/train.log 2>&1 &
    setsid nohup nice -n 10 env OMP_NUM_THREADS=1 python -m train --model kda-draft --out /work/runs/kda-draft \
        > /work/runs/kda-draft/train.log 2>&1 &

Re-running the same command resumes from ``DIR/checkpoint.pt``. Export with ``python -m train.export``.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from kda_core.model import HybridLM
from train.corpus import check_against_manifest, documents, join, load_manifest
from train.loop import TrainArgs, train
from train.model_config import TRAINED_MODELS, TRAINED_NAME, model_config


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="run directory (checkpoint, loss.csv, eval.csv)")
    p.add_argument("--model", choices=TRAINED_MODELS, default=TRAINED_NAME, help="model shape to train")
    defaults = TrainArgs()
    for f in dataclasses.fields(TrainArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "device":
            p.add_argument(flag, choices=("cpu", "cuda"), default=defaults.device)
        else:
            p.add_argument(flag, type=type(getattr(defaults, f.name)), default=getattr(defaults, f.name))
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (CPU; 1 on a shared machine, where 2 threads spin-wait)")
    p.add_argument("--no-manifest-check", action="store_true",
                   help="train on this Python's stdlib even if it differs from train/corpus_manifest.json")
    return p.parse_args(argv)


def main(argv=None) -> None:
    ns = parse_args(argv)
    torch.set_num_threads(ns.threads)
    args = TrainArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(TrainArgs)})
    docs = documents()
    if not ns.no_manifest_check:
        check_against_manifest(docs, load_manifest())
    data = join(docs)
    cfg = model_config(ns.model)
    n_params = sum(p.numel() for p in HybridLM(cfg).parameters())
    print(f"model {cfg.name}: {n_params:,} parameters; train {len(data.train):,} bytes, held-out code "
          f"{len(data.heldout_code):,} / prose {len(data.heldout_prose):,} bytes; {args}", flush=True)
    train(cfg, data, args, ns.out)


if __name__ == "__main__":
    main()
