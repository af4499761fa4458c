"""Measured draft acceptance on pages 01, 02 and 04: the drafter selector and the per-position chart.

``drafter_selector`` puts the drafter (n-gram prompt lookup by default, the trained draft model, or the noisy
oracle as a labelled controlled experiment whose correctness slider shows only when it is chosen) in a column;
``acceptance_section`` measures acceptance per draft position on held-out code and prose prompts against the
trained target, behind a button (a few seconds of CPU: kept off the first render), and draws it. The
measurement is :func:`lab.drafters.measure_drafters`, cached (bounded) and shared by the three pages.
"""
from __future__ import annotations

import plotly.graph_objects as go
import streamlit as st

from app_pages.caching import built_by_loaded_code
from app_pages.charts import num, pct, show_chart, show_table
from app_pages.errors import engine_call
from app_pages.links import url_widget
from lab.drafters import DRAFTERS, draft_model, measure_drafters, target_model

KIND_COLORS = {"code": "#1f77b4", "prose": "#ff7f0e"}
ORACLE_HELP = ("Controlled experiment, not a real drafter: the target's own greedy token, replaced by a wrong one "
               "with probability 1 − p, each draft independently.")
target = st.cache_resource(target_model, validate=built_by_loaded_code, max_entries=1)
draft = st.cache_resource(draft_model, validate=built_by_loaded_code, max_entries=1)


def drafter_selector(col, prefix: str, oracle_keys: tuple[str, ...] = ()) -> tuple[str, float]:
    """The drafter selectbox (URL key ``{prefix}_drafter``) in ``col``, and for the noisy oracle only its
    correctness slider (``{prefix}_accept``). A link that sets ``{prefix}_accept`` or one of ``oracle_keys`` (the
    oracle's other widgets: links made when the oracle was the only drafter) picks the oracle. Returns (drafter, p)."""
    linked = any(k in st.query_params for k in (f"{prefix}_accept", *oracle_keys))
    default = "noisy oracle" if linked else DRAFTERS[0]
    drafter = url_widget(col.selectbox, "Drafter", f"{prefix}_drafter", default, list(DRAFTERS),
                         help="n-gram: prompt lookup (copy what followed the last n bytes earlier in the text). "
                              "draft model: the trained 2-layer model (1 KDA + 1 MLA) drafts greedily. noisy oracle: "
                              + ORACLE_HELP)
    p = 0.7
    if drafter == "noisy oracle":
        p = url_widget(col.slider, "Draft correctness p (controlled experiment)", f"{prefix}_accept", 0.7, 0.0, 1.0,
                       step=0.05, help=ORACLE_HELP)
    return drafter, p


@st.cache_data(show_spinner="Speculative decoding of held-out code and prose…", max_entries=8, ttl="1h")
def _measure(drafter: str, p: float, num_draft: int):
    run = measure_drafters(target(), draft(), (drafter,), num_prompts=2, prompt_bytes=192, new_tokens=32,
                           num_draft=num_draft, corrupt_prob=1.0 - p)
    return run.positions, run.summary, run.conditions


def acceptance_section(prefix: str, drafter: str, p: float, num_draft: int, title: str) -> None:
    """Section ``title``: behind a button (session flag ``{prefix}_acceptance_on``, set in the button's callback
    so the click is never lost to a rerun), acceptance per draft position of ``drafter`` at ``num_draft`` drafts
    on held-out code vs prose, and the summary table. Until the click it shows the button and returns: the
    rest of the page still renders (unlike ``run_on_request``, which stops the page)."""
    st.subheader(title)
    label = f"{drafter} (controlled, p = {p:.2f})" if drafter == "noisy oracle" else drafter
    flag = f"{prefix}_acceptance_on"
    if not st.session_state.get(flag):
        st.caption(f"Generates 32 bytes after two held-out code and two held-out prose prompts with the trained "
                   f"target and the {label} drafter at n = {num_draft} (a few seconds on this CPU).")
        st.button("Measure acceptance per position", key=f"{prefix}_acceptance_button", type="primary",
                  on_click=st.session_state.update, kwargs={flag: True})
        return
    positions, summary, cond = engine_call(_measure, drafter, p, num_draft)
    fig = go.Figure([go.Bar(x=part.position, y=100 * part.rate, name=kind, marker_color=KIND_COLORS[kind],
                            text=[f"{r:.0%}" for r in part.rate], textposition="outside",
                            customdata=100 * part.conditional_rate,
                            hovertemplate="position %{x}: %{y:.0f} % of drafts; %{customdata:.0f} % given "
                                          "position − 1 accepted<extra>" + kind + "</extra>")
                     for kind, part in positions.groupby("kind", sort=False)])
    fig.update_layout(barmode="group", xaxis_title="draft position i", xaxis_dtick=1, yaxis_range=[0, 115],
                      yaxis_title="P(draft token i accepted), % of verify steps with drafts",
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
               f"Greedy verification by the trained target ({cond['target']}); {cond['prompts_per_kind']} prompts "
               f"per kind of ≤ {cond['prompt_bytes_max']} bytes from held-out stdlib files, "
               f"{cond['new_bytes_per_prompt']} bytes each; 1 torch thread, load average "
               f"{cond['load_average_1min']:.2f}. Repetition: share of the target's output "
               f"{cond['repetition_ngram_bytes']}-byte n-grams already seen in prompt + output — a looping target "
               "inflates prompt-lookup acceptance. ik_llama.cpp#2369 reports 92 % (code) vs 47 % (stories) for a "
               "draft model on a large LLM; the full table is `python -m bench.drafters`.")
