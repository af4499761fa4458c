"""Shareable views: every page keeps the widgets that define its view in the URL (``app_pages.links``: declared
parameters, ``?key=value``, synced through the public ``st.query_params``), so a pasted link reproduces the view.

For every tab in app_pages/registry.py the URL widgets are found by their keys (the page's declaration is
``st.session_state[DECLARED]``), then the page is opened three more times with query
params set before its first run, as a deep link does:

- a valid non-default value per bound widget: every widget takes it;
- a malformed value per bound widget (``1.5`` for an integer, ``nan`` for a float, ``garbage`` otherwise; text
  widgets excepted: any text is valid): every widget keeps its default and says the link's value was ignored, no
  exception, no ``st.error`` (except those allow-listed in tests/app/allowed_errors.py);
- an out-of-range number per numeric widget and an unknown option per choice widget: same.

A page with no URL widget fails, unless it is listed in ``PENDING`` (pages whose binding is being
added on another branch; the lead empties the set after merging).
"""
import functools
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app_pages.links import DECLARED
from app_pages.registry import HOME, TABS
from tests.app.allowed_errors import allowed

APP = str(Path(__file__).resolve().parents[2] / "app.py")
TIMEOUT_S = 180
PENDING: set[str] = set()
PENDING_PREFIXES: tuple[str, ...] = ()
WIDGET_TYPES = ("slider", "select_slider", "number_input", "selectbox", "multiselect", "radio", "checkbox",
                "toggle", "text_input", "text_area")
TEXT = {"text_input", "text_area"}
NUMERIC = {"slider", "number_input"}


def _bound(at: AppTest) -> dict[str, tuple[str, object]]:
    """``{query param key: (widget type, widget)}`` of every widget kept in the URL (its key is the param)."""
    keys = at.session_state[DECLARED].keys if DECLARED in at.session_state else set()
    return {w.key: (kind, w) for kind in WIDGET_TYPES for w in at.get(kind) if w.key in keys}


