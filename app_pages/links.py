"""A page's URL parameters: declared once, drawn from the declaration, kept in the URL and across page switches.

- ``declare(*params)``: a page's first call, before any widget; ``params`` are its parameters as data
  (``app_pages.params``: ``Int``, ``Float``, ``Choice``, ``Range``, ``Multi``, ``Toggle``, ``Text``, each with its
  key, default and bounds). It removes from the URL, with a notice, each key shaped like the page's (``p08_...``)
  that it did not declare (``?p08_prefix=0``), and returns the page's :class:`PageLinks`.
- ``PageLinks.slider(where, label, key)`` (and ``number_input``, ``selectbox``, ``radio``, ``select_slider``,
  ``multiselect``, ``checkbox``, ``toggle``, ``text_input``, ``text_area``): the widget of the declared parameter
  ``key`` in ``where`` (``st``, a column), its default, options and bounds taken from the declaration. Its URL value
  is read when it changed (a page load, a pasted link, the browser's back / forward), checked and applied, or
  ignored with a notice; its stored session value is checked on every run; after the widget is drawn its value
  goes back to the URL (removed at the default). A key the page did not declare raises :class:`UndeclaredParameter`.
- ``keep_page_links(prefix)``: called by ``app.py`` once the page is known; drops the keys of other pages' widgets
  from the URL (the address bar keeps the query string on a page switch).

Synced by hand through the public ``st.query_params`` and ``st.session_state`` (``persist_state="session"`` keeps a
widget's value across page switches).
"""
from __future__ import annotations

import streamlit as st

from app_pages.params import APP_KEY, Choice, Float, Int, Multi, Param, Range, Text, Toggle, Unreadable

DECLARED = "_declared_parameters"     # the open page's PageLinks, for the tests
LINKED = "_linked_url_values"         # {key: the URL values this session last read or wrote for it}
LAST_SHOWN = "__last_shown"           # suffix: a narrowed widget's value when it was last on the page
LINK_SHOWN_CHARS = 60                 # a link value longer than this is cut in its notice (a long prompt)


class UndeclaredParameter(LookupError):
    """A page drew a widget for a key it did not declare (its ``declare(...)`` call lacks it)."""


def declare(*params: Param) -> PageLinks:
    """The page's URL parameters: call once, before the page's first widget, with every parameter the page may draw
    (those drawn only for some settings too: their links must survive a run that hides them). Removes from the URL
    each key of the page's shape (``p<NN>_...``, this page's number) that is not one of ``params``, with a toast
    "Unknown link setting {key} ignored: ...", and records the declaration in ``st.session_state[DECLARED]``.
    Raises ValueError for no parameter, a key declared twice or keys of two pages."""
    links = PageLinks(params)
    st.session_state[DECLARED] = links
    unknown = [k for k in st.query_params if k.startswith(links.prefix) and APP_KEY.fullmatch(k) and k not in links]
    if unknown:
        st.query_params.from_dict({k: st.query_params.get_all(k) for k in st.query_params if k not in unknown})
    for key in unknown:
        st.toast(f"Unknown link setting {key} ignored: this page has no widget of that name.",
                 icon=":material/link_off:")
    return links


