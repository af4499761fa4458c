"""The only ``st.error`` texts a page may show in the app tests (AppTest sweep, page helpers, browser),
each with the reason it is an intentional state (bad input the page explains) rather than a bug. Any
other ``st.error`` fails those tests."""
import re

# (page, regex matched against the st.error text, reason it is intentional)
ALLOWED_ERRORS: list[tuple[str, str, str]] = [
]


def allowed(path: str, text: str) -> str | None:
    """The reason ``text`` is an intentional error on ``path``, or None."""
    return next((why for page, pattern, why in ALLOWED_ERRORS if page == path and re.search(pattern, text)), None)
