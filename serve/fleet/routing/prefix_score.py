"""Routing on the prefix each replica reports it would serve, with or without its KDA checkpoints.

A precise prefix-cache router (llm-d's ``precise-prefix-cache-scorer`` fed by the engines' KV-cache
events; SGLang's and vLLM's routers instead keep an approximate tree of what they sent, see
``cache_aware.py``) knows which prompt tokens each replica holds. For a KDA hybrid two answers exist:

- ``precise_kv`` — the tokens whose **KV** the replica holds: what a router built for full-attention
  models scores. It ignores where the replica placed its state checkpoints, so it can pick a replica
  whose cached KV is useless (no state at or beyond a boundary of the match);
- ``precise_state`` — the tokens the replica would actually skip: its policy's hit, which needs a
  state at the boundary (checkpoint-aware).

The difference between the two on one trace is the cost of routing that ignores checkpoint placement.
Both share ``cache_aware``'s rule with exact scores: if the load is imbalanced (max - min >
``balance_abs_threshold`` and max > ``balance_rel_threshold`` x min) the least-loaded replica; otherwise
the replica with the highest score when it exceeds ``cache_threshold`` of the prompt (sgl-router's 0.3:
a short shared prefix such as a system prompt does not pull every request to one replica), ties to the
least loaded; else the least loaded (then router order).
``scorer(replica, request) -> (hit_tokens, kv_tokens)`` is given at construction (the simulation passes its
replicas' :meth:`prefix_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from serve.errors import check_fraction
from serve.fleet.routing.router import RouteQuery, Router

PREFIX_SCORE_ROUTERS = {"precise_kv": False, "precise_state": True}   # name -> checkpoint-aware


class PrefixScoreRouter(Router):
    """Route on each replica's reported prefix (module docstring). ``use_state``: score the hit (True) or
    the cached KV (False); ``scorer(replica, request) -> (hit_tokens, kv_tokens)``. Raises ValueError for bad
    thresholds."""

    def __init__(self, replicas: Sequence[str], scorer: Callable[[str, object], tuple[int, int]],
                 use_state: bool = True, cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5):
        check_fraction("cache_threshold", cache_threshold)
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        self.cache_threshold = cache_threshold
        super().__init__(replicas)
        self.use_state = bool(use_state)
        self.name = "precise_state" if self.use_state else "precise_kv"
        self.balance_abs_threshold, self.balance_rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.scorer = scorer

    def route(self, query: RouteQuery) -> str:
        replicas, load = self._replicas, self._load
        loads = [load.get(r, 0) for r in replicas]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return replicas[loads.index(lo)]
        pick = 0 if self.use_state else 1
        scores = [self.scorer(r, query.request)[pick] for r in replicas]
        best = max(scores)
        if not best > self.cache_threshold * query.request.input_length:
            return replicas[loads.index(lo)]
        best_i = min((i for i, s in enumerate(scores) if s == best), key=lambda i: (loads[i], i))
        return replicas[best_i]
