"""The fleet simulator's policies, pinned by when and where each request starts, worked out by hand (the
step-by-step reference re-implements admission, but its comparison never meets an oversized request, and both
share the router's view of the loads):

- a replica reserves ``input + output`` KV tokens per running request and admits FCFS, stopping at the first
  request that does not fit (no overtaking); a request larger than the whole KV capacity still runs, alone;
- one prefill step admits at most ``max_prefill_tokens_per_step`` uncached tokens, but always at least one
  request; at most ``max_batch_requests`` run at once;
- the simulation keeps the router's in-flight loads (``on_start`` at dispatch, ``on_finish`` at the end), so a
  load-aware router (least_loaded) sees them.
"""
from __future__ import annotations

from serve.fleet.sim.service_model import ServiceModel
from serve.fleet.sim.simulation import simulate
from serve.fleet.sim.types import FleetConfig, FleetRequest


def starts(svc: ServiceModel, reqs, **cfg) -> list[float]:
    sim = simulate(reqs, FleetConfig(service=svc, num_replicas=cfg.pop("num_replicas", 1), **cfg))
    assert all(r.status == "completed" for r in sim.results)
    return [r.start_ms for r in sim.results]


def req(i: int, t: float, inp: int, out: int) -> FleetRequest:
    return FleetRequest(i, t, inp, out, (1000 + i,))                      # distinct blocks: no cache hits


def test_kv_reservation_fcfs_without_overtaking_and_an_oversized_request_runs_alone():
    """KV capacity 1000 tokens, 1000 prompt tokens/s, 10 ms decode steps. 0 (411 tokens) starts at 0 and ends at
    400 + 10 x 10 = 500 ms; 1 (600) does not fit beside it; 2 (102) would, but must not overtake 1: both start at
    500 (prefill of 600 tokens: first tokens at 1100); 3 (1502 > the capacity) waits until the replica is empty:
    1 ends at 1100 + 99 x 10 = 2090 ms, then 3 runs alone."""
    svc = ServiceModel(prefill_tokens_per_s=1000, decode_step_base_ms=10, kv_capacity_tokens=1000)
    reqs = [req(0, 0, 400, 11), req(1, 0, 500, 100), req(2, 0, 100, 2), req(3, 0, 1500, 2)]
    assert starts(svc, reqs) == [0, 500, 500, 2090]


def test_prefill_token_cap_admits_at_least_one_request_and_batch_cap():
    """At most 500 new tokens per prefill step, at most 2 running. 0 (700 tokens, over the cap) still runs, alone:
    first token at 700; 1 joins then (200 tokens, 2 running: 2 must wait), first token at 900; one decode step
    ends both at 910, when 2 starts."""
    svc = ServiceModel(prefill_tokens_per_s=1000, decode_step_base_ms=10, max_prefill_tokens_per_step=500,
                       max_batch_requests=2)
    reqs = [req(0, 0, 700, 2), req(1, 0, 200, 2), req(2, 0, 200, 2)]
    assert starts(svc, reqs) == [0, 700, 910]


def test_least_loaded_routing_sees_in_flight_requests():
    """Two replicas. 0 (long) goes to replica-0; 1 arrives while 0 runs: replica-1; 2 arrives after 1 ended
    (at 1 + 100 + 10 = 111 ms) while 0 still runs: replica-1 again; 3 arrives with one request on each: the tie goes to replica-0."""
    svc = ServiceModel(prefill_tokens_per_s=1000, decode_step_base_ms=10)
    reqs = [req(0, 0, 100, 100), req(1, 1, 100, 2), req(2, 500, 100, 50), req(3, 501, 100, 2)]
    sim = simulate(reqs, FleetConfig(service=svc, num_replicas=2, router="least_loaded"))
    assert [r.replica for r in sim.results] == ["replica-0", "replica-1", "replica-1", "replica-0"]
    assert sim.results[1].finish_ms == 111
