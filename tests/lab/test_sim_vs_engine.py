"""Page 14's "predicted vs measured on the real engine": the lab reads the recorded bench run and recomputes every
error and the MAPE per metric from the recorded per-rate measured / predicted values (never copies them)."""
import json
import math

import pytest

from lab.fleet_simulation import SIM_METRICS, SIM_VS_ENGINE_JSON, UNINFORMATIVE, sim_vs_engine_record


def _rows(values):
    return [dict(rate_rps=rate, metric=m, measured=meas, predicted=pred, error_pct=999.0)
            for rate, m, meas, pred in values]


def test_mape_is_recomputed_from_the_per_rate_values(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"meta": {"measured": "2026-01-01 00:00 UTC"}, "mape_pct": {"ttft_p50_ms": 0.0},
                                "rows": _rows([(1.0, "ttft_p50_ms", 100.0, 110.0), (2.0, "ttft_p50_ms", 200.0, 150.0),
                                               (1.0, "tpot_mean_ms", 10.0, 10.0), (2.0, "tpot_mean_ms", 20.0, 21.0)])}))
    rec = sim_vs_engine_record(path)
    assert rec["rows"].error_pct.tolist() == pytest.approx([10.0, 25.0, 0.0, 5.0])      # not the recorded 999
    mape = rec["mape"].set_index("metric")
    assert mape.mape_pct["ttft_p50_ms"] == pytest.approx(17.5)                            # not the recorded 0
    assert mape.mape_pct["tpot_mean_ms"] == pytest.approx(2.5)
    assert mape.rates.tolist() == [2, 2] and mape.label["tpot_mean_ms"] == SIM_METRICS["tpot_mean_ms"]


def test_throughput_counts_only_where_saturated(tmp_path):
    """48 requests: a completed rate within 2 / √48 (29 %) of the offered one echoes the arrivals and is not
    judged; at 4 req/s the engine completed 2.0 (saturated): judged there only, and the verdict follows it."""
    path = tmp_path / "run.json"
    thr = "request_throughput_rps"
    rows = _rows([(1.0, thr, 0.95, 0.96), (4.0, thr, 2.0, 3.0), (1.0, "ttft_p50_ms", 100.0, 105.0),
                  (4.0, "ttft_p50_ms", 900.0, 950.0)])
    path.write_text(json.dumps({"meta": {"requests": 48}, "rows": rows}))
    rec = sim_vs_engine_record(path)
    assert rec["rows"].informative.tolist() == [False, True, True, True]
    mape = rec["mape"].set_index("metric")
    assert mape.judged_mape_pct[thr] == pytest.approx(50.0) and mape.informative_rates[thr] == 1
    assert mape.verdict[thr] == "misses the goal" and mape.verdict["ttft_p50_ms"] == "meets the goal"
    rows[1].update(measured=3.9, predicted=3.8)                       # neither fell behind: nothing to judge
    path.write_text(json.dumps({"meta": {"requests": 48}, "rows": rows}))
    mape = sim_vs_engine_record(path)["mape"].set_index("metric")
    assert mape.verdict[thr] == UNINFORMATIVE and math.isnan(mape.judged_mape_pct[thr])
    assert mape.mape_pct[thr] == pytest.approx((1 / 0.95 + 10 / 3.9) / 2)    # the all-rate MAPE is still shown
    path.write_text(json.dumps({"meta": {}, "rows": rows}))
    with pytest.raises(ValueError, match="run.json.*meta.requests"):
        sim_vs_engine_record(path)


def test_the_recorded_run_is_consistent_with_its_rows():
    rec = sim_vs_engine_record()
    raw = json.loads(SIM_VS_ENGINE_JSON.read_text())
    assert set(rec["mape"].metric) == set(SIM_METRICS) and rec["meta"]["measured"]
    for m, v in raw["mape_pct"].items():          # the bench's own summary agrees with the recomputation
        assert math.isclose(rec["mape"].set_index("metric").mape_pct[m], v, rel_tol=1e-9)
    assert {"fitted", "held out"} <= set(rec["steps"].role)      # calibrated on some steps, validated on others


