"""lab.fleet_hashing / fleet_scaling / fleet_simulation: pages 11, 12 and 14 in one call each."""
import pytest

from lab.fleet import page_trace, where_prefix_lands
from lab.fleet_hashing import VNODES, fleet_hashing
from lab.fleet_scaling import fleet_scaling
from lab.fleet_simulation import fleet_simulation


def test_fleet_hashing_landing_matches_where_prefix_lands():
    run = fleet_hashing("ring", 8, 2, 160, 300)
    trace = page_trace(None, 300).requests
    assert run.num_requests == len(trace) == 300 and run.load.requests.sum() == 300
    for i in (0, 7, 299):
        one = run.landing[run.landing.request == i].drop(columns="request").reset_index(drop=True)
        assert one.equals(where_prefix_lands(trace, i, 8, 2, 160))
    assert list(run.balance.vnodes) == list(VNODES) and set(run.lookup.algorithm) >= {"ring", "maglev"}
    assert 0 <= run.hit_ratio <= run.ideal_ratio + 1e-12
    with pytest.raises(ValueError, match="algorithm"):
        fleet_hashing("nope", 8, 2, 160, 300)


def test_fleet_scaling_one_call():
    run = fleet_scaling(8, "add", 10_000, 160, 600, 2, 0.5, 100, "unlimited")
    assert run.replicas_after == 9 and run.at_request == 300 and run.routing_keys > 1
    mod_n = run.moved.set_index("algorithm").moved_fraction["mod_n"]
    assert mod_n > 0.8 and (run.moved.set_index("algorithm").moved_fraction.drop("mod_n") < 0.3).all()
    assert set(run.recovery.algorithm) == set(run.dip.algorithm)
    with pytest.raises(ValueError, match="capacity"):
        fleet_scaling(8, "add", 10_000, 160, 600, 2, 0.5, 100, "7")


def test_fleet_simulation_policies_and_progress():
    seen = []
    run = fleet_simulation(["ring", "round_robin"], 300, 4, 2, "8000", "vtc", 10, "none", 8, "a10g",
                           progress=seen.append)
    assert list(run.summary[run.summary["class"] == "all"].policy) == ["ring", "round_robin"]
    assert set(run.per_request.policy) == {"ring", "round_robin"} and len(run.per_request) == 600
    assert seen == sorted(seen) and seen[-1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="policies"):
        fleet_simulation([], 300, 4, 2, "8000", "vtc", 10, "none", 8, "a10g")
