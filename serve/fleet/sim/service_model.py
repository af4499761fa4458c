"""Service-time model of one replica (continuous batching, prefill-prioritised, as S-LoRA / vLLM v0).

A replica runs *steps*. If requests were admitted, the step is a **prefill step** over their uncached
prompt tokens (cache hits are skipped; at least one token is computed to produce logits):
``prefill_ms = prefill_overhead_ms + uncached_tokens / prefill_tokens_per_s · 1000``; decoding
requests wait during it. Otherwise it is a **decode step** producing one token for each of the b
running requests: ``decode_step_ms(b) = decode_step_base_ms + decode_step_per_seq_ms · b``.
A request's first token comes at the end of its prefill step; the remaining ``output_length − 1``
come from decode steps.

``mixed_steps=True`` models a batched engine that runs decode rows and prefill chunks in the same step
(vLLM v1 / SGLang chunked prefill; our :class:`serve.engine.ServeEngine`): a step with admitted prompts also
advances every running request by one token and lasts
``prefill_overhead_ms + uncached_tokens / prefill_tokens_per_s · 1000 + decode_step_per_seq_ms · b``
(one fixed cost per step, each prefill token and each decode row on top: :meth:`ServiceModel.mixed_step_ms`);
without admissions the step is a decode step as above. For such an engine ``prefill_overhead_ms`` is the fixed
cost of a step that has prefill rows and ``decode_step_base_ms`` that of a decode-only step.

Five optional terms (0 by default) fitted to a real engine (``bench/sim_vs_engine.py``):
``prefill_off_grid_per_token_ms`` per new token of a prompt whose cached part ends off the
``prefill_grid_tokens`` grid (our engine's KDA chunk kernel runs such a prompt off its 64-token chunk grid:
measured 40-50 % more time per token after a 16- or 48-token hit than after none or 64);
``prefill_per_row_ms`` per prompt in the step (each prefill row's own work: restoring its checkpoint, its
row of the packed forward, publishing its blocks and checkpoints); ``prefill_per_token_pair_ms`` · pairs, the prefill attention's quadratic part (the MLA layers score each new
token against every cached and earlier new token: ``pairs = new · cached + new · (new + 1) / 2`` per prompt,
the FLOP count of causal attention, FlashAttention paper §3 / Vidur's attention-prefill operator); and
``per_output_row_ms`` · rows for every row that emits a token (decode rows and prompts whose prefill ends):
the server's own per-token work after each step (detokenise, hand the token to its stream, the event loop's
share of the CPU and the GIL); and ``prefill_per_checkpoint_ms`` per checkpoint a prompt publishes (one every
``checkpoint_interval_tokens`` of the prompt: the engine copies the KDA state out at each, fitted by
:mod:`serve.fleet.engine_replay.fit`).

Admission limits: at most ``max_batch_requests`` running; each running request reserves
``input_length + output_length`` KV tokens out of ``kv_capacity_tokens`` (S-LoRA reserves the full
future length the same way); one prefill step admits at most ``max_prefill_tokens_per_step`` uncached
tokens (at least one request).

Presets:
- :func:`vtc_a10g_preset` — calibrated on the VTC artifact's measurements (S-LoRA, Llama-7B, one
  A10G; ``max_total_token_num`` 10,000 in its ``launch_server.py``).
- :meth:`ServiceModel.scaled` — the same with prefill and decode sped up by stated factors: an
  *assumption* for a faster replica, labelled as such wherever it is used.
- :func:`measure_cpu_engine` — prefill and decode rates measured on this CPU with our own engine.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import NamedTuple

from serve.errors import check_int, check_positive
from serve.traces.vtc_artifact import VTCRun


@dataclass(frozen=True)
class ServiceModel:
    """Replica speed and limits; see the module docstring for the formulas. Times in ms."""

    prefill_tokens_per_s: float
    decode_step_base_ms: float
    decode_step_per_seq_ms: float = 0.0
    prefill_overhead_ms: float = 0.0
    max_batch_requests: int = 256
    kv_capacity_tokens: int | None = None
    max_prefill_tokens_per_step: int | None = None
    source: str = ""
    mixed_steps: bool = False
    decode_per_context_token_ms: float = 0.0
    decode_buckets: tuple[int, ...] | None = None
    prefill_per_token_pair_ms: float = 0.0
    per_output_row_ms: float = 0.0
    prefill_per_row_ms: float = 0.0
    prefill_off_grid_per_token_ms: float = 0.0
    prefill_grid_tokens: int = 64
    prefill_per_checkpoint_ms: float = 0.0
    checkpoint_interval_tokens: int = 64

    def __post_init__(self):
        check_positive("prefill_tokens_per_s", self.prefill_tokens_per_s)
        if not self.decode_step_base_ms > 0 or min(self.decode_step_per_seq_ms, self.prefill_overhead_ms,
                                                   self.decode_per_context_token_ms, self.prefill_per_token_pair_ms,
                                                   self.per_output_row_ms, self.prefill_per_row_ms,
                                                   self.prefill_off_grid_per_token_ms,
                                                   self.prefill_per_checkpoint_ms) < 0:
            raise ValueError("decode_step_base_ms must be > 0; per-seq, per-context-token, per-pair, per-row and "
                             "overhead times must be >= 0")
        check_int("max_batch_requests", self.max_batch_requests)
        check_int("prefill_grid_tokens", self.prefill_grid_tokens)
        check_int("checkpoint_interval_tokens", self.checkpoint_interval_tokens)
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be >= 1 or None, got {self.kv_capacity_tokens}")
        if self.decode_buckets is not None and (not self.decode_buckets or any(
                not isinstance(b, int) or b < 1 for b in self.decode_buckets)):
            raise ValueError(f"decode_buckets must be None or positive ints, got {self.decode_buckets!r}")
        if self.max_prefill_tokens_per_step is not None and self.max_prefill_tokens_per_step < 1:
            raise ValueError("max_prefill_tokens_per_step must be >= 1 or None")

    def prefill_ms(self, uncached_tokens: int) -> float:
        """Duration of a prefill step computing ``uncached_tokens`` prompt tokens."""
        return self.prefill_overhead_ms + uncached_tokens * 1000.0 / self.prefill_tokens_per_s

    def prefill_batch_ms(self, parts) -> float:
        """A prefill step over ``(new_tokens, cached_tokens)`` per admitted request: the new tokens, their
        attention pairs (:func:`attention_pairs`), the new tokens of prompts cached off the grid,
        ``prefill_per_row_ms`` and ``per_output_row_ms`` per prompt (the
        interface :class:`serve.fleet.sim.roofline_service.RooflineService` shares)."""
        parts = list(parts)
        off_grid = sum(n for n, c in parts if c % self.prefill_grid_tokens)
        C = self.checkpoint_interval_tokens
        published = sum((c + n) // C - c // C for n, c in parts)          # checkpoints the prompts write
        return (self.prefill_per_checkpoint_ms * published + self.prefill_ms(sum(n for n, _ in parts))
                + (self.prefill_per_row_ms + self.per_output_row_ms) * len(parts)
                + self.prefill_per_token_pair_ms * sum(attention_pairs(n, c) for n, c in parts)
                + self.prefill_off_grid_per_token_ms * off_grid)

    def mixed_step_ms(self, parts, decode_batch: int, context_tokens: int = 0) -> float:
        """A step of a batched engine (``mixed_steps``): the prefill step over ``parts`` (see
        :meth:`prefill_batch_ms`) plus one decode row for each of ``decode_batch`` running requests of mean
        context ``context_tokens``."""
        return self.prefill_batch_ms(parts) + self.decode_step_ms(decode_batch, context_tokens) - \
            self.decode_step_base_ms

    def decode_step_ms(self, batch: int, context_tokens: int = 0) -> float:
        """Duration of one decode step with ``batch`` running requests of mean context ``context_tokens``:
        ``decode_step_base_ms + decode_step_per_seq_ms · padded_batch(batch) + decode_per_context_token_ms ·
        batch · context + per_output_row_ms · batch`` (pad rows cost a row but read no KV and emit nothing;
        zero per-context and per-row cost by default)."""
        return (self.decode_step_base_ms + self.decode_step_per_seq_ms * self.padded_batch(batch)
                + (self.decode_per_context_token_ms * context_tokens + self.per_output_row_ms) * batch)

    def padded_batch(self, batch: int) -> int:
        """The decode rows a step really computes: ``batch`` rounded up to the smallest of ``decode_buckets``
        that holds it (CUDA-graph buckets, vLLM's ``cudagraph_capture_sizes``; our ModelRunner pads the same
        way), ``batch`` itself above the largest bucket or without buckets."""
        if self.decode_buckets is None or batch <= 0:
            return batch
        return min((b for b in self.decode_buckets if b >= batch), default=batch)

    def scaled(self, prefill_x: float, decode_x: float, kv_capacity_tokens: int | None = None,
               max_batch_requests: int | None = None) -> ServiceModel:
        """A replica ``prefill_x`` times faster at prefill and ``decode_x`` times faster per decode
        step (an assumption, recorded in ``source``); optional new KV capacity / batch limit. Every prefill
        time term (fixed, per token, per row, per attention pair, off the grid) is divided by ``prefill_x``, every
        decode term (base, per row, per context token) by ``decode_x``; ``per_output_row_ms``, the server's own
        work per emitted token, stays as it is. Raises ValueError for a factor <= 0."""
        if not (prefill_x > 0 and decode_x > 0):
            raise ValueError("speed-up factors must be > 0")
        return replace(
            self,
            prefill_tokens_per_s=self.prefill_tokens_per_s * prefill_x,
            decode_step_base_ms=self.decode_step_base_ms / decode_x,
            decode_step_per_seq_ms=self.decode_step_per_seq_ms / decode_x,
            decode_per_context_token_ms=self.decode_per_context_token_ms / decode_x,
            prefill_overhead_ms=self.prefill_overhead_ms / prefill_x,
            prefill_per_token_pair_ms=self.prefill_per_token_pair_ms / prefill_x,
            prefill_per_row_ms=self.prefill_per_row_ms / prefill_x,
            prefill_off_grid_per_token_ms=self.prefill_off_grid_per_token_ms / prefill_x,
            prefill_per_checkpoint_ms=self.prefill_per_checkpoint_ms / prefill_x,
            kv_capacity_tokens=kv_capacity_tokens if kv_capacity_tokens is not None else self.kv_capacity_tokens,
            max_batch_requests=max_batch_requests or self.max_batch_requests,
            source=f"{self.source} × (prefill {prefill_x:g}, decode {decode_x:g}) — assumed speed-up",
        )


def attention_pairs(new_tokens: int, cached_tokens: int) -> float:
    """Query-key pairs a causal attention prefill scores for ``new_tokens`` after ``cached_tokens``:
    ``new · cached + new · (new + 1) / 2`` (each new token sees the cache and the new tokens up to itself)."""
    return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2


SLORA_MAX_TOTAL_TOKENS = 10_000  # VTC-artifact fair_bench/launch_server.py: --num-token default


def vtc_a10g_preset(run: VTCRun) -> ServiceModel:
    """Calibrate on a VTC artifact run (uniform 256/256 suites).

    - prefill rate: the smallest TTFT of the run is an uncontended prefill of one prompt (the first
      requests reach an idle server) → ``prompt_len / min ttft``;
    - batch limit: S-LoRA's KV reservation, ⌊10,000 / (input + output)⌋ requests;
    - decode step (batch-independent — the A10G decode is memory-bound at these batch sizes): solved
      so that the saturated throughput equals the run's measured throughput X:
      ``1/X = prefill + (out − 1) · step / B``.
    Raises ValueError when the run is not a single-length suite or not saturated enough.
    """
    records = [r for r in run.records if r.ttft_s >= 0]
    if not records:
        raise ValueError("VTC run has no completed requests")
    in_len = statistics.median(r.prompt_len for r in records)
    out_len = statistics.median(r.output_len for r in records)
    prefill_s = min(r.ttft_s for r in records)
    per_request_tokens = in_len + out_len
    batch = SLORA_MAX_TOTAL_TOKENS // per_request_tokens
    step_s = batch * (1.0 / run.throughput_rps - prefill_s) / (out_len - 1)
    if batch < 1 or step_s <= 0:
        raise ValueError("cannot calibrate: run not saturated or lengths too long for the KV capacity")
    return ServiceModel(
        prefill_tokens_per_s=in_len / prefill_s,
        decode_step_base_ms=step_s * 1000.0,
        max_batch_requests=int(batch),
        kv_capacity_tokens=SLORA_MAX_TOTAL_TOKENS,
        source=f"VTC artifact (S-LoRA, Llama-7B, A10G), calibrated to {run.throughput_rps:.3f} req/s",
    )


class EngineRates(NamedTuple):
    """Measured on this CPU: ``prefill_tokens_per_s`` (one prompt of ``prompt_tokens``),
    ``decode_step_ms`` per batch size in ``batch_sizes`` (median of ``repeats``)."""

    prefill_tokens_per_s: float
    decode_step_ms: dict[int, float]
    prompt_tokens: int


def measure_cpu_engine(prompt_tokens: int = 256, batch_sizes: tuple[int, ...] = (1, 4), repeats: int = 3,
                       preset: str = "demo") -> EngineRates:
    """Time our own ``kda_core`` HybridLM (the runnable model of ``preset``, :func:`serve.runnable.demo_model`:
    the trained weights for ``demo``) on this CPU: prefill of one prompt, decode steps at several
    batch sizes (medians). Heavy: call it from a cached function or a bench, not in a page body."""
    import torch

    from serve.runnable import demo_model

    torch.manual_seed(0)
    model = demo_model(preset)
    prompt = torch.randint(0, 256, (1, prompt_tokens))
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.prefill(prompt)
            times.append(time.perf_counter() - t0)
        decode = {}
        for b in batch_sizes:
            _, cache = model.prefill(torch.randint(0, 256, (b, 8)))
            step_times = []
            tok = torch.randint(0, 256, (b,))
            for _ in range(repeats):
                t0 = time.perf_counter()
                model.decode_step(tok, cache)
                step_times.append(time.perf_counter() - t0)
            decode[b] = statistics.median(step_times) * 1000.0
    return EngineRates(prompt_tokens / statistics.median(times), decode, prompt_tokens)


def cpu_engine_preset(rates: EngineRates, kv_capacity_tokens: int | None = 65536,
                      max_batch_requests: int = 64) -> ServiceModel:
    """Service model from :func:`measure_cpu_engine`: decode step = base + slope · batch through the
    smallest and largest measured batch sizes (slope ≥ 0; if that line would have a non-positive
    intercept, base = 1 µs and the line goes through the largest batch). The fit passes through one
    measured point and never under-estimates the other."""
    (b0, t0), (b1, t1) = sorted(rates.decode_step_ms.items())[0], sorted(rates.decode_step_ms.items())[-1]
    slope = max(0.0, (t1 - t0) / (b1 - b0)) if b1 != b0 else 0.0
    base = t0 - slope * b0
    if base < 1e-3:  # super-linear timings: keep a positive intercept, pass through the larger batch
        base = 1e-3
        slope = (t1 - base) / b1
    return ServiceModel(rates.prefill_tokens_per_s, base, slope, max_batch_requests=max_batch_requests,
                        kv_capacity_tokens=kv_capacity_tokens, source="measured on this CPU (our engine)")


def saturated_throughput_rps(model: ServiceModel, input_len: int, output_len: int) -> float:
    """Steady-state requests/s of one always-full replica (single-request prefill steps)."""
    batch = model.max_batch_requests
    if model.kv_capacity_tokens is not None:
        batch = min(batch, model.kv_capacity_tokens // (input_len + output_len))
    if batch < 1:
        return 0.0
    per_request_ms = model.prefill_ms(input_len) + (output_len - 1) * model.decode_step_ms(batch) / batch
    return 1000.0 / per_request_ms if math.isfinite(per_request_ms) else 0.0
