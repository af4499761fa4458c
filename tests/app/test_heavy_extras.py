"""Heavy extras stay off the first render and still work on request: page 09's trace replay (16 cache
configurations) runs only after its button, then stays on for the session."""
import json
from pathlib import Path

from streamlit.testing.v1 import AppTest

from tests.app.verdicts import VERDICTS

TIMEOUT_S = 300
REPO = Path(__file__).resolve().parents[2]


def _chart_keys(at: AppTest) -> set[str]:
    return {c.proto.id for c in at.get("plotly_chart")}


def _chart_has_data(at: AppTest) -> bool:
    return all(json.loads(c.proto.spec).get("data") for c in at.get("plotly_chart"))


def test_prefix_miss_replay_behind_button():
    at = AppTest.from_file(str(REPO / "pages" / "09_prefix_miss.py"), default_timeout=TIMEOUT_S).run()
    assert not at.exception, [e.value for e in at.exception]
    before = _chart_keys(at)
    assert len(before) == 1, f"only section 1's chart before the button, got {len(before)}"
    assert [b.label for b in at.button] == ["Replay the trace"]
    at.button(key="p09_replay_button").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(_chart_keys(at)) == 4 and _chart_has_data(at)        # + capacity, causes, interval charts
    VERDICTS["pages/09_prefix_miss.py"](at)                         # incl. no capacity beats the ideal
    at.run()                                                        # a rerun (any widget) keeps the replay on
    assert len(_chart_keys(at)) == 4 and not at.button
