"""Page 04's live experiments on the RawInputRing: bytes vs draft length, commit time vs accepted
length for each strategy, a ring run (slots, head/tail, wrap-around, write-backs) and its overflow.

All runs use a demo-shaped hybrid (8 layers: 6 KDA + 2 MLA, head dims 32) whose width d (and so
H = d / 32 heads) is a parameter, single-threaded (see :func:`lab.threads.one_thread`). At the demo width
(128) it is the trained demo model; the other widths have no trained weights and run a seeded random init.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import NamedTuple

from kda_core.config import PRESETS
from kda_core.layer import KDAAux, KDACache
from kda_core.model import ForwardOutput, HybridCache, HybridLM, encode
from lab.drafters import make_proposer
from lab.models import demo_model
from lab.rollback import strategies_for
from lab.threads import one_thread
from lab.timing import MIN_REPEATS, Conditions, LinearFit, conditions, fit_linear, summarize
from lab.verify import PROMPT_TEXT
from serve.errors import check_choice, check_int
from serve.spec_decode.raw_input_ring import RawInputRing
from serve.spec_decode.reference import greedy_decode
from serve.spec_decode.rollback import conv_window_after
from serve.spec_decode.snapshot import SnapshotRollback
from serve.spec_decode.verify import DecodeState, prefill_state, speculate, verify, verify_and_replay

WIDTHS = (64, 128, 256)
DEMO = PRESETS["demo"]                  # ring_model changes only its width and heads
RUN_TOKENS = 24   # page 04's run: at the default 16 slots the ring wraps and forces a write-back; short enough for a fast first render


def ring_model(width: int) -> HybridLM:
    """The demo hybrid at hidden size ``width`` with ``width / 32`` KDA heads of K = V = 32: the trained demo
    model (:func:`lab.models.demo_model`, shared, not to be modified) at the demo width, a seeded random
    init at the others (:func:`is_trained_width`).

    Raises ValueError unless width is one of ``WIDTHS``."""
    if is_trained_width(width):
        return demo_model("demo")
    cfg = dataclasses.replace(PRESETS["demo"], name=f"demo-d{width}", hidden_size=width, num_heads=width // 32)
    return HybridLM(cfg)


def is_trained_width(width: int) -> bool:
    """True at the demo preset's width (trained weights ship for it), False at the other ``WIDTHS``. Raises
    ValueError unless width is one of ``WIDTHS``."""
    check_choice("width", width, WIDTHS)
    return width == DEMO.hidden_size


def prompt_state(model: HybridLM) -> DecodeState:
    """The demo prompt (:data:`lab.verify.PROMPT_TEXT`) prefilled on ``model``, greedy first token taken:
    the state every experiment of this module starts from (one prefill, shared by :func:`ring_view`)."""
    with one_thread():
        return prefill_state(model, encode(PROMPT_TEXT))


def verify_prefix(model: HybridLM, base: HybridCache, out: ForwardOutput, num_tokens: int) -> ForwardOutput:
    """The output of a verify of only the first ``num_tokens`` tokens of ``out``, cut from ``out``.

    ``out`` is :func:`serve.spec_decode.verify.verify` from ``base`` (recurrent mode, ``output_aux=True``) over
    T tokens. Recurrent mode is causal and token by token, and every linear / pointwise op is
    row-invariant (:mod:`kda_core.invariant`), so the first ``num_tokens`` positions of ``out`` are
    bitwise what a verify of those tokens alone returns (``tests/lab/test_ring.py`` checks it): logits
    ``[1, num_tokens, 256]``, every aux tensor cut to ``[1, num_tokens, ...]``, KDA caches = the state
    after token ``num_tokens`` and the conv window there, MLA latents cut to ``base + num_tokens`` tokens.
    Raises ValueError unless ``1 <= num_tokens <= T`` and ``out`` has aux with per-token states."""
    total = out.cache.num_tokens - base.num_tokens
    if out.aux is None or any(a.states is None for a in out.aux.values()):
        raise ValueError("out must be a recurrent-mode verify with output_aux=True")
    if not isinstance(num_tokens, int) or not 1 <= num_tokens <= total:
        raise ValueError(f"num_tokens must be an int in [1, {total}], got {num_tokens!r}")
    aux = {i: KDAAux(*(t[:, :num_tokens] for t in a)) for i, a in out.aux.items()}   # each [1, num_tokens, ...]
    layers = tuple(
        KDACache(aux[i].states[:, -1], conv_window_after(b.conv, aux[i].raw_qkv, num_tokens))  # [1, H, K, V], [1, D, W-1]
        if i in aux else out.cache.layers[i][:, : base.num_tokens + num_tokens]              # [1, L + num_tokens, r + rope]
        for i, b in enumerate(base.layers))
    return ForwardOutput(out.logits[:, :num_tokens], HybridCache(layers, base.num_tokens + num_tokens), aux)


def bytes_vs_draft(model: HybridLM, max_draft: int, start: DecodeState | None = None) -> list[dict]:
    """For n = 1..max_draft: bytes each strategy holds after a real verify of 1 + n tokens (whole model,
    fp32). The ring is sized to the verify (capacity = window = 1 + n), i.e. its raw inputs only.

    One verify of ``1 + max_draft`` tokens from ``start`` (default :func:`prompt_state`) is run; the verify
    of ``1 + n`` tokens is its first ``1 + n`` positions (:func:`verify_prefix`, bitwise), so each
    strategy records exactly what it would record after that shorter verify."""
    rows = []
    with one_thread():
        state = prompt_state(model) if start is None else start
        full = verify(model, state, [state.last_token] * max_draft)
        for n in range(1, max_draft + 1):
            out = verify_prefix(model, state.cache, full, 1 + n)
            for strat in strategies_for(1 + n):
                strat.record(model, state.cache, out)
                rows.append({"draft_tokens": n, "strategy": strat.name, "bytes": strat.nbytes()})
                strat.discard()
    return rows


def commit_times(model: HybridLM, num_draft: int, repeats: int = MIN_REPEATS,
                 accepted: Sequence[int] | None = None,
                 start: DecodeState | None = None) -> tuple[list[dict], Conditions]:
    """Commit (rebuild) time of each strategy for each accepted length (default: every one, 0..num_draft).

    Each sample records a fresh verify of ``1 + num_draft`` tokens from ``start`` (default
    :func:`prompt_state`) and times only ``commit(a)``. One
    untimed warm-up round, then ``repeats`` rounds over every (accepted, strategy) pair, the pair order
    rotating from round to round (:mod:`lab.timing`'s interleaving: a burst of load on the shared machine
    hits every point alike). Rows: accepted, strategy, commit_ms (median), q1_ms, q3_ms, min_ms, max_ms,
    samples (count); and the :class:`lab.timing.Conditions`.
    Raises ValueError for repeats < 5 or an accepted length outside [0, num_draft]."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < MIN_REPEATS:
        raise ValueError(f"repeats must be an int >= {MIN_REPEATS}, got {repeats!r}")
    accepted = list(range(num_draft + 1) if accepted is None else accepted)
    if any(not 0 <= a <= num_draft for a in accepted):
        raise ValueError(f"accepted lengths must be in [0, {num_draft}], got {accepted}")
    names = [strat.name for strat in strategies_for(1 + num_draft)]
    pairs = [(a, i) for a in accepted for i in range(len(names))]
    times: dict[tuple[int, int], list[float]] = {p: [] for p in pairs}
    with one_thread():
        cond = conditions(repeats, 1)
        state = prompt_state(model) if start is None else start
        out = verify(model, state, [state.last_token] * num_draft)
        for r in range(repeats + 1):                       # round 0 = warm-up, not kept
            for j in range(len(pairs)):
                a, i = pairs[(r + j) % len(pairs)]
                strat = strategies_for(1 + num_draft)[i]   # fresh: a ring holds one request
                strat.record(model, state.cache, out)
                t0 = time.perf_counter()
                strat.commit(a)
                if r:
                    times[(a, i)].append(time.perf_counter() - t0)
    rows = []
    for (a, i), ts in times.items():
        t = summarize(names[i], ts)
        rows.append({"accepted": a, "strategy": names[i], "commit_ms": t.median_s * 1e3, "q1_ms": t.q1_s * 1e3,
                     "q3_ms": t.q3_s * 1e3, "min_ms": t.min_s * 1e3, "max_ms": t.max_s * 1e3, "samples": len(ts)})
    return rows, cond


