"""One real-scale replica: a real Kimi model on ``tp`` GPUs of one kind, with a production prefix-cache policy
under a share of the HBM its weights leave. The one type the fleet pages (11–15), the policy replays and the
fleet simulation pass around; it builds the two things a simulated replica needs: its prefix cache at real
bytes (:meth:`RealReplica.cache`, a :class:`serve.fleet.routing.policy_cache.PolicyReplicaCache`) and its step
times (:meth:`RealReplica.service`, a :class:`serve.fleet.sim.roofline_service.RooflineService`).

Memory of one replica (bytes): ``tp`` x the GPU's HBM = weights (:func:`serve.scale.capacity.weight_bytes`)
+ free; the prefix cache gets ``budget_fraction`` x free (cached KV, cached states and one running request's
state slots), the running requests' KV the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from kda_core.config import REAL_PRESETS
from serve.errors import check_choice
from serve.fleet.routing.policy_cache import PolicyReplicaCache
from serve.fleet.sim.roofline_service import RooflineService
from serve.scale.capacity import weight_bytes
from serve.scale.hardware import GPUS, Hardware, hardware
from serve.scale.model_shape import preset
from serve.scale.policies import CACHE_POLICIES, ReplicaBytes, make_policy

TP_SIZES = (1, 2, 4, 8, 16)   # GPUs per replica the pages offer (powers of two up to two 8-GPU nodes)


def free_bytes(model: str, hw: Hardware, tp: int) -> float:
    """HBM of ``tp`` x ``hw`` minus ``model``'s weights (bytes per replica; <= 0 when the weights do not fit)."""
    return hw.hbm_bytes * tp - weight_bytes(preset(model))


def fitting_tps(model: str, gpu: str) -> tuple[int, ...]:
    """The TP sizes of :data:`TP_SIZES` at which ``model``'s weights fit in ``tp`` x ``gpu`` with HBM to spare
    (empty when none does). Raises ValueError for an unknown model or GPU."""
    check_choice("model", model, REAL_PRESETS)
    check_choice("gpu", gpu, tuple(GPUS))
    return tuple(tp for tp in TP_SIZES if free_bytes(model, hardware(gpu), tp) > 0)


@dataclass(frozen=True)
class RealReplica:
    """``model`` (:data:`kda_core.config.REAL_PRESETS`) on ``tp`` (:data:`TP_SIZES`) x ``gpu``
    (:data:`serve.scale.hardware.GPUS`), its prefix cache ``cache_policy``
    (:data:`serve.scale.policies.CACHE_POLICIES`) under ``budget_fraction`` in (0, 1] of the HBM the weights leave.

    Raises ValueError naming the field for an unknown model, GPU, TP or policy, a fraction outside (0, 1], weights
    that do not fit, or a budget below one running request's state slots."""

    model: str = "kimi-linear-48b-a3b"
    gpu: str = "H200"
    tp: int = 8                    # the smallest 8-GPU node Kimi-Linear's report serves on
    cache_policy: str = "ours"
    budget_fraction: float = 1 / 8  # of the free HBM: the middle of the pages' 1/32 .. 1 sweep

    def __post_init__(self):
        check_choice("model", self.model, REAL_PRESETS)
        check_choice("gpu", self.gpu, tuple(GPUS))
        check_choice("tp", self.tp, TP_SIZES)
        check_choice("cache_policy", self.cache_policy, CACHE_POLICIES)
        if isinstance(self.budget_fraction, bool) or not 0 < self.budget_fraction <= 1:
            raise ValueError(f"budget_fraction must be in (0, 1] (share of the HBM left after weights), "
                             f"got {self.budget_fraction!r}")
        if self.free_bytes <= 0:
            raise ValueError(f"{self.model} weights do not fit in {self.tp} x {self.gpu}: choose more GPUs (tp) "
                             "or larger ones")
        try:
            self.cache()                                  # checks the budget against the running state slots
        except ValueError as exc:
            raise ValueError(f"budget_fraction {self.budget_fraction:g} of the {self.free_bytes / 1e9:,.0f} GB left "
                             f"after weights is too small for {self.cache_policy}: {exc}") from exc

    @property
    def free_bytes(self) -> float:
        """HBM of the replica left after the weights (bytes)."""
        return free_bytes(self.model, hardware(self.gpu), self.tp)

    @property
    def budget_bytes(self) -> float:
        """The prefix cache's budget (bytes)."""
        return self.free_bytes * self.budget_fraction

    def cache(self) -> PolicyReplicaCache:
        """A fresh, empty prefix cache of this replica (a ``cache_factory`` of the simulation and the replays)."""
        return PolicyReplicaCache(make_policy(self.cache_policy, self.model, self.tp), self.budget_bytes)

    def service(self) -> RooflineService:
        """Roofline step times of this replica, with the HBM outside the cache budget as the running requests'
        KV room (tokens)."""
        room = (self.free_bytes - self.budget_bytes) // ReplicaBytes.for_preset(self.model, self.tp).kv_bytes_per_token
        return RooflineService(self.model, self.gpu, self.tp, kv_capacity_tokens=max(1, int(room)))

