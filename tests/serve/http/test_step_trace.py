"""``--step-trace``: the server logs every engine step's composition and every request's timeline, and the log
adds up: every prompt token computed or restored exactly once, one decode row per token after the first, each
request's times in order, and the client's clock (another thread here, another process in the bench) agrees."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from serve.http.app import create_app
from serve.http.background import serve_in_thread
from serve.http.model import EngineSpec, build_engine
from serve.http.step_trace import StepTrace, read_step_trace
from tests.serve.http.server_helpers import MODEL

PROMPTS = ["a" * 70 + "first", "b" * 40, "c" * 9, "a" * 70 + "second"]      # the last restores the first's prefix
MAX_TOKENS = [8, 7, 9, 4]                         # the first three decode together: 3 rows, one pad row


def test_trace_accounts_for_every_token_and_orders_every_request(tmp_path):
    spec = EngineSpec(max_model_len=128, max_num_seqs=4)
    path = tmp_path / "steps.jsonl"
    app = create_app(build_engine(spec), MODEL, spec.max_model_len, spec.max_num_seqs, 8, StepTrace(path))
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        sent = time.perf_counter()

        def run(i):
            return client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i])

        with ThreadPoolExecutor(3) as pool:
            list(pool.map(run, range(3)))
        run(3)
        done = time.perf_counter()
    steps, reqs = read_step_trace(path)
    assert sorted((r["prompt_tokens"], r["output_tokens"], r["status"]) for r in reqs) == sorted(
        (len(p), n, "finished") for p, n in zip(PROMPTS, MAX_TOKENS))
    for r in reqs:
        assert sent <= r["arrival_t"] <= r["feed_t"] <= r["first_t"] <= r["last_t"] <= r["end_t"] <= done
    last = next(r for r in reqs if r["prompt_tokens"] == len(PROMPTS[3]))
    assert last["hit_tokens"] == 64                          # the first prompt's checkpoint on the 64-token grid
    prefill_rows = [row for s in steps for row in s["prefill"]]
    assert sum(n for n, _ in prefill_rows) == sum(r["prompt_tokens"] - r["hit_tokens"] for r in reqs)
    assert sorted(start for _, start in prefill_rows) == sorted(r["hit_tokens"] for r in reqs)
    assert sum(s["decode_rows"] for s in steps) == sum(n - 1 for n in MAX_TOKENS)
    assert any(s["decode_rows"] == 3 and s["pad_rows"] == 1 for s in steps)
    for s in steps:
        assert s["loop_t"] <= s["t0"] <= s["t1"] <= s["emit_t"] and 0 < s["cpu_s"] <= s["t1"] - s["t0"] + 1e-3 and s["others_cpu_s"] >= -1e-3
        assert s["decode_rows"] + s["pad_rows"] in (0, 1, 2, 4)                        # padded to a bucket


def test_read_step_trace_names_the_bad_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"kind": "step"}) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"t.jsonl:2"):
        read_step_trace(path)
