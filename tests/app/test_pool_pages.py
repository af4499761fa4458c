"""Pages 05 (unified page pool) and 06 (MLA paging): regressions found driving them in a browser."""
import numpy as np
import pytest

from tests.app.page_helpers import chart_spec, open_page, open_revealed, plotly_values


@pytest.mark.parametrize("values", [{}, {"p05_pool_mib": 128, "p05_groups": 6, "p05_long_share": 1.0}],
                         ids=["defaults", "max"])
def test_p05_latency_chart_draws_every_call_and_marks_p50_p99(values):
    """Regression: linear histogram bins on a log axis started at 0 ns, so most calls (all of them at
    the maximum settings) were not drawn while the text still printed p50 / p99."""
    at = open_revealed("app_pages/05_page_pool.py", **values)
    fig = chart_spec(at, "p05_latency")
    assert fig["layout"]["xaxis"]["type"] == "log"
    bars = [t for t in fig["data"] if t["type"] == "bar"]
    assert {t["name"] for t in bars} == {"alloc", "free"}
    edges = []
    for t in bars:
        x, w = np.array(plotly_values(t["x"])), np.array(plotly_values(t["width"]))
        assert (x - w / 2 > 0).all()                               # every bar has a positive left edge
        assert sum(plotly_values(t["y"])) > 0
        edges += [*(x - w / 2), *(x + w / 2)]
    lo, hi = min(edges), max(edges)
    markers = {t["name"].split(" = ")[0]: plotly_values(t["x"])[0] for t in fig["data"] if t["type"] == "scatter"}
    assert set(markers) == {"alloc p50", "alloc p99", "free p50", "free p99"}
    text = next(m.value for m in at.markdown if "p50" in m.value and "p99" in m.value)
    for name, x in markers.items():                                # the chart marks what the text prints
        assert f"{name.split()[1]} {x:,.0f} ns" in text and lo <= x <= hi


def test_p05_utilisation_uses_one_denominator():
    """Regression: static-split lines were % of their own sub-pool under a "% of the pool" axis."""
    at = open_page("app_pages/05_page_pool.py")
    fig = chart_spec(at, "p05_util")
    caption = next(c.value for c in at.caption if "static split:" in c.value)
    n = int(caption.split(" pages of ")[0].replace(",", ""))
    kv_static = int(caption.split("static split: ")[1].split(" KV pages")[0].replace(",", ""))
    for t in fig["data"]:
        y = np.array(plotly_values(t["y"]))
        assert 0 <= y.min() and y.max() <= 100
    caps = sorted(s["y0"] for s in fig["layout"]["shapes"] if s["y0"] == s["y1"])
    assert caps == pytest.approx(sorted([100 * kv_static / n, 100 * (n - kv_static) / n]))


def test_p06_zero_prefix_and_tail_is_explained_in_slider_terms():
    """Regression: prefix = tail = 0 showed the engine's "max_requests > 0 ... got 1, 16, 0, 0"; both sliders at
    their minimum are a state the sliders reach, so the page explains it (an info, not an error box)."""
    at = open_page("app_pages/06_mla_paging.py", p06_max_ctx=1024, p06_prefix=0, p06_unique=0)
    assert not at.error
    assert "Shared prefix + unique tail is 0 tokens: there is nothing to page. Move either slider above 0." in \
        [i.value for i in at.info]
    assert not any(c.proto.id.endswith("p06_sharing") for c in at.get("plotly_chart"))


def test_p06_log_axes_have_readable_ticks():
    """Regression: the log right axis of the fragmentation chart labelled ticks "2, 6, 2, 9, 4, 1, 5, 2"."""
    at = open_page("app_pages/06_mla_paging.py", p06_max_ctx=1024)
    layout = chart_spec(at, "p06_frag")["layout"]
    assert layout["yaxis2"]["ticktext"][:6] == ["1", "2", "5", "10", "20", "50"]
    assert plotly_values(layout["xaxis"]["tickvals"]) == [2 ** i for i in range(11)]
