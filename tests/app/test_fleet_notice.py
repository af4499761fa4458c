"""Page 14's "what to notice" is read off the run's own numbers, so it is true at any replica count: with one replica
every policy routes to it (no policy "loses hits"), and with several the hit ratios it quotes are the chart's."""
import re

import pytest

from tests.app.page_helpers import chart_spec, open_page, plotly_values

PAGE = "app_pages/14_fleet_simulation.py"


def _notice(at) -> str:
    return next(c.value for c in at.caption if "What to notice" in c.value)


def _hits(at) -> dict[str, float]:
    bars = chart_spec(at, "p14_hit_chart")["data"][0]
    return dict(zip(plotly_values(bars["x"]), plotly_values(bars["y"])))


@pytest.mark.parametrize("replicas", [1, 2], ids=lambda r: f"R{r}")
def test_p14_notice_holds_at_any_replica_count(replicas):
    at = open_page(PAGE, p14_requests=200, p14_replicas=replicas)
    notice, hits = _notice(at), _hits(at)
    assert len(hits) == 4, hits                                        # the default four policies
    if replicas == 1:    # the old caption said "round robin scatters sessions and loses most hits" here too
        assert len(set(hits.values())) == 1, hits
        assert "one replica" in notice and "round robin" not in notice, notice
    else:
        rr, best, best_name = re.search(r"round robin .*?: ([\d.]+)% of prompt tokens hit vs ([\d.]+)% with (.+?);",
                                        notice).groups()
        assert float(rr) == pytest.approx(100 * hits["round robin"], abs=0.051)
        assert float(best) == pytest.approx(100 * hits[best_name], abs=0.051)
        assert hits[best_name] == max(v for name, v in hits.items() if name != "round robin")
