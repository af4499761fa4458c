"""Nothing a visitor should read is cut off, hidden or out of place (each case was seen in a Chromium tour at 1400 px).

- Metric labels fit their column: a label longer than its share of a row is cut with an ellipsis ("Forced commits
  (ring write-backs / Re…"); the detail goes in ``help=``. Checked on every tab's source (:func:`metric_labels`).
- A sentence in a table is wrapped (``show_table(..., wrap=True)``, a static ``st.table``), not cut at a grid
  column's width ("What it means" on page 03).
- Counts read as words ("1 head", never "1 heads"); a one-rank run of page 10 is not called a speedup.
- Charts: page 04's two coinciding lines both visible, page 05's pool sizes above the panels rather than over the
  data, page 06's settings beside the section they drive and its gather chart more than two points, page 13's log
  axis labelled over the whole range of its boxes, and a short bar's label above the bar, not shrunk inside it.
"""
from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from app_pages.charts import WRAP_CHARS, inside_if_tall
from app_pages.registry import HOME, TABS
from tests.app.page_helpers import chart_spec, plotly_values

REPO = Path(__file__).resolve().parents[2]
ROW_CHARS = 144          # metric label characters one full-width row shows at 1400 px (36 in each of 4 columns)
PLACEHOLDER_CHARS = 6    # an f-string field counts as this many characters


def _label_chars(node: ast.expr) -> int | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return len(node.value)
    if isinstance(node, ast.JoinedStr):
        return sum(len(v.value) if isinstance(v, ast.Constant) else PLACEHOLDER_CHARS for v in node.values)
    return None


def _column_shares(call: ast.Call) -> list[float] | None:
    """The width shares of ``st.columns(4)`` / ``st.columns([1, 2])``; None when not literal."""
    spec = call.args[0] if call.args else None
    if isinstance(spec, ast.Constant) and isinstance(spec.value, int):
        return [1 / spec.value] * spec.value
    if isinstance(spec, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) for e in spec.elts):
        weights = [e.value for e in spec.elts]
        return [w / sum(weights) for w in weights]
    return None


def metric_labels(source: str) -> list[tuple[int, int, int]]:
    """(line, label characters, characters its column shows) of every ``X.metric(label, ...)`` with a literal or
    f-string label, where ``X`` is a column of a literal ``st.columns(...)`` (else the full row)."""
    tree = ast.parse(source)
    share = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "columns"
                and isinstance(node.targets[0], ast.Tuple) and (shares := _column_shares(node.value))):
            share |= {e.id: s for e, s in zip(node.targets[0].elts, shares) if isinstance(e, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "metric":
            label = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "label"), None)
            chars = _label_chars(label) if label is not None else None
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            if chars is not None:
                found.append((node.lineno, chars, int(ROW_CHARS * share.get(owner, 1.0))))
    return found


@pytest.mark.parametrize("tab", TABS, ids=[Path(t.path).stem for t in TABS])
def test_metric_labels_fit_their_columns(tab):
    """Was: "Forced commits (ring write-backs / ReplaySSM materialisations)" (02), "Fixed state per sequence
    (recurrent + bf16 conv)" (03), "block ideal (one shared infinite cache)" (11, 12), "Prefill scales α · β
    (fitted on H100 x TP8)" (15), each cut with an ellipsis."""
    too_long = [(line, chars, room) for line, chars, room in metric_labels((REPO / tab.path).read_text())
                if chars > room]
    assert not too_long, f"{tab.path}: (line, label chars, chars its column shows) {too_long}"


def test_metric_label_scan_sees_columns():
    src = f"a, b = st.columns([3, 1])\na.metric('{'x' * 100}', 1)\nb.metric(f'{{n}} ranks of the fleet', 1)\n"
    assert metric_labels(src) == [(2, 100, 108), (3, 25, 36)]


def _page(path: str, **params) -> AppTest:
    at = AppTest.from_file(str(REPO / path), default_timeout=120)
    at.query_params.update(params)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _texts(at: AppTest) -> str:
    parts = [m.value for m in at.markdown] + [c.value for c in at.caption] + [m.label for m in at.metric]
    return " ".join(parts + [str(m.proto.delta) for m in at.metric] + [w.value for w in at.warning])


