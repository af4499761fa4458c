"""AppTest for every tab in app_pages/registry.py: run it, move every slider / select_slider /
number_input to its minimum and maximum, try every selectbox option, and check after every run that
no exception is raised, no ``st.error`` is shown unless allow-listed with its reason, the page's own
verdict holds (tests/app/verdicts.py) and every Plotly chart has data."""
import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app_pages.links import DECLARED
from app_pages.registry import HOME, TABS
from tests.app.allowed_errors import allowed
from tests.app.verdicts import VERDICTS

TIMEOUT_S = 120
APP = str(Path(__file__).resolve().parents[2] / "app.py")


def _check(at: AppTest, where: str) -> None:
    """``where`` starts with the page path."""
    assert not at.exception, f"{where}: exception {[e.value for e in at.exception]}"
    path = where.split()[0]
    errors = [e.value for e in at.error]
    unexpected = [e for e in errors if allowed(path, e) is None]
    assert not unexpected, f"{where}: st.error {unexpected}"
    if not errors and path in VERDICTS:   # an allowed error stops the page before its verdict
        try:
            VERDICTS[path](at)
        except AssertionError as exc:
            raise AssertionError(f"{where}: verdict failed: {exc}") from exc
    for chart in at.get("plotly_chart"):
        fig = json.loads(chart.proto.spec)
        assert fig.get("data"), f"{where}: Plotly chart {chart.proto.id} has no traces"
        assert any(any(k in tr for k in ("x", "y", "z", "values", "cells", "r")) for tr in fig["data"]), \
            f"{where}: Plotly chart has traces without data"


def _extremes(w):
    """(min, max) values for a slider-like widget; None if it has no bounds."""
    is_range = isinstance(w.value, (tuple, list))
    if type(w).__name__ == "SelectSlider":
        opts = [type(w.value[0] if is_range else w.value)(o) for o in w.options]
        if is_range:  # narrowest ranges at each end
            return (opts[0], opts[min(1, len(opts) - 1)]), (opts[max(0, len(opts) - 2)], opts[-1])
        return opts[0], opts[-1]
    lo, hi = w.min, w.max
    if lo is None or hi is None:
        return None
    if is_range:
        step = w.step or 1
        return (lo, min(hi, lo + step)), (max(lo, hi - step), hi)
    return lo, hi


def _sliders(at: AppTest):
    return list(at.slider) + list(at.select_slider) + list(at.number_input)


def _fresh(path: str) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.run()
    if path != HOME.path:
        at.switch_page(path)
        at.run()
    return at


def _sweep_sliders(at: AppTest, path: str, skip: set) -> set:
    seen = set()
    for i in range(len(_sliders(at))):
        w = _sliders(at)[i]
        key = w.key or f"#{i}"
        if key in skip:
            continue
        seen.add(key)
        ext = _extremes(w)
        if ext is None:
            continue
        default = w.value
        for val in ext:
            target = next((x for x in _sliders(at) if (x.key or None) == w.key), w) if w.key else _sliders(at)[i]
            target.set_value(val)
            at.run()
            _check(at, f"{path} {key}={val}")
        target = next((x for x in _sliders(at) if (x.key or None) == w.key), None) if w.key else None
        if target is not None:
            target.set_value(default)
            at.run()
    return seen


@pytest.mark.parametrize("path", [HOME.path] + [t.path for t in TABS], ids=lambda p: p.split("/")[-1][:-3])
def test_page(path):
    at = _fresh(path)
    _check(at, path)
    seen = _sweep_sliders(at, path, set())
    for j in range(len(at.selectbox)):
        box = at.selectbox[j]
        default, n_opts = box.index, len(box.options)
        for idx in range(n_opts):
            at.selectbox[j].select_index(idx)
            at.run()
            _check(at, f"{path} {box.key}=#{idx}")
            seen |= _sweep_sliders(at, path, seen)
        if default is not None and j < len(at.selectbox):
            at.selectbox[j].select_index(default)
            at.run()


@pytest.mark.parametrize("path", [t.path for t in TABS], ids=lambda p: p.split("/")[-1][:-3])
def test_widget_values_survive_page_switch(path):
    """Move the page's first persisted slider-like widget, visit Home, come back: value kept."""
    at = _fresh(path)
    persisted = at.session_state[DECLARED].keys if DECLARED in at.session_state else set()
    widgets = [w for w in _sliders(at) if w.key in persisted and _extremes(w) is not None]
    if not widgets:
        pytest.skip(f"{path} has no persisted slider-like widget")
    w = widgets[0]
    lo, hi = _extremes(w)
    new = hi if w.value != hi else lo
    w.set_value(new)
    at.run()
    at.switch_page(HOME.path)
    at.run()
    at.switch_page(path)
    at.run()
    _check(at, path)
    again = next(x for x in _sliders(at) if x.key == w.key)
    assert again.value == new, f"{path}: {w.key} was {new!r} before the page switch, {again.value!r} after"
