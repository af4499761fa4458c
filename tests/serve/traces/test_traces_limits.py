"""Regression tests for trace uploads: every limit is checked at load with the line and the limit named,
budgeted reads say what they cut, and nothing allocates in proportion to a number in the file."""

from __future__ import annotations

import io
import json
import tracemalloc

import pytest

from lab.fleet import PAGE_TRACE_BLOCKS, page_trace
from serve.prefix.sim import replay_row
from serve.traces.azure import load_azure_csv, read_azure_csv
from serve.traces.limits import (
    MAX_INPUT_TOKENS,
    MAX_LINE_CHARS,
    MAX_OUTPUT_TOKENS,
    MAX_TRACE_BLOCKS,
    TraceFormatError,
)
from serve.traces.mooncake import TraceRequest, dump_mooncake, load_mooncake, named_bytes, read_mooncake
from serve.traces.vtc_artifact import load_vtc_artifact

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _line(**overrides) -> str:
    obj = {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]}
    obj.update(overrides)
    return json.dumps(obj)


def _peak_bytes(fn, *args, **kwargs) -> tuple[object, int]:
    """(result or the exception raised, peak bytes allocated by Python while running ``fn``)."""
    tracemalloc.start()
    try:
        out = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the caller inspects it
        out = exc
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return out, peak


def test_azure_77_byte_file_with_huge_context_is_rejected_without_allocating():
    """Regression: ``ContextTokens = 10**11`` built ``tuple(range(...))`` of 2·10^8 ids (36 s, 7.5 GB,
    then a MemoryError with an empty message)."""
    data = (HEADER + "2023-11-16 18:17:03,100000000000,100\n").encode()
    assert len(data) == 77
    err, peak = _peak_bytes(load_azure_csv, named_bytes(data, "tiny.csv"))
    assert isinstance(err, TraceFormatError)
    assert str(err).startswith("tiny.csv: line 2: field 'ContextTokens' is 100,000,000,000, more than the limit of "
                               f"{MAX_INPUT_TOKENS:,}")
    assert peak < 1_000_000, f"{peak:,} bytes allocated for a 77-byte file"


def test_fleet_fresh_block_ids_are_bounded():
    """Regression: scenarios.py and vtc.py built ``tuple(range(n))`` for any prompt length they got."""
    from lab.budgets import Stream, budget_traffic
    from serve.fleet.sim.vtc import requests_from_vtc
    from serve.traces.vtc_artifact import VTCRecord, VTCRun

    huge = [TraceRequest(0, 10**11, 10, ())]
    err, peak = _peak_bytes(budget_traffic, [Stream("a", 1.0, 100, 10)], 10.0, "b", 1, 1.0, 1.0, 1, 1, azure=huge)
    assert isinstance(err, ValueError) and "outside [0, 1,048,576]" in str(err) and peak < 5_000_000
    run = VTCRun({}, 1.0, 1.0, [VTCRecord("c", 10**11, 1, 0.0, 0.1, 1.0)])
    err, peak = _peak_bytes(requests_from_vtc, run)
    assert isinstance(err, ValueError) and "request 0" in str(err) and peak < 5_000_000


def test_mooncake_request_over_the_token_limit_names_line_and_limit():
    """Regression: one valid request with 4.7 M hash ids (or two with 10^6) ran page 09 for minutes."""
    n = MAX_INPUT_TOKENS // 512 + 1
    text = _line() + "\n" + _line(timestamp=1, input_length=n * 512, hash_ids=list(range(n))) + "\n"
    with pytest.raises(TraceFormatError, match=r"^<file>: line 2: field 'input_length' is 1,049,088, more than "
                                               r"the limit of 1,048,576 \(tokens per prompt\)$"):
        load_mooncake(io.StringIO(text))


def test_mooncake_line_over_the_length_limit_is_rejected_before_parsing():
    text = _line() + "\n" + _line(pad=" " * MAX_LINE_CHARS) + "\n"
    err, peak = _peak_bytes(load_mooncake, io.StringIO(text))
    assert isinstance(err, TraceFormatError) and str(err).startswith("<file>: line 2: 1,048,")
    assert "more than the limit of 1,048,576 per line" in str(err)


def test_page_trace_cuts_at_the_block_budget_and_says_so():
    """Regression: an upload of many maximal requests was replayed whole (no total-block bound)."""
    per = MAX_INPUT_TOKENS // 512
    reqs = [TraceRequest(i, MAX_INPUT_TOKENS, 1, tuple(range(i * per, (i + 1) * per))) for i in range(70)]
    loaded = page_trace(dump_mooncake(reqs).encode(), 5000, name="big.jsonl")
    kept = PAGE_TRACE_BLOCKS // per
    assert loaded.requests == reqs[:kept] and loaded.cut_line == kept + 1
    assert loaded.note == (f"Kept the first {kept} requests ({kept * per:,} blocks) of big.jsonl: the 131,072-block "
                           "budget (512-token blocks this page replays within a few seconds) stopped the upload at "
                           f"line {kept + 1}; the rest was not read.")
    capped = page_trace(dump_mooncake(reqs).encode(), 3, name="big.jsonl")
    assert len(capped.requests) == 3 and "the 3-request cap" in capped.note
    assert page_trace(dump_mooncake(reqs[:3]).encode(), 3).note == ""  # exactly at the cap: nothing cut


