"""Page 07's what-if: ticking "drop one group's checkpoint" at the defaults changes the lookup. Its boundary starts
at the one the lookup stops at (the hit b), not at the deepest checkpoint, which lies past the last prompt's KV run
and which the lookup never reaches (dropping it changed nothing)."""
import re

from tests.app.page_helpers import open_page


def _hit(at) -> int:
    return int(next(re.search(r"Hit b = (\d+) tokens", m.value).group(1) for m in at.markdown if "Hit b =" in m.value))


def test_default_drop_moves_the_hit():
    at = open_page("app_pages/07_prefix_anatomy.py")
    before = _hit(at)
    at.checkbox(key="p07_drop").check().run()
    assert not at.exception, [e.value for e in at.exception]
    at_boundary = int(at.selectbox(key="p07_drop_at").value)
    assert at_boundary == before > 0
    assert _hit(at) < before, (before, _hit(at))
