"""The prefix-cache checks: a hit equals a fresh prefill; A -> B -> A gives the same output with the cache on and
off; the state-cache hit is counted apart from the KV hit.

Prompt lengths are in tokens of the engine under test; for a byte-level model, bytes."""
from __future__ import annotations

from conformance.adapters import BASE, NO_CACHE
from conformance.report import Part, Source, Status
from conformance.suite import Check, Ctx, blocked, metric_delta

PREFIX_LEN, SHARED_LEN, TAIL_LEN = 150, 100, 40
ORDER_LEN, ORDER_SHARED = 120, 40      # B shares a third of A


def _hit_note(c) -> dict:
    return {"cached_tokens": c.cached_tokens}


# ---- a prefix-cache hit equals a fresh prefill -------------------------------------------------------------------
def _prefix_prompts(ctx: Ctx) -> tuple[list, list]:
    p = ctx.prompts.plain("prefix-hit", PREFIX_LEN)
    q = p[:SHARED_LEN] + ctx.prompts.filler(TAIL_LEN, offset=600)
    return p, q


def _prefix_plan(ctx: Ctx) -> dict:
    def base(client, ctx):
        p, q = _prefix_prompts(ctx)
        cold = ctx.complete(client, p)
        return {"cold": cold, "warm": ctx.complete(client, p), "shared": ctx.complete(client, q)}

    def reference(client, ctx):
        return {"shared": ctx.complete(client, _prefix_prompts(ctx)[1])}

    return {BASE: base, NO_CACHE: reference}


def _prefix_judge(results: dict, ctx: Ctx) -> list:
    base, ref = results.get("base"), results.get("no_prefix_cache")
    if (part := blocked("repeat", base)) is not None:
        return [part]
    parts = [_unless_cold(ctx.same("repeat", base["cold"], base["warm"], "the same prompt again vs its cold run",
                                   _hit_note(base["warm"])), base["warm"])]
    part = blocked("shared prefix", ref)
    parts.append(part or _unless_cold(ctx.same(
        "shared prefix", ref["shared"], base["shared"],
        f"{SHARED_LEN} shared tokens then a new tail, warm vs the cache-off run", _hit_note(base["shared"])),
        base["shared"]))
    return parts


def _unless_cold(part: Part, warm) -> Part:
    """A passing comparison whose 'warm' run was not served from the cache (the engine reports 0 cached tokens)
    compared two cold runs: not applicable."""
    if part.status is Status.PASS and warm.cached_tokens == 0:
        return Part(part.name, Status.NA, "not applicable: not served from the cache (cached_tokens 0), so nothing "
                    "was restored", part.evidence)
    return part


PREFIX_HIT = Check(
    "prefix_hit", "A prefix-cache hit equals a fresh prefill",
    "the greedy tokens and logprobs of a prompt served from the prefix cache equal those of its fresh prefill",
    "attention (KV) hits while the recurrent state misses, so the recurrence restarts from zero or from a state that "
    "is not this prefix's (never written, seeded in the wrong units, another request's)",
    (Source("vLLM #43090", "https://github.com/vllm-project/vllm/issues/43090"),
     Source("vLLM PR #47491", "https://github.com/vllm-project/vllm/pull/47491"),
     Source("vLLM PR #55601", "https://github.com/vllm-project/vllm/pull/55601"),
     Source("SGLang PR #31474", "https://github.com/sgl-project/sglang/pull/31474"),
     Source("SGLang #39830", "https://github.com/sgl-project/sglang/issues/39830"),
     Source("tpu-inference PR #3412", "https://github.com/vllm-project/tpu-inference/pull/3412")),
    _prefix_plan, _prefix_judge)


# ---- A -> B -> A, cache on and off -------------------------------------------------------------------------------
def _order_prompts(ctx: Ctx) -> tuple[list, list]:
    a = ctx.prompts.plain("order-A", ORDER_LEN)
    b = a[:ORDER_SHARED] + ctx.prompts.filler(ORDER_LEN - ORDER_SHARED, offset=400)   # same length, shared prefix
    return a, b


def _order_plan(ctx: Ctx) -> dict:
    def run(client, ctx):
        a, b = _order_prompts(ctx)
        return [ctx.complete(client, p) for p in (a, b, a)]

    return {BASE: run, NO_CACHE: run}


def _order_judge(results: dict, ctx: Ctx) -> list:
    on, off = results.get("base"), results.get("no_prefix_cache")
    if (part := blocked("cache on", on)) is not None:
        return [part]
    parts = [ctx.same("A again, cache on", on[0], on[2], "A after B vs A before it", _hit_note(on[2]))]
    hits = {"B": on[1].cached_tokens, "A again": on[2].cached_tokens}
    if all(h is not None for h in hits.values()):
        served = any(hits.values())
        parts.insert(0, Part("hits", Status.PASS if served else Status.NA,
                             ("cached tokens: " + ", ".join(f"{k} {v}" for k, v in hits.items())) if served else
                             "not applicable: neither B nor A again was served from the cache (cached_tokens 0)",
                             {"cached_tokens": hits}, premise=True))
    if (part := blocked("cache off", off)) is not None:
        return parts + [part]
    for i, name in enumerate(("A", "B", "A again")):
        parts.append(ctx.same(f"{name}, on vs off", off[i], on[i], f"{name} with the cache on vs off",
                              _hit_note(on[i])))
    return parts


