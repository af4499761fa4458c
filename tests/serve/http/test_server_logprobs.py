"""``/v1/completions``' ``logprobs``: each emitted token's natural-log probability is the log-softmax of the logits
the engine sampled it from (its batch-1 run's, recorded), the alternatives are the most likely ids in order, in
OpenAI's completions format, as ``token_id:N`` with vLLM's ``return_tokens_as_token_ids``; streamed chunks carry
the same values; out-of-range values and chat logprobs are 400s naming the field."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from serve.http.model import EngineSpec, build_engine, load_model
from tests.serve.http.server_helpers import MODEL, running_server

PROMPT = list(b"def checkpoint(state):\n    # the caf\xc3\xa9 ")
N = 10


@pytest.fixture(scope="module")
def url():
    with running_server(EngineSpec(max_model_len=128, max_num_seqs=2), max_queue=4) as (base, _):
        yield base


def post(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": N, **body},
                      timeout=60)


def test_logprobs_are_the_log_softmax_of_the_sampled_logits(url):
    ref = build_engine(EngineSpec(max_model_len=128, prefix_cache=False, max_num_seqs=1),
                       load_model("demo")).generate(PROMPT, N, record_logits=True)
    lp = torch.log_softmax(ref.logits, dim=-1)                                        # [N, 256]
    got = post(url, logprobs=3, return_tokens_as_token_ids=True).json()["choices"][0]["logprobs"]
    assert got["tokens"] == [f"token_id:{t}" for t in ref.output_tokens]
    assert got["token_logprobs"] == pytest.approx([lp[i, t].item() for i, t in enumerate(ref.output_tokens)], abs=1e-6)
    for i, top in enumerate(got["top_logprobs"]):
        want_v, want_i = lp[i].topk(3)
        assert list(top) == [f"token_id:{t}" for t in want_i.tolist()]
        assert list(top.values()) == pytest.approx(want_v.tolist(), abs=1e-6)
    assert got["text_offset"][0] == 0 and got["text_offset"] == sorted(got["text_offset"])


def test_token_strings_and_the_stream_carry_the_same_values(url):
    whole = post(url, logprobs=0).json()["choices"][0]
    assert all(top == {} for top in whole["logprobs"]["top_logprobs"])             # logprobs 0: the chosen only
    for t in whole["logprobs"]["tokens"]:
        assert len(t) == 1 and ord(t) < 128 or t.startswith("bytes:\\x")
    events = [json.loads(line[6:]) for line in post(url, logprobs=0, stream=True).text.splitlines()
              if line.startswith("data: {")]
    streamed = [v for e in events if e["choices"][0]["logprobs"] for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    assert post(url).json()["choices"][0]["logprobs"] is None                     # not asked: null


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
], ids=["over-20", "negative", "chat"])
def test_bad_logprobs_are_400_naming_the_field(url, path, body, param):
    r = httpx.post(f"{url}{path}", json={"model": MODEL, "max_tokens": 1, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
