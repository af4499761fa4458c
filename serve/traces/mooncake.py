"""Request traces: the Mooncake JSON Lines format, its loader, a seeded synthetic generator, ideal hit ratios.

One request of a trace is a :class:`TraceRequest`. ``hash_ids`` has one id per ``block_size``-token
block of the prompt (512 in the Mooncake traces; the last block is partial), and ids are *chained*:
two prompts share a cached prefix exactly for their leading run of equal ids.

Sources (files under ``../shared/traces/``, see its README):
- Mooncake (kvcache-ai/Mooncake, FAST'25): ``{"timestamp", "input_length", "output_length", "hash_ids"}``
  per line, timestamp in ms since the trace start.
- Azure LLM inference trace 2023 (Splitwise, ISCA'24): ``serve/traces/azure.py``.
- VTC artifact (Sheng et al., OSDI'24): ``serve/traces/vtc_artifact.py``.
Limits every loader applies: ``serve/traces/limits.py``.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import IO, NamedTuple

import numpy as np

from serve.errors import check_fraction, check_int, check_positive
from serve.traces.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_INPUT_TOKENS,
    MAX_OUTPUT_TOKENS,
    MAX_TIMESTAMP_MS,
    MAX_TRACE_BLOCKS,
    MAX_TRACE_REQUESTS,
    LoadedTrace,
    TraceFormatError,
    check_field_int,
    check_line_length,
    cut_note,
    parse_json,
    read_text,
    show,
    text_lines,
    whole_file,
)

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces (trace README)
_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceRequest(NamedTuple):
    """One request of a trace.

    Fields: ``timestamp_ms`` arrival (ms since trace start), ``input_length`` prompt tokens,
    ``output_length`` generated tokens, ``hash_ids`` chained block ids (one per block of the prompt).
    """

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def named_bytes(data: bytes, name: str) -> io.BytesIO:
    """A binary file object over ``data`` whose ``name`` the loaders put in their error messages."""
    buf = io.BytesIO(data)
    buf.name = name or "uploaded file"
    return buf


def _mooncake_request(line: str, where: str, block_size: int) -> TraceRequest:
    """One validated Mooncake record (see :func:`read_mooncake` for the checks)."""
    obj = parse_json(line, where)
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for field in _MOONCAKE_FIELDS:
        if field not in obj:
            raise TraceFormatError(f"{where}: missing field '{field}'")
    ts = check_field_int(obj["timestamp"], where, "timestamp", 0, MAX_TIMESTAMP_MS, "ms; 30 days")
    length = check_field_int(obj["input_length"], where, "input_length", 0, MAX_INPUT_TOKENS, "tokens per prompt")
    output = check_field_int(obj["output_length"], where, "output_length", 0, MAX_OUTPUT_TOKENS, "tokens per output")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list):
        raise TraceFormatError(f"{where}: field 'hash_ids' must be a list of integers, got {show(hash_ids)}")
    expected = -(-length // block_size)
    if len(hash_ids) != expected:
        raise TraceFormatError(f"{where}: field 'hash_ids' has {len(hash_ids)} ids but input_length "
                               f"{length} needs ceil({length}/{block_size}) = {expected}")
    for h in hash_ids:
        if not isinstance(h, int) or isinstance(h, bool):
            raise TraceFormatError(f"{where}: field 'hash_ids' must be a list of integers, got {show(h)}")
        if not INT64_MIN <= h <= INT64_MAX:
            raise TraceFormatError(f"{where}: field 'hash_ids' holds {show(h)}, outside the 64-bit signed "
                                   f"range [{INT64_MIN:,}, {INT64_MAX:,}]")
    return TraceRequest(ts, length, output, tuple(hash_ids))


def read_mooncake(path_or_file: str | Path | IO, block_size: int = MOONCAKE_BLOCK_TOKENS,
                  max_requests: int = MAX_TRACE_REQUESTS, max_total_blocks: int = MAX_TRACE_BLOCKS) -> LoadedTrace:
    """Read the leading requests of a Mooncake JSON Lines trace within a budget.

    Args:
        path_or_file: a path, or a text/binary file object (e.g. a Streamlit upload).
        block_size: tokens per hash id (512 for the published traces).
        max_requests / max_total_blocks: keep requests in file order while both fit (blocks = hash ids
            summed over the kept requests); the first request that does not fit ends the read.
    Returns:
        :class:`LoadedTrace` (``requests`` in file order, blank lines skipped; ``note`` says what was cut).
    Raises:
        TraceFormatError (a ValueError) naming the file, ``line N`` and the field for: a line over
        ``MAX_LINE_CHARS``, bad JSON (also nested too deeply or an integer of > 4,300 digits), a missing
        field, a length or timestamp that is not an integer or is outside [0, limit] (``MAX_INPUT_TOKENS``,
        ``MAX_OUTPUT_TOKENS``, ``MAX_TIMESTAMP_MS``), a hash id outside int64, ``len(hash_ids) !=
        ceil(input_length / block_size)``, timestamps going backwards; naming the file for an empty
        (0-byte or blank-lines-only), too large, UTF-16 or non-UTF-8 file; ValueError for a
        non-positive ``block_size`` or budget.
    """
    if block_size <= 0 or max_requests <= 0 or max_total_blocks <= 0:
        raise ValueError(f"block_size, max_requests and max_total_blocks must be positive, got {block_size}, "
                         f"{max_requests}, {max_total_blocks}")
    text, name = read_text(path_or_file, "a Mooncake JSON Lines trace (one JSON object per line)")
    requests: list[TraceRequest] = []
    last_ts = blocks = 0
    for line_no, line in text_lines(text):
        if not line.strip():
            continue
        if len(requests) == max_requests:
            return LoadedTrace(requests, cut_note(name, len(requests), blocks, line_no, max_requests,
                                                  max_total_blocks), line_no)
        check_line_length(line, name, line_no)
        where = f"{name}: line {line_no}"
        req = _mooncake_request(line, where, block_size)
        if req.timestamp_ms < last_ts:
            raise TraceFormatError(f"{where}: field 'timestamp' goes backwards ({req.timestamp_ms} < {last_ts})")
        if blocks + len(req.hash_ids) > max_total_blocks:
            if not requests:
                raise TraceFormatError(f"{where}: {len(req.hash_ids):,} blocks, more than the budget of "
                                       f"{max_total_blocks:,} blocks")
            return LoadedTrace(requests, cut_note(name, len(requests), blocks, line_no, max_requests,
                                                  max_total_blocks), line_no)
        last_ts = req.timestamp_ms
        blocks += len(req.hash_ids)
        requests.append(req)
    if not requests:
        raise TraceFormatError(f"file {name} has no requests (only blank lines); expected one JSON object per line")
    return LoadedTrace(requests, "", 0)


def load_mooncake(path_or_file: str | Path | IO, block_size: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    """Load a whole Mooncake JSON Lines trace (the checks of :func:`read_mooncake`).

    Returns the requests in file order. Raises TraceFormatError as :func:`read_mooncake` does, and
    naming the line where the file passes ``MAX_TRACE_REQUESTS`` requests or ``MAX_TRACE_BLOCKS`` blocks.
    """
    return whole_file(read_mooncake(path_or_file, block_size))


def dump_mooncake(requests: Iterable[TraceRequest]) -> str:
    """Serialize requests to Mooncake JSON Lines (inverse of :func:`load_mooncake`)."""
    return "".join(
        json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                    "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
        for r in requests
    )


def synthesize(
    num_requests: int = 2000,
    duration_s: float = 600.0,
    seed: int = 0,
    block_size: int = MOONCAKE_BLOCK_TOKENS,
    new_session_prob: float = 0.65,
    system_prompt_blocks: int = 1,
    median_first_prompt_tokens: float = 5000.0,
    median_turn_tokens: float = 600.0,
    median_output_tokens: float = 260.0,
    max_input_tokens: int = 131072,
) -> list[TraceRequest]:
    """Seeded synthetic trace with the Mooncake schema and conversation-trace-like statistics.

    Model: arrivals are a Poisson process over ``duration_s``. Each arrival opens a new session with
    probability ``new_session_prob`` (the conversation trace has ~61 % of requests whose only hit is the
    system block), else it continues a uniformly chosen earlier session. Every prompt starts with the
    same ``system_prompt_blocks`` full blocks (ids 0..). A new session's prompt is lognormal around
    ``median_first_prompt_tokens``; a follow-up turn's prompt is the session's previous prompt +
    previous output + a new user message (lognormal around ``median_turn_tokens``), so its ``hash_ids``
    repeat the previous prompt's *full* blocks and get fresh ids from there on (the previous last,
    partial block changes content). Outputs are lognormal around ``median_output_tokens``.

    Returns:
        ``num_requests`` requests sorted by timestamp (ms, integers).
    Raises:
        ValueError for non-positive counts or durations, or a probability outside [0, 1].
    """
    check_int("num_requests", num_requests)
    check_positive("duration_s", duration_s)
    check_fraction("new_session_prob", new_session_prob)
    if block_size <= 0 or system_prompt_blocks < 0:
        raise ValueError("block_size must be > 0 and system_prompt_blocks >= 0")
    rng = np.random.default_rng(seed)
    times_ms = np.sort(rng.uniform(0.0, duration_s * 1000.0, size=num_requests)).astype(np.int64)
    system_tokens = system_prompt_blocks * block_size
    next_id = system_prompt_blocks
    sessions: list[tuple[int, tuple[int, ...], int]] = []  # (prompt tokens, hash ids, last output tokens)
    out: list[TraceRequest] = []
    for ts in times_ms:
        output_len = int(np.clip(rng.lognormal(math.log(median_output_tokens), 0.85), 1, 4096))
        if not sessions or rng.random() < new_session_prob:
            body = int(np.clip(rng.lognormal(math.log(median_first_prompt_tokens), 1.1), 16, max_input_tokens))
            input_len = min(system_tokens + body, max_input_tokens)
            kept: tuple[int, ...] = tuple(range(system_prompt_blocks))[: input_len // block_size]
            session = len(sessions)
            sessions.append((0, (), 0))
        else:
            session = int(rng.integers(len(sessions)))
            prev_len, prev_ids, prev_out = sessions[session]
            turn = int(np.clip(rng.lognormal(math.log(median_turn_tokens), 1.0), 1, max_input_tokens))
            input_len = min(prev_len + prev_out + turn, max_input_tokens)
            kept = prev_ids[: min(prev_len, input_len) // block_size]
        num_blocks = math.ceil(input_len / block_size)
        fresh = num_blocks - len(kept)
        hash_ids = kept + tuple(range(next_id, next_id + fresh))
        next_id += fresh
        sessions[session] = (input_len, hash_ids, output_len)
        out.append(TraceRequest(int(ts), input_len, output_len, hash_ids))
    return out


class IdealHitRatio(NamedTuple):
    """Hit ratios of an infinite, shared prefix cache (computed directly from ``hash_ids``).

    ``block_hit_ratio`` = blocks of each request's leading run of ids seen before / all blocks;
    ``token_hit_ratio`` = Σ min(run · block_size, input_length) / Σ input_length;
    ``hit_blocks`` / ``total_blocks`` / ``hit_tokens`` / ``total_tokens`` are the raw counts.
    """

    block_hit_ratio: float
    token_hit_ratio: float
    hit_blocks: int
    total_blocks: int
    hit_tokens: int
    total_tokens: int


def leading_run(hash_ids: Iterable[int], seen: set[int] | dict) -> int:
    """Number of leading ids of ``hash_ids`` present in ``seen`` (the prefix-cache hit in blocks)."""
    run = 0
    for h in hash_ids:
        if h not in seen:
            break
        run += 1
    return run


def ideal_hit_ratio(requests: Iterable[TraceRequest], block_size: int = MOONCAKE_BLOCK_TOKENS) -> IdealHitRatio:
    """Ideal (unlimited, single shared cache) block and token hit ratios of a trace, in trace order.

    Each request hits the leading run of its ``hash_ids`` already seen in an earlier request (ids are
    chained, so a seen id implies its whole prefix was seen); hit tokens are capped at ``input_length``
    (the last block is partial). The block ratio is Mooncake's view (one hash id = one block);
    the paper's Table 2 "cache ratio" gives no formula and is not this count.
    """
    seen: set[int] = set()
    hit_blocks = total_blocks = hit_tokens = total_tokens = 0
    for r in requests:
        run = leading_run(r.hash_ids, seen)
        seen.update(r.hash_ids)
        hit_blocks += run
        total_blocks += len(r.hash_ids)
        hit_tokens += min(run * block_size, r.input_length)
        total_tokens += r.input_length
    return IdealHitRatio(
        hit_blocks / total_blocks if total_blocks else 0.0,
        hit_tokens / total_tokens if total_tokens else 0.0,
        hit_blocks, total_blocks, hit_tokens, total_tokens,
    )
