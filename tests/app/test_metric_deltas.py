"""Metric deltas read at a glance: an arrow only on a real, non-zero change, pointing the way of its sign.

For every ``st.metric`` on every page (Home and every tab) at its defaults: a delta that is a note
(``"KDA state, copied"``, ``"R² 0.998"``, ``"see below"``) shows no arrow; a delta that is a change
(starts with a sign or a digit) shows no arrow when it rounds to zero (``"0 vs cold"``, ``"-0%"``), a down arrow
when it is negative (ASCII ``-`` or Unicode ``−``) and an up arrow otherwise.
"""
import re

import pytest
from streamlit.proto.Metric_pb2 import Metric

from app_pages.registry import HOME, TABS
from tests.app.page_helpers import open_page

NONE, UP, DOWN = Metric.MetricDirection.NONE, Metric.MetricDirection.UP, Metric.MetricDirection.DOWN
CHANGE = re.compile(r"^[+\-−]?\d")                       # a signed or unsigned number first: a change
ZERO = re.compile(r"^[+\-−]?0+(?:[.,]0+)?\s*(?:%|×|\s|$)")   # a change that rounds to zero


def delta_problem(m: Metric) -> str | None:
    """Why metric ``m``'s arrow misreads its delta, or None."""
    delta = m.delta.strip()
    if not delta:
        return None
    if not CHANGE.match(delta):
        return None if m.direction == NONE else f"{m.label!r}: the note {delta!r} has an arrow"
    if ZERO.match(delta):
        return None if m.direction == NONE else f"{m.label!r}: the zero change {delta!r} has an arrow"
    want = DOWN if delta[0] in "-−" else UP
    if m.direction not in (want, NONE):
        return f"{m.label!r}: {delta!r} points {Metric.MetricDirection.Name(m.direction).lower()}"
    return None


@pytest.mark.parametrize("path", [HOME.path] + [t.path for t in TABS], ids=lambda p: p.split("/")[-1][:-3])
def test_metric_arrows(path):
    at = open_page(path)
    problems = [p for p in (delta_problem(m.proto) for m in at.metric) if p]
    assert not problems, f"{path}:\n" + "\n".join(problems)


@pytest.mark.parametrize("delta, direction, ok", [
    ("KDA state, copied", NONE, True), ("KDA state, copied", UP, False), ("-48 vs cold", DOWN, True),
    ("0 vs cold", UP, False), ("-0%", DOWN, False), ("−12 ms", UP, False), ("12 ms", UP, True), ("0.5×", UP, True)])
def test_delta_problem_rules(delta, direction, ok):
    assert (delta_problem(Metric(label="x", delta=delta, direction=direction)) is None) == ok


def test_home_without_a_hit_shows_no_arrow():
    """Request 2 shares nothing with request 1: warm computes as many prefill tokens as cold; "0 vs cold" is
    no change, so no arrow (Streamlit points a string delta "0 …" up)."""
    at = open_page(HOME.path)
    at.text_area(key="p00_second").set_value("Zebra crossings at noon.").run()
    assert not at.exception, [e.value for e in at.exception]
    prefill = next(m.proto for m in at.metric if m.label == "Prefill tokens computed")
    assert prefill.delta.startswith("0"), prefill.delta
    assert prefill.color == Metric.GRAY, "no change painted as a change (red: 'inverse' reads the string '0' as up)"
    problems = [p for p in (delta_problem(m.proto) for m in at.metric) if p]
    assert not problems, problems
