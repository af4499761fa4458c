"""pages._common.show_chart labels enough ticks on a log axis to read values between the powers of ten."""
import pandas as pd
import plotly.graph_objects as go
import pytest

from pages._common import show_chart


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
