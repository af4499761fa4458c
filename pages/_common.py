"""Shared UI helpers for the pages (not a page: app.py does not list it).

- ``show_chart(fig, df, key)``: a Plotly chart with a stable key plus a CSV download of its data.
- ``engine_call(fn, *args, **kwargs)``: run an engine call; on a ValueError/RuntimeError show
  ``st.error`` with the message and stop the page (never a stack trace in the UI).
- ``built_by_loaded_code(obj)``: the ``validate=`` of ``st.cache_resource`` for cached models: False
  once a source reload replaced the object's class, so Streamlit rebuilds it.
- ``url_widget(make, label, key, default, *args, **kwargs)``: an input widget bound to the URL and kept
  across page switches (Streamlit 1.67 ``bind="query-params"``, ``persist_state="session"``), its default,
  options and bounds stated once; built on ``persist(key, default, options=..., min_value=..., max_value=...)``,
  which checks a stored or linked value against them and falls back to the default with a notice. A widget
  with ``format_func`` shows (and puts in the URL) the formatted label; its options and ``default`` stay the
  code names.
- ``show_table(df, columns)``: ``st.dataframe`` of the named columns, each with its header and number
  format; booleans read yes / no. ``num(label, fmt)`` and ``pct(label)`` build the number columns.
- ``real_replica(prefix, where)``: the model / GPU / TP (and prefix-cache policy, budget) widgets of a
  real-scale replica, the GPU and TP constrained by the model.
- ``upload_parts(upload)``: ``(bytes, file name)`` of an ``st.file_uploader`` value, hashable for ``st.cache_data``.

- ``route_through_navigation()``: per run, send a run that Streamlit started in its legacy
  ``pages/`` mode back through ``app.py``'s ``st.navigation`` (``persist`` and ``engine_call`` call
  it, so every page does; importing this module has no side effect).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
import streamlit as st

from serve.errors import UserFacingErrors
from serve.process_memory import limit_malloc_arenas, release_freed_memory

if TYPE_CHECKING:      # annotations only: a page that builds no frame (Home's first run) does not import pandas
    import pandas as pd

PERSISTED_KEYS = "_persisted_widget_keys"  # every key handed out by persist(), for the tests
CHECKED_LINKS = "_checked_link_values"     # (key, URL values) already checked in this session
LAST_SHOWN = "__last_shown"                # suffix: a dependent slider's value when it was last on the page
_THIS_FILE = Path(__file__).resolve()
limit_malloc_arenas(2)   # every script run is a new thread of the shared server: few arenas, reused


def _legacy_run() -> bool:
    """True when Streamlit's legacy ``pages/`` navigation started this run (checked per run).

    Streamlit 1.67 decides at the start of each run: while the class flag
    ``PagesManager.uses_pages_directory`` is set (a fresh server with a ``pages/`` folder, until any
    session calls ``st.navigation``), it runs ``_mpa_v1`` instead of ``app.py``, which registers
    every ``pages/*.py`` file as a page (this module included) and runs the deep-linked file
    directly. The flag is global, so another session clearing it says nothing about this run; the
    pages registered in this run do: ``app.py``'s navigation never lists this module.
    """
    from streamlit.runtime.scriptrunner_utils.script_run_context import get_script_run_ctx

    ctx = get_script_run_ctx()
    if ctx is None:                      # bare mode (python -c, tests without a runner)
        return False
    return any(info.get("script_path") and Path(info["script_path"]).resolve() == _THIS_FILE
               for info in ctx.pages_manager.get_pages().values())


def route_through_navigation() -> None:
    """Rerun a legacy-mode run through ``app.py`` (``st.navigation``); a no-op in a routed run.

    Called on every run by every page (through ``persist`` and ``engine_call``) and by the
    ``__main__`` blocks of ``_common.py`` and ``_registry.py`` (legacy mode lists them as pages too),
    never at import time: an ``st.rerun()`` raised while
    a module is being imported leaves a half-initialised module to sessions importing it at the same
    moment. Clears the class flag first so the rerun executes ``app.py``; the rerun keeps the page
    hash (the URL path), so a deep link lands on its page with the sectioned navigation.
    """
    from streamlit.runtime.pages_manager import PagesManager

    if _legacy_run():
        PagesManager.uses_pages_directory = False
        st.rerun()


def built_by_loaded_code(obj: object) -> bool:
    """True if ``obj``'s class is still the one its module defines (looked up in ``sys.modules`` now).

    For ``st.cache_resource(validate=...)`` on the pages' models: when a source file changes, Streamlit
    evicts and re-imports every project module, but a cached model keeps running the old modules and
    returns caches of the old ``KDACache`` class, which the new code's ``isinstance`` checks reject
    (``AttributeError: 'KDACache' object has no attribute 'shape'``). False makes Streamlit rebuild it."""
    cls = type(obj)
    return getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls


def _invalid(value, default, options, min_value, max_value) -> str | None:
    """Why ``value`` cannot be the widget's value (None if it can): the type of ``default`` (a list:
    a multiselect), membership in ``options`` (same type too: ``True`` is not the option ``1``) and
    ``[min_value, max_value]``; a tuple default is a range: two ends, each checked like a single value."""
    if isinstance(default, tuple):
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            return f"a {type(value).__name__}, not a range of two values"
        whys = [_invalid(v, default[0], options, min_value, max_value) for v in value]
        return next((w for w in whys if w is not None), None)
    if isinstance(default, list):
        if not isinstance(value, list):
            return f"a {type(value).__name__}, not a list"
        if options is not None and any(v not in options for v in value):
            return "not a subset of the options"
        return None
    if default is not None and type(value) is not type(default):
        return f"a {type(value).__name__}, not a {type(default).__name__}"
    if options is not None and not any(type(o) is type(value) and o == value for o in options):
        return "not one of the options"
    if isinstance(value, float) and value != value:
        return "NaN"
    if (min_value is not None and value < min_value) or (max_value is not None and value > max_value):
        return f"outside [{min_value}, {max_value}]"
    return None


LINK_SHOWN_CHARS = 60   # a link value longer than this is cut in its notice (a 25,000-digit number, a long prompt)


def _url_value_problem(raw, default, options, min_value, max_value, format_func=None, max_chars=None) -> str | None:
    """Why the URL value ``raw`` (a string, or a list of strings for a multiselect or a range) cannot be
    the widget's value, or None. Strings are read as the type of ``default`` (bool: true / false; a number must
    be finite: ``nan`` and ``inf`` are not values of a slider); a range (tuple ``default``) needs exactly two
    values; a text longer than ``max_chars`` is not taken (Streamlit would cut it silently). With a
    ``format_func`` the URL carries the option's label (as Streamlit writes it), not the option itself."""
    if format_func is not None and options is not None:
        options = [format_func(o) for o in options]
    def cast(text):
        if isinstance(default, bool):
            if str(text).lower() not in ("true", "false"):
                raise ValueError
            return str(text).lower() == "true"
        if isinstance(default, (int, float)) and options is None:
            try:
                value = type(default)(text)
            except ValueError:
                if str(text).strip().lstrip("+-").isdigit():    # over Python's 4,300-digit int() limit
                    raise ValueError(f"outside [{min_value}, {max_value}]") from None
                raise ValueError("not an integer" if isinstance(default, int) else "not a number") from None
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError("not a finite number")
            return value
        if options is not None:
            match = [o for o in options if str(o) == str(text)]
            if not match:
                raise ValueError
            return match[0]
        return text
    if isinstance(default, tuple):           # a range: two ends, each read as the type of the range's ends
        values = raw if isinstance(raw, list) else [raw]
        if len(values) != 2:
            return f"{len(values)} value{'' if len(values) == 1 else 's'}, not a range of two (give it twice)"
        default = default[0]
    if max_chars is not None and isinstance(raw, str) and len(raw) > max_chars:
        return f"{len(raw):,} characters, over the {max_chars:,}-character limit"
    if isinstance(default, list) and raw in ([], [""], ""):
        return "an empty selection"
    try:
        values = [cast(v) for v in (raw if isinstance(raw, list) else [raw])]
    except (TypeError, ValueError, OverflowError) as exc:
        return str(exc) if str(exc).startswith(("not ", "outside ")) else "not a value this widget takes"
    if options is None and any((min_value is not None and v < min_value) or (max_value is not None and v > max_value)
                               for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)):
        return f"outside [{min_value}, {max_value}]"
    return None


def _drop_link_value(key: str) -> None:
    """Remove ``key`` from this session's URL before a widget reads it, so the widget keeps its default.

    Streamlit 1.67 seeds a bound widget from the URL values of the page load (``_initial_query_params``) and
    from the current ones; it parses them itself and applies what it can (``?p00_new=1.5`` becomes 1, the last
    of a repeated value wins, an empty multiselect value clears the selection) or raises from its deserializer
    (``int(float('inf'))`` in ``number_input``: a stack trace). A value :func:`persist` reports as ignored is
    therefore removed from both before the widget is built (the browser's address bar loses it too)."""
    from streamlit.runtime.scriptrunner_utils.script_run_context import get_script_run_ctx

    ctx = get_script_run_ctx()
    if ctx is None:                      # bare mode: no URL
        return
    with ctx.session_state.query_params() as qp:
        qp.remove_param(key)
        qp._initial_query_params.pop(key, None)   # Streamlit has no public call for the page load's values


def _shown_link_value(raw: list[str]) -> str:
    """A link's values as a notice shows them: joined by commas, cut to :data:`LINK_SHOWN_CHARS` characters."""
    text = ", ".join(raw)
    return text if len(text) <= LINK_SHOWN_CHARS else f"{text[:LINK_SHOWN_CHARS]}… ({len(text):,} characters)"


def persist(key: str, default=None, *, options=None, min_value=None, max_value=None, format_func=None,
            max_chars=None) -> str:
    """A widget key starting at ``default``; use as ``key=persist(...), persist_state="session"``.

    The stored session value is checked on every run against the widget's constraints: the type of
    ``default``, ``options`` (selectbox / select_slider / multiselect) and ``min_value`` /
    ``max_value`` (slider / number_input). A None, wrongly typed or invalid value (e.g. from a
    session written by another version of the page) falls back to ``default`` (or, when it is None,
    to the widget's own first option) with a toast saying so. A widget bound to the URL
    (``bind="query-params"``) whose query parameter is malformed (``nan``, ``inf``, ``1.5`` for an integer, one
    end of a range, an empty multiselect), out of range, longer than ``max_chars`` (a text widget's limit) or given
    twice for a one-value widget keeps its value, and a toast says the link's value was ignored: the value is
    removed from the URL before the widget is built (:func:`_drop_link_value`), so Streamlit never parses it. A
    link's value is checked once per session: when another widget later lowers this one's bound, the old link
    value is not reported after the fact. Pass the widget's
    ``format_func`` too: the URL then carries the option's label, and only a label is a valid link value.

    A widget bound to the URL also takes ``default`` as its own ``value=`` / ``index=`` / ``default=``:
    Streamlit drops a URL value equal to the widget's declared default, which without it would be the
    minimum or first option (``.streamlit/config.toml`` silences the resulting duplicate-default
    warning). Returns key."""
    route_through_navigation()
    state = st.session_state
    state.setdefault(PERSISTED_KEYS, set()).add(key)
    raw = st.query_params.get_all(key) if key in st.query_params else []
    checked = state.setdefault(CHECKED_LINKS, set())
    if raw and (key, tuple(raw)) not in checked:   # once per value: a bound lowered later by another widget
        checked.add((key, tuple(raw)))             # makes no old link value "bad" after the fact
        many = len(raw) > 1 and not isinstance(default, (list, tuple))
        why = f"given {len(raw)} times" if many else _url_value_problem(
            raw if len(raw) > 1 or isinstance(default, (list, tuple)) else raw[0], default, options, min_value,
            max_value, format_func, max_chars)
        if why is not None:
            _drop_link_value(key)                  # the widget must not take what the notice says was ignored
            st.toast(f"The link's {key}={_shown_link_value(raw)} is {why}; it was ignored.", icon=":material/link_off:")
    if key in state:
        why = _invalid(state[key], default, options, min_value, max_value)
        if why is not None:
            st.toast(f"{key}: the stored value {state[key]!r} is {why}; using the default {default!r} instead.",
                     icon=":material/restart_alt:")
            del state[key]
    if key not in state and default is not None:
        state[key] = default
    return key


def persist_within(key: str, default, options: list, known) -> str:
    """:func:`persist` for a widget whose ``options`` depend on another widget (the GPUs a model fits on, the TP
    sizes that fit): a stored value among ``known`` (every value the widget can ever offer) but not among the
    current ``options`` moves to ``default`` without a notice (the other widget changed; dependent widgets
    constrain each other); a None, wrongly typed or unknown value is handled as :func:`persist` does. Returns key."""
    stored = st.session_state.get(key)
    if any(stored == k and type(stored) is type(k) for k in known) and stored not in options:
        st.session_state[key] = default
    return persist(key, default, options=options)


OPTION_WIDGETS = ("selectbox", "radio", "select_slider", "multiselect")


def url_widget(make, label: str, key: str, default, *args, known=None, clamp: bool | int = False, **kwargs):
    """Call the input widget ``make`` (``st.slider``, ``cols[1].selectbox``, ...) bound to the URL and kept across
    page switches, starting at ``default``; returns its value. The default, options and bounds are stated once, for
    the widget and for :func:`persist` alike: ``args`` are the widget's own positional arguments after the label
    (min and max of a slider / number_input, the options of a selectbox / radio / select_slider / multiselect).
    ``clamp``: the value's upper bound depends on another widget (:func:`persist_clamped`): True for the slider's max,
    or that bound; ``known``: the options do (every value they can ever hold, :func:`persist_within`). Other
    ``kwargs`` go to the widget."""
    kind = make.__name__
    if kind in ("slider", "number_input"):
        lo, hi = args[0], (args[1] if clamp is True or clamp is False else clamp)
        key = persist_clamped(key, default, lo, hi) if clamp is not False else persist(key, default, min_value=lo,
                                                                                       max_value=hi)
        start = {"value": min(default, hi)}
    elif kind in OPTION_WIDGETS:
        options = list(args[0])
        key = (persist_within(key, default, options, known) if known is not None else
               persist(key, default, options=options, format_func=kwargs.get("format_func")))
        start = ({"index": options.index(default)} if kind in ("selectbox", "radio") else
                 {"default" if kind == "multiselect" else "value": default})
    else:                                           # checkbox, toggle, text_input, text_area
        key, start = persist(key, default, max_chars=kwargs.get("max_chars")), {"value": default}
    value = make(label, *args, key=key, bind="query-params", persist_state="session", **start, **kwargs)
    if clamp is not False:
        st.session_state[key + LAST_SHOWN] = value
    return value


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
        RealReplica,
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
    return RealReplica(model, gpu, tp, cache_policy, budget_fraction)


def persist_clamped(key: str, default: int, lo: int, hi: int) -> str:
    """:func:`persist` for a slider whose upper bound ``hi`` depends on another widget: the value the widget showed
    last run, now above ``hi``, is lowered to ``hi`` silently (the other widget lowered the bound: dependent
    widgets constrain each other instead of failing); any other stored value outside [lo, hi] (one the widget
    never showed: a session written by another version of the page, or by code) falls back to ``default`` with
    :func:`persist`'s notice, and a link's value outside [lo, hi] is ignored with its notice. Returns key."""
    state = st.session_state
    shown = state.get(key + LAST_SHOWN)
    stored = state.get(key, shown)           # hidden last run: Streamlit restores the value it showed then
    if type(stored) is type(default) and type(shown) is type(default) and stored == shown > hi:
        state[key] = hi                      # the value the widget showed; the other widget lowered the bound: follow
    return persist(key, min(default, hi), min_value=lo, max_value=hi)   # any other value above hi: noticed


def _log_data_range(fig: go.Figure, axis) -> tuple[float, float] | None:
    """(min, max) of the positive finite data plotted on ``axis`` (a layout xaxis/yaxis), or None."""
    letter = axis.plotly_name[0]                          # "x" or "y"
    ref = letter + axis.plotly_name[5:]                   # "xaxis2" -> "x2"
    values = []
    for trace in fig.data:
        if (getattr(trace, f"{letter}axis", None) or letter) != ref:
            continue
        data = getattr(trace, letter, None)
        if data is None:
            continue
        try:
            arr = np.asarray(data, dtype=float).ravel()
        except (TypeError, ValueError):
            continue
        values.append(arr[np.isfinite(arr) & (arr > 0)])
    values = np.concatenate(values) if values else np.empty(0)
    return (float(values.min()), float(values.max())) if values.size else None


def _decade_ticks(axis, data_range: tuple[float, float] | None = None) -> None:
    """Readable labels on a log axis without explicit ticks (Plotly's default minor labels read as a
    bare "2" or "5", which can mean 2,000 or 20,000). Over ``data_range`` (min, max > 0) spanning
    <= 1 decade: ticks at 1, 1.5, 2, 3, 5, 7 x 10^k; <= 3 decades: 1-2-5 x 10^k; wider (or unknown):
    the powers of ten only. Every tick is labelled with its full value."""
    if axis.type != "log" or axis.dtick is not None or axis.tickvals is not None:
        return
    if data_range is not None and data_range[0] > 0 and data_range[1] >= data_range[0]:
        lo, hi = np.log10(data_range[0]), np.log10(data_range[1])
        mantissas = (1, 1.5, 2, 3, 5, 7) if hi - lo <= 1 else (1, 2, 5) if hi - lo <= 3 else None
        if mantissas is not None:
            ticks = [m * 10.0 ** e for e in range(int(np.floor(lo)) - 1, int(np.ceil(hi)) + 1) for m in mantissas]
            below = [t for t in ticks if t <= data_range[0]]
            above = [t for t in ticks if t >= data_range[1]]
            first, last = (below[-1] if below else ticks[0]), (above[0] if above else ticks[-1])
            axis.update(tickvals=[t for t in ticks if first <= t <= last])   # labelled ticks are the grid
            return
    axis.update(dtick=1, minor=dict(ticks="inside", showgrid=True, gridcolor="rgba(0, 0, 0, 0.035)"))  # faint: many decades


def _label_lines_on_log_axes(fig: go.Figure) -> None:
    """Move the label of an ``add_hline`` / ``add_vline`` reference line on a log axis onto its line. Plotly 7
    writes the label at the line's data value, but an annotation on a log axis is placed in log10 units, so the
    label of a 1e-5 line lands at 10^(1e-5) and a break-even at 5,384 tokens far off the plot. Only an
    annotation with a reference line (a shape) at its value on the same axis is moved."""
    lines = {(ref, v0) for sh in fig.layout.shapes or () if sh.type == "line"
             for ref, v0, v1 in ((sh.yref, sh.y0, sh.y1), (sh.xref, sh.x0, sh.x1)) if v0 == v1 and v0 is not None}
    for ann in fig.layout.annotations or ():
        for letter in ("x", "y"):
            ref, value = getattr(ann, f"{letter}ref"), getattr(ann, letter)
            if not ref or "domain" in ref or ref == "paper" or value is None or (ref, value) not in lines:
                continue
            axis = fig.layout[f"{letter}axis{ref[1:]}"]
            if axis.type == "log" and value > 0:
                ann.update({letter: float(np.log10(value))})


def _csv_bytes(data: pd.DataFrame | list[dict]) -> bytes:
    """CSV of a frame (no index) or of a list of row dicts (header = the first row's keys), UTF-8."""
    if not isinstance(data, list):
        return data.to_csv(index=False).encode()
    import csv
    import io
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(data[0]) if data else [], lineterminator="\n")
    writer.writeheader()
    writer.writerows(data)
    return out.getvalue().encode()


def show_chart(fig: go.Figure, df: pd.DataFrame | list[dict], key: str, filename: str | None = None) -> None:
    """Render ``fig`` with ``key`` and a CSV download button of ``df`` (the chart's data: a frame, or a list of
    row dicts where a page builds no frame, e.g. Home, whose first run on a fresh server imports no pandas).
    Log axes get enough labelled ticks to read the data range (:func:`_decade_ticks`), and their reference
    lines' labels sit on the lines (:func:`_label_lines_on_log_axes`)."""
    fig.update_layout(margin=dict(l=10, r=10, t=40, b=10))
    _label_lines_on_log_axes(fig)
    fig.for_each_xaxis(lambda ax: _decade_ticks(ax, _log_data_range(fig, ax)))
    fig.for_each_yaxis(lambda ax: _decade_ticks(ax, _log_data_range(fig, ax)))
    st.plotly_chart(fig, key=key, width="stretch")
    st.download_button("Download CSV", _csv_bytes(df), file_name=filename or f"{key}.csv",
                       mime="text/csv", key=f"{key}_csv")


def show_forward_fit(fit, key: str) -> None:
    """Home's and page 08's chart of :class:`lab.forward_cost.ForwardFit`: TTFT against prefill tokens, the
    measured points fitted (median, IQR bars), the fitted line ``a + b·n``, the held-out cold run, and the warm
    run measured beside its two predictions; then one caption with the fixed cost and the errors."""
    rows = fit.points()
    top = max(r["prefill_tokens"] for r in rows)
    style = {"measured, used in the fit": ("circle", "#1f77b4"), "measured, held out: cold run": ("square", "#d62728"),
             "measured: warm run": ("circle", "#2ca02c"), "predicted: warm, a + b·n + copies": ("diamond-open", "#2ca02c"),
             "predicted: warm, without a": ("x-open", "#6b7280")}
    fig = go.Figure(go.Scatter(x=[0, top], y=[fit.fixed_ms, fit.fixed_ms + fit.per_token_ms * top], mode="lines",
                               line=dict(dash="dash", color="#1f77b4"),
                               name=f"fitted: {fit.fixed_ms:.1f} ms + {fit.per_token_ms:.3f} ms/token × n"))
    for role, (symbol, colour) in style.items():
        pts = [r for r in rows if r["role"] == role]
        bars = dict(type="data", symmetric=False, array=[r["q3_ms"] - r["ttft_ms"] for r in pts],
                    arrayminus=[r["ttft_ms"] - r["q1_ms"] for r in pts]) if role.endswith("in the fit") else None
        fig.add_trace(go.Scatter(x=[r["prefill_tokens"] for r in pts], y=[r["ttft_ms"] for r in pts], mode="markers",
                                 name=role, error_y=bars, marker=dict(symbol=symbol, size=11, color=colour)))
    fig.update_layout(xaxis_title="prefill tokens computed n (tokens)", yaxis_title="TTFT (ms; median, bars = IQR)",
                      xaxis_range=[0, top * 1.05], yaxis_rangemode="tozero", legend=dict(orientation="h", y=-0.3),
                      height=360)
    show_chart(fig, rows, key=key)
    r2 = f"; R² {fit.r2:.2f}" if len(fit.fit_tokens) > 2 else ""       # a line through two points has R² = 1
    st.caption(f"**Fixed cost per forward a = {fit.fixed_ms:.1f} ms** (fitted) + b = {fit.per_token_ms:.3f} ms per "
               f"prefill token (fitted at n = {', '.join(map(str, fit.fit_tokens))}{r2}). Held out, not in "
               f"the fit: the cold run, {fit.prompt_tokens} tokens, measured {fit.held_out_measured_ms:.1f} ms, fit "
               f"{fit.held_out_predicted_ms:.1f} ms ({fit.held_out_error:+.0%}).")
    st.caption(f"Warm, {fit.warm_prefill_tokens} tokens prefilled: measured {fit.warm_measured_ms:.1f} ms; predicted "
               f"a + b·(L − hit) + copies = {fit.warm_predicted_ms:.1f} ms ({fit.warm_error:+.0%}); without a, "
               f"cold·(L − hit)/L + copies = {fit.proportional_ms:.1f} ms ({fit.proportional_error:+.0%}). The fixed "
               f"cost is {fit.fixed_share:.0%} of the measured warm TTFT.")
    with st.expander("How the forward cost is fitted"):
        st.markdown(
            "- **Measured**: cache-off TTFT of the first n tokens of the same prompt at each fitted n, the cold run "
            "(all L tokens) and the warm run, in the same interleaved rounds on fresh engines.\n"
            "- **Fitted**: a + b·n by least squares over the medians at the fitted n (never L).\n"
            "- **Held out**: the cold run is not in the fit; the fit's error there is how far to trust it.\n"
            f"- **Predicted**: warm = a + b·(L − hit) + the warm run's restore and checkpoint copies "
            f"({fit.warm_copies_ms:.2f} ms, measured). Without the fixed cost a, skipping most prefill tokens would "
            "cut TTFT in proportion; it does not.")


def num(label: str, fmt: str = "localized", **kwargs):
    """A right-aligned number column headed ``label`` (with its unit): ``fmt`` is a printf format (``"%.1f ms"``,
    ``"%,d B"``) or a Streamlit preset (``"localized"``: thousands separators, the default)."""
    return st.column_config.NumberColumn(label, format=fmt, **kwargs)


def pct(label: str, decimals: int = 1, **kwargs):
    """A number column headed ``label`` showing a fraction (0.1234) as a percentage with ``decimals`` decimals
    (12.3%) in :func:`show_table`, which scales it by 100 for display (Streamlit's ``"percent"`` preset drops
    trailing zeros, so a column would mix 6.5% and 7.97%)."""
    return st.column_config.NumberColumn(label, format=f"%.{decimals}f%%", **kwargs)


def show_table(df: pd.DataFrame, columns: dict, **kwargs) -> None:
    """``st.dataframe`` of ``df``'s columns named in ``columns``, in that order, without the index. Each value is the
    column's header (a string) or a ``st.column_config`` column (:func:`num`, :func:`pct`: its fractions are
    shown ×100); booleans read "yes" / "no". Only the display changes: ``df`` and any CSV of it keep the raw,
    machine-readable frame."""
    from pandas.api.types import is_bool_dtype  # here, not at import: Home's first run builds no frame
    shown = df[list(columns)].copy()
    for col, cfg in columns.items():
        if is_bool_dtype(shown[col]):
            shown[col] = shown[col].map({True: "yes", False: "no"})
        elif isinstance(cfg, dict) and str(cfg.get("type_config", {}).get("format", "")).endswith("%%"):
            shown[col] = shown[col] * 100
    st.dataframe(shown, hide_index=True, width="stretch", column_config=columns, **kwargs)


def engine_call(fn, *args, **kwargs):
    """Call ``fn``; show the error text with ``st.error`` and stop the page on bad input."""
    route_through_navigation()
    try:
        return fn(*args, **kwargs)
    except UserFacingErrors as exc:
        st.error(f"{type(exc).__name__}: {exc}")
        st.stop()
    finally:
        release_freed_memory()   # the call's temporaries back to the OS: the server is long-lived and shared


def upload_parts(upload) -> tuple[bytes | None, str]:
    """``(content bytes, file name)`` of an uploaded file (anything with ``getvalue()`` and ``name``,
    e.g. a Streamlit ``UploadedFile``), or ``(None, "")`` without one. An empty file gives ``b""``,
    not None, so the loaders can report it instead of silently falling back to a default trace."""
    if upload is None:
        return None, ""
    return upload.getvalue(), str(getattr(upload, "name", "") or "uploaded file")



def remeasure_button(cached_fn, key: str, label: str = "Re-measure") -> None:
    """A button that clears ``cached_fn``'s ``st.cache_data`` entries (only this page's measurement: cached
    measurements are shared by every visitor), so the run the click starts measures afresh. The clear runs
    as the button's ``on_click`` callback, before that run's script: a click is never lost to a rerun."""
    st.button(label, key=key, on_click=cached_fn.clear,
              help="Cached measurements are shared by all visitors; this clears this page's measurement only "
                   "and takes it again now.")


def run_on_request(flag: str, button_key: str, label: str, caption: str, where=None) -> None:
    """Heavy work behind a button: unless ``flag`` is on in this session, show ``caption`` and a primary button
    ``label`` in ``where`` (a container; default the page) and stop the page there. A click turns ``flag`` on for
    the session in the button's callback, before the run it starts: the click is never lost to a rerun."""
    if st.session_state.get(flag):
        return
    (where or st).caption(caption)
    (where or st).button(label, key=button_key, type="primary", on_click=st.session_state.update, kwargs={flag: True})
    st.stop()


def measured_stamp(conditions) -> None:
    """The stamp under a measured chart: when, repeats, torch threads, cores, load average
    (:meth:`lab.timing.Conditions.stamp`)."""
    st.caption(conditions.stamp())

if __name__ == "__main__":  # deep link to /common on a fresh server: Streamlit ran this file as a page
    route_through_navigation()
