"""The replayed requests: lengths, arrivals and shared prefixes from the Mooncake conversation trace, scaled to
what the demo model runs in a bounded time.

Scaling of one trace request (``serve.traces.mooncake``: 512-token hash blocks, chained ids, ms timestamps):
- prompt = its first hash id's ``system_tokens`` bytes (every request of the conversation trace starts with id 0:
  a shared system prompt, which becomes a prefix-cache hit once the first request has published its checkpoint at
  ``system_tokens``; 64 = one checkpoint interval) + ``block_tokens`` bytes per further hash id, cut to
  ``system_tokens + input_length / scale`` (at most ``max_prompt_tokens``); the bytes of an id are seeded by the
  id, so equal chained ids give equal bytes;
- output = ``output_length / scale`` tokens, clipped to [1, ``max_output_tokens``];
- arrivals = the trace's timestamps of the window, shifted to start at 0 and stretched so that the mean rate is
  ``rate_rps`` (the trace's burstiness is kept: Mooncake timestamps are whole seconds, so several requests
  arrive together).
``hash_ids`` per request: one chained id per ``block_tokens`` tokens of the prompt (the simulator's prefix-cache
key, the engine's block size).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

from serve.errors import check_int, check_positive
from serve.traces.mooncake import load_mooncake

TRACE = Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


class ReplayRequest(NamedTuple):
    """``request_id``; ``arrival_ms`` on the replay's clock; ``prompt`` byte ids ``[T]``; ``max_new_tokens``;
    ``hash_ids``: chained ids, one per ``block_tokens`` tokens of the prompt (the last block may be partial)."""

    request_id: int
    arrival_ms: float
    prompt: tuple
    max_new_tokens: int
    hash_ids: tuple


def _bytes_of(block_id, n: int) -> list[int]:
    return list(random.Random(repr(block_id)).randbytes(n))


def mooncake_requests(start: int, count: int, rate_rps: float, path: Path = TRACE, scale: int = 32,
                      system_tokens: int = 64, block_tokens: int = 16, max_prompt_tokens: int = 384,
                      max_output_tokens: int = 24) -> list[ReplayRequest]:
    """``count`` requests from trace line ``start`` at a mean ``rate_rps`` (see the module docstring). Raises
    ValueError for a non-positive size or rate, or a window past the trace's end (naming the input)."""
    for name, v in (("count", count), ("scale", scale), ("system_tokens", system_tokens),
                    ("block_tokens", block_tokens), ("max_prompt_tokens", max_prompt_tokens),
                    ("max_output_tokens", max_output_tokens)):
        check_int(name, v)
    check_int("start", start, 0)
    check_positive("rate_rps", rate_rps)
    if system_tokens % block_tokens:
        raise ValueError(f"system_tokens must be a multiple of block_tokens={block_tokens}, got {system_tokens}")
    trace = load_mooncake(path)
    if start + count > len(trace):
        raise ValueError(f"start + count = {start + count} exceeds the trace's {len(trace)} requests")
    window = trace[start:start + count]
    t0, span = window[0].timestamp_ms, window[-1].timestamp_ms - window[0].timestamp_ms
    stretch = (count / rate_rps * 1e3) / span if span else 0.0      # trace ms -> replay ms at the target rate
    out = []
    for i, r in enumerate(window):
        length = min(system_tokens + max(1, r.input_length // scale), max_prompt_tokens)
        prompt = _bytes_of(("system", r.hash_ids[0]), system_tokens)
        keys = [("system", r.hash_ids[0], j) for j in range(system_tokens // block_tokens)]
        for k, h in enumerate(r.hash_ids[1:]):
            if len(prompt) >= length:
                break
            prompt += _bytes_of(h, block_tokens)
            keys.append(tuple(r.hash_ids[: k + 2]))
        prompt += _bytes_of(("tail", start + i), max(0, length - len(prompt)))   # ids ran out: a private tail
        prompt = prompt[:length]
        keys += [("tail", start + i, j) for j in range(len(keys), -(-length // block_tokens))]
        out.append(ReplayRequest(i, (r.timestamp_ms - t0) * stretch, tuple(prompt),
                                 min(max_output_tokens, max(1, r.output_length // scale)),
                                 tuple(hash(k) for k in keys[: -(-length // block_tokens)])))
    return out