@pytest.mark.parametrize("content", [None, "{}", '{"rows": [{"rate_rps": 1, "metric": "nope", "measured": 1, '
                                     '"predicted": 1}]}', '{"rows": [{"rate_rps": 1, "metric": "tpot_mean_ms", '
                                     '"measured": 0, "predicted": 1}]}'])
def test_bad_record_names_the_path(tmp_path, content):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match="bad.json"):
        sim_vs_engine_record(path)


def _step(t0, ms, decode=0, prefill=(), ctx=0):
    return dict(loop_t=t0 - 1e-4, t0=t0, t1=t0 + ms / 1e3, emit_t=t0 + ms / 1e3, cpu_s=ms / 1e3, others_cpu_s=0.0,
                decode_rows=decode,
                pad_rows=0, decode_context=ctx, prefill=[list(p) for p in prefill], running=1, waiting=0, queued=0)


def test_step_table_and_server_terms_recover_known_costs():
    """Steps whose CPU time is exactly 1.5 x the service model's and wall time twice that, and whose engine-thread work after each is
    2 + 0.5 ms x output rows: the fit gives back CPU slowdown 1.5, wall / CPU 2, 2 ms fixed and 0.5 ms per row; the gap after a
    step that left no request (the loop idled until the next arrival) is not counted as work."""
    from bench.engine_timeline import fit_server_terms, predicted_step_ms, step_table
    from serve.fleet.sim.service_model import ServiceModel

    svc = ServiceModel(prefill_tokens_per_s=1000, decode_step_base_ms=5, decode_step_per_seq_ms=1.0,
                       prefill_overhead_ms=10, mixed_steps=True, prefill_per_token_pair_ms=0.001)
    shapes = [dict(decode=4), dict(prefill=[(100, 16)]), dict(decode=2, prefill=[(30, 0), (8, 0)]), dict(decode=9)]
    steps, t = [], 0.0
    for i, shape in enumerate(shapes * 3):
        s = _step(t, 0.0, **shape)
        ms = 1.5 * predicted_step_ms(svc, s)                     # CPU time; the wall is twice that
        rows = s["decode_rows"] + len(s["prefill"])
        s.update(t1=t + 2 * ms / 1e3, emit_t=t + 2 * ms / 1e3, cpu_s=ms / 1e3)
        steps.append(s)
        if i == 5:                                                   # no request left: idle until the next
            s["running"], gap = 0, 0.5
        else:
            gap = (2 + 0.5 * rows) / 1e3
        t = s["t1"] + gap
    assert predicted_step_ms(svc, steps[1]) == pytest.approx(10 + 100 + 0.001 * (100 * 16 + 100 * 101 / 2))
    table = step_table(svc, steps)
    assert [r["kind"] for r in table[:4]] == ["decode", "prefill", "mixed", "decode"]
    assert table[5]["after_ms"] is None and table[-1]["after_ms"] is None
    fit = fit_server_terms(table)
    assert fit["cpu_slowdown"] == pytest.approx(1.5) and fit["wall_per_cpu"] == pytest.approx(2.0)
    assert fit["per_output_row_ms"] == pytest.approx(0.5, abs=0.02)
    assert fit["after_fixed_ms"] == pytest.approx(2.0, abs=0.05)
    with pytest.raises(ValueError, match="busy steps"):
        fit_server_terms(table[:1])


