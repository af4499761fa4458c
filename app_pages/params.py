"""The parameters a page keeps in its URL, declared as data: one frozen dataclass per kind of value.

Each states the key, the default and the bounds once, and reads, checks and writes its value:

- ``parse(raw)``: the value the URL values ``raw`` (the key's values, in order) ask for; raises :class:`Unreadable`
  saying why ("not an integer", "outside [0, 9999]", "given 2 times").
- ``check(value)``: why a stored session value cannot be the parameter's value (None if it can).
- ``format(value)``: the value as the URL carries it (a list: a range or a multiselect repeats the key).
- ``narrowed(...)``: the same parameter within tighter bounds that depend on another widget this run (a lower
  maximum, fewer options), and the default moved inside them.

==========  ===================================  ==============================  ===========================
kind        value                                URL form                        drawn as (``links.py``)
==========  ===================================  ==============================  ===========================
``Int``     an int in [min_value, max_value]     ``?p05_seed=3``                 slider, number_input
``Float``   a finite float in [min, max]         ``?p12_at=0.35``                slider, number_input
``Choice``  one of ``options``                   its label: ``?p03_preset=...``  selectbox, radio,
                                                                                 select_slider
``Range``   two of ``options``, low end first    the key twice                   select_slider
``Multi``   a subset of ``options``              the key once per option         multiselect
``Toggle``  True / False                         ``true`` / ``false``            checkbox, toggle
``Text``    text up to ``max_chars``             the text                        text_input, text_area
==========  ===================================  ==============================  ===========================

Nothing here imports Streamlit: ``tests/app/test_params.py`` checks each kind without an app.
"""
from __future__ import annotations

import abc
import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

APP_KEY = re.compile(r"p\d\d_\w+")    # the shape of this app's URL keys: page number, then the widget's name
OPTIONS_SHOWN = 12                     # a notice names at most this many of the values a widget takes


class Unreadable(ValueError):
    """A URL value a parameter cannot take; the message says why ("not an integer", "outside [0, 9]")."""


def _takes(labels: Sequence[str]) -> str:
    """The values a widget takes, as a notice lists them (cut after :data:`OPTIONS_SHOWN`)."""
    more = f", … ({len(labels)} in all)" if len(labels) > OPTIONS_SHOWN else ""
    return ", ".join(labels[:OPTIONS_SHOWN]) + more


def _one(raw: Sequence[str]) -> str:
    """The single URL value of a one-value parameter. Raises :class:`Unreadable` when the key is repeated."""
    if len(raw) != 1:
        raise Unreadable(f"given {len(raw)} times")
    return raw[0]


def _wrong_type(value, like: type) -> str | None:
    """Why ``value`` is not of type ``like`` (exactly: ``True`` is not the int ``1``), None if it is."""
    return None if type(value) is like else f"a {type(value).__name__}, not a {like.__name__}"


@dataclass(frozen=True)
class Param(abc.ABC):
    """A URL parameter (abstract: each kind below implements parse / check / format): ``key`` (``p<NN>_<name>``: the page number, then the widget's name) and ``default``.
    Raises ValueError for a malformed key or a default the parameter itself would refuse."""

    key: str
    default: Any

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not APP_KEY.fullmatch(self.key):
            raise ValueError(f"{self.key!r}: a URL key is p<NN>_<name> (page number, then the widget's name)")
        why = self.check(self.default)
        if why is not None:
            raise ValueError(f"{self.key}: the default {self.default!r} is {why}")

    @property
    def prefix(self) -> str:
        """The page's key prefix: ``p05_`` for ``p05_seed``."""
        return self.key[:4]

    @abc.abstractmethod
    def parse(self, raw: Sequence[str]) -> Any:
        """The value of the URL's strings for this key; raises ``Unreadable`` with the reason."""

    @abc.abstractmethod
    def check(self, value) -> str | None:
        """Why ``value`` is not one this widget takes (None: it is)."""

    @abc.abstractmethod
    def format(self, value) -> list[str]:
        """The URL's strings for ``value`` (one per repeated key)."""

    def narrowed(self, **bounds) -> Param:
        """This parameter within bounds narrower than the declared ones; kinds that have none raise TypeError."""
        raise TypeError(f"{self.key}: a {type(self).__name__} takes no bounds narrower than its declaration")

    def follow(self, value) -> Any:
        """Where a value this widget showed last run goes when the bounds of this run leave it out (another widget
        narrowed them): the nearest bound for a number, the default for an option."""
        return self.default


