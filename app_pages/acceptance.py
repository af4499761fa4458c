"""Measured draft acceptance on pages 01, 02 and 04: the drafter selector and the per-position chart.

``drafter_params(prefix)`` and ``acceptance_params(prefix)`` are the URL parameters of the two, for the page's
``declare(...)``; ``drafter_selector`` puts the drafter (prompt lookup (n-gram) by default, the trained draft model, or the noisy
oracle as a labelled controlled experiment whose correctness slider shows only when it is chosen) in a column;
``acceptance_section`` measures acceptance per draft position on held-out code and prose prompts against the
trained target, behind a button (seconds to a minute of CPU: kept off the first render), and draws it, with the
page's run conditions beside the bench's (``python -m bench.drafters``, bench/README.md's table). The measurement is
:func:`lab.drafters.measure_drafters`, cached (bounded) and shared by the three pages; it defaults to the bench's
prompts and bytes (:data:`lab.drafters.BENCH_SIZE`), with a quick option too small to rank drafters.
"""
from __future__ import annotations

import plotly.graph_objects as go
import streamlit as st

from app_pages.caching import built_by_loaded_code
from app_pages.charts import num, pct, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import PageLinks
from app_pages.params import Choice, Float, Param
from lab.drafters import (
    BENCH_SIZE,
    DRAFTER_LABELS,
    DRAFTERS,
    QUICK_SIZE,
    RunSize,
    bench_drafters,
    measure_drafters,
)
from lab.models import demo_model, draft_model

KIND_COLORS = {"code": "#1f77b4", "prose": "#ff7f0e"}
ORACLE_HELP = ("Controlled experiment, not a real drafter: the target's own greedy token, replaced by a wrong one "
               "with probability 1 − p, each draft independently.")
target = st.cache_resource(demo_model, validate=built_by_loaded_code, max_entries=1)
draft = st.cache_resource(draft_model, validate=built_by_loaded_code, max_entries=1)


def drafter_params(prefix: str) -> tuple[Param, ...]:
    """The drafter selector's parameters on page ``prefix`` (``"p02"``): ``{prefix}_drafter`` (prompt lookup by
    default) and the noisy oracle's correctness ``{prefix}_accept``."""
    return (Choice(f"{prefix}_drafter", DRAFTERS[0], DRAFTERS, format_func=DRAFTER_LABELS.__getitem__),
            Float(f"{prefix}_accept", 0.7, 0.0, 1.0, step=0.05))


def drafter_selector(links: PageLinks, col, oracle_keys: tuple[str, ...] = ()) -> tuple[str, float]:
    """The drafter selectbox of :func:`drafter_params` in ``col``, and for the noisy oracle only its correctness
    slider. A link that sets ``{prefix}_accept`` or one of ``oracle_keys`` (the oracle's other widgets: links made
    when the oracle was the only drafter) picks the oracle. Returns (drafter, p)."""
    accept = links.prefix + "accept"
    linked = any(k in st.query_params for k in (accept, *oracle_keys))
    drafter = links.selectbox(col, "Drafter", links.prefix + "drafter", default="noisy oracle" if linked else None,
                              help="prompt lookup (n-gram): copy what followed the last n bytes earlier in the text. "
                                   "draft model: the trained 2-layer model (1 KDA + 1 MLA) drafts greedily. noisy "
                                   "oracle: " + ORACLE_HELP)
    p = 0.7
    if drafter == "noisy oracle":
        p = links.slider(col, "Draft correctness p (controlled experiment)", accept, help=ORACLE_HELP)
    return drafter, p


@st.cache_data(show_spinner="Speculative decoding of held-out code and prose…", max_entries=8, ttl="1h")
def _measure(drafter: str, p: float, num_draft: int, size: RunSize):
    run = measure_drafters(target("demo"), draft(), (drafter,), num_prompts=size.num_prompts,
                           prompt_bytes=size.prompt_bytes, new_tokens=size.new_tokens, num_draft=num_draft,
                           corrupt_prob=1.0 - p)
    return run.positions, run.summary, run.conditions


SIZES = {"bench": BENCH_SIZE, "quick": QUICK_SIZE}
SIZE_LABELS = {"bench": f"the bench's: {BENCH_SIZE.num_prompts} prompts per kind × {BENCH_SIZE.new_tokens} bytes",
               "quick": f"quick: {QUICK_SIZE.num_prompts} prompts per kind × {QUICK_SIZE.new_tokens} bytes"}
SIZE_HELP = ("The bench's prompts and bytes (`python -m bench.drafters`, bench/README.md's table) take about 20–60 s on "
             "this CPU; the quick run about 10 s, but with so few bytes the target's loops decide the ranking: too "
             "small to rank drafters.")


def acceptance_params(prefix: str) -> tuple[Param, ...]:
    """The acceptance section's parameter on page ``prefix``: its run size ``{prefix}_acceptance_size``."""
    return (Choice(f"{prefix}_acceptance_size", "bench", SIZES, format_func=SIZE_LABELS.__getitem__),)


def label(drafter: str, p: float) -> str:
    """The drafter's display name (:data:`lab.drafters.DRAFTER_LABELS`), the oracle's p included."""
    return f"{drafter} (controlled, p = {p:.2f})" if drafter == "noisy oracle" else DRAFTER_LABELS[drafter]


