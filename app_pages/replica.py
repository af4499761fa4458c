"""The model / GPU / TP (and prefix-cache policy, budget) widgets of a real-scale replica, the GPU and TP
constrained by the model (pages 11-15): ``replica_params(prefix)`` for the page's ``declare(...)``,
``real_replica(links)`` to draw them."""
from __future__ import annotations

import streamlit as st

from app_pages.links import PageLinks
from app_pages.params import Choice, Param
from lab.fleet import fitting_tps
from lab.fleet_simulation import BUDGET_OPTIONS, CACHE_POLICIES, HARDWARE, MODELS, REAL_DEFAULTS, TP_SIZES, RealReplica
from lab.real_scale import policy_title, preset_title

BUDGETS = [f"1/{round(1 / f)}" if f < 1 else "1" for f in BUDGET_OPTIONS]   # the budget's labels: 1/8 ... 1


def replica_params(prefix: str, *, policy: bool = True, model_key: str | None = None) -> tuple[Param, ...]:
    """The replica's parameters on page ``prefix`` (``"p11"``), at :data:`lab.fleet_simulation.REAL_DEFAULTS`:
    ``{prefix}_model`` (or ``model_key``), ``{prefix}_gpu`` and ``{prefix}_tp`` (every GPU and TP size; the widgets
    offer those the model fits in), and with ``policy`` ``{prefix}_cache_policy`` and ``{prefix}_budget``."""
    d = REAL_DEFAULTS
    params = (Choice(model_key or f"{prefix}_model", d["model"], MODELS, format_func=preset_title),
              Choice(f"{prefix}_gpu", d["gpu"], HARDWARE),
              Choice(f"{prefix}_tp", d["tp"], TP_SIZES))
    if not policy:
        return params
    return (*params, Choice(f"{prefix}_cache_policy", d["cache_policy"], CACHE_POLICIES, format_func=policy_title),
            Choice(f"{prefix}_budget", BUDGETS[BUDGET_OPTIONS.index(d["budget_fraction"])], BUDGETS))


def real_replica(links: PageLinks, where=None, *, policy: bool = True, model_key: str | None = None) -> RealReplica:
    """The widgets of :func:`replica_params` (the same ``policy`` and ``model_key``) in one row of ``where`` (a
    container; default the page): model, GPU and TP, offering only the GPUs and TP sizes the model's weights fit in
    (:func:`lab.fleet.fitting_tps`), and with ``policy`` the prefix-cache policy and the cache budget (share of the
    HBM the weights leave). Returns the :class:`~lab.fleet_simulation.RealReplica` (model, gpu, tp, cache_policy,
    budget_fraction); without ``policy`` the last two are :data:`lab.fleet_simulation.REAL_DEFAULTS`'."""
    p = links.prefix
    cols = (where or st).columns(5 if policy else 3)
    model = links.selectbox(cols[0], "Model", model_key or p + "model")
    gpu = links.selectbox(cols[1], "GPU", p + "gpu", options=[g for g in HARDWARE if fitting_tps(model, g)])
    tps = list(fitting_tps(model, gpu))
    if len(tps) > 1:
        tp = links.select_slider(cols[2], "GPUs per replica (TP)", p + "tp", options=tps)
    else:
        tp = tps[0]
        cols[2].markdown(f"GPUs per replica (TP): **{tp}** (the only size the weights fit)")
    if not policy:
        return RealReplica(model, gpu, tp, REAL_DEFAULTS["cache_policy"], REAL_DEFAULTS["budget_fraction"])
    cache_policy = links.selectbox(cols[3], "Prefix-cache policy", p + "cache_policy")
    budget = links.select_slider(cols[4], "Cache budget (share of HBM left after weights)", p + "budget")
    return RealReplica(model, gpu, tp, cache_policy, BUDGET_OPTIONS[BUDGETS.index(budget)])