def _in_page_order(node):
    yield node
    for key in sorted(getattr(node, "children", {}) or {}):
        yield from _in_page_order(node.children[key])


def test_p03_fit_table_wraps_and_counts_read_as_words():
    """Was: the fit table's "What it means" cut at the grid's width; "Measured now with 1 heads"; the MLA decode at
    1 and 4 heads only in different runs (3.5 vs 14.2 ms at different loads)."""
    at = _page("app_pages/03_kda_state_vs_kv.py", p03_meas_heads="1", p03_meas_max="1024")
    assert not [col for d in at.dataframe for col in d.value.columns
                if any(isinstance(v, str) and len(v) > WRAP_CHARS for v in d.value[col])], "a sentence in a grid"
    fits = next(t.value for t in at.table if "What it means" in t.value.columns)
    assert list(fits["Fitted line"]) == ["KDA", "MLA"] and fits["What it means"].str.len().gt(WRAP_CHARS).any()
    text = _texts(at)
    assert "1 head " in text and not re.search(r"\b1 heads\b", text), text
    heads = [int(h) for h in plotly_values(chart_spec(at, "p03_heads_chart")["data"][0]["x"])]
    assert heads == [1, 2, 4, 8, 16]
    assert any(m.label == "2 heads ÷ 1 head" for m in at.metric) and any(m.label == "16 heads ÷ 2 heads"
                                                                          for m in at.metric)
    at.query_params["p03_meas_heads"] = "3"
    at.run()
    assert [int(h) for h in plotly_values(chart_spec(at, "p03_heads_chart")["data"][0]["x"])] == [1, 2, 3, 4, 8, 16]
    assert any(m.label == "3 heads ÷ 1 head" for m in at.metric)


def test_p04_coinciding_lines_both_visible():
    """Was: projection replay's line hidden under ReplaySSM's (the same bytes at every n)."""
    at = _page("app_pages/04_raw_input_ring.py")
    traces = {t["name"]: (i, t) for i, t in enumerate(chart_spec(at, "p04_bytes_chart")["data"])}
    (i_replay, replay), (i_proj, proj) = traces["ReplaySSM"], traces["projection replay"]
    assert plotly_values(replay["y"]) == pytest.approx(plotly_values(proj["y"]), rel=0.02)   # they do coincide
    assert i_proj > i_replay and proj["line"]["dash"] == "dash" and proj["marker"]["symbol"] == "diamond-open"
    assert proj["line"]["width"] < replay["line"]["width"]


def test_p05_pool_sizes_named_above_the_panels():
    """Was: "static state pool size: 303 pages" written on the plot, under the plotted line ("grid" and "mix flips"
    too, over the filled area)."""
    at = _page("app_pages/05_page_pool.py")
    spec = chart_spec(at, "p05_util")
    notes = [a["text"] for a in spec["layout"]["annotations"]]
    assert len(notes) == 2 and all("(dashed: static" in t and t.endswith(" pages)") for t in notes), notes   # titles
    assert "the mix flips" in spec["layout"]["xaxis2"]["title"]["text"]        # the vertical lines named off the data


def test_p06_settings_beside_their_sections_and_gather_has_points():
    """Was: the settings of sections 3 and 4 above section 1's chart; the gather chart at two contexts."""
    at = _page("app_pages/06_mla_paging.py")
    order = []
    for node in _in_page_order(at._tree):
        proto_id = getattr(getattr(node, "proto", None), "id", "") or ""
        if node.type == "plotly_chart":
            order.append(proto_id.rsplit("-", 1)[-1])
        elif getattr(node, "key", None) in ("p06_max_ctx", "p06_requests"):
            order.append(node.key)
    assert [k for k in order if k.startswith("p06_")] == ["p06_table", "p06_frag", "p06_max_ctx", "p06_gather",
                                                          "p06_requests", "p06_sharing"], order
    contexts = {c for t in chart_spec(at, "p06_gather")["data"] for c in plotly_values(t["x"])}
    assert len(contexts) >= 4, contexts


