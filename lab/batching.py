"""Continuous batching, live: a small trace through the real batched :class:`serve.engine.ServeEngine`
(plain data out for the page; no Streamlit).

:func:`batching_run` replays requests arriving at engine steps, records every step's batch composition
(decode rows, pad rows of the decode bucket, prefill tokens), the state slots held against their
ceiling, each request's measured TTFT and TPOT, and then reruns every request alone on a fresh engine
with the same token budget and speculation (:func:`alone_run`): the verdict is whether every request's tokens AND
logits are bitwise its batch-1 run. :func:`decode_throughput` measures decode tokens/s against the batch size (interleaved
repeats, one run), on :func:`decoding_engine` (B requests already all decoding) timed by :func:`time_steps`; page 01's
state-write sweep (:mod:`lab.state_write`), ``bench/batch.py`` and ``bench/replay_ssm_batch.py`` time the same engine.
"""
from __future__ import annotations

import functools
import os
import statistics
import time
from typing import NamedTuple

import pandas as pd
import torch

from kda_core.model import HybridLM
from lab.models import demo_model
from lab.timing import Conditions, conditions
from serve.config import ServeConfig
from serve.engine import EngineArgs, ServeEngine, build_engine
from serve.engine.request import RequestStatus
from serve.errors import check_int
from serve.spec_decode.draft import NgramProposer
from serve.spec_decode.verify import Speculation

# A trace small enough for a first render: every request is replayed twice (batched, then alone), ~65 forwards of
# the demo model here (10 requests of 4-16 output tokens were ~130). 5 slots for 8 requests: the ceiling binds.
DEFAULTS = {"max_num_seqs": 8, "max_num_batched_tokens": 128, "num_state_slots": 5, "num_requests": 8,
            "speculation": False}
PROMPT_TOKENS = (8, 90)    # each request's prompt length range (tokens)
OUTPUT_TOKENS = (4, 10)    # each request's max_new_tokens range
BLOCK = 16
DECODE_PROMPT_TOKENS = 32  # each request's prompt in :func:`decoding_engine` (tokens)


class BatchingRun(NamedTuple):
    """steps: one row per engine step (step, decode rows, verify rows (speculation: the last token + its drafts,
    one row per request), pad rows, prefill tokens (prompt tokens only), running = state slots
    held, waiting, step_ms). requests: one row per request (rid, arrival step, prompt tokens, output
    tokens, TTFT ms, TPOT ms, bitwise equal to alone). slot_ceiling: the state slots (the cap on running
    requests). all_bitwise: every request's tokens and logits equal its run alone. conditions: when / how."""

    steps: pd.DataFrame
    requests: pd.DataFrame
    slot_ceiling: int
    all_bitwise: bool
    stamp: str