def test_request_parts_sum_to_the_clients_ttft_and_match_by_send_order():
    """Client records and server records of two requests with the same prompt length sent 1 ms apart: each client
    request is paired with the first server arrival after its send, and ingress + feed wait + engine + egress is
    exactly its TTFT."""
    from bench.engine_timeline import match_requests, request_parts

    client = [dict(ok=True, send_t=1.001, input_tokens=8, chunk_t=[1.2, 1.3]),
              dict(ok=True, send_t=1.000, input_tokens=8, chunk_t=[1.1, 1.25]),
              dict(ok=False, status=429)]
    server = [dict(arrival_t=1.002, feed_t=1.01, first_t=1.15, last_t=1.28, prompt_tokens=8, hit_tokens=0),
              dict(arrival_t=1.0015, feed_t=1.005, first_t=1.09, last_t=1.24, prompt_tokens=8, hit_tokens=16)]
    pairs = match_requests(client, server)
    assert [(c["send_t"], r["arrival_t"]) for c, r in pairs] == [(1.000, 1.0015), (1.001, 1.002)]
    parts = request_parts(pairs)
    for i in range(2):
        total = parts["ingress"][i] + parts["feed_wait"][i] + parts["engine"][i] + parts["egress"][i]
        assert total == pytest.approx(parts["ttft"][i])
    assert parts["ttft"] == pytest.approx([100.0, 199.0]) and parts["hit_tokens"] == [16.0, 0.0]
    with pytest.raises(ValueError, match="no server record"):
        match_requests(client, server[:1])


def test_error_sources_are_recomputed_per_variant(tmp_path):
    """Each variant's error is recomputed against the measured row of its rate and metric (the recorded
    error_pct is not trusted), averaged over rates into the variant's MAPE; TTFT parts and step checks come out
    one row per rate."""
    summ = lambda p50: {"p50": p50, "mean": p50, "p99": 2 * p50, "n": 3}          # noqa: E731
    fit = lambda ttft, tpot: {                                                        # noqa: E731
        "variants": {"A": {"ttft_p50_ms": ttft, "tpot_mean_ms": tpot, "error_pct": {"ttft_p50_ms": 999}},
                     "B": {"ttft_p50_ms": 100.0, "tpot_mean_ms": 10.0}},
        "replay_request_parts_ms": {"ingress": summ(1.0), "feed_wait": summ(2.0), "engine": summ(90.0),
                                    "egress": summ(7.0)},
        "replay_step_check": {"decode": {"steps": 5, "measured_cpu_ms": summ(10.0), "predicted_cpu_ms": summ(11.0),
                                         "cpu_abs_error_pct": summ(10.0), "measured_wall_ms": summ(20.0),
                                         "wall_per_cpu": 2.0}},
        "server_terms": {"cpu_slowdown": 1.0, "wall_per_cpu": 2.0}, "load_average_1min": [1.0, 1.5]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({
        "meta": {"fitted_service_model_per_rate": {"1.0": fit(110.0, 12.0), "2.0": fit(300.0, 20.0)}},
        "rows": _rows([(1.0, "ttft_p50_ms", 100.0, 110.0), (2.0, "ttft_p50_ms", 200.0, 300.0),
                       (1.0, "tpot_mean_ms", 10.0, 12.0), (2.0, "tpot_mean_ms", 20.0, 20.0)])}))
    rec = sim_vs_engine_record(path)
    vm = rec["variant_mape"].set_index("variant")
    assert vm.loc["A", SIM_METRICS["ttft_p50_ms"]] == pytest.approx((10 + 50) / 2)
    assert vm.loc["A", SIM_METRICS["tpot_mean_ms"]] == pytest.approx((20 + 0) / 2)
    assert vm.loc["B", SIM_METRICS["ttft_p50_ms"]] == pytest.approx((0 + 50) / 2)
    assert list(vm.columns) == [SIM_METRICS["ttft_p50_ms"], SIM_METRICS["tpot_mean_ms"]]
    assert len(rec["parts"]) == 8 and rec["parts"].p50_ms.sum() == pytest.approx(2 * 100.0)
    assert rec["step_check"].wall_per_cpu.tolist() == [2.0, 2.0] and rec["server"].load_after.tolist() == [1.5, 1.5]
