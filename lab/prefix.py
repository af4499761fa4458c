"""Measured engine runs behind the home page, pages 07-09 and ``bench.prefix``. The home page and page 08
each make two calls, drawn progressively: :func:`home` / :func:`prefix_hit` (one cold and one warm run:
the output verdict and what the hit reused, fast) and :func:`home_timing` / :func:`prefix_hit_timing`
(engine TTFT and the CPU time of the same requests over interleaved repeats with :func:`lab.timing.measure`,
slower). Page 07's call is
:func:`lab.prefix_anatomy.anatomy_view`.

Every function builds fresh engines on the runnable demo model, runs real requests through
:class:`serve.engine.ServeEngine` single-threaded (2 shared cores: stable timings), and returns plain
rows (lists of dicts) for the UI. TTFT is measured by the engine (submit -> first token, ms); beside it, the
timed runs record the CPU time of the same one-token request (``time.thread_time``: the engine runs on the
calling thread with one torch thread, so it counts the forward's work and not the time spent waiting for a core,
which a loaded 2-core host adds to the wall clock).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from kda_core.chunk import CHUNK_SIZE
from kda_core.model import HybridLM, bytes_to_text
from lab.forward_cost import ForwardFit, fit_lengths, forward_fit
from lab.models import demo_model
from lab.threads import one_thread
from lab.timing import MIN_REPEATS, Conditions, measure, summarize
from serve.config import ServeConfig
from serve.engine import EngineArgs, ServeEngine, build_engine
from serve.engine.request import TIMING_PHASES, RequestResult
from serve.errors import check_int
from serve.memory.layout import CacheLayout

if TYPE_CHECKING:     # pandas is imported where a frame is built: Home's first run on a fresh server skips it
    import pandas as pd

def as_tokens(prompt: str | Sequence[int]) -> list[int]:
    """UTF-8 bytes of a text prompt (byte-level model), or the ids as given. Raises ValueError if empty."""
    ids = list(prompt.encode("utf-8")) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise ValueError("prompt must not be empty")
    return ids


def _pages_for(model: HybridLM, config: ServeConfig, tokens: int) -> int:
    """Pages for two requests of ``tokens`` under ``config``, counted as if a checkpoint were written at every
    block (at least as many as any interval writes: generous, never evicts)."""
    lay = config.layout(model.cfg)
    blocks = -(-tokens // config.block_size) + 1
    return 2 * (blocks + lay.state_pages * (blocks + 2))


def _row(kind: str, res: RequestResult, repeat: int = 0) -> dict:
    return dict(kind=kind, repeat=repeat, ttft_ms=res.ttft_ms, prompt_tokens=res.prompt_tokens,
                prefill_tokens=res.prefill_tokens, hit_tokens=res.hit_tokens, kv_hit_tokens=res.kv_hit_tokens,
                restored_bytes=res.restored_bytes, shared_kv_bytes=res.shared_kv_bytes,
                checkpoints_written=res.checkpoints_written, **{f"{p}_ms": res.timings_ms[p] for p in TIMING_PHASES})


WARM_TOLERANCE = 5e-5
"""Max |Δ logits| allowed between a warm run and the cache-off run when they are not bitwise equal: a hit
boundary b off the 64-token chunk grid (``kda_core.chunk.CHUNK_SIZE``) starts the warm prefill's KDA chunks and
MLA row blocks at b instead of on the cold run's grid, so in-chunk sums are taken in another order (fp32
rounding). The error scales with the logits: about 7e-7 of the largest |logit| on the trained demo model
(measured up to 1.2e-5 with logits up to 17, b = 416 at C = 32 and b = 400, five prompts each), 1e-6 on
its random init (3.7e-6, logits up to 3.6); 5e-5 leaves a factor 4 over the trained model's worst case."""


