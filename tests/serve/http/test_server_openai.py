"""The server against the ``openai`` Python client (and raw httpx where the client cannot send the input):
completion, chat, streaming, every error path, 429 with Retry-After, a mid-stream disconnect, /metrics and the
``python -m serve.http`` command. Outputs are checked against a batch-1 run of the same prompt."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from serve.http.model import EngineSpec
from serve.http.protocol import ChatMessage, TextDecoder, chat_prompt, decode_all
from tests.serve.http.server_helpers import MODEL, metric, on_engine, reference_texts, running_server

MAX_LEN = 256


@pytest.fixture(scope="module")
def server():
    with running_server(EngineSpec(max_model_len=MAX_LEN, max_num_seqs=4), max_queue=8) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server[0] + "/health").status_code == 200
    text = httpx.get(server[0] + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "kda:state_slots_free",
                 "kda:checkpoints_held"):
        metric(text, name, model_name=MODEL)
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert f"# TYPE {name} histogram" in text
    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "sglang:mamba_cache_miss_requests",
                 "sglang:mamba_cache_miss_tokens"):
        assert f"# TYPE {name}_total counter" in text


def test_completion_equals_batch1_run(client):
    prompt = "The KDA state is a matrix per head; "
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
    ref = reference_texts([list(prompt.encode())], [12])[0]
    assert out.choices[0].text == decode_all(ref)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt.encode()), 12)


def test_token_id_prompt_and_repeat_hits_the_cache(client):
    ids = list(range(40, 40 + 100))                       # 100 bytes: blocks and a checkpoint at 64 published
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=4)
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=4)
    assert first.choices[0].text == again.choices[0].text == decode_all(reference_texts([ids], [4])[0])
    assert again.usage.prompt_tokens_details.cached_tokens >= 64


def test_chat_and_streams_match_non_streamed(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a KDA gate ✓"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
    rendered = chat_prompt([ChatMessage(**m) for m in messages])
    assert chat.choices[0].message.content == decode_all(reference_texts([list(rendered.encode())], [10])[0])
    assert chat.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    text = client.completions.create(model=MODEL, prompt="abc", max_tokens=20).choices[0].text
    streamed = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=20, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text
    assert streamed[-1].choices[0].finish_reason == "length"


@given(st.binary(max_size=40), st.lists(st.integers(1, 5), max_size=20))
def test_text_decoder_splits_like_one_decode(data, cuts):
    """Any bytes (invalid UTF-8 included), fed in any pieces, decode to what one decode gives."""
    dec, out, i = TextDecoder(), [], 0
    for c in cuts:
        out.append(dec.feed(list(data[i:i + c])))
        i += c
    out.append(dec.feed(list(data[i:]), final=True))
    assert "".join(out) == decode_all(data)


@pytest.mark.parametrize("kwargs, param", [
    (dict(prompt="x", extra_body={"frobnicate": 1}), "frobnicate"),           # unknown field
    (dict(prompt="x", max_tokens="3"), "max_tokens"),                         # wrong type
    (dict(prompt="x", extra_body={"stream": "yes"}), "stream"),
    (dict(prompt="x" * MAX_LEN, max_tokens=1), "prompt"),                      # over the limit
    (dict(prompt="x", max_tokens=0), "max_tokens"),                           # out of range
    (dict(prompt="x" * 200, max_tokens=MAX_LEN - 199), "max_tokens"),
    (dict(prompt="x", temperature=2.5), "temperature"),                       # OpenAI's range is [0, 2]
    (dict(prompt="x", top_p=0), "top_p"),
    (dict(prompt="x", extra_body={"seed": 2**70}), "seed"),                     # a 64-bit signed int, as vLLM
    (dict(prompt="x", extra_body={"seed": 2**63}), "seed"),
    (dict(prompt="x", extra_body={"seed": -2**63 - 1}), "seed"),
    (dict(prompt="x", extra_body={"top_k": -7}), "top_k"),                    # vLLM: 0 or -1 off, else >= 1
    (dict(prompt="x", temperature="hot"), "temperature"),                     # not "temperature.float"
    (dict(prompt="x", n=2), "n"),
    (dict(prompt=[256]), "prompt"),                                           # not a byte
    (dict(prompt=""), "prompt"),
    (dict(prompt="x", stream_options={"include_usage": True}), "stream_options"),   # without stream
])
def test_bad_input_is_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"
    assert err.value.body["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "kda-demo", "prompt": "\\ud800", "max_tokens": 1}', "prompt"),     # lone surrogate
    (b'{"model": "kda-demo", "prompt": "\xff\xfe", "max_tokens": 1}', None),         # body not UTF-8
    (b'{"model": "kda-demo", "prompt": ', None),                                      # not JSON
    (b'["kda-demo"]', None),
])
def test_bad_utf8_and_bad_json_are_400(server, raw, param):
    r = httpx.post(server[0] + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_too_long_chat_names_messages_and_echo_is_refused_for_echo(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * MAX_LEN}])
    assert err.value.body["param"] == "messages" and "messages render to a prompt of" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, echo=True)
    assert err.value.body["param"] == "echo" and "does not echo the prompt" in err.value.body["message"]
    assert "logprobs" not in err.value.body["message"] and "penalties" not in err.value.body["message"]


@pytest.mark.parametrize("content_type, status", [
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("application/json; charset=utf-8", 200),
    (None, 415),
], ids=["text-plain", "form", "json-charset", "none"])
def test_a_json_body_under_another_content_type_is_415_naming_it(server, content_type, status):
    """A valid JSON object sent as text/plain (or with no Content-Type) is refused for its Content-Type (vLLM's
    415), not called "not a JSON object"."""
    raw = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    r = httpx.post(server[0] + "/v1/completions", content=raw,
                   headers={} if content_type is None else {"content-type": content_type})
    assert r.status_code == status, r.text
    if status == 415:
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == 415
        got = "missing" if content_type is None else f"'{content_type}'"
        assert f"Content-Type is {got}" in err["message"] and "application/json" in err["message"]


def test_full_queue_is_429_with_retry_after_and_disconnect_frees_the_slot():
    with running_server(EngineSpec(max_model_len=MAX_LEN, max_num_seqs=1), max_queue=0) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        baseline = on_engine(app, lambda e: e.pool.num_free)
        holding, release = threading.Event(), threading.Event()

        def hold():
            stream = client.completions.create(model=MODEL, prompt="hold the slot", max_tokens=200, stream=True)
            next(iter(stream))
            holding.set()
            release.wait(30)
            stream.close()                                 # disconnect mid-stream

        th = threading.Thread(target=hold)
        th.start()
        assert holding.wait(30)
        t0 = time.perf_counter()
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert time.perf_counter() - t0 < 2.0                   # answered at once, no hang
        assert err.value.response.headers["retry-after"] == "1"
        assert err.value.body["type"] == "rate_limit_exceeded"
        text = httpx.get(url + "/metrics").text                 # the 429 is counted, apart from "never fits"
        assert metric(text, "kda:requests_rejected_total", model_name=MODEL, reason="queue_full") == 1
        assert metric(text, "kda:requests_rejected_total", model_name=MODEL, reason="never_fits") == 0
        release.set()
        th.join(30)
        for _ in range(100):                                    # the abort runs on the engine thread
            text = httpx.get(url + "/metrics").text
            if metric(text, "kda:requests_aborted_total", model_name=MODEL) == 1:
                break
            time.sleep(0.05)
        assert metric(text, "kda:requests_aborted_total", model_name=MODEL) == 1
        assert metric(text, "kda:state_slots_used", model_name=MODEL) == 0
        assert metric(text, "kda:request_pages", model_name=MODEL) == 0
        on_engine(app, lambda e: e.check_integrity())
        on_engine(app, lambda e: e.cache.clear())
        assert on_engine(app, lambda e: e.pool.num_free) == baseline
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].finish_reason == "length"


def test_command_line_server_binds_localhost():
    """``python -m serve.http`` serves on 127.0.0.1; its ``--state-write`` / ``--ring-size`` reach the engine, as
    ``/v1/models`` reports."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "serve.http", "--port", str(port), "--max-model-len", "128",
                             "--max-num-seqs", "2", "--state-write", "replay_ssm", "--ring-size", "2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="kda-demo", prompt="hi", max_tokens=3)
        assert out.usage.completion_tokens == 3
        card = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]
        assert (card["state_write"], card["ring_size"]) == ("replay_ssm", 2)
    finally:
        proc.terminate()
        proc.wait(20)
    first = proc.stdout.read().decode().splitlines()[0]                  # the startup line, before uvicorn's
    assert first.startswith(f"python -m serve.http: serving kda-demo on http://127.0.0.1:{port}/v1 | state dtype "
                            "fp32, state write replay_ssm (ring 2) | pool "), first


