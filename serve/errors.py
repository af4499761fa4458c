"""Error types the UI shows to the user as ``st.error`` instead of a stack trace, and the argument checks
(an int with a lower bound, one of a set of choices) the serve and lab layers share."""

UserFacingErrors = (ValueError, RuntimeError, KeyError, TimeoutError)


def check_int(name: str, val, minimum: int = 1) -> int:
    """``val`` if it is an int >= ``minimum`` (a bool is not an int here); else ValueError "``name`` must be an
    int >= ``minimum``, got ``val``"."""
    if isinstance(val, bool) or not isinstance(val, int) or val < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {val!r}")
    return val


def check_choice(name: str, value, allowed):
    """``value`` if it is in ``allowed``; else ValueError "``name`` must be one of ``allowed``, got ``value``"."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value
