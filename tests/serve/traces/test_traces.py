"""Tests for serve.traces.mooncake: Mooncake loader errors, the synthetic generator, ideal hit ratios, loaders."""

from __future__ import annotations

import io
import json
import math

import pytest

from serve.traces.azure import load_azure_csv
from serve.traces.mooncake import (
    TraceFormatError,
    TraceRequest,
    dump_mooncake,
    ideal_hit_ratio,
    leading_run,
    load_mooncake,
    named_bytes,
    synthesize,
)
from serve.traces.vtc_artifact import load_vtc_artifact


def _line(**overrides) -> str:
    obj = {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]}
    obj.update(overrides)
    return json.dumps(obj)


def test_load_mooncake_conversation_trace(traces_dir):
    trace = load_mooncake(traces_dir / "mooncake_conversation_trace.jsonl")
    assert len(trace) == 12031  # trace README
    assert all(r.hash_ids[0] == trace[0].hash_ids[0] for r in trace)  # shared system-prompt block
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in trace)
    assert trace[-1].timestamp_ms / 60000 == pytest.approx(59, abs=1)  # ~59 min


def test_ideal_hit_ratio_conversation_trace_fixed_values(traces_dir):
    ideal = ideal_hit_ratio(load_mooncake(traces_dir / "mooncake_conversation_trace.jsonl"))
    assert (ideal.hit_blocks, ideal.total_blocks) == (105710, 288500)
    assert ideal.hit_tokens == 54098411 and ideal.total_tokens == 144793823
    assert ideal.token_hit_ratio == pytest.approx(0.37362, abs=1e-5)


def test_ideal_hit_ratio_by_hand():
    trace = [
        TraceRequest(0, 1024, 1, (0, 1)),        # cold: 0 hit
        TraceRequest(1, 1500, 1, (0, 1, 2)),     # hits 0, 1 -> 1024 tokens
        TraceRequest(2, 700, 1, (0, 3)),         # hits 0 -> 512 tokens
        TraceRequest(3, 1100, 1, (0, 1, 2)),     # hits all 3 blocks, capped at 1100 tokens
    ]
    ideal = ideal_hit_ratio(trace)
    assert (ideal.hit_blocks, ideal.total_blocks) == (6, 10)
    assert ideal.hit_tokens == 1024 + 512 + 1100
    assert ideal.token_hit_ratio == pytest.approx((1024 + 512 + 1100) / (1024 + 1500 + 700 + 1100))


@pytest.mark.parametrize(
    "bad_line, fragment",
    [
        pytest.param("{not json", "bad JSON", id="bad-json"),
        pytest.param(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1}), "'hash_ids'", id="missing"),
        pytest.param(_line(output_length=-3), "'output_length' is negative", id="negative"),
        pytest.param(_line(input_length=1025), "needs ceil(1025/512) = 3", id="hash-ids-count"),
        pytest.param(_line(input_length="10"), "'input_length' must be an integer", id="string-length"),
        pytest.param("[1, 2]", "expected a JSON object", id="not-object"),
    ],
)
def test_load_mooncake_bad_line_names_line_and_field(bad_line, fragment):
    text = _line() + "\n\n" + bad_line + "\n"
    with pytest.raises(TraceFormatError, match="line 3") as info:
        load_mooncake(io.StringIO(text))
    assert fragment in str(info.value)


def test_load_mooncake_timestamps_backwards_and_empty():
    with pytest.raises(TraceFormatError, match="line 2: field 'timestamp' goes backwards"):
        load_mooncake(io.StringIO(_line(timestamp=5) + "\n" + _line(timestamp=4)))
    with pytest.raises(TraceFormatError, match="no requests"):
        load_mooncake(io.BytesIO(b"\n\n"))


def test_dump_load_roundtrip_bytes_upload():
    trace = synthesize(num_requests=50, duration_s=30, seed=3)
    assert load_mooncake(io.BytesIO(dump_mooncake(trace).encode())) == trace


