"""URL-bound input widgets and the checking of their stored and linked values.

- ``url_widget(make, label, key, default, *args, **kwargs)``: an input widget bound to the URL and kept
  across page switches (Streamlit 1.67 ``bind="query-params"``, ``persist_state="session"``), its default,
  options and bounds stated once; built on ``persist(key, default, options=..., min_value=..., max_value=...)``,
  which checks a stored or linked value against them and falls back to the default with a notice. A widget
  with ``format_func`` shows (and puts in the URL) the formatted label; its options and ``default`` stay the
  code names.
- ``persist_within`` / ``persist_clamped``: :func:`persist` for a widget whose options or upper bound depend on
  another widget (dependent widgets constrain each other instead of failing).
"""
from __future__ import annotations

import streamlit as st

PERSISTED_KEYS = "_persisted_widget_keys"  # every key handed out by persist(), for the tests
CHECKED_LINKS = "_checked_link_values"     # (key, URL values) already checked in this session
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


def _url_value_problem(raw, default, options, min_value, max_value, format_func=None, max_chars=None) -> str | None:
    """Why the URL value ``raw`` (a string, or a list of strings for a multiselect or a range) cannot be
    the widget's value, or None. Strings are read as the type of ``default`` (bool: true / false; a number must
    be finite: ``nan`` and ``inf`` are not values of a slider); a range (tuple ``default``) needs exactly two
    values; a text longer than ``max_chars`` is not taken (Streamlit would cut it silently). With a
    ``format_func`` the URL carries the option's label (as Streamlit writes it), not the option itself."""
    if format_func is not None and options is not None:
        options = [format_func(o) for o in options]
    def cast(text):
        if isinstance(default, bool):
            if str(text).lower() not in ("true", "false"):
                raise ValueError
            return str(text).lower() == "true"
        if isinstance(default, (int, float)) and options is None:
            try:
                value = type(default)(text)
            except ValueError:
                if str(text).strip().lstrip("+-").isdigit():    # over Python's 4,300-digit int() limit
                    raise ValueError(f"outside [{min_value}, {max_value}]") from None
                raise ValueError("not an integer" if isinstance(default, int) else "not a number") from None
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError("not a finite number")
            return value
        if options is not None:
            match = [o for o in options if str(o) == str(text)]
            if not match:
                raise ValueError
            return match[0]
        return text
    if isinstance(default, tuple):           # a range: two ends, each read as the type of the range's ends
        values = raw if isinstance(raw, list) else [raw]
        if len(values) != 2:
            return f"{len(values)} value{'' if len(values) == 1 else 's'}, not a range of two (give it twice)"
        default = default[0]
    if max_chars is not None and isinstance(raw, str) and len(raw) > max_chars:
        return f"{len(raw):,} characters, over the {max_chars:,}-character limit"
    if isinstance(default, list) and raw in ([], [""], ""):
        return "an empty selection"
    try:
        values = [cast(v) for v in (raw if isinstance(raw, list) else [raw])]
    except (TypeError, ValueError, OverflowError) as exc:
        return str(exc) if str(exc).startswith(("not ", "outside ")) else "not a value this widget takes"
    if options is None and any((min_value is not None and v < min_value) or (max_value is not None and v > max_value)
                               for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)):
        return f"outside [{min_value}, {max_value}]"
    return None


def _drop_link_value(key: str) -> None:
    """Remove ``key`` from this session's URL before a widget reads it, so the widget keeps its default.

    Streamlit 1.67 seeds a bound widget from the URL values of the page load (``_initial_query_params``) and
    from the current ones; it parses them itself and applies what it can (``?p00_new=1.5`` becomes 1, the last
    of a repeated value wins, an empty multiselect value clears the selection) or raises from its deserializer
    (``int(float('inf'))`` in ``number_input``: a stack trace). A value :func:`persist` reports as ignored is
    therefore removed from both before the widget is built (the browser's address bar loses it too)."""
    from streamlit.runtime.scriptrunner_utils.script_run_context import get_script_run_ctx

    ctx = get_script_run_ctx()
    if ctx is None:                      # bare mode: no URL
        return
    with ctx.session_state.query_params() as qp:
        qp.remove_param(key)
        qp._initial_query_params.pop(key, None)   # Streamlit has no public call for the page load's values


def _shown_link_value(raw: list[str]) -> str:
    """A link's values as a notice shows them: joined by commas, cut to :data:`LINK_SHOWN_CHARS` characters."""
    text = ", ".join(raw)
    return text if len(text) <= LINK_SHOWN_CHARS else f"{text[:LINK_SHOWN_CHARS]}… ({len(text):,} characters)"


