"""Error types the UI shows to the user as ``st.error`` instead of a stack trace, and the positive-int
argument check the serve classes share."""

UserFacingErrors = (ValueError, RuntimeError, KeyError, TimeoutError)


def check_positive_int(name: str, val) -> int:
    """``val`` if it is an int > 0 (a bool is not); else ValueError naming ``name``."""
    if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
        raise ValueError(f"{name} must be a positive int, got {val!r}")
    return val