class Comparison(NamedTuple):
    """Warm output vs the cache-off output of the same prompt.

    outputs_identical: same greedy tokens; max_logit_diff: max |Δ logits| over the generated tokens (inf when
    the tokens differ); bitwise: tokens equal and every logit bitwise equal (``torch.equal``); hit_tokens: the
    hit boundary b the warm run restored; on_grid: b is a multiple of the KDA chunk size
    (``kda_core.chunk.CHUNK_SIZE`` = 64), so the warm prefill ran on the cold run's chunk grid. The engine's
    rule: on_grid (with a checkpoint written by a prefill from a grid point) implies bitwise; off the grid
    the logits agree within :data:`WARM_TOLERANCE`.
    """

    outputs_identical: bool
    max_logit_diff: float
    bitwise: bool = False
    hit_tokens: int = 0
    on_grid: bool = True

    @property
    def verdict(self) -> str:
        """"bitwise equal", "within tolerance (max |Δ| = x)" or "different"."""
        if self.bitwise:
            return "bitwise equal"
        if self.outputs_identical and self.max_logit_diff <= WARM_TOLERANCE:
            return f"within tolerance (max |Δ| = {self.max_logit_diff:.1e})"
        return "different"

    @property
    def reason(self) -> str:
        """Why, in one sentence: where the hit boundary b sits on the KDA chunk grid."""
        b, C = self.hit_tokens, CHUNK_SIZE
        if b == 0:
            why = ("there is no hit (b = 0): the warm run restored nothing and prefilled the whole prompt, the same "
                   "forward as the cache-off run")
            return why if self.bitwise else why + ", yet its output differs"
        if self.on_grid:
            why = (f"the hit b = {b} is a multiple of the {C}-token KDA chunk, so the warm prefill from b ran on "
                   "the cache-off run's chunk grid")
            return why if self.bitwise else why + ", but its checkpoint was not taken by a prefill on that grid"
        return (f"the hit b = {b} is not a multiple of the {C}-token KDA chunk, so the warm prefill's chunks start "
                f"at b, off the cache-off run's grid, and fp32 sums round differently (allowed: {WARM_TOLERANCE:.0e})")


def compare(warm: RequestResult, cold: RequestResult) -> Comparison:
    """Compare a warm run with the cache-off run of the same prompt (both with ``record_logits``)."""
    same = warm.output_tokens == cold.output_tokens
    diff = float((warm.logits - cold.logits).abs().max()) if same else float("inf")
    bitwise = same and torch.equal(warm.logits, cold.logits)
    return Comparison(same, diff, bitwise, warm.hit_tokens, warm.hit_tokens % CHUNK_SIZE == 0)


class ColdWarm(NamedTuple):
    """The verification run of :func:`cold_vs_warm`: rows: one dict per run kind, in :data:`PHASE_RUNS`
    order (cold = ``second`` through a cache-off engine, first = ``first`` filling the cache, warm =
    ``second`` after it; TTFT, tokens, bytes, per-phase ms); check: warm vs cold outputs; warm_tokens: the
    warm output token ids (``max_new_tokens`` of them); layout: page layout."""

    rows: list
    check: Comparison
    warm_tokens: tuple
    layout: CacheLayout


PHASE_RUNS = ("cold", "first", "warm")  # run kinds, in the order of the rows and the phase breakdown


def _sizes(first, second, max_new_tokens: int, config: ServeConfig, preset: str):
    a, b = as_tokens(first), as_tokens(second)
    check_int("max_new_tokens", max_new_tokens)
    model = demo_model(preset)
    return a, b, model, _pages_for(model, config, max(len(a), len(b)) + max_new_tokens)


def fill_tokens(first: list[int], second: list[int], max_new_tokens: int, block_size: int) -> int:
    """Tokens request 1 (``first``) generates when it fills the cache for ``second``: ``max_new_tokens`` when they can
    change ``second``'s hit, else 1 (the same cache, without the decode steps). Generated tokens enter the cache only
    as blocks that complete (and their checkpoints), so they can matter only when ``second`` starts with all of
    ``first`` (else a block past ``first``'s prompt covers the position where ``second`` differs) and decoding
    crosses a block boundary: ``(len(first) + max_new_tokens) // N > len(first) // N``."""
    n = len(first)
    crosses = (n + max_new_tokens) // block_size > n // block_size
    return max_new_tokens if second[:n] == first and crosses else 1


