"""Captions stay short: a caption is read at a glance under its chart; a derivation (formulas, sources, how it
was timed) goes in an expander. Every caption a page shows at its defaults (and behind its heavy-extra button,
``page_helpers.REVEAL``) is at most ``CAPTION_MAX`` characters."""
import pytest

from app_pages.registry import HOME, TABS
from tests.app.page_helpers import open_revealed

CAPTION_MAX = 350   # about three lines of the wide layout
PAGES = [HOME.path] + [t.path for t in TABS]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.split("/")[-1][:-3])
def test_captions_short(path):
    at = open_revealed(path)
    long = [f"{len(c.value)} chars: {c.value[:80]}…" for c in at.caption if len(c.value) > CAPTION_MAX]
    assert not long, f"{path}: captions over {CAPTION_MAX} characters (move the derivation to an expander):\n" + \
        "\n".join(long)
