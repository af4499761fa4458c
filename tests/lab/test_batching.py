"""lab.batching: the live continuous-batching replay behind page 16."""
import pytest
import torch

from lab.batching import alone_run, batching_run, decode_throughput, demo_engine


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


def test_speculation_counts_verify_rows_not_prefill_tokens():
    """With speculation every decoding request verifies in a verify row (its last token + drafts): those are counted
    as verify rows, and prefill tokens are only the prompts' (their sum is every prompt token, each prefilled once);
    the chart once drew verify tokens as prefill tokens and 0 decode rows throughout."""
    run = batching_run(max_num_seqs=4, max_num_batched_tokens=64, num_state_slots=2, num_requests=3, speculation=True)
    assert run.all_bitwise
    steps = run.steps
    assert steps["verify rows"].sum() > 0 and (steps["verify rows"] <= 2).all()
    assert steps["prefill tokens"].sum() == run.requests["prompt tokens"].sum()


def test_bad_settings_name_the_input():
    with pytest.raises(ValueError, match="num_state_slots"):
        batching_run(num_state_slots=0)


def test_decode_throughput_table():
    tp = decode_throughput(batches=(1, 4), steps=1, repeats=5)
    assert list(tp.table["batch"]) == [1, 4] and (tp.table["tokens_per_s"] > 0).all()
    assert tp.table["speedup"].iloc[0] == 1.0


def test_alone_run_ignores_the_batch_limits():
    """A lone request is one row holding one slot: its tokens and logits are bitwise the same whatever max_num_seqs
    and the state slots, with and without speculation (why alone_run keeps one result for all of them)."""
    prompt = [(7 * i) % 256 for i in range(70)]                   # longer than the budget: two prefill chunks
    for spec in (False, True):
        tokens, logits = alone_run.__wrapped__(tuple(prompt), 9, 64, spec)
        assert len(tokens) == 9 and logits.shape == (9, 256)
        for seqs, slots in ((8, 6), (16, 2)):
            res = demo_engine(seqs, 64, slots, spec).generate(prompt, 9, record_logits=True)
            assert res.output_tokens == tokens and torch.equal(res.logits, logits), (spec, seqs, slots)