def commit_fits(commit_rows: list[dict]) -> dict[str, LinearFit]:
    """Per strategy, ``commit_ms(a) = a0 + b a`` fitted over the median commit times of
    :func:`commit_times` (:func:`lab.timing.fit_linear`; ``a_s`` / ``b_s`` are in ms here): the fixed
    per-commit overhead and the cost per accepted token. Raises ValueError with fewer than two accepted
    lengths for a strategy."""
    by: dict[str, list[tuple[int, float]]] = {}
    for r in commit_rows:
        by.setdefault(r["strategy"], []).append((r["accepted"], r["commit_ms"]))
    return {name: fit_linear(*zip(*sorted(pts))) for name, pts in by.items()}


class RingRun(NamedTuple):
    """steps: per step the ring counters after the commit (head, commit_end, tail, slots in use), the
    accepted count and whether a write-back was forced before its verify; slots:
    :meth:`RawInputRing.slot_table` at the end of the run; overflow: what one more verify of
    ``requested_draft`` tokens does after the run ("fits ..." or the ValueError text);
    num_write_backs: write-backs forced during the run (= the steps flagged ``forced_write_back``; the
    overflow probe's own write-back, if any, is not counted here but named in ``overflow``); ring_bytes."""

    steps: list[dict]
    slots: list[dict]
    overflow: str
    num_write_backs: int
    ring_bytes: int


