"""Request traces: the Mooncake JSON Lines format, a seeded synthetic generator, Azure and VTC loaders.

One request of a trace is a :class:`TraceRequest`. ``hash_ids`` has one id per ``block_size``-token
block of the prompt (512 in the Mooncake traces; the last block is partial), and ids are *chained*:
two prompts share a cached prefix exactly for their leading run of equal ids.

Sources (files under ``../shared/traces/``, see its README):
- Mooncake (kvcache-ai/Mooncake, FAST'25): ``{"timestamp", "input_length", "output_length", "hash_ids"}``
  per line, timestamp in ms since the trace start.
- Azure LLM inference trace 2023 (Splitwise, ISCA'24): CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``,
  no prefix information.
- VTC artifact (Sheng et al., OSDI'24): measured per-request latencies of FCFS vs VTC scheduling.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import IO, NamedTuple

import numpy as np

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


class TraceFormatError(ValueError):
    """A trace line is malformed; the message names the line number and the field."""


def _open_text(path_or_file: str | Path | IO, kind: str) -> tuple[list[str], str]:
    """Lines of a path or a text/binary file object, and the name to put in error messages.

    Raises TraceFormatError naming the file for an empty (0-byte) file or bytes that are not UTF-8
    (``kind`` says what the file should be, e.g. "a Mooncake JSON Lines trace")."""
    if isinstance(path_or_file, (str, Path)):
        name = str(path_or_file)
        data: str | bytes = Path(path_or_file).read_bytes()
    else:
        name = str(getattr(path_or_file, "name", "") or "<file>")
        data = path_or_file.read()
    if len(data) == 0:
        raise TraceFormatError(f"file {name} is empty (0 bytes): no requests; expected {kind}")
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise TraceFormatError(
                f"file {name} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start:,}); "
                f"expected {kind}") from None
    return data.splitlines(), name


def upload_parts(upload) -> tuple[bytes | None, str]:
    """``(content bytes, file name)`` of an uploaded file (anything with ``getvalue()`` and ``name``,
    e.g. a Streamlit ``UploadedFile``), or ``(None, "")`` without one. An empty file gives ``b""``,
    not None, so the loaders can report it instead of silently falling back to a default trace."""
    if upload is None:
        return None, ""
    return upload.getvalue(), str(getattr(upload, "name", "") or "uploaded file")


def named_bytes(data: bytes, name: str) -> io.BytesIO:
    """A binary file object over ``data`` whose ``name`` the loaders put in their error messages."""
    buf = io.BytesIO(data)
    buf.name = name or "uploaded file"
    return buf


def load_mooncake(path_or_file: str | Path | IO, block_size: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    """Load a Mooncake JSON Lines trace.

    Args:
        path_or_file: a path, or a text/binary file object (e.g. a Streamlit upload).
        block_size: tokens per hash id (512 for the published traces).
    Returns:
        the requests in file order (blank lines skipped).
    Raises:
        TraceFormatError (a ValueError) naming the file, ``line N`` and the field for: bad JSON, a missing
        field, a non-integer or negative length or timestamp, ``len(hash_ids) != ceil(input_length /
        block_size)``, timestamps going backwards; naming the file for an empty (0-byte or blank-lines-only)
        file or one that is not UTF-8 text.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
    lines, name = _open_text(path_or_file, "a Mooncake JSON Lines trace (one JSON object per line)")
    requests: list[TraceRequest] = []
    last_ts = 0
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise TraceFormatError(f"{name}: line {line_no}: bad JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{name}: line {line_no}: expected a JSON object, got {type(obj).__name__}")
        for field in _MOONCAKE_FIELDS:
            if field not in obj:
                raise TraceFormatError(f"{name}: line {line_no}: missing field '{field}'")
        for field in ("timestamp", "input_length", "output_length"):
            value = obj[field]
            if not isinstance(value, int) or isinstance(value, bool):
                raise TraceFormatError(f"{name}: line {line_no}: field '{field}' must be an integer, got {value!r}")
            if value < 0:
                raise TraceFormatError(f"{name}: line {line_no}: field '{field}' is negative ({value})")
        hash_ids = obj["hash_ids"]
        if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
            raise TraceFormatError(f"{name}: line {line_no}: field 'hash_ids' must be a list of integers")
        expected = math.ceil(obj["input_length"] / block_size)
        if len(hash_ids) != expected:
            raise TraceFormatError(
                f"{name}: line {line_no}: field 'hash_ids' has {len(hash_ids)} ids but input_length "
                f"{obj['input_length']} needs ceil({obj['input_length']}/{block_size}) = {expected}"
            )
        if obj["timestamp"] < last_ts:
            raise TraceFormatError(
                f"{name}: line {line_no}: field 'timestamp' goes backwards ({obj['timestamp']} < {last_ts})"
            )
        last_ts = obj["timestamp"]
        requests.append(TraceRequest(obj["timestamp"], obj["input_length"], obj["output_length"], tuple(hash_ids)))
    if not requests:
        raise TraceFormatError(f"file {name} has no requests (only blank lines); expected one JSON object per line")
    return requests


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
    if num_requests <= 0:
        raise ValueError(f"num_requests must be > 0, got {num_requests}")
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if not 0.0 <= new_session_prob <= 1.0:
        raise ValueError(f"new_session_prob must be in [0, 1], got {new_session_prob}")
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