CACHE_ORDER = Check(
    "cache_order", "A -> B -> A gives the same output with the cache on and off",
    "requests A, B (sharing A's prefix, the same length), A again: each greedy output with the prefix cache on equals "
    "the one with it off, and A's second output equals its first",
    "a later request's checkpoint overwrites or stands in for an earlier one's (a state found by its length or slot, "
    "not by its tokens), so a request served after another answers from the other's state",
    (Source("vLLM #43559", "https://github.com/vllm-project/vllm/issues/43559"),
     Source("vLLM #53912", "https://github.com/vllm-project/vllm/issues/53912")),
    _order_plan, _order_judge)


# ---- the state-cache hit counted apart from the KV hit -----------------------------------------------------------
def _metrics_lengths(ctx: Ctx) -> tuple[int, int, int, int] | None:
    """(A's length, shared tokens m, expected KV hit, expected state hit) on the engine's grid: A = 2C + N tokens,
    B shares m = C + 2N + N/2 of them, so its KV hit (C + 2N) reaches past the only checkpoint it can restore (C)."""
    g = ctx.grid
    if g is None or g.interval <= 2.5 * g.block or g.interval % g.block:
        return None
    C, N = g.interval, g.block
    m = C + 2 * N + N // 2
    return 2 * C + N, m, m // N * N, C


def _metrics_plan(ctx: Ctx) -> dict:
    def base(client, ctx):
        lengths, names = _metrics_lengths(ctx), client.adapter.metric_names
        if lengths is None or not (names.hits and names.state_miss_tokens):
            return None
        la, m, _, _ = lengths
        a = ctx.prompts.plain("metrics-A", la)
        b = a[:m] + ctx.prompts.filler(30, offset=777)
        ctx.complete(client, a)
        before = client.metrics()
        got = ctx.complete(client, b)
        return {"before": before, "after": client.metrics(), "b": got}

    return {BASE: base}


def _metrics_judge(results: dict, ctx: Ctx) -> list:
    base = results.get("base")
    if (part := blocked("counters", base)) is not None:
        return [part]
    lengths = _metrics_lengths(ctx)
    if base is None:
        names = ctx.adapter.metric_names
        if not names.state_miss_tokens:
            one = f" ({names.hits})" if names.hits else ""
            why = (f"the engine counts reused prompt tokens in one counter{one}, no state-cache miss apart from the "
                   "KV hit: a KV-only hit cannot be told from a state hit")
        else:
            why = "the engine's state grid is unknown (pass --grid BLOCK:INTERVAL)"
        return [Part("counters", Status.NA, f"not applicable: {why}")]
    if base["b"].error is not None:
        return [Part("counters", Status.FAIL, f"the request failed: {base['b'].error}")]
    _, m, kv, state = lengths
    names = ctx.adapter.metric_names
    got = {k: metric_delta(base["before"], base["after"], n) for k, n in (
        ("hits", names.hits), ("state_miss_tokens", names.state_miss_tokens),
        ("state_miss_requests", names.state_miss_requests))}
    want = {"hits": state, "state_miss_tokens": kv - state, "state_miss_requests": 1}
    evidence = {"shared_tokens": m, "expected": want, "counted": got, "cached_tokens": base["b"].cached_tokens}
    if any(v is None for v in got.values()):
        return [Part("counters", Status.NA, "not applicable: the engine's metrics lack "
                     f"{[k for k, v in got.items() if v is None]}", evidence)]
    wrong = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    if base["b"].cached_tokens not in (None, state):
        wrong["cached_tokens"] = (base["b"].cached_tokens, state)
    if wrong:
        return [Part("counters", Status.FAIL, "counted (got, expected): " + ", ".join(
            f"{k} {g:g} vs {w:g}" for k, (g, w) in wrong.items()), evidence)]
    return [Part("counters", Status.PASS, f"a KV hit of {kv} tokens restored the state at {state}: hits +{state}, "
                 f"state misses +{kv - state} tokens in 1 request", evidence)]


STATE_HIT_METRICS = Check(
    "state_hit_metrics", "The state-cache hit is counted apart from the KV hit",
    "a request whose cached KV blocks reach past the last restorable state checkpoint counts as hits only the tokens "
    "whose state was restored, and the rest as a state-cache miss",
    "one hit counter for a hybrid cache: KV-only hits reported as hits (or as plain misses), so a cache that "
    "restores no state looks healthy or a healthy one looks dead",
    (Source("vLLM #45238", "https://github.com/vllm-project/vllm/issues/45238"),
     Source("SGLang #5979", "https://github.com/sgl-project/sglang/issues/5979")),
    _metrics_plan, _metrics_judge)