def greedy_continuation(model: HybridLM, start: DecodeState, num_tokens: int) -> list[int]:
    """The target's greedy tokens after ``start``: ``start.last_token`` then ``num_tokens - 1`` decode
    steps (:func:`serve.spec_decode.reference.greedy_decode`); bitwise ``model.generate(prompt, num_tokens)``
    when ``start`` is the prompt's prefill."""
    return greedy_decode(model, start.cache, start.last_token, num_tokens).tokens


def ring_run(model: HybridLM, capacity: int, window: int, requested_draft: int, acceptance: float = 0.7,
             max_new_tokens: int = RUN_TOKENS, seed: int = 0, start: DecodeState | None = None,
             drafter: str = "noisy oracle", draft: HybridLM | None = None) -> RingRun:
    """A generation of ``max_new_tokens`` tokens through one ring (:func:`serve.spec_decode.verify.speculate`) with
    drafts of at most ``min(requested_draft, window - 1)`` tokens from ``drafter`` (one of
    :data:`lab.drafters.DRAFTERS`; the noisy oracle is right with probability ``acceptance``; ``draft``: the
    draft model); then one verify of exactly ``requested_draft`` drafts (the target's next greedy tokens, whatever
    the drafter would propose) to show the overflow path. ``start``: the
    prompt's prefilled state (default :func:`prompt_state`).

    Raises ValueError for a bad capacity/window (from :class:`RawInputRing`), requested_draft < 0, an unknown
    drafter or no draft model for ``"draft model"``."""
    check_int("requested_draft", requested_draft, 0)
    ring = RawInputRing(capacity, window)
    prompt = encode(PROMPT_TEXT)
    with one_thread():
        state = prompt_state(model) if start is None else start
        # only the noisy oracle reads the target's greedy output ahead of the run (its drafts are those tokens)
        reference = (greedy_continuation(model, state, max_new_tokens + requested_draft + 1)
                     if drafter == "noisy oracle" else [])
        proposer = make_proposer(drafter, draft, prompt.tolist(), reference, 1.0 - acceptance, seed)
        history, steps = prompt.tolist() + [state.last_token], []
        for step in speculate(model, state, history, proposer, ring, min(requested_draft, window - 1),
                              max_new_tokens - 1):
            steps.append({"step": step.step, "head": ring.head, "commit_end": ring.commit_end, "tail": ring.tail,
                          "slots_in_use": ring.tail - ring.head, "accepted": step.result.num_accepted,
                          "forced_write_back": step.result.forced_commit})
            history.extend(step.result.emitted_tokens)
            state = step.result.state
        ring.check_integrity()                             # committed state == rebuild from the checkpoint
        slots, num_write_backs, num_free = ring.slot_table(), ring.num_write_backs, ring.num_free
        # The probe verifies exactly requested_draft drafts, the target's own next tokens: a drafter may propose
        # fewer (prompt lookup without a match proposes none), which would let a too-long n look as if it fit.
        # They are greedy tokens after the run's last emitted token, from its committed state (= plain decoding's).
        probe_drafts = greedy_continuation(model, DecodeState(state.cache, history[-1]), requested_draft + 1)[1:]
        try:
            probe = verify_and_replay(model, DecodeState(state.cache, history[-1]), probe_drafts, ring)
            overflow = f"fits: {requested_draft + 1} verify tokens <= window {window}"
            if probe.forced_commit:
                overflow += (f", after a forced write-back (only {num_free} of {capacity} slots were free); "
                             "not counted in the run's write-backs")
        except ValueError as exc:
            overflow = f"ValueError: {exc}"
        ring.check_integrity()
    return RingRun(steps, slots, overflow, num_write_backs, ring.nbytes())