def test_p13_log_axis_labelled_over_the_boxes():
    """Was: ticks at 0.1, 1, 10 s only while the boxes reached 30-60 s and 0.01 s."""
    at = _page("app_pages/13_fleet_budgets.py")
    spec = chart_spec(at, "p13_ttft_chart")
    fences = [v for t in spec["data"] for k in ("lowerfence", "upperfence") for v in plotly_values(t[k])]
    ticks = plotly_values(spec["layout"]["yaxis"]["tickvals"])
    assert min(ticks) <= min(fences) and max(ticks) >= max(fences), (ticks, fences)
    assert all(b / a <= 10 / 3 + 1e-9 for a, b in zip(ticks, ticks[1:])), ticks     # a label every half decade
    assert all(t.endswith(" s") for t in spec["layout"]["yaxis"]["ticktext"])


def test_p10_one_rank_is_not_a_speedup():
    """Was: at world size 1, "1 ranks are 0.30× as fast as the best one rank" under "Speedup vs best one rank"."""
    at = _page("app_pages/10_kcp.py", p10_world="1")
    text = _texts(at)
    assert not re.search(r"\b1 ranks\b", text), text
    assert not any(m.label.startswith("Speedup") for m in at.metric)
    assert any(m.label == "KCP path vs best one rank" for m in at.metric)


def test_wrapped_table_shows_text_as_written():
    """st.table renders Markdown: page 14's "+ the engine's checkpoint placement" showed as a bullet, "+" lost."""
    def script():
        import pandas as pd

        from app_pages.charts import num, show_table
        show_table(pd.DataFrame({"v": ["+ a step", "a_b < c"], "x": [1234.5, float("nan")]}),
                   {"v": "Variant", "x": num("Time (ms)", "%,.1f")}, wrap=True)

    at = AppTest.from_function(script).run()
    (table,) = at.table
    assert list(table.value.columns) == ["Variant", "Time (ms)"]
    assert table.value["Variant"].tolist() == ["\\+ a step", "a\\_b \\< c"]     # escaped: shown as written
    assert table.value["Time (ms)"].tolist() == ["1,234.5", ""]


def test_short_bars_label_above_not_inside():
    """Was: "1.8 %" shrunk into a sliver of a bar on page 14 (Plotly fits an inside label to its bar)."""
    assert inside_if_tall([30.0, 25.0, 1.8, float("nan")]) == ["inside", "inside", "outside", "outside"]
    assert inside_if_tall([0.02, 0.35], top=0.38) == ["outside", "inside"]
    assert inside_if_tall([0.0, 0.0]) == ["outside", "outside"]


# --- Rules every Plotly chart keeps: tests/app/test_pages.py applies figure_problems to every chart of every page
# --- after every run (defaults and each widget's extremes); the browser tour (bench.screens) checks the drawn ones.

def _axis_values(trace: dict, letter: str) -> list[float]:
    """The numbers ``trace`` plots along ``letter`` ("x" / "y"): points, box samples, a bar's end (not its category)
    and error bars' ends; [] for categories."""
    if trace.get("type", "scatter") not in ("scatter", "bar", "box") or trace.get("visible", True) is not True:
        return []
    if trace.get("type") == "bar" and letter == ("y" if trace.get("orientation") == "h" else "x"):
        return []
    try:
        values = np.asarray(plotly_values(trace.get(letter, [])), dtype=float)
    except (TypeError, ValueError):
        return []
    bars = trace.get(f"error_{letter}") or {}
    if bars.get("type") == "data" and bars.get("visible", True) and "array" in bars:
        up = np.asarray(plotly_values(bars["array"]), dtype=float)
        down = np.asarray(plotly_values(bars.get("arrayminus", bars["array"])), dtype=float) \
            if bars.get("symmetric") is False else up
        if up.shape == down.shape == values.shape:
            values = np.concatenate([values, values + up, values - down])
    return values[np.isfinite(values)].tolist()


