"""The strict replay's machinery on the tiny model: its clock (advances by each boundary's thread CPU time, idle
gaps jump to the next arrival), its arrivals (submitted at the first boundary at or after them), its metrics'
definitions (by value on a hand-built schedule), and the simulator's prediction on the same clock."""
import math
import time

import pytest

from serve.fleet.engine_replay.clock import CpuClock
from serve.fleet.engine_replay.driver import StepRecord, replay
from serve.fleet.engine_replay.fit import fit_terms, predicted_step_ms, service_model, wall_per_cpu
from serve.fleet.engine_replay.metrics import RequestTimes, replay_metrics
from serve.fleet.engine_replay.predict import predict
from serve.fleet.engine_replay.workload import ReplayRequest, mooncake_requests
from serve.fleet.sim.service_model import ServiceModel
from tests.serve.prefix.helpers import tiny_model, tokens

LATE_MS = 1e6            # an arrival far past the others' work: an idle gap the clock must jump


def test_cpu_clock_advances_by_thread_cpu_time_only():
    clock = CpuClock()
    cpu, wall = clock.run(lambda: time.sleep(0.05))        # off the CPU: the clock hardly moves
    assert wall >= 50 and cpu < 5 and clock.now_ms() == cpu
    c0 = time.thread_time()
    cpu, _ = clock.run(lambda: sum(i * i for i in range(200_000)))
    assert cpu > 1 and clock.now_ms() == pytest.approx(clock.now_ms() - cpu + (time.thread_time() - c0) * 1e3,
                                                       abs=1.0)
    before = clock.now_ms()
    clock.wait_until(before - 10)                          # never back
    assert clock.now_ms() == before
    clock.wait_until(before + 1e5)                         # idle: jump, no waiting
    assert clock.now_ms() == before + 1e5


def _requests() -> list[ReplayRequest]:
    """Two at 0, one while they run, one after an idle gap; the last shares the first's 32-token prefix."""
    p = [tokens(s, 40) for s in range(3)]
    return [ReplayRequest(0, 0.0, tuple(p[0]), 3, (1, 2, 3)), ReplayRequest(1, 0.0, tuple(p[1]), 1, (4, 5, 6)),
            ReplayRequest(2, 0.5, tuple(p[2]), 4, (7, 8, 9)),
            ReplayRequest(3, LATE_MS, tuple(p[0][:32] + tokens(9, 8)), 2, (1, 2, 10))]


@pytest.fixture(scope="module")
def strict_run():
    return replay(_requests(), num_state_slots=2, clock="cpu", model=tiny_model())


def test_strict_clock_advances_by_step_cpu_time(strict_run):
    steps = strict_run.steps
    assert all(s.cpu_ms > 0 and s.clock_ms == pytest.approx(s.cpu_ms, abs=1e-9) for s in steps)
    for a, b in zip(steps, steps[1:]):
        end = a.start_ms + a.clock_ms
        assert b.start_ms == pytest.approx(end, abs=1e-9) or b.start_ms == LATE_MS > end
    late = next(i for i, s in enumerate(steps) if s.start_ms == LATE_MS)   # the idle gap jumped to the late arrival
    assert steps[late - 1].in_flight == 0 and all(s.in_flight > 0 for s in steps[: late - 1])


def test_arrivals_submitted_at_first_boundary_at_or_after_them(strict_run):
    reqs, steps = _requests(), strict_run.steps
    assert sum(s.submitted for s in steps) == len(reqs)
    submitted_at = [s.start_ms for s in steps for _ in range(s.submitted)]
    for r, t in zip(reqs, submitted_at):
        assert t >= r.arrival_ms
        earlier = [s.start_ms for s in steps if s.start_ms < t]
        assert not earlier or max(earlier) < r.arrival_ms  # no earlier boundary at or after the arrival
    # two slots: the third request waits for a slot; the late one hits the first's published prefix
    assert strict_run.hit_tokens[3] > 0 and strict_run.hit_tokens[0] == 0
    assert max(len(s.prefill) + s.decode_rows for s in steps) <= 2


def test_request_times_are_step_ends(strict_run):
    ends = [s.start_ms + s.clock_ms for s in strict_run.steps]
    for t in strict_run.times:
        assert min(abs(t.first_token_ms - e) for e in ends) < 1e-9 and min(abs(t.finish_ms - e) for e in ends) < 1e-9
    assert strict_run.times[1].first_token_ms == strict_run.times[1].finish_ms        # one token


