"""Fuzz-style property tests of the trace loaders: hypothesis writes malformed and extreme records; every
loader either returns requests within the limits (and the pages' downstream calls run on them) or
raises TraceFormatError — never another exception — and its peak allocation stays bounded."""

from __future__ import annotations

import json
import math
import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab.fleet import routing_load, simulate_policies
from serve.fleet.sim.simulation import simulate
from serve.fleet.sim.types import FleetConfig
from serve.fleet.sim.vtc import on_off_less_service, requests_from_vtc
from serve.prefix.sim import replay_row
from serve.traces.azure import read_azure_csv
from serve.traces.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_INPUT_TOKENS,
    MAX_OUTPUT_TOKENS,
    MAX_TIMESTAMP_MS,
    TraceFormatError,
)
from serve.traces.mooncake import named_bytes, read_mooncake
from serve.traces.vtc_artifact import load_vtc_artifact

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])
PEAK_BYTES = 16 * 1024 * 1024  # every example's input is < 100 KB; a loader may hold a few copies of it

EXTREME_INTS = st.sampled_from([0, 1, -1, 511, 512, 513, MAX_INPUT_TOKENS, MAX_INPUT_TOKENS + 1,
                                MAX_OUTPUT_TOKENS + 1, MAX_TIMESTAMP_MS + 1, INT64_MAX, INT64_MAX + 1,
                                INT64_MIN - 1, 10**11, 10**12, 10**30, -(10**30), 10**400])
ANY_VALUE = st.one_of(EXTREME_INTS, st.integers(), st.floats(), st.booleans(), st.none(),
                      st.text(max_size=6), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=2),
                                                                                               st.integers(), max_size=2))
NASTY_TEXT = st.sampled_from(["", " ", "[" * 3000, "{", '{"a":', "\u2028", "\x85", "\x0c", "\ufeff", "\x00",
                              "9" * 5000, "NaN", "\"", "\r", ",,,", "é", "\ud7ff"])
SEPARATORS = st.sampled_from(["\n", "\r\n", "\r"])


def _run_bounded(fn, *args, **kwargs):
    """Call ``fn``; return its result, or None if it raised TraceFormatError; assert the peak allocation."""
    tracemalloc.start()
    try:
        return fn(*args, **kwargs)
    except TraceFormatError:
        return None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < PEAK_BYTES, f"{peak:,} bytes allocated"


@st.composite
def mooncake_line(draw) -> str:
    if draw(st.integers(0, 5)) == 0:
        return draw(NASTY_TEXT) + draw(st.text(max_size=8))
    obj = {}
    length = draw(st.one_of(EXTREME_INTS, st.integers(0, 5000), ANY_VALUE))
    for field, good in (("timestamp", st.integers(0, 10_000)), ("input_length", st.just(length)),
                        ("output_length", st.integers(0, 3000))):
        choice = draw(st.integers(0, 6))
        if choice:  # 0: the field is missing
            obj[field] = draw(good) if choice > 2 else draw(ANY_VALUE)
    if draw(st.integers(0, 6)):
        if isinstance(length, int) and not isinstance(length, bool) and 0 <= length <= MAX_INPUT_TOKENS + 512 \
                and draw(st.booleans()):
            ids = list(range(math.ceil(length / 512)))
            if ids and draw(st.booleans()):
                ids[draw(st.integers(0, len(ids) - 1))] = draw(EXTREME_INTS)
            obj["hash_ids"] = ids
        else:
            obj["hash_ids"] = draw(st.one_of(ANY_VALUE, st.lists(ANY_VALUE, max_size=4)))
    if draw(st.booleans()):
        obj["note"] = draw(NASTY_TEXT)
    return json.dumps(obj, ensure_ascii=draw(st.booleans()))


@FUZZ
@given(lines=st.lists(mooncake_line(), min_size=0, max_size=6), sep=SEPARATORS, bom=st.booleans(),
       cap=st.integers(1, 8), budget=st.integers(1, 4096))
def test_read_mooncake_fuzz(lines, sep, bom, cap, budget):
    data = ("\ufeff" if bom else "") + sep.join(lines)
    loaded = _run_bounded(read_mooncake, named_bytes(data.encode("utf-8", "surrogatepass"), "f.jsonl"),
                          max_requests=cap, max_total_blocks=budget)
    if loaded is None:
        return
    trace = loaded.requests
    assert 1 <= len(trace) <= cap and sum(len(r.hash_ids) for r in trace) <= budget
    for r in trace:
        assert 0 <= r.timestamp_ms <= MAX_TIMESTAMP_MS and 0 <= r.input_length <= MAX_INPUT_TOKENS
        assert 0 <= r.output_length <= MAX_OUTPUT_TOKENS and len(r.hash_ids) == math.ceil(r.input_length / 512)
        assert all(INT64_MIN <= h <= INT64_MAX for h in r.hash_ids)
    # what the pages do with an accepted upload (09: prefix replay; 11: routing; 14: fleet simulation)
    row = replay_row(trace, "kimi-linear-48b-a3b", 1024, 2, None)
    replay_row(trace, "kimi-linear-48b-a3b", 512, 1, 0.5 * (row["peak_kv_gb"] + row["peak_state_gb"]) * 1e9)
    routing_load(trace, "ring", 3, 2, vnodes=10)
    cfg = FleetConfig(service=on_off_less_service(), num_replicas=2, routing_k=2, cache_capacity_blocks=100)
    simulate_policies(trace, ["cache_aware"], cfg)


