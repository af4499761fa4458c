"""Page 14's bytes chart: per replica, the bytes by kind held when its cached KV + states peaked, stacked under
the budget line. The old chart stacked each kind's own peak (reached at different times), which passed the
budget at small budgets."""
from lab.real_scale import free_bytes
from serve.scale.hardware import hardware
from tests.app.page_helpers import chart_spec, plotly_values
from tests.app.test_pages import _check, _fresh

PAGE = "app_pages/14_fleet_simulation.py"


def test_bytes_held_at_the_peak_stay_under_the_budget_line():
    at = _fresh(PAGE)
    at.select_slider(key="p14_budget").set_value("1/32").run()    # evictions: KV and states peak apart
    _check(at, f"{PAGE} budget 1/32")
    spec = chart_spec(at, "p14_bytes_chart")
    bars = [t for t in spec["data"] if t["type"] == "bar"]
    assert [t["name"] for t in bars] == ["cached KV", "cached states", "running request's state slots"]
    stacks = [sum(v) for v in zip(*(plotly_values(t["y"]) for t in bars))]
    budget = free_bytes("kimi-linear-48b-a3b", hardware("H200"), 8) / 32 / 1e9    # the page's default replica
    assert len(stacks) == 4 * 8 and min(stacks) > 0                  # 4 default routing policies x 8 replicas
    assert max(stacks) <= budget * (1 + 1e-12), (max(stacks), budget)
    assert max(stacks) > 0.9 * budget, "the budget should bind at 1/32"
    assert [sh["y0"] for sh in spec["layout"].get("shapes", [])] == [budget]   # the budget line