def head_tail_labels(slots: list[dict]) -> list[tuple[str, int, int]]:
    """Labels for page 04's slot chart from :meth:`RawInputRing.slot_table` rows: ``(text, slot, rise_px)``.

    head (oldest slot kept since the last write-back) and tail (next slot to write) get arrows of
    different heights, so labels on neighbouring slots never overlap; when both sit on one slot the ring
    is full (or empty) and a single "head = tail" label says which."""
    tail = next(r["slot"] for r in slots if r["tail"])
    head = next((r["slot"] for r in slots if r["head"]), None)
    if head is None:
        return [("head = tail (ring empty)", tail, 30)]
    if head == tail:
        return [("head = tail (ring full)", tail, 30)]
    return [("head", head, 50), ("tail", tail, 25)]


def tradeoff_table(bytes_rows: list[dict], commit_rows: list[dict], num_draft: int) -> list[dict]:
    """Memory vs recompute per strategy at ``num_draft``, from :func:`bytes_vs_draft` and :func:`commit_times`
    rows: bytes per verify, commit ms with all drafts accepted and with none, each also relative to snapshot."""
    held = {r["strategy"]: r["bytes"] for r in bytes_rows if r["draft_tokens"] == num_draft}
    full = {r["strategy"]: r["commit_ms"] for r in commit_rows if r["accepted"] == num_draft}
    none = {r["strategy"]: r["commit_ms"] for r in commit_rows if r["accepted"] == 0}
    if not held or not full:
        raise ValueError(f"no measurement at num_draft = {num_draft} in the given rows")
    snap = SnapshotRollback.name
    return [{"strategy": s, "bytes per verify": held[s], "memory vs snapshot": held[s] / held[snap],
             "commit ms (all accepted)": full[s], "commit ms (none accepted)": none[s],
             "commit time vs snapshot": full[s] / full[snap]} for s in held]


MAX_BYTES_DRAFT = 16   # section 1 of page 04 measures bytes for n = 1 .. 16 drafts


class RingView(NamedTuple):
    """What page 04 draws at every render, measured now on ``model``: ``bytes_rows`` (:func:`bytes_vs_draft` up to
    :data:`MAX_BYTES_DRAFT` drafts), ``run`` (:func:`ring_run`) and ``labels`` (:func:`head_tail_labels` of its
    slots). No timing: :func:`commit_timing` is the page's second, on-request call."""

    bytes_rows: list[dict]
    run: RingRun
    labels: list[tuple[str, int, int]]


def ring_view(model: HybridLM, capacity: int, window: int, num_draft: int, drafter: str = "noisy oracle",
              acceptance: float = 0.7, draft: HybridLM | None = None) -> RingView:
    """Page 04's view (one prefill of the prompt, shared by both experiments); ``drafter``, ``acceptance`` and
    ``draft`` go to :func:`ring_run`. Raises ValueError as :func:`ring_run` does."""
    start = prompt_state(model)
    run = ring_run(model, capacity, window, num_draft, acceptance, start=start, drafter=drafter, draft=draft)
    return RingView(bytes_vs_draft(model, MAX_BYTES_DRAFT, start), run, head_tail_labels(run.slots))


class CommitTiming(NamedTuple):
    """Page 04's measured commit times at ``num_draft`` drafts: ``commit_rows`` (:func:`commit_times`), ``fits``
    (:func:`commit_fits`, ms), ``tradeoff`` (:func:`tradeoff_table` against the bytes of a verify of
    ``1 + num_draft`` tokens) and the ``conditions`` of the timing."""

    commit_rows: list[dict]
    fits: dict[str, LinearFit]
    tradeoff: list[dict]
    conditions: Conditions


def commit_timing(model: HybridLM, num_draft: int, repeats: int = MIN_REPEATS) -> CommitTiming:
    """Every strategy's commit time for every accepted length at ``num_draft`` drafts (:func:`commit_times`: a
    warm-up round, then ``repeats`` interleaved rounds), its fit, and the memory vs recompute table. It depends on
    the model and n only, not on the ring's capacity, window or drafter. Raises ValueError as :func:`commit_times`."""
    start = prompt_state(model)
    commit_rows, cond = commit_times(model, num_draft, repeats, start=start)
    tradeoff = tradeoff_table(bytes_vs_draft(model, num_draft, start), commit_rows, num_draft)
    return CommitTiming(commit_rows, commit_fits(commit_rows), tradeoff, cond)
