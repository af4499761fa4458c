"""URL-bound input widgets and the checking of their stored and linked values.

- ``url_widget(make, label, key, default, *args, **kwargs)``: an input widget kept in the URL (``?key=value``, a
  multiselect or a range as the key repeated) and across page switches (``persist_state="session"``), its default,
  options and bounds stated once. Synced by hand through the public ``st.query_params`` and ``st.session_state``:
  :func:`persist` reads the key's URL value when it changed (a page load, a pasted link, the browser's back /
  forward), checks it against the widget's type, options and bounds and seeds the widget with it, or ignores it
  with a notice; after the widget is drawn its value goes back to the URL (removed when it is the default). A
  widget with ``format_func`` carries the formatted label in the URL; its options and ``default`` stay the code
  names.
- ``persist_within`` / ``persist_clamped``: :func:`persist` for a widget whose options or upper bound depend on
  another widget (dependent widgets constrain each other instead of failing).
- ``keep_page_links(prefix)``: called by ``app.py`` once the page is known; drops the keys of other pages' widgets
  from the URL (the address bar keeps the query string on a page switch).
- ``drop_unknown_links(prefix, page_path)``: called by ``app.py`` before the page runs; a URL key that looks like
  this page's (``p08_...``) but names none of its widgets (``?p08_prefix=0``) leaves the URL with a notice.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import streamlit as st

PERSISTED_KEYS = "_persisted_widget_keys"  # every key handed out by persist(), for the tests
LINKED = "_linked_url_values"              # {key: the URL values this session last read or wrote for it}
LAST_SHOWN = "__last_shown"                # suffix: a dependent slider's value when it was last on the page


def _invalid(value, default, options, min_value, max_value) -> str | None:
    """Why ``value`` cannot be the widget's value (None if it can): the type of ``default`` (a list:
    a multiselect), membership in ``options`` (same type too: ``True`` is not the option ``1``) and
    ``[min_value, max_value]``; a tuple default is a range: two ends, each checked like a single value."""
    if isinstance(default, tuple):
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            return f"a {type(value).__name__}, not a range of two values"
        whys = [_invalid(v, default[0], options, min_value, max_value) for v in value]
        return next((w for w in whys if w is not None), None)
    if isinstance(default, list):
        if not isinstance(value, list):
            return f"a {type(value).__name__}, not a list"
        if options is not None and any(v not in options for v in value):
            return "not a subset of the options"
        return None
    if default is not None and type(value) is not type(default):
        return f"a {type(value).__name__}, not a {type(default).__name__}"
    if options is not None and not any(type(o) is type(value) and o == value for o in options):
        return "not one of the options"
    if isinstance(value, float) and value != value:
        return "NaN"
    if (min_value is not None and value < min_value) or (max_value is not None and value > max_value):
        return f"outside [{min_value}, {max_value}]"
    return None


LINK_SHOWN_CHARS = 60   # a link value longer than this is cut in its notice (a 25,000-digit number, a long prompt)
OPTIONS_SHOWN = 12      # a notice names at most this many of the values a widget takes


class _Unreadable(ValueError):
    """A URL value the widget cannot take; the message says why ("not an integer", "outside [0, 9]")."""


def _labels(options, format_func) -> list[str]:
    """The options as the URL carries them: the ``format_func`` label, else ``str``."""
    return [str(format_func(o)) if format_func is not None else str(o) for o in options]


def _takes(labels: list[str]) -> str:
    """The values a widget takes, as a notice lists them (cut after :data:`OPTIONS_SHOWN`)."""
    more = f", … ({len(labels)} in all)" if len(labels) > OPTIONS_SHOWN else ""
    return ", ".join(labels[:OPTIONS_SHOWN]) + more


def _read_one(text: str, default, options, min_value, max_value, format_func):
    """One URL string read as the type of ``default`` (bool: true / false; a number must be finite: ``nan`` and
    ``inf`` are not values of a slider) or as the option whose label it is. Raises :class:`_Unreadable`."""
    if options is not None:
        labels = _labels(options, format_func)
        if text not in labels:
            raise _Unreadable(f"not one of the values this widget takes now ({_takes(labels)})")
        return options[labels.index(text)]
    if isinstance(default, bool):
        if text.lower() not in ("true", "false"):
            raise _Unreadable("not true or false")
        return text.lower() == "true"
    if isinstance(default, (int, float)):
        try:
            value = type(default)(text)
        except ValueError:
            if text.strip().lstrip("+-").isdigit():    # over Python's 4,300-digit int() limit
                raise _Unreadable(f"outside [{min_value}, {max_value}]") from None
            raise _Unreadable("not an integer" if isinstance(default, int) else "not a number") from None
        except OverflowError:
            raise _Unreadable("not an integer") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise _Unreadable("not a finite number")
        if (min_value is not None and value < min_value) or (max_value is not None and value > max_value):
            raise _Unreadable(f"outside [{min_value}, {max_value}]")
        return value
    return text


def _read_link(raw: list[str], default, options, min_value, max_value, format_func=None, max_chars=None):
    """The widget value the URL values ``raw`` (the key's values, in order) ask for. Raises :class:`_Unreadable`
    saying why the widget cannot take it: a one-value widget given the key more than once, a range (tuple
    ``default``) not given exactly two values, an empty multiselect or one naming an option twice, a text longer than ``max_chars`` (Streamlit
    would cut it silently), or a value :func:`_read_one` cannot read. With a ``format_func`` the URL carries the
    option's label (as the widget shows it), not the option itself."""
    def one(text, like):
        return _read_one(text, like, options, min_value, max_value, format_func)
    if isinstance(default, tuple):           # a range: two ends, each read as the type of the range's ends
        if len(raw) != 2:
            raise _Unreadable(f"{len(raw)} value{'' if len(raw) == 1 else 's'}, not a range of two (give it twice)")
        return tuple(one(t, default[0]) for t in raw)
    if isinstance(default, list):            # a multiselect
        if raw in ([], [""]):
            raise _Unreadable("an empty selection")
        repeated = sorted({t for t in raw if raw.count(t) > 1})
        if repeated:                         # a widget value is a set of options: one of them twice means nothing
            raise _Unreadable(f"a selection that names {', '.join(repeated)} more than once")
        return [one(t, None) for t in raw]
    if len(raw) > 1:
        raise _Unreadable(f"given {len(raw)} times")
    if max_chars is not None and len(raw[0]) > max_chars:
        raise _Unreadable(f"{len(raw[0]):,} characters, over the {max_chars:,}-character limit")
    return one(raw[0], default)


def _url_form(value, format_func=None) -> list[str]:
    """A widget value as the URL carries it: the key's values, in order (a multiselect or a range repeats the key;
    an empty multiselect is one empty value, ``?key=``). Booleans are ``true`` / ``false``, a whole float has no
    ``.0`` (as Streamlit writes numbers), an option with ``format_func`` is its label."""
    def one(v) -> str:
        if format_func is not None:
            return str(format_func(v))
        if isinstance(v, bool):
            return str(v).lower()
        if isinstance(v, float) and v == v and abs(v) != float("inf") and v == int(v):
            return str(int(v))
        return str(v)
    if isinstance(value, (list, tuple)):
        return [one(v) for v in value] or [""]
    return [one(value)]


def _shown_link_value(raw: list[str], why: str) -> str:
    """A link's values as a notice shows them: joined by commas, cut to :data:`LINK_SHOWN_CHARS` characters (and
    the length said, unless ``why`` says it already)."""
    text = ", ".join(raw)
    if len(text) <= LINK_SHOWN_CHARS:
        return text
    return f"{text[:LINK_SHOWN_CHARS]}…" + ("" if " characters" in why else f" ({len(text):,} characters)")


def _set_link(key: str, values: list[str]) -> None:
    """Put ``key=values`` in the URL (none: remove the key) unless it is there already, and remember what the URL
    now carries for it (:data:`LINKED`)."""
    current = st.query_params.get_all(key) if key in st.query_params else []
    if current != values:
        if values:
            st.query_params[key] = values
        else:
            del st.query_params[key]
    st.session_state.setdefault(LINKED, {})[key] = tuple(values)


def _take_link(key: str, default, options, min_value, max_value, format_func, max_chars) -> None:
    """Seed ``st.session_state[key]`` from the key's URL values when they differ from those this session last read
    or wrote for it (a page load, a pasted link, the browser's back / forward): a value the widget can take becomes
    its value; one it cannot is removed from the URL with a notice and the widget keeps its value. A key gone from
    the URL that this session had put there (back to a view at the default) sets the widget back to ``default``.
    Unchanged values are left alone, and so is every value in a rerun the user started by moving a widget
    (:func:`_widget_moved`): the widget's own value wins."""
    state = st.session_state
    raw = st.query_params.get_all(key) if key in st.query_params else []
    last = state.setdefault(LINKED, {}).get(key, ())
    if tuple(raw) == last:
        return
    if not raw:
        state[LINKED][key] = ()
        if default is not None:
            state[key] = default
        return
    try:
        state[key] = _read_link(raw, default, options, min_value, max_value, format_func, max_chars)
        state[LINKED][key] = tuple(raw)
    except _Unreadable as exc:
        _set_link(key, [])                     # the widget must not take what the notice says was ignored
        st.toast(f"The link's {key}={_shown_link_value(raw, str(exc))} is {exc}; it was ignored.",
                 icon=":material/link_off:")


def _widget_moved() -> None:
    """``on_change`` of every url_widget: the user moved a widget, and this rerun carries the address bar's URL,
    which may lag behind what the last run wrote (a second move before that run's URL update reached the
    browser). Every key's URL values are taken as read, so no widget is seeded from them this run (the user's
    move wins, as it does with Streamlit's own binding); the values drawn go back to the URL after."""
    linked = st.session_state.setdefault(LINKED, {})
    for key in linked:
        linked[key] = tuple(st.query_params.get_all(key))


def persist(key: str, default=None, *, options=None, min_value=None, max_value=None, format_func=None,
            max_chars=None) -> str:
    """A widget key starting at ``default``, its value taken from the URL when the link changed; use as
    ``key=persist(...), persist_state="session"`` and write the drawn value back with :func:`_set_link`.

    The key's URL values are checked when they change (:func:`_take_link`): a malformed value (``nan``, ``inf``,
    ``1.5`` for an integer, one end of a range, an empty multiselect), one out of range or not among the current
    ``options``, longer than ``max_chars`` (a text widget's limit) or given twice for a one-value widget is removed
    from the URL, the widget keeps its value and a toast says the link's value was ignored and why. A valid link
    value, once applied, is not checked again: when another widget later lowers this one's bound, the old link
    value is not reported after the fact. Pass the widget's ``format_func`` too: the URL then carries the option's
    label, and only a label is a valid link value.

    The stored session value is then checked on every run against the widget's constraints: the type of
    ``default``, ``options`` (selectbox / select_slider / multiselect) and ``min_value`` / ``max_value`` (slider /
    number_input). A None, wrongly typed or invalid value (e.g. from a session written by another version of the
    page) falls back to ``default`` (or, when it is None, to the widget's own first option) with a toast saying
    so. The widget also takes ``default`` as its own ``value=`` / ``index=`` / ``default=`` (``.streamlit/
    config.toml`` silences Streamlit's warning that session state sets it too: the two agree). Returns key."""
    state = st.session_state
    state.setdefault(PERSISTED_KEYS, set()).add(key)
    _take_link(key, default, options, min_value, max_value, format_func, max_chars)
    if key in state:
        why = _invalid(state[key], default, options, min_value, max_value)
        if why is not None:
            st.toast(f"{key}: the stored value {state[key]!r} is {why}; using the default {default!r} instead.",
                     icon=":material/restart_alt:")
            del state[key]
    if key not in state and default is not None:
        state[key] = default
    return key


def keep_page_links(prefix: str) -> None:
    """Remove from the URL the keys of other pages' widgets this session has drawn (a url_widget key not starting
    with ``prefix``, ``"p05_"``): the browser keeps the query string when the user switches pages, and they would
    ride along in this page's links (Streamlit's own binding drops them too). A key whose widget this session never
    drew stays: ``/?p04_draft=3``, then a switch to page 04, still opens it at 3. The widgets keep their values in
    the session (``persist_state``); this session forgets it wrote them, so their absence is not read as "back to
    the default" on return."""
    linked = st.session_state.get(LINKED, {})
    other = [k for k in st.query_params if k in linked and not k.startswith(prefix)]
    if other:
        kept = {k: st.query_params.get_all(k) for k in st.query_params if k not in other}
        st.query_params.from_dict(kept)       # one URL update for all
    for k in [k for k in linked if not k.startswith(prefix)]:
        linked[k] = ()


def persist_within(key: str, default, options: list, known) -> str:
    """:func:`persist` for a widget whose ``options`` depend on another widget (the GPUs a model fits on, the TP
    sizes that fit): a stored value among ``known`` (every value the widget can ever offer) but not among the
    current ``options`` moves to ``default`` without a notice (the other widget changed; dependent widgets
    constrain each other); a None, wrongly typed or unknown value is handled as :func:`persist` does. Returns key."""
    stored = st.session_state.get(key)
    if any(stored == k and type(stored) is type(k) for k in known) and stored not in options:
        st.session_state[key] = default
    return persist(key, default, options=options)


OPTION_WIDGETS = ("selectbox", "radio", "select_slider", "multiselect")


def url_widget(make, label: str, key: str, default, *args, known=None, clamp: bool | int = False, **kwargs):
    """Call the input widget ``make`` (``st.slider``, ``cols[1].selectbox``, ...) kept in the URL and across page
    switches, starting at ``default``; returns its value and puts it in the URL (no key at the default, as a
    pasted link needs none). The default, options and bounds are stated once, for the widget and for
    :func:`persist` alike: ``args`` are the widget's own positional arguments after the label
    (min and max of a slider / number_input, the options of a selectbox / radio / select_slider / multiselect).
    ``clamp``: the value's upper bound depends on another widget (:func:`persist_clamped`): True for the slider's max,
    or that bound; ``known``: the options do (every value they can ever hold, :func:`persist_within`). Other
    ``kwargs`` go to the widget (not ``on_change``: url_widget sets it, :func:`_widget_moved`)."""
    kind = make.__name__
    format_func = kwargs.get("format_func")
    if kind in ("slider", "number_input"):
        lo, hi = args[0], (args[1] if clamp is True or clamp is False else clamp)
        key = persist_clamped(key, default, lo, hi) if clamp is not False else persist(key, default, min_value=lo,
                                                                                       max_value=hi)
        start = {"value": min(default, hi)}
    elif kind in OPTION_WIDGETS:
        options = list(args[0])
        key = (persist_within(key, default, options, known) if known is not None else
               persist(key, default, options=options, format_func=format_func))
        start = ({"index": options.index(default)} if kind in ("selectbox", "radio") else
                 {"default" if kind == "multiselect" else "value": default})
    else:                                           # checkbox, toggle, text_input, text_area
        key, start = persist(key, default, max_chars=kwargs.get("max_chars")), {"value": default}
    value = make(label, *args, key=key, persist_state="session", on_change=_widget_moved, **start, **kwargs)
    if clamp is not False:
        st.session_state[key + LAST_SHOWN] = value
    start_value = options[start["index"]] if "index" in start else next(iter(start.values()))
    form = _url_form(value, format_func)
    _set_link(key, [] if form == _url_form(start_value, format_func) else form)   # the default: no key in the URL
    return value


def persist_clamped(key: str, default: int, lo: int, hi: int) -> str:
    """:func:`persist` for a slider whose upper bound ``hi`` depends on another widget: the value the widget showed
    last run, now above ``hi``, is lowered to ``hi`` silently (the other widget lowered the bound: dependent
    widgets constrain each other instead of failing); any other stored value outside [lo, hi] (one the widget
    never showed: a session written by another version of the page, or by code) falls back to ``default`` with
    :func:`persist`'s notice, and a link's value outside [lo, hi] is ignored with its notice. Returns key."""
    state = st.session_state
    shown = state.get(key + LAST_SHOWN)
    stored = state.get(key, shown)           # hidden last run: Streamlit restores the value it showed then
    if type(stored) is type(default) and type(shown) is type(default) and stored == shown > hi:
        state[key] = hi                      # the value the widget showed; the other widget lowered the bound: follow
    return persist(key, min(default, hi), min_value=lo, max_value=hi)   # any other value above hi: noticed


APP_KEY = re.compile(r"p\d\d_\w+")          # the shape of this app's URL keys: page number, then the widget's name
WIDGET_CALLS = frozenset({"url_widget", "persist", "persist_within", "persist_clamped"})   # draw a URL-bound widget
_WORD_LITERAL = re.compile(r"[\"']([a-z][a-z0-9_]*)[\"']")


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _widget_functions(trees: list) -> set[str]:
    """The functions that draw a URL-bound widget: :data:`WIDGET_CALLS` and every function of ``trees`` (parsed
    modules) whose body calls one of them (``real_replica``, a page's own slider helper), to a fixpoint."""
    found, defs = set(WIDGET_CALLS), [d for t in trees for d in ast.walk(t) if isinstance(d, ast.FunctionDef)]
    while more := {d.name for d in defs if d.name not in found
                   and any(isinstance(n, ast.Call) and _callee(n) in found for n in ast.walk(d))}:
        found |= more
    return found


@functools.lru_cache(maxsize=64)
def page_link_keys(page_path: str, prefix: str) -> frozenset[str]:
    """Every URL key page file ``page_path`` (relative to the repository) can draw, read from the source: the string
    literals starting with ``prefix`` in its calls to a function that draws a URL-bound widget (``url_widget(...,
    "p08_shared", ...)``, ``real_replica("p14", model_key="p14_real_model")``: :func:`_widget_functions`), ``prefix``
    + each word literal where the page builds keys itself (``f"p13_{key}"`` with ``key`` one of its literals), and the
    keys the shared widget helpers in ``app_pages`` build from a page's prefix (``f"{prefix}_gpu"``), with ``prefix``
    filled in. A superset of one run's widgets: a widget drawn only for some settings (page 14's cache size for the
    A10G replica) counts as the page's. A chart's, a button's or a file uploader's key (``"p17_bench"``) is not
    one: nothing reads it from the URL."""
    root = Path(__file__).resolve().parents[1]
    source = (root / page_path).read_text()
    page, helpers = ast.parse(source), [ast.parse(h.read_text()) for h in Path(__file__).parent.glob("[a-z]*.py")]
    drawing = _widget_functions([page, *helpers])

    def in_drawing_calls(tree):
        return [n for call in ast.walk(tree) if isinstance(call, ast.Call) and _callee(call) in drawing
                for n in ast.walk(call)]
    keys = {c.value for c in in_drawing_calls(page) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            and APP_KEY.fullmatch(c.value) and c.value.startswith(prefix)}
    if f'f"{prefix}{{' in source or f"f'{prefix}{{" in source:   # a page helper's f"p13_{key}": any word literal
        keys |= {prefix + word for word in _WORD_LITERAL.findall(source)}
    for helper in helpers:                            # a helper's f"{prefix}_gpu", for the page that passes its prefix
        keys |= {prefix.rstrip("_") + f.values[1].value for f in in_drawing_calls(helper)
                 if isinstance(f, ast.JoinedStr) and len(f.values) == 2 and isinstance(f.values[0], ast.FormattedValue)
                 and isinstance(f.values[0].value, ast.Name) and f.values[0].value.id == "prefix"
                 and isinstance(f.values[1], ast.Constant) and re.fullmatch(r"_\w+", str(f.values[1].value))}
    return frozenset(keys)


def drop_unknown_links(prefix: str, page_path: str) -> None:
    """Before the page at ``page_path`` runs: remove from the URL each key that looks like one of this page's
    (:data:`APP_KEY`, starting with ``prefix``) but is none of its widgets (:func:`page_link_keys`, or a key this
    session's widgets drew), with a notice per key, as for a bad value. Other pages' keys and keys of other shapes
    are left alone (:func:`keep_page_links` handles the first; the second are not this app's)."""
    known = page_link_keys(page_path, prefix) | st.session_state.get(PERSISTED_KEYS, set())
    unknown = [k for k in st.query_params if k.startswith(prefix) and APP_KEY.fullmatch(k) and k not in known]
    if not unknown:
        return
    st.query_params.from_dict({k: st.query_params.get_all(k) for k in st.query_params if k not in unknown})
    for key in unknown:
        st.toast(f"Unknown link setting {key} ignored: this page has no widget of that name.",
                 icon=":material/link_off:")
