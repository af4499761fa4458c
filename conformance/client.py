"""``EngineClient``: the suite's only way into an engine, its OpenAI-compatible HTTP API (``/v1/completions``
greedy with logprobs, a streamed request dropped mid-way, ``/metrics``, ``/v1/models``), one engine adapter
(:mod:`conformance.adapters`) saying what the engine's fields and answers look like."""
from __future__ import annotations

import re
import time
from typing import NamedTuple

import httpx


class Completion(NamedTuple):
    """One greedy completion: ``tokens`` (ids, or the engine's token strings when it gives no ids; None without
    logprobs), ``logprobs`` (the chosen tokens' natural-log probabilities, None at a position the engine did not
    compute, or None), ``top`` (per position, a dict of the most likely tokens to their logprobs, or None), ``text``, ``cached_tokens`` (the prompt tokens the engine
    says it served from its cache, ``usage.prompt_tokens_details.cached_tokens``; None if not reported), ``error``
    (the HTTP status and message of a failed request, else None)."""

    tokens: tuple | None
    logprobs: tuple | None
    top: tuple | None
    text: str
    cached_tokens: int | None = None
    error: str | None = None

    @classmethod
    def failed(cls, error: str) -> Completion:
        return cls(None, None, None, "", None, error)


_SAMPLE = re.compile(r"^([^\s{#]+)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict:
    """A Prometheus text exposition as ``{name: total over its series}`` (labels summed: the suite reads one
    model's server), ``name{k="v"}`` keys added for labelled series."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        name = m.group(1)
        out[name] = out.get(name, 0.0) + value
        labels = [f'{k}="{v}"' for k, v in _LABEL.findall(m.group(2) or "") if k != "model_name"]
        if labels:
            key = f"{name}{{{','.join(labels)}}}"
            out[key] = out.get(key, 0.0) + value
    return out


class EngineClient:
    """One engine endpoint: ``base_url`` (``http://host:port``), the served ``model`` name, the ``adapter``
    (:class:`conformance.adapters.Adapter`), ``fields``: a callable giving extra request fields for every
    completion (a per-request setting such as llama.cpp's ``cache_prompt: false``), ``timeout_s`` per request."""

    def __init__(self, base_url: str, model: str, adapter, fields=None, timeout_s: float = 120.0):
        self.base_url, self.model, self.adapter = base_url.rstrip("/"), model, adapter
        self.fields = fields or dict
        self.timeout_s = timeout_s
        self.http = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` as this engine tokenizes it (:meth:`Adapter.tokenize`)."""
        return self.adapter.tokenize(self.http, self.base_url, self.model, text)

    def complete(self, prompt: list, max_tokens: int, logprobs: int) -> Completion:
        """Greedy (temperature 0) completion of the token-id ``prompt``, ``max_tokens`` tokens, each with its
        logprob and ``logprobs`` alternatives. An HTTP or connection error is a :class:`Completion` with
        ``error`` set, never an exception."""
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                **self.adapter.request_fields(logprobs), **self.fields()}
        try:
            r = self.http.post(f"{self.base_url}/v1/completions", json=body)
        except httpx.HTTPError as err:
            return Completion.failed(f"{type(err).__name__}: {err}")
        if r.status_code != 200:
            return Completion.failed(f"HTTP {r.status_code}: {r.text[:300]}")
        try:
            return self.adapter.parse_completion(r.json())
        except (ValueError, KeyError, TypeError, IndexError) as err:
            return Completion.failed(f"unreadable answer ({type(err).__name__}: {err}): {r.text[:300]}")

    def stream_then_drop(self, prompt: list, max_tokens: int, after_chunks: int) -> int:
        """Start a streamed completion and close the connection after ``after_chunks`` data events (the client
        gone, as a user closing the page); returns the events read. Raises RuntimeError if the request fails."""
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                "stream": True, **self.fields()}
        seen = 0
        with self.http.stream("POST", f"{self.base_url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"the streamed request failed: HTTP {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if line.startswith("data:") and "[DONE]" not in line:
                    seen += 1
                    if seen >= after_chunks:
                        break
        return seen

    def metrics(self) -> dict | None:
        """``/metrics`` parsed (:func:`parse_metrics`), or None if the engine serves none."""
        try:
            r = self.http.get(f"{self.base_url}{self.adapter.metrics_path}")
        except httpx.HTTPError:
            return None
        return parse_metrics(r.text) if r.status_code == 200 else None

    def wait_idle(self, timeout_s: float = 20.0) -> bool:
        """Wait until the engine's running and waiting gauges read 0 (its adapter's ``metric_names.busy``);
        returns False at the timeout or without metrics (then after a fixed 1 s)."""
        gauges = self.adapter.metric_names.busy
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = self.metrics()
            if m is None or not gauges:
                time.sleep(1.0)
                return False
            if all(m.get(g, 0.0) == 0.0 for g in gauges):
                return True
            time.sleep(0.1)
        return False


def served_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model id ``/v1/models`` lists. Raises RuntimeError naming the URL when there is none."""
    try:
        data = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=timeout_s).json()["data"]
        return data[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as err:
        raise RuntimeError(f"{base_url}/v1/models names no model ({type(err).__name__}: {err}); pass --model") from None