def figure_problems(spec: dict) -> list[str]:
    """What a visitor could not see in the Plotly figure ``spec`` (data + layout, as Streamlit sends it):

    - a plotted point outside an axis's set range (a log axis's range is in log10 units), or, on a log axis, outside
      its labelled ticks (page 16's box points above the last label);
    - a horizontal legend below the plot placed at a share of the plot's height (``yref`` paper): long or rotated
      tick labels reach into it (page 14's eleven policies);
    - a legend placed inside the plot area (both ``x`` and ``y`` in 0..1), over the data;
    - two lines of the same style drawn on each other (page 15's policies with equal hit ratios), one hidden;
    - Plotly's SI ticks ("16k") on an axis in bytes past 10,000 (page 09's "16k" GB read as 16 kGB)."""
    layout, data, problems = spec.get("layout", {}), spec.get("data", []), []
    for name, axis in layout.items():
        if not re.fullmatch(r"[xy]axis\d*", name) or not isinstance(axis, dict):
            continue
        letter, ref = name[0], name[0] + name[5:]
        log = axis.get("type") == "log"
        values = [v for t in data if (t.get(f"{letter}axis") or letter) == ref for v in _axis_values(t, letter)]
        values = [math.log10(v) for v in values if v > 0] if log else values
        if not values:
            continue
        if isinstance(axis.get("range"), list) and None not in axis["range"]:
            lo, hi = sorted(float(r) for r in axis["range"])
            if log or layout.get("barmode") != "stack":       # a stack's total is its bars' sum, not a point
                out = [v for v in values if not lo - 1e-9 <= v <= hi + 1e-9]
                if out:
                    problems.append(f"{name}: {len(out)} point(s) outside its range [{lo:.4g}, {hi:.4g}]")
        if log and axis.get("tickvals") is not None:
            ticks = [math.log10(t) for t in plotly_values(axis["tickvals"]) if t > 0]
            if ticks and (min(ticks) > min(values) + 1e-9 or max(ticks) < max(values) - 1e-9):
                problems.append(f"{name}: points beyond its labelled ticks")
        title = axis.get("title", {})
        title = title.get("text", "") if isinstance(title, dict) else str(title or "")
        ticks = plotly_values(axis["tickvals"]) if axis.get("tickvals") is not None else []
        top = max([abs(v) for v in values] + [math.log10(t) if log else t for t in ticks if t > 0])
        if (re.search(r"\b(B|KiB|MiB|GiB|KB|MB|GB|TB)\b", title) and top >= (4 if log else 1e4)
                and not axis.get("tickformat") and axis.get("ticktext") is None):
            problems.append(f"{name}: SI ticks ('10k') on a byte axis, {title!r}: read as 10 k{title.split('(')[-1]}")
    legend = layout.get("legend", {})
    if (legend.get("orientation") == "h" and (legend.get("y") or 0) < 0
            and legend.get("yref", "paper") == "paper"):
        problems.append("a legend below the plot at a share of its height (under the tick labels: yref container)")
    if (legend.get("x") is not None and legend.get("y") is not None and legend.get("yref", "paper") == "paper"
            and 0 <= legend["x"] <= 1 and 0 <= legend["y"] <= 1 and layout.get("showlegend", True)):
        problems.append("the legend inside the plot area, over the data")
    lines = [t for t in data if t.get("type", "scatter") == "scatter" and "lines" in t.get("mode", "lines")
             and "x" in t and "y" in t]
    points = [_line(t, layout.get("yaxis" + (t.get("yaxis") or "y")[1:], {}).get("type") == "log") for t in lines]
    ys = [y[np.isfinite(y)] for p in points if p is not None for y in [p[1]]]
    ys = np.concatenate(ys) if ys else np.empty(0)
    tol = 0.005 * float(ys.max() - ys.min()) if ys.size else 0.0      # half a percent of the chart's height
    for i, (a, pa) in enumerate(zip(lines, points)):
        for b, pb in zip(lines[i + 1:], points[i + 1:]):
            same_axes = (a.get("xaxis"), a.get("yaxis")) == (b.get("xaxis"), b.get("yaxis"))
            same_style = (a.get("line", {}).get("dash", "solid") == b.get("line", {}).get("dash", "solid"))
            if (same_axes and same_style and pa is not None and pb is not None and pa[0] == pb[0]
                    and bool(np.allclose(pa[1], pb[1], rtol=0, atol=tol, equal_nan=True))):
                problems.append(f"line {b.get('name')!r} drawn on {a.get('name')!r} in the same style")
    return problems


