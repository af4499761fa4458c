"""``lab.state_write``: the slot write vs ReplaySSM sweep through the real batched engine counts the bytes the
formula predicts (state once per R steps, a record on the others, the conv window every step), and its
predicted table matches hand-computed demo numbers; bad sizes are refused."""
from __future__ import annotations

import pytest

from lab.state_write import predicted_bytes, state_write_sweep


def test_state_write_sweep_counts_the_predicted_bytes():
    sweep = state_write_sweep(batches=(1, 3), ring_sizes=(2, 4), window=2, repeats=8)   # 16 steps: whole periods
    rows = {(r["batch"], r["ring_size"]): r for r in sweep.rows}
    assert set(rows) == {(b, r) for b in (1, 3) for r in (0, 2, 4)}
    for r in sweep.rows:
        assert r["total_B"] == pytest.approx(r["predicted_total_B"], rel=0, abs=1e-9), r
        assert r["step_q1_ms"] <= r["step_ms"] <= r["step_q3_ms"]
    for b in (1, 3):
        slot, r4 = rows[(b, 0)], rows[(b, 4)]
        assert slot["speedup_vs_slot"] == 1.0 and slot["records_B"] == 0
        assert r4["state_B"] == slot["state_B"] / 4 and r4["conv_B"] == slot["conv_B"]
    assert sweep.conditions.repeats == 8 and sweep.window == 2


def test_predicted_bytes_demo_by_hand():
    """Demo: 6 KDA layers, H = 4, K = V = 32, conv 2HK + HV = 384 channels, window W - 1 = 3, fp32."""
    state, conv, record = 6 * 4 * 32 * 32 * 4, 6 * 384 * 3 * 4, 6 * 4 * (2 * 32 + 32) * 4
    demo = {r["ring_size"]: r for r in predicted_bytes(ring_sizes=(16,), models=("demo",))}
    assert demo[0]["total_B"] == state + conv and demo[0]["vs_slot"] == 1
    assert demo[16]["total_B"] == state / 16 + conv + record * 15 / 16 == 42_432
    assert demo[16]["vs_slot"] == pytest.approx(42_432 / 125_952)


@pytest.mark.parametrize("kwargs", [dict(batches=()), dict(ring_sizes=(0,)), dict(batches=(1.5,)),
                                    dict(window=0), dict(repeats=3)], ids=["no-batch", "ring0", "batch-float",
                                                                            "window0", "repeats3"])
def test_state_write_sweep_bad_input(kwargs):
    with pytest.raises(ValueError):
        state_write_sweep(**kwargs)
