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
import re
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app_pages.charts import WRAP_CHARS, inside_if_tall
from app_pages.registry import TABS
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