def cold_vs_warm(first: str | Sequence[int], second: str | Sequence[int], max_new_tokens: int = 8,
                 config: ServeConfig = ServeConfig(), preset: str = "demo") -> ColdWarm:
    """Run ``second`` cold (cache-off engine) and warm (after ``first`` filled the cache, generating
    :func:`fill_tokens`) once each on fresh engines, ``max_new_tokens`` greedy tokens with logits recorded, and
    compare them. Raises ValueError for bad sizes or prompts."""
    a, b, model, pages = _sizes(first, second, max_new_tokens, config, preset)
    with one_thread():
        cold = build_engine(EngineArgs(model, pages, config)).generate(
            b, max_new_tokens, record_logits=True)
        eng = build_engine(EngineArgs(model, pages, config, prefix_cache=True))
        fill = eng.generate(a, fill_tokens(a, b, max_new_tokens, config.block_size))
        warm = eng.generate(b, max_new_tokens, record_logits=True)
        eng.check_integrity()
    rows = [_row("cold", cold), _row("first", fill), _row("warm", warm)]
    return ColdWarm(rows, compare(warm, cold), warm.output_tokens, eng.layout)


def _one_token(kind: str, eng: ServeEngine, prompt: list[int]) -> dict:
    """Row of ``prompt`` run to its first token on ``eng`` (as :func:`_row`), plus ``cpu_ms``: the calling thread's
    CPU time over the whole request (submit -> its one token, finished; ``time.thread_time``, ms)."""
    c0 = time.thread_time()
    res = eng.generate(prompt, 1)
    return dict(_row(kind, res), cpu_ms=(time.thread_time() - c0) * 1e3)


class TtftTimes(NamedTuple):
    """Engine-measured TTFT of :func:`time_cold_warm`: rows: one dict per (timed repeat, run kind) as in
    :class:`ColdWarm` (warm-up runs left out) plus ``cpu_ms``, the CPU time of the cold and warm requests
    (:func:`_one_token`; NaN for the fill, which decodes further); timings: one :class:`lab.timing.Timing` (seconds) per kind
    in :data:`PHASE_RUNS` over the ``repeats`` samples of the engine's TTFT (submit -> first token);
    conditions: when and how it was measured; prefill: ``(n, Timing)`` per length of
    :func:`lab.forward_cost.fit_lengths` (cache-off TTFT of the first n tokens of ``second``, same rounds)."""

    rows: list
    timings: list
    conditions: Conditions
    prefill: tuple = ()


