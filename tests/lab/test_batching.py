"""lab.batching: the live continuous-batching replay behind page 16."""
import pytest

from lab.batching import batching_run, decode_throughput


def test_replay_is_bitwise_and_respects_the_slot_ceiling():
    run = batching_run(max_num_seqs=6, max_num_batched_tokens=64, num_state_slots=3, num_requests=6)
    assert run.all_bitwise and run.requests["bitwise equal to alone"].all()
    steps = run.steps
    assert (steps["running (state slots held)"] <= 3).all()
    assert steps["running (state slots held)"].max() == 3          # the ceiling binds with 6 requests
    assert (steps["prefill tokens"] + steps["decode rows"] <= 64).all()
    dec = steps["decode rows"]
    assert ((dec == 0) | ((dec + steps["pad rows"]).isin([1, 2, 4, 8, 16, 32, 64]))).all()
    assert len(run.requests) == 6 and (run.requests["TTFT ms"] > 0).all()


def test_bad_settings_name_the_input():
    with pytest.raises(ValueError, match="num_state_slots"):
        batching_run(num_state_slots=0)


def test_decode_throughput_table():
    tp = decode_throughput(batches=(1, 4), steps=1, repeats=5)
    assert list(tp.table["batch"]) == [1, 4] and (tp.table["tokens_per_s"] > 0).all()
    assert tp.table["speedup"].iloc[0] == 1.0