def test_whole_file_load_names_the_line_past_the_block_limit():
    per = MAX_INPUT_TOKENS // 512
    n = MAX_TRACE_BLOCKS // per
    lines = "".join(json.dumps({"timestamp": 0, "input_length": 512 * per, "output_length": 1,
                                "hash_ids": [i] * per}) + "\n" for i in range(n + 1))
    with pytest.raises(TraceFormatError, match=f"^line {n + 1:,}: the file has more than the limit of"):
        load_mooncake(io.StringIO(lines))
    with pytest.raises(TraceFormatError, match="more than the budget of 10 blocks"):
        read_mooncake(io.StringIO(_line(input_length=512 * 11, hash_ids=list(range(11)))), max_total_blocks=10)


@pytest.mark.parametrize("hash_id", [1 << 63, -(1 << 63) - 1, 10**30], ids=["2^63", "-2^63-1", "1e30"])
def test_hash_id_outside_int64_is_rejected_at_load(hash_id):
    """Regression: such ids loaded, then ``routing_key`` raised OverflowError on pages 11, 12 and 14."""
    from serve.fleet.routing.hashing import routing_key

    with pytest.raises(TraceFormatError, match=r"^<file>: line 1: field 'hash_ids' holds .* outside the 64-bit"):
        load_mooncake(io.StringIO(_line(hash_ids=[0, hash_id])))
    with pytest.raises(ValueError, match="outside the signed 64-bit range"):
        routing_key([hash_id], 1)
    assert routing_key([(1 << 63) - 1, -(1 << 63)], 2) == routing_key([(1 << 63) - 1, -(1 << 63)], 2)


def test_only_request_with_empty_prompt_replays_to_zero_ratios():
    """Regression: a trace whose only request has input_length 0 raised ZeroDivisionError on page 09."""
    trace = load_mooncake(io.StringIO(_line(input_length=0, hash_ids=[])))
    row = replay_row(trace, "kimi-linear-48b-a3b", 512)
    assert row["block_hit_ratio"] == 0.0 and row["token_hit_ratio"] == 0.0
    assert all(row[f"miss_{c}"] == 0.0 for c in ("no_kv_block", "evicted", "kv_no_checkpoint", "below_one_block"))


@pytest.mark.parametrize("bad, fragment", [
    ("[" * 100_000, "line 2: bad JSON (nested too deeply)"),
    ('{"timestamp": ' + "9" * 5000 + "}", "line 2: bad JSON (Exceeds the limit (4300 digits)"),
], ids=["deep-nesting", "5000-digit-int"])
def test_json_depth_and_digit_errors_name_the_line(bad, fragment):
    """Regression: RecursionError / a bare ValueError without a line number."""
    with pytest.raises(TraceFormatError) as info:
        load_mooncake(io.StringIO(_line() + "\n" + bad + "\n"))
    assert fragment in str(info.value)


def test_unicode_line_separators_inside_a_json_string_are_kept():
    """Regression: ``str.splitlines`` split a line at a raw U+2028 (also U+0085) inside a
    valid JSON string, so a valid file was rejected as bad JSON."""
    obj = {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1], "note": "a\u2028b\x85c"}
    text = json.dumps(obj, ensure_ascii=False) + "\r\n"
    assert "\u2028" in text and "\x85" in text
    trace = load_mooncake(io.BytesIO(text.encode()))
    assert trace == [TraceRequest(0, 1000, 10, (0, 1))]


@pytest.mark.parametrize("response, fragment", [
    (1, "response 0: expected a JSON object, got 1"),
    ({"adapter_dir": "c", "prompt_len": [1], "output_len": 1, "req_time": 0, "first_token_latency": 1,
      "request_latency": 1}, "response 0: field 'prompt_len' must be an integer, got [1]"),
    ({"adapter_dir": None, "prompt_len": 1, "output_len": 1, "req_time": 0, "first_token_latency": 1,
      "request_latency": 1}, "field 'adapter_dir' must be a string"),
    ({"adapter_dir": "c", "prompt_len": 1, "output_len": 1, "req_time": "soon", "first_token_latency": 1,
      "request_latency": 1}, "field 'req_time' must be a number of seconds"),
    ({"adapter_dir": "c", "prompt_len": 1, "output_len": 1, "req_time": 0, "first_token_latency": 1,
      "request_latency": float("nan")}, "field 'request_latency' is nan"),
    ({"adapter_dir": "c", "prompt_len": 1, "output_len": 1, "req_time": 10**400, "first_token_latency": 1,
      "request_latency": 1}, "field 'req_time' is an integer of 1,329 bits; expected seconds"),
], ids=["int", "list-length", "none-client", "string-time", "nan-latency", "400-digit-time"])
def test_vtc_records_of_the_wrong_type_name_the_response(response, fragment):
    """Regression: ``int([1])`` / ``str``-less records raised TypeError (no response index)."""
    data = json.dumps({"config": {}, "result": {"responses": [response]}})
    with pytest.raises(TraceFormatError) as info:
        load_vtc_artifact(named_bytes(data.encode(), "v.json"))
    assert str(info.value).startswith("v.json: ") and fragment in str(info.value)