def _open(path: str, params: dict | None = None) -> AppTest:
    """The page run first (a deep link), with ``params`` in the URL; asserts no exception, no st.error."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.switch_page(path)
    for key, value in (params or {}).items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, f"{path} {params}: exception {[e.value for e in at.exception]}"
    unexpected = [e.value for e in at.error if allowed(path, e.value) is None]
    assert not unexpected, f"{path} {params}: st.error {unexpected}"
    return at


def _valid_other(kind: str, w) -> tuple[object, object]:
    """(query param value, expected widget value) for a valid value other than the current (default)
    one: the lowest / first one where possible (with Streamlit's own URL binding, a value equal to the widget's
    declared default, the minimum / first option unless the page passed ``value=`` / ``index=``, was dropped
    from a link; this choice catches such a loss)."""
    if isinstance(w.value, (tuple, list)) and kind in ("slider", "select_slider"):   # a range: repeated params
        opts = [str(o) for o in w.options] if kind == "select_slider" else [str(w.min), str(w.min + (w.step or 1))]
        lo, hi = opts[0], opts[1]
        cast = (lambda x: x) if kind == "select_slider" else type(w.value[0])
        expected = (cast(lo), cast(hi))
        return [lo, hi], expected
    if kind in NUMERIC:
        is_float = isinstance(w.value, float)
        step = w.step or (0.01 if is_float else 1)
        v = w.min if w.min != w.value else w.value + step
        v = round(float(v), 10) if is_float else int(v)
        return str(v), v
    if kind in ("select_slider", "selectbox", "radio"):
        opts = list(w.options)
        other = opts[0] if opts[0] != str(w.value) else opts[1]
        return other, other
    if kind == "multiselect":
        value = [str(v) for v in _shown(kind, w)]
        other = value[:-1] if len(value) > 1 else [o for o in w.options if o not in value][:1] + value
        return other, other
    if kind in ("checkbox", "toggle"):
        return str(not w.value).lower(), not w.value
    return w.value + "\nshared view", w.value + "\nshared view"        # text


def _garbage(kind: str, w) -> str:
    """A malformed query param value: ``1.5`` for an integer widget (Streamlit took it as 1 while the notice said
    "ignored"), ``nan`` for a float one (Streamlit dropped it with no notice), else text no widget reads."""
    if kind in NUMERIC and not isinstance(w.value, (tuple, list)):
        return "nan" if isinstance(w.value, float) else "1.5"
    return "garbage"


def _out_of_range(kind: str, w) -> object | None:
    """A well-formed but invalid query param value (None for text and boolean widgets)."""
    if kind in NUMERIC:
        return str(w.max + 1000 * (w.step or 1))
    if kind in ("select_slider", "selectbox", "radio", "multiselect"):
        return "no such option"
    return None


def _shown(kind: str, w):
    """The value as the URL carries it: a selectbox or radio with a ``format_func`` (a model preset shown by its
    name) is bound by its label, so compare labels."""
    if kind in ("selectbox", "radio") and w.index is not None:
        return w.options[w.index]
    if kind == "multiselect":
        return [w.options[i] for i in w.indices]
    return w.value


def _normal(kind: str, value):
    if isinstance(value, (tuple, list)) and kind in ("slider", "select_slider"):
        return tuple(str(v) for v in value) if kind == "select_slider" else tuple(value)
    if kind in ("select_slider", "selectbox", "radio"):
        return str(value)
    if kind == "multiselect":
        return [str(v) for v in value]
    return value


PAGES = [HOME, *TABS]


@pytest.mark.parametrize("tab", PAGES, ids=[Path(t.path).stem for t in PAGES])
def test_query_params(tab) -> None:
    path = tab.path
    pending = path in PENDING or path.startswith(PENDING_PREFIXES)
    at = _open(path)
    bound = _bound(at)
    if not bound:
        if pending:
            pytest.skip(f"{path}: binding pending on another branch")
        pytest.fail(f"{path}: no widget is kept in the URL (app_pages.links.declare)")
    defaults = {key: _normal(kind, _shown(kind, w)) for key, (kind, w) in bound.items()}

    valid = {key: _valid_other(kind, w) for key, (kind, w) in bound.items()}
    at = _open(path, {key: qp for key, (qp, _) in valid.items()})
    ignored = " ".join(t.value for t in at.toast if "it was ignored" in t.value)
    got = _bound(at)
    def took(key, kind, w) -> bool:
        expected = valid[key][1]
        shown = _normal(kind, _shown(kind, w))
        return shown == pytest.approx(expected) if kind in NUMERIC else shown == expected

    for key in valid:   # a value the widget took is not reported as ignored (a format_func's label is valid)
        if key in got and took(key, *got[key]):
            assert f"link's {key}=" not in ignored, f"{path}: ?{key}={valid[key][0]} was taken but reported ignored"
    for key in valid:
        if key not in got or not took(key, *got[key]):
            # hidden or constrained by another value (page 04: capacity 1 has no window slider; page 15: TP 1 does
            # not fit the other GPU): the value alone
            got[key] = _bound(_open(path, {key: valid[key][0]}))[key]
        kind, w = got[key]
        assert took(key, kind, w), f"{path}: ?{key}={valid[key][0]} gave {w.value!r}"

    garbage = {key: _garbage(kind, w) for key, (kind, w) in bound.items() if kind not in TEXT}
    bad = {key: v for key, (kind, w) in bound.items() if (v := _out_of_range(kind, w)) is not None}
    for params in (garbage, bad):
        if not params:
            continue
        at = _open(path, params)
        got = _bound(at)
        for key in params:
            if key not in got:   # hidden by another (ignored) value's fallback: checked on its own
                at_one = _open(path, {key: params[key]})
                got[key] = _bound(at_one)[key]
            kind, w = got[key]
            assert _normal(kind, _shown(kind, w)) == defaults[key], \
                f"{path}: ?{key}={params[key]} gave {w.value!r}, not the default {defaults[key]!r}"
        notices = " ".join(t.value for t in at.toast)
        for key in params:                                  # the short notice: the link's value was ignored
            if key in got:
                assert f"link's {key}=" in notices, f"{path}: no notice for ?{key}={params[key]}: {notices!r}"


@pytest.mark.parametrize(("path", "params", "key"), [
    ("app_pages/04_raw_input_ring.py", {"p04_window": "99"}, "p04_window"),
    ("app_pages/04_raw_input_ring.py", {"p04_window": "0"}, "p04_window"),
    ("app_pages/02_verify_and_replay.py", {"p02_mode": "interrupted", "p02_abort_tokens": "99"}, "p02_abort_tokens"),
    ("app_pages/10_kcp.py", {"p10_world": "64"}, "p10_world"),
])
def test_a_dependent_sliders_link_value_out_of_its_bounds_is_reported(path, params, key):
    """A slider whose upper bound follows another widget (drawn with ``max_value=``) reports a link's value outside its
    current bounds, naming both bounds, instead of dropping it silently (or printing "None" for the bound)."""
    at = _open(path, params)
    notices = [t.value for t in at.toast if f"link's {key}=" in t.value]
    assert notices and "outside [1, " in notices[0] and "None" not in notices[0], [t.value for t in at.toast]


@pytest.mark.parametrize("tab", PAGES, ids=[Path(t.path).stem for t in PAGES])
def test_every_url_widget_states_its_default_once(tab) -> None:
    """A page binds its widgets to the URL only through its declared parameters (``app_pages.links``), which give
    the default, options and bounds to the widget and to the value check alike: a page that writes ``bind=`` or
    ``persist_state=`` itself states them twice, and the two copies can drift apart."""
    source = Path(tab.path).read_text()
    assert "bind=" not in source and "persist_state=" not in source, tab.path


@pytest.mark.parametrize(("path", "params", "bound", "lowered", "key"), [
    ("app_pages/11_fleet_hashing.py", {"p11_requests": "3000", "p11_index": "2500"}, "p11_requests", 500, "p11_index"),
    ("app_pages/04_raw_input_ring.py", {"p04_capacity": "32", "p04_window": "16"}, "p04_capacity", 5, "p04_window"),
])
def test_a_link_value_is_not_reported_after_another_widget_lowers_its_bound(path, params, bound, lowered, key):
    """A valid link value stays valid: when the user then lowers the widget it depends on, the dependent follows
    silently (the URL still carries the old value; it was applied, and is not "ignored" after the fact)."""
    at = _open(path, params)
    assert not [t.value for t in at.toast], [t.value for t in at.toast]
    next(w for w in [*at.slider, *at.select_slider] if w.key == bound).set_value(lowered)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    follower = next(w for w in [*at.slider, *at.number_input] if w.key == key)
    assert follower.value == follower.max <= lowered
    assert not [t.value for t in at.toast if "ignored" in t.value], [t.value for t in at.toast]


def test_a_value_given_twice_for_a_one_value_widget_is_reported():
    """Streamlit drops ``?p05_pool_mib=48&p05_pool_mib=64`` and shows the default: the page says why."""
    at = _open("app_pages/05_page_pool.py", {"p05_pool_mib": ["48", "64"]})
    assert any("p05_pool_mib=48, 64 is given 2 times" in t.value for t in at.toast), [t.value for t in at.toast]



WIDGETS_BY_KEY = ("slider", "select_slider", "number_input", "multiselect", "text_area", "selectbox")


def _value(at: AppTest, key: str):
    """The value of the widget with ``key`` (a multiselect's as its labels)."""
    for kind in WIDGETS_BY_KEY:
        for w in at.get(kind):
            if w.key == key:
                return _normal(kind, _shown(kind, w))
    raise AssertionError(f"no widget {key!r}")


@functools.cache
def _fresh_value(path: str, key: str, rest: tuple = ()):
    """The widget's value on the page opened with only the other link values ``rest`` ((key, value) pairs),
    e.g. the drafter that shows the widget at all."""
    return _value(_open(path, dict(rest)), key)


def _ignored_and_default(path: str, params: dict, key: str, why: str) -> None:
    """The link's value of ``key`` is reported as ignored, saying ``why``, and the widget shows its default."""
    at = _open(path, params)
    notices = [t.value for t in at.toast if f"link's {key}=" in t.value]
    assert len(notices) == 1 and notices[0].endswith("it was ignored.") and why in notices[0], \
        [t.value for t in at.toast]
    assert len(notices[0]) < 200, notices[0]             # a 25,000-digit value is cut in the notice
    rest = tuple((k, v) for k, v in params.items() if k != key and isinstance(v, str))
    assert _value(at, key) == _fresh_value(path, key, rest), f"{path} {params}: the widget took the ignored value"


HUGE = "9" * 25_000
BAD_NUMBERS = [("inf", "not an integer"), ("1e309", "not an integer"), (HUGE, "outside [0, ")]


@pytest.mark.parametrize(("path", "key"), [("app_pages/05_page_pool.py", "p05_seed"),
                                           ("app_pages/11_fleet_hashing.py", "p11_index")])
@pytest.mark.parametrize(("value", "why"), BAD_NUMBERS, ids=["inf", "1e309", "25000-digits"])
def test_a_number_streamlit_cannot_read_is_ignored_before_the_widget_sees_it(path, key, value, why):
    """Regression: ``?p05_seed=inf`` (or 1e309, or 25,000 digits) reached Streamlit's ``number_input``
    deserializer, ``int(val)``: OverflowError, a stack trace, while the page's own notice said "ignored"."""
    _ignored_and_default(path, {key: value}, key, why)


@pytest.mark.parametrize(("path", "params", "key", "why"), [
    ("app_pages/00_home.py", {"p00_new": "1.5"}, "p00_new", "not an integer"),
    ("app_pages/00_home.py", {"p00_first": ["a", "second"]}, "p00_first", "given 2 times"),
    ("app_pages/12_fleet_scaling.py", {"p12_algorithms": ""}, "p12_algorithms", "an empty selection"),
    ("app_pages/14_fleet_simulation.py", {"p14_policies": ""}, "p14_policies", "an empty selection"),
    ("app_pages/15_real_scale.py", {"p15_policies": ""}, "p15_policies", "an empty selection"),
], ids=["float-for-int", "repeated", "empty-12", "empty-14", "empty-15"])
def test_a_link_value_reported_as_ignored_is_not_applied(path, params, key, why):
    """Regression: Streamlit applied these (``1.5`` became 1, the last of a repeated value won, an empty
    multiselect value cleared the selection) while the page's notice said the value was ignored."""
    _ignored_and_default(path, params, key, why)


@pytest.mark.parametrize(("path", "params", "key", "why"), [
    ("app_pages/02_verify_and_replay.py", {"p02_drafter": "noisy oracle", "p02_accept": "nan"}, "p02_accept",
     "not a finite number"),
    ("app_pages/05_page_pool.py", {"p05_long_share": "nan"}, "p05_long_share", "not a finite number"),
    ("app_pages/12_fleet_scaling.py", {"p12_at": "nan"}, "p12_at", "not a finite number"),
    ("app_pages/03_kda_state_vs_kv.py", {"p03_context": "64"}, "p03_context", "1 value, not a range of two"),
    ("app_pages/03_kda_state_vs_kv.py", {"p03_context": ["1024", "4096", "65536"]}, "p03_context",
     "3 values, not a range of two"),
    ("app_pages/00_home.py", {"p00_first": "x" * 2_001}, "p00_first", "2,001 characters, over the 2,000-character limit"),
    ("app_pages/07_prefix_anatomy.py", {"p07_prompts": "a" * 30_000 + "\n" + "b" * 30_000}, "p07_prompts",
     "60,001 characters, over the 4,000-character limit"),
    ("app_pages/07_prefix_anatomy.py", {"p07_prompts": "\n".join(str(i) for i in range(2_000))}, "p07_prompts",
     "8,889 characters, over the 4,000-character limit"),
], ids=["nan-02", "nan-05", "nan-12", "range-one-end", "range-three-ends", "text-over-limit", "07-two-long-prompts",
        "07-2000-prompts"])
def test_a_link_value_streamlit_drops_is_reported(path, params, key, why):
    """Regression: Streamlit dropped (or, for a text over ``max_chars``, cut) these values with no notice."""
    _ignored_and_default(path, params, key, why)


@pytest.mark.parametrize(("path", "key", "value"), [
    ("app_pages/04_raw_input_ring.py", "p04_window", 99),
    ("app_pages/10_kcp.py", "p10_world", 64),
    ("app_pages/11_fleet_hashing.py", "p11_index", 10**9),
])
def test_a_stored_value_above_a_dependent_bound_is_reported(path, key, value):
    """Regression: a stored session value above a dependent slider's bound (one the widget never showed: a session
    written by another version of the page, or by code) was lowered to the bound silently, where every other
    widget reports a stored value it cannot take and shows its default."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.switch_page(path)
    at.session_state[key] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    notices = [t.value for t in at.toast if t.value.startswith(f"{key}: the stored value {value!r}")]
    assert notices and "outside [" in notices[0], [t.value for t in at.toast]
    assert _value(at, key) == _fresh_value(path, key)


@pytest.mark.parametrize(("text", "why"), [
    ("\n".join(str(i) for i in range(500)), "ValueError: prompts: 500 prompts, over the limit of 16; keep at most 16 lines"),
    ("é" * 1_500 + "\n" + "è" * 1_500, "ValueError: prompts: 6,000 bytes in all (UTF-8; bytes are tokens), over the "
                                       "limit of 4,000; shorten them"),
], ids=["500-prompts", "multi-byte"])
def test_page_07_prompts_within_the_box_but_over_the_bounds_are_an_error(text, why):
    """Regression: page 07 ran any text through the engine (2,000 short prompts asked torch for 3.9 GB). A text
    that fits the box (4,000 characters) but holds too many prompts, or too many UTF-8 bytes, is an error naming
    the prompts, before any engine is built; the caption states the bounds."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.switch_page("app_pages/07_prefix_anatomy.py")
    at.query_params["p07_prompts"] = text
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert [e.value for e in at.error] == [why]
    assert at.text_area(key="p07_prompts").value == text            # taken, as the link asked, and explained
    assert any("At most 16 prompts, 4,000 bytes and 128 checkpoint intervals in all" in c.value for c in at.caption)
