"""Service-time model of one replica from the roofline of a real model on real GPUs.

The same step structure as :class:`serve.fleet.sim.service_model.ServiceModel` (continuous batching,
prefill-prioritised), with step times from :mod:`serve.scale.roofline` instead of a calibration:

- **prefill step** over the admitted requests: the sum over them of the fitted roofline prefill of each
  request's uncached tokens after its cached ones (:func:`serve.scale.validation.fitted_prefill_s`:
  attention over the whole context, the rest over the new tokens, scaled by the fit on the Kimi Linear
  report's Fig. 7a), plus one checkpoint restore (:func:`serve.scale.roofline.checkpoint_restore_time`)
  per request that hits. Summing per request charges each request's weights pass separately: an upper
  bound for a batch of short prompts, exact for one long prompt (compute-bound).
- **decode step** with b running requests: the pure roofline TPOT
  (:func:`serve.scale.roofline.decode_time`) at the batch's mean context (prompt + tokens generated so
  far), taken when the step run starts: a replica skips ahead over decode steps at a fixed batch
  (:mod:`serve.fleet.sim.replica`), so the context growth during one run of steps (at most until the next
  completion or arrival) is not charged.

Admission: at most ``max_batch_requests`` running; ``kv_capacity_tokens`` of room for the running
requests' KV (the prefix cache's budget is separate, :class:`serve.fleet.routing.policy_cache.PolicyReplicaCache`);
``max_prefill_tokens_per_step`` uncached tokens per prefill step (at least one request).
"""

from __future__ import annotations

from collections.abc import Sequence

from kda_core.config import preset_title
from serve.errors import check_int
from serve.scale.hardware import hardware
from serve.scale.model_shape import preset
from serve.scale.roofline import checkpoint_restore_time, decode_time
from serve.scale.validation import fit_prefill, fitted_prefill_s


class RooflineService:
    """Step times of ``model`` (a :mod:`serve.scale.model_shape` preset) on ``tp`` x ``gpu``
    (:mod:`serve.scale.hardware`). Times in ms. Raises ValueError for an unknown model or GPU, or a
    non-positive tp / limit."""

    def __init__(self, model: str, gpu: str, tp: int, max_batch_requests: int = 256,
                 kv_capacity_tokens: int | None = None, max_prefill_tokens_per_step: int | None = 16384):
        check_int("tp", tp)
        check_int("max_batch_requests", max_batch_requests)
        for name, val in (("kv_capacity_tokens", kv_capacity_tokens),
                          ("max_prefill_tokens_per_step", max_prefill_tokens_per_step)):
            if val is not None:
                check_int(name, val)
        self.model, self.gpu, self.tp = model, gpu, tp
        self.shape, self.hw = preset(model), hardware(gpu)
        # the factors fitted once on the report's points at its assumed setup (validation.FIT_SETUP) and carried
        # to this hardware: fitting them on the chosen GPU would force every GPU to the report's seconds
        self.fit = fit_prefill()
        self.restore_ms = 1e3 * checkpoint_restore_time(self.shape, self.hw, tp)
        self.max_batch_requests = max_batch_requests
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_prefill_tokens_per_step = max_prefill_tokens_per_step
        self._prefill: dict[tuple[int, int], float] = {}    # memo: (new, cached) -> ms (a pure function)
        self._decode: dict[tuple[int, int], float] = {}     # memo: (batch, context) -> ms
        self.source = (f"{preset_title(model)} on {tp} × {gpu}: roofline step times (prefill fitted on the Kimi Linear "
                       f"report's Fig. 7a, alpha {self.fit.alpha:.2f}, beta {self.fit.beta:.2f})")

    def request_prefill_ms(self, new_tokens: int, cached_tokens: int) -> float:
        """One request's prefill: ``new_tokens`` (>= 1) after ``cached_tokens``, + a restore if it hits."""
        key = (new_tokens, cached_tokens)
        t = self._prefill.get(key)
        if t is None:
            t = 1e3 * fitted_prefill_s(self.shape, self.hw, self.tp, self.fit, new_tokens, cached_tokens)
            t = self._prefill[key] = t + (self.restore_ms if cached_tokens else 0.0)
        return t

    def prefill_batch_ms(self, parts: Sequence[tuple[int, int]]) -> float:
        """A prefill step over ``(new_tokens, cached_tokens)`` per admitted request."""
        return sum(self.request_prefill_ms(n, c) for n, c in parts)

    def prefill_ms(self, uncached_tokens: int) -> float:
        """A prefill step of one request with nothing cached."""
        return self.request_prefill_ms(uncached_tokens, 0)

    def decode_step_ms(self, batch: int, context_tokens: int = 0) -> float:
        """One decode step of ``batch`` sequences at ``context_tokens`` of context each."""
        key = (batch, int(context_tokens))
        t = self._decode.get(key)
        if t is None:
            t = self._decode[key] = 1e3 * decode_time(self.shape, self.hw, self.tp, batch, key[1]).total_s
        return t
