"""Page 13 says why a class is missing from its TTFT chart: Kimi K3 on one replica, with loads as shares of that
fleet's own capacity, gives Batch a steady rate of 0.04 req/s, and in the simulated time none arrives (at these loads
the seeded arrivals hold no Batch request); the page names the class and the rate instead of dropping it
silently."""
from tests.app.page_helpers import open_page


def test_a_class_without_requests_is_explained():
    at = open_page("app_pages/13_fleet_budgets.py", p13_model="kimi-k3", p13_vip_load=5, p13_standard_load=5,
                   p13_vip_weight=8, p13_num_replicas=1, p13_burst_load=400, p13_burst_duration_s=30,
                   p13_standard_budget=10, p13_load_basis="own")
    notes = [i.value for i in at.info]
    assert any(n.startswith("No Batch request completed") and "none arrived" in n for n in notes), notes
    table = next(d.value for d in at.dataframe if "isolation" in d.value.columns)   # the per-class TTFT table
    classes = {str(c) for c in table["klass"]}
    assert "Batch" not in classes and {"VIP", "Standard"} <= classes, classes
