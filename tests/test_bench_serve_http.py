"""bench/serve_http.py's warm-up: the replay after it meets an empty prefix cache, and the two warm-up requests run
every kind of step the replay runs (a prefill with and without a hit, decode, a request ending at its prefill),
through the real engine and, sent by :func:`bench.serve_http.warm_up`, through the server."""
import asyncio

import httpx
import pytest

from bench.serve_http import BLOCK_BYTES, CHECKPOINT_TOKENS, mooncake_workload, warm_up, warmup_workload
from serve.http.model import EngineSpec, build_engine, load_model
from tests.serve.http.server_helpers import MODEL, metric, running_server

SPEC = EngineSpec("demo-tiny", max_model_len=1024)     # the bench's server, seeded model: hits depend on the cache only


@pytest.fixture(scope="module")
def workload():
    return mooncake_workload(24, SPEC.max_model_len)      # from the 18th on, requests hit the ones before them


def _kinds(results, max_tokens) -> set[str]:
    """The kinds of step the requests ran: prefill with / without a hit, decode, ended at the prefill."""
    kinds = set()
    for res, n in zip(results, max_tokens):
        kinds |= {"hit prefill" if res.hit_tokens else "miss prefill", "decode" if n > 1 else "prefill only"}
    return kinds


def test_warmup_leaves_the_replay_an_empty_cache_and_runs_every_kind_of_step(workload):
    engine = build_engine(SPEC, load_model(SPEC.preset))
    warmup = warmup_workload(workload)
    warm = [engine.generate(p, n) for p, n in warmup]
    replay = [engine.generate(p, n) for p, n in workload]
    # the replay's first requests find nothing the warm-up cached (the replay's own first two as warm-up: 208, 224)
    assert [r.hit_tokens for r in replay[:2]] == [0, 0]
    assert [r.hit_tokens for r in warm] == [0, 2 * CHECKPOINT_TOKENS]      # the second hits the first's checkpoints
    replay_kinds = _kinds(replay, [n for _, n in workload])
    assert "hit prefill" in replay_kinds and replay_kinds <= _kinds(warm, [n for _, n in warmup])
    engine.check_integrity()


def test_warmup_refuses_bytes_a_workload_prompt_starts_with(workload):
    clash = warmup_workload(workload)[0][0][:BLOCK_BYTES] + [0] * 40
    with pytest.raises(ValueError, match="starts like a workload prompt"):
        warmup_workload(workload + [(clash, 4)])


def test_warm_up_through_the_server_runs_the_hit(workload):
    """Through the server: both warm-up requests are served and the second finds the first's checkpoints (sent one
    after the other, it always can)."""
    with running_server(SPEC, max_queue=4, model=load_model(SPEC.preset)) as (url, _app):
        asyncio.run(warm_up(url, MODEL, warmup_workload(workload)))
        text = httpx.get(url + "/metrics").text
    assert metric(text, "vllm:prefix_cache_hits_total", model_name=MODEL) == 2 * CHECKPOINT_TOKENS
    assert metric(text, "vllm:request_success_total", model_name=MODEL, finished_reason="length") == 2
