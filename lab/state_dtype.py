"""The engine storing its KDA recurrent states in bf16 / fp16 (page 17 "In the engine", ``bench/state_dtype.py``).

Unlike :mod:`lab.state_precision` (a per-token store / load simulation of many formats), this runs the serving
engine itself, :class:`serve.engine.ServeEngine` with ``ServeConfig(state_dtype=...)``, on the trained demo
model: every prompt is served once per state dtype (batched, greedy, no prefix cache), and each dtype's tokens
are compared with the fp32 engine's. Prompts: the held-out cuts of the Home prompt rule, step 1
(:func:`train.prompts.candidates`, ``train/demo_prompts.json``): each held-out code file up to the first body
statement of a function, 256 to 1,200 bytes.

Slots: every state dtype on the same pool, sized as ``python -m serve.http`` sizes it for fp32 (:func:`slot_table`).
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pandas as pd
import torch

from kda_core.config import PRESETS
from lab.models import demo_model
from lab.shipped import read_shipped, result_path
from lab.threads import one_thread
from serve.config import STATE_DTYPES, ServeConfig
from serve.engine import EngineArgs, build_engine
from serve.engine.request import RequestStatus
from serve.errors import check_choice, check_int
from serve.http.model import EngineSpec

BENCH_RESULT = result_path("state_dtype")
LENGTHS = (1, 16, 64, 256)        # generated tokens at which agreement with fp32 is reported
SLOT_MODELS = ("demo", "kimi-linear-48b-a3b")


def heldout_prompts(num_prompts: int) -> list[tuple[str, list[int]]]:
    """The first ``num_prompts`` held-out prompts of the Home rule's step 1, in rule order: ``(label
    "path::function", byte ids)``. Raises ValueError unless 1 <= num_prompts <= the cuts available (48)."""
    from train.corpus import documents
    from train.prompts import candidates

    cuts = [(f"{doc.path}::{name}", list(doc.data[:b])) for doc, _, b, name in candidates(documents())]
    check_int("num_prompts", num_prompts)
    if num_prompts > len(cuts):
        raise ValueError(f"num_prompts must be at most {len(cuts)} (held-out cuts of the rule), got {num_prompts}")
    return cuts[:num_prompts]


def serve_greedy(prompts: list[list[int]], max_new_tokens: int, state_dtype: str,
                 max_num_seqs: int = 16) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Serve every prompt once through the batched engine (demo model, no prefix cache, states stored in
    ``state_dtype``, a key of :data:`serve.config.STATE_DTYPES`), one torch thread. Returns per prompt its
    greedy tokens and logits ``[max_new_tokens, 256]`` fp32. Raises ValueError for a bad dtype name or size,
    RuntimeError if a request does not finish."""
    check_choice("state_dtype", state_dtype, tuple(STATE_DTYPES))
    check_int("max_new_tokens", max_new_tokens)
    model = demo_model()
    config = ServeConfig(state_dtype=STATE_DTYPES[state_dtype])
    layout = config.layout(model.cfg)
    need = [layout.state_pages + -(-(len(p) + max_new_tokens) // layout.block_size) for p in prompts]
    num_pages = sum(sorted(need)[-max_num_seqs:])                          # the max_num_seqs largest fit at once
    engine = build_engine(EngineArgs(model, num_pages, config, max_num_seqs=max_num_seqs))
    with one_thread():
        rids = [engine.submit(p, max_new_tokens, record_logits=True) for p in prompts]
        engine.run_until_idle()
    out = []
    for rid in rids:
        res = engine.result(rid)
        if res.status is not RequestStatus.FINISHED:
            raise RuntimeError(f"request {rid} ended {res.status.value}: {res.reason}")
        out.append((res.output_tokens, res.logits))
    return out


class EngineAgreement(NamedTuple):
    """What :func:`engine_agreement` measured.

    per_prompt: one row per (prompt, state dtype): ``prompt``, ``prompt_tokens``, ``state_dtype``,
        ``first_divergence`` (generated tokens equal to the fp32 engine's before the first different one;
        ``max_new_tokens`` when all are equal), ``identical``, ``max_logit_diff`` (max |z - z_fp32| over the
        positions whose inputs are still identical: up to and including the first divergence, logits units).
    summary: one row per (state dtype, generation length n in :data:`LENGTHS` up to ``max_new_tokens``):
        ``agreement`` (fraction of prompts whose first n tokens equal fp32's), ``median_first_divergence``,
        ``min_first_divergence``, ``median_max_logit_diff``.
    """

    per_prompt: pd.DataFrame
    summary: pd.DataFrame


def engine_agreement(num_prompts: int = 8, max_new_tokens: int = 64,
                     state_dtypes: tuple[str, ...] = ("bf16", "fp16")) -> EngineAgreement:
    """Serve :func:`heldout_prompts` through the engine in fp32 and in each of ``state_dtypes``
    (:func:`serve_greedy`) and compare greedy tokens and logits with fp32's. Raises ValueError for a bad
    size or dtype name (fp32 itself is the reference, not a choice)."""
    for d in state_dtypes:
        check_choice("state_dtypes", d, tuple(k for k in STATE_DTYPES if k != "fp32"))
    prompts = heldout_prompts(num_prompts)
    ref = serve_greedy([p for _, p in prompts], max_new_tokens, "fp32")
    rows = []
    for dtype in state_dtypes:
        for (label, prompt), (want, want_z), (got, got_z) in zip(
                prompts, ref, serve_greedy([p for _, p in prompts], max_new_tokens, dtype)):
            diff = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
            first = diff[0] if diff else max_new_tokens
            upto = min(first + 1, max_new_tokens)                       # inputs identical through position first
            rows.append(dict(prompt=label, prompt_tokens=len(prompt), state_dtype=dtype, first_divergence=first,
                             identical=not diff, max_logit_diff=float((got_z[:upto] - want_z[:upto]).abs().max())))
    per = pd.DataFrame(rows)
    summary = [dict(state_dtype=d, length=n, agreement=float((g.first_divergence >= n).mean()),
                    median_first_divergence=float(g.first_divergence.median()),
                    min_first_divergence=int(g.first_divergence.min()),
                    median_max_logit_diff=float(g.max_logit_diff.median()))
               for d, g in per.groupby("state_dtype", sort=False) for n in (*LENGTHS, max_new_tokens)
               if n <= max_new_tokens]
    return EngineAgreement(per, pd.DataFrame(summary).drop_duplicates(["state_dtype", "length"]))


def divergence_text(summary: pd.DataFrame) -> pd.DataFrame:
    """``summary`` (:func:`engine_agreement`'s, or a shipped one) with ``median_first_divergence`` and
    ``min_first_divergence`` as text that applies to each row's generation length n: the number when it lies
    within the n tokens (``< n``), else ``"none within n"`` (a divergence at token 33 is not one within 16 tokens;
    a median at the run's cap means at least half the prompts never diverged). A new frame; ``summary`` is left as is."""
    out = summary.copy()
    for column in ("median_first_divergence", "min_first_divergence"):
        out[column] = [f"{v:,.0f}" if v < n else f"none within {n:,}" for v, n in zip(summary[column], summary.length)]
    return out


def slot_table(max_model_len: int = 1024, max_num_seqs: int = 64) -> pd.DataFrame:
    """State slots per pool by stored state dtype, for the demo model and at Kimi-Linear-48B-A3B's shape (our
    engine's layout: fp32 conv windows and latents, 16-token KV-block pages). The pool is the one
    ``python -m serve.http`` builds for fp32: 2 x ``max_num_seqs`` x (fp32 state pages + KV pages of
    ``max_model_len`` tokens), the same pages for every dtype. Columns: model, state_dtype, state_bytes (one
    request, all KDA layers), state_pages, num_pages (the pool), requests (at ``max_model_len``, each a state
    and its KV pages), state_slots (states alone), requests_vs_fp32, state_slots_vs_fp32 (ratios)."""
    check_int("max_model_len", max_model_len)
    check_int("max_num_seqs", max_num_seqs)
    rows = []
    for name in SLOT_MODELS:
        cfg = PRESETS[name]
        layouts = {d: ServeConfig(state_dtype=dt).layout(cfg) for d, dt in STATE_DTYPES.items()}
        kv_pages = -(-max_model_len // layouts["fp32"].block_size)
        num_pages = EngineSpec(max_model_len=max_model_len, max_num_seqs=max_num_seqs).pool_pages(cfg)
        for d, lay in layouts.items():
            rows.append(dict(model=name, state_dtype=d, state_bytes=lay.state_bytes, state_pages=lay.state_pages,
                             num_pages=num_pages, requests=num_pages // (lay.state_pages + kv_pages),
                             state_slots=num_pages // lay.state_pages))
    df = pd.DataFrame(rows)
    fp32 = df[df.state_dtype == "fp32"].set_index("model")
    df["requests_vs_fp32"] = df.requests / df.model.map(fp32.requests)
    df["state_slots_vs_fp32"] = df.state_slots / df.model.map(fp32.state_slots)
    return df


class ShippedRun(NamedTuple):
    """``bench/results/state_dtype.json``: ``summary``, ``per_prompt`` and ``slots`` as above; ``timing`` (one row
    per dtype: median_s, min_s, max_s, repeats, vs_fp32: serving wall time and its ratio to fp32's, measured in
    the same run); ``meta`` (sizes, conditions, weights sha256, the timing run's size)."""

    summary: pd.DataFrame
    per_prompt: pd.DataFrame
    slots: pd.DataFrame
    timing: pd.DataFrame
    meta: dict


def shipped_run(path: Path = BENCH_RESULT) -> ShippedRun | None:
    """The shipped ``python -m bench.state_dtype`` result at ``path``, or None when there is none."""
    d = read_shipped(path)
    if d is None:
        return None
    meta = {k: v for k, v in d.items() if k not in ("summary", "per_prompt", "slots")}
    timing = pd.DataFrame(d["timing"]["rows"]).set_index("state_dtype")
    return ShippedRun(pd.DataFrame(d["summary"]), pd.DataFrame(d["per_prompt"]), pd.DataFrame(d["slots"]), timing, meta)
