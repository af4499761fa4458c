"""The checks and the engines the suite knows, by name (the command line's ``--checks`` and ``--engine``)."""
from __future__ import annotations

from conformance.adapters import Adapter, LlamaCpp, Sglang, Vllm
from conformance.checks_cache import CACHE_ORDER, PREFIX_HIT, STATE_HIT_METRICS
from conformance.checks_decode import ABORT_RECOMPUTE, BATCH_INVARIANCE, CHUNKED_PREFILL, SPECULATIVE_DECODING
from conformance.ours import Ours
from conformance.suite import Check

CHECKS: dict[str, Check] = {c.id: c for c in (PREFIX_HIT, CACHE_ORDER, SPECULATIVE_DECODING, CHUNKED_PREFILL,
                                              BATCH_INVARIANCE, ABORT_RECOMPUTE, STATE_HIT_METRICS)}
ENGINES: dict[str, type[Adapter]] = {a.name: a for a in (Ours, LlamaCpp, Vllm, Sglang)}


def select_checks(ids) -> list[Check]:
    """The checks named in ``ids`` (all for an empty selection), in the suite's order. Raises ValueError naming
    an unknown id."""
    ids = list(ids or ())
    unknown = [i for i in ids if i not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; known: {list(CHECKS)}")
    return [c for cid, c in CHECKS.items() if not ids or cid in ids]
