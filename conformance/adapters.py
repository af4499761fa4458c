"""One adapter per engine: what each setting a check needs is called there (a start-up flag, or a field of the
request), how its completions and metrics read, how it tokenizes.

The settings a check toggles are :class:`Variant` s of the engine as deployed (``base``): its prefix cache off,
speculative decoding on, prefill in chunks of N tokens. A per-request field (llama.cpp's ``cache_prompt``, vLLM's
``cache_salt``) works on the running server; a start-up flag needs the suite to start the engine itself
(``--launch``). Our server's adapter is :mod:`conformance.ours`.

The flags below are written from each engine's own documentation and code; only ours and llama.cpp's are run here
(:attr:`Adapter.run_here`): vLLM's and SGLang's wait for a GPU run.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import NamedTuple

import httpx

from conformance.client import Completion


class Variant(NamedTuple):
    """A setting of the engine: ``name``; ``prefix_cache`` (on in the deployment), ``speculative``, ``chunk``
    (prefill chunk size in tokens, None: the engine's default)."""

    name: str
    prefix_cache: bool = True
    speculative: bool = False
    chunk: int | None = None


BASE = Variant("base")
NO_CACHE = Variant("no_prefix_cache", prefix_cache=False)
SPECULATIVE = Variant("speculative", speculative=True)


def chunked(n: int) -> Variant:
    """The engine prefilling prompts in chunks of ``n`` tokens."""
    return Variant(f"chunk_{n}", chunk=n)


class MetricNames(NamedTuple):
    """The Prometheus series a check reads (None / empty: the engine has none). ``busy``: gauges that read 0 when
    no request runs; ``leftovers``: gauges back at their idle value once every request ended (pages or slots held);
    ``hits`` / ``queries``: prefix-cache hit and queried prompt tokens; ``state_miss_tokens`` /
    ``state_miss_requests``: tokens cached as KV but recomputed for want of a state checkpoint, and the requests
    with such a miss; ``drafted`` / ``accepted``: speculative draft tokens proposed / accepted."""

    busy: tuple = ()
    leftovers: tuple = ()
    hits: str | None = None
    queries: str | None = None
    state_miss_tokens: str | None = None
    state_miss_requests: str | None = None
    drafted: str | None = None
    accepted: str | None = None


class Grid(NamedTuple):
    """Where an engine can restore a state on a prefix hit: KV ``block`` (tokens) and a state checkpoint every
    ``interval`` tokens of a prefill (both from its flags)."""

    block: int
    interval: int


def _token(t):
    """``token_id:N`` (vLLM's ``return_tokens_as_token_ids``) -> N; any other token string as it is."""
    return int(t[9:]) if isinstance(t, str) and t.startswith("token_id:") else t


def cached_tokens(body: dict) -> int | None:
    return ((body.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


def parse_openai(body: dict) -> Completion:
    """A ``text_completion`` in the OpenAI format (``logprobs``: ``tokens``, ``token_logprobs``,
    ``top_logprobs``) as a :class:`Completion`."""
    choice = body["choices"][0]
    lp = choice.get("logprobs")
    if not lp:
        return Completion(None, None, None, choice["text"], cached_tokens(body))
    tokens = tuple(_token(t) for t in lp["tokens"])
    top = tuple({_token(k): v for k, v in (d or {}).items()} for d in (lp.get("top_logprobs") or ()))
    return Completion(tokens, tuple(lp["token_logprobs"]), top or None, choice["text"], cached_tokens(body))


class Adapter:
    """An engine as the suite sees it. Subclasses set the class attributes and override what differs."""

    name = "engine"
    run_here = False                     # False: written from the engine's docs and code, not run here
    docs = ""                            # where the flags below are documented
    default_chunk_sizes = (16, 64, 100)
    metrics_path = "/metrics"
    health_path = "/health"
    metric_names = MetricNames()
    always_args: tuple = ()              # added to every command the suite starts (e.g. llama.cpp's --metrics)

    def port_args(self, port: int) -> list[str]:
        return ["--host", "127.0.0.1", "--port", str(port)]

    def variant_args(self, variant: Variant) -> list[str] | None:
        """Start-up flags that put a launched engine in ``variant`` (None: it has no such setting)."""
        return [] if variant == BASE else None

    def variant_fields(self, variant: Variant) -> Callable[[], dict] | None:
        """A callable giving request fields that put the running base server in ``variant`` for that request
        (None: not a per-request setting)."""
        return dict if variant == BASE else None

    def request_fields(self, logprobs: int) -> dict:
        return {"logprobs": logprobs}

    def parse_completion(self, body: dict) -> Completion:
        return parse_openai(body)

    def tokenize(self, http: httpx.Client, base_url: str, model: str, text: str) -> list[int]:
        r = http.post(f"{base_url}/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return list(r.json()["tokens"])

    def grid(self, launch_args: list[str] | None) -> Grid | None:
        """The engine's state grid for these flags (None: unknown; the metrics check is then not applicable)."""
        return None

    @staticmethod
    def flag_value(args: list[str] | None, flag: str, default):
        """The value following ``flag`` in ``args`` (``--flag V`` or ``--flag=V``), else ``default``."""
        args = list(args or ())
        for i, a in enumerate(args):
            if a == flag and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return default


class LlamaCpp(Adapter):
    """llama.cpp's ``llama-server`` (``tools/server/README.md``; flags in ``common/arg.cpp``): prompt cache per
    request (``cache_prompt``), n-gram speculation (``--spec-type ngram-simple``), batch and micro-batch sizes
    ``-b`` / ``-ub`` (a prompt is decoded in ubatches of that many tokens). Completions' logprobs come as
    ``logprobs.content[i]`` with token ids (``n_probs``); metrics need ``--metrics``."""

    name = "llama.cpp"
    run_here = True
    docs = "https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md"
    always_args = ("--metrics",)
    metric_names = MetricNames(busy=("llamacpp:requests_processing", "llamacpp:requests_deferred"),
                               hits="llamacpp:prompt_tokens_cached_total",
                               drafted="llamacpp:spec_decode_num_draft_tokens_total",
                               accepted="llamacpp:spec_decode_num_accepted_tokens_total")
    SPEC_ARGS = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "4",
                 "--spec-draft-n-max", "4"]

    def variant_args(self, variant: Variant) -> list[str] | None:
        if variant.speculative:
            return list(self.SPEC_ARGS)
        if variant.chunk is not None:
            return ["-b", str(variant.chunk), "-ub", str(variant.chunk)]
        return [] if variant == BASE else ["--no-cache-prompt"]

    def variant_fields(self, variant: Variant) -> Callable[[], dict] | None:
        if variant == NO_CACHE:
            return lambda: {"cache_prompt": False}
        return super().variant_fields(variant)

    def request_fields(self, logprobs: int) -> dict:
        # ignore_eos: a byte vocabulary's GGUF gets id 11 as its end-of-generation token (llama-vocab.cpp)
        return {"n_probs": logprobs, "ignore_eos": True}

    def parse_completion(self, body: dict) -> Completion:
        """``logprobs.content``; a token with logprob 0 and no alternatives is one llama-server did not compute
        (a token of a speculative step: ``result.prob = 1.0f; // set later`` and a to-do note to set ``result.probs``
        in ``tools/server/server-context.cpp``), read as None (not reported), not as probability 1."""
        choice = body["choices"][0]
        content = (choice.get("logprobs") or {}).get("content")
        if not content:
            return Completion(None, None, None, choice["text"], cached_tokens(body))
        unset = [c["logprob"] == 0.0 and not c.get("top_logprobs") for c in content]
        return Completion(tuple(c["id"] for c in content),
                          tuple(None if u else c["logprob"] for c, u in zip(content, unset)),
                          tuple(None if u else {t["id"]: t["logprob"] for t in c.get("top_logprobs", ())}
                                for c, u in zip(content, unset)),
                          choice["text"], cached_tokens(body))

    def tokenize(self, http: httpx.Client, base_url: str, model: str, text: str) -> list[int]:
        r = http.post(f"{base_url}/tokenize", json={"content": text, "add_special": False})
        r.raise_for_status()
        return list(r.json()["tokens"])


class Vllm(Adapter):
    """vLLM (``vllm serve``; engine arguments in ``vllm/engine/arg_utils.py``): the deployment should enable
    ``--enable-prefix-caching --mamba-cache-mode align`` (hybrid models; ``all`` where supported) and may set
    ``--mamba-ssm-cache-dtype``; the suite adds ``cache_salt`` per request for cold prefills (a salted request
    shares no cached block), ``--speculative-config`` (n-gram) and ``--max-num-batched-tokens`` (the step budget
    a prompt is chunked to). Logprobs with ``return_tokens_as_token_ids``."""

    name = "vllm"
    docs = "https://docs.vllm.ai/en/latest/configuration/engine_args.html"
    metric_names = MetricNames(busy=("vllm:num_requests_running", "vllm:num_requests_waiting"),
                               leftovers=("vllm:kv_cache_usage_perc",), hits="vllm:prefix_cache_hits_total",
                               queries="vllm:prefix_cache_queries_total",
                               drafted="vllm:spec_decode_num_draft_tokens_total",
                               accepted="vllm:spec_decode_num_accepted_tokens_total")
    SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}

    def variant_args(self, variant: Variant) -> list[str] | None:
        if variant.speculative:
            return ["--speculative-config", json.dumps(self.SPEC)]
        if variant.chunk is not None:
            return ["--enable-chunked-prefill", "--max-num-batched-tokens", str(variant.chunk)]
        return [] if variant == BASE else ["--no-enable-prefix-caching"]

    def variant_fields(self, variant: Variant) -> Callable[[], dict] | None:
        if variant == NO_CACHE:
            return lambda: {"cache_salt": uuid.uuid4().hex}
        return super().variant_fields(variant)

    def request_fields(self, logprobs: int) -> dict:
        return {"logprobs": logprobs, "return_tokens_as_token_ids": True}


class Sglang(Adapter):
    """SGLang (``python -m sglang.launch_server``; ``python/sglang/srt/server_args.py``): the deployment chooses
    its hybrid cache (``--mamba-radix-cache-strategy no_buffer|extra_buffer``, older builds
    ``--mamba-scheduler-strategy``; ``--mamba-track-interval``, ``--mamba-ssm-dtype``); the suite adds
    ``--disable-radix-cache``, ``--speculative-algorithm NGRAM`` and ``--chunked-prefill-size``. Its metrics name
    the state-cache misses apart (``sglang:mamba_cache_miss_*``, SGLang PR #38018)."""

    name = "sglang"
    docs = "https://docs.sglang.ai/advanced_features/server_arguments.html"
    metric_names = MetricNames(busy=("sglang:num_running_reqs", "sglang:num_queue_reqs"),
                               hits="sglang:cached_tokens_total", queries="sglang:prompt_tokens_total",
                               state_miss_tokens="sglang:mamba_cache_miss_tokens_total",
                               state_miss_requests="sglang:mamba_cache_miss_requests_total")

    def variant_args(self, variant: Variant) -> list[str] | None:
        if variant.speculative:
            return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"]
        if variant.chunk is not None:
            return ["--chunked-prefill-size", str(variant.chunk)]
        return [] if variant == BASE else ["--disable-radix-cache"]

    def tokenize(self, http: httpx.Client, base_url: str, model: str, text: str) -> list[int]:
        r = http.post(f"{base_url}/v1/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return list(r.json()["tokens"])

    def grid(self, launch_args: list[str] | None) -> Grid | None:
        page = int(self.flag_value(launch_args, "--page-size", 1))
        interval = self.flag_value(launch_args, "--mamba-track-interval", None)
        return None if interval is None else Grid(page, int(interval))