def test_replay_metrics_by_value():
    times = [RequestTimes(0.0, 10.0, 30.0, 3), RequestTimes(5.0, 25.0, 25.0, 1), RequestTimes(20.0, 60.0, 120.0, 4)]
    m = replay_metrics(times)
    assert m["ttft_p50_ms"] == 20.0                                   # TTFTs 10, 20, 40
    assert m["ttft_p99_ms"] == pytest.approx(20 + 0.98 * 20)          # linear interpolation
    assert m["tpot_mean_ms"] == 15.0 and m["tpot_p50_ms"] == 15.0     # (30-10)/2 = 10, (120-60)/3 = 20
    assert m["e2e_mean_ms"] == pytest.approx((30 + 20 + 100) / 3)
    assert m["request_throughput_rps"] == pytest.approx(3 / 120 * 1000)
    with pytest.raises(ValueError, match="out of order"):
        replay_metrics([RequestTimes(10.0, 5.0, 20.0, 2)])


def test_prediction_runs_on_the_same_clock():
    """One request at LATE_MS: prefill 10 ms, then decode steps of 4 ms."""
    svc = ServiceModel(prefill_tokens_per_s=1e12, decode_step_base_ms=4.0, prefill_overhead_ms=10.0,
                       max_batch_requests=2, mixed_steps=True)
    req = ReplayRequest(0, LATE_MS, tuple(range(40)), 3, (1, 2, 3))
    (t,) = predict([req], svc).times
    assert t.arrival_ms == LATE_MS
    assert (t.first_token_ms, t.finish_ms) == pytest.approx((LATE_MS + 10.0, LATE_MS + 18.0), abs=1e-6)


def test_fit_terms_recovers_the_step_model_and_predicts_held_out_steps():
    truth = service_model(dict(prefill_overhead_ms=5.0, decode_step_base_ms=3.0, ms_per_prefill_token=0.1,
                               prefill_per_row_ms=2.0, prefill_per_token_pair_ms=0.0, prefill_off_grid_per_token_ms=0.0,
                               decode_step_per_seq_ms=0.5, decode_per_context_token_ms=0.001,
                               prefill_per_checkpoint_ms=1.5, per_output_row_ms=0.3), 8, "truth")

    def step(prefill, rows, ctx):
        return StepRecord(0.0, predicted_step_ms(truth, prefill, rows, ctx), 0.0, 0.0, prefill, rows, ctx, 0)

    cal = [step(((n, c),) * k, b, b * x) for n, c, k in ((40, 0, 1), (130, 64, 2), (200, 0, 1), (70, 16, 3), (63, 0, 2), (65, 60, 1),
                                                                   (250, 10, 1))
           for b, x in ((0, 0), (2, 100), (4, 300))] + [step((), b, b * x) for b in (1, 3, 8) for x in (50, 400)]
    svc = service_model(fit_terms(cal), 8, "fit")
    for prefill, rows, ctx in ((((300, 0),), 3, 600), ((), 5, 1000), (((17, 48), (90, 0)), 0, 0)):
        assert predicted_step_ms(svc, prefill, rows, ctx) == pytest.approx(predicted_step_ms(truth, prefill, rows, ctx),
                                                                           rel=1e-6)


def test_mooncake_requests_share_the_system_prefix_and_keep_the_rate():
    reqs = mooncake_requests(0, 12, 4.0)
    assert all(r.prompt[:64] == reqs[0].prompt[:64] and r.hash_ids[:4] == reqs[0].hash_ids[:4] for r in reqs)
    assert all(len(r.hash_ids) == math.ceil(len(r.prompt) / 16) for r in reqs)
    assert reqs[-1].arrival_ms == pytest.approx(12 / 4.0 * 1e3)
    with pytest.raises(ValueError, match="rate_rps"):
        mooncake_requests(0, 12, 0.0)


def test_wall_per_cpu_counts_back_to_back_boundaries_only():
    """Two back-to-back boundaries (25 ms and 30 ms of clock for 10 ms of CPU each); the idle wait after the second
    (nothing in flight) is not the engine's: 55 / 20."""
    rec = lambda start, cpu, in_flight: StepRecord(start, cpu, 0.0, 0.0, (), 1, 0, 0, in_flight)   # noqa: E731
    steps = [rec(0.0, 10.0, 1), rec(25.0, 10.0, 1), rec(55.0, 10.0, 0), rec(1000.0, 5.0, 1)]
    assert wall_per_cpu(steps) == pytest.approx(55.0 / 20.0)
    with pytest.raises(ValueError, match="back-to-back"):
        wall_per_cpu(steps[2:3])