def test_vtc_responses_not_a_list_and_real_artifacts_load(traces_dir):
    with pytest.raises(TraceFormatError, match="missing field 'result.responses'"):
        load_vtc_artifact(io.StringIO('{"result": {"responses": 5}}'))
    for path in sorted((traces_dir / "vtc_artifact").glob("*.jsonl")):
        assert load_vtc_artifact(path).records, path


def test_excel_csv_with_a_bom_loads_and_utf16_says_bom():
    """Regression: a UTF-8 BOM from Excel made the header check fail without saying "BOM"."""
    row = "2023-11-16 18:17:03.9799600,4808,10\n"
    trace = load_azure_csv(named_bytes(b"\xef\xbb\xbf" + (HEADER + row).encode(), "excel.csv"))
    assert trace == [TraceRequest(0, 4808, 10, tuple(range(1 << 40, (1 << 40) + 10)))]
    with pytest.raises(TraceFormatError, match=r"^file u16\.csv is not UTF-8 text but UTF-16 .*BOM"):
        load_azure_csv(named_bytes((HEADER + row).encode("utf-16"), "u16.csv"))
    with pytest.raises(TraceFormatError, match=r"^b\.csv: line 1: the header holds a byte-order mark \(BOM"):
        load_azure_csv(named_bytes(("TIMESTAMP,\ufeffContextTokens,GeneratedTokens\n" + row).encode(), "b.csv"))


@pytest.mark.parametrize("row, fragment", [
    ("2023-11-16 18:17:03.9,5\n", "line 2: 2 cells, the header has 3"),
    ("2023-11-16 18:17:03.9,5," + "9" * 5000 + "\n", "field 'GeneratedTokens' must be a non-negative integer"),
    ('2023-11-16 18:17:03.9,5,"' + "x" * 200_000 + '"\n', "line 2: bad CSV (field larger than field limit"),
    ("2023-11-16 18:17:03.9,-5,1\n", "field 'ContextTokens' must be a non-negative integer"),
    ("2023-11-16 18:17:03.x,5,1\n", "bad fraction of a second"),
], ids=["short-row", "5000-digits", "huge-field", "negative", "bad-fraction"])
def test_azure_bad_rows_name_the_line(row, fragment):
    with pytest.raises(TraceFormatError) as info:
        load_azure_csv(named_bytes((HEADER + row).encode(), "a.csv"))
    assert str(info.value).startswith("a.csv: line 2") and fragment in str(info.value)


def test_output_length_over_the_limit_is_rejected():
    """Regression: ``output_length`` 10**12 loaded and "completed" 212 simulated years later."""
    with pytest.raises(TraceFormatError, match=r"^<file>: line 1: field 'output_length' is 1,000,000,000,000, more "
                                               r"than the limit of 131,072 \(tokens per output\)$"):
        load_mooncake(io.StringIO(_line(output_length=10**12)))
    with pytest.raises(TraceFormatError, match="'GeneratedTokens' is 131,073, more than the limit of 131,072"):
        load_azure_csv(io.StringIO(HEADER + f"2023-11-16 18:17:03,1,{MAX_OUTPUT_TOKENS + 1}\n"))
    with pytest.raises(TraceFormatError, match="field 'timestamp' is 2,592,000,001, more than the limit"):
        load_mooncake(io.StringIO(_line(timestamp=30 * 24 * 3600 * 1000 + 1)))


def test_short_azure_file_shrinks_the_burst_and_says_so():
    """Regression: a 2-request Azure file made a 2-request burst while page 13 said 1,500."""
    from lab.budgets import Stream, budget_traffic

    azure = read_azure_csv(io.StringIO(HEADER + "2023-11-16 18:17:03,100,10\n2023-11-16 18:17:04,200,20\n"),
                           max_requests=1500)
    assert azure.note == ""
    traffic = budget_traffic([Stream("vip", 1.0, 256, 64)], 120.0, "standard", 1500, 30.0, 30.0, 1024, 128,
                             azure=azure.requests)
    assert traffic.burst_requests == 2 == sum(r.klass == "standard" for r in traffic.requests)
    assert traffic.note == "The burst has 2 standard requests, not the 1,500 asked for: the Azure trace gave only 2."
    full = budget_traffic([], 120.0, "standard", 1500, 30.0, 30.0, 1024, 128)
    assert full.burst_requests == 1500 and full.note == ""


def test_azure_read_cuts_at_the_request_cap():
    rows = "".join(f"2023-11-16 18:17:{s:02d},100,10\n" for s in range(10))
    loaded = read_azure_csv(named_bytes((HEADER + rows).encode(), "z.csv"), max_requests=4)
    assert len(loaded.requests) == 4 and loaded.cut_line == 6 and "the 4-request cap" in loaded.note
