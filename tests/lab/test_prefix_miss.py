"""lab.prefix_miss: page 09 in one call; the 16 trace replays report progress through the callback."""
import pytest

from lab.prefix_miss import INTERVALS, prefix_miss


def test_prefix_miss_replays_and_progress():
    calls = []
    run = prefix_miss(64, 48, 16, 32, 2, "kimi-k3", 1, 1, 500, progress=lambda d, t: calls.append((d, t)))
    assert calls == [(i, 16) for i in range(1, 17)]  # one call per asked replay, in order
    assert run.next_shared == 48 and run.hit["hit_tokens"] <= 48 and run.check.outputs_identical
    assert len(run.capacity) == 5 and list(run.free.interval_tokens) == list(INTERVALS)
    assert run.limited.capacity_gb.nunique() == 1 and run.free.capacity_gb.isna().all()
    assert 0 <= run.ideal.token_hit_ratio <= 1 and run.num_requests == 500
    assert (run.capacity.token_hit_ratio <= run.ideal.token_hit_ratio + 1e-12).all()


def test_prefix_miss_caps_the_shared_prefix_and_checks_the_preset():
    assert prefix_miss(64, 512, 16, 32, 1, "kimi-k3", 8, 1, 500).next_shared == 64
    with pytest.raises(ValueError, match="preset"):
        prefix_miss(64, 0, 16, 32, 1, "demo", 1, 1, 500)
