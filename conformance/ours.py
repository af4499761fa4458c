"""Our server (``python -m serve.http``) as an engine under test: its adapter (the flags of
``serve/http/__main__.py`` for each setting a check toggles, its metrics of ``serve/http/metrics.py``) and
:func:`serve_in_process`, which starts it in this process from the same flags (the page's live run and the tests).

The one module of the suite that imports our serving code, and only inside :func:`serve_in_process`: a run against
another engine never imports it."""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from conformance.adapters import BASE, Adapter, Grid, MetricNames, Variant

DEFAULT_BLOCK, DEFAULT_INTERVAL = 16, 64        # python -m serve.http's --block-size, --checkpoint-interval


class Ours(Adapter):
    """``python -m serve.http``: ``--no-prefix-cache``, ``--speculative-config`` (n-gram, vLLM's format),
    ``--chunked-prefill-size``; byte-level tokens (a prompt's ids are its UTF-8 bytes); vLLM's and SGLang's metric
    names, with the state-cache misses counted apart (``sglang:mamba_cache_miss_*``)."""

    name = "ours"
    run_here = True
    docs = "python -m serve.http --help"
    metric_names = MetricNames(busy=("vllm:num_requests_running", "vllm:num_requests_waiting"),
                               leftovers=("kda:request_pages", "kda:state_slots_used", "vllm:kv_cache_usage_perc"),
                               hits="vllm:prefix_cache_hits_total", queries="vllm:prefix_cache_queries_total",
                               state_miss_tokens="sglang:mamba_cache_miss_tokens_total",
                               state_miss_requests="sglang:mamba_cache_miss_requests_total",
                               drafted="vllm:spec_decode_num_draft_tokens_total",
                               accepted="vllm:spec_decode_num_accepted_tokens_total")
    SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}

    def port_args(self, port: int) -> list[str]:
        return ["--host", "127.0.0.1", "--port", str(port)]

    def variant_args(self, variant: Variant) -> list[str] | None:
        if variant == BASE:
            return []
        if variant.speculative:
            return ["--speculative-config", json.dumps(self.SPEC)]
        if variant.chunk is not None:
            return ["--chunked-prefill-size", str(variant.chunk)]
        return ["--no-prefix-cache"]

    def request_fields(self, logprobs: int) -> dict:
        return {"logprobs": logprobs, "return_tokens_as_token_ids": True}

    def tokenize(self, http, base_url: str, model: str, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def grid(self, launch_args: list[str] | None) -> Grid | None:
        return Grid(int(self.flag_value(launch_args, "--block-size", DEFAULT_BLOCK)),
                    int(self.flag_value(launch_args, "--checkpoint-interval", DEFAULT_INTERVAL)))


@contextlib.contextmanager
def serve_in_process(args: list[str]) -> Iterator[tuple[str, str]]:
    """Start our server in this process on 127.0.0.1 (a free port) as ``python -m serve.http args`` would (the
    same option parsing, engine, app and door limits; ``--host`` / ``--port`` are ignored) and yield ``(base_url,
    model_name)``; stopped on exit. Raises ValueError with argparse's message for options it refuses."""
    from serve.http.__main__ import door_limits, engine_spec, parse_args
    from serve.http.app import create_app
    from serve.http.background import serve_in_thread
    from serve.http.model import build_engine

    try:
        ns = parse_args(list(args))
    except SystemExit as exit_:
        raise ValueError(f"python -m serve.http refuses {args}: exit status {exit_.code} (see its message above)") from None
    spec = engine_spec(ns)
    name = ns.served_model_name or f"kda-{ns.preset}"
    app = create_app(build_engine(spec), name, spec.max_model_len, spec.max_num_seqs, ns.max_queue)
    with serve_in_thread(app, limits=door_limits(ns)) as url:
        yield url, name
