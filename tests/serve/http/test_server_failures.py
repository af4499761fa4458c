"""The server never hangs and one request cannot take it down: the request that killed the engine (temperature
1e-38) is served; a request whose row fails in the engine is a 500 (an error event mid-stream) while the others are
served; a non-streaming client that gives up has its request aborted; a request the pool can never hold is a 503 (and
one that fits it is not, whatever its prefix hit); an engine that fails on its own ends every request with 503, fails
/health with the cause, and ``python -m serve.http`` exits non-zero."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest

from serve.engine import ServeEngine
from serve.http.__main__ import ENGINE_DIED, main
from serve.http.app import create_app
from serve.http.background import serve_in_thread
from serve.http.model import EngineSpec, build_engine, load_model
from serve.memory.pool import PagePool
from serve.spec_decode.draft import NgramProposer
from serve.spec_decode.verify import Speculation
from tests.serve.http.server_helpers import MODEL, metric, on_engine, reference_texts, running_server


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
                         max_num_seqs=1)
    with serve_in_thread(create_app(engine, MODEL, spec.max_model_len, 1, 0)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=MODEL, prompt="x" * 200, max_tokens=10)
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"
        assert "needs" in err.value.body["message"]                          # the engine's reason
        assert client.completions.create(model=MODEL, prompt="small", max_tokens=4).usage.completion_tokens == 4


def test_a_request_that_fits_the_pool_is_not_a_503_for_its_prefix_hit():
    """The smallest pool of max_model_len=512 (45 pages): a 300-byte prompt leaves 18 blocks and a 13-page
    checkpoint cached (31 pages); the same prompt + 30 bytes for 100 tokens needs 40 pages alone but 22 beside its
    pinned hit while 14 are free, and was answered 503 ("needs 22 pages ... its 18 hit blocks stay pinned"). It is
    served, as the cache-off batch-1 run (admission falls back to no hit), and the engine holds no leak."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 7
    first, second = prompt[:300], prompt[:300] + " and then some more text here."
    with running_server(EngineSpec(max_model_len=512, max_num_seqs=1, num_pages=45), max_queue=2) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        client.completions.create(model=MODEL, prompt=first, max_tokens=2)
        assert on_engine(app, lambda e: e.pool.num_used()) == 31
        out = client.completions.create(model=MODEL, prompt=second, max_tokens=100)
        ref = reference_texts([list(second.encode())], [100])[0].decode("utf-8", errors="replace")
        assert out.usage.completion_tokens == 100 and out.choices[0].text == ref
        on_engine(app, lambda e: e.check_integrity())


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


