"""Measured draft acceptance of real drafters against the trained target, per draft position, code vs prose.

Each held-out prompt (``train/corpus_manifest.json``'s held-out split, whole files never trained on) is
generated with greedy speculative decoding (:func:`serve.spec_decode.verify.speculative_generate`, snapshot
rollback) by the trained target ``weights/kda-demo`` with one drafter:

- ``n-gram``: prompt lookup (shown as "prompt lookup (n-gram)", :data:`DRAFTER_LABELS`) (:class:`serve.spec_decode.draft.NgramProposer`, n = 3 down to 1);
- ``draft model``: the trained 2-layer draft ``weights/kda-draft`` (:class:`DraftModelProposer`);
- ``noisy oracle``: the controlled experiment (the target's own tokens, each corrupted with probability p).

Accounting (vLLM's spec-decode metrics, vllm#48892's "per-position acceptance"): a verify step that carried
at least one draft token is one *draft*; ``accepted[i]`` counts the drafts whose position i was accepted
(greedy: drafts 1..i all equal the target's tokens). The per-position rate is **unconditional**,
``accepted[i] / drafts`` = P(draft token i accepted), so it can only fall with i; the **conditional** rate
``accepted[i] / accepted[i - 1]`` (``accepted[0] = drafts``) is P(i accepted | i - 1 accepted). A draft
shorter than i (prompt lookup found a short match) counts as position i not accepted. Only steps whose draft
budget was the full n count (the last steps of a generation may draft fewer: ``draft_budget`` never drafts
past the requested length, which would otherwise show as rejections). Mean accepted length
= mean accepted drafts per verify step (steps without drafts included, as 0); bytes per verify step = mean
emitted bytes (accepted + the bonus byte; one token = one byte). Repetition rate: the fraction of the
target's output n-grams (``REPEAT_NGRAM`` bytes, wholly inside the output) that already occurred earlier in
prompt + output: a model stuck in a loop drives it to 1 and inflates prompt-lookup acceptance.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import torch

from kda_core.model import HybridLM
from lab.shipped import read_shipped, result_path
from lab.threads import one_thread
from serve.errors import check_choice, check_int
from serve.spec_decode.draft import DraftModelProposer, DraftProposer, NgramProposer, NoisyOracleProposer
from serve.spec_decode.verify import draft_budget, make_strategy, speculative_generate
from train.corpus import KINDS, documents

DRAFTERS = ("n-gram", "draft model", "noisy oracle")
DRAFTER_LABELS = {"n-gram": "prompt lookup (n-gram)", "draft model": "draft model", "noisy oracle": "noisy oracle"}
REPEAT_NGRAM = 8            # bytes per n-gram of the repetition rate
STEP_COLUMNS = ["drafter", "kind", "prompt", "step", "budget", "num_drafted", "num_accepted", "num_emitted"]
BENCH_RESULT = result_path("drafters")


class RunSize(NamedTuple):
    """How much one acceptance measurement generates: ``num_prompts`` held-out prompts per kind of at most
    ``prompt_bytes`` bytes, ``new_tokens`` bytes generated after each."""

    num_prompts: int
    prompt_bytes: int
    new_tokens: int


BENCH_SIZE = RunSize(6, 256, 96)   # python -m bench.drafters (bench/README.md); pages 01, 02, 04 default to it
QUICK_SIZE = RunSize(2, 192, 32)   # the pages' quick option: too few bytes to rank drafters (the target loops)


class BenchDrafters(NamedTuple):
    """The shipped ``python -m bench.drafters`` result: ``summary`` and ``positions`` frames as
    :class:`DrafterRun` has them, and its ``conditions`` dict."""

    summary: pd.DataFrame
    positions: pd.DataFrame
    conditions: dict


def bench_drafters(path: Path = BENCH_RESULT) -> BenchDrafters | None:
    """The shipped bench result at ``path`` (``bench/results/drafters.json``), or None when there is none."""
    d = read_shipped(path)
    if d is None:
        return None
    return BenchDrafters(pd.DataFrame(d["summary"]), pd.DataFrame(d["positions"]), d["conditions"])


@functools.lru_cache(maxsize=8)
def heldout_prompts(kind: str, num_prompts: int, prompt_bytes: int) -> tuple[tuple[int, ...], ...]:
    """``num_prompts`` prompts of at most ``prompt_bytes`` bytes from held-out documents of ``kind``.

    Documents at least ``2 * prompt_bytes`` long, taken evenly spread over the held-out list (sorted by
    path); each prompt starts at the first line start after the document's middle and is cut back to end
    with a newline (when one falls in its second half), so the continuation starts a line. Byte-id tuples.

    Raises:
        ValueError: unknown ``kind``; ``num_prompts`` not a positive int; ``prompt_bytes`` not an int >= 16;
        fewer held-out documents of ``kind`` than ``num_prompts``.
    """
    check_choice("kind", kind, KINDS)
    check_int("num_prompts", num_prompts)
    check_int("prompt_bytes", prompt_bytes, 16)
    docs = sorted((d for d in documents() if d.split == "heldout" and d.kind == kind
                   and len(d.data) >= 2 * prompt_bytes), key=lambda d: d.path)
    if len(docs) < num_prompts:
        raise ValueError(f"num_prompts must be <= {len(docs)} (held-out {kind} documents of >= "
                         f"{2 * prompt_bytes} bytes), got {num_prompts}")
    out = []
    for i in range(num_prompts):
        data = docs[i * len(docs) // num_prompts].data
        mid = len(data) // 2
        start = data.index(b"\n", mid) + 1 if b"\n" in data[mid:] else mid
        window = data[start: start + prompt_bytes]
        cut = window.rfind(b"\n") + 1
        out.append(tuple(window[:cut] if cut > prompt_bytes // 2 else window))
    return tuple(out)


def make_proposer(drafter: str, draft: HybridLM | None, prompt: Sequence[int], reference: Sequence[int],
                  corrupt_prob: float = 0.3, seed: int = 0) -> DraftProposer:
    """A fresh proposer for one request. ``reference``: the target's greedy output (the noisy oracle's
    tokens). Raises ValueError for an unknown drafter, or ``draft`` None with ``"draft model"``."""
    check_choice("drafter", drafter, DRAFTERS)
    if drafter == "n-gram":
        return NgramProposer()
    if drafter == "draft model":
        if draft is None:
            raise ValueError("draft must be the draft model (a HybridLM) for drafter 'draft model'")
        return DraftModelProposer(draft)
    return NoisyOracleProposer(prompt, reference, corrupt_prob, seed)


def repetition_rate(prompt: Sequence[int], output: Sequence[int], n: int = REPEAT_NGRAM) -> float:
    """Fraction of the n-grams wholly inside ``output`` that occurred at an earlier start in
    ``prompt + output``; NaN when the output has fewer than n tokens. Raises ValueError for n < 1."""
    check_int("n", n)
    seq, p = [int(t) for t in prompt] + [int(t) for t in output], len(prompt)
    seen = {tuple(seq[i: i + n]) for i in range(0, min(p, len(seq) - n + 1))}   # n-grams starting in the prompt
    total = repeated = 0
    for i in range(p, len(seq) - n + 1):
        gram = tuple(seq[i: i + n])
        total += 1
        repeated += gram in seen
        seen.add(gram)
    return repeated / total if total else float("nan")


def acceptance_by_position(steps: pd.DataFrame, num_draft: int) -> pd.DataFrame:
    """Per-position acceptance from a steps frame (columns ``drafter``, ``kind``, ``budget``, ``num_drafted``,
    ``num_accepted``): one row per (drafter, kind) and draft position i = 1..num_draft with ``drafts``
    (steps with a full budget of ``num_draft`` and >= 1 draft), ``accepted`` (drafts whose position i was accepted), ``rate`` = accepted / drafts
    (unconditional) and ``conditional_rate`` = accepted / accepted at i - 1 (NaN after 0).

    Raises ValueError for num_draft < 1 or missing columns."""
    check_int("num_draft", num_draft)
    missing = {"drafter", "kind", "budget", "num_drafted", "num_accepted"} - set(steps.columns)
    if missing:
        raise ValueError(f"steps is missing columns {sorted(missing)}")
    rows = []
    for (drafter, kind), part in steps.groupby(["drafter", "kind"], sort=False):
        drafted = part[(part.num_drafted > 0) & (part.budget == num_draft)]
        prev = len(drafted)
        for i in range(1, num_draft + 1):
            acc = int((drafted.num_accepted >= i).sum())
            rows.append({"drafter": drafter, "kind": kind, "position": i, "drafts": len(drafted), "accepted": acc,
                         "rate": acc / len(drafted) if len(drafted) else float("nan"),
                         "conditional_rate": acc / prev if prev else float("nan")})
            prev = acc
    return pd.DataFrame(rows, columns=["drafter", "kind", "position", "drafts", "accepted", "rate",
                                       "conditional_rate"])


class DrafterRun(NamedTuple):
    """``steps``: one row per verify step (``STEP_COLUMNS``); ``positions``: :func:`acceptance_by_position`;
    ``summary``: per drafter and kind the verify steps, bytes generated, mean accepted length, bytes per verify
    step, the share of steps that carried a draft, the target's repetition rate, draft-model tokens run per
    emitted byte (draft model only, else NaN) and whether every output equalled plain greedy decoding
    (``matches_plain``); ``conditions``: what was run, threads, load average."""

    steps: pd.DataFrame
    positions: pd.DataFrame
    summary: pd.DataFrame
    conditions: dict


def measure_drafters(target: HybridLM, draft: HybridLM | None, drafters: Sequence[str] = DRAFTERS[:2],
                     kinds: Sequence[str] = KINDS, num_prompts: int = 2, prompt_bytes: int = 192,
                     new_tokens: int = 48, num_draft: int = 4, corrupt_prob: float = 0.3,
                     seed: int = 0) -> DrafterRun:
    """Generate ``new_tokens`` bytes after each held-out prompt with each drafter; count acceptance.

    Every speculative output is compared with the target's plain greedy output (``HybridLM.generate``);
    ``summary.matches_plain`` says whether all were equal (they must be). The noisy oracle of prompt i draws
    from seed ``seed + i``. One torch thread.

    Raises:
        ValueError: an unknown drafter or kind, ``new_tokens`` < 2, ``num_draft`` < 1, bad prompt counts,
        ``draft`` None with the draft model.
    """
    for d in drafters:
        check_choice("drafter", d, DRAFTERS)
    check_int("new_tokens", new_tokens, 2)
    check_int("num_draft", num_draft)
    rows, summary = [], []
    load = os.getloadavg()[0]
    with one_thread():
        for kind in kinds:
            prompts = heldout_prompts(kind, num_prompts, prompt_bytes)
            refs = [target.generate(torch.tensor([p]), new_tokens)[0][0].tolist() for p in prompts]   # [new_tokens]
            rep = sum(repetition_rate(p, r) for p, r in zip(prompts, refs)) / len(prompts)
            for drafter in drafters:
                match, fed, part = True, 0, []
                for i, (prompt, ref) in enumerate(zip(prompts, refs)):
                    prop = make_proposer(drafter, draft, prompt, ref, corrupt_prob, seed + i)   # own draws per prompt
                    res = speculative_generate(target, torch.tensor(prompt), new_tokens, prop,
                                               make_strategy("snapshot", num_draft + 1), num_draft)
                    match &= res.tokens == ref
                    fed += getattr(prop, "num_fed", 0)
                    left = new_tokens - 1                       # tokens still to emit after the prefill's
                    for s in res.steps:
                        part.append((drafter, kind, i, s.step, draft_budget(num_draft, 0, left), s.num_drafted,
                                     s.num_accepted, s.num_emitted))
                        left -= s.num_emitted
                df = pd.DataFrame(part, columns=STEP_COLUMNS)
                rows += part
                summary.append({"drafter": drafter, "kind": kind, "verify_steps": len(df),
                                "bytes": len(prompts) * new_tokens, "mean_accepted": df.num_accepted.mean(),
                                "bytes_per_verify": df.num_emitted.mean(),
                                "draft_coverage": (df.num_drafted > 0).mean(), "repetition_rate": rep,
                                "draft_tokens_per_byte": fed / (len(prompts) * new_tokens)
                                if drafter == "draft model" else float("nan"),
                                "matches_plain": match})
    steps = pd.DataFrame(rows, columns=STEP_COLUMNS)
    conditions = {"target": target.cfg.name, "draft": None if draft is None else draft.cfg.name,
                  "prompts_per_kind": num_prompts, "prompt_bytes_max": prompt_bytes,
                  "new_bytes_per_prompt": new_tokens, "num_draft": num_draft, "verification": "greedy",
                  "rollback": "snapshot", "noisy_oracle_corrupt_prob": corrupt_prob if "noisy oracle" in drafters
                  else None, "repetition_ngram_bytes": REPEAT_NGRAM, "torch_threads": 1, "load_average_1min": load,
                  "torch": torch.__version__}
    return DrafterRun(steps, acceptance_by_position(steps, num_draft), pd.DataFrame(summary), conditions)