def _line(trace: dict, log: bool) -> tuple[list, np.ndarray] | None:
    try:
        x, y = plotly_values(trace["x"]), np.asarray(plotly_values(trace["y"]), dtype=float)
    except (TypeError, ValueError):
        return None
    if log:
        y = np.log10(np.where(y > 0, y, np.nan))
    return (x, y) if len(x) == len(y) > 0 else None


def _shown(build) -> dict:
    """The spec of the figure ``build()`` returns, as ``show_chart`` renders it."""
    def script(build):
        from app_pages.charts import show_chart
        show_chart(build(), [{"a": 1}], key="fig")

    at = AppTest.from_function(script, args=(build,)).run()
    assert not at.exception, [e.value for e in at.exception]
    return chart_spec(at, "fig")


def test_figure_problems_sees_each_rule():
    import plotly.graph_objects as go
    ok = go.Figure(go.Scatter(x=[1, 2], y=[1, 5], mode="lines"), layout=dict(yaxis_range=[0, 6])).to_plotly_json()
    assert figure_problems(json.loads(json.dumps(ok, default=list))) == []
    for layout, data, expected in (
            (dict(yaxis_range=[0, 4]), [go.Scatter(x=[1, 2], y=[1, 5])], "outside its range"),
            (dict(yaxis=dict(type="log", tickvals=[1, 2, 5])), [go.Box(y=[1, 9])], "beyond its labelled ticks"),
            (dict(legend=dict(orientation="h", y=-0.3)), [go.Bar(x=["a"], y=[1])], "below the plot"),
            (dict(legend=dict(x=0.02, y=0.98)), [go.Bar(x=["a"], y=[1])], "inside the plot"),
            ({}, [go.Scatter(x=[1, 2], y=[1, 2], name="a"), go.Scatter(x=[1, 2], y=[1, 2.002], name="b")],
             "'b' drawn on 'a'"),
            (dict(yaxis_title="state held (GB)"), [go.Bar(x=["a"], y=[16_000])], "SI ticks")):
        spec = json.loads(go.Figure(data, layout=layout).to_json())
        assert any(expected in p for p in figure_problems(spec)), (expected, figure_problems(spec))


def test_show_chart_log_axis_spans_every_point():
    """Was: page 16's TTFT box points above the last labelled tick, at the plot's edge (Plotly's autorange on a log
    axis with ticks at 20 ... 100 ms while points reached 160 ms)."""
    import plotly.graph_objects as go
    spec = _shown(lambda: go.Figure([go.Box(y=[17.0, 40, 55, 60, 161], boxpoints="all")],
                                    layout=dict(yaxis_type="log")))
    assert figure_problems(spec) == []
    lo, hi = spec["layout"]["yaxis"]["range"]
    ticks = plotly_values(spec["layout"]["yaxis"]["tickvals"])
    assert lo <= math.log10(min(ticks)) <= math.log10(17) and math.log10(161) <= math.log10(max(ticks)) <= hi


def test_show_chart_legend_under_the_tick_labels():
    """Was: page 14's legend at y = -0.25 of the plot's height, over the eleven policies' rotated tick labels."""
    import plotly.graph_objects as go
    spec = _shown(lambda: go.Figure([go.Bar(x=[f"policy number {i}" for i in range(11)], y=list(range(11)))],
                                    layout=dict(legend=dict(orientation="h", y=-0.25))))
    assert spec["layout"]["legend"]["yref"] == "container" and spec["layout"]["legend"]["y"] == 0
    assert figure_problems(spec) == []


