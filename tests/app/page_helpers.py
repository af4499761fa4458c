"""Helpers for page-specific AppTest regressions: open a page with widget values, read a chart's data."""
import base64
import json
from pathlib import Path

import numpy as np
from streamlit.testing.v1 import AppTest

from tests.app.allowed_errors import allowed

APP = str(Path(__file__).resolve().parents[2] / "app.py")


def open_page(path: str, expect_error: bool = False, **values) -> AppTest:
    """Run the app, switch to ``path``, then set each widget ``key=value`` (slider, select_slider,
    number_input, selectbox or radio) and rerun; asserts that no run raised and that the page shows no st.error
    except those allow-listed in tests/app/allowed_errors.py (``expect_error``: the test provokes an
    error on purpose and checks it itself)."""
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    at.switch_page(path)
    at.run()
    for key, value in values.items():
        next(w for w in [*at.slider, *at.select_slider, *at.number_input, *at.selectbox, *at.radio] if w.key == key).set_value(value)
        at.run()
    assert not at.exception, [e.value for e in at.exception]
    unexpected = [e.value for e in at.error if allowed(path, e.value) is None]
    assert expect_error or not unexpected, f"{path}: st.error {unexpected}"
    return at


# Sections shown only after a button (heavy extras): the session flag each page's button sets.
REVEAL = {"app_pages/04_raw_input_ring.py": "p04_timing_on", "app_pages/05_page_pool.py": "p05_latency_on",
          "app_pages/08_prefix_hit.py": "p08_timing_on", "app_pages/09_prefix_miss.py": "p09_replay_on",
          "app_pages/14_fleet_simulation.py": "p14_sweep_on",
          "app_pages/15_real_scale.py": "p15_sweep_on", "app_pages/17_state_precision.py": "p17_run_on"}


def open_revealed(path: str, **values) -> AppTest:
    """:func:`open_page` (with ``values``), then, for a page in :data:`REVEAL`, set the flag its button sets and
    rerun, so the heavy extras render too; asserts that the rerun raised nothing."""
    at = open_page(path, **values)
    if path in REVEAL:
        at.session_state[REVEAL[path]] = True
        at.run()
        assert not at.exception, [e.value for e in at.exception]
    return at


def chart_spec(at: AppTest, key: str) -> dict:
    """The Plotly figure (data + layout) of the chart rendered with ``key``."""
    return next(json.loads(c.proto.spec) for c in at.get("plotly_chart") if c.proto.id.endswith(key))


def plotly_values(array) -> list:
    """A Plotly data array: a list, or a typed array ``{"dtype", "bdata"}`` (base64)."""
    if isinstance(array, dict):
        return np.frombuffer(base64.b64decode(array["bdata"]), dtype=array["dtype"]).tolist()
    return list(array)
