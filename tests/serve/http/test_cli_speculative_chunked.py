"""``python -m serve.http --speculative-config JSON --chunked-prefill-size N``: the options reach the engine, bad
values exit 2 with argparse's message, and the served greedy bytes equal the plain server's (speculation accepted
drafts, counted in vLLM's ``vllm:spec_decode_*`` metrics; temperature > 0 is a 400 there, not a 503)."""
from __future__ import annotations

import httpx
import pytest

from serve.http.__main__ import engine_spec, parse_args, startup_line
from serve.http.model import EngineSpec, SpeculativeConfig, build_engine, load_model
from tests.serve.http.server_helpers import MODEL, assert_exits_2, metric, running_server

LOOP = "for i in range(10):\n    total = total + i\n    print(i, total)\n"
PROMPTS = [(LOOP * 3)[:-20], "The scheduler admits a request only when its pages and one state slot fit. " * 3]


def test_options_reach_the_engine_and_the_startup_line():
    args = parse_args(["--preset", "demo-tiny", "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}',
                       "--chunked-prefill-size", "32"])
    spec = engine_spec(args)
    assert spec.speculative == SpeculativeConfig("ngram", 2, 4, 1) and spec.chunked_prefill_size == 32
    engine = build_engine(spec, load_model("demo-tiny"))
    assert engine.speculation.num_draft_tokens == 2 and engine.max_prefill_chunk == 32
    assert engine.speculation.proposer([1, 2]).max_ngram == 4
    line = startup_line(args, engine, "m")
    assert "speculative ngram, 2 drafts (n-grams 1..4)" in line and "prefill chunks of 32 tokens" in line
    plain = build_engine(engine_spec(parse_args(["--preset", "demo-tiny"])), load_model("demo-tiny"))
    assert plain.speculation is None and plain.max_prefill_chunk is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--speculative-config", "{"], "argument --speculative-config: not JSON"),
    (["--speculative-config", "[3]"], "argument --speculative-config: must be a JSON object"),
    (["--speculative-config", '{"method": "eagle"}'], "method must be one of ('ngram',), got 'eagle'"),
    (["--speculative-config", '{"num_speculative_tokens": 0}'], "num_speculative_tokens must be an int >= 1, got 0"),
    (["--speculative-config", '{"prompt_lookup_min": 3, "prompt_lookup_max": 2}'], "prompt_lookup_max must be an int >= 3"),
    (["--speculative-config", '{"draft_model": "x"}'], "unknown key(s) ['draft_model']"),
    (["--speculative-config", "{}", "--state-write", "replay_ssm"], "--speculative-config needs --state-write slot"),
    (["--chunked-prefill-size", "0"], "argument --chunked-prefill-size: must be an int >= 1, got 0"),
], ids=["not-json", "not-object", "method", "zero-drafts", "min-over-max", "unknown-key", "replay-ssm", "chunk-0"])
def test_bad_values_exit_2(argv, message, capsys):
    assert_exits_2(argv, message, capsys)


def test_engine_spec_refuses_speculation_with_replay_ssm():
    with pytest.raises(ValueError, match="speculative decoding needs state_write='slot'"):
        EngineSpec(state_write="replay_ssm", speculative=SpeculativeConfig())


def _serve(spec: EngineSpec) -> tuple[list[str], str]:
    with running_server(spec, max_queue=4) as (url, _):
        texts = [httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 16},
                            timeout=60).json()["choices"][0]["text"] for p in PROMPTS]
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                           "temperature": 0.7}, timeout=60)
        metrics = httpx.get(f"{url}/metrics").text
    return texts, refused, metrics


def test_speculative_and_chunked_servers_serve_the_plain_servers_bytes():
    plain, ok, _ = _serve(EngineSpec(max_model_len=256, max_num_seqs=2))
    spec, refused, metrics = _serve(EngineSpec(max_model_len=256, max_num_seqs=2, speculative=SpeculativeConfig()))
    chunked, _, _ = _serve(EngineSpec(max_model_len=256, max_num_seqs=2, chunked_prefill_size=64))
    assert spec == plain == chunked and ok.status_code == 200
    assert metric(metrics, "vllm:spec_decode_num_accepted_tokens_total", model_name=MODEL) > 0
    assert metric(metrics, "vllm:spec_decode_num_draft_tokens_total", model_name=MODEL) >= \
        metric(metrics, "vllm:spec_decode_num_accepted_tokens_total", model_name=MODEL)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature", refused.text
