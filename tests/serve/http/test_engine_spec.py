"""The server's engine is the batched one, sized by its spec: ``max_num_seqs`` reaches the engine's scheduler; a
``ring_size`` without the replay_ssm state write, or a bad state write, is refused; the default pool has the
fp32 sizing's bytes for every state dtype."""
import pytest
from fastapi.testclient import TestClient

from serve.http.app import create_app
from serve.http.model import EngineSpec, build_engine, load_model, pool_capacity
from tests.serve.http.server_helpers import metric


def test_server_engine_is_batched_with_the_specs_max_num_seqs():
    model = load_model("demo-tiny")
    engine = build_engine(EngineSpec("demo-tiny", max_model_len=64, max_num_seqs=6), model)
    assert engine.rows_per_forward is None and engine.sched_config.max_num_seqs == 6
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


def test_default_pool_keeps_the_fp32_bytes_and_bf16_holds_more_state_slots():
    """The default pool is the fp32 sizing for every ``state_dtype`` (same pages, same bytes), so bf16 states
    fit ~1.6x the state slots of fp32 in it (the demo model: fp32 conv windows stay), and /metrics shows it."""
    model = load_model("demo")
    caps = {}
    for dtype in ("fp32", "bf16"):
        spec = EngineSpec(max_model_len=1024, max_num_seqs=8, state_dtype=dtype)
        engine = build_engine(spec, model)
        caps[dtype] = pool_capacity(engine, spec.max_model_len)
        assert caps[dtype].state_slots == engine.pool.num_pages // engine.layout.state_pages
        with TestClient(create_app(engine, "kda-demo", 1024, 8, 2)) as client:
            text = client.get("/metrics").text
        assert metric(text, "kda:state_slots_capacity", model_name="kda-demo") == caps[dtype].state_slots
        assert metric(text, "kda:requests_capacity", model_name="kda-demo") == caps[dtype].requests
    assert caps["bf16"].num_pages == caps["fp32"].num_pages and caps["bf16"].pool_bytes == caps["fp32"].pool_bytes
    assert 1.55 <= caps["bf16"].state_slots / caps["fp32"].state_slots <= 1.7, caps
    assert caps["bf16"].requests > caps["fp32"].requests
