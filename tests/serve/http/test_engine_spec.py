"""The server's engine is the batched one, sized by its spec: ``max_num_seqs`` reaches the engine's scheduler; a
``ring_size`` without the replay_ssm state write, or a bad state write, is refused."""
import pytest

from serve.http.model import EngineSpec, build_engine, load_model


def test_server_engine_is_batched_with_the_specs_max_num_seqs():
    model = load_model("demo-tiny")
    engine = build_engine(EngineSpec("demo-tiny", max_model_len=64, max_num_seqs=6), model)
    assert engine.batched and engine.sched_config.max_num_seqs == 6
    rids = [engine.submit([1 + i, 2, 3], 4) for i in range(8)]
    engine.step()
    assert len(engine.running) == 6 and len(engine.waiting) == 2       # the engine itself caps the running batch
    for _ in range(20):
        engine.step()
    assert all(engine.result(r).status.name == "FINISHED" for r in rids)
    engine.check_integrity()


def test_engine_spec_refuses_a_ring_size_for_the_slot_write():
    with pytest.raises(ValueError, match="ring_size is the replay_ssm state write's ring"):
        EngineSpec(ring_size=4)
    with pytest.raises(ValueError, match="ring_size must be an int >= 1, got 0"):
        EngineSpec(state_write="replay_ssm", ring_size=0)
    with pytest.raises(ValueError, match="state_write must be one of"):
        EngineSpec(state_write="replay")
