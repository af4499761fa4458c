"""``real_replica(prefix, where)``: the model / GPU / TP (and prefix-cache policy, budget) widgets of a
real-scale replica, the GPU and TP constrained by the model (pages 11-15)."""
from __future__ import annotations

import streamlit as st

from app_pages.links import url_widget


def real_replica(prefix: str, where=None, *, policy: bool = True, model_key: str | None = None) -> tuple:
    """The widgets of a real-scale replica in one row of ``where`` (a container; default the page): model, GPU and
    TP, offering only the GPUs and TP sizes the model's weights fit in (:func:`lab.fleet.fitting_tps`), and with
    ``policy`` the prefix-cache policy and the cache budget (share of the HBM the weights leave). Keys
    ``{prefix}_model`` (or ``model_key``), ``{prefix}_gpu``, ``{prefix}_tp``, ``{prefix}_cache_policy``,
    ``{prefix}_budget``, bound to the URL and kept across page switches. Returns (model, gpu, tp, cache_policy,
    budget_fraction); without ``policy`` the last two are :data:`lab.fleet_simulation.REAL_DEFAULTS`'."""
    from lab.fleet import fitting_tps
    from lab.fleet_simulation import (
        BUDGET_OPTIONS,
        CACHE_POLICIES,
        HARDWARE,
        MODELS,
        REAL_DEFAULTS,
        TP_SIZES,
    )
    from lab.real_scale import policy_title, preset_title
    model, gpu, tp, cache_policy, budget_fraction = (REAL_DEFAULTS[x] for x in (
        "model", "gpu", "tp", "cache_policy", "budget_fraction"))
    cols = (where or st).columns(5 if policy else 3)
    model = url_widget(cols[0].selectbox, "Model", model_key or f"{prefix}_model", model, list(MODELS),
                       format_func=preset_title)
    gpus = [g for g in HARDWARE if fitting_tps(model, g)]
    gpu = url_widget(cols[1].selectbox, "GPU", f"{prefix}_gpu", gpu if gpu in gpus else gpus[0], gpus, known=HARDWARE)
    tps = list(fitting_tps(model, gpu))
    tp = tp if tp in tps else tps[0]
    if len(tps) > 1:
        tp = url_widget(cols[2].select_slider, "GPUs per replica (TP)", f"{prefix}_tp", tp, tps, known=TP_SIZES)
    else:
        cols[2].markdown(f"GPUs per replica (TP): **{tp}** (the only size the weights fit)")
    if policy:
        cache_policy = url_widget(cols[3].selectbox, "Prefix-cache policy", f"{prefix}_cache_policy", cache_policy,
                                  list(CACHE_POLICIES), format_func=policy_title)
        budgets = [f"1/{round(1 / f)}" if f < 1 else "1" for f in BUDGET_OPTIONS]
        budget = url_widget(cols[4].select_slider, "Cache budget (share of HBM left after weights)", f"{prefix}_budget",
                            budgets[BUDGET_OPTIONS.index(budget_fraction)], budgets)
        budget_fraction = BUDGET_OPTIONS[budgets.index(budget)]
    return model, gpu, tp, cache_policy, budget_fraction