def test_show_chart_coinciding_lines_both_visible():
    """Was: page 15's policies with the same hit ratio at every budget, one line exactly over the other."""
    import plotly.graph_objects as go
    spec = _shown(lambda: go.Figure([go.Scatter(x=[1, 2, 4], y=[0.2, 0.4, 0.5], name="cache-aware", mode="lines+markers"),
                                     go.Scatter(x=[1, 2, 4], y=[0.2, 0.4, 0.5], name="bounded load", mode="lines+markers"),
                                     go.Scatter(x=[1, 2, 4], y=[0.1, 0.1, 0.1], name="round robin")]))
    first, second, third = spec["data"]     # round robin 0.1 below: the span is 0.4, so 1 % apart is not on it
    assert second["line"]["dash"] == "dash" and second["marker"]["symbol"] == "circle-open"
    assert second["name"] == "bounded load (on the cache-aware line)" and "dash" not in third.get("line", {})
    assert figure_problems(spec) == []


def test_show_chart_close_values_are_not_coinciding_lines():
    """Close in value is not on each other: page 15's mean TTFT of two policies, 6,960 vs 6,990 ms on a chart 40 ms
    high, are apart on the screen (a first rule, 1 % of the value, dashed one of them)."""
    import plotly.graph_objects as go
    spec = _shown(lambda: go.Figure([go.Scatter(x=[1, 2, 4], y=[6970.0, 6960, 6955], name="ours"),
                                     go.Scatter(x=[1, 2, 4], y=[6990.0, 6961, 6985], name="extra_buffer")]))
    assert "dash" not in spec["data"][1].get("line", {}) and spec["data"][1]["name"] == "extra_buffer"
    assert figure_problems(spec) == []


def _readable(at: AppTest) -> dict:
    """Every chart's spec of ``at`` by key, each asserted free of :func:`figure_problems`."""
    specs = {c.proto.id.rsplit("-", 1)[-1]: json.loads(c.proto.spec) for c in at.get("plotly_chart")}
    problems = {key: p for key, spec in specs.items() if (p := figure_problems(spec))}
    assert not problems, problems
    return specs


@pytest.mark.parametrize("block", ["16", "4"], ids=["default", "lines-coincide"])
def test_p07_lookup_lines_clear_of_the_checkpoints(block):
    """Was: the phase lines drawn through the last prompt's checkpoint diamonds (hit b = 64 on the markers at 64),
    group 0's diamonds half under group 1's, and at N = 4 the KV run's dotted line hidden under the hit's (both 92)."""
    at = _page("app_pages/07_prefix_anatomy.py", p07_block=block, p07_groups="4")
    data = _readable(at)["p07_blocks_chart"]["data"]
    lines = [t for t in data if t.get("mode") == "lines"]
    markers = [t for t in data if t.get("mode") == "markers"]
    last = max(plotly_values(markers[0]["y"]))                     # the top row's markers lie above the last prompt
    lowest = min(v for t in markers for v in plotly_values(t["y"]) if v > int(last))
    assert all(max(plotly_values(t["y"])) < lowest - 0.05 for t in lines), "a phase line reaches the markers"
    rows = sorted({round(v - int(v), 3) for t in markers for v in plotly_values(t["y"])})
    assert len(rows) == 4 and min(b - a for a, b in zip(rows, rows[1:])) >= 0.15 - 1e-9, rows
    hit, run = lines                                                # the hit's wide line first, the run dotted on it
    assert hit["line"]["width"] > run["line"]["width"] and run["line"]["dash"] == "dot"
    if plotly_values(hit["x"]) == plotly_values(run["x"]):
        assert all("(the lines coincide)" in t["name"] for t in lines)
    assert data.index(lines[-1]) < data.index(markers[0])          # markers drawn over the lines, never under


def test_p14_many_policies_readable():
    """Was: eleven policies' 44 TTFT bars each labelled (shrunk to unreadable, over each other), and the simulator
    chart's goal labels ("5 % goal (strict)") written over the bars' own labels."""
    from lab.fleet import DISPLAY_NAMES
    from lab.fleet_simulation import ROUTING_POLICIES
    at = AppTest.from_file(str(REPO / "app_pages/14_fleet_simulation.py"), default_timeout=240)
    at.query_params["p14_policies"] = [DISPLAY_NAMES[p] for p in ROUTING_POLICIES]
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    specs = _readable(at)
    assert len(specs["p14_ttft_chart"]["data"]) == 4 and all(
        "texttemplate" not in t for t in specs["p14_ttft_chart"]["data"]), "44 bars, each labelled"
    mape = specs["p14_sim_engine_chart"]
    assert not mape["layout"].get("annotations") and "goals" in mape["layout"]["yaxis"]["title"]["text"]
    top = max(v for t in mape["data"] for v in plotly_values(t["y"]))
    for trace in mape["data"]:
        assert trace["textposition"] == inside_if_tall(plotly_values(trace["y"]), top)


