"""The server never hangs: a non-streaming client that gives up has its request aborted; a request the pool
can never hold is a 503; an engine whose step keeps raising ends every request with 503 and fails /health."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from serve.engine import ServeEngine
from serve.http.app import create_app
from serve.http.background import serve_in_thread
from serve.http.model import EngineSpec, build_engine, load_model
from serve.memory.pool import PagePool
from tests.serve.http.server_helpers import MODEL, metric, on_engine, running_server


def wait_metric(url: str, name: str, value: float, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics").text
        if metric(text, name, model_name=MODEL) == value or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_non_streaming_client_that_leaves_is_aborted():
    with running_server(EngineSpec(max_model_len=512, max_num_seqs=2), max_queue=2) as (url, app):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "wait", "max_tokens": 500},
                       timeout=httpx.Timeout(10, read=0.5))
        text = wait_metric(url, "kda:requests_aborted_total", 1)
        assert metric(text, "kda:requests_aborted_total", model_name=MODEL) == 1
        assert metric(text, "kda:state_slots_used", model_name=MODEL) == 0
        assert metric(text, "kda:request_pages", model_name=MODEL) == 0
        on_engine(app, lambda e: e.check_integrity())


def test_request_the_pool_can_never_hold_is_503():
    """``python -m serve.http`` refuses to start on a pool smaller than one max-length request (as vLLM does);
    an engine on such a pool, served anyway, answers 503 for a request that can never fit and serves the rest."""
    spec = EngineSpec(max_model_len=512, max_num_seqs=1, num_pages=20)      # 13 state pages + 7 KV blocks
    model = load_model(spec.preset)
    with pytest.raises(ValueError, match="num_pages=20 cannot hold one request of max_model_len=512"):
        build_engine(spec, model)
    engine = ServeEngine(model, PagePool(20, spec.config.page_bytes(model.cfg)), config=spec.config,
                         max_num_seqs=1, batched=True)
    with serve_in_thread(create_app(engine, MODEL, spec.max_model_len, 1, 0)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=MODEL, prompt="x" * 200, max_tokens=10)
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"
        assert "needs" in err.value.body["message"]                          # the engine's reason
        assert client.completions.create(model=MODEL, prompt="small", max_tokens=4).usage.completion_tokens == 4


def test_engine_that_keeps_failing_ends_requests_and_health():
    with running_server(EngineSpec(max_model_len=256, max_num_seqs=2), max_queue=2) as (url, app):
        def boom():
            raise RuntimeError("injected step failure")

        on_engine(app, lambda e: setattr(e, "step", boom))
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and "injected step failure" in r.json()["error"]["message"]
        assert time.perf_counter() - t0 < 10
        assert httpx.get(url + "/health").status_code == 503
        again = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4})
        assert again.status_code == 503 and again.headers["retry-after"] == "1"