def test_prefix_cache_and_missing_checkpoint_counters():
    """A repeat whose deepest checkpoint was dropped hits only the one below it: the KV blocks between are
    counted as SGLang's mamba_cache_miss (requests 1, tokens 96 - 64 = 32)."""
    with running_server(EngineSpec(max_model_len=MAX_LEN, max_num_seqs=2), max_queue=2) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        ids = list(range(100, 200))                          # L = 100: checkpoints at 64 and 96
        client.completions.create(model=MODEL, prompt=ids, max_tokens=2)
        on_engine(app, lambda e: [e.cache.drop_checkpoint(ids, 96, g) for g in range(e.config.num_groups)])
        again = client.completions.create(model=MODEL, prompt=ids, max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens == 64
        text = httpx.get(url + "/metrics").text
        assert metric(text, "vllm:prefix_cache_queries_total", model_name=MODEL) == 200
        assert metric(text, "vllm:prefix_cache_hits_total", model_name=MODEL) == 64
        assert metric(text, "sglang:mamba_cache_miss_requests_total", model_name=MODEL) == 1
        assert metric(text, "sglang:mamba_cache_miss_tokens_total", model_name=MODEL) == 32
        assert metric(text, "kda:checkpoints_held", model_name=MODEL) >= 1


def test_seeded_sampling_is_reproducible_and_equals_its_batch1_run(client):
    """temperature / top_p / seed are honoured per request: the same seed gives the same text, also while other
    sampled requests share the batch, and it is the batch-1 run's text with those params (each request draws
    from its own generator; rows are batch-invariant); temperature 0 and a top_p nucleus of one token are greedy."""
    from concurrent.futures import ThreadPoolExecutor

    from serve.engine.sampling import SamplingParams

    prompts = ["Sampling: ", "Another prompt, longer than the first one. ", "x"]
    seeds, n = [7, 8, 9], 12

    def run(i):
        return client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=n, temperature=1.3, top_p=0.95,
                                         seed=seeds[i]).choices[0].text

    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(run, range(3)))
    alone = [run(i) for i in range(3)]
    refs = reference_texts([list(p.encode()) for p in prompts], [n] * 3,
                           sampling=[SamplingParams(1.3, 0.95, s) for s in seeds])
    assert together == alone == [decode_all(r) for r in refs]
    greedy = decode_all(reference_texts([list(prompts[0].encode())], [n])[0])
    assert greedy not in together                                        # it did sample
    for kwargs in (dict(temperature=0), dict(temperature=1.0, top_p=1e-9, seed=1)):
        assert client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=n, **kwargs).choices[0].text \
            == greedy