@st.composite
def azure_row(draw) -> str:
    if draw(st.integers(0, 5)) == 0:
        return draw(NASTY_TEXT)
    stamp = draw(st.one_of(st.sampled_from(["2023-11-16 18:17:03.9799600", "2023-11-16 18:17:04",
                                            "2024-01-01 00:00:00.1", "2023-11-16 18:17:03.x", "yesterday",
                                            "2023-02-30 00:00:00", "1999-01-01 00:00:00"]), st.text(max_size=6)))
    counts = [draw(st.one_of(EXTREME_INTS.map(str), st.integers(0, 9000).map(str), NASTY_TEXT, st.text(max_size=4)))
              for _ in range(2)]
    cells = [stamp, *counts][: draw(st.integers(1, 4))]
    return ",".join(cells) + ("," + draw(st.text(max_size=3)) if draw(st.integers(0, 8)) == 0 else "")


@FUZZ
@given(rows=st.lists(azure_row(), max_size=6), header=st.sampled_from(
    ["TIMESTAMP,ContextTokens,GeneratedTokens", "\ufeffTIMESTAMP,ContextTokens,GeneratedTokens",
     "GeneratedTokens,TIMESTAMP,ContextTokens", "TIMESTAMP,ContextTokens", "", "a,b,c"]),
       sep=SEPARATORS, cap=st.integers(1, 8), budget=st.integers(1, 4096))
def test_read_azure_csv_fuzz(rows, header, sep, cap, budget):
    from lab.budgets import Stream, budget_traffic

    data = sep.join([header, *rows])
    loaded = _run_bounded(read_azure_csv, named_bytes(data.encode("utf-8", "surrogatepass"), "f.csv"),
                          max_requests=cap, max_total_blocks=budget)
    if loaded is None:
        return
    trace = loaded.requests
    assert 1 <= len(trace) <= cap and sum(len(r.hash_ids) for r in trace) <= budget
    assert all(0 <= r.timestamp_ms <= MAX_TIMESTAMP_MS and 0 <= r.input_length <= MAX_INPUT_TOKENS
               and 0 <= r.output_length <= MAX_OUTPUT_TOKENS for r in trace)
    traffic = budget_traffic([Stream("vip", 0.5, 256, 64)], 10.0, "standard", 5, 2.0, 3.0, 1024, 128, azure=trace)
    assert traffic.burst_requests == min(5, len(trace))
    simulate(traffic.requests, FleetConfig(service=on_off_less_service(), num_replicas=1, cache_capacity_blocks=0))


@st.composite
def vtc_record(draw):
    if draw(st.integers(0, 6)) == 0:
        return draw(ANY_VALUE)
    good = {"adapter_dir": st.text(max_size=3), "prompt_len": st.integers(0, 3000), "output_len": st.integers(0, 600),
            "req_time": st.floats(0, 600), "first_token_latency": st.sampled_from([-1, 0.5]),
            "request_latency": st.floats(0, 100)}
    rec = {}
    for field, strategy in good.items():
        choice = draw(st.integers(0, 6))
        if choice:
            rec[field] = draw(strategy) if choice > 2 else draw(ANY_VALUE)
    return rec


@FUZZ
@given(records=st.lists(vtc_record(), max_size=6), shape=st.integers(0, 5), extra=NASTY_TEXT)
def test_load_vtc_artifact_fuzz(records, shape, extra):
    obj = [{"config": {}, "result": {"responses": records, "throughput": 1.0}},
           {"result": {"responses": records}}, {"config": extra, "result": {"responses": records}},
           {"result": {"responses": {"0": records}}}, {"result": records}, records][shape]
    text = json.dumps(obj) + (extra if shape == 5 else "")
    run = _run_bounded(load_vtc_artifact, named_bytes(text.encode("utf-8", "surrogatepass"), "v.json"))
    if run is None:
        return
    for r in run.records:
        assert isinstance(r.client, str) and 0 <= r.prompt_len <= MAX_INPUT_TOKENS
        assert all(math.isfinite(v) for v in (r.req_time_s, r.ttft_s, r.latency_s))
    if run.records:
        requests = requests_from_vtc(run)
        simulate(requests, FleetConfig(service=on_off_less_service(), num_replicas=1, scheduler="vtc",
                                       cache_capacity_blocks=0))
