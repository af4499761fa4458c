"""Deadlines at the door (serve/http/door.py) against a real server on 127.0.0.1 with short limits: a connection that
sends nothing, a head sent a byte at a time, a body shorter than its Content-Length or trickled a byte at a time is
dropped within its deadline (408 when a request was started); normal clients, a kept-alive connection and a response
that takes longer than the deadlines are not; past the connection cap a request gets 503. Every wait is bounded."""
from __future__ import annotations

import http.client
import json
import socket
import time

import httpx
import pytest

from serve.http.app import create_app
from serve.http.background import serve_in_thread
from serve.http.door import DoorLimits
from serve.http.model import EngineSpec, build_engine, load_model
from tests.serve.http.server_helpers import on_engine

LIMITS = DoorLimits(header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=1.0, max_connections=6)
SLACK_S = 1.0                                   # how late after its deadline a drop may be seen on a loaded machine
READ_TIMEOUT_S = LIMITS.header_timeout_s + LIMITS.body_timeout_s + SLACK_S + 2     # a socket left open fails the test
MODEL = "kda-demo-tiny"
BODY = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


@pytest.fixture(scope="module")
def server():
    spec = EngineSpec("demo-tiny", max_model_len=64, max_num_seqs=2)
    app = create_app(build_engine(spec, load_model("demo-tiny")), MODEL, 64, 2, 2)
    with serve_in_thread(app, limits=LIMITS) as url:
        yield url, int(url.rsplit(":", 1)[1]), app


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.settimeout(READ_TIMEOUT_S)
    return s


def _until_closed(s: socket.socket) -> tuple[float, bytes]:
    """Read until the server closes the connection: (seconds waited, bytes received). Fails if it stays open."""
    t0, data = time.monotonic(), b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open (got {data!r})")
    except ConnectionResetError:
        pass
    finally:
        s.close()
    return time.monotonic() - t0, data


def _trickle(s: socket.socket, data: bytes, period_s: float) -> float:
    """Send ``data`` a byte every ``period_s`` until done or the server closes; returns the seconds it took."""
    t0 = time.monotonic()
    for b in data:
        try:
            s.sendall(bytes([b]))
        except OSError:                                  # closed by the server: the point
            break
        time.sleep(period_s)
    return time.monotonic() - t0


def test_a_connection_that_sends_nothing_is_closed_silently(server):
    waited, data = _until_closed(_connect(server[1]))
    assert data == b"" and waited < LIMITS.header_timeout_s + SLACK_S


@pytest.mark.parametrize("kept_alive", [False, True], ids=["new-connection", "kept-alive-connection"])
def test_a_head_sent_a_byte_at_a_time_is_dropped_with_408(server, kept_alive):
    """Slow loris: each byte resets no deadline, so the head is cut at header_timeout_s total (on a kept-alive
    connection from its first byte, which stops uvicorn's keep-alive timer)."""
    if kept_alive:
        conn = http.client.HTTPConnection("127.0.0.1", server[1], timeout=10)
        conn.request("POST", "/v1/completions", BODY, {"content-type": "application/json"})
        assert conn.getresponse().read() and conn.sock is not None
        s = conn.sock
        s.settimeout(READ_TIMEOUT_S)
    else:
        s = _connect(server[1])
    took = _trickle(s, HEAD % len(BODY), 0.05)                       # 100 bytes: 5 s if it were let through
    waited, data = _until_closed(s)
    assert data.startswith(b"HTTP/1.1 408 ") and b"headers did not arrive within 0.5 s" in data, data
    assert took + waited < LIMITS.header_timeout_s + SLACK_S


@pytest.mark.parametrize("trickle", [False, True], ids=["body-short-of-its-length", "body-a-byte-at-a-time"])
def test_a_body_that_does_not_arrive_is_dropped_with_408(server, trickle):
    s = _connect(server[1])
    s.sendall(HEAD % len(BODY) + BODY[:5])
    took = _trickle(s, BODY[5:], 0.05) if trickle else 0.0
    waited, data = _until_closed(s)
    assert data.startswith(b"HTTP/1.1 408 ") and b"body did not arrive within 0.5 s" in data, data
    assert took + waited < LIMITS.body_timeout_s + SLACK_S


def test_normal_clients_keep_alive_and_long_responses_are_not_cut(server):
    url, port, app = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for pause_s in (0.0, 0.7):              # idle 0.7 s: past the read deadlines, within keep-alive: the same socket
        time.sleep(pause_s)
        conn.request("POST", "/v1/completions", BODY, {"content-type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2
    waited, data = _until_closed(conn.sock)            # idle past keep-alive: closed (uvicorn's timeout_keep_alive)
    assert data == b"" and waited < LIMITS.keep_alive_s + SLACK_S

    def slow(engine):                                  # each engine step takes 0.2 s: a 2 s response
        real = engine.step
        engine.step = lambda: (time.sleep(0.2), real())[1]

    on_engine(app, slow)
    try:
        t0 = time.monotonic()
        with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 10,
                                                                 "stream": True}, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert time.monotonic() - t0 > LIMITS.body_timeout_s + LIMITS.header_timeout_s
    finally:
        on_engine(app, lambda e: e.__dict__.pop("step"))


def test_past_the_connection_cap_a_request_gets_503_until_idle_ones_are_dropped(server):
    url, port, _ = server
    idle = [_connect(port) for _ in range(LIMITS.max_connections)]
    try:
        assert httpx.get(url + "/health").status_code == 503           # uvicorn's limit_concurrency
        for s in idle:
            _until_closed(s)                                             # the header deadline frees them
        assert httpx.get(url + "/health").status_code == 200
    finally:
        for s in idle:
            s.close()


def test_bad_limits_name_the_field():
    for kw in ({"header_timeout_s": 0}, {"body_timeout_s": float("inf")}, {"keep_alive_s": -1},
               {"max_connections": 0}, {"max_header_bytes": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            DoorLimits(**kw)
