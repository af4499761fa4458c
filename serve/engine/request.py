"""A serving request: its prompt (:func:`prompt_ids`), its record (:class:`Request`), its caches read
from and written to its pages (:func:`read_request_cache`, :func:`write_request_cache`), and what the
engine reports about it (:class:`RequestResult`)."""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kda_core.model import HybridCache
from serve.engine.sampling import GREEDY, SamplingParams
from serve.memory.layout import CacheLayout
from serve.memory.pages import read_kv, read_state, write_kv, write_state
from serve.memory.pool import PagePool
from serve.prefix.hit import PrefixHit

TIMING_PHASES = ("lookup", "queue", "admit", "restore", "prefill", "checkpoint")


class RequestStatus(enum.StrEnum):
    """Life cycle: WAITING (matched, queued) -> PREFILL -> DECODE -> FINISHED; or ABORTED / REJECTED."""

    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    ABORTED = "aborted"
    REJECTED = "rejected"


class RequestResult(NamedTuple):
    """What the engine reports for one request.

    output_tokens: generated ids; ttft_ms: submit -> first token (measured, perf_counter);
    prefill_tokens: prompt tokens computed; hit_tokens: tokens restored from the cache (b);
    kv_hit_tokens: phase-1 KV tokens; restored_bytes: checkpoint bytes copied into the request's state;
    shared_kv_bytes: KV bytes reused by reference (hit blocks * block bytes); checkpoints_written:
    checkpoints this request published; timings_ms: per phase in :data:`TIMING_PHASES`; logits:
    ``[len(output_tokens), 256]`` fp32 when recorded, else None; reason: why a request was rejected or
    aborted by the engine (empty otherwise); drafted_tokens / accepted_tokens: speculative drafts proposed / accepted (0 without speculation).
    """

    rid: int
    status: RequestStatus
    prompt_tokens: int
    output_tokens: tuple
    ttft_ms: float | None
    prefill_tokens: int
    hit_tokens: int
    kv_hit_tokens: int
    restored_bytes: int
    shared_kv_bytes: int
    checkpoints_written: int
    timings_ms: dict
    logits: torch.Tensor | None
    reason: str
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class Request:
    """Mutable engine-side state of one request.

    Token ranges (half-open), L = len(prompt):
      [0, hit.num_tokens)          restored (shared KV pages + checkpoint copy)
      [hit.num_tokens, computed)   computed so far by this request (its own KV pages, private state)
      [computed, L)                prompt still to prefill
      [L, L + len(output) - 1)     decoded (the last output token is not fed back yet)
    """

    rid: int
    prompt: list
    max_new_tokens: int
    record_logits: bool
    submit_t: float
    status: RequestStatus = RequestStatus.WAITING
    hit: PrefixHit | None = None
    keys: list = field(default_factory=list)
    page_table: list = field(default_factory=list)
    state_pages: list = field(default_factory=list)
    spec_slots: list = field(default_factory=list)   # snapshot speculation: k + 1 slots' state pages; state_pages is one
    computed: int = 0
    output: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    first_token_t: float | None = None
    finish_t: float | None = None
    timings_ms: dict = field(default_factory=lambda: dict.fromkeys(TIMING_PHASES, 0.0))
    prefill_tokens: int = 0
    restored_bytes: int = 0
    shared_kv_bytes: int = 0
    checkpoints_written: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    proposer: object = None
    strategy: object = None
    reason: str = ""
    sampling: SamplingParams = GREEDY        # seeded (SamplingParams.seeded) when not greedy
    generator: torch.Generator | None = None   # the request's own, at its seed's start on submit / preempt

    @property
    def final_tokens(self) -> int:
        """Tokens the request's cache will have consumed at the end: L + max_new_tokens - 1."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def hit_blocks(self) -> int:
        """Blocks restored from the cache (b / N; 0 without a hit)."""
        return 0 if self.hit is None else len(self.hit.kv_pages)

    @property
    def hit_pages(self) -> int:
        """Cache pages the request's hit pins: its KV blocks plus its checkpoint's state pages."""
        return 0 if self.hit is None else self.hit_blocks + sum(len(g) for g in self.hit.checkpoint_pages)

    def pages_needed(self, layout: CacheLayout) -> tuple[int, int]:
        """``(state pages, KV pages)`` the request must allocate under ``layout``: a whole KDA state (all
        groups) and one page per block of its final tokens not covered by its hit."""
        return layout.state_pages, -(-self.final_tokens // layout.block_size) - self.hit_blocks

    def tokens(self) -> list:
        """Prompt + output ids (the last output id is not yet consumed by the cache)."""
        return self.prompt + self.output

    def result(self) -> RequestResult:
        hit = self.hit
        ttft = None if self.first_token_t is None else (self.first_token_t - self.submit_t) * 1e3
        logits = torch.stack(self.logits) if self.logits else None
        return RequestResult(self.rid, self.status, len(self.prompt), tuple(self.output), ttft,
                             self.prefill_tokens, 0 if hit is None else hit.num_tokens,
                             0 if hit is None else hit.kv_tokens, self.restored_bytes, self.shared_kv_bytes,
                             self.checkpoints_written, dict(self.timings_ms), logits, self.reason,
                             self.drafted_tokens, self.accepted_tokens)


def prompt_ids(tokens, vocab_size: int = 256) -> list[int]:
    """A prompt as a list of token ids: a 1-D integer tensor / array, ``bytes``, or a sequence of ints
    (not bools). Raises ValueError naming ``tokens`` for anything else, an empty prompt or ids
    outside [0, vocab_size) (the shipped byte models: [0, 255])."""
    what = "byte ids" if vocab_size == 256 else "token ids"
    expected = f"tokens must be a non-empty 1-D sequence of {what} (ints in [0, {vocab_size - 1}])"
    if hasattr(tokens, "tolist") and hasattr(tokens, "ndim"):          # torch tensor / numpy array
        if tokens.ndim != 1:
            raise ValueError(f"{expected}, got an array of shape {tuple(tokens.shape)}")
        tokens = tokens.tolist()
    if isinstance(tokens, (str, dict, set)) or not isinstance(tokens, (bytes, bytearray, list, tuple, range)):
        raise ValueError(f"{expected}, got {type(tokens).__name__}")
    if not tokens:
        raise ValueError(f"{expected}, got an empty prompt")
    prompt = []
    for t in tokens:
        try:
            i = None if isinstance(t, bool) else operator.index(t)   # ints incl. numpy ints; not 1.0, not True
        except TypeError:
            i = None
        if i is None or not 0 <= i < vocab_size:
            raise ValueError(f"{expected}, got {t!r} at position {len(prompt)}")
        prompt.append(i)
    return prompt


def read_request_cache(layout: CacheLayout, pool: PagePool, req: Request) -> HybridCache:
    """The request's cache as model tensors (copies): KDA layers from its state pages, MLA latents of
    its first ``computed`` tokens from its page table."""
    cfg = layout.cfg
    kda = read_state(layout, pool, req.state_pages)
    latents = dict(zip(cfg.mla_layers, read_kv(layout, pool, req.page_table, req.computed)))
    return HybridCache(tuple(kda[i] if i in kda else latents[i] for i in range(cfg.num_layers)), req.computed)


def write_request_cache(layout: CacheLayout, pool: PagePool, req: Request, new: HybridCache, start: int) -> None:
    """Write the state after ``new.num_tokens`` tokens into the request's state pages and the latents of
    tokens ``[start, new.num_tokens)`` into its page table; ``computed`` becomes ``new.num_tokens``."""
    cfg = layout.cfg
    write_state(layout, pool, req.state_pages, {i: new.layers[i] for i in cfg.kda_layers})
    write_kv(layout, pool, req.page_table, start, [new.layers[i][:, start:] for i in cfg.mla_layers])
    req.computed = new.num_tokens