POISON = {"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 1e-38, "seed": 1}


def test_the_request_that_killed_the_engine_is_served_and_the_server_goes_on():
    """Temperature 1e-38 passed the schema, then raised in the sampler: the engine loop died after three failed
    steps, a running stream ended with finish_reason "abort" and every later request got 503. Now it is a normal
    (greedy-limit) completion, and so are tiny top_p values and the same request streamed."""
    with running_server(EngineSpec(max_model_len=256, max_num_seqs=4), max_queue=4) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        out = client.completions.create(**POISON)
        greedy = client.completions.create(model=MODEL, prompt="x", max_tokens=4).choices[0].text
        assert out.usage.completion_tokens == 4 and out.choices[0].text == greedy
        tiny_p = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=1.0, top_p=1e-300)
        assert tiny_p.choices[0].text == greedy                      # the most likely token alone: greedy
        chunks = list(client.completions.create(**POISON, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length" and "".join(c.choices[0].text for c in chunks) == greedy
        assert httpx.get(url + "/health").status_code == 200
        assert client.completions.create(model=MODEL, prompt="after", max_tokens=2).usage.completion_tokens == 2
        on_engine(app, lambda e: e.check_integrity())


def test_a_request_whose_row_fails_is_a_500_and_the_others_are_served():
    """A failure planted in one request's row (its prompt "poison-me"), at its first token or mid-stream: that client
    gets a 500 naming the failure (a streamed one an error event, which the openai client raises), its slot and pages
    are freed, and a request beside it gets its batch-1 output; /health stays 200."""
    with running_server(EngineSpec(max_model_len=256, max_num_seqs=4), max_queue=4) as (url, app):
        def plant(engine):
            real = engine.postprocess.decode

            def failing(req, *args):
                if bytes(req.prompt) == b"poison-me" and len(req.output) >= 3:
                    raise RuntimeError("planted row failure")
                return real(req, *args)
            engine.postprocess.decode = failing

        on_engine(app, plant)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        ref = reference_texts([list(b"neighbour")], [40])[0].decode("utf-8", errors="replace")
        got = {}
        beside = threading.Thread(target=lambda: got.setdefault(
            "text", client.completions.create(model=MODEL, prompt="neighbour", max_tokens=40).choices[0].text))
        beside.start()
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=MODEL, prompt="poison-me", max_tokens=20)
        assert err.value.status_code == 500 and "planted row failure" in err.value.body["message"]
        assert "retry-after" not in err.value.response.headers
        with pytest.raises(openai.APIError, match="planted row failure"):
            for _ in client.completions.create(model=MODEL, prompt="poison-me", max_tokens=20, stream=True):
                pass
        beside.join(60)
        assert got["text"] == ref
        assert httpx.get(url + "/health").status_code == 200
        text = wait_metric(url, "kda:state_slots_used", 0)
        assert metric(text, "kda:request_pages", model_name=MODEL) == 0
        on_engine(app, lambda e: e.check_integrity())


def test_command_line_server_exits_non_zero_when_the_model_fails(monkeypatch):
    """A failure of no one request (the model's MLP raises for every input): the request gets 503 with the cause,
    /health says why, and ``python -m serve.http`` (``main``, here on a thread) exits with status 1 so that a
    supervisor restarts it, instead of staying up answering 503."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = load_model("demo-tiny")                       # the one main() loads (once per process)
    exit_code = {}

    def run():
        try:
            main(["--preset", "demo-tiny", "--port", str(port), "--max-model-len", "64", "--max-num-seqs", "2"])
        except SystemExit as exc:
            exit_code["code"] = exc.code
        else:
            exit_code["code"] = 0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    def broken(i, x):
        raise RuntimeError("the model's weights are gone")

    monkeypatch.setattr(model, "feed_forward", broken)
    r = httpx.post(url + "/v1/completions", json={"model": "kda-demo-tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and "weights are gone" in r.json()["error"]["message"], r.text
    health = httpx.get(url + "/health")                    # within the grace before the server shuts down
    assert health.status_code == 503 and "EngineFailure" in health.json()["error"]["message"]
    thread.join(15)
    assert not thread.is_alive() and exit_code["code"] == ENGINE_DIED


def test_a_request_the_engine_refuses_at_submit_ends_alone(monkeypatch):
    """An engine with speculation accepts drafts greedily, so its submit() refuses a sampled request; that ValueError
    escaped the engine thread and killed the loop (every later request 503). The door now answers a sampled request
    to such a server with a 400 naming ``temperature``; a request the engine's submit() still refuses (here one
    prompt, refused on purpose) ends with a 503 naming the reason and the server goes on."""
    spec = EngineSpec("demo-tiny", max_model_len=64, max_num_seqs=2)
    model = load_model("demo-tiny")
    engine = ServeEngine(model, PagePool(64, spec.config.page_bytes(model.cfg)), config=spec.config, max_num_seqs=2,
                         speculation=Speculation.named(lambda prompt: NgramProposer(), "snapshot", 2))
    submit = engine.submit

    def refuse_one(tokens, *args, **kwargs):
        if list(tokens) == list(b"refuse me"):
            raise ValueError("sampling (temperature > 0) is not supported with speculation: drafts are accepted greedily")
        return submit(tokens, *args, **kwargs)

    monkeypatch.setattr(engine, "submit", refuse_one)
    with serve_in_thread(create_app(engine, MODEL, 64, 2, 2)) as url:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0.7},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "refuse me", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "not supported with speculation" in r.json()["error"]["message"], r.text
        assert httpx.get(url + "/health").status_code == 200
        ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
