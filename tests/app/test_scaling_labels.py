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
    dip = chart_spec(at, "p12_dip_chart")["layout"]["annotations"]
    event = next(a for a in dip if a.get("yref") == "y domain")
    assert event["y"] == 0 and event["yanchor"] == "bottom"   # at the bottom: clear of "no event" at y = 0 (the top)