def time_cold_warm(first: str | Sequence[int], second: str | Sequence[int], max_new_tokens: int = 8,
                   config: ServeConfig = ServeConfig(), repeats: int = MIN_REPEATS,
                   warmup: int = 1, preset: str = "demo", fit: bool = True) -> TtftTimes:
    """TTFT of ``second`` cold and warm, ``repeats`` interleaved rounds after ``warmup`` (:func:`lab.timing.measure`).

    Case "cold": a fresh cache-off engine runs ``second`` to its first token. Case "warm": a fresh engine
    runs ``first``, then ``second`` to its first token; the fill's own TTFT is the "first" kind. The fill
    generates :func:`fill_tokens`, as in the verification run (the same cache). The samples are the engine's
    TTFT of each request, not the wall time of a case (which includes engine set-up and the fill).
    Cases "prefill <n>" (``fit=True``), for each n of :func:`lab.forward_cost.fit_lengths` (never len(second)):
    a fresh cache-off engine runs the first n tokens of ``second`` (repeated if n is longer) to its first
    token; the fixed + per-token cost of a forward is fitted to them (:func:`lab.forward_cost.forward_fit`).
    Raises ValueError for bad sizes, prompts or repeats (< :data:`lab.timing.MIN_REPEATS`) and
    RuntimeError if the warm runs' hit differs between repeats (the engine is deterministic)."""
    a, b, model, pages = _sizes(first, second, max_new_tokens, config, preset)
    runs: dict[str, list] = {"cold": [], "warm": []}     # cold: a row per run; warm: (first, warm) rows per run
    fill_n = fill_tokens(a, b, max_new_tokens, config.block_size)
    fit_ns = fit_lengths(len(b)) if fit else ()
    fit_pages = max([pages] + [_pages_for(model, config, n + 1) for n in fit_ns])
    ttft_ms: dict[int, list[float]] = {n: [] for n in fit_ns}

    def prefill(n: int):
        prompt = (b * -(-n // len(b)))[:n]                  # the first n tokens of `second` (repeated past its end)

        def run() -> None:
            eng = build_engine(EngineArgs(model, fit_pages, config))
            ttft_ms[n].append(eng.generate(prompt, 1).ttft_ms)
        return run

    def cold() -> None:
        runs["cold"].append(_one_token("cold", build_engine(EngineArgs(model, pages, config)), b))

    def warm() -> None:
        eng = build_engine(EngineArgs(model, pages, config, prefix_cache=True))
        fill = eng.generate(a, fill_n)
        runs["warm"].append((dict(_row("first", fill), cpu_ms=float("nan")), _one_token("warm", eng, b)))

    with one_thread():
        _, cond = measure({"cold": cold, "warm": warm} | {f"prefill {n}": prefill(n) for n in fit_ns},
                          repeats=repeats, warmup=warmup)
    rows = [dict(row, repeat=r) for r, (c, (f, w)) in enumerate(zip(runs["cold"][warmup:], runs["warm"][warmup:]))
            for row in (c, f, w)]
    hits = {r["hit_tokens"] for r in rows if r["kind"] == "warm"}
    if len(hits) != 1:
        raise RuntimeError(f"warm runs hit different boundaries across repeats: {sorted(hits)}")
    timings = [summarize(kind, [r["ttft_ms"] / 1e3 for r in rows if r["kind"] == kind]) for kind in PHASE_RUNS]
    prefill_timings = [(n, summarize(f"prefill {n}", [t / 1e3 for t in ttft_ms[n][warmup:]])) for n in fit_ns]
    return TtftTimes(rows, timings, cond, prefill_timings)


def shared_prefix_prompts(shared_tokens: int, unique_tokens: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Two seeded random byte prompts sharing their first ``shared_tokens`` tokens, each with
    ``unique_tokens`` of its own after. Raises ValueError for negative lengths or an empty prompt."""
    if shared_tokens < 0 or unique_tokens < 0 or shared_tokens + unique_tokens < 1:
        raise ValueError("shared_tokens and unique_tokens must be >= 0 with at least one token in total")
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (shared_tokens,), generator=gen).tolist()
    tail_a = torch.randint(0, 256, (unique_tokens,), generator=gen).tolist()
    tail_b = torch.randint(0, 256, (unique_tokens,), generator=gen).tolist()
    return shared + tail_a, shared + tail_b


def _paired(rows: list, column: str) -> tuple[dict, dict]:
    """Cold and warm medians / IQRs of ``column`` and the quartiles of its paired differences cold - warm per
    repeat (see :func:`ttft_summary`), as two dicts: ``{kind: Timing}`` and the differences' Timing."""
    by_repeat: dict[str, dict] = {}
    per_kind = {}
    for kind in ("cold", "warm"):
        kind_rows = [r for r in rows if r["kind"] == kind]
        per_kind[kind] = summarize(kind, [r[column] for r in kind_rows])
        by_repeat[kind] = {r["repeat"]: r[column] for r in kind_rows}
        if len(by_repeat[kind]) != len(kind_rows):
            raise ValueError(f"rows: two {kind} rows share a repeat index")
    if by_repeat["cold"].keys() != by_repeat["warm"].keys():
        raise ValueError(f"rows: cold repeats {sorted(by_repeat['cold'])} and warm repeats "
                         f"{sorted(by_repeat['warm'])} do not pair up")
    saved = summarize("cold - warm", [by_repeat["cold"][r] - by_repeat["warm"][r] for r in sorted(by_repeat["cold"])])
    return per_kind, saved


def _verdict(saved) -> str:
    return "warm faster" if saved.q1_s > 0 else "warm slower" if saved.q3_s < 0 else "not resolved"


def ttft_summary(rows: list) -> dict:
    """Cold vs warm TTFT of :func:`time_cold_warm`'s rows (dicts with ``kind``, ``repeat``, ``ttft_ms``).

    Keys: ``cold_ttft_ms`` / ``warm_ttft_ms`` (medians, ms), ``cold_ttft_iqr_ms`` / ``warm_ttft_iqr_ms``
    (interquartile ranges, ms), ``ttft_reduction`` = ``1 - warm / cold`` of the medians (a fraction),
    ``saved_ms`` / ``saved_q1_ms`` / ``saved_q3_ms``: median and quartiles (ms) of the paired differences
    ``cold - warm`` of each repeat (both ran in the same interleaved round, so a slow phase of the machine
    hits both and cancels), and ``verdict``: "warm faster" when the paired differences' first quartile is
    > 0, "warm slower" when their third quartile is < 0, else "not resolved" (the spread covers zero: the
    medians' difference is noise at this load). When every cold and warm row has ``cpu_ms`` (the CPU time of
    the same request), the same keys for it with ``cpu`` in place of ``ttft`` (``cold_cpu_ms``,
    ``cold_cpu_iqr_ms``, ``cpu_reduction``) and a ``cpu_`` prefix (``cpu_saved_ms``, ``cpu_saved_q1_ms``,
    ``cpu_saved_q3_ms``, ``cpu_verdict``). Quartiles as :func:`lab.timing.summarize` (numpy's linear
    percentiles). Raises ValueError without a cold or a warm row, or when the cold and warm rows do not
    pair up one to one by ``repeat``."""
    out = {}
    timed = [r for r in rows if r["kind"] in ("cold", "warm")]
    with_cpu = bool(timed) and all("cpu_ms" in r for r in timed)
    columns = [("ttft_ms", "ttft", "")] + ([("cpu_ms", "cpu", "cpu_")] if with_cpu else [])
    for column, name, prefix in columns:
        per_kind, saved = _paired(rows, column)
        for kind, t in per_kind.items():
            out |= {f"{kind}_{name}_ms": t.median_s, f"{kind}_{name}_iqr_ms": t.iqr_s}
        out |= {f"{name}_reduction": 1.0 - out[f"warm_{name}_ms"] / out[f"cold_{name}_ms"],
                f"{prefix}saved_ms": saved.median_s, f"{prefix}saved_q1_ms": saved.q1_s,
                f"{prefix}saved_q3_ms": saved.q3_s, f"{prefix}verdict": _verdict(saved)}
    return out


def paired_spread(summary: dict, prefix: str = "") -> str:
    """``"cold − warm 12.7 ms (paired IQR −8.1 to 30.0 ms)"`` from a :func:`ttft_summary` dict; ``prefix="cpu_"``
    for the CPU time's."""
    return (f"cold − warm {summary[prefix + 'saved_ms']:.1f} ms (paired IQR {summary[prefix + 'saved_q1_ms']:.1f} to "
            f"{summary[prefix + 'saved_q3_ms']:.1f} ms)").replace("-", "−")


def ttft_headline(summary: dict) -> str:
    """The warm-vs-cold TTFT headline of a :func:`ttft_summary` dict: the median change vs cold only when the
    paired differences resolve it (``"-21% vs cold 122.5 ms; cold − warm …"``), else ``"not resolved at this
    load: cold − warm … (paired IQR … to … ms)"``."""
    if summary["verdict"] == "not resolved":
        return f"not resolved at this load: {paired_spread(summary)}"
    return f"{-summary['ttft_reduction']:+.0%} vs cold {summary['cold_ttft_ms']:.1f} ms; {paired_spread(summary)}"


ANATOMY_BLOCK_COLUMNS = ("prompt", "block", "start", "end", "key", "cached")


class Anatomy(NamedTuple):
    """blocks: one dict per (prompt, full block) with the keys :data:`ANATOMY_BLOCK_COLUMNS` (token range,
    key prefix, whether the cache holds it); empty when every prompt is shorter than one block;
    checkpoints: :meth:`PrefixCache.checkpoints` rows after the earlier prompts (and the drop);
    steps: the two-phase lookup of the last prompt; num_tokens / kv_tokens: its hit; dropped: the
    (boundary, group) removed, if any; prompt_tokens: each prompt's length in tokens (the tokens after
    its last full block form a partial block, which is never cached)."""

    blocks: list
    checkpoints: list
    steps: list
    num_tokens: int
    kv_tokens: int
    dropped: tuple | None
    prompt_tokens: list


def anatomy(prompts: Sequence[str | Sequence[int]], config: ServeConfig = ServeConfig(16, 32, 2),  # page 07's
            drop: tuple[int, int] | None = None, preset: str = "demo") -> Anatomy:
    """Run every prompt but the last through a cached engine (one output token each), optionally drop
    group ``drop[1]``'s checkpoint at boundary ``drop[0]`` of the previous prompt, then explain the last
    prompt's lookup. Raises ValueError with fewer than two prompts or a drop that names no checkpoint."""
    ids = [as_tokens(p) for p in prompts]
    if len(ids) < 2:
        raise ValueError("give at least two prompts (the last one is looked up)")
    model = demo_model(preset)
    pages = sum(_pages_for(model, config, len(p) + 1) for p in ids)
    eng = build_engine(EngineArgs(model, pages, config, prefix_cache=True))
    with one_thread():
        for p in ids[:-1]:
            eng.generate(p, 1)
    cache = eng.cache
    if drop is not None:
        cache.drop_checkpoint(ids[-2], drop[0], drop[1])
    N, nodes = config.block_size, cache.index.nodes
    blocks = []
    for i, p in enumerate(ids):
        for j, key in enumerate(cache.keys(p)):
            blocks.append(dict(prompt=i, block=j, start=j * N, end=(j + 1) * N, key=key.hex()[:8],
                               cached=key in nodes))
    hit = cache.lookup(ids[-1])
    steps = [s._asdict() for s in cache.explain(ids[-1])]
    return Anatomy(blocks, [c._asdict() for c in cache.checkpoints()], steps, hit.num_tokens, hit.kv_tokens, drop,
                   [len(p) for p in ids])


class MissThenHit(NamedTuple):
    """miss: row of the cold request; written: checkpoints it left (boundary, group, written_at, pages);
    hit: row of the next request sharing ``next_shared`` tokens; check: its output vs cache-off."""

    miss: dict
    written: list
    hit: dict
    check: Comparison


def miss_then_hit(prompt_tokens: int, next_shared: int, config: ServeConfig = ServeConfig(16, 64, 2),  # page 09's
                  max_new_tokens: int = 4, seed: int = 0, preset: str = "demo") -> MissThenHit:
    """A cold request of ``prompt_tokens`` random bytes, then one sharing its first ``next_shared``
    tokens (+ 16 new). Raises ValueError if ``next_shared`` exceeds the prompt."""
    if not 0 <= next_shared <= prompt_tokens:
        raise ValueError(f"next_shared must be in [0, prompt_tokens={prompt_tokens}], got {next_shared}")
    first, _ = shared_prefix_prompts(prompt_tokens, 0, seed)
    second = first[:next_shared] + shared_prefix_prompts(16, 0, seed + 1)[0]
    model = demo_model(preset)
    pages = _pages_for(model, config, prompt_tokens + 16 + max_new_tokens)
    with one_thread():
        eng = build_engine(EngineArgs(model, pages, config, prefix_cache=True))
        miss = eng.generate(first, max_new_tokens)
        written = [c._asdict() for c in eng.cache.checkpoints()]
        warm = eng.generate(second, max_new_tokens, record_logits=True)
        cold = build_engine(EngineArgs(model, pages, config)).generate(
            second, max_new_tokens, record_logits=True)
    return MissThenHit(_row("miss", miss), written, _row("next", warm), compare(warm, cold))


@dataclass(frozen=True)
class PrefixCheck:
    """Cold vs warm output, ready to show (home page and page 08; the fast part, drawn first).

    rows: the verification run's rows (:class:`ColdWarm`: a list of dicts), one per kind in :data:`PHASE_RUNS`; warm / cold:
    its warm and cold rows; check: warm vs cache-off output; warm_text: the warm output decoded as UTF-8
    (control bytes other than newline shown as ·); num_generated: its tokens; state_bytes: the whole-model KDA state (bytes);
    chunk_size: the KDA chunk C (tokens)."""

    rows: list
    warm: dict
    cold: dict
    check: Comparison
    warm_text: str
    num_generated: int
    state_bytes: int
    chunk_size: int = CHUNK_SIZE


@dataclass(frozen=True)
class PrefixTimings:
    """Engine TTFT of cold vs warm runs, ready to draw (home page and page 08; the measured part).

    rows: one row per (repeat, kind) (:class:`TtftTimes`); ttft: one row per kind in :data:`PHASE_RUNS` with
    ``median_ms``, ``q1_ms``, ``q3_ms``, ``min_ms``, ``max_ms`` and ``repeats`` of the TTFT (wall clock) and
    ``cpu_median_ms``, ``cpu_q1_ms``, ``cpu_q3_ms`` of the same requests' CPU time (NaN for the fill); phases_ms: median ms per
    timing phase (columns ``<phase>_ms`` of :data:`serve.engine.request.TIMING_PHASES`) per kind; summary:
    :func:`ttft_summary`; conditions: :class:`lab.timing.Conditions`; fit: the fixed + per-token cost of a
    forward fitted to cache-off runs in the same rounds, validated on the cold run (held out) and predicting
    the warm run (:class:`lab.forward_cost.ForwardFit`); phases: the phase names."""

    rows: pd.DataFrame
    ttft: pd.DataFrame
    phases_ms: pd.DataFrame
    summary: dict
    conditions: Conditions
    fit: ForwardFit
    phases: tuple = TIMING_PHASES

    def cache_on_extra_ms(self, kind: str = "first") -> dict:
        """What a cache-on run of ``kind`` ("first": request 1, which fills the cache; "warm") spends beyond the
        cache-off cold run, phase by phase (median ms of ``kind`` − median ms of "cold", :data:`TIMING_PHASES`
        keys), plus ``"ttft"`` (the same for the TTFT) and ``"checkpoints"`` (median KDA state checkpoints the run
        wrote). lookup: hashing the prompt's blocks and matching them; checkpoint: copying the KDA state out to
        the checkpoint pages and publishing it; prefill: the forward, which in a cache-on run also returns the
        chunk states at the checkpoint boundaries and writes the latents of the blocks below them."""
        by = self.phases_ms.set_index("kind")
        out = {p: float(by.loc[kind, f"{p}_ms"] - by.loc["cold", f"{p}_ms"]) for p in self.phases}
        med = self.ttft.set_index("kind").median_ms
        out["ttft"] = float(med[kind] - med["cold"])
        out["checkpoints"] = float(self.rows[self.rows.kind == kind].checkpoints_written.median())
        return out


def _check(run: ColdWarm) -> PrefixCheck:
    text = "".join(c if c.isprintable() or c == "\n" else "·" for c in bytes_to_text(run.warm_tokens))
    by_kind = {r["kind"]: r for r in run.rows}
    return PrefixCheck(run.rows, by_kind["warm"], by_kind["cold"], run.check, text, len(run.warm_tokens),
                       run.layout.state_bytes)


def _timings(run: TtftTimes) -> PrefixTimings:
    import pandas as pd

    rows = pd.DataFrame(run.rows)
    phases = rows.groupby("kind")[[f"{p}_ms" for p in TIMING_PHASES]].median().reindex(list(PHASE_RUNS))
    cpu = rows.groupby("kind").cpu_ms.quantile([0.25, 0.5, 0.75]).unstack()   # numpy's linear quartiles, as summarize
    ttft = pd.DataFrame([dict(kind=t.label, median_ms=t.median_s * 1e3, q1_ms=t.q1_s * 1e3, q3_ms=t.q3_s * 1e3,
                              min_ms=t.min_s * 1e3, max_ms=t.max_s * 1e3, repeats=len(t.samples_s),
                              cpu_median_ms=cpu.loc[t.label, 0.5], cpu_q1_ms=cpu.loc[t.label, 0.25],
                              cpu_q3_ms=cpu.loc[t.label, 0.75])
                         for t in run.timings])
    by_kind = {t.label: t for t in run.timings}
    warm = rows[rows.kind == "warm"]
    fit = forward_fit(run.prefill, by_kind["cold"], by_kind["warm"], int(warm.prompt_tokens.iloc[0]),
                      int(warm.hit_tokens.iloc[0]), float(warm.restore_ms.median() + warm.checkpoint_ms.median()))
    return PrefixTimings(rows, ttft, phases.reset_index(), ttft_summary(run.rows), run.conditions, fit)


def home(first: str, second: str, max_new_tokens: int, block_size: int, interval: int) -> PrefixCheck:
    """The home page's verdict: text prompt ``second`` cold and warm after ``first`` (:func:`cold_vs_warm`).
    Raises ValueError for an empty prompt or bad sizes."""
    return _check(cold_vs_warm(first, second, max_new_tokens, ServeConfig(block_size, interval)))


def home_timing(first: str, second: str, max_new_tokens: int, block_size: int, interval: int,
                repeats: int = MIN_REPEATS) -> PrefixTimings:
    """The home page's measured TTFT, cold vs warm (:func:`time_cold_warm`). Raises as it does."""
    return _timings(time_cold_warm(first, second, max_new_tokens, ServeConfig(block_size, interval), repeats=repeats))


def prefix_hit(shared_tokens: int, unique_tokens: int, max_new_tokens: int, block_size: int, interval: int,
               num_groups: int, seed: int = 0) -> PrefixCheck:
    """Page 08's verdict: two seeded random prompts sharing ``shared_tokens`` (:func:`shared_prefix_prompts`),
    the second cold and warm. Raises ValueError for bad lengths or sizes."""
    first, second = shared_prefix_prompts(shared_tokens, unique_tokens, seed=seed)
    return _check(cold_vs_warm(first, second, max_new_tokens, ServeConfig(block_size, interval, num_groups)))


def prefix_hit_timing(shared_tokens: int, unique_tokens: int, max_new_tokens: int, block_size: int, interval: int,
                      num_groups: int, repeats: int = MIN_REPEATS, seed: int = 0) -> PrefixTimings:
    """Page 08's measured TTFT, cold vs warm, of the prompts of :func:`prefix_hit`. Raises as
    :func:`time_cold_warm` does."""
    first, second = shared_prefix_prompts(shared_tokens, unique_tokens, seed=seed)
    return _timings(time_cold_warm(first, second, max_new_tokens, ServeConfig(block_size, interval, num_groups), repeats))
