"""The decoding checks: speculative equals plain decoding; chunked prefill at every chunk size equals the unchunked
prefill, with a needle in the first chunk; batch invariance; an aborted request leaves nothing behind and its
recompute equals an uninterrupted run."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from conformance.adapters import BASE, NO_CACHE, SPECULATIVE, chunked
from conformance.compare import compare
from conformance.report import Part, Source, Status
from conformance.suite import Check, Ctx, blocked, metric_delta

NEEDLE_LEN = 320
BATCH_LENS = (40, 90, 150, 60, 200)
ABORT_LEN, FRESH_LEN, ABORT_MAX_TOKENS, ABORT_AFTER = 100, 80, 64, 3


# ---- speculative == plain ----------------------------------------------------------------------------------------
def _spec_prompts(ctx: Ctx) -> list:
    p = ctx.prompts
    return [p.repetitive("spec-1", 90), p.repetitive("spec-2", 60), p.plain("spec-3", 80, offset=300)]


def _spec_plan(ctx: Ctx) -> dict:
    n = 2 * ctx.max_tokens                                         # several verify steps per request

    def plain(client, ctx):
        return [ctx.complete(client, q, n) for q in _spec_prompts(ctx)]

    def speculative(client, ctx):
        before = client.metrics()
        outs = [ctx.complete(client, q, n) for q in _spec_prompts(ctx)]
        after, names = client.metrics(), client.adapter.metric_names
        return {"outs": outs, "drafted": metric_delta(before, after, names.drafted),
                "accepted": metric_delta(before, after, names.accepted)}

    return {BASE: plain, SPECULATIVE: speculative}


def _spec_judge(results: dict, ctx: Ctx) -> list:
    plain, spec = results.get("base"), results.get("speculative")
    for name, data in (("plain", plain), ("speculative", spec)):
        if (part := blocked(name, data)) is not None:
            return [part]
    counts = {"drafted": spec["drafted"], "accepted": spec["accepted"]}
    parts = [ctx.same(f"prompt {i + 1}", a, b, "speculative vs plain", counts)
             for i, (a, b) in enumerate(zip(plain, spec["outs"]))]
    if spec["drafted"] is None:
        drafts = Part("drafts", Status.NA, "drafts not counted (the engine exposes no speculative metrics)", counts)
    elif spec["drafted"] == 0:
        drafts = Part("drafts", Status.NA, "not applicable: no draft was proposed, so no rollback ran", counts,
                      premise=True)
    else:
        drafts = Part("drafts", Status.PASS, f"{spec['drafted']:g} drafts proposed, {spec['accepted']:g} accepted "
                      "(rollbacks after accepted and rejected drafts ran)", counts)
    return [drafts, *parts]


SPECULATIVE_DECODING = Check(
    "speculative", "Speculative decoding equals plain decoding",
    "greedy output with speculative decoding (n-gram drafts, some accepted, some rejected) equals the plain decode",
    "the rollback after a verify leaves a stale state: one missing the accepted drafts (read from the wrong slot), "
    "a snapshot never written, or a stale conv window",
    (Source("vLLM PR #52942", "https://github.com/vllm-project/vllm/pull/52942"),
     Source("mlx-lm #846 (fix: PR #1109)", "https://github.com/ml-explore/mlx-lm/pull/1109"),
     Source("llama.cpp PR #28466", "https://github.com/ggml-org/llama.cpp/pull/28466"),
     Source("llama.cpp #28461", "https://github.com/ggml-org/llama.cpp/issues/28461")),
    _spec_plan, _spec_judge)


# ---- chunked prefill == unchunked, a needle in the first chunk ---------------------------------------------------
def _chunk_plan(ctx: Ctx) -> dict:
    def base(client, ctx):
        return [ctx.complete(client, ctx.prompts.needle("needle", NEEDLE_LEN, which)) for which in (0, 1)]

    def chunk(client, ctx):
        return ctx.complete(client, ctx.prompts.needle("needle", NEEDLE_LEN, 0))

    return {BASE: base, **{chunked(n): chunk for n in ctx.chunk_sizes}}


def _chunk_judge(results: dict, ctx: Ctx) -> list:
    base = results.get("base")
    if (part := blocked("unchunked", base)) is not None:
        return [part]
    span = ctx.prompts.needle_span("needle")
    matters = compare(base[0], base[1], "exact", 0.0)
    how = (f"token {matters.first_diff} differs" if matters.first_diff is not None else
           f"its logprobs move by up to {matters.max_dlogprob:.2e}")
    premise = Part("needle", Status.PASS, f"another needle in the first {span} tokens changes the output ({how})",
                   {**matters.evidence(), "needle_tokens": span}, premise=True)
    if matters.match:
        premise = Part("needle", Status.NA, "not applicable: another needle gives the same output, so a state "
                       "lost at a chunk boundary need not show", matters.evidence(), premise=True)
    parts = [premise]
    for n in ctx.chunk_sizes:
        got = results.get(f"chunk_{n}")
        parts.append(blocked(f"chunk {n}", got) or ctx.same(
            f"chunk {n}", base[0], got, f"{-(-NEEDLE_LEN // n)} chunks of {n} tokens vs one prefill",
            {"chunk_tokens": n, "needle_in_first_chunk": span <= n}))
    return parts


CHUNKED_PREFILL = Check(
    "chunked_prefill", "Chunked prefill at every chunk size equals the unchunked prefill",
    "a long prompt whose first line holds a needle (which changes the output) gives the same greedy output and "
    "logprobs prefilled in chunks of each size as in one prefill",
    "the recurrent state is reset (or read in the wrong layout) at a chunk boundary, so the answer comes from the "
    "last chunk alone and the needle is lost",
    (Source("lablup/mlxcel #1749", "https://github.com/lablup/mlxcel/issues/1749"),
     Source("vLLM #41292", "https://github.com/vllm-project/vllm/issues/41292")),
    _chunk_plan, _chunk_judge)


# ---- batch invariance -----------------------------------------------------------------------------------------
def _batch_prompts(ctx: Ctx) -> list:
    lens = [BATCH_LENS[i % len(BATCH_LENS)] for i in range(ctx.concurrency)]
    return [ctx.prompts.plain(f"batch-{i}", n, offset=97 * i) for i, n in enumerate(lens)]


def _batch_plan(ctx: Ctx) -> dict:
    def run(client, ctx):
        prompts = _batch_prompts(ctx)
        alone = [ctx.complete(client, p) for p in prompts]
        gate = threading.Barrier(len(prompts))

        def together(p):
            gate.wait(30)
            return ctx.complete(client, p)

        with ThreadPoolExecutor(len(prompts)) as pool:
            return {"alone": alone, "together": list(pool.map(together, prompts))}

    return {NO_CACHE if ctx.routable(NO_CACHE) else BASE: run}


def _batch_judge(results: dict, ctx: Ctx) -> list:
    where = "no_prefix_cache" if "no_prefix_cache" in results else "base"
    data = results[where]
    if (part := blocked("batch", data)) is not None:
        return [part]
    note = "" if where == "no_prefix_cache" else " (prefix cache on: the batch's requests are warm)"
    return [ctx.same(f"request {i + 1}", a, b, f"with {len(data['alone']) - 1} others at once vs alone{note}",
                     {"setting": where})
            for i, (a, b) in enumerate(zip(data["alone"], data["together"]))]


BATCH_INVARIANCE = Check(
    "batch_invariance", "A request's output does not depend on what else runs",
    "each of several requests of different lengths sent at once gives the greedy output and logprobs it gives alone",
    "pad rows of a batch write a live request's state (a -1 pad slot clamped to slot 0, a vacated slot id left in a "
    "padded position), or kernels whose reductions depend on the batch",
    (Source("tpu-inference PR #2469", "https://github.com/vllm-project/tpu-inference/pull/2469"),
     Source("state-spaces/mamba PR #792", "https://github.com/state-spaces/mamba/pull/792"),
     Source("vLLM #51902", "https://github.com/vllm-project/vllm/issues/51902")),
    _batch_plan, _batch_judge)


# ---- an aborted request leaves nothing behind -------------------------------------------------------------------
def _abort_prompts(ctx: Ctx) -> tuple[list, list]:
    return ctx.prompts.plain("abort", ABORT_LEN), ctx.prompts.plain("abort-fresh", FRESH_LEN, offset=200)


def _abort_plan(ctx: Ctx) -> dict:
    def base(client, ctx):
        r, f = _abort_prompts(ctx)
        before = client.metrics()
        read = client.stream_then_drop(r, ABORT_MAX_TOKENS, ABORT_AFTER)
        time.sleep(0.5)                                             # the server notices the client is gone
        idle = client.wait_idle()
        time.sleep(0.3)
        after = client.metrics()
        return {"before": before, "after": after, "events_read": read, "idle": idle,
                "recomputed": ctx.complete(client, r), "fresh": ctx.complete(client, f)}

    def reference(client, ctx):
        r, f = _abort_prompts(ctx)
        return {"recomputed": ctx.complete(client, r), "fresh": ctx.complete(client, f)}

    return {BASE: base, NO_CACHE: reference}


def _abort_judge(results: dict, ctx: Ctx) -> list:
    base, ref = results.get("base"), results.get("no_prefix_cache")
    if (part := blocked("abort", base)) is not None:
        return [part]
    gauges = list(ctx.adapter.metric_names.leftovers + ctx.adapter.metric_names.busy)
    before, after = base["before"], base["after"]
    if before is None or after is None or not gauges:
        left = Part("nothing left", Status.NA, "not applicable: the engine exposes no gauges of what requests hold")
    else:
        seen = {g: [before.get(g), after.get(g)] for g in gauges if g in after}
        moved = {g: v for g, v in seen.items() if v[0] != v[1]}
        evidence = {"gauges_before_after": seen, "events_read": base["events_read"], "idle": base["idle"]}
        left = Part("nothing left", Status.FAIL if moved else Status.PASS,
                    (f"after the abort and idle: {', '.join(f'{g} {a} -> {b}' for g, (a, b) in moved.items())}"
                     if moved else f"dropped after {base['events_read']} events; {len(seen)} gauges back where they "
                     "were"), evidence)
    parts = [left]
    for key, what in (("recomputed", "the aborted prompt run again to the end vs an uninterrupted run"),
                      ("fresh", "a new request after the abort vs its run on a clean server")):
        parts.append(blocked(key, ref) or ctx.same(key, ref[key], base[key], what))
    return parts


ABORT_RECOMPUTE = Check(
    "abort_recompute", "An aborted request leaves nothing behind; a recomputed one equals its uninterrupted run",
    "a streamed request dropped after a few tokens releases every page and slot it held (the engine's gauges return "
    "to their idle values), the same prompt run again equals its uninterrupted run, and the next fresh request is "
    "not served from the aborted one's state (preemption by recompute, which a client cannot force, takes the same "
    "release path)",
    "a released state slot is neither freed nor cleared, so the next tenant reads the aborted request's state, or "
    "its pages leak",
    (Source("tpu-inference PR #2779", "https://github.com/vllm-project/tpu-inference/pull/2779"),
     Source("vLLM PR #56524", "https://github.com/vllm-project/vllm/pull/56524")),
    _abort_plan, _abort_judge)
