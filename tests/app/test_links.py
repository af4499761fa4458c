"""app_pages/links.py: widgets kept in the URL through public Streamlit API only.

- No file of the app (``app.py``, ``app_pages/``, ``lab/``) imports Streamlit's internals (``streamlit.runtime``,
  any ``streamlit.*`` module but the public ``streamlit.components.v1``) or reads a private attribute (``._name``)
  of ``st`` / ``streamlit`` or of an object reached from it (``st.query_params._initial_query_params``).
- A drawn parameter writes its widget's value to the URL after it is drawn (no key at the default), reads it back
  when the link changes (the browser's back / forward), and ``app.py`` keeps only the open page's keys in the URL while
  the widgets keep their values across page switches.
- A link's notice names the values a widget takes and states a long value's length once.
- A page's URL whitelist is its declared parameters (``declare(...)``), nothing read from its source: a declared key
  stays in the URL even in a run that does not draw its widget, any other key of the page's shape leaves it with a
  notice, and a widget drawn for a key the page did not declare fails loudly.
"""
import ast
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app_pages.links import DECLARED
from app_pages.params import APP_KEY
from app_pages.registry import HOME, TABS

REPO = Path(__file__).resolve().parents[2]
APP = str(REPO / "app.py")
PUBLIC_MODULES = {"streamlit", "streamlit.components.v1"}


