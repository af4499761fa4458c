"""The simulator's prediction of a replay: the same requests (arrivals on the replay's clock, lengths, prefix
keys) through :func:`serve.fleet.sim.simulation.simulate` with one replica whose prefix cache is the engine's
own policy (:class:`serve.scale.policies.OursPolicy`: blocks of N = 16, a checkpoint every 64 tokens + the replay
boundary + the prompt's end, unbounded) and whose step times are a fitted
:class:`serve.fleet.sim.service_model.ServiceModel`; the metrics by the replay's own definitions
(:func:`serve.fleet.engine_replay.metrics.replay_metrics`)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from serve.fleet.engine_replay.metrics import RequestTimes
from serve.fleet.engine_replay.workload import ReplayRequest
from serve.fleet.routing.policy_cache import PolicyReplicaCache
from serve.fleet.sim.service_model import ServiceModel
from serve.fleet.sim.simulation import simulate
from serve.fleet.sim.types import FleetConfig, FleetRequest
from serve.scale.policies import OursPolicy

BLOCK_TOKENS, CHECKPOINT_TOKENS = 16, 64          # the replay engine's ServeConfig (serve.http.model.EngineSpec)
UNBOUNDED_BYTES = 1e15


class Prediction(NamedTuple):
    """``times`` per request (in request order) and ``hit_tokens`` per request, as the simulator has them."""

    times: list
    hit_tokens: list


def predict(requests: Sequence[ReplayRequest], svc: ServiceModel) -> Prediction:
    """Simulate ``requests`` on one replica of ``svc`` (its ``max_batch_requests`` = the state slots). Raises
    RuntimeError if a request does not complete in the simulation."""
    def cache() -> PolicyReplicaCache:
        policy = OursPolicy("demo", CHECKPOINT_TOKENS, block_size=BLOCK_TOKENS)
        return PolicyReplicaCache(policy, UNBOUNDED_BYTES, max_running=svc.max_batch_requests)

    reqs = [FleetRequest(r.request_id, r.arrival_ms, len(r.prompt), r.max_new_tokens, r.hash_ids)
            for r in requests]
    cfg = FleetConfig(svc, num_replicas=1, router="round_robin", block_size=BLOCK_TOKENS, cache_factory=cache)
    res = {r.request_id: r for r in simulate(reqs, cfg).results}
    bad = [i for i, r in res.items() if r.status != "completed"]
    if bad:
        raise RuntimeError(f"simulated requests {bad[:5]} did not complete")
    out = [res[r.request_id] for r in requests]
    return Prediction([RequestTimes(r.arrival_ms, r.first_token_ms, r.finish_ms, r.output_length) for r in out],
                      [r.hit_tokens for r in out])
