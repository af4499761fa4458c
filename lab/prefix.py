"""Measured engine runs behind the home page, pages 07-09 and ``bench.prefix``; :func:`home` (home page)
 and :func:`prefix_hit` (page 08) return everything their page draws in one call
(page 07's: :func:`lab.prefix_anatomy.anatomy_view`).

Every function builds fresh engines on the runnable demo model, runs real requests through
:class:`serve.engine.ServeEngine` single-threaded (2 shared cores: stable timings), and returns plain
rows (lists of dicts) for the UI. TTFT is measured by the engine (submit -> first token, ms).
"""
from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import pandas as pd
import torch

from kda_core.chunk import CHUNK_SIZE
from kda_core.config import PRESETS
from kda_core.model import HybridLM, bytes_to_text
from lab.threads import one_thread
from serve.config import ServeConfig
from serve.engine import ServeEngine
from serve.memory.layout import CacheLayout
from serve.memory.pool import PagePool
from serve.prefix.cache import PrefixCache
from serve.request import TIMING_PHASES, RequestResult

RUNNABLE = ("demo", "demo-k3gate", "demo-tiny")


@functools.lru_cache(maxsize=len(RUNNABLE))   # bounded: one model per runnable preset
def demo_model(preset: str = "demo") -> HybridLM:
    """The runnable model of a demo preset (weights from its seed; built once per process)."""
    if preset not in RUNNABLE:
        raise ValueError(f"preset must be one of {RUNNABLE} (runnable on the CPU), got {preset!r}")
    return HybridLM(PRESETS[preset])


def as_tokens(prompt: str | Sequence[int]) -> list[int]:
    """UTF-8 bytes of a text prompt (byte-level model), or the ids as given. Raises ValueError if empty."""
    ids = list(prompt.encode("utf-8")) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise ValueError("prompt must not be empty")
    return ids


def build_engine(model: HybridLM, block_size: int, interval: int, num_groups: int = 1, num_pages: int = 512,
                 policy: str = "multi_page", cache: bool = True) -> ServeEngine:
    """An engine on a fresh pool (page size from ``policy``), with or without a prefix cache. Raises
    ValueError for a bad :class:`ServeConfig`."""
    config = ServeConfig(block_size, interval, num_groups, policy)
    pool = PagePool(num_pages, config.page_bytes(model.cfg))
    pc = PrefixCache(pool, config, cfg=model.cfg) if cache else None
    return ServeEngine(model, pool, pc, config=config)