def test_p15_prediction_and_fit_both_visible():
    """Was: the dashed prediction drawn on the solid fitted line of the same colour and width (they coincide on
    H200 x TP8), and the budget line over the bars' tops (the running state slots' sliver)."""
    at = _page("app_pages/15_real_scale.py", p15_requests="1000")
    at.session_state["p15_sweep_on"] = True                        # the policy sweep's charts too
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    specs = _readable(at)
    data = specs["p15_prefill_chart"]["data"]
    for model in ("Kimi Linear", "all MLA"):
        names = [t["name"] for t in data]
        band = next(i for i, n in enumerate(names) if n.startswith(f"{model}: predicted"))
        fitted = next(i for i, n in enumerate(names) if n.startswith(f"{model}: fit"))
        assert band < fitted and data[band]["line"]["width"] > data[fitted].get("line", {}).get("width", 2)
    assert all(s.get("layer") == "below" for s in specs["p15_bytes_chart"]["layout"]["shapes"])


def test_p16_peers_grid_fits_and_log_axes_span_points():
    """Was: the peers grid's ten columns ("limit (tokens/s)" and the goals cut at the right; nine still cut the
    limit), the TTFT box points above the last labelled tick."""
    at = _page("app_pages/16_continuous_batching.py")
    _readable(at)
    (grid,) = [d.value for d in at.dataframe if "ours ÷ llama.cpp" in d.value.columns]
    assert "goals" not in grid.columns and len(grid.columns) <= 7      # nine still ran past the column's edge
    assert any({"Goals on the row", "Limit (tokens/s)"} <= set(t.value.columns) for t in at.table)


