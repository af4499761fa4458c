"""Charts, their CSV downloads, and tables.

- ``show_chart(fig, df, key)``: a Plotly chart with a stable key plus a CSV download of its data; log axes get
  labelled ticks between the powers of ten (the range spanning them) and their reference lines' labels on the
  lines; a horizontal legend below the plot sits under the x axis's labels; a line drawn over an earlier one of
  the same style is dashed and named as on it.
- ``inside_if_tall(values)``: a bar's label inside it when the bar is tall enough, above it when not.
- ``show_forward_fit(fit, key)``: Home's and page 08's fitted forward cost, measured vs fitted vs predicted.
- ``show_table(df, columns)``: ``st.dataframe`` of the named columns, each with its header and number
  format; booleans read yes / no. ``num(label, fmt)`` and ``pct(label)`` build the number columns. With
  ``wrap=True`` (a table whose sentences a grid would cut) a static ``st.table`` of the same, its text wrapped
  and shown as written (``literal``: Markdown signs escaped).
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
import streamlit as st

if TYPE_CHECKING:      # annotations only: a page that builds no frame (Home's first run) does not import pandas
    import pandas as pd


def _log_data_range(fig: go.Figure, axis) -> tuple[float, float] | None:
    """(min, max) of the positive finite data plotted on ``axis`` (a layout xaxis/yaxis) and of its reference lines
    (page 17's fp16 limit at 65,504 above data up to 5 left four decades unlabelled), or None."""
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
        bars = getattr(trace, f"error_{letter}", None)     # error bars' ends are plotted too
        if bars is not None and bars.visible is not False and bars.type == "data" and bars.array is not None:
            up = np.asarray(bars.array, dtype=float).ravel()
            down = np.asarray(bars.arrayminus if bars.arrayminus is not None and bars.symmetric is False
                              else bars.array, dtype=float).ravel()
            if up.shape == down.shape == arr.shape:
                ends = np.concatenate([arr + up, arr - down])
                values.append(ends[np.isfinite(ends) & (ends > 0)])
    for shape in fig.layout.shapes or ():     # a reference line (add_hline / add_vline) widens the axis too
        v0, v1 = getattr(shape, letter + "0"), getattr(shape, letter + "1")
        if getattr(shape, letter + "ref") == ref and v0 is not None and v0 == v1 and v0 > 0:
            values.append(np.array([float(v0)]))
    values = np.concatenate(values) if values else np.empty(0)
    return (float(values.min()), float(values.max())) if values.size else None


BYTE_UNIT = re.compile(r"\b(B|KiB|MiB|GiB|KB|MB|GB|TB)\b")   # an axis title in bytes: SI ticks would read "10k MiB"


def _decade_ticks(axis, data_range: tuple[float, float] | None = None) -> None:
    """Readable labels on a log axis without explicit ticks (Plotly's default minor labels read as a
    bare "2" or "5", which can mean 2,000 or 20,000). Over ``data_range`` (min, max > 0) spanning
    <= 1 decade: ticks at 1, 1.5, 2, 3, 5, 7 x 10^k; <= 3 decades: 1-2-5 x 10^k; <= 5 decades: 1-3 x 10^k (with
    the powers alone, data up to 4 x 10^k ran past the last label); wider (or unknown): the powers of ten only.
    Every tick is labelled with its full value (on an axis in bytes "10,000", never "10k"), and an axis without a set range spans the ticks from the last one at
    or below the data to the first one at or above it (page 16's box points above the last label, at the plot's
    edge), so every plotted point lies between two labels."""
    if axis.type != "log" or axis.dtick is not None or axis.tickvals is not None:
        return
    if data_range is not None and data_range[0] > 0 and data_range[1] >= data_range[0]:
        lo, hi = np.log10(data_range[0]), np.log10(data_range[1])
        mantissas = ((1, 1.5, 2, 3, 5, 7) if hi - lo <= 1 else (1, 2, 5) if hi - lo <= 3 else (1, 3) if hi - lo <= 5
                     else None)
        if mantissas is not None:
            ticks = [m * 10.0 ** e for e in range(int(np.floor(lo)) - 1, int(np.ceil(hi)) + 1) for m in mantissas]
            below = [t for t in ticks if t <= data_range[0]]
            above = [t for t in ticks if t >= data_range[1]]
            first, last = (below[-1] if below else ticks[0]), (above[0] if above else ticks[-1])
            axis.update(tickvals=[t for t in ticks if first <= t <= last])   # labelled ticks are the grid
            if axis.tickformat is None and axis.ticktext is None:
                if BYTE_UNIT.search(axis.title.text or ""):        # 10,000 MiB, not Plotly's SI "10k" (kMiB?)
                    axis.update(tickformat=",")
                elif first >= 1 and last >= 1e4:   # one style: Plotly writes 2000 in full and 10000 as "10k"
                    axis.update(tickformat="~s")
            if axis.range is None and axis.autorange in (None, True):
                pad = max(0.03 * (np.log10(last) - np.log10(first)), 0.05)   # log10 units: clear of the edges
                axis.update(range=[float(np.log10(first) - pad), float(np.log10(last) + pad)])
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


def _legend_below_the_labels(fig: go.Figure) -> None:
    """A horizontal legend placed below the plot (``legend=dict(orientation="h", y=-0.3)``) moved to the bottom of
    the figure, under the x axis's tick labels and title. ``y`` below the plot is a share of the plot's height, so
    long or rotated category labels (page 14's eleven policies) reached into the legend; at ``yref="container"``,
    ``y=0`` Plotly keeps a margin for the legend under everything else."""
    legend = fig.layout.legend
    if legend.orientation == "h" and legend.y is not None and legend.y < 0 and legend.yref in (None, "paper"):
        legend.update(yref="container", y=0, yanchor="bottom")
        # The legend's rows come out of the figure's height: page 14's 22 entries left a 100-px plot. Add a row's
        # height per row beyond the first, assuming a 900-px-wide chart, entries as wide as the longest name (Plotly
        # lines them up in columns) and ~6 px per character.
        names = [t.name for t in fig.data if t.showlegend is not False and t.name]
        if names:
            per_row = max(1, int(900 // (6 * max(map(len, names)) + 45)))
            rows = -(-len(names) // per_row)
            fig.layout.height = (fig.layout.height or 450) + 20 * (rows - 1)


def _line_points(trace, log: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """(x, y) of a scatter trace as arrays, y in log10 on a log axis; None when y is not numeric."""
    try:
        x, y = np.asarray(trace.x), np.asarray(trace.y, dtype=float)
    except (TypeError, ValueError):
        return None
    if log:
        y = np.log10(np.where(y > 0, y, np.nan))
    return (x, y) if x.shape == y.shape and x.size else None


def _show_coinciding_lines(fig: go.Figure) -> None:
    """A line drawn on an earlier one of the same style (page 15's policies with the same hit ratio at every
    budget) is hidden: at the same x, within 0.5 % of the chart's y span (log10 on a log axis), the later line is
    drawn dashed, narrower and with open markers, and its legend entry names the line it lies on. Lines already
    told apart by their dash are left as they are."""
    lines = [t for t in fig.data if t.type == "scatter" and "lines" in (t.mode or "lines") and t.x is not None]
    points = {}
    for t in lines:
        axis = fig.layout["yaxis" + (t.yaxis or "y")[1:]]
        points[id(t)] = _line_points(t, axis.type == "log")
    ys = [p[1][np.isfinite(p[1])] for p in points.values() if p is not None]
    ys = np.concatenate(ys) if ys else np.empty(0)
    tol = 0.005 * float(ys.max() - ys.min()) if ys.size else 0.0
    for i, later in enumerate(lines):
        b = points[id(later)]
        under = next((t for t in lines[:i] if (t.line.dash or "solid") == (later.line.dash or "solid")
                      and (t.xaxis, t.yaxis) == (later.xaxis, later.yaxis) and b is not None
                      and (a := points[id(t)]) is not None and a[0].shape == b[0].shape
                      and bool((a[0] == b[0]).all()) and bool(np.allclose(a[1], b[1], rtol=0, atol=tol,
                                                                         equal_nan=True))), None)
        if under is None:
            continue
        later.update(line=dict(dash="dash" if (under.line.dash or "solid") == "solid" else "solid",
                               width=max(1.0, 0.6 * (under.line.width or 2))),
                     name=f"{later.name} (on the {under.name} line)")
        if "markers" in (later.mode or ""):
            later.update(marker_symbol="circle-open", marker_size=10)


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
    lines' labels sit on the lines (:func:`_label_lines_on_log_axes`); a horizontal legend below the plot goes under
    the x axis's labels (:func:`_legend_below_the_labels`); a line hidden under an earlier one of the same style is
    drawn dashed (:func:`_show_coinciding_lines`)."""
    fig.update_layout(margin=dict(l=10, r=10, t=40, b=10))
    _legend_below_the_labels(fig)
    _show_coinciding_lines(fig)
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
    # The warm run and its two predictions share one n and lie a few ms apart: open markers of three sizes, the
    # largest drawn first, so each shows around the next (at one size the "without a" cross hid under the others).
    style = {"measured, used in the fit": ("circle", "#1f77b4", 11), "measured, held out: cold run": ("square", "#d62728", 11),
             "predicted: warm, a + b·n + copies": ("diamond-open", "#2ca02c", 18),
             "predicted: warm, without a": ("x-open", "#6b7280", 13), "measured: warm run": ("circle", "#2ca02c", 8)}
    fig = go.Figure(go.Scatter(x=[0, top], y=[fit.fixed_ms, fit.fixed_ms + fit.per_token_ms * top], mode="lines",
                               line=dict(dash="dash", color="#1f77b4"),
                               name=f"fitted: {fit.fixed_ms:.1f} ms + {fit.per_token_ms:.3f} ms/token × n"))
    for role, (symbol, colour, size) in style.items():
        pts = [r for r in rows if r["role"] == role]
        bars = dict(type="data", symmetric=False, array=[r["q3_ms"] - r["ttft_ms"] for r in pts],
                    arrayminus=[r["ttft_ms"] - r["q1_ms"] for r in pts]) if role.endswith("in the fit") else None
        fig.add_trace(go.Scatter(x=[r["prefill_tokens"] for r in pts], y=[r["ttft_ms"] for r in pts], mode="markers",
                                 name=role, error_y=bars, marker=dict(symbol=symbol, size=size, color=colour)))
    highest = max([fit.fixed_ms + fit.per_token_ms * top] + [r["ttft_ms"] for r in rows]
                  + [r["q3_ms"] for r in rows if r["q3_ms"] == r["q3_ms"]])     # NaN where no IQR
    fig.update_layout(xaxis_title="prefill tokens computed n (tokens)", yaxis_title="TTFT (ms; median, bars = IQR)",
                      xaxis_range=[0, top * 1.05],   # the cold run's square off the top edge, a < 0 above the bottom
                      yaxis_range=[min(0.0, fit.fixed_ms) * 1.1 - 0.02 * highest, highest * 1.1],
                      legend=dict(orientation="h", y=-0.3),
                      height=360)
    show_chart(fig, rows, key=key)
    sizes = ", ".join(map(str, fit.fit_tokens))
    how = (f"two-point estimate: the line through the medians at n = {sizes}, so no residual tests it" if fit.two_point
           else f"fitted at n = {sizes}; R² {fit.r2:.2f}, largest residual {fit.max_residual_ms:.1f} ms")
    check = (f"held-out error {fit.held_out_error:+.0%} ({fit.held_out_error_ms:+.1f} ms) on the cold run, "
             f"{fit.prompt_tokens} tokens")
    st.caption(f"**Fixed cost per forward a = {fit.fixed_ms:.1f} ms** ({'estimated' if fit.two_point else 'fitted'}) "
               f"+ b = {fit.per_token_ms:.3f} ms per prefill token ({how}). Held out, not in the fit: the cold run, "
               f"{fit.prompt_tokens} tokens, measured {fit.held_out_measured_ms:.1f} ms, line "
               f"{fit.held_out_predicted_ms:.1f} ms ({fit.held_out_error:+.0%}).")
    st.caption(f"Warm, {fit.warm_prefill_tokens} tokens prefilled: measured {fit.warm_measured_ms:.1f} ms; predicted "
               f"a + b·(L − hit) + copies = {fit.warm_predicted_ms:.1f} ms ({fit.warm_error:+.0%}); without a, "
               f"cold·(L − hit)/L + copies = {fit.proportional_ms:.1f} ms ({fit.proportional_error:+.0%}). By this "
               f"{'two-point estimate' if fit.two_point else 'fit'}, the fixed cost is {fit.fixed_share:.0%} of the "
               f"measured warm TTFT ({check}: trust a no closer than that).")
    with st.expander("How the forward cost is fitted"):
        st.markdown(
            "- **Measured**: cache-off TTFT of the first n tokens of the same prompt at each fitted n, the cold run "
            "(all L tokens) and the warm run, in the same interleaved rounds on fresh engines.\n"
            "- **Fitted**: a + b·n by least squares over the medians at the fitted n (never L); with two sizes "
            "that is the line through both, an estimate with no residual, checked only on the held-out point.\n"
            "- **Held out**: the cold run is not in the fit; the fit's error there is how far to trust it.\n"
            f"- **Predicted**: warm = a + b·(L − hit) + the warm run's restore and checkpoint copies "
            f"({fit.warm_copies_ms:.2f} ms, measured). Without the fixed cost a, skipping most prefill tokens would "
            "cut TTFT in proportion; it does not.")


def inside_if_tall(values, top: float | None = None, share: float = 0.12) -> list[str]:
    """A bar chart's per-bar ``textposition``: "inside" for a bar at least ``share`` of ``top`` (default: the largest
    value) tall, "outside" for a shorter one, whose label inside would be shrunk into a sliver."""
    values = [float(v) for v in values]
    top = max([v for v in values if v == v] + [0.0]) if top is None else float(top)
    return ["inside" if v == v and top > 0 and v >= share * top else "outside" for v in values]


def int_tick_step(max_value: int, max_ticks: int = 8) -> int:
    """The smallest 1-2-5 step (1, 2, 5, 10, 20, ...) that puts at most ``max_ticks`` integer ticks on an axis from 0
    to ``max_value`` (a count: rows, tokens, requests), so no tick reads a fraction or a negative count."""
    step = 1
    while max(int(max_value), 0) / step > max_ticks:
        step = step * 5 // 2 if str(step)[0] == "2" else step * 2
    return step


def num(label: str, fmt: str = "localized", **kwargs):
    """A right-aligned number column headed ``label`` (with its unit): ``fmt`` is a printf format (``"%.1f ms"``,
    ``"%,d B"``) or a Streamlit preset (``"localized"``: thousands separators, the default)."""
    return st.column_config.NumberColumn(label, format=fmt, **kwargs)


def pct(label: str, decimals: int = 1, **kwargs):
    """A number column headed ``label`` showing a fraction (0.1234) as a percentage with ``decimals`` decimals
    (12.3%) in :func:`show_table`, which scales it by 100 for display (Streamlit's ``"percent"`` preset drops
    trailing zeros, so a column would mix 6.5% and 7.97%)."""
    return st.column_config.NumberColumn(label, format=f"%.{decimals}f%%", **kwargs)


WRAP_CHARS = 60   # a text cell longer than this is cut in st.dataframe's grid at its default column width


def formatted(value, fmt: str) -> str:
    """``value`` as a :func:`num` column with printf format ``fmt`` shows it (``"%,.2f"``, ``"%d"``, ``"%.1f%%"``,
    ``"localized"``); ``""`` for NaN / None. A format without a ``%`` directive gives ``str(value)``."""
    if value is None or value != value:
        return ""
    if fmt == "localized":
        return f"{value:,}" if float(value).is_integer() else f"{value:,.2f}"

    def one(m: re.Match) -> str:
        comma, precision, kind = m.group(1), m.group(2) or "", m.group(3)
        number = round(value) if kind in "di" else value
        text = format(number, f"{comma}{precision}{'d' if kind in 'di' else kind}")
        return re.sub(r"e([+-])0(\d)", r"e\1\2", text)      # 5.2e-5, as the grid's printf writes it

    return re.sub(r"%(,?)(\.\d+)?([dife])", one, fmt).replace("%%", "%") if "%" in fmt else str(value)


MARKDOWN_SIGNS = re.compile(r"([\\`*_\[\]<>#+\-|~$!])")


def literal(text: str) -> str:
    """``text`` shown as written in a ``st.table`` cell, which renders Markdown: each Markdown sign backslash-escaped
    (a simulator variant "+ the engine's checkpoint placement" became a bullet point, its "+" lost)."""
    return MARKDOWN_SIGNS.sub(r"\\\1", text)


def show_table(df: pd.DataFrame, columns: dict, wrap: bool = False, **kwargs) -> None:
    """``st.dataframe`` of ``df``'s columns named in ``columns``, in that order, without the index. Each value is the
    column's header (a string) or a ``st.column_config`` column (:func:`num`, :func:`pct`: its fractions are
    shown ×100); booleans read "yes" / "no". Only the display changes: ``df`` and any CSV of it keep the raw,
    machine-readable frame. ``wrap=True``: a static ``st.table`` instead, numbers formatted as their columns say
    and long text wrapped in its cell (a grid cuts a sentence at its column's width; see :data:`WRAP_CHARS`)."""
    if wrap:
        shown = df[list(columns)].copy()
        for col, cfg in columns.items():
            fmt = cfg.get("type_config", {}).get("format") if isinstance(cfg, dict) else None
            if _is_bool(shown[col]):
                shown[col] = shown[col].map({True: "yes", False: "no"})
            elif fmt:
                scale = 100 if str(fmt).endswith("%%") else 1
                shown[col] = [formatted(v * scale if v == v else v, fmt) for v in shown[col]]
        shown = shown.map(lambda v: literal(v) if isinstance(v, str) else v)
        shown.columns = [literal(cfg["label"] if isinstance(cfg, dict) else cfg) for cfg in columns.values()]
        st.table(shown, hide_index=True, **kwargs)
        return
    shown = df[list(columns)].copy()
    for col, cfg in columns.items():
        if _is_bool(shown[col]):
            shown[col] = shown[col].map({True: "yes", False: "no"})
        elif isinstance(cfg, dict) and str(cfg.get("type_config", {}).get("format", "")).endswith("%%"):
            shown[col] = shown[col] * 100
    st.dataframe(shown, hide_index=True, width="stretch", column_config=columns, **kwargs)


def _is_bool(series) -> bool:
    """Whether ``series`` holds booleans (pandas imported here, not at import: Home's first run builds no frame)."""
    from pandas.api.types import is_bool_dtype
    return is_bool_dtype(series)