def load_azure_csv(
    path_or_file: str | Path | IO, block_size: int = MOONCAKE_BLOCK_TOKENS, id_offset: int = 1 << 40
) -> list[TraceRequest]:
    """Load an Azure LLM inference trace (CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Timestamps (wall clock, 100 ns digits) become ms since the first request. The trace has no prefix
    information, so every block gets a fresh id (starting at ``id_offset``, away from Mooncake ids):
    nothing is shared. Raises TraceFormatError (a ValueError) naming the file and line for a bad row or a
    missing column, and the file for an empty, header-only or non-UTF-8 file.
    """
    lines, name = _open_text(path_or_file, "an Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens)")
    reader = csv.DictReader(lines)
    needed = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    if not any(line.strip() for line in lines):
        raise TraceFormatError(f"file {name} has no header line (only blank lines); expected {', '.join(needed)}")
    if reader.fieldnames is None or any(c not in reader.fieldnames for c in needed):
        raise TraceFormatError(f"{name}: line 1: header must contain {', '.join(needed)}, got {reader.fieldnames}")
    rows: list[tuple[datetime, int, int]] = []
    for line_no, row in enumerate(reader, start=2):
        try:
            stamp = row["TIMESTAMP"]
            head, _, frac = stamp.partition(".")
            ts = datetime.strptime(head, "%Y-%m-%d %H:%M:%S")
            micro = int((frac + "000000")[:6]) if frac else 0
            rows.append((ts.replace(microsecond=micro), int(row["ContextTokens"]), int(row["GeneratedTokens"])))
        except (ValueError, TypeError) as err:
            raise TraceFormatError(f"{name}: line {line_no}: bad row {row!r} ({err})") from None
        if rows[-1][1] < 0 or rows[-1][2] < 0:
            raise TraceFormatError(f"{name}: line {line_no}: negative token count")
    if not rows:
        raise TraceFormatError(f"file {name} has no requests (a header line but no rows)")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    out: list[TraceRequest] = []
    next_id = id_offset
    for ts, ctx, gen in rows:
        n = math.ceil(ctx / block_size)
        out.append(TraceRequest(int((ts - t0).total_seconds() * 1000.0), ctx, gen, tuple(range(next_id, next_id + n))))
        next_id += n
    return out


class VTCRecord(NamedTuple):
    """One measured request of the VTC artifact (S-LoRA, Llama-7B, one A10G).

    ``client`` (adapter dir), ``prompt_len`` / ``output_len`` tokens, ``req_time_s`` arrival (s since
    start), ``ttft_s`` first-token latency (s; -1 = rejected), ``latency_s`` end-to-end latency (s).
    """

    client: str
    prompt_len: int
    output_len: int
    req_time_s: float
    ttft_s: float
    latency_s: float


class VTCRun(NamedTuple):
    """One scheduler's run of one VTC suite: ``config`` (the suite's settings), ``throughput_rps``
    (completed requests / total_time as the artifact reports it), ``total_time_s``, ``records``."""

    config: dict
    throughput_rps: float
    total_time_s: float
    records: list[VTCRecord]


def load_vtc_artifact(path_or_file: str | Path | IO) -> VTCRun:
    """Load one VTC artifact result file (``{"config", "result": {"responses": [...], ...}}``).

    Raises TraceFormatError (a ValueError) naming the response index and field when a record is
    malformed, and the file when it is empty or not UTF-8 text.
    """
    lines, name = _open_text(path_or_file, "a VTC artifact result file (JSON)")
    try:
        obj = json.loads("\n".join(lines))
    except json.JSONDecodeError as err:
        raise TraceFormatError(f"{name}: line {err.lineno}: bad JSON ({err.msg})") from None
    try:
        result = obj["result"]
        responses = result["responses"]
    except (KeyError, TypeError):
        raise TraceFormatError(f"{name}: missing field 'result.responses'") from None
    records = []
    for i, r in enumerate(responses):
        try:
            records.append(VTCRecord(str(r["adapter_dir"]), int(r["prompt_len"]), int(r["output_len"]),
                                     float(r["req_time"]), float(r["first_token_latency"]),
                                     float(r["request_latency"])))
        except KeyError as err:
            raise TraceFormatError(f"{name}: response {i}: missing field {err}") from None
    return VTCRun(obj.get("config", {}), float(result.get("throughput", float("nan"))),
                  float(result.get("total_time", float("nan"))), records)