def conditions_caption(drafter: str, num_draft: int, cond: dict, summary) -> str:
    """This run's conditions beside the bench's (bench/README.md's table), and the bench's accepted drafts per verify
    for ``drafter``, so the page and bench/README.md can be read side by side."""
    own = (f"This page's run: {cond['prompts_per_kind']} prompts per kind of ≤ {cond['prompt_bytes_max']} bytes, "
           f"{cond['new_bytes_per_prompt']} bytes generated after each, n = {num_draft}")
    rep = summary.set_index("kind").repetition_rate
    loops = (f"The target repeats itself here ({', '.join(f'{rep[k]:.0%} of {k}' for k in rep.index)} output "
             f"{cond['repetition_ngram_bytes']}-grams seen before) and prompt lookup copies those loops: the fewer the "
             "bytes, the more a loop weighs, so a short run can rank prompt lookup above the draft model.")
    shipped = bench_drafters()
    if shipped is None:
        return f"{own}. {loops} No shipped bench result: `python -m bench.drafters` writes one."
    b, acc = shipped.conditions, shipped.summary.set_index(["drafter", "kind"]).mean_accepted
    kinds = [k for k in rep.index if (drafter, k) in acc.index]
    there = ", ".join(f"{k} {acc[(drafter, k)]:.2f}" for k in kinds)
    rival = {"n-gram": "draft model", "draft model": "n-gram"}.get(drafter)
    versus = (f" vs {DRAFTER_LABELS[rival]}'s " + ", ".join(f"{k} {acc[(rival, k)]:.2f}" for k in kinds)
              if rival else "")
    return (f"{own}; the bench's (`bench/results/drafters.json`, bench/README.md's table): {b['prompts_per_kind']} prompts "
            f"per kind of ≤ {b['prompt_bytes_max']} bytes, {b['new_bytes_per_prompt']} bytes each, n = "
            f"{b['num_draft']}, where {label(drafter, 1.0 - b['noisy_oracle_corrupt_prob'])} accepted {there} "
            f"drafts per verify{versus}. {loops}")


def acceptance_section(links: PageLinks, drafter: str, p: float, num_draft: int, title: str) -> None:
    """Section ``title`` of the page whose parameters are ``links`` (with :func:`acceptance_params`): behind a
    button (session flag ``{prefix}_acceptance_on``, set in the button's callback
    so the click is never lost to a rerun), acceptance per draft position of ``drafter`` at ``num_draft`` drafts
    on held-out code vs prose, and the summary table. Until the click it shows the button and returns: the
    rest of the page still renders (unlike ``run_on_request``, which stops the page)."""
    st.subheader(title)
    prefix = links.prefix.rstrip("_")
    flag = f"{prefix}_acceptance_on"
    size = links.radio(st, "Run size", f"{prefix}_acceptance_size", horizontal=True, help=SIZE_HELP)
    if not st.session_state.get(flag):
        st.caption(f"Generates {SIZES[size].new_tokens} bytes after {SIZES[size].num_prompts} held-out code and "
                   f"{SIZES[size].num_prompts} held-out prose prompts with the trained target and the "
                   f"{label(drafter, p)} drafter at n = {num_draft}.")
        st.button("Measure acceptance per position", key=f"{prefix}_acceptance_button", type="primary",
                  on_click=st.session_state.update, kwargs={flag: True})
        return
    positions, summary, cond = engine_call(_measure, drafter, p, num_draft, SIZES[size])
    crowded = num_draft > 8                    # two labels per position would run together ("100%100%"): upright
    fig = go.Figure([go.Bar(x=part.position, y=100 * part.rate, name=kind, marker_color=KIND_COLORS[kind],
                            text=[f"{r:.0%}" for r in part.rate], textposition="outside",
                            textangle=-90 if crowded else 0,
                            customdata=100 * part.conditional_rate,
                            hovertemplate="position %{x}: %{y:.0f} % of drafts; %{customdata:.0f} % given "
                                          "position − 1 accepted<extra>" + kind + "</extra>")
                     for kind, part in positions.groupby("kind", sort=False)])
    fig.update_layout(barmode="group", xaxis_title="draft position i", xaxis_dtick=1, yaxis_range=[0, 130 if crowded else 115],
                      yaxis_title="P(draft i accepted) (%)",   # of verify steps with drafts: the caption
                      legend=dict(orientation="h", y=-0.3), height=340)
    show_chart(fig, positions, key=f"{prefix}_acceptance_chart")
    show_table(summary, {"kind": "Held-out prompts", "verify_steps": num("Verify steps", "%d"),
                         "mean_accepted": num("Accepted drafts per verify", "%.2f"),
                         "bytes_per_verify": num("Bytes per verify step", "%.2f"),
                         "draft_coverage": pct("Steps with a draft", 0),
                         "repetition_rate": pct(f"Target's repeated {cond['repetition_ngram_bytes']}-grams", 0),
                         "matches_plain": "Output = plain greedy"})
    st.caption(f"Unconditional rate: accepted_i ÷ verify steps that carried a draft (vLLM's per-position "
               f"acceptance, vllm#48892), so it can only fall with i; hover shows P(i accepted | i − 1 accepted). "
               f"Greedy verification by the trained target ({cond['target']}) on held-out stdlib files; 1 torch "
               f"thread, load average {cond['load_average_1min']:.2f}. ik_llama.cpp#2369 reports 92 % (code) vs "
               "47 % (stories) for a draft model on a large LLM.")
    st.caption(conditions_caption(drafter, num_draft, cond, summary))