def persist(key: str, default=None, *, options=None, min_value=None, max_value=None, format_func=None,
            max_chars=None) -> str:
    """A widget key starting at ``default``; use as ``key=persist(...), persist_state="session"``.

    The stored session value is checked on every run against the widget's constraints: the type of
    ``default``, ``options`` (selectbox / select_slider / multiselect) and ``min_value`` /
    ``max_value`` (slider / number_input). A None, wrongly typed or invalid value (e.g. from a
    session written by another version of the page) falls back to ``default`` (or, when it is None,
    to the widget's own first option) with a toast saying so. A widget bound to the URL
    (``bind="query-params"``) whose query parameter is malformed (``nan``, ``inf``, ``1.5`` for an integer, one
    end of a range, an empty multiselect), out of range, longer than ``max_chars`` (a text widget's limit) or given
    twice for a one-value widget keeps its value, and a toast says the link's value was ignored: the value is
    removed from the URL before the widget is built (:func:`_drop_link_value`), so Streamlit never parses it. A
    link's value is checked once per session: when another widget later lowers this one's bound, the old link
    value is not reported after the fact. Pass the widget's
    ``format_func`` too: the URL then carries the option's label, and only a label is a valid link value.

    A widget bound to the URL also takes ``default`` as its own ``value=`` / ``index=`` / ``default=``:
    Streamlit drops a URL value equal to the widget's declared default, which without it would be the
    minimum or first option (``.streamlit/config.toml`` silences the resulting duplicate-default
    warning). Returns key."""
    state = st.session_state
    state.setdefault(PERSISTED_KEYS, set()).add(key)
    raw = st.query_params.get_all(key) if key in st.query_params else []
    checked = state.setdefault(CHECKED_LINKS, set())
    if raw and (key, tuple(raw)) not in checked:   # once per value: a bound lowered later by another widget
        checked.add((key, tuple(raw)))             # makes no old link value "bad" after the fact
        many = len(raw) > 1 and not isinstance(default, (list, tuple))
        why = f"given {len(raw)} times" if many else _url_value_problem(
            raw if len(raw) > 1 or isinstance(default, (list, tuple)) else raw[0], default, options, min_value,
            max_value, format_func, max_chars)
        if why is not None:
            _drop_link_value(key)                  # the widget must not take what the notice says was ignored
            st.toast(f"The link's {key}={_shown_link_value(raw)} is {why}; it was ignored.", icon=":material/link_off:")
    if key in state:
        why = _invalid(state[key], default, options, min_value, max_value)
        if why is not None:
            st.toast(f"{key}: the stored value {state[key]!r} is {why}; using the default {default!r} instead.",
                     icon=":material/restart_alt:")
            del state[key]
    if key not in state and default is not None:
        state[key] = default
    return key


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
    """Call the input widget ``make`` (``st.slider``, ``cols[1].selectbox``, ...) bound to the URL and kept across
    page switches, starting at ``default``; returns its value. The default, options and bounds are stated once, for
    the widget and for :func:`persist` alike: ``args`` are the widget's own positional arguments after the label
    (min and max of a slider / number_input, the options of a selectbox / radio / select_slider / multiselect).
    ``clamp``: the value's upper bound depends on another widget (:func:`persist_clamped`): True for the slider's max,
    or that bound; ``known``: the options do (every value they can ever hold, :func:`persist_within`). Other
    ``kwargs`` go to the widget."""
    kind = make.__name__
    if kind in ("slider", "number_input"):
        lo, hi = args[0], (args[1] if clamp is True or clamp is False else clamp)
        key = persist_clamped(key, default, lo, hi) if clamp is not False else persist(key, default, min_value=lo,
                                                                                       max_value=hi)
        start = {"value": min(default, hi)}
    elif kind in OPTION_WIDGETS:
        options = list(args[0])
        key = (persist_within(key, default, options, known) if known is not None else
               persist(key, default, options=options, format_func=kwargs.get("format_func")))
        start = ({"index": options.index(default)} if kind in ("selectbox", "radio") else
                 {"default" if kind == "multiselect" else "value": default})
    else:                                           # checkbox, toggle, text_input, text_area
        key, start = persist(key, default, max_chars=kwargs.get("max_chars")), {"value": default}
    value = make(label, *args, key=key, bind="query-params", persist_state="session", **start, **kwargs)
    if clamp is not False:
        st.session_state[key + LAST_SHOWN] = value
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
