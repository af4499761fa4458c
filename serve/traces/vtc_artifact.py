"""The VTC artifact (Sheng et al., OSDI'24; Ying1123/VTC-artifact ``fair_bench/<scheduler>/all_results_*.jsonl``):
measured per-request latencies of S-LoRA (Llama-7B, one A10G) under FCFS and VTC scheduling.

Each file is one JSON object ``{"config": {...}, "result": {"responses": [...], "throughput", "total_time", ...}}``.
Checks and limits are those of every trace loader (``serve/traces/limits.py``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import IO, NamedTuple

from serve.traces.limits import (
    MAX_INPUT_TOKENS,
    MAX_OUTPUT_TOKENS,
    MAX_TIMESTAMP_MS,
    MAX_TRACE_REQUESTS,
    TraceFormatError,
    check_field_int,
    parse_json,
    read_text,
    show,
)

_MAX_SECONDS = MAX_TIMESTAMP_MS / 1000.0


class VTCRecord(NamedTuple):
    """One measured request of the VTC artifact (S-LoRA, Llama-7B, one A10G).

    ``client`` (adapter dir), ``prompt_len`` / ``output_len`` tokens, ``req_time_s`` arrival (s since
    start), ``ttft_s`` first-token latency (s; -1 = rejected), ``latency_s`` end-to-end latency (s; -1 = rejected).
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


def _seconds(value, where: str, field: str, allow_rejected: bool) -> float:
    """A finite number of seconds in [0, 30 days] (or -1 for a rejected request when allowed)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TraceFormatError(f"{where}: field '{field}' must be a number of seconds, got {show(value)}")
    v = float(value) if isinstance(value, float) or abs(value) <= 1 << 53 else math.inf  # float(10**400) overflows
    if not math.isfinite(v) or not (0.0 <= v <= _MAX_SECONDS or (allow_rejected and v == -1.0)):
        raise TraceFormatError(f"{where}: field '{field}' is {show(value)}; expected seconds in "
                               f"[0, {_MAX_SECONDS:,.0f}]" + (" or -1 (rejected)" if allow_rejected else ""))
    return v


def _record(r, where: str) -> VTCRecord:
    if not isinstance(r, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {show(r)}")
    for field in ("adapter_dir", "prompt_len", "output_len", "req_time", "first_token_latency", "request_latency"):
        if field not in r:
            raise TraceFormatError(f"{where}: missing field '{field}'")
    if not isinstance(r["adapter_dir"], str):
        raise TraceFormatError(f"{where}: field 'adapter_dir' must be a string, got {show(r['adapter_dir'])}")
    return VTCRecord(r["adapter_dir"],
                     check_field_int(r["prompt_len"], where, "prompt_len", 0, MAX_INPUT_TOKENS, "tokens per prompt"),
                     check_field_int(r["output_len"], where, "output_len", 0, MAX_OUTPUT_TOKENS, "tokens per output"),
                     _seconds(r["req_time"], where, "req_time", False),
                     _seconds(r["first_token_latency"], where, "first_token_latency", True),
                     _seconds(r["request_latency"], where, "request_latency", True))


def _optional_number(result: dict, field: str, name: str) -> float:
    value = result.get(field, math.nan)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TraceFormatError(f"{name}: field 'result.{field}' must be a number, got {show(value)}")
    return float(value) if isinstance(value, float) or abs(value) <= 1 << 53 else math.nan


def load_vtc_artifact(path_or_file: str | Path | IO) -> VTCRun:
    """Load one VTC artifact result file (``{"config", "result": {"responses": [...], ...}}``).

    Raises TraceFormatError (a ValueError) naming the file, the response index and the field when a
    record is not an object, misses a field, has a client that is not a string, a length that is not an
    integer in [0, limit] or a time that is not a finite number of seconds in [0, 30 days] (latencies
    may be -1: rejected); naming the file for bad JSON (with its line), more than ``MAX_TRACE_REQUESTS``
    responses, a ``config`` that is not an object, or an empty, too large, UTF-16 or non-UTF-8 file.
    """
    text, name = read_text(path_or_file, "a VTC artifact result file (JSON)")
    obj = parse_json(text, name, with_line=True)
    result = obj.get("result") if isinstance(obj, dict) else None
    responses = result.get("responses") if isinstance(result, dict) else None
    if not isinstance(responses, list):
        raise TraceFormatError(f"{name}: missing field 'result.responses' (a list of request records)")
    if len(responses) > MAX_TRACE_REQUESTS:
        raise TraceFormatError(f"{name}: 'result.responses' has {len(responses):,} records, more than the limit "
                               f"of {MAX_TRACE_REQUESTS:,}")
    config = obj.get("config", {})
    if not isinstance(config, dict):
        raise TraceFormatError(f"{name}: field 'config' must be an object, got {show(config)}")
    records = [_record(r, f"{name}: response {i}") for i, r in enumerate(responses)]
    return VTCRun(config, _optional_number(result, "throughput", name), _optional_number(result, "total_time", name),
                  records)
