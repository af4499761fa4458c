"""Page 03: cache bytes per sequence of the real configs (exact formulas of :mod:`kda_core.config`) and
live decode-cost measurements on this CPU; :func:`state_vs_kv` returns both for the page in one call.

Measurements (chart 2):

Per decoded token and layer: one :func:`kda_core.kda.kda_step` (constant work: H K V state
update) against one absorbed MLA decode over a latent cache of N tokens
(:func:`kda_core.layer.latent_attention`, linear in N). Real head dims (K = V = 128, latent
r + rope = 576) with the number of heads scaled down (``num_heads``) so a sweep stays under a
second; the page says so. Timing follows :func:`lab.timing.measure`: one case per context N, a
warm-up run of each, then ``repeats`` rounds with the contexts in rotating order; each point is the
median with its interquartile range and min / max (microseconds). KDA and MLA are measured in two
separate sweeps, not interleaved with each other: interleaving let the MLA pass over N latents evict
the KDA state from the CPU cache, so the KDA time grew with N (3.4x at 16k, found in review) although
its work does not. The KDA step's inputs are the same at every N (its state is H x K x V whatever
the context); it is timed once per N so its line shows its own run-to-run spread. Per layer,
:func:`lab.timing.fit_linear` fits t(N) = a + b N over the medians: a is the fixed cost of one step
(call overhead, the state update), b the cost per context token (≈ 0 for KDA). Runs use one torch thread.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from kda_core import config as kc
from kda_core.config import ModelConfig
from kda_core.kda import kda_step
from kda_core.layer import latent_attention
from lab.threads import one_thread
from lab.timing import MIN_REPEATS, Conditions, LinearFit, fit_linear, measure
from serve.errors import check_choice, check_int


class DecodeCost(NamedTuple):
    """One context length N: microseconds per decoded token for one layer, median and interquartile range
    (q1, q3) over the repeats, for the KDA step and the MLA decode."""

    context_tokens: int
    kda_step_us: float
    kda_q1_us: float
    kda_q3_us: float
    mla_decode_us: float
    mla_q1_us: float
    mla_q3_us: float


class DecodeCosts(NamedTuple):
    """:func:`measure_decode_cost`'s result: rows (one :class:`DecodeCost` per context, input order); kda_fit
    / mla_fit: t(N) = a + b N over the medians (seconds; a fixed per-step cost, b per context token);
    conditions: of the KDA sweep (the MLA sweep follows it at once with the same repeats and threads)."""

    rows: list
    kda_fit: LinearFit
    mla_fit: LinearFit
    conditions: Conditions


class HeadCost(NamedTuple):
    """One head count H: microseconds of one absorbed MLA decode over the same N latents, median and interquartile
    range (q1, q3) over the repeats."""

    num_heads: int
    mla_decode_us: float
    mla_q1_us: float
    mla_q3_us: float


class HeadScaling(NamedTuple):
    """:func:`measure_head_scaling`'s result: ``rows`` (one :class:`HeadCost` per head count, ascending),
    ``context_tokens`` (the N every row decodes over), ``latent_bytes`` (the N x (r + rope) fp32 latents one decode
    reads, whatever H), ``conditions`` of the run."""

    rows: list
    context_tokens: int
    latent_bytes: int
    conditions: Conditions

    def ratio(self, heads: int, base: int = 1) -> float:
        """The median time with ``heads`` heads ÷ with ``base`` heads (both must be rows). Raises KeyError."""
        medians = {r.num_heads: r.mla_decode_us for r in self.rows}
        return medians[heads] / medians[base]


MAX_MEASURED_CONTEXT = 262_144
HEAD_COUNTS = (1, 2, 4, 8, 16)   # head counts of the head-scaling run (the page's measured heads joins them)
GOOD_FIT_R2 = 0.9   # below this the line explains too little of the medians' spread to be read as a + b·N


def fit_reading(fit: LinearFit) -> str:
    """What a fitted line t(N) = a + b·N over decode medians means, in one sentence: a flat time (b not above its
    standard error: R² near 0 is then expected, nothing follows N), a bent one (a < 0: the time rises faster above
    the CPU cache than below, so a is not a fixed cost and the line undershoots at small N), a poor fit (R² below
    :data:`GOOD_FIT_R2`: read the points), or a good one (a fixed cost per step plus b per context token)."""
    if not fit.b_measurable:
        return ("flat: no measurable cost per context token (b ≤ its standard error), so R² near 0 is expected; "
                "the time is the fixed cost")
    if fit.a_s < 0:
        return ("not one straight line: a < 0 is no fixed cost, the time rises faster at large N (the latents leave "
                "the CPU cache); read b as the large-N slope and the points at small N")
    if not fit.r2 >= GOOD_FIT_R2:
        return f"a poor line (R² {fit.r2:.2f} < {GOOD_FIT_R2}): the points, not a and b, are the result"
    return "a good line: a fixed cost a per step plus b per token of context"


def fit_table(fits: dict[str, LinearFit]) -> pd.DataFrame:
    """One row per named fit (``fits``: name -> t(N) = a + b·N in seconds): ``kind``, ``a_us`` (µs), ``b_ns`` and
    ``b_se_ns`` (ns per context token, and its standard error), ``r2`` and ``reading`` (:func:`fit_reading`)."""
    return pd.DataFrame([{"kind": name, "a_us": f.a_s * 1e6, "b_ns": f.b_s * 1e9, "b_se_ns": f.b_se_s * 1e9,
                          "r2": f.r2, "reading": fit_reading(f)} for name, f in fits.items()])


def measure_decode_cost(cfg: ModelConfig, contexts: list[int], num_heads: int = 4, repeats: int = MIN_REPEATS,
                        seed: int = 0) -> DecodeCosts:
    """Measure per-token decode time of one KDA layer step vs one MLA decode at each context.

    Args:
        cfg: model config (head dims K, V and latent width r + rope come from it).
        contexts: distinct context lengths N in tokens (each in [1, 262,144]; at least two, for the fit).
        num_heads: heads used for both layers in the measurement (scaled down from the real model).
        repeats: timed rounds per point (>= :data:`lab.timing.MIN_REPEATS`; the median is reported).

    Returns: :class:`DecodeCosts`.

    Raises: ValueError on out-of-range or repeated contexts, fewer than two contexts, non-positive
    heads or repeats below :data:`lab.timing.MIN_REPEATS`.
    """
    if not contexts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 or n > MAX_MEASURED_CONTEXT
                           for n in contexts):
        raise ValueError(f"contexts must be ints in [1, {MAX_MEASURED_CONTEXT}], got {contexts}")
    if len(set(contexts)) != len(contexts) or len(contexts) < 2:
        raise ValueError(f"contexts must be at least two distinct lengths (for the a + b N fit), got {contexts}")
    check_int("num_heads", num_heads)
    gen = torch.Generator().manual_seed(seed)
    H, K, V, r = num_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.kv_lora_rank
    q = torch.nn.functional.normalize(torch.randn(1, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, H, K, generator=gen), dim=-1)
    v = torch.randn(1, H, V, generator=gen)
    g = -torch.rand(1, H, K, generator=gen) * 0.1
    beta = torch.rand(1, H, generator=gen)
    state = torch.randn(1, H, K, V, generator=gen)
    q_cat = torch.randn(1, H, cfg.latent_dim, generator=gen)
    latents = torch.randn(1, max(contexts), cfg.latent_dim, generator=gen)   # [1, N_max, r + rope]; N = a prefix
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    with one_thread():
        kda, cond = measure({str(n): lambda: kda_step(q, k, v, g, beta, state) for n in contexts}, repeats=repeats)
        mla, _ = measure({str(n): lambda c=latents[:, :n]: latent_attention(q_cat, c, r, scale) for n in contexts},
                         repeats=repeats)
    rows = [DecodeCost(n, kt.median_s * 1e6, kt.q1_s * 1e6, kt.q3_s * 1e6, mt.median_s * 1e6, mt.q1_s * 1e6,
                       mt.q3_s * 1e6) for n, kt, mt in zip(contexts, kda, mla)]
    return DecodeCosts(rows, fit_linear(contexts, [t.median_s for t in kda]),
                       fit_linear(contexts, [t.median_s for t in mla]), cond)


def measure_head_scaling(cfg: ModelConfig, context_tokens: int, heads: tuple[int, ...] = HEAD_COUNTS,
                         repeats: int = MIN_REPEATS, seed: int = 0) -> HeadScaling:
    """Time one absorbed MLA decode (:func:`kda_core.layer.latent_attention`) over the same ``context_tokens``
    latents with each head count in ``heads``, all in one run: the head counts interleaved in rotating order
    (:func:`lab.timing.measure`), one torch thread, so a change of load moves every count alike.

    Absorbed MLA's heads share one latent cache: each step reads the N x (r + rope) latents once, whatever H, and
    each head adds 2 N (r + rope) + 2 N r flops (its scores, then its weighted sum of latents). While reading the
    latents dominates, the time grows far slower than H; H-fold only where the arithmetic dominates. Timings from
    different runs on a shared machine differ by more than that (the load changes), hence one run.

    Args:
        cfg: model config (latent width r + rope and the softmax scale come from it).
        context_tokens: N, in [1, 262,144].
        heads: distinct head counts, each >= 1, at least two (for the fit).
        repeats: timed rounds per head count (>= :data:`lab.timing.MIN_REPEATS`).

    Returns: :class:`HeadScaling`, rows in ascending head count.

    Raises: ValueError for N out of range, fewer than two distinct head counts, a head count < 1, or repeats
    below :data:`lab.timing.MIN_REPEATS`.
    """
    check_int("context_tokens", context_tokens)
    if context_tokens > MAX_MEASURED_CONTEXT:
        raise ValueError(f"context_tokens must be <= {MAX_MEASURED_CONTEXT}, got {context_tokens}")
    counts = sorted(set(heads))
    if len(counts) < 2 or len(counts) != len(heads):
        raise ValueError(f"heads must be at least two distinct head counts, got {heads}")
    for h in counts:
        check_int("heads", h)
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, context_tokens, cfg.latent_dim, generator=gen)        # [1, N, r + rope]
    queries = {h: torch.randn(1, h, cfg.latent_dim, generator=gen) for h in counts}  # [1, H, r + rope]
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    with one_thread():
        timings, cond = measure({str(h): lambda q=queries[h]: latent_attention(q, latents, cfg.kv_lora_rank, scale)
                                 for h in counts}, repeats=repeats)
    rows = [HeadCost(h, t.median_s * 1e6, t.q1_s * 1e6, t.q3_s * 1e6) for h, t in zip(counts, timings)]
    return HeadScaling(rows, context_tokens, latents.numel() * latents.element_size(), cond)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8 (e4m3)": torch.float8_e4m3fn}
STATE_DTYPES = ("fp32", "bf16")
KV_DTYPES = ("bf16", "fp8 (e4m3)", "fp16", "fp32")
MODELS = {"Kimi-Linear-48B-A3B": "kimi-linear-48b-a3b", "Kimi K3": "kimi-k3", "Custom": "custom"}
CONTEXTS = tuple(2 ** i for i in range(6, 21))  # context options of the page (tokens): 64 .. 1,048,576
MEASURED_CONTEXTS = tuple(2 ** i for i in range(10, 16))  # largest measured context options (tokens)
CONV_DTYPE = torch.bfloat16  # conv window dtype of kda_core.config's byte formulas
CURVE_POINTS = 60  # log-spaced contexts of the bytes chart
MEASURE_REPEATS = MIN_REPEATS  # timed rounds per measured point (the median is shown)


@dataclass(frozen=True)
class StateVsKv:
    """Everything page 03 draws.

    cfg: the model. bytes: :class:`kda_core.config.SequenceBytes` columns per context (bytes per sequence);
    layers: :func:`kda_core.config.layer_table` rows for every context in :data:`CONTEXTS` (column
    ``context_tokens``); decode: :class:`DecodeCost` columns (µs); kda_fit / mla_fit: t(N) = a + b N of the
    medians (s); conditions: of the measurement (:class:`lab.timing.Conditions`); heads: the MLA decode at the
    largest measured context with 1, 2, 4, 8, 16 and the measured head count, in one run (:class:`HeadScaling`). Scalars in bytes (per token / layer /
    sequence) and tokens (break-even; inf when the model has no MLA layer); ``*_dtype_bytes`` element sizes."""

    cfg: ModelConfig
    bytes: pd.DataFrame
    layers: pd.DataFrame
    decode: pd.DataFrame
    kda_fit: LinearFit
    mla_fit: LinearFit
    conditions: Conditions
    heads: HeadScaling
    kv_bytes_per_token: int
    all_mla_kv_bytes_per_token: int
    state_bytes_per_layer: int
    fixed_state_bytes: int
    break_even_tokens: float
    recurrent_break_even_tokens: float
    state_dtype_bytes: int
    kv_dtype_bytes: int
    conv_dtype_bytes: int


def state_vs_kv(model: str, state_dtype: str, kv_dtype: str, context_range: tuple[int, int],
                measure_heads: int, measure_max_tokens: int, custom: tuple[int, int, int, int] | None = None,
                repeats: int = MEASURE_REPEATS) -> StateVsKv:
    """Bytes of ``model`` (a :data:`MODELS` value; "custom" takes ``custom`` = (layers, KDA layers per MLA
    layer, heads, head dim)) over ``context_range`` (tokens, inclusive) with the named dtypes, and decode
    cost measured now with ``measure_heads`` heads at 256 .. ``measure_max_tokens`` tokens (powers of two).

    Raises: ValueError for an unknown model or dtype name, a bad custom config or range, or bad
    measurement sizes (see :func:`measure_decode_cost`)."""
    if model == "custom":
        if custom is None:
            raise ValueError("custom must be (layers, kda_per_mla, heads, head_dim) for the custom model")
        cfg = kc.custom_config(*custom)
    elif model in kc.REAL_PRESETS:
        cfg = kc.PRESETS[model]
    else:
        raise ValueError(f"model must be one of {sorted(MODELS.values())}, got {model!r}")
    for name, value, allowed in (("state_dtype", state_dtype, STATE_DTYPES), ("kv_dtype", kv_dtype, KV_DTYPES)):
        check_choice(name, value, allowed)
    lo, hi = context_range
    if not 1 <= lo <= hi:
        raise ValueError(f"context_range must be (lo, hi) with 1 <= lo <= hi, got {context_range}")
    sd, kd = DTYPES[state_dtype], DTYPES[kv_dtype]
    ctx = np.unique(np.geomspace(lo, max(hi, lo + 1), CURVE_POINTS).astype(int))
    curve = pd.DataFrame([kc.sequence_bytes(cfg, int(n), sd, kd) for n in ctx], columns=kc.SequenceBytes._fields)
    layers = pd.concat([pd.DataFrame(kc.layer_table(cfg, n, sd, kd)).assign(context_tokens=n) for n in CONTEXTS],
                       ignore_index=True)
    measured = [2 ** i for i in range(8, int(np.log2(measure_max_tokens)) + 1)]
    costs = measure_decode_cost(cfg, measured, num_heads=measure_heads, repeats=repeats)
    decode = pd.DataFrame(costs.rows, columns=DecodeCost._fields)
    heads = measure_head_scaling(cfg, measured[-1], tuple(sorted({*HEAD_COUNTS, measure_heads})), repeats=repeats)
    return StateVsKv(cfg, curve, layers, decode, costs.kda_fit, costs.mla_fit, costs.conditions, heads,
                     kc.mla_kv_bytes_per_token(cfg, kd),
                     kc.all_mla_kv_bytes_per_token(cfg, kd), kc.kda_state_bytes_per_layer(cfg, sd),
                     kc.fixed_state_bytes_per_sequence(cfg, sd), kc.break_even_tokens(cfg, sd, kd),
                     kc.recurrent_break_even_tokens(cfg, sd, kd), kc.dtype_bytes(sd), kc.dtype_bytes(kd),
                     kc.dtype_bytes(CONV_DTYPE))