def private_streamlit_uses(source: str) -> list[str]:
    """``line: what`` for each import of a non-public Streamlit module and each private attribute (``._name``,
    not a dunder) read from ``st`` / ``streamlit`` or from an attribute, call or subscript chain starting there."""
    tree = ast.parse(source)
    names = {"streamlit"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "streamlit":
                    names.add(a.asname or a.name)
                    if a.name not in PUBLIC_MODULES:
                        found.append(f"{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "streamlit":
            if node.module not in PUBLIC_MODULES:
                found.append(f"{node.lineno}: from {node.module} import ...")
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
                root = root.func if isinstance(root, ast.Call) else root.value
            if isinstance(root, ast.Name) and root.id in names | {"st"}:
                found.append(f"{node.lineno}: .{node.attr}")
    return found


def _app_files() -> list[Path]:
    return [REPO / "app.py", *sorted((REPO / "app_pages").glob("*.py")), *sorted((REPO / "lab").rglob("*.py"))]


def test_no_private_streamlit_api():
    uses = {str(p.relative_to(REPO)): u for p in _app_files() if (u := private_streamlit_uses(p.read_text()))}
    assert not uses, uses


@pytest.mark.parametrize("source", [
    "from streamlit.runtime.scriptrunner_utils.script_run_context import get_script_run_ctx",
    "import streamlit.runtime.state",
    "import streamlit as st\nst.query_params._initial_query_params.pop('k', None)",
    "import streamlit as st\nst.session_state._state",
    "import streamlit as x\nx.context._ctx().y",
], ids=["runtime-from", "runtime-import", "query-params", "session-state", "aliased-call"])
def test_private_streamlit_uses_are_found(source):
    """The scan itself: each private use, as the old links.py made them, is reported."""
    assert private_streamlit_uses(source)


def test_public_streamlit_uses_pass():
    assert not private_streamlit_uses("import streamlit as st\nimport streamlit.components.v1 as c\n"
                                      "st.query_params.get_all('k')\nst.session_state.__class__\nx._y")


def _run(at: AppTest) -> AppTest:
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_a_drawn_parameter_keeps_the_url_in_step():
    """Page 05: a link's value is taken; a moved widget goes into the URL and leaves it at its default; a URL that
    changes under the session (back / forward) sets the widget, but not in a rerun started by moving a widget (the
    address bar may lag behind); another page's URL carries none of page 05's keys,
    and on return the widgets and the URL have the values again."""
    at = AppTest.from_file(APP, default_timeout=180)
    at.switch_page("app_pages/05_page_pool.py")
    at.query_params["p05_seed"] = "3"
    _run(at)
    assert at.number_input(key="p05_seed").value == 3 and at.query_params == {"p05_seed": "3"}
    at.slider(key="p05_groups").set_value(3)
    _run(at)
    assert at.query_params == {"p05_seed": "3", "p05_groups": "3"}
    at.slider(key="p05_groups").set_value(1)                   # the default: the key leaves the URL
    _run(at)
    assert at.query_params == {"p05_seed": "3"}
    at.query_params["p05_groups"] = "2"                         # forward to a view with G = 2
    _run(at)
    assert at.slider(key="p05_groups").value == 2
    del at.query_params["p05_groups"]                           # back to the view at the default
    _run(at)
    assert at.slider(key="p05_groups").value == 1
    at.slider(key="p05_groups").set_value(3)
    _run(at)
    at.query_params.clear()                                    # a second move before the URL update arrived:
    at.slider(key="p05_groups").set_value(4)                   # the rerun carries a stale URL; the move wins
    _run(at)
    assert at.slider(key="p05_groups").value == 4 and at.number_input(key="p05_seed").value == 3
    assert at.query_params == {"p05_seed": "3", "p05_groups": "4"}
    at.switch_page("app_pages/00_home.py")
    _run(at)
    assert not [k for k in at.query_params if k.startswith("p05_")], at.query_params
    at.switch_page("app_pages/05_page_pool.py")
    _run(at)
    assert at.slider(key="p05_groups").value == 4 and at.number_input(key="p05_seed").value == 3
    assert at.query_params == {"p05_seed": "3", "p05_groups": "4"}
    assert not at.toast, [t.value for t in at.toast]


def _notices(path: str, params: dict, key: str) -> list[str]:
    at = AppTest.from_file(APP, default_timeout=180)
    at.switch_page(path)
    for k, v in params.items():
        at.query_params[k] = v
    _run(at)
    return [t.value for t in at.toast if f"link's {key}=" in t.value]


def test_an_option_not_offered_names_the_values_taken():
    """Regression: ``?p15_tp=1`` with the A100 said only "not a value this widget takes"."""
    notices = _notices("app_pages/15_real_scale.py", {"p15_gpu": "A100", "p15_tp": "1"}, "p15_tp")
    assert len(notices) == 1 and "takes now (2, 4, 8, 16)" in notices[0], notices


def test_a_multiselect_link_naming_an_option_twice_is_ignored_with_a_notice():
    """``?p14_policies=round+robin&p14_policies=round+robin`` reached the simulation as the same policy twice and the
    page showed ``TypeError: float() argument must be a string or a real number, not 'Series'``; now the link is
    ignored with a notice and the page runs with its default policies."""
    at = AppTest.from_file(APP, default_timeout=300)
    at.switch_page("app_pages/14_fleet_simulation.py")
    at.query_params["p14_policies"] = ["round robin", "round robin"]
    _run(at)
    notices = [t.value for t in at.toast if "link's p14_policies=" in t.value]
    assert notices == ["The link's p14_policies=round robin, round robin is a selection that names round robin more "
                       "than once; it was ignored."], [t.value for t in at.toast]
    assert "p14_policies" not in at.query_params and not at.exception


def test_a_long_value_states_its_length_once():
    """Regression: the notice for a text over its limit gave the length twice ("… (2,001 characters) is 2,001
    characters, over the 2,000-character limit")."""
    notices = _notices("app_pages/00_home.py", {"p00_first": "x" * 2_001}, "p00_first")
    assert len(notices) == 1 and notices[0].count("2,001") == 1, notices


@pytest.mark.parametrize("path, params, unknown", [
    pytest.param("app_pages/16_continuous_batching.py", {"p16_max_num_seqs": "64"}, "p16_max_num_seqs", id="p16"),
    pytest.param("app_pages/08_prefix_hit.py", {"p08_prefix": "0", "p08_new": "1", "p04_draft": "3", "utm": "x"},
                 "p08_prefix", id="p08"),
    pytest.param("app_pages/17_state_precision.py", {"p17_bench": "9" * 20_000}, "p17_bench", id="p17-chart-key"),
])
def test_an_unknown_key_of_the_page_is_reported_and_dropped(path, params, unknown):
    """A key shaped like the page's own (pNN_...) that names none of its widgets stayed in the URL with no notice;
    now it leaves the URL with a toast, as a bad value does. The page's real keys, another page's keys (kept for
    that page, keep_page_links) and keys of other shapes stay."""
    at = AppTest.from_file(APP, default_timeout=180)
    at.switch_page(path)
    for k, v in params.items():
        at.query_params[k] = v
    _run(at)
    assert [t.value for t in at.toast if unknown in t.value] == [
        f"Unknown link setting {unknown} ignored: this page has no widget of that name."]
    assert unknown not in at.query_params
    assert {k for k in params if k != unknown} <= set(at.query_params), at.query_params
    assert len(at.toast) == 1, [t.value for t in at.toast]                  # the page's real keys raise nothing


def _declaring_page():
    """A page of three parameters; the mode's widget shows only with "more" on."""
    import streamlit as st

    from app_pages.links import declare
    from app_pages.params import Choice, Int, Toggle

    links = declare(Int("p99_n", 3, 0, 9), Toggle("p99_more", False), Choice("p99_mode", "a", ["a", "b"]))
    n = links.slider(st, "n", "p99_n")
    if links.checkbox(st, "more", "p99_more"):
        links.selectbox(st, "mode", "p99_mode")
    st.write(f"n = {n}")


def test_the_url_whitelist_is_the_declared_keys():
    """Every declared key is a link setting, drawn this run or not (``p99_mode`` is hidden with "more" off: its link
    value waits in the URL); an undeclared key of the page's shape leaves the URL with a notice; other pages' keys
    and keys of other shapes stay."""
    at = AppTest.from_function(_declaring_page, default_timeout=30)
    for key, value in {"p99_n": "5", "p99_mode": "b", "p99_ghost": "1", "p98_n": "1", "utm": "x"}.items():
        at.query_params[key] = value
    _run(at)
    assert at.session_state[DECLARED].keys == {"p99_n", "p99_more", "p99_mode"}
    assert [t.value for t in at.toast] == ["Unknown link setting p99_ghost ignored: this page has no widget of that "
                                           "name."]
    assert set(at.query_params) == {"p99_n", "p99_mode", "p98_n", "utm"} and at.slider(key="p99_n").value == 5
    at.checkbox(key="p99_more").check()
    _run(at)
    assert at.selectbox(key="p99_mode").value == "b"


def _undeclared_page():
    import streamlit as st

    from app_pages.links import declare
    from app_pages.params import Int

    links = declare(Int("p99_n", 3, 0, 9))
    links.slider(st, "n", "p99_n")
    links.slider(st, "m", "p99_m")


def _wrong_widget_page():
    import streamlit as st

    from app_pages.links import declare
    from app_pages.params import Int

    links = declare(Int("p99_n", 3, 0, 9))
    links.selectbox(st, "n", "p99_n")


def _two_pages_page():
    from app_pages.links import declare
    from app_pages.params import Int

    declare(Int("p99_n", 3, 0, 9), Int("p98_n", 3, 0, 9))


@pytest.mark.parametrize(("page", "error"), [
    (_undeclared_page, "p99_m is drawn but not declared: add it to the page's declare(...) call (declared: p99_n)"),
    (_wrong_widget_page, "p99_n is declared as a Int; a selectbox draws Choice"),
    (_two_pages_page, "keys of more than one page declared together: ['p98_', 'p99_']"),
], ids=["undeclared", "wrong-widget", "two-prefixes"])
def test_a_widget_the_page_did_not_declare_fails_loudly(page, error):
    at = AppTest.from_function(page, default_timeout=30)
    at.run()
    assert [e.message for e in at.exception] == [error]


PAGES = [HOME, *TABS]
INPUTS = ("slider", "select_slider", "number_input", "selectbox", "multiselect", "radio", "checkbox", "toggle",
          "text_input", "text_area")


@pytest.mark.parametrize("tab", PAGES, ids=[Path(t.path).stem for t in PAGES])
def test_each_page_links_exactly_what_it_declares(tab):
    """Each tab declares its parameters under its own prefix and draws no input widget of that shape outside them
    (a raw ``st.slider(key="p05_x")`` would not be in the URL); opened with every declared key at its default plus
    one undeclared key, only the undeclared key is reported, and the declared keys whose widgets this run does not
    draw stay in the URL for the run that does."""
    at = AppTest.from_file(APP, default_timeout=180)
    at.switch_page(tab.path)
    _run(at)
    links = at.session_state[DECLARED]
    assert links.prefix == tab.link_prefix
    drawn = {w.key for kind in INPUTS for w in at.get(kind) if w.key and APP_KEY.fullmatch(w.key)}
    assert drawn <= links.keys, f"drawn but not declared: {sorted(drawn - links.keys)}"
    ghost = tab.link_prefix + "not_declared"
    params = {key: links[key].format(links[key].default) for key in links.keys}
    at = AppTest.from_file(APP, default_timeout=180)
    at.switch_page(tab.path)
    for key, value in {**params, ghost: ["1"]}.items():
        at.query_params[key] = value
    _run(at)
    assert [t.value for t in at.toast] == [f"Unknown link setting {ghost} ignored: this page has no widget of that "
                                           "name."]
    hidden = links.keys - {w.key for kind in INPUTS for w in at.get(kind)}
    assert hidden <= set(at.query_params) and ghost not in at.query_params, (hidden, dict(at.query_params))


def test_a_link_the_app_wrote_opens_its_view():
    """Regression: page 17 wrote the value scale 100.0 to the URL as ``p17_vscale=100`` (a slider's whole-number form)
    but read back only the option's label ``100.0``: reopening the app's own link said "not one of the values this
    widget takes now" and showed the default."""
    at = AppTest.from_file(APP, default_timeout=180)
    at.switch_page("app_pages/17_state_precision.py")
    _run(at)
    at.select_slider(key="p17_vscale").set_value(100.0)
    _run(at)
    link = at.query_params["p17_vscale"]
    assert link == "100.0", link
    again = AppTest.from_file(APP, default_timeout=180)
    again.switch_page("app_pages/17_state_precision.py")
    again.query_params["p17_vscale"] = link
    _run(again)
    assert again.select_slider(key="p17_vscale").value == 100.0 and not again.toast, [t.value for t in again.toast]


def test_a_range_given_high_end_first_is_ignored_with_a_notice():
    """Regression: ``?p03_context=65536&p03_context=4096`` was applied with no notice and page 03 showed "ValueError:
    context_range must be (lo, hi) with 1 <= lo <= hi, got (65536, 4096)"."""
    notices = _notices("app_pages/03_kda_state_vs_kv.py", {"p03_context": ["65536", "4096"]}, "p03_context")
    assert notices == ["The link's p03_context=65536, 4096 is a range whose low end comes second; it was ignored."]
