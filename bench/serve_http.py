"""Load generator for the OpenAI-compatible server: ``python -m bench.serve_http [--url URL]``.

A trace-replay client of our own in the request format of ``vllm bench serve`` (its ``openai`` completions
backend: ``POST /v1/completions`` with ``prompt``, ``max_tokens``, ``temperature`` 0, ``ignore_eos``,
``stream`` and ``stream_options.include_usage``), reporting its metrics: TTFT (send -> first streamed
text), TPOT per request ((latency - TTFT) / (output tokens - 1)), ITL (gaps between chunks), end-to-end
latency, request and output-token throughput. guidellm and aiperf pull large dependency trees we do not ship:
``bench.guidellm`` runs guidellm from a venv of its own, and the README says how to point aiperf or
``vllm bench serve`` at the server.

Workload, shaped like the Mooncake conversation trace (``../shared/traces/mooncake_conversation_trace.jsonl``,
kvcache-ai/Mooncake FAST'25): its first ``--requests`` requests in order, scaled by 1/32: each 512-token hash
block becomes 16 bytes (one KV block of the server, N = 16) drawn from a generator seeded by the block's hash id,
so requests that share hash ids share a byte prefix exactly as the trace's share a cached prefix; the output is
output_length / 32 tokens, clipped to [1, 32]. Arrivals are Poisson at each ``--rates`` value (req/s, seeded),
as ``vllm bench serve --request-rate`` draws them. Without ``--url`` a ``python -m serve.http`` process is started on
127.0.0.1 (fresh per rate, so every rate starts from an empty prefix cache; with ``--url`` the server's cache
carries over from rate to rate).

Warm-up (:func:`warmup_workload`, not counted): two streamed requests sent one after the other, of printable
bytes the trace's blocks never start with, so the replay still meets an empty prefix cache (the replay's own first
requests as warm-up made them, and every later request sharing a checkpoint interval with them, cache hits). Between
them they run every kind of step the replay runs: a prefill with no hit, a prefill after a prefix-cache hit (the
second shares two checkpoint intervals with the first), decode steps, and a request that ends at its prefill
(``max_tokens`` 1). Two suffice: the engine runs eager fp32 torch on the CPU, with no per-shape compile or graph
capture (what vLLM warms for each batch size), and a decode bucket or prefix hit it has not run before costs
about what a repeat does (measured in 5 fresh processes of the server's engine, 5 interleaved repeats, 1 thread,
load ~4: the first decode step at each bucket 1 to 32 and the first hit prefill within the repeats' p10-p90, median
first / repeat 0.98 to 1.16); what the first request pays once is the process's and the HTTP stack's first calls.
Writes ``bench/results/serve_http.json``; all figures are measured, on this machine, in this run.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from serve.traces.mooncake import load_mooncake

OUT = Path(__file__).parent / "results" / "serve_http.json"
TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
SCALE, BLOCK_BYTES, MAX_OUTPUT = 32, 16, 32             # 512 tokens / 32 = 16 bytes per hash block
CHECKPOINT_TOKENS = 64                                   # python -m serve.http's --checkpoint-interval default


def mooncake_workload(num_requests: int, max_model_len: int, path: Path = TRACE) -> list[tuple[list[int], int]]:
    """``(prompt bytes, max_tokens)`` per request of the scaled trace (see the module docstring)."""
    out = []
    for req in load_mooncake(path)[:num_requests]:
        prompt = []
        for h in req.hash_ids:
            prompt += random.Random(h).randbytes(BLOCK_BYTES)
        prompt = prompt[:max(1, req.input_length // SCALE)]
        max_tokens = min(MAX_OUTPUT, max(1, req.output_length // SCALE))
        out.append((prompt[: max_model_len - max_tokens], max_tokens))
    return out


def warmup_workload(workload, seed: int = 0) -> list[tuple[list[int], int]]:
    """The two warm-up requests ``(prompt bytes, max_tokens)`` (module docstring): a prompt of three checkpoint
    intervals of printable bytes (32..126) with 8 output tokens, then its first two intervals plus one new
    interval with 1. Raises ValueError if a warm-up prompt starts with the first block of a ``workload`` prompt
    (the replay could then hit what the warm-up cached; for the seeded bytes it never does)."""
    rng = random.Random(seed)
    interval = lambda: [rng.randrange(32, 127) for _ in range(CHECKPOINT_TOKENS)]   # noqa: E731
    first = interval() + interval() + interval()
    warmup = [(first, 8), (first[:2 * CHECKPOINT_TOKENS] + interval(), 1)]
    starts = {tuple(prompt[:BLOCK_BYTES]) for prompt, _ in workload}
    if any(tuple(prompt[:BLOCK_BYTES]) in starts for prompt, _ in warmup):
        raise ValueError(f"a warm-up prompt (seed {seed}) starts like a workload prompt; pick another seed")
    return warmup


async def warm_up(url: str, model: str, warmup) -> None:
    """Send the ``warmup`` requests one after the other (the second's prefix hit needs the first's checkpoints
    published); not counted. Raises RuntimeError if one fails."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for prompt, max_tokens in warmup:
            res = await one_request(client, model, prompt, max_tokens)
            if not res["ok"]:
                raise RuntimeError(f"warm-up request failed: {res['status']}")


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed request as ``vllm bench serve`` sends it; returns its timings (s) and token counts, with
    ``send_t`` and ``chunk_t`` (each streamed text chunk received) as ``time.perf_counter()`` seconds (one
    clock for every process on Linux: comparable with the server's ``--step-trace``)."""
    payload = {"model": model, "prompt": prompt, "temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, last, itl, tokens, chunk_t = None, t0, [], 0, []
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as r:
            if r.status_code != 200:
                return {"ok": False, "status": r.status_code}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj, now = json.loads(line[6:]), time.perf_counter()
                if obj.get("usage"):
                    tokens = obj["usage"]["completion_tokens"]
                if obj["choices"] and obj["choices"][0]["text"]:
                    chunk_t.append(now)
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itl.append(now - last)
                    last = now
    except httpx.TransportError as err:                  # counted as a failed request, as vllm bench serve does
        return {"ok": False, "status": f"{type(err).__name__}: {err}"}
    latency = time.perf_counter() - t0
    ttft = latency if ttft is None else ttft
    return {"ok": True, "send_t": t0, "chunk_t": chunk_t, "ttft": ttft, "latency": latency, "itl": itl,
            "output_tokens": tokens,
            "input_tokens": len(prompt), "tpot": (latency - ttft) / (tokens - 1) if tokens > 1 else None}


async def run_rate(url: str, model: str, workload, rate: float, seed: int, records: list | None = None) -> dict:
    """Send the workload with Poisson arrivals at ``rate`` req/s; the per-rate row of the table. ``records``:
    a list that gets every request's own result (:func:`one_request`), in workload order."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, len(workload))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=1000, keepalive_expiry=2.0)) as client:
        tasks, t_start = [], time.perf_counter()
        for (prompt, max_tokens), gap in zip(workload, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one_request(client, model, prompt, max_tokens)))
        res = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t_start
    if records is not None:
        records.extend(res)
    ok = [r for r in res if r["ok"]]
    ms = lambda xs, q: float(np.percentile(xs, q) * 1e3) if xs else float("nan")   # noqa: E731
    ttft, tpot = [r["ttft"] for r in ok], [r["tpot"] for r in ok if r["tpot"] is not None]
    itl = [g for r in ok for g in r["itl"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    return dict(rate_rps=rate, requests=len(res), failed=len(res) - len(ok), duration_s=wall,
                errors=sorted({str(r["status"]) for r in res if not r["ok"]}),
                request_throughput_rps=len(ok) / wall, output_throughput_tps=out_tokens / wall,
                input_tokens=sum(r["input_tokens"] for r in ok), output_tokens=out_tokens,
                ttft_mean_ms=statistics.fmean(ttft) * 1e3, ttft_p50_ms=ms(ttft, 50), ttft_p99_ms=ms(ttft, 99),
                tpot_mean_ms=statistics.fmean(tpot) * 1e3 if tpot else float("nan"), tpot_p50_ms=ms(tpot, 50),
                tpot_p99_ms=ms(tpot, 99), itl_p50_ms=ms(itl, 50), itl_p99_ms=ms(itl, 99),
                e2e_p50_ms=ms([r["latency"] for r in ok], 50))


@contextlib.contextmanager
def local_server(max_model_len: int, max_num_seqs: int, step_trace: Path | None = None):
    """A fresh ``python -m serve.http`` process on 127.0.0.1 (its own interpreter: the client's Python work
    does not share the server's GIL), stopped on exit; ``step_trace``: its ``--step-trace`` file. Raises
    RuntimeError if it does not come up in 60 s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "serve.http", "--port", str(port), "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(max_num_seqs), "--max-queue", "1024"]
    if step_trace is not None:
        cmd += ["--step-trace", str(step_trace)]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=dict(os.environ, OMP_NUM_THREADS="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {' '.join(cmd)}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.serve_http", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server, its prefix cache kept from rate to rate "
                   "(default: start one here per rate)")
    p.add_argument("--model", default="kda-demo")
    p.add_argument("--requests", type=int, default=48, help="requests per rate (the trace's first N)")
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0], help="req/s (Poisson)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    workload = mooncake_workload(args.requests, args.max_model_len)
    rows = []
    for rate in args.rates:
        with (contextlib.nullcontext(args.url) if args.url else local_server(args.max_model_len,
                                                                            args.max_num_seqs)) as url:
            asyncio.run(warm_up(url, args.model, warmup_workload(workload, args.seed)))    # not counted
            rows.append(asyncio.run(run_rate(url, args.model, workload, rate, args.seed)))
        r = rows[-1]
        print(f"rate {rate:5.1f} req/s: {r['request_throughput_rps']:.2f} req/s done, "
              f"{r['output_throughput_tps']:.0f} tok/s out, TTFT p50 {r['ttft_p50_ms']:.0f} / p99 "
              f"{r['ttft_p99_ms']:.0f} ms, TPOT p50 {r['tpot_p50_ms']:.1f} ms, ITL p99 {r['itl_p99_ms']:.0f} ms, "
              f"failed {r['failed']}", flush=True)
    meta = dict(workload="Mooncake conversation trace, first requests, 1/32 scale (bench/serve_http.py)",
                requests_per_rate=args.requests, server=args.url or "python -m serve.http subprocess on 127.0.0.1, fresh per rate",
                warmup="2 requests of other bytes, one after the other: miss + 8 decode, hit + prefill only (not counted)",
                measured=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
