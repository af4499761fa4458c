"""What every prefix-cache policy model shares: replica byte sizes, the policy interface, the replay.

A replay is timeless: requests run one at a time, in trace order ("one running request at a time").
For each request the policy is asked for its hit (:meth:`PrefixPolicy.lookup`, pure), then told the
request ran (:meth:`PrefixPolicy.admit`: what the engine caches after it), then trimmed to the byte
budget (:meth:`PrefixPolicy.evict_to`). The budget covers, per replica, cached KV + cached states +
the state slots one running request holds (``running_state_slots`` x one sequence's state): the slots
are reserved from the budget before anything is cached.

Tokens from hash ids: a trace names each ``block_size``-token block of a prompt by a chained id
(Mooncake: 512 tokens), so two prompts are known to share exactly ``512 x`` their leading run of equal
ids (the whole prompt when every id, partial tail included, is equal). Policies that work at one-token
pages (SGLang) see token positions, but a divergence is only known to the block: a shared prefix
always ends on a trace block boundary or at a whole prompt. Outputs are not modelled: a trace does not
say which later prompt contains which output tokens, so only prompt tokens are cached, and a state an
engine saves at the end of a request (prompt + output) is placed at the end of the prompt.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from kda_core.config import PRESETS, fixed_state_bytes_per_sequence, mla_kv_bytes_per_token
from serve.errors import check_choice, check_int
from serve.traces.mooncake import TraceRequest, leading_run

BYTE_KINDS = ("kv", "state", "running")


@dataclass(frozen=True)
class ReplicaBytes:
    """Byte sizes of one replica (all its TP ranks together). Frozen; validated in ``__post_init__``.

    kv_bytes_per_token: cached MLA latent KV of one token, all MLA layers, all ranks;
    state_bytes: one sequence's KDA state (recurrent + conv), all KDA layers, all ranks;
    tp_size: tensor-parallel ranks; preset: the model preset name ("" if custom).
    """

    kv_bytes_per_token: int
    state_bytes: int
    tp_size: int = 1
    preset: str = ""

    def __post_init__(self):
        for name in ("kv_bytes_per_token", "state_bytes", "tp_size"):
            check_int(name, getattr(self, name))

    @classmethod
    def for_preset(cls, preset: str, tp_size: int = 1, kv_dtype: torch.dtype = torch.bfloat16,
                   state_dtype: torch.dtype = torch.float32, conv_dtype: torch.dtype = torch.bfloat16) -> ReplicaBytes:
        """A real preset (:mod:`kda_core.config`) on ``tp_size`` ranks. The MLA latent is one tensor shared
        by all heads, so plain TP replicates it on every rank (KV bytes x tp_size); KDA heads are split, so
        the state summed over ranks is one sequence's state. Raises ValueError for an unknown preset or a
        tp_size that does not divide the KDA heads."""
        check_choice("preset", preset, sorted(PRESETS))
        cfg = PRESETS[preset]
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size <= 0 or cfg.num_heads % tp_size:
            raise ValueError(f"tp_size must be a positive divisor of num_heads={cfg.num_heads}, got {tp_size!r}")
        kv = mla_kv_bytes_per_token(cfg, kv_dtype) * tp_size      # latent replicated on each rank
        st = fixed_state_bytes_per_sequence(cfg, state_dtype, conv_dtype)  # heads split: sum = one state
        return cls(kv, st, tp_size, preset)


class PolicyResult(NamedTuple):
    """Outcome of :func:`replay`. Tokens are totals over the trace; bytes per replica.

    name: policy name. token_hit_ratio = hit_tokens / total_tokens. ideal_hit_tokens: the block ideal
    (unlimited cache, ``min(leading run x N, L)`` per request, :func:`serve.traces.mooncake.ideal_hit_ratio`).
    request_hit_tokens: ``[R]`` int64, each request's hit (feed a roofline to get prefill time saved).
    peak_bytes: ``{kind: bytes}`` over :data:`BYTE_KINDS`, the most held after any request, per kind (the
    kinds peak at different times: their sum can pass the budget). held_at_peak: ``{kind: bytes}`` held after
    the request where KV + states held was largest (the first such request): its sum never passes the budget.
    states_written / states_evicted: state checkpoints (one sequence's state each, or one group's for ours)
    stored / evicted; kv_evicted_tokens: cached KV tokens evicted.
    lost_to_missing_state: tokens whose KV the engine could reuse (cached, within its hit granularity and
    caps) but no state at or beyond let it. budget_bytes: the budget. seconds: wall time of the replay.
    token_hit_ratio is 0.0 for a trace whose prompts are all empty.
    """

    name: str
    token_hit_ratio: float
    hit_tokens: int
    total_tokens: int
    ideal_hit_tokens: int
    request_hit_tokens: np.ndarray
    peak_bytes: dict
    states_written: int
    states_evicted: int
    kv_evicted_tokens: int
    lost_to_missing_state: int
    budget_bytes: float
    seconds: float
    held_at_peak: dict


@runtime_checkable
class PrefixPolicy(Protocol):
    """A prefix-cache policy model over trace requests. Metadata only (no tensors).

    ``lookup(request) -> (hit_tokens, kv_reusable_tokens)``: pure; the tokens the engine would skip,
    and the tokens its cached KV alone would allow (the same caps and granularity, no state needed).
    ``admit(request, hit_tokens)``: the request ran; cache what the engine caches after it.
    ``evict_to(cache_bytes)``: evict until cached KV + states <= cache_bytes; returns nothing.
    ``bytes_by_kind() -> {"kv": int, "state": int}``; ``check_integrity()``: AssertionError if broken.
    ``running_state_slots``: states one running request holds, each ``state_bytes`` (the engine's slot,
    padding included); ``block_size``: tokens per trace hash id; ``states_written``, ``states_evicted``,
    ``kv_evicted_tokens``: counters. ``replay_trace(requests, budget_bytes, check_every) -> PolicyResult``: the whole trace
    (called by :func:`replay` once it has checked the inputs): :func:`step_replay` (one request at a time through
    the methods above), or the policy's own replay (ours: :func:`serve.prefix.sim.replay_trace`).
    """

    name: str
    running_state_slots: int
    state_bytes: int
    block_size: int
    states_written: int
    states_evicted: int
    kv_evicted_tokens: int

    def lookup(self, request: TraceRequest) -> tuple[int, int]: ...

    def admit(self, request: TraceRequest, hit_tokens: int) -> None: ...

    def evict_to(self, cache_bytes: float) -> None: ...

    def bytes_by_kind(self) -> dict: ...

    def check_integrity(self) -> None: ...

    def replay_trace(self, requests: Sequence[TraceRequest], budget_bytes: float,
                     check_every: int = 0) -> PolicyResult: ...


def running_bytes(policy, max_running: int = 1) -> int:
    """Bytes the state slots of ``max_running`` running requests take from a budget (``running_state_slots`` x the
    policy's ``state_bytes`` each)."""
    return policy.running_state_slots * policy.state_bytes * max_running


def cache_bytes(policy, budget_bytes: float, max_running: int = 1) -> float:
    """What a budget of ``budget_bytes`` leaves for cached KV and states once ``max_running`` running requests'
    state slots are reserved (:func:`running_bytes`; the engine allocates them first). Raises ValueError when the
    budget does not cover them (nothing could run)."""
    running = running_bytes(policy, max_running)
    if not budget_bytes >= running:
        raise ValueError(f"budget_bytes {budget_bytes:,.0f} is below the state slots of {max_running} running "
                         f"request(s) of {policy.name} ({running:,} bytes)")
    return budget_bytes - running


def check_budget(name: str, val) -> float:
    """``val`` as a float if it is a finite real number >= 0 (not a bool, not NaN); else ValueError naming
    ``name``."""
    if isinstance(val, bool) or not isinstance(val, Real) or not math.isfinite(val) or val < 0:
        raise ValueError(f"{name} must be a finite number of bytes >= 0, got {val!r}")
    return float(val)


def check_trace_blocks(requests: Sequence[TraceRequest], block_size: int) -> None:
    """ValueError unless every request names its prompt by ``ceil(input_length / block_size)`` hash ids (the
    trace's block is the policy's ``block_size``)."""
    for i, r in enumerate(requests):
        if len(r.hash_ids) != -(-r.input_length // block_size):
            raise ValueError(f"block_size {block_size} is not this trace's block: request {i} has "
                             f"{r.input_length} tokens and {len(r.hash_ids)} hash ids (expected "
                             f"{-(-r.input_length // block_size)})")


def replay(requests: Sequence[TraceRequest], policy: PrefixPolicy, budget_bytes: float,
           check_every: int = 0) -> PolicyResult:
    """Replay ``requests`` in order through ``policy`` under ``budget_bytes`` per replica (see the module
    docstring), by the policy's own ``replay_trace``; ``check_every`` > 0: integrity checks every that many
    requests (tests; :func:`step_replay`).

    Raises ValueError for an empty trace, a budget that is not a finite number >= 0 (a string, NaN, inf), one
    smaller than the running request's state slots (nothing could run), or a trace whose block is not the
    policy's ``block_size``.
    """
    if not requests:
        raise ValueError("requests must not be empty")
    budget_bytes = check_budget("budget_bytes", budget_bytes)
    check_trace_blocks(requests, policy.block_size)
    cache_bytes(policy, budget_bytes)
    return policy.replay_trace(requests, budget_bytes, check_every)


def step_replay(requests: Sequence[TraceRequest], policy: PrefixPolicy, budget_bytes: float,
                check_every: int = 0) -> PolicyResult:
    """The replay of a policy that models one request at a time: ``lookup``, ``admit``, ``evict_to`` the budget
    left after the running request's slots, per request in order. ``check_every`` > 0 runs ``check_integrity``
    and the budget check every that many requests (tests); 0 never. Raises ValueError as :func:`cache_bytes`."""
    cache_budget = cache_bytes(policy, budget_bytes)
    running = running_bytes(policy)
    t0 = time.perf_counter()
    hits = np.zeros(len(requests), dtype=np.int64)
    seen: set = set()
    ideal = lost = total = 0
    peak = dict.fromkeys(BYTE_KINDS, 0)
    at_peak = dict.fromkeys(BYTE_KINDS, 0)
    n_blk = policy.block_size
    for n, r in enumerate(requests):
        hit, kv_ok = policy.lookup(r)
        hits[n] = hit
        lost += kv_ok - hit
        ideal += min(leading_run(r.hash_ids, seen) * n_blk, r.input_length)
        seen.update(r.hash_ids)
        total += r.input_length
        policy.admit(r, hit)
        policy.evict_to(cache_budget)
        b = policy.bytes_by_kind()
        peak["kv"], peak["state"] = max(peak["kv"], b["kv"]), max(peak["state"], b["state"])
        if b["kv"] + b["state"] > at_peak["kv"] + at_peak["state"]:
            at_peak["kv"], at_peak["state"] = b["kv"], b["state"]
        if check_every and n % check_every == 0:
            policy.check_integrity()
            assert b["kv"] + b["state"] <= cache_budget, "cache over its budget after eviction"
    peak["running"] = at_peak["running"] = running
    hit_total = int(hits.sum())
    return PolicyResult(
        name=policy.name, token_hit_ratio=hit_total / total if total else 0.0, hit_tokens=hit_total,
        total_tokens=total, ideal_hit_tokens=ideal, request_hit_tokens=hits, peak_bytes=peak,
        states_written=policy.states_written, states_evicted=policy.states_evicted,
        kv_evicted_tokens=policy.kv_evicted_tokens, lost_to_missing_state=lost, budget_bytes=budget_bytes,
        seconds=time.perf_counter() - t0, held_at_peak=at_peak)
