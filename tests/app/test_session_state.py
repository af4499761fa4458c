"""Persisted widget values that are None, of the wrong type or not a valid option (e.g. a session
written by another version of a page) must not crash any page: the page's links (``app_pages.links``) fall back to the
widget's default with a toast. For every tab, every persisted key is poisoned at once, then the page
runs; its widgets must show exactly the values of a fresh session."""
import functools
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app_pages.links import DECLARED
from app_pages.registry import HOME, TABS

APP = str(Path(__file__).resolve().parents[2] / "app.py")
WIDGETS = ("slider", "select_slider", "selectbox", "multiselect", "number_input", "text_area", "checkbox")
PATHS = [HOME.path] + [t.path for t in TABS]


def _run(path: str, state: dict | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=180)
    for key, value in (state or {}).items():
        at.session_state[key] = value
    at.run()
    if path != HOME.path:
        at.switch_page(path)
        at.run()
    assert not at.exception, f"{path}: {[e.value for e in at.exception]}"
    return at


def _values(at: AppTest, keys: set) -> dict:
    return {w.key: w.value for kind in WIDGETS for w in getattr(at, kind) if w.key in keys}


@functools.cache
def _fresh(path: str) -> tuple[dict, frozenset, frozenset]:
    """(widget values of a fresh session, the persisted keys, the free-text keys) of the page at ``path``."""
    at = _run(path)
    prefix = f"p{Path(path).name[:2]}_"                      # page-prefixed widget keys
    keys = {k for k in at.session_state[DECLARED].keys if k.startswith(prefix)}
    return _values(at, keys), frozenset(keys), frozenset(w.key for w in at.text_area)


def _wrong_type(value):
    if isinstance(value, bool):
        return "yes"
    if isinstance(value, (int, float)):
        return "many"
    if isinstance(value, list):
        return "ring"
    return 7


def _invalid(value):
    """A value of the right type that no widget option / bound allows (None where every value is valid)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return type(value)(-10**9)                  # below every bound (all are >= 0)
    if isinstance(value, list):
        return ["no-such-option"]
    return "no-such-option"


CASES = {"None": lambda v: None, "wrong-type": _wrong_type, "invalid-option": _invalid}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.split("/")[-1][:-3])
def test_poisoned_session_values_fall_back_to_defaults(path, case):
    defaults, keys, free_text = _fresh(path)
    assert defaults, f"{path}: no persisted widget found"
    bad = {k: CASES[case](v) for k, v in defaults.items() if not (case == "invalid-option" and k in free_text)}
    bad = {k: v for k, v in bad.items() if v is not None or case == "None"}
    at = _run(path, bad)
    assert _values(at, keys) == defaults
    notices = " ".join(t.value for t in at.toast)
    missing = [k for k in bad if k not in notices]
    assert not missing, f"{path}: no notice for {missing}"
