"""bench/guidellm.py without guidellm: the byte table its tokenizer is built on, and the report summary."""
import pytest

from bench.guidellm import byte_symbols, summarize


def test_byte_table_is_gpt2s():
    """A bijection of the 256 bytes onto 256 characters, printable ASCII kept, and GPT-2's well-known symbols
    for the bytes it moves: space -> 'Ġ' (U+0120), newline -> 'Ċ' (U+010A), byte 0 -> U+0100."""
    table = byte_symbols()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert all(table[b] == chr(b) for b in range(ord("!"), ord("~") + 1))
    assert (table[ord(" ")], table[ord("\n")], table[0], table[127]) == ("\u0120", "\u010a", "\u0100", "\u0121")


def _stat(mean: float, p50: float) -> dict:
    return {"successful": {"mean": mean, "median": p50, "min": p50, "max": 2 * p50,
                           "percentiles": {"p50": p50, "p95": 1.5 * p50, "p99": 2 * p50}}}


def test_summarize_reads_guidellms_successful_statistics():
    metrics = {name: _stat(10.0 * i, 9.0 * i) for i, name in enumerate(
        ["requests_per_second", "output_tokens_per_second", "prompt_token_count", "output_token_count",
         "time_to_first_token_ms", "inter_token_latency_ms", "time_per_output_token_ms", "request_latency"], 1)}
    metrics["request_totals"] = {"successful": 29, "errored": 1, "incomplete": 0, "total": 30}
    report = {"benchmarks": [{"config": {"strategy": {"type_": "poisson", "rate": 2.0}}, "duration": 18.5,
                              "metrics": metrics}]}
    row = summarize(report)
    assert row["strategy"] == "poisson@2.0" and row["duration_s"] == 18.5
    assert (row["requests_completed"], row["requests_errored"]) == (29, 1)
    assert (row["request_throughput_rps"], row["output_throughput_tps"]) == (10.0, 20.0)
    assert row["ttft_ms"] == {"mean": 50.0, "median": 45.0, "p95": 67.5, "p99": 90.0}
    assert row["itl_ms"]["p99"] == 108.0 and row["tpot_ms"]["median"] == 63.0
    assert row["prompt_tokens"] == {"mean": 30.0, "min": 27.0, "max": 54.0}


@pytest.mark.parametrize("report", [{}, {"benchmarks": []}, {"benchmarks": [{}, {}]}])
def test_summarize_rejects_a_report_without_exactly_one_benchmark(report):
    with pytest.raises(ValueError, match="report"):
        summarize(report)
