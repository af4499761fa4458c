"""The real-scale replica type: one validated value builds the policy cache and the roofline service."""
from __future__ import annotations

import dataclasses

import pytest

from serve.fleet.real_replica import TP_SIZES, RealReplica, fitting_tps, free_bytes
from serve.scale.hardware import hardware
from serve.scale.policies import ReplicaBytes


def test_the_replica_builds_its_cache_and_service():
    """The cache gets ``budget_fraction`` of the HBM the weights leave; the running requests' KV room is the rest,
    in tokens of the model's KV bytes on ``tp`` ranks; each call builds a fresh, empty cache."""
    r = RealReplica("kimi-linear-48b-a3b", "H200", 8, "vllm align", 1 / 16)
    free = free_bytes("kimi-linear-48b-a3b", hardware("H200"), 8)
    assert r.free_bytes == free > 0 and r.budget_bytes == pytest.approx(free / 16)
    first, second = r.cache(), r.cache()
    assert first is not second and first.budget_bytes == pytest.approx(free / 16) and first.policy.name == "vllm align"
    kv = ReplicaBytes.for_preset("kimi-linear-48b-a3b", 8).kv_bytes_per_token
    service = r.service()
    assert service.kv_capacity_tokens == int((free - free / 16) // kv) and (service.model, service.gpu, service.tp) == (
        "kimi-linear-48b-a3b", "H200", 8)
    assert RealReplica() == RealReplica() and dataclasses.replace(r, tp=4).tp == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.tp = 4  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, match", [
    ({"model": "gpt"}, "model"), ({"gpu": "T4"}, "gpu"), ({"tp": 3}, "tp"), ({"tp": True}, "tp"),
    ({"cache_policy": "lru"}, "cache_policy"), ({"budget_fraction": 0.0}, "budget_fraction"),
    ({"budget_fraction": 1.5}, "budget_fraction"), ({"budget_fraction": True}, "budget_fraction"),
    ({"model": "kimi-k3"}, "kimi-k3 weights do not fit in 8 x H200"),
    ({"budget_fraction": 1e-9}, r"budget_fraction 1e-09 .* too small for ours: budget_bytes")])
def test_a_bad_replica_is_refused_when_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RealReplica(**kwargs)
    with pytest.raises(ValueError, match=match):      # replace() validates too
        dataclasses.replace(RealReplica(), **kwargs)


def test_fitting_tps():
    assert fitting_tps("kimi-linear-48b-a3b", "H200") == TP_SIZES
    assert fitting_tps("kimi-k3", "H200") == (16,) and fitting_tps("kimi-k3", "A100") == ()
    with pytest.raises(ValueError, match="gpu"):
        fitting_tps("kimi-k3", "T4")