def test_tools_are_a_clear_400_not_an_unknown_field(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       tools=tools)
    assert err.value.body["param"] == "tools" and "tool calls are not supported" in err.value.body["message"]
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                         tool_choice="none")
    assert out.usage.completion_tokens == 2


def test_greedy_accepts_top_p_and_top_k_and_top_k_one_is_greedy(client):
    """top_p / top_k cannot change an argmax, so temperature 0 accepts them (vLLM does; clients send top_p by
    default); top_k is honoured, not ignored: top_k 1 at temperature 1.3 keeps only the most likely token; a seed
    anywhere in the 64-bit signed range is accepted."""
    prompt, n = "Sampling: ", 12
    greedy = decode_all(reference_texts([list(prompt.encode())], [n])[0])
    for extra in ({"top_p": 0.95}, {"top_p": 0.95, "top_k": -1}, {"top_k": 0}, {"top_k": 5, "seed": -2**63}):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, extra_body=extra)
        assert out.choices[0].text == greedy, extra
    sampled = dict(model=MODEL, prompt=prompt, max_tokens=n, temperature=1.3, top_p=0.95, seed=7)
    assert client.completions.create(**sampled).choices[0].text != greedy
    assert client.completions.create(**sampled, extra_body={"top_k": 1}).choices[0].text == greedy