def _pages_for(model: HybridLM, block_size: int, num_groups: int, tokens: int, policy: str = "multi_page") -> int:
    """Pages for two requests of ``tokens`` with a checkpoint every block (generous, never evicts)."""
    lay = ServeConfig(block_size, block_size, num_groups, policy).layout(model.cfg)
    blocks = -(-tokens // block_size) + 1
    return 2 * (blocks + lay.state_pages * (blocks + 2))


def _row(kind: str, res: RequestResult, repeat: int = 0) -> dict:
    row = dict(kind=kind, repeat=repeat, ttft_ms=res.ttft_ms, prompt_tokens=res.prompt_tokens,
               prefill_tokens=res.prefill_tokens, hit_tokens=res.hit_tokens, kv_hit_tokens=res.kv_hit_tokens,
               restored_bytes=res.restored_bytes, shared_kv_bytes=res.shared_kv_bytes,
               checkpoints_written=res.checkpoints_written)
    row.update({f"{p}_ms": res.timings_ms[p] for p in TIMING_PHASES})
    return row


WARM_TOLERANCE = 1e-5
"""Max |Δ logits| allowed between a warm run and the cache-off run when they are not bitwise equal: a hit
boundary b off the 64-token chunk grid (``kda_core.chunk.CHUNK_SIZE``) starts the warm prefill's KDA chunks and
MLA row blocks at b instead of on the cold run's grid, so in-chunk sums are taken in another order (fp32
rounding; measured up to 5e-6 on the demo model)."""


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
    """rows: one dict per (repeat, kind) with TTFT, tokens, bytes and per-phase ms; cold = the prompt
    through a cache-off engine, first = the earlier request that fills the cache, warm = the prompt
    after it; check: warm vs cold outputs (worst repeat); warm_tokens: the warm output token ids of
    repeat 0 (``max_new_tokens`` of them); layout: page layout."""

    rows: list
    check: Comparison
    warm_tokens: tuple
    layout: CacheLayout


def cold_vs_warm(first: str | Sequence[int], second: str | Sequence[int], max_new_tokens: int = 8,
                 block_size: int = 16, interval: int = 64, num_groups: int = 1, repeats: int = 3,
                 preset: str = "demo") -> ColdWarm:
    """Measure ``second`` cold (cache-off engine) and warm (after ``first`` filled the cache), ``repeats``
    times on fresh engines. Repeat 0 generates ``max_new_tokens`` for the cold and warm runs; later
    repeats only measure TTFT, so they stop at the first token (its logits are still compared). ``first``
    always generates ``max_new_tokens`` (its output blocks are part of the cache it leaves). Raises
    ValueError for bad sizes or prompts."""
    a, b = as_tokens(first), as_tokens(second)
    if repeats < 1 or max_new_tokens < 1:
        raise ValueError("repeats and max_new_tokens must be >= 1")
    model = demo_model(preset)
    pages = _pages_for(model, block_size, num_groups, max(len(a), len(b)) + max_new_tokens)
    rows, checks, warm = [], [], None
    with one_thread():
        for r in range(repeats):
            new_tokens = max_new_tokens if r == 0 else 1
            cold = build_engine(model, block_size, interval, num_groups, pages, cache=False).generate(
                b, new_tokens, record_logits=True)
            eng = build_engine(model, block_size, interval, num_groups, pages)
            fill = eng.generate(a, max_new_tokens)
            res = eng.generate(b, new_tokens, record_logits=True)
            if r == 0:
                warm = res
            eng.check_integrity()
            rows += [_row("cold", cold, r), _row("first", fill, r), _row("warm", res, r)]
            checks.append(compare(res, cold))
    worst = max(checks, key=lambda c: (not c.outputs_identical, not c.bitwise, c.max_logit_diff))
    return ColdWarm(rows, worst, warm.output_tokens, eng.layout)


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


def ttft_summary(rows: list) -> dict:
    """Median TTFT (ms) of the cold and warm rows and the reduction ``1 - warm / cold``."""
    cold = statistics.median(r["ttft_ms"] for r in rows if r["kind"] == "cold")
    warm = statistics.median(r["ttft_ms"] for r in rows if r["kind"] == "warm")
    return dict(cold_ttft_ms=cold, warm_ttft_ms=warm, ttft_reduction=1.0 - warm / cold)


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


def anatomy(prompts: Sequence[str | Sequence[int]], block_size: int = 16, interval: int = 32,
            num_groups: int = 2, drop: tuple[int, int] | None = None, preset: str = "demo") -> Anatomy:
    """Run every prompt but the last through a cached engine (one output token each), optionally drop
    group ``drop[1]``'s checkpoint at boundary ``drop[0]`` of the previous prompt, then explain the last
    prompt's lookup. Raises ValueError with fewer than two prompts or a drop that names no checkpoint."""
    ids = [as_tokens(p) for p in prompts]
    if len(ids) < 2:
        raise ValueError("give at least two prompts (the last one is looked up)")
    model = demo_model(preset)
    pages = sum(_pages_for(model, block_size, num_groups, len(p) + 1) for p in ids)
    eng = build_engine(model, block_size, interval, num_groups, pages)
    with one_thread():
        for p in ids[:-1]:
            eng.generate(p, 1)
    cache = eng.cache
    if drop is not None:
        cache.drop_checkpoint(ids[-2], drop[0], drop[1])
    N, nodes = block_size, cache.index.nodes
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


def miss_then_hit(prompt_tokens: int, next_shared: int, block_size: int = 16, interval: int = 64,
                  num_groups: int = 2, max_new_tokens: int = 4, seed: int = 0, preset: str = "demo") -> MissThenHit:
    """A cold request of ``prompt_tokens`` random bytes, then one sharing its first ``next_shared``
    tokens (+ 16 new). Raises ValueError if ``next_shared`` exceeds the prompt."""
    if not 0 <= next_shared <= prompt_tokens:
        raise ValueError(f"next_shared must be in [0, prompt_tokens={prompt_tokens}], got {next_shared}")
    first, _ = shared_prefix_prompts(prompt_tokens, 0, seed)
    second = first[:next_shared] + shared_prefix_prompts(16, 0, seed + 1)[0]
    model = demo_model(preset)
    pages = _pages_for(model, block_size, num_groups, prompt_tokens + 16 + max_new_tokens)
    with one_thread():
        eng = build_engine(model, block_size, interval, num_groups, pages)
        miss = eng.generate(first, max_new_tokens)
        written = [c._asdict() for c in eng.cache.checkpoints()]
        warm = eng.generate(second, max_new_tokens, record_logits=True)
        cold = build_engine(model, block_size, interval, num_groups, pages, cache=False).generate(
            second, max_new_tokens, record_logits=True)
    return MissThenHit(_row("miss", miss), written, _row("next", warm), compare(warm, cold))


PHASE_RUNS = ("cold", "first", "warm")  # row order of the phase breakdown


@dataclass(frozen=True)
class PrefixRuns:
    """Cold vs warm, ready to draw (home page and page 08).

    rows: one row per (repeat, run) as in :class:`ColdWarm` (ms, tokens, bytes); phases_ms: median ms per
    timing phase (columns :data:`serve.request.TIMING_PHASES`) per run ``kind`` in :data:`PHASE_RUNS`;
    warm: the warm row of repeat 0; check: warm vs cache-off output; summary: :func:`ttft_summary`;
    warm_text: the warm output of repeat 0 decoded as UTF-8 (control bytes shown as ·); num_generated:
    its tokens; state_bytes: the whole-model KDA state (bytes); phases: the timing phase names;
    chunk_size: the KDA chunk C (tokens)."""

    rows: pd.DataFrame
    phases_ms: pd.DataFrame
    warm: dict
    check: Comparison
    summary: dict
    warm_text: str
    num_generated: int
    state_bytes: int
    phases: tuple = TIMING_PHASES
    chunk_size: int = CHUNK_SIZE


def _prefix_runs(run: ColdWarm) -> PrefixRuns:
    rows = pd.DataFrame(run.rows)
    phases = rows.groupby("kind")[[f"{p}_ms" for p in TIMING_PHASES]].median().reindex(list(PHASE_RUNS))
    text = "".join(c if c.isprintable() else "·" for c in bytes_to_text(run.warm_tokens))
    warm = rows[rows.kind == "warm"].iloc[0].to_dict()
    return PrefixRuns(rows, phases.reset_index(), warm, run.check, ttft_summary(run.rows), text,
                      len(run.warm_tokens), run.layout.state_bytes)


def home(first: str, second: str, max_new_tokens: int, block_size: int, interval: int,
         repeats: int = 3) -> PrefixRuns:
    """The home page: text prompt ``second`` cold and warm after ``first`` (:func:`cold_vs_warm`).
    Raises ValueError for an empty prompt or bad sizes."""
    return _prefix_runs(cold_vs_warm(first, second, max_new_tokens, block_size, interval, repeats=repeats))


def prefix_hit(shared_tokens: int, unique_tokens: int, max_new_tokens: int, block_size: int, interval: int,
               num_groups: int, repeats: int = 3, seed: int = 0) -> PrefixRuns:
    """Page 08: two seeded random prompts sharing ``shared_tokens`` (:func:`shared_prefix_prompts`), the
    second cold and warm. Raises ValueError for bad lengths or sizes."""
    first, second = shared_prefix_prompts(shared_tokens, unique_tokens, seed=seed)
    return _prefix_runs(cold_vs_warm(first, second, max_new_tokens, block_size, interval, num_groups,
                                     repeats=repeats))

