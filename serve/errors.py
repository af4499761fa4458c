"""Error types the UI shows to the user as ``st.error`` instead of a stack trace, and the argument checks
(a positive int, one of a set of choices) the serve and lab layers share."""

UserFacingErrors = (ValueError, RuntimeError, KeyError, TimeoutError)


def check_positive_int(name: str, val) -> int:
    """``val`` if it is an int > 0 (a bool is not); else ValueError naming ``name``."""
    if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
        raise ValueError(f"{name} must be a positive int, got {val!r}")
    return val


def check_choice(name: str, value, allowed):
    """``value`` if it is in ``allowed``; else ValueError "``name`` must be one of ``allowed``, got ``value``"."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value
