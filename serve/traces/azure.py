"""The Azure LLM inference trace 2023 (Splitwise, ISCA'24; Azure/AzurePublicDataset): CSV
``TIMESTAMP,ContextTokens,GeneratedTokens``, one request per row, no prefix information.

Checks and limits are those of every trace loader (``serve/traces/limits.py``).
"""

from __future__ import annotations

import csv
import io
import re
from datetime import datetime
from pathlib import Path
from typing import IO

from serve.traces.limits import (
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
    read_text,
    show,
    whole_file,
)
from serve.traces.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_DIGITS = re.compile(r"\s*[0-9]{1,18}\s*")  # an unsigned integer with at most 18 digits (fits int64)


def _count(cell: str, where: str, field: str, high: int, limit: str) -> int:
    if not _DIGITS.fullmatch(cell):
        raise TraceFormatError(f"{where}: field '{field}' must be a non-negative integer, got {show(cell)}")
    return check_field_int(int(cell), where, field, 0, high, limit)


def _timestamp(cell: str, where: str) -> datetime:
    head, _, frac = cell.strip().partition(".")
    try:
        ts = datetime.strptime(head, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        raise TraceFormatError(f"{where}: field 'TIMESTAMP' must look like 2023-11-16 18:17:03.9799600, "
                               f"got {show(cell)}") from None
    if frac and not (frac.isascii() and frac.isdigit()):
        raise TraceFormatError(f"{where}: field 'TIMESTAMP' has a bad fraction of a second: {show(cell)}")
    return ts.replace(microsecond=int((frac + "000000")[:6]) if frac else 0)


def read_azure_csv(path_or_file: str | Path | IO, block_size: int = MOONCAKE_BLOCK_TOKENS,
                   id_offset: int = 1 << 40, max_requests: int = MAX_TRACE_REQUESTS,
                   max_total_blocks: int = MAX_TRACE_BLOCKS) -> LoadedTrace:
    """Read the leading rows of an Azure LLM trace CSV within a budget.

    Rows are kept in file order while ``max_requests`` rows and ``max_total_blocks`` blocks
    (ceil(ContextTokens / block_size) per row) fit, then sorted by time; timestamps (wall clock, 100 ns
    digits) become ms since the first kept request. The trace has no prefix information, so every block
    gets a fresh id (from ``id_offset``, away from Mooncake ids): nothing is shared.

    Returns:
        :class:`LoadedTrace` of :class:`TraceRequest` (``note`` says what was cut).
    Raises:
        TraceFormatError (a ValueError) naming the file, the line and the field for a bad row (wrong
        number of cells, a bad timestamp, a count that is not a plain integer or is over
        ``MAX_INPUT_TOKENS`` / ``MAX_OUTPUT_TOKENS``, a span over ``MAX_TIMESTAMP_MS``), a missing
        column or a byte-order mark (BOM) left inside the header; naming the file for an empty,
        header-only, too large, UTF-16 or non-UTF-8 file. A leading UTF-8 BOM (Excel) is accepted.
    """
    if block_size <= 0 or max_requests <= 0 or max_total_blocks <= 0:
        raise ValueError(f"block_size, max_requests and max_total_blocks must be positive, got {block_size}, "
                         f"{max_requests}, {max_total_blocks}")
    text, name = read_text(path_or_file, "an Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens)")
    reader = csv.reader(io.StringIO(text, newline=""))
    rows: list[tuple[datetime, int, int, int]] = []  # (time, context tokens, generated tokens, line)
    header: list[str] | None = None
    blocks, note, cut_line = 0, "", 0
    try:
        for cells in reader:
            line_no = reader.line_num
            if not cells or all(not c.strip() for c in cells):
                continue
            where = f"{name}: line {line_no}"
            if header is None:
                header = [c.strip() for c in cells]
                if any("\ufeff" in c for c in header):
                    raise TraceFormatError(f"{where}: the header holds a byte-order mark (BOM, U+FEFF) inside a "
                                           f"column name: {show(cells)}; save the file as plain UTF-8 CSV")
                missing = [c for c in AZURE_COLUMNS if c not in header]
                if missing:
                    raise TraceFormatError(f"{where}: header must contain {', '.join(AZURE_COLUMNS)}, "
                                           f"got {show(cells)}")
                cols = [header.index(c) for c in AZURE_COLUMNS]
                continue
            if len(rows) == max_requests:
                note, cut_line = cut_note(name, len(rows), blocks, line_no, max_requests, max_total_blocks), line_no
                break
            check_line_length(",".join(cells), name, line_no)
            if len(cells) != len(header):
                raise TraceFormatError(f"{where}: {len(cells)} cells, the header has {len(header)}")
            ts = _timestamp(cells[cols[0]], where)
            ctx = _count(cells[cols[1]], where, "ContextTokens", MAX_INPUT_TOKENS, "tokens per prompt")
            gen = _count(cells[cols[2]], where, "GeneratedTokens", MAX_OUTPUT_TOKENS, "tokens per output")
            n = -(-ctx // block_size)
            if blocks + n > max_total_blocks:
                if not rows:
                    raise TraceFormatError(f"{where}: {n:,} blocks, more than the budget of {max_total_blocks:,}")
                note, cut_line = cut_note(name, len(rows), blocks, line_no, max_requests, max_total_blocks), line_no
                break
            blocks += n
            rows.append((ts, ctx, gen, line_no))
    except csv.Error as err:
        raise TraceFormatError(f"{name}: line {reader.line_num}: bad CSV ({err})") from None
    if header is None:
        raise TraceFormatError(f"file {name} has no header line (only blank lines); expected "
                               f"{', '.join(AZURE_COLUMNS)}")
    if not rows:
        raise TraceFormatError(f"file {name} has no requests (a header line but no rows)")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    out: list[TraceRequest] = []
    next_id = id_offset
    for ts, ctx, gen, line_no in rows:
        ms = round((ts - t0).total_seconds() * 1000.0)
        if ms > MAX_TIMESTAMP_MS:
            raise TraceFormatError(f"{name}: line {line_no}: field 'TIMESTAMP' is {ms:,} ms after the first "
                                   f"request, more than the limit of {MAX_TIMESTAMP_MS:,} ms (30 days)")
        n = -(-ctx // block_size)  # ≤ MAX_INPUT_TOKENS / block_size, and Σ n ≤ max_total_blocks
        out.append(TraceRequest(ms, ctx, gen, tuple(range(next_id, next_id + n))))
        next_id += n
    return LoadedTrace(out, note, cut_line)


def load_azure_csv(path_or_file: str | Path | IO, block_size: int = MOONCAKE_BLOCK_TOKENS,
                   id_offset: int = 1 << 40) -> list[TraceRequest]:
    """Load a whole Azure LLM trace CSV (the checks of :func:`read_azure_csv`), sorted by time.

    Raises TraceFormatError as :func:`read_azure_csv` does, and naming the line where the file passes
    ``MAX_TRACE_REQUESTS`` rows or ``MAX_TRACE_BLOCKS`` blocks."""
    return whole_file(read_azure_csv(path_or_file, block_size, id_offset))
