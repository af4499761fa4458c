"""``python -m train.export --run DIR --out weights/kda-demo``: ship a run's current weights.

Writes into ``--out``: the checkpoint in Kimi-Linear's format (``model.safetensors`` in fp32 + ``config.json``,
:mod:`kda_core.pretrained`; ``tokenizer.json`` + ``tokenizer_config.json``, :mod:`kda_core.tokenizer`), the loss
curve (``loss.csv``, ``eval.csv`` copied from the run) and ``manifest.json``: sha256 and size of each shipped
file, the training summary (step, bytes trained, hours, where), the held-out quality table (nats per byte
and greedy top-1 on code and prose beside xz's nats per byte on the same bytes) and the CI record: a held-out
code and a prose sample with the loss and the last-position logits that the shipped weights give.
The tests compare against this record, so they hold for whichever export is committed. ``greedy``: what the
weights write after the first half of each sample (informational).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from kda_core.model import HybridLM
from kda_core.tokenizer import write_tokenizer
from train import checkpoint
from train.batches import as_tensor, eval_windows
from train.corpus import KINDS, check_against_manifest, documents, join, load_manifest, xz_nats_per_byte
from train.evaluate import evaluate, loss_of
from train.loop import config_from_dict

MANIFEST_NAME = "manifest.json"
SAMPLE_BYTES = 512          # bytes of each CI sample (from the start of a held-out document)
LOGIT_POSITIONS = 4         # last positions of a sample whose logits are recorded
QUALITY_WINDOWS = 32        # held-out windows of 512 bytes per kind in the quality table
GREEDY_BYTES = 160         # bytes of each greedy continuation recorded in the manifest
SHIPPED_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "loss.csv", "eval.csv")
STORE_DTYPE = torch.float32   # fp32: the trained values themselves (4 M parameters: 16 MB), as every peer loads them


def sha256_file(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def sample_record(model: HybridLM, text: bytes) -> dict:
    """The CI record of one sample: its text, mean next-byte loss (nats) and the last positions' logits."""
    x = torch.tensor(list(text), dtype=torch.long)[None]                   # [1, T]
    logits = model(x[:, :-1]).logits                                       # [1, T - 1, 256]
    return {"text": text.decode("utf-8"), "loss_nats": loss_of(logits, x[:, 1:]).item(),
            "logits_last": logits[0, -LOGIT_POSITIONS:].tolist()}


def greedy_sample(model: HybridLM, prompt: bytes, num_bytes: int = GREEDY_BYTES) -> dict:
    """Greedy continuation of ``prompt`` (informational: shows what the shipped weights write; not checked
    by the tests, as an argmax tie may break differently on another machine)."""
    new, _ = model.generate(torch.tensor(list(prompt), dtype=torch.long)[None], num_bytes)   # [1, num_bytes]
    return {"prompt": prompt.decode("utf-8"), "continuation": bytes(new[0].tolist()).decode("utf-8", "replace")}


def ci_sample(docs, kind: str) -> bytes:
    """The first ``SAMPLE_BYTES`` bytes (cut back to whole UTF-8 characters) of the first held-out document
    of ``kind`` that long."""
    doc = next(d for d in docs if d.split == "heldout" and d.kind == kind and len(d.data) >= SAMPLE_BYTES)
    return doc.data[:SAMPLE_BYTES].decode("utf-8", errors="ignore").encode("utf-8")


def export(run_dir, out_dir, where: str) -> dict:
    """Export the checkpoint of ``run_dir`` into ``out_dir``; returns the manifest written.
    Raises ValueError when ``run_dir`` holds no checkpoint."""
    ckpt = checkpoint.load(run_dir)
    if ckpt is None:
        raise ValueError(f"run_dir must hold a checkpoint ({checkpoint.checkpoint_path(run_dir)} does not exist)")
    model = HybridLM(config_from_dict(ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    out = Path(out_dir)
    model.save_pretrained(out, STORE_DTYPE)
    write_tokenizer(out)
    for name in ("loss.csv", "eval.csv"):                                 # the run may be ahead of its checkpoint
        lines = (Path(run_dir) / name).read_text().splitlines(keepends=True)
        (out / name).write_text("".join(lines[:1] + [ln for ln in lines[1:] if int(ln.split(",")[0]) <= ckpt["step"]]))
    shipped = HybridLM.from_pretrained(out)                               # the stored weights, as loaded
    docs = documents()
    check_against_manifest(docs, load_manifest())
    data = join(docs)
    quality = {}
    for kind, raw in zip(KINDS, (data.heldout_code, data.heldout_prose)):
        q = evaluate(shipped, eval_windows(as_tensor(raw), QUALITY_WINDOWS, ckpt["args"]["seq_len"]))
        quality[kind] = {"nats_per_byte": q.nats_per_byte, "top1": q.top1, "num_bytes": q.num_bytes,
                         "xz_nats_per_byte": xz_nats_per_byte(raw), "heldout_bytes": len(raw)}
    manifest = {
        "model": model.cfg.name, "num_parameters": sum(p.numel() for p in model.parameters()),
        "weights_dtype": str(STORE_DTYPE).removeprefix("torch."),
        "files": {name: {"sha256": sha256_file(out / name), "num_bytes": (out / name).stat().st_size}
                  for name in SHIPPED_FILES},
        "training": {"step": ckpt["step"], "max_steps": ckpt["args"]["max_steps"], "bytes_trained": ckpt["tokens"],
                     "hours": ckpt["elapsed_s"] / 3600, "where": where, "args": ckpt["args"]},
        "corpus": {"manifest_sha256": sha256_file(Path(__file__).resolve().parent / "corpus_manifest.json"),
                   "python_version": load_manifest()["python_version"], "license": "PSF-2.0"},
        "quality": quality,
        "ci_samples": {kind: sample_record(shipped, ci_sample(docs, kind)) for kind in KINDS},
        "greedy": {kind: greedy_sample(shipped, ci_sample(docs, kind)[:SAMPLE_BYTES // 2].decode(
            "utf-8", errors="ignore").encode("utf-8")) for kind in KINDS},
    }
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="run directory of python -m train")
    p.add_argument("--out", default="weights/kda-demo", help="model folder to write (default weights/kda-demo)")
    p.add_argument("--where", default=f"CPU ({platform.machine()}, {os.cpu_count()} cores shared with other jobs), "
                   f"torch {torch.__version__}",
                   help="where the run trained (recorded in the manifest)")
    p.add_argument("--threads", type=int, default=2)
    ns = p.parse_args(argv)
    torch.set_num_threads(ns.threads)
    m = export(ns.run, ns.out, ns.where)
    t, q = m["training"], m["quality"]
    print(f"exported step {t['step']} ({t['bytes_trained']:,} bytes, {t['hours']:.2f} h) to {ns.out}: "
          + "; ".join(f"{k} {q[k]['nats_per_byte']:.3f} nats/byte (xz {q[k]['xz_nats_per_byte']:.3f}), "
                      f"top-1 {q[k]['top1']:.3f}" for k in KINDS))


if __name__ == "__main__":
    main()
