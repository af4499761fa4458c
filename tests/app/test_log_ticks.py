"""app_pages.charts.show_chart labels enough ticks on a log axis to read values between the powers of ten."""
import pandas as pd
import plotly.graph_objects as go
import pytest

from app_pages.charts import show_chart


def _shown(x, y, **layout) -> go.Figure:
    fig = go.Figure(go.Scatter(x=x, y=y))
    fig.update_layout(**layout)
    show_chart(fig, pd.DataFrame({"x": x, "y": y}), key="log_ticks_test")   # bare mode: renders nothing
    return fig


def test_three_decades_get_1_2_5_ticks() -> None:
    fig = _shown([1, 2, 3], [120.0, 900.0, 9000.0], yaxis_type="log")
    assert list(fig.layout.yaxis.tickvals) == pytest.approx([100, 200, 500, 1000, 2000, 5000, 10000])
    assert fig.layout.yaxis.dtick is None


def test_under_one_decade_gets_finer_ticks() -> None:
    fig = _shown([1, 2], [2.2, 6.0], yaxis_type="log")
    assert list(fig.layout.yaxis.tickvals) == pytest.approx([2, 3, 5, 7])


def test_wide_range_labels_powers_of_ten() -> None:
    fig = _shown([1, 2], [1e-3, 1e5], yaxis_type="log")
    assert fig.layout.yaxis.dtick == 1 and fig.layout.yaxis.tickvals is None


def test_four_decades_get_1_3_ticks() -> None:
    """Page 03's bytes chart reached 40,000 MiB above its last label (10,000 MiB) with the powers of ten alone."""
    fig = _shown([1, 2], [8.2, 41_000.0], yaxis_type="log")
    assert list(fig.layout.yaxis.tickvals) == pytest.approx([3, 10, 30, 100, 300, 1000, 3000, 10_000, 30_000, 100_000])


def test_x_axis_of_second_subplot_uses_its_own_data() -> None:
    fig = go.Figure([go.Scatter(x=[1, 1e6], y=[1, 2]), go.Scatter(x=[30, 400], y=[1, 2], xaxis="x2")])
    fig.update_layout(xaxis=dict(type="log", domain=[0, 0.45]), xaxis2=dict(type="log", domain=[0.55, 1]))
    show_chart(fig, pd.DataFrame(), key="log_ticks_test2")
    assert fig.layout.xaxis.dtick == 1
    assert list(fig.layout.xaxis2.tickvals) == pytest.approx([20, 50, 100, 200, 500])


def test_explicit_ticks_and_linear_axes_untouched() -> None:
    fig = _shown([1, 2], [10.0, 300.0], yaxis=dict(type="log", tickvals=[10, 300]))
    assert list(fig.layout.yaxis.tickvals) == [10, 300]
    fig = _shown([1, 2], [10.0, 300.0])
    assert fig.layout.yaxis.tickvals is None and fig.layout.yaxis.dtick is None


def test_reference_line_labels_sit_on_their_lines_on_log_axes() -> None:
    """Plotly writes an add_hline / add_vline label at the data value, but places annotations on a log axis in
    log10 units: the 1e-5 tolerance label landed at 10^(1e-5) ≈ 1, a break-even at 5,384 tokens off the plot."""
    fig = go.Figure(go.Scatter(x=[10, 1e5], y=[1e-9, 1e-3]))
    fig.update_layout(xaxis_type="log", yaxis_type="log")
    fig.add_hline(y=1e-5, annotation_text="1e-5 tolerance")
    fig.add_vline(x=5384, annotation_text="break-even")
    fig.add_annotation(x=2.0, y=-4.0, text="placed by hand, already in log10 units")
    show_chart(fig, pd.DataFrame(), key="log_lines_test")
    by_text = {a.text: a for a in fig.layout.annotations}
    assert by_text["1e-5 tolerance"].y == pytest.approx(-5)
    assert by_text["break-even"].x == pytest.approx(3.7311, abs=1e-4)
    assert (by_text["placed by hand, already in log10 units"].x, by_text["placed by hand, already in log10 units"].y) \
        == (2.0, -4.0)


def test_pages_label_their_log_reference_lines() -> None:
    """Page 10's tolerance line and page 03's break-even line, as the browser draws them."""
    import math

    from tests.app.page_helpers import chart_spec, open_page

    tol = next(a for a in chart_spec(open_page("app_pages/10_kcp.py"), "p10_exact_chart")["layout"]["annotations"]
               if "tolerance" in a["text"])
    assert tol["y"] == pytest.approx(-5), tol
    be = next(a for a in chart_spec(open_page("app_pages/03_kda_state_vs_kv.py"), "p03_bytes_chart")["layout"]["annotations"]
              if a["text"].startswith("break-even"))
    tokens = float(be["text"].split("≈ ")[1].split(" tokens")[0].replace(",", ""))
    assert be["x"] == pytest.approx(math.log10(tokens), abs=1e-3), be


def test_reference_line_counts_in_the_tick_range() -> None:
    """Page 17: data 0.1-5 under an fp16 limit line at 65,504 got ticks up to 5 only, four decades unlabelled."""
    fig = go.Figure(go.Scatter(x=[1, 2, 3], y=[0.1, 1.0, 5.0]))
    fig.update_layout(yaxis_type="log")
    fig.add_hline(y=65_504, line_dash="dash", annotation_text="fp16 max")
    show_chart(fig, pd.DataFrame({"y": [0.1, 1.0, 5.0]}), key="log_ticks_test3")
    assert fig.layout.yaxis.dtick == 1 and fig.layout.yaxis.tickvals is None        # 0.1 .. 65,504: > 5 decades