def _prompts(num_requests: int, seed: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, max_new_tokens): prompts of :data:`PROMPT_TOKENS`, outputs of :data:`OUTPUT_TOKENS`,
    one arrival every 0-2 steps."""
    g = torch.Generator().manual_seed(seed)
    out, step = [], 0
    for _ in range(num_requests):
        n = int(torch.randint(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1, (1,), generator=g))
        new = int(torch.randint(OUTPUT_TOKENS[0], OUTPUT_TOKENS[1] + 1, (1,), generator=g))
        out.append((step, torch.randint(0, 256, (n,), generator=g).tolist(), new))
        step += int(torch.randint(0, 3, (1,), generator=g))
    return out


def demo_engine(max_num_seqs: int, max_num_batched_tokens: int, num_state_slots: int,
                speculation: bool) -> ServeEngine:
    """A fresh batched engine on the demo model with page 16's settings: 16-token blocks, unified pages, a pool of
    1,024 pages, prompt-lookup speculation (3 drafts, snapshot rollback) when ``speculation``."""
    spec = Speculation.named(lambda p: NgramProposer(), "snapshot", 3) if speculation else None
    return build_engine(EngineArgs(demo_model("demo"), 1024, ServeConfig(BLOCK, BLOCK, page_policy="unified"),
                                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   num_state_slots=num_state_slots, speculation=spec))


@functools.lru_cache(maxsize=256)   # ~16 KiB of logits per entry: a few MiB at most
def alone_run(prompt: tuple[int, ...], max_new_tokens: int, max_num_batched_tokens: int,
              speculation: bool) -> tuple[tuple[int, ...], torch.Tensor]:
    """``prompt`` run alone on a fresh engine (one sequence, one state slot, the same token budget and speculation):
    its output tokens and logits ``[max_new_tokens, 256]`` fp32. A lone request is one row and holds one slot
    whatever ``max_num_seqs`` and the slots are (``tests/lab/test_batching.py`` checks it), so the result is kept
    (bounded, read-only) for every setting that shares these arguments."""
    res = demo_engine(1, max_num_batched_tokens, 1, speculation).generate(list(prompt), max_new_tokens, record_logits=True)
    return res.output_tokens, res.logits


def batching_run(max_num_seqs: int = DEFAULTS["max_num_seqs"],
                 max_num_batched_tokens: int = DEFAULTS["max_num_batched_tokens"],
                 num_state_slots: int = DEFAULTS["num_state_slots"], num_requests: int = DEFAULTS["num_requests"],
                 speculation: bool = False, seed: int = 0) -> BatchingRun:
    """Replay ``num_requests`` seeded requests through the batched engine on the demo model, then each
    alone. Raises ValueError for a non-positive int setting (names it)."""
    for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                    ("num_state_slots", num_state_slots), ("num_requests", num_requests)):
        check_int(name, v)
    torch.set_num_threads(1)
    plan = _prompts(num_requests, seed)
    eng = demo_engine(max_num_seqs, max_num_batched_tokens, num_state_slots, speculation)
    pending, rids, steps, arrival = list(plan), [], [], {}
    k = 0
    while pending or eng.waiting or eng.running:
        while pending and pending[0][0] <= k:
            at, prompt, new = pending.pop(0)
            rid = eng.submit(prompt, new, record_logits=True)
            rids.append(rid)
            arrival[rid] = at
        t0 = time.perf_counter()
        before = eng.last_batch
        eng.step()
        ms = (time.perf_counter() - t0) * 1e3
        b = eng.last_batch if eng.last_batch is not before else None
        steps.append({"step": k, "decode rows": 0 if b is None else b.num_decode,
                      "verify rows": 0 if b is None else b.num_verify,
                      "pad rows": 0 if b is None else b.num_pad,
                      "prefill tokens": 0 if b is None else b.num_prefill_tokens,
                      "running (state slots held)": len(eng.running), "waiting": len(eng.waiting), "step_ms": ms})
        k += 1
    rows, all_ok = [], True
    for rid in rids:
        req = eng.requests[rid]
        res = eng.result(rid)
        ref_tokens, ref_logits = alone_run(tuple(req.prompt), req.max_new_tokens, max_num_batched_tokens, speculation)
        ok = (res.status is RequestStatus.FINISHED and res.output_tokens == ref_tokens
              and torch.equal(res.logits, ref_logits))
        all_ok &= ok
        tpot = ((req.finish_t - req.first_token_t) * 1e3 / (len(req.output) - 1)) if len(req.output) > 1 else None
        rows.append({"rid": rid, "arrival step": arrival[rid], "prompt tokens": len(req.prompt),
                     "output tokens": len(req.output), "TTFT ms": res.ttft_ms, "TPOT ms": tpot,
                     "bitwise equal to alone": ok})
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    stamp = (f"One replay, measured {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC on the demo model · "
             f"{torch.get_num_threads()} torch thread · load average {load:.2f}; TTFT / TPOT are wall-clock "
             "(perf_counter), so they include the other rows of each step.")
    return BatchingRun(pd.DataFrame(steps), pd.DataFrame(rows), num_state_slots, all_ok, stamp)


def decoding_engine(model: HybridLM, batch: int, max_new_tokens: int, **engine_kw) -> ServeEngine:
    """An engine of ``model`` (no prefix cache, 16-token blocks, unified pages) with ``batch`` requests of
    :data:`DECODE_PROMPT_TOKENS`-token prompts already all decoding, each with ``max_new_tokens`` to go at most;
    ``engine_kw`` go to :class:`serve.engine.EngineArgs` (e.g. ``state_write``, ``ring_size``, or
    ``rows_per_forward=1``: the batch-1 baseline, each row in its own forward)."""
    config = ServeConfig(BLOCK, BLOCK, page_policy="unified")
    pages_per_req = 1 + -(-(DECODE_PROMPT_TOKENS + max_new_tokens) // BLOCK) + 1   # state + KV blocks + one spare
    eng = build_engine(EngineArgs(model, batch * pages_per_req + 8, config, **engine_kw))
    for i in range(batch):
        eng.submit([(i * 7 + j) % 256 for j in range(DECODE_PROMPT_TOKENS)], max_new_tokens)
    while any(eng.requests[r].status is not RequestStatus.DECODE for r in eng.running) or eng.waiting:
        eng.step()
    return eng


def time_steps(eng: ServeEngine, steps: int) -> float:
    """Wall seconds (``time.perf_counter``) of ``steps`` engine steps of ``eng``."""
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return time.perf_counter() - t0


class Throughput(NamedTuple):
    """table: batch, tokens_per_s (median), min, max, ms_per_step, speedup (vs batch 1, same run);
    conditions: the measurement's :class:`lab.timing.Conditions`."""

    table: pd.DataFrame
    conditions: Conditions


def decode_throughput(batches=(1, 2, 4, 8, 16, 32), steps: int = 4, repeats: int = 5, progress=None) -> Throughput:
    """Measured decode tokens/s of the batched engine at each batch size (B requests all decoding, one token
    each per step): median and min / max over ``repeats`` interleaved repeats after a warm-up step.
    ``progress(fraction)`` is called as it goes. Columns: batch, tokens_per_s, min, max, ms_per_step,
    speedup (vs batch 1, same run)."""
    torch.set_num_threads(1)
    cond = conditions(repeats, 1)
    model = demo_model("demo")
    engines = {b: decoding_engine(model, b, steps * repeats + 3) for b in batches}
    for e in engines.values():
        time_steps(e, 1)
    secs = {b: [] for b in batches}
    total, done = repeats * len(batches), 0
    for _ in range(repeats):
        for b in batches:
            secs[b].append(time_steps(engines[b], steps))
            done += 1
            if progress is not None:
                progress(done / total)
    rows = []
    for b in batches:
        tps = [steps * b / s for s in secs[b]]
        rows.append({"batch": b, "tokens_per_s": statistics.median(tps), "min": min(tps), "max": max(tps),
                     "ms_per_step": statistics.median(secs[b]) / steps * 1e3})
    df = pd.DataFrame(rows)
    df["speedup"] = df["tokens_per_s"] / df["tokens_per_s"].iloc[0]
    return Throughput(df, cond)