def _number_text(v) -> str:
    """A number as the URL carries it: a whole float without ``.0``, as Streamlit writes numbers."""
    if isinstance(v, float) and v == v and abs(v) != float("inf") and v == int(v):
        return str(int(v))
    return str(v)


@dataclass(frozen=True)
class _Number(Param):
    """An ``int`` or ``float`` in [``min_value``, ``max_value``]; ``step`` is the widget's."""

    min_value: Any
    max_value: Any
    step: Any = None
    kind = int                                   # the value's type (a class attribute, not a field)

    def __post_init__(self) -> None:
        if not self.min_value <= self.max_value:
            raise ValueError(f"{self.key}: min_value {self.min_value!r} > max_value {self.max_value!r}")
        super().__post_init__()

    def _bounds(self) -> str:
        return f"outside [{self.min_value}, {self.max_value}]"

    def parse(self, raw: Sequence[str]):
        """One finite number within the bounds (``nan`` and ``inf`` are not values of a slider)."""
        text = _one(raw)
        try:
            value = self.kind(text)
        except ValueError:
            if text.strip().lstrip("+-").isdigit():    # over Python's 4,300-digit int() limit
                raise Unreadable(self._bounds()) from None
            raise Unreadable("not an integer" if self.kind is int else "not a number") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise Unreadable("not a finite number")
        if not self.min_value <= value <= self.max_value:
            raise Unreadable(self._bounds())
        return value

    def check(self, value) -> str | None:
        why = _wrong_type(value, self.kind)
        if why is not None:
            return why
        if value != value:
            return "NaN"
        return None if self.min_value <= value <= self.max_value else self._bounds()

    def format(self, value) -> list[str]:
        return [_number_text(value)]

    def follow(self, value):
        return min(value, self.max_value)

    def narrowed(self, *, max_value=None, default=None) -> _Number:
        """This parameter up to ``max_value`` (at most the declared one; another widget lowered it), its default
        ``default`` (or the declared one) lowered to the bound. Raises ValueError outside the declaration."""
        hi = self.max_value if max_value is None else max_value
        if not self.min_value <= hi <= self.max_value:
            raise ValueError(f"{self.key}: max_value {hi!r} is outside the declared [{self.min_value}, "
                             f"{self.max_value}]")
        return dataclasses.replace(self, max_value=hi, default=min(self.default if default is None else default, hi))


@dataclass(frozen=True)
class Int(_Number):
    """An integer in [``min_value``, ``max_value``]: ``Int("p05_seed", 0, 0, 9999)``."""


@dataclass(frozen=True)
class Float(_Number):
    """A finite float in [``min_value``, ``max_value``]: ``Float("p12_at", 0.5, 0.1, 0.9, step=0.05)``."""

    kind = float


@dataclass(frozen=True)
class _Options(Param):
    """A value made of ``options`` (stored as a tuple), each carried in the URL as its label: ``format_func(option)``
    (the widget's own label) or ``str(option)``."""

    options: Sequence = ()
    format_func: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", tuple(self.options))
        if not self.options:
            raise ValueError(f"{self.key}: no options")
        super().__post_init__()

    def label(self, option) -> str:
        """The option as the widget shows it and the URL carries it."""
        return str(self.format_func(option)) if self.format_func is not None else str(option)

    def _option(self, text: str):
        """The option whose label is ``text``. Raises :class:`Unreadable` naming the options."""
        labels = [self.label(o) for o in self.options]
        if text not in labels:
            raise Unreadable(f"not one of the values this widget takes now ({_takes(labels)})")
        return self.options[labels.index(text)]

    def _why_not_option(self, value, like) -> str | None:
        """Why ``value`` is not one of the options (same type as ``like`` too: ``True`` is not the option ``1``)."""
        why = _wrong_type(value, type(like))
        if why is not None:
            return why
        return None if any(type(o) is type(value) and o == value for o in self.options) else "not one of the options"