@pytest.mark.parametrize("path, body, param", [
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages[0].content[0].text"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x", "colour": 1}]}, "messages[0].colour"),
    ("completions", {"prompt": [[1, "a"]]}, "prompt[0][1]"),
    ("chat/completions", {"messages": ["hello"]}, "messages[0]"),               # nested values that must be objects:
    ("chat/completions", {"messages": [None]}, "messages[0]"),                  # were "the body is not a JSON object"
    ("chat/completions", {"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    ("completions", {"prompt": "x", "stream": True, "stream_options": [1]}, "stream_options"),
])
def test_bad_field_param_is_the_path_the_client_wrote(server, path, body, param):
    """pydantic's union member names (``str``, ``list[TextPart]``) stay out of ``param``; the message lists what
    each member wanted. A nested value of the wrong type is named too."""
    r = httpx.post(f"{server[0]}/v1/{path}", json={"model": MODEL, "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert param in r.json()["error"]["message"] and ".str" not in r.json()["error"]["message"]


def test_no_redirect_built_from_host_head_health_and_no_docs(server):
    """A trailing slash was a 307 to a Location built from the request's Host header; HEAD /health was 405; /docs
    loaded its scripts from a CDN without being asked for (``--docs`` turns it on: tests/serve/http/test_main.py)."""
    url = server[0]
    r = httpx.post(url + "/v1/completions/", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                   headers={"host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers and r.json()["error"]["code"] == 404
    assert httpx.head(url + "/health").status_code == 200
    assert [httpx.get(url + p).status_code for p in ("/docs", "/redoc", "/openapi.json")] == [404] * 3


def test_help_shows_every_default(capsys):
    from serve.http.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    text = text[text.index("options:"):]                                 # past the usage line
    for flag, default in (("--max-num-seqs", 64), ("--max-queue", 256), ("--max-model-len", 1024), ("--port", 8000),
                          ("--block-size", 16), ("--checkpoint-interval", 64), ("--ring-size", 16)):
        after = text[text.index(f"{flag} {flag[2:].upper().replace('-', '_')}"):]
        assert f"(default: {default})" in after[:after.index(" --", 5)], flag


def test_idle_kv_cache_usage_counts_cached_pages_as_free():
    """As vLLM's BlockPool.get_usage (vllm/v1/core/block_pool.py): pages held only by the prefix cache are
    evictable, so an idle server whose cache holds pages reports 0; a running request's pages count."""
    with running_server(EngineSpec(max_model_len=MAX_LEN, max_num_seqs=1), max_queue=0) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        stream = client.completions.create(model=MODEL, prompt=list(range(30, 130)), max_tokens=150, stream=True)
        next(iter(stream))
        busy = _poll_metric(url, "vllm:kv_cache_usage_perc", lambda v: v > 0)
        stream.close()
        idle = _poll_metric(url, "vllm:kv_cache_usage_perc", lambda v: v == 0)
        text = httpx.get(url + "/metrics").text
        assert busy > 0 and idle == 0
        assert metric(text, "kda:prefix_cache_pages", model_name=MODEL) > 0          # the cache still holds pages
        assert metric(text, "kda:pool_pages", model_name=MODEL, kind="free") < on_engine(app, lambda e: e.pool.num_pages)


def _poll_metric(url: str, name: str, ok, timeout_s: float = 10.0) -> float:
    """The series' value once ``ok(value)`` (or the last value read after ``timeout_s``)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        value = metric(httpx.get(url + "/metrics").text, name, model_name=MODEL)
        if ok(value) or time.perf_counter() > deadline:
            return value
        time.sleep(0.05)


def test_the_default_max_tokens_fits_the_room_left_and_an_explicit_one_does_not_shrink():
    """A completion without max_tokens near the context's end gets the room left (OpenAI's default 16 would be over
    it: the client was told "got 16" for a number it never sent); an explicit max_tokens over the room stays a 400."""
    from serve.http.protocol import DEFAULT_MAX_TOKENS, CompletionRequest, RequestError, check_request

    prompt = "x" * (MAX_LEN - 5)                                          # 5 tokens (bytes) of room
    assert check_request(CompletionRequest(model="m", prompt=prompt), "m", MAX_LEN).max_tokens == 5
    assert check_request(CompletionRequest(model="m", prompt="x"), "m", MAX_LEN).max_tokens == DEFAULT_MAX_TOKENS
    with pytest.raises(RequestError, match=r"max_tokens must be in \[1, 5\]"):
        check_request(CompletionRequest(model="m", prompt=prompt, max_tokens=6), "m", MAX_LEN)
