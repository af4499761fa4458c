"""Page 12's reference lines keep their labels apart: going from 2 replicas to 1, the ideal 1/2 and mod-N's expected
1 - 1/2 are the same line, and both labels were printed on top of each other at its right end."""
from tests.app.page_helpers import chart_spec, open_page


def _spots(fig) -> list[tuple]:
    return [(a.get("xref"), a["x"], a.get("xanchor"), a.get("yref"), round(float(a["y"]), 6), a.get("yanchor"))
            for a in fig["layout"]["annotations"]]


def test_reference_line_labels_never_share_a_spot():
    at = open_page("app_pages/12_fleet_scaling.py", p12_replicas=2, p12_action="remove")
    moved = chart_spec(at, "p12_moved_chart")
    ys = sorted(float(a["y"]) for a in moved["layout"]["annotations"])
    assert ys[0] == ys[-1] == 0.5                      # the two lines coincide here
    for key in ("p12_moved_chart", "p12_dip_chart"):
        spots = _spots(chart_spec(at, key))
        assert len(set(spots)) == len(spots), (key, spots)
    _check_event_label(chart_spec(at, "p12_dip_chart"), "left")


def _check_event_label(fig, side: str) -> None:
    """The event's label hangs from the top of the plot area (y = 1 of the y domain, anchored at its top), on
    ``side`` of its line: not on the x axis, where "bottom right" put it, and below the top edge while "no event"
    sits above the zero line, which after a dip is that edge."""
    event = next(a for a in fig["layout"]["annotations"] if a.get("yref") == "y domain")
    none = next(a for a in fig["layout"]["annotations"] if a["text"] == "no event")
    assert (event["y"], event["yanchor"], event["xanchor"]) == (1, "top", side), event
    assert (none["y"], none.get("yanchor"), none.get("yref")) == (0, "bottom", "y"), none


def test_event_label_stays_inside_the_plot_late_in_the_trace():
    """An event at 90 % of the trace labels its line on the left, so the label does not run off the right edge."""
    at = open_page("app_pages/12_fleet_scaling.py", p12_at=0.9)
    _check_event_label(chart_spec(at, "p12_dip_chart"), "right")