@dataclass(frozen=True)
class Choice(_Options):
    """One of ``options``: ``Choice("p05_arrival", "steady", ["steady", "bursty"])``."""

    def parse(self, raw: Sequence[str]):
        return self._option(_one(raw))

    def check(self, value) -> str | None:
        return self._why_not_option(value, self.default)

    def format(self, value) -> list[str]:
        return [self.label(value)]

    def narrowed(self, *, options=None, default=None) -> Choice:
        """This parameter among ``options`` only (a subset of the declared ones: another widget rules the others
        out), its default ``default``, else the declared one if still offered, else the first of ``options``.
        Raises ValueError for an option the declaration does not have."""
        opts = self.options if options is None else tuple(options)
        strange = [o for o in opts if self._why_not_option(o, self.default) is not None]
        if strange or not opts:
            raise ValueError(f"{self.key}: options {strange or opts!r} are not among the declared ones")
        if default is None:
            default = self.default if any(type(o) is type(self.default) and o == self.default for o in opts) else opts[0]
        return dataclasses.replace(self, options=opts, default=default)


@dataclass(frozen=True)
class Range(_Options):
    """Two of ``options``, the low end first: ``Range("p03_context", (1024, 2 ** 20), CONTEXTS)``; the URL gives the
    key twice (``?p03_context=4096&p03_context=65536``)."""

    def parse(self, raw: Sequence[str]) -> tuple:
        if len(raw) != 2:
            raise Unreadable(f"{len(raw)} value{'' if len(raw) == 1 else 's'}, not a range of two (give it twice)")
        lo, hi = (self._option(t) for t in raw)
        if self.options.index(lo) > self.options.index(hi):
            raise Unreadable("a range whose low end comes second")
        return lo, hi

    def check(self, value) -> str | None:
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            return f"a {type(value).__name__}, not a range of two values"
        whys = [self._why_not_option(v, self.default[0]) for v in value]
        why = next((w for w in whys if w is not None), None)
        if why is None and self.options.index(value[0]) > self.options.index(value[1]):
            return "a range whose low end comes second"
        return why

    def format(self, value) -> list[str]:
        return [self.label(v) for v in value]


@dataclass(frozen=True)
class Multi(_Options):
    """A selection of ``options`` (its default a list or tuple of them): ``Multi("p15_policies", DEFAULT_POLICIES,
    POLICIES)``; the URL gives the key once per option, an empty selection as one empty value (``?p15_policies=``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "default", tuple(self.default))
        super().__post_init__()

    def parse(self, raw: Sequence[str]) -> list:
        if list(raw) in ([], [""]):
            raise Unreadable("an empty selection")
        repeated = sorted({t for t in raw if list(raw).count(t) > 1})
        if repeated:                         # a widget value is a set of options: one of them twice means nothing
            raise Unreadable(f"a selection that names {', '.join(repeated)} more than once")
        return [self._option(t) for t in raw]

    def check(self, value) -> str | None:
        if not isinstance(value, (list, tuple)):
            return f"a {type(value).__name__}, not a list"
        return None if all(v in self.options for v in value) else "not a subset of the options"

    def format(self, value) -> list[str]:
        return [self.label(v) for v in value] or [""]


@dataclass(frozen=True)
class Toggle(Param):
    """True or False, ``true`` / ``false`` in the URL (any case): ``Toggle("p07_drop", False)``."""

    def parse(self, raw: Sequence[str]) -> bool:
        text = _one(raw).lower()
        if text not in ("true", "false"):
            raise Unreadable("not true or false")
        return text == "true"

    def check(self, value) -> str | None:
        return _wrong_type(value, bool)

    def format(self, value) -> list[str]:
        return [str(value).lower()]


@dataclass(frozen=True)
class Text(Param):
    """Text up to ``max_chars`` characters (None: any length): ``Text("p00_first", FIRST, max_chars=2000)``. A longer
    link value is refused (Streamlit would cut it silently)."""

    max_chars: int | None = None

    def parse(self, raw: Sequence[str]) -> str:
        text = _one(raw)
        if self.max_chars is not None and len(text) > self.max_chars:
            raise Unreadable(f"{len(text):,} characters, over the {self.max_chars:,}-character limit")
        return text

    def check(self, value) -> str | None:
        return _wrong_type(value, str)

    def format(self, value) -> list[str]:
        return [value]
