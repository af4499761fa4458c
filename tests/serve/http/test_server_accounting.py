"""The server's accounting of a request that never reaches the engine, pinned by its metrics and its step-trace
record (its output cannot show it: it has none). Behind ``max_num_seqs=1`` a second request waits in the
server's queue: the waiting gauge counts it (server queue + engine waiting list: one running + one queued
reads 1); a client that gives up while it waits has it aborted with no token generated, the aborted counter
rises by one, and nothing of it is counted as prompt or generated tokens."""
from __future__ import annotations

import threading
import time

import httpx
import openai

from serve.http.app import create_app
from serve.http.background import serve_in_thread
from serve.http.model import EngineSpec, build_engine
from serve.http.step_trace import StepTrace, read_step_trace
from tests.serve.http.server_helpers import MODEL, metric, on_engine

HOLD_PROMPT = "hold the only slot"


def poll(url: str, name: str, ok, timeout_s: float = 20.0) -> float:
    """The series' value once ``ok(value)`` holds (or the last value read after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric(httpx.get(url + "/metrics").text, name, model_name=MODEL)
        if ok(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def test_a_client_that_gives_up_while_queued_is_aborted_unserved_and_the_waiting_gauge_counts_it(tmp_path):
    spec = EngineSpec(max_model_len=8192, max_num_seqs=1)      # the holder's 8,000 tokens outlast the 2 s wait
    path = tmp_path / "steps.jsonl"
    app = create_app(build_engine(spec), MODEL, spec.max_model_len, spec.max_num_seqs, 2, StepTrace(path))
    holding, release = threading.Event(), threading.Event()
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def hold():
            stream = client.completions.create(model=MODEL, prompt=HOLD_PROMPT, max_tokens=8000, stream=True)
            next(iter(stream))
            holding.set()
            release.wait(60)
            stream.close()

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert holding.wait(60)
            seen = {}

            def queued_client():                                             # gives up after 2 s without a byte
                try:
                    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "queued", "max_tokens": 5},
                                   timeout=httpx.Timeout(30, read=2.0))
                    seen["client"] = f"answered {r.status_code}"
                except httpx.ReadTimeout:
                    seen["client"] = "gave up"

            waiter = threading.Thread(target=queued_client)
            waiter.start()
            seen["waiting"] = poll(url, "vllm:num_requests_waiting", lambda v: v == 1, timeout_s=1.9)
            seen["running"] = metric(httpx.get(url + "/metrics").text, "vllm:num_requests_running", model_name=MODEL)
            waiter.join(30)
            assert seen["client"] == "gave up"
            assert (seen["running"], seen["waiting"]) == (1, 1), "one running + one queued must read 1 waiting"
            assert poll(url, "kda:requests_aborted_total", lambda v: v == 1) == 1
            assert poll(url, "vllm:num_requests_waiting", lambda v: v == 0) == 0
            assert len(on_engine(app, lambda e: list(e.running))) == 1            # the holder still runs
        finally:
            release.set()
            holder.join(60)
        assert poll(url, "kda:requests_aborted_total", lambda v: v == 2) == 2     # the holder, closed mid-stream
        assert on_engine(app, lambda e: dict(e.requests)) == {}, "the loop left an ended request in the engine"
        text = httpx.get(url + "/metrics").text
    _, reqs = read_step_trace(path)
    queued = [r for r in reqs if r["prompt_tokens"] == len(b"queued")]
    held = [r for r in reqs if r["prompt_tokens"] == len(HOLD_PROMPT)]
    assert len(queued) == 1 and len(held) == 1
    q = queued[0]
    assert (q["rid"], q["feed_t"], q["first_t"], q["output_tokens"], q["status"]) == (None, None, None, 0, "aborted")
    assert metric(text, "vllm:prompt_tokens_total", model_name=MODEL) == len(HOLD_PROMPT)
    assert metric(text, "vllm:generation_tokens_total", model_name=MODEL) == held[0]["output_tokens"] > 0
    assert metric(text, "vllm:request_success_total", model_name=MODEL, finished_reason="length") == 0