class PageLinks:
    """A page's declared parameters (``keys``, all starting with ``prefix``), and the widgets drawn from them.

    Every draw method takes ``where`` (``st`` or a container), the widget's ``label`` and the declared ``key``, and
    passes other keyword arguments (``help``, ``disabled``, ``height``, ``horizontal``) to the widget; not
    ``on_change``, which the draw sets. Two more, for a widget that depends on another one this run:

    - ``max_value`` (numbers) or ``options`` (a Choice): bounds within the declared ones (``Param.narrowed``); a value
      the widget showed last run that they leave out follows silently (a number to the new bound, an option to the
      default), where any other value they refuse is reported;
    - ``default``: this run's default, within the bounds (a default that depends on another widget or on the link).

    A key not declared raises :class:`UndeclaredParameter`; a widget that does not fit the parameter's kind (a
    slider for a Choice) raises TypeError.
    """

    def __init__(self, params: tuple[Param, ...]) -> None:
        if not params:
            raise ValueError("declare() needs at least one parameter")
        self._params = {p.key: p for p in params}
        if len(self._params) != len(params):
            keys = [p.key for p in params]
            raise ValueError(f"a key declared twice: {sorted({k for k in keys if keys.count(k) > 1})}")
        prefixes = {p.prefix for p in params}
        if len(prefixes) != 1:
            raise ValueError(f"keys of more than one page declared together: {sorted(prefixes)}")
        self.prefix = prefixes.pop()

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(self._params)

    def __contains__(self, key: str) -> bool:
        return key in self._params

    def __getitem__(self, key: str) -> Param:
        if key not in self._params:
            raise UndeclaredParameter(f"{key} is drawn but not declared: add it to the page's declare(...) call "
                                      f"(declared: {', '.join(sorted(self._params))})")
        return self._params[key]

    def _param(self, key: str, kinds: tuple[type, ...], widget: str, **narrow) -> tuple[Param, bool]:
        """(the parameter ``key`` within this run's bounds, whether they are narrower than the declaration)."""
        declared = self[key]
        if not isinstance(declared, kinds):
            raise TypeError(f"{key} is declared as a {type(declared).__name__}; a {widget} draws "
                            f"{' or '.join(k.__name__ for k in kinds)}")
        narrow = {k: v for k, v in narrow.items() if v is not None}
        if not narrow:
            return declared, False
        return declared.narrowed(**narrow), set(narrow) != {"default"}

    # numbers
    def slider(self, where, label: str, key: str, *, max_value=None, default=None, **kwargs):
        p, narrowed = self._param(key, (Int, Float), "slider", max_value=max_value, default=default)
        shown_max = p.max_value if p.max_value > p.min_value else p.min_value + (p.step or 1)   # a slider needs lo < hi
        return _draw(where.slider, label, p, narrowed, kwargs, min_value=p.min_value, max_value=shown_max,
                     value=p.default, step=p.step)

    def number_input(self, where, label: str, key: str, *, max_value=None, default=None, **kwargs):
        p, narrowed = self._param(key, (Int, Float), "number_input", max_value=max_value, default=default)
        return _draw(where.number_input, label, p, narrowed, kwargs, min_value=p.min_value, max_value=p.max_value,
                     value=p.default, step=p.step)

    # options
    def selectbox(self, where, label: str, key: str, *, options=None, default=None, **kwargs):
        p, narrowed = self._param(key, (Choice,), "selectbox", options=options, default=default)
        return _draw(where.selectbox, label, p, narrowed, kwargs, options=p.options, format_func=p.label,
                     index=p.options.index(p.default))

    def radio(self, where, label: str, key: str, *, options=None, default=None, **kwargs):
        p, narrowed = self._param(key, (Choice,), "radio", options=options, default=default)
        return _draw(where.radio, label, p, narrowed, kwargs, options=p.options, format_func=p.label,
                     index=p.options.index(p.default))

    def select_slider(self, where, label: str, key: str, *, options=None, default=None, **kwargs):
        p, narrowed = self._param(key, (Choice, Range), "select_slider", options=options, default=default)
        return _draw(where.select_slider, label, p, narrowed, kwargs, options=p.options, format_func=p.label,
                     value=p.default)

    def multiselect(self, where, label: str, key: str, **kwargs):
        p, narrowed = self._param(key, (Multi,), "multiselect")
        return _draw(where.multiselect, label, p, narrowed, kwargs, options=p.options, format_func=p.label,
                     default=list(p.default))

    # true / false, text
    def checkbox(self, where, label: str, key: str, **kwargs):
        p, narrowed = self._param(key, (Toggle,), "checkbox")
        return _draw(where.checkbox, label, p, narrowed, kwargs, value=p.default)

    def toggle(self, where, label: str, key: str, **kwargs):
        p, narrowed = self._param(key, (Toggle,), "toggle")
        return _draw(where.toggle, label, p, narrowed, kwargs, value=p.default)

    def text_input(self, where, label: str, key: str, **kwargs):
        p, narrowed = self._param(key, (Text,), "text_input")
        return _draw(where.text_input, label, p, narrowed, kwargs, value=p.default, max_chars=p.max_chars)

    def text_area(self, where, label: str, key: str, **kwargs):
        p, narrowed = self._param(key, (Text,), "text_area")
        return _draw(where.text_area, label, p, narrowed, kwargs, value=p.default, max_chars=p.max_chars)


