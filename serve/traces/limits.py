"""Limits on uploaded traces and the checks every trace loader shares (``mooncake.py``, ``azure.py``, ``vtc_artifact.py``).

One rule for every loader: a record outside a limit is an error naming the file, the line (or
response index), the field and the limit; a file with more requests or blocks than the caller's
budget is either an error (``load_*``) or cut after the last request that fits (``read_*``, which the
pages use and whose :class:`LoadedTrace` says what was cut). Nothing allocates in proportion to a
number written in the file: a record's size is checked before anything is built from it.

Limits (serve/traces/README.md, "Inputs and limits"):

| limit | value | why |
|---|---|---|
| :data:`MAX_UPLOAD_BYTES` | 50 MiB | ``server.maxUploadSize`` in ``.streamlit/config.toml`` |
| :data:`MAX_LINE_CHARS` | 1 MiB | a request at :data:`MAX_INPUT_TOKENS` needs ≤ 2,048 ids × 21 chars ≈ 44 KiB |
| :data:`MAX_INPUT_TOKENS` | 1,048,576 | Kimi Linear's longest context (1 M tokens) = 2,048 blocks of 512 |
| :data:`MAX_OUTPUT_TOKENS` | 131,072 | bounds one request's decode; the public traces peak at 2,000 |
| :data:`MAX_TIMESTAMP_MS` | 30 days | the public traces span ≤ 1 hour |
| hash id | int64 | block ids are hashed as 8-byte signed integers (``fleet/hashing.py``) |
| :data:`MAX_TRACE_REQUESTS` / :data:`MAX_TRACE_BLOCKS` | 100,000 / 2,097,152 | whole-file loads (tests, bench) |
"""

from __future__ import annotations

import io
import json
import reprlib
from pathlib import Path
from typing import IO, NamedTuple

MAX_UPLOAD_BYTES = 50 * 1024 * 1024  # bytes; = server.maxUploadSize (50 MB) in .streamlit/config.toml
MAX_LINE_CHARS = 1024 * 1024  # characters in one JSON Lines / CSV line
MAX_INPUT_TOKENS = 1 << 20  # prompt tokens of one request
MAX_OUTPUT_TOKENS = 1 << 17  # generated tokens of one request
MAX_TIMESTAMP_MS = 30 * 24 * 3600 * 1000  # arrival time since the trace start, ms
MAX_TRACE_REQUESTS = 100_000  # requests a whole-file load keeps
MAX_TRACE_BLOCKS = 1 << 21  # hash ids (blocks) a whole-file load keeps, summed over requests
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # range of a hash id

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 40
_short.maxlist = _short.maxdict = 4
_short.maxlevel = 2


class TraceFormatError(ValueError):
    """A trace is malformed or outside a limit; the message names the file, the line and the field."""


class LoadedTrace(NamedTuple):
    """What a ``read_*`` loader kept: ``requests`` (list), ``note`` ("" when nothing was cut, else one
    sentence for the page: what was kept and which limit cut the rest) and ``cut_line`` (the first
    line not kept, 0 when nothing was cut)."""

    requests: list
    note: str
    cut_line: int