def test_p08_headline_delta_fits_its_column():
    """Was: "cold − warm 13.9 ms (paired IQR 1…" cut in a quarter of the row (a delta pill shows about 3 characters
    fewer than a label of the same width)."""
    at = _page("app_pages/08_prefix_hit.py")
    at.session_state["p08_timing_on"] = True
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    delta = at.metric[0].proto.delta
    tree = ast.parse((REPO / "app_pages/08_prefix_hit.py").read_text())
    shares = next(_column_shares(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                  and isinstance(n.targets[0], ast.Tuple) and [e.id for e in n.targets[0].elts][:1] == ["m1"])
    assert "paired IQR" in delta and len(delta) <= ROW_CHARS * shares[0] - 3, (delta, shares)


@pytest.mark.parametrize("tab", [HOME, *TABS], ids=[Path(t.path).stem for t in [HOME, *TABS]])
def test_every_chart_readable_at_defaults(tab):
    """:func:`figure_problems` on every chart of every tab at its defaults (the sections behind a button stay
    closed; the tour, bench.screens, opens them in Chromium). Home runs through app.py (its page links need it)."""
    _readable(_page("app.py" if tab is HOME else tab.path))


def test_show_chart_log_byte_axis_reads_thousands():
    """Was: page 10's MiB axis labelled "10k" at its top tick (Plotly's SI format on the labelled decade ticks)."""
    import plotly.graph_objects as go
    spec = _shown(lambda: go.Figure([go.Scatter(x=[1, 2, 3], y=[3.5, 40.0, 4000.0])],
                                    layout=dict(yaxis=dict(type="log", title="MiB received per rank (log)"))))
    assert 10_000 in plotly_values(spec["layout"]["yaxis"]["tickvals"]) and spec["layout"]["yaxis"]["tickformat"] == ","
    assert figure_problems(spec) == []
    spec["layout"]["yaxis"].pop("tickformat")
    assert any("SI ticks" in p for p in figure_problems(spec))


def test_show_chart_log_token_axis_reads_one_style():
    """Was: page 15's context axis read "2000" beside "10k" (Plotly writes ticks below 10,000 in full and above in
    SI); a log axis in tokens reaching 10,000 reads 2k, 5k, 10k, while one in seconds keeps 0.01 (not "10m")."""
    import plotly.graph_objects as go
    spec = _shown(lambda: go.Figure([go.Scatter(x=[1_000, 4_000, 32_000], y=[0.01, 0.1, 1.0])],
                                    layout=dict(xaxis=dict(type="log", title="context (tokens, log)"),
                                                yaxis=dict(type="log", title="prefill latency (s, log)"))))
    assert spec["layout"]["xaxis"]["tickformat"] == "~s"
    assert "tickformat" not in spec["layout"]["yaxis"]


@pytest.mark.parametrize("tab", [HOME, *TABS], ids=[Path(t.path).stem for t in [HOME, *TABS]])
def test_code_blocks_wrap(tab):
    """Was: Home's warm output ("Optional _class and strict are passed to the Pars") and page 18's vLLM / SGLang
    commands cut at the column's edge behind a scroll bar: every ``st.code`` wraps its lines."""
    calls = [n for n in ast.walk(ast.parse((REPO / tab.path).read_text())) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "code"]
    unwrapped = [c.lineno for c in calls if not any(k.arg == "wrap_lines" and getattr(k.value, "value", None) is True
                                                   for k in c.keywords)]
    assert not unwrapped, f"{tab.path}: st.code without wrap_lines=True on lines {unwrapped}"


@pytest.mark.parametrize("fixed_ms", [12.0, -17.6], ids=["a>0", "a<0"])
def test_forward_fit_chart_holds_every_point(fixed_ms):
    """Was: the held-out cold run's square on the chart's top edge (Home, page 08); then, with the range set from 0,
    a fitted line with a < 0 (-17.6 ms on a loaded host) below the axis. The warm run's two predictions are open
    markers of other sizes than the measured one, so none hides another."""
    def script(fixed_ms):
        from app_pages.charts import show_forward_fit
        from lab.forward_cost import ForwardFit
        show_forward_fit(ForwardFit(fixed_ms, 0.36, 1.0, (139, 696), (fixed_ms + 50, fixed_ms + 250),
                                    (fixed_ms + 40, fixed_ms + 230), (fixed_ms + 60, fixed_ms + 300), 1114, 600.0,
                                    fixed_ms + 401, 282, 1.5, 243.5, fixed_ms + 103, 153.4), key="fit")

    at = AppTest.from_function(script, args=(fixed_ms,)).run()
    assert not at.exception, [e.value for e in at.exception]
    spec = chart_spec(at, "fit")
    assert figure_problems(spec) == []
    lo, hi = spec["layout"]["yaxis"]["range"]
    assert hi > 600 * 1.05 and lo < min(0, fixed_ms)
    sizes = {t["name"]: t["marker"]["size"] for t in spec["data"] if t.get("mode") == "markers"}
    warm = [sizes["predicted: warm, a + b·n + copies"], sizes["predicted: warm, without a"], sizes["measured: warm run"]]
    assert len(set(warm)) == 3, sizes


def test_show_chart_long_legend_adds_height():
    """Was: page 14's TTFT-vs-load chart with eleven policies: 22 legend entries under the plot, in the figure's
    450 px, left a plot area about 100 px high (10 ms to 10 s in a sliver)."""
    import plotly.graph_objects as go
    names = [f"policy number {i} P{q} (on the ring (consistent hashing) P50 line)" for i in range(11) for q in (50, 99)]
    spec = _shown(lambda: go.Figure([go.Scatter(x=[1, 2], y=[i, i + 1], name=n) for i, n in enumerate(names)],
                                    layout=dict(legend=dict(orientation="h", y=-0.25))))
    assert spec["layout"]["height"] >= 450 + 20 * 10, spec["layout"].get("height")    # two a row: eleven rows
    few = _shown(lambda: go.Figure([go.Scatter(x=[1, 2], y=[1, 2], name="one")],
                                   layout=dict(legend=dict(orientation="h", y=-0.25))))
    assert few["layout"].get("height", 450) == 450