def _draw(make, label: str, param: Param, narrowed: bool, kwargs: dict, **start):
    """Draw the widget ``make`` for ``param`` (this run's bounds) with ``start`` (its default, options and bounds as
    the widget takes them) and ``kwargs``: the shown value that the narrowed bounds leave out follows
    (:func:`_follow`), the URL value is taken if it changed (:func:`_take_link`), the stored one is checked
    (:func:`_settle`); after the widget, its value goes to the URL (no key at the default). Returns the value."""
    key, state = param.key, st.session_state
    if narrowed:
        _follow(param)
    _take_link(param)
    _settle(param)
    value = make(label, key=key, persist_state="session", on_change=_widget_moved, **start, **kwargs)
    if narrowed:
        state[key + LAST_SHOWN] = value
    form = param.format(value)
    _set_link(key, [] if form == param.format(param.default) else form)
    return value


def _follow(param: Param) -> None:
    """A value the widget showed last run, now outside this run's narrowed bounds (another widget lowered them),
    moves to ``param.follow`` silently: dependent widgets constrain each other instead of failing. A value the
    widget never showed (a session written by another version of the page, or by code) is left to :func:`_settle`,
    which reports it."""
    state = st.session_state
    shown = state.get(param.key + LAST_SHOWN)
    stored = state.get(param.key, shown)             # hidden last run: Streamlit restores the value it showed then
    if stored is not None and type(stored) is type(shown) and stored == shown and param.check(stored) is not None:
        state[param.key] = param.follow(stored)


def _settle(param: Param) -> None:
    """The stored session value checked against ``param`` (type, options, bounds): one it cannot take (None, of the
    wrong type, out of bounds: a session written by another version of the page) falls back to the default with a
    toast saying so. No stored value: the default."""
    state, key = st.session_state, param.key
    if key in state:
        why = param.check(state[key])
        if why is not None:
            st.toast(f"{key}: the stored value {state[key]!r} is {why}; using the default {param.default!r} instead.",
                     icon=":material/restart_alt:")
            del state[key]
    if key not in state:
        state[key] = list(param.default) if isinstance(param, Multi) else param.default


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


def _take_link(param: Param) -> None:
    """Seed the widget's session value from the key's URL values when they differ from those this session last read
    or wrote for it (a page load, a pasted link, the browser's back / forward): a value ``param.parse`` reads
    becomes the widget's value; one it refuses is removed from the URL with a notice and the widget keeps its
    value. A valid link value, once applied, is not checked again: when another widget later lowers this one's
    bound, the old link value is not reported after the fact. A key gone from the URL that this session had put
    there (back to a view at the default) sets the widget back to its default. Unchanged values are left alone,
    and so is every value in a rerun the user started by moving a widget (:func:`_widget_moved`)."""
    state, key = st.session_state, param.key
    raw = st.query_params.get_all(key) if key in st.query_params else []
    last = state.setdefault(LINKED, {}).get(key, ())
    if tuple(raw) == last:
        return
    if not raw:
        state[LINKED][key] = ()
        state[key] = list(param.default) if isinstance(param, Multi) else param.default
        return
    try:
        state[key] = param.parse(raw)
        state[LINKED][key] = tuple(raw)
    except Unreadable as exc:
        _set_link(key, [])                     # the widget must not take what the notice says was ignored
        st.toast(f"The link's {key}={_shown_link_value(raw, str(exc))} is {exc}; it was ignored.",
                 icon=":material/link_off:")


def _widget_moved() -> None:
    """``on_change`` of every drawn parameter: the user moved a widget, and this rerun carries the address bar's
    URL, which may lag behind what the last run wrote (a second move before that run's URL update reached the
    browser). Every key's URL values are taken as read, so no widget is seeded from them this run (the user's
    move wins, as it does with Streamlit's own binding); the values drawn go back to the URL after."""
    linked = st.session_state.setdefault(LINKED, {})
    for key in linked:
        linked[key] = tuple(st.query_params.get_all(key))


def keep_page_links(prefix: str) -> None:
    """Remove from the URL the keys of other pages' widgets this session has drawn (a key not starting with
    ``prefix``, ``"p05_"``): the browser keeps the query string when the user switches pages, and they would ride
    along in this page's links (Streamlit's own binding drops them too). A key whose widget this session never drew
    stays: ``/?p04_draft=3``, then a switch to page 04, still opens it at 3. The widgets keep their values in the
    session (``persist_state``); this session forgets it wrote them, so their absence is not read as "back to the
    default" on return."""
    linked = st.session_state.get(LINKED, {})
    other = [k for k in st.query_params if k in linked and not k.startswith(prefix)]
    if other:
        kept = {k: st.query_params.get_all(k) for k in st.query_params if k not in other}
        st.query_params.from_dict(kept)       # one URL update for all
    for k in [k for k in linked if not k.startswith(prefix)]:
        linked[k] = ()
