"""Bounded load through the ``openai`` async client: 72 concurrent streaming clients (over the 64 state
slots, so some queue), a fixed 96 requests, a quarter cancelled mid-stream at a random chunk. Every request
that completes streams exactly the text of a batch-1 run of its prompt on a fresh cache-off engine; every
cancelled one ends as ABORTED or (if it raced its last token) FINISHED; afterwards /metrics shows no request
running, waiting or holding a slot or page, ``check_integrity()`` holds, and once the prefix cache is cleared
the pool's free pages equal the baseline. Half the prompts share a 64-byte prefix (one KDA chunk), so warm
requests restore a checkpoint on the chunk grid and must still match the cold reference."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai

from serve.http.model import EngineSpec, load_model
from serve.http.protocol import decode_all
from tests.serve.http.server_helpers import MODEL, metric, on_engine, reference_texts, running_server

NUM_REQUESTS, CONCURRENCY, CANCEL_FRACTION, SEED = 96, 72, 0.25, 7


def workload(seed: int):
    """``(prompts, max_tokens, cancel_after)``: seeded byte prompts of 8-48 bytes, half behind one shared
    64-byte prefix; 3-10 output tokens; a chunk index to cancel after for ~CANCEL_FRACTION of them."""
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(64)]
    prompts, max_tokens, cancel = [], [], []
    for i in range(NUM_REQUESTS):
        own = [rng.randrange(256) for _ in range(rng.randint(8, 48))]
        prompts.append(shared + own if i % 2 else own)
        max_tokens.append(rng.randint(3, 10))
        cancel.append(rng.randint(1, max_tokens[-1] - 1) if rng.random() < CANCEL_FRACTION else None)
    return prompts, max_tokens, cancel


async def drive(url: str, prompts, max_tokens, cancel):
    """Run every request, at most CONCURRENCY streams at once; returns per request (text, cancelled)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i):
        async with gate:
            stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i],
                                                     stream=True)
            pieces, finish = [], None
            async for k, chunk in _enumerate(stream):
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
                if cancel[i] is not None and k + 1 == cancel[i]:
                    await stream.close()                   # the client goes away mid-stream
                    return "".join(pieces), True
            assert finish == "length"
            return "".join(pieces), False

    try:
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        await client.close()


async def _enumerate(aiter):
    k = 0
    async for x in aiter:
        yield k, x
        k += 1


def test_concurrent_streams_with_cancels_match_batch1_and_free_everything():
    prompts, max_tokens, cancel = workload(SEED)
    model = load_model("demo")
    with running_server(EngineSpec(max_model_len=256, max_num_seqs=64), max_queue=64, model=model) as (url, app):
        baseline_free = on_engine(app, lambda e: e.pool.num_free)
        t0 = time.perf_counter()
        results = asyncio.run(drive(url, prompts, max_tokens, cancel))
        wall_s = time.perf_counter() - t0
        for _ in range(200):                                  # aborts land on the engine thread
            text = httpx.get(url + "/metrics").text
            if metric(text, "kda:state_slots_used", model_name=MODEL) == 0:
                break
            time.sleep(0.05)
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "kda:state_slots_used",
                     "kda:request_pages"):
            assert metric(text, name, model_name=MODEL) == 0, name
        assert metric(text, "kda:state_slots_free", model_name=MODEL) == 64
        done = metric(text, "vllm:request_success_total", finished_reason="length", model_name=MODEL)
        aborted = metric(text, "kda:requests_aborted_total", model_name=MODEL)
        assert done + aborted == NUM_REQUESTS
        assert aborted <= sum(c is not None for c in cancel) and aborted >= 1
        on_engine(app, lambda e: e.check_integrity())
        assert on_engine(app, lambda e: (len(e.running), len(e.waiting))) == (0, 0)
        on_engine(app, lambda e: e.cache.clear())
        assert on_engine(app, lambda e: e.pool.num_free) == baseline_free
        hits = metric(text, "vllm:prefix_cache_hits_total", model_name=MODEL)
    refs = reference_texts(prompts, max_tokens)
    completed = 0
    for (text, cancelled), ref in zip(results, refs):
        if cancelled:
            assert decode_all(ref).startswith(text)        # a prefix: a character split across tokens is held
        else:
            assert text == decode_all(ref)
            completed += 1
    assert completed == NUM_REQUESTS - sum(c is not None for c in cancel)
    assert hits > 0                                           # warm requests were among those checked
    tokens = sum(n for n, c in zip(max_tokens, cancel) if c is None)
    print(f"\nload: {NUM_REQUESTS} requests, {CONCURRENCY} concurrent streams, {aborted:.0f} aborted: "
          f"{NUM_REQUESTS / wall_s:.2f} requests/s, {tokens / wall_s:.0f} output tokens/s of completed requests, "
          f"{wall_s:.1f} s wall (measured, this run)")
