"""``EngineLoop``'s policies, pinned by when each request reached the engine and whether the loop lives (every
output is the same in any order): requests queued at the server go to the engine first come, first served, and
the engine never holds more than the loop's ``max_num_seqs`` (running + waiting), even when the engine itself would
take more. (What stops the loop — a failure of the model itself, :class:`serve.engine.EngineFailure` — is pinned in
``test_server_failures.py``; one request's failure is isolated inside the engine, ``tests/serve/test_engine_faults.py``.)"""
from __future__ import annotations

import asyncio

from serve.engine.request import RequestResult, RequestStatus
from serve.http.loop import EngineLoop
from serve.http.metrics import ServerMetrics
from serve.http.model import EngineSpec, build_engine
from serve.http.step_trace import StepTrace, read_step_trace

NUM = 4


async def run_all(loop: EngineLoop) -> tuple[list, list]:
    streams = [loop.submit(list(f"request {i}".encode()), 2) for i in range(NUM)]   # queued in this order
    ends = []
    for s in streams:
        while not isinstance(item := await asyncio.wait_for(s.events.get(), 60), RequestResult):
            pass
        ends.append(item)
    return streams, ends


def test_queued_requests_reach_the_engine_in_arrival_order_one_at_a_time(tmp_path):
    engine = build_engine(EngineSpec(max_model_len=64, max_num_seqs=4))          # the engine would take 4
    path = tmp_path / "steps.jsonl"
    loop = EngineLoop(engine, ServerMetrics("m", 16), max_num_seqs=1, max_queue=NUM, trace=StepTrace(path))
    loop.start()
    try:
        streams, ends = asyncio.run(run_all(loop))
    finally:
        loop.stop()
    assert [e.status for e in ends] == [RequestStatus.FINISHED] * NUM
    feeds = [s.feed_t for s in streams]
    assert feeds == sorted(feeds), "the server queue was not served first come, first served"
    for prev, nxt in zip(streams, streams[1:]):
        assert nxt.feed_t >= prev.last_t, "a request reached the engine while another was still in it"
    steps, _ = read_step_trace(path)
    assert max(s["running"] + s["waiting"] for s in steps) == 1
    assert max(s["queued"] for s in steps) == NUM - 1