def show(value) -> str:
    """A short repr of a user value for an error message (never the whole of a huge value)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"an integer of {value.bit_length():,} bits" if value.bit_length() > 64 else f"{value:,}"
    return _short.repr(value)


def read_text(path_or_file: str | Path | IO, kind: str) -> tuple[str, str]:
    """``(text, name)`` of a path or a text/binary file object; ``name`` is for error messages.

    A UTF-8 byte-order mark (BOM, as Excel writes) is dropped. Raises TraceFormatError naming the file
    for an empty file, a file over :data:`MAX_UPLOAD_BYTES`, UTF-16 text (its BOM) or bytes that are
    not UTF-8 (``kind`` says what the file should be, e.g. "a Mooncake JSON Lines trace")."""
    if isinstance(path_or_file, (str, Path)):
        name = str(path_or_file)
        data: str | bytes = Path(path_or_file).read_bytes()
    else:
        name = str(getattr(path_or_file, "name", "") or "<file>")
        data = path_or_file.read()
    if len(data) == 0:
        raise TraceFormatError(f"file {name} is empty (0 bytes): no requests; expected {kind}")
    if len(data) > MAX_UPLOAD_BYTES:
        raise TraceFormatError(f"file {name} has {len(data):,} bytes, more than the limit of "
                               f"{MAX_UPLOAD_BYTES:,} bytes (50 MiB)")
    if isinstance(data, bytes):
        if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
            raise TraceFormatError(f"file {name} is not UTF-8 text but UTF-16 (it starts with the byte-order mark, BOM, "
                                   f"0x{data[0]:02x} 0x{data[1]:02x}); save it as UTF-8; expected {kind}")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise TraceFormatError(
                f"file {name} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start:,}); "
                f"expected {kind}") from None
    return data.removeprefix("\ufeff"), name


def text_lines(text: str):
    """Iterate ``(line_no, line)`` splitting only at ``\\n``, ``\\r\\n`` or ``\\r`` — never at U+2028,
    U+0085 or form feeds, which may sit inside a JSON string (``str.splitlines`` splits there)."""
    return enumerate(io.StringIO(text, newline=None), start=1)


def parse_json(text: str, where: str, with_line: bool = False):
    """``json.loads(text)``; any way it fails is a :class:`TraceFormatError` naming ``where`` (and, with
    ``with_line``, the line of a syntax error inside a multi-line document): bad JSON, nesting too deep for
    the parser (RecursionError), an integer of more than 4,300 digits (ValueError)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        at = f"line {err.lineno}: " if with_line else ""
        raise TraceFormatError(f"{where}: {at}bad JSON ({err.msg})") from None
    except RecursionError:
        raise TraceFormatError(f"{where}: bad JSON (nested too deeply)") from None
    except ValueError as err:
        raise TraceFormatError(f"{where}: bad JSON ({err})") from None


def check_line_length(line: str, name: str, line_no: int) -> None:
    """Raise TraceFormatError if ``line`` is longer than :data:`MAX_LINE_CHARS` (checked before parsing)."""
    if len(line) > MAX_LINE_CHARS:
        raise TraceFormatError(f"{name}: line {line_no}: {len(line):,} characters, more than the limit of "
                               f"{MAX_LINE_CHARS:,} per line (a request at the {MAX_INPUT_TOKENS:,}-token limit "
                               "needs about 45,000)")


def check_field_int(value, where: str, field: str, low: int, high: int, limit: str = "") -> int:
    """``value`` if it is an integer (not a bool) in ``[low, high]``; else TraceFormatError
    ``"{where}: field '{field}' ..."`` naming the range and ``limit`` (what the bound is)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TraceFormatError(f"{where}: field '{field}' must be an integer, got {show(value)}")
    if value < low:
        raise TraceFormatError(f"{where}: field '{field}' is {'negative' if low == 0 else 'too small'} "
                               f"({show(value)}; must be >= {low:,})")
    if value > high:
        raise TraceFormatError(f"{where}: field '{field}' is {show(value)}, more than the limit of {high:,}"
                               + (f" ({limit})" if limit else ""))
    return value


def cut_note(name: str, kept_requests: int, kept_blocks: int, line_no: int, max_requests: int,
             max_blocks: int) -> str:
    """The page's sentence for a trace cut at ``line_no`` by the request or block budget."""
    which = (f"the {max_requests:,}-request cap" if kept_requests >= max_requests
             else f"the {max_blocks:,}-block budget (512-token blocks this page replays within a few seconds)")
    return (f"Kept the first {kept_requests:,} requests ({kept_blocks:,} blocks) of {name}: {which} stopped "
            f"the upload at line {line_no:,}; the rest was not read.")


def whole_file(loaded: LoadedTrace) -> list:
    """The requests of a ``read_*`` result that kept the whole file; TraceFormatError naming the line where
    the file passes ``MAX_TRACE_REQUESTS`` requests or ``MAX_TRACE_BLOCKS`` blocks otherwise."""
    if loaded.cut_line:
        raise TraceFormatError(f"line {loaded.cut_line:,}: the file has more than the limit of "
                               f"{MAX_TRACE_REQUESTS:,} requests or {MAX_TRACE_BLOCKS:,} blocks ({loaded.note})")
    return loaded.requests