def test_synthesize_schema_seed_and_statistics():
    a = synthesize(num_requests=3000, duration_s=900, seed=7)
    assert a == synthesize(num_requests=3000, duration_s=900, seed=7)
    assert a != synthesize(num_requests=3000, duration_s=900, seed=8)
    assert [r.timestamp_ms for r in a] == sorted(r.timestamp_ms for r in a)
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in a)
    assert all(r.hash_ids[0] == 0 for r in a)  # shared system prompt block
    # multi-turn: a good share of requests extend an earlier prompt beyond the system block
    seen: set[int] = set()
    deep = 0
    for r in a:
        deep += leading_run(r.hash_ids, seen) >= 2
        seen.update(r.hash_ids)
    assert 0.15 < deep / len(a) < 0.6  # conversation trace: 0.39
    ideal = ideal_hit_ratio(a)
    assert 0.25 < ideal.token_hit_ratio < 0.5  # conversation trace: 0.374
    mean_in = sum(r.input_length for r in a) / len(a)
    assert 6000 < mean_in < 16000  # conversation trace: 12,035
    dump = dump_mooncake(a)
    assert load_mooncake(io.StringIO(dump)) == a


def test_synthesize_prefix_consistency():
    """A repeated id always sits at the same position after the same parent (chained ids)."""
    parent = {}
    for r in synthesize(num_requests=2000, duration_s=600, seed=1):
        for i, h in enumerate(r.hash_ids):
            p = r.hash_ids[i - 1] if i else None
            assert parent.setdefault(h, p) == p


def test_synthesize_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_requests"):
        synthesize(num_requests=0)
    with pytest.raises(ValueError, match="new_session_prob"):
        synthesize(new_session_prob=1.5)


def test_load_azure_code_trace(traces_dir):
    trace = load_azure_csv(traces_dir / "azure_llm_2023_code.csv")
    assert len(trace) == 8819
    assert trace[0].timestamp_ms == 0 and trace[1].timestamp_ms == 52  # 18:17:03.97996 -> 04.03196
    assert trace[0].input_length == 4808 and trace[0].output_length == 10
    assert ideal_hit_ratio(trace).hit_blocks == 0  # no prefix information: nothing shared
    with pytest.raises(TraceFormatError, match="line 2"):
        load_azure_csv(io.StringIO("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n"))


def test_load_vtc_artifact_on_off_less(traces_dir):
    run = load_vtc_artifact(traces_dir / "vtc_artifact" / "VTC_on_off_less.jsonl")
    assert len(run.records) == 1350 and run.throughput_rps == pytest.approx(1.7136, abs=1e-4)
    clients = {r.client for r in run.records}
    assert len(clients) == 2
    with pytest.raises(TraceFormatError, match="result.responses"):
        load_vtc_artifact(io.StringIO("{}"))


@pytest.mark.parametrize("loader", [load_mooncake, load_azure_csv, load_vtc_artifact])
def test_empty_file_names_the_file(loader):
    """Regression: a 0-byte upload was silently replaced by the synthetic trace (the loader was never
    called); every loader now reports an empty file by name."""
    with pytest.raises(TraceFormatError, match=r"^file empty\.jsonl is empty \(0 bytes\): no requests"):
        loader(named_bytes(b"", "empty.jsonl"))


def test_blank_or_header_only_file_has_no_requests():
    with pytest.raises(TraceFormatError, match=r"^file blank\.jsonl has no requests \(only blank lines\)"):
        load_mooncake(named_bytes(b"\n  \n\n", "blank.jsonl"))
    with pytest.raises(TraceFormatError, match=r"^file h\.csv has no requests \(a header line but no rows\)"):
        load_azure_csv(named_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n", "h.csv"))
    with pytest.raises(TraceFormatError, match=r"^file b\.csv has no header line"):
        load_azure_csv(named_bytes(b"\n\n", "b.csv"))


def test_binary_file_is_not_utf8_names_file_and_offset(tmp_path):
    """Regression: a binary upload surfaced as a raw UnicodeDecodeError with no file name."""
    data = _line().encode() + b"\n\x89PNG\r\n\x1a\n\xff\x00"
    for loader, kind in ((load_mooncake, "Mooncake JSON Lines"), (load_azure_csv, "Azure LLM trace CSV"),
                         (load_vtc_artifact, "VTC artifact")):
        with pytest.raises(TraceFormatError) as info:
            loader(named_bytes(data, "image.png"))
        offset = len(_line()) + 1
        assert str(info.value).startswith(f"file image.png is not UTF-8 text (byte 0x89 at offset {offset})")
        assert kind in str(info.value)
    path = tmp_path / "bin.jsonl"
    path.write_bytes(data)
    with pytest.raises(TraceFormatError, match=f"^file {path} is not UTF-8 text"):
        load_mooncake(path)


def test_named_bytes_names_the_file():
    assert named_bytes(b"x", "").name == "uploaded file"
    assert named_bytes(b"x", "t.jsonl").name == "t.jsonl"
