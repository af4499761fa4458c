"""Error types the UI shows to the user as ``st.error`` instead of a stack trace, and the argument checks
(an int with a lower bound, a number > 0, a fraction, one of a set of choices) the serve and lab layers share."""
from numbers import Integral, Real

UserFacingErrors = (ValueError, RuntimeError, KeyError, TimeoutError)


def check_int(name: str, val, minimum: int = 1) -> int:
    """``val`` if it is an int (numpy's too; a bool is not) >= ``minimum``; else ValueError "``name`` must be an
    int >= ``minimum``, got ``val``"."""
    if isinstance(val, bool) or not isinstance(val, Integral) or val < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {val!r}")
    return val


def check_positive(name: str, val) -> float:
    """``val`` if it is a real number > 0 (not NaN, not a bool); else ValueError "``name`` must be > 0, got ``val``"."""
    if isinstance(val, bool) or not isinstance(val, Real) or not val > 0:
        raise ValueError(f"{name} must be > 0, got {val!r}")
    return val


def check_fraction(name: str, val) -> float:
    """``val`` if it is a real number in [0, 1] (not NaN, not a bool); else ValueError "``name`` must be in [0, 1],
    got ``val``"."""
    if isinstance(val, bool) or not isinstance(val, Real) or not 0 <= val <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {val!r}")
    return val


def check_choice(name: str, value, allowed):
    """``value`` if it is in ``allowed``; else ValueError "``name`` must be one of ``allowed``, got ``value``"."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value
