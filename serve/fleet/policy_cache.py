"""A replica's prefix cache backed by a prefix-cache policy model at real bytes.

The fleet simulation's default replica cache (:class:`serve.fleet.block_cache.BlockLRUCache`) counts
blocks; this one holds a policy of :mod:`serve.scale.policies` (ours, SGLang ``MambaRadixCache``, vLLM
``mamba_cache_mode``) under a byte budget per replica, so a hit needs a KDA state where the policy placed
one. Per request, in the replica's order of events:

- while the scheduler considers it: the policy's ``lookup(req)`` (pure; the replica's ``prefix_tokens``);
- when its prefill step starts: :meth:`start` records the hit it gets and the tokens whose KV was
  cached but no state let it reuse them (``lost_to_missing_state``);
- when its prefill step ends: :meth:`finish` tells the policy the request ran (``admit``: it caches what
  the engine caches, refreshing the hit as the cache is now) and evicts to the budget.

The budget covers cached KV + cached states + the state slots of the running requests (``running_state_
slots`` x one state, for each of ``max_running`` requests, reserved first; as
:func:`serve.scale.policies.base.replay` does for one running request). Hit blocks are not pinned
between the start and the end of a prefill step (the policy models have no pins); another request's
insertion in the same step can evict them, which the refresh at ``finish`` then sees.
"""

from __future__ import annotations

from serve.errors import check_int
from serve.scale.policies.base import BYTE_KINDS, check_budget


class PolicyReplicaCache:
    """One replica's cache: a fresh policy instance (``lookup`` / ``admit`` / ``evict_to`` /
    ``bytes_by_kind``, see :class:`serve.scale.policies.base.PrefixPolicy`) under ``budget_bytes``.

    Counters: ``hit_tokens_total``, ``lost_to_missing_state`` (tokens), ``requests``; ``peak_bytes``
    ``{kind: bytes}`` over :data:`serve.scale.policies.base.BYTE_KINDS`, each kind's own peak (reached at
    different times: their sum can pass the budget); ``held_at_peak`` ``{kind: bytes}`` held after the
    prefill step where cached KV + states peaked (the first such step, as
    :class:`serve.scale.policies.base.PolicyResult`'s): its sum never passes ``budget_bytes``. Raises
    ValueError when the budget is not a finite number of bytes >= 0 (a string, NaN, inf) or does not cover
    the running requests' state slots, or ``max_running`` < 1. ``deep_checks``: the end-of-run integrity
    check also walks the policy's whole structure (tests; the budget is always checked)."""

    def __init__(self, policy, budget_bytes: float, max_running: int = 1, deep_checks: bool = False):
        check_int("max_running", max_running)
        budget_bytes = check_budget("budget_bytes", budget_bytes)
        running = policy.running_state_slots * policy.state_bytes * max_running   # the engine's slots
        if not budget_bytes >= running:
            raise ValueError(f"budget_bytes {budget_bytes:,.0f} is below the state slots of {max_running} running "
                             f"request(s) of {policy.name} ({running:,} bytes)")
        self.policy, self.budget_bytes = policy, float(budget_bytes)
        self.cache_bytes = self.budget_bytes - running
        self.peak_bytes = dict.fromkeys(BYTE_KINDS, 0)
        self.peak_bytes["running"] = running
        self.held_at_peak = dict(self.peak_bytes)
        self.hit_tokens_total = self.lost_to_missing_state = self.requests = 0
        self.deep_checks = deep_checks

    def start(self, req) -> int:
        """``req``'s prefill starts: returns its hit and records it."""
        hit, kv_ok = self.policy.lookup(req)
        self.hit_tokens_total += hit
        self.lost_to_missing_state += kv_ok - hit
        self.requests += 1
        return hit

    def finish(self, req, hit: int) -> None:
        """``req``'s prefill ended with ``hit`` tokens: the policy caches what the engine caches, then
        evicts to the budget."""
        self.policy.admit(req, hit)
        self.policy.evict_to(self.cache_bytes)
        b = self.policy.bytes_by_kind()
        self.peak_bytes["kv"] = max(self.peak_bytes["kv"], b["kv"])
        self.peak_bytes["state"] = max(self.peak_bytes["state"], b["state"])
        if b["kv"] + b["state"] > self.held_at_peak["kv"] + self.held_at_peak["state"]:
            self.held_at_peak["kv"], self.held_at_peak["state"] = b["kv"], b["state"]

    def check_integrity(self) -> None:
        """The budget, and with ``deep_checks`` the policy's own invariants (O(cache); tests) (AssertionError)."""
        if self.deep_checks:
            self.policy.check_integrity()
        b = self.policy.bytes_by_kind()
        assert b["kv"] + b["state"] <= self.cache_bytes, "replica cache over its budget"
