"""``EngineLoop``'s policies, pinned by when each request reached the engine and whether the loop lives (every
output is the same in any order): requests queued at the server go to the engine first come, first served, and
the engine never holds more than the loop's ``max_num_seqs`` (running + waiting), even when the engine itself would
take more; a step that raises now and then (a failed publish aborts its request) does not stop the loop, only
``MAX_STEP_FAILURES`` in a row do."""
from __future__ import annotations

import asyncio

from serve.http.loop import MAX_STEP_FAILURES, EngineLoop
from serve.http.metrics import ServerMetrics
from serve.http.model import EngineSpec, build_engine
from serve.http.step_trace import StepTrace, read_step_trace
from serve.request import RequestResult, RequestStatus

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


def test_step_errors_stop_the_loop_only_when_consecutive():
    """Every other step raises (MAX_STEP_FAILURES of them and more, never two in a row): the loop lives on and the
    request finishes; then MAX_STEP_FAILURES in a row end it (the request with them, alive False)."""
    engine = build_engine(EngineSpec(max_model_len=64, max_num_seqs=1))
    real, calls = engine.step, []

    def every_other_step_fails():
        calls.append(1)
        if len(calls) % 2:
            raise RuntimeError("injected step failure")
        return real()

    def always_fails():
        raise RuntimeError("injected: always")

    engine.step = every_other_step_fails
    loop = EngineLoop(engine, ServerMetrics("m", 16), max_num_seqs=1, max_queue=1)
    loop.start()

    async def one(max_tokens: int):
        s = loop.submit(list(b"some prompt"), max_tokens)
        while not isinstance(item := await asyncio.wait_for(s.events.get(), 60), RequestResult):
            pass
        return item

    try:
        assert asyncio.run(one(MAX_STEP_FAILURES + 2)).status is RequestStatus.FINISHED
        assert len(calls) > 2 * MAX_STEP_FAILURES and loop.alive
        engine.step = always_fails
        end = asyncio.run(one(4))
        assert end.status is RequestStatus.ABORTED and "always" in end.reason and not loop.alive
    finally:
        loop.stop()
