"""Page 05's defaults show what its text claims: when the mix flips, the unified pool keeps admitting while the
static split (sized for the first half's mix) runs dry in one kind and idles in the other."""
from tests.app.page_helpers import chart_spec, open_page, plotly_values


def _phase2(at, pool: str) -> dict[str, int]:
    """Phase-2 requests of ``pool`` ("unified" / "static split") per outcome, read from the outcomes chart."""
    out = {}
    for trace in chart_spec(at, "p05_outcomes")["data"]:
        bars = dict(zip(trace["x"], plotly_values(trace["y"])))
        out[trace["name"]] = int(bars[f"phase 2 · {pool}"])
    return out


def test_default_flip_shows_the_unified_pool_admitting_what_the_static_split_rejects():
    at = open_page("app_pages/05_page_pool.py")
    unified, static = _phase2(at, "unified"), _phase2(at, "static split")
    assert unified["admitted"] + unified["rejected"] == static["admitted"] + static["rejected"]   # same arrivals
    assert unified["admitted"] >= 1.4 * static["admitted"], (unified, static)
    assert static["rejected"] >= 0.25 * (static["admitted"] + static["rejected"]), static   # the split runs dry
    assert unified["rejected"] <= 0.05 * (unified["admitted"] + unified["rejected"]), unified
