"""The cost of one forward, fitted from the engine's own TTFT measurements, and what it predicts for a warm run
(Home and page 08).

A prefill of n tokens is one chunked forward: its TTFT is ``t(n) = a + b·n`` with ``a`` a fixed cost per
forward (ms: layer launches, the MLA/KDA set-up, the sampler, the engine's lookup and admission) and ``b`` a
cost per token (ms/token). The formula "warm TTFT = restore + (L − hit) tokens of prefill" leaves ``a`` out, so
it predicts a warm run far too fast when the fixed cost dominates (a warm run that skips 75 % of the tokens is
not 75 % faster). Here:

- **measured**: cache-off TTFT at the prefill lengths of :func:`fit_lengths` (never L itself), the cold run (L
  tokens) and the warm run, all in the same interleaved rounds (:func:`lab.prefix.time_cold_warm`);
- **fitted**: ``a`` and ``b`` by least squares over the medians at :func:`fit_lengths`
  (:func:`lab.timing.fit_linear`);
- **held out**: the cold run (L tokens, cache off) is not in the fit; the fit's prediction at L against its
  measured median is the validation error;
- **predicted**: warm TTFT ``= a + b·(L − hit) + copies``, copies = the warm run's measured restore and
  checkpoint phases (medians); next to it the per-token-only formula ``cold·(L − hit)/L + copies`` (no fixed
  cost), so the page can show how far off that one is.

The line is an empirical model fitted here on this CPU, not a published formula: it is only as good as its
error on the held-out point, which the pages show next to it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from lab.timing import LinearFit, Timing, fit_linear
from serve.errors import check_int

# Cache-off prefill lengths of the fit, as fractions of the prompt L. Two: each length is one more engine run per
# round on page 08's first render (hosted budget 2 s); the held-out cold run, not R², says how good the line is.
FIT_FRACTIONS = (0.125, 0.625)


def fit_lengths(prompt_tokens: int) -> tuple[int, ...]:
    """The prefill lengths n (tokens) fitted for a prompt of L = ``prompt_tokens``: :data:`FIT_FRACTIONS` of L,
    rounded, distinct, never L itself (L is the held-out point: the cold run). A prompt too short for two
    distinct lengths below L gets L + 16, L + 32, ... (still measured, never L). Raises ValueError for L < 1."""
    check_int("prompt_tokens", prompt_tokens)
    ns = sorted({max(1, round(f * prompt_tokens)) for f in FIT_FRACTIONS} - {prompt_tokens})
    extra = 1
    while len(ns) < 2:
        ns.append(prompt_tokens + 16 * extra)
        extra += 1
    return tuple(ns)


class ForwardFit(NamedTuple):
    """The fitted cost of a forward and its checks, ms.

    fixed_ms: fitted ``a`` (ms per forward); per_token_ms: fitted ``b`` (ms/token); r2: of the fit over the
    medians; fit_tokens / fit_median_ms / fit_q1_ms / fit_q3_ms: the measured points fitted (n, median, IQR);
    prompt_tokens: L; held_out_measured_ms / held_out_predicted_ms: the cold run (L tokens, not in the fit),
    measured median and the fit at L; warm_prefill_tokens: L − hit; warm_copies_ms: the warm run's measured
    restore + checkpoint (medians); warm_measured_ms: its measured median TTFT; warm_predicted_ms:
    ``a + b·(L − hit) + copies``; proportional_ms: ``cold·(L − hit)/L + copies``, the formula without a fixed
    cost."""

    fixed_ms: float
    per_token_ms: float
    r2: float
    fit_tokens: tuple
    fit_median_ms: tuple
    fit_q1_ms: tuple
    fit_q3_ms: tuple
    prompt_tokens: int
    held_out_measured_ms: float
    held_out_predicted_ms: float
    warm_prefill_tokens: int
    warm_copies_ms: float
    warm_measured_ms: float
    warm_predicted_ms: float
    proportional_ms: float

    @property
    def held_out_error(self) -> float:
        """(predicted − measured) / measured at the held-out point (fraction)."""
        return self.held_out_predicted_ms / self.held_out_measured_ms - 1.0

    @property
    def warm_error(self) -> float:
        """(predicted − measured) / measured for the warm run (fraction)."""
        return self.warm_predicted_ms / self.warm_measured_ms - 1.0

    @property
    def proportional_error(self) -> float:
        """(per-token-only prediction − measured) / measured for the warm run (fraction)."""
        return self.proportional_ms / self.warm_measured_ms - 1.0

    @property
    def two_point(self) -> bool:
        """True when the line passes through exactly two measured sizes: an estimate with no residual to test it
        (its only check is :attr:`held_out_error`), not a fit over more points than parameters."""
        return len(self.fit_tokens) == 2

    @property
    def held_out_error_ms(self) -> float:
        """Predicted − measured at the held-out point (ms): how far the line is off where it was not fitted."""
        return self.held_out_predicted_ms - self.held_out_measured_ms

    @property
    def max_residual_ms(self) -> float:
        """Largest |median − (a + b·n)| over the fitted points (ms); 0 for a two-point line by construction."""
        return max(abs(m - self.fixed_ms - self.per_token_ms * n) for n, m in zip(self.fit_tokens, self.fit_median_ms))

    @property
    def fixed_share(self) -> float:
        """Share of the measured warm TTFT that is the fitted fixed cost (fraction)."""
        return self.fixed_ms / self.warm_measured_ms

    def points(self) -> list[dict]:
        """Rows for a chart / CSV, one per point: ``role`` ("measured, used in the fit", "measured, held out:
        cold run", "measured: warm run", "predicted: warm, a + b·n + copies", "predicted: warm, without a"),
        ``prefill_tokens``, ``ttft_ms``, ``q1_ms`` / ``q3_ms`` (the fitted points' IQR; NaN otherwise) and
        ``fit_ms``: the fitted line at that n."""
        nan = float("nan")
        line = LinearFit(self.fixed_ms, self.per_token_ms, self.r2)
        rows = [dict(role="measured, used in the fit", prefill_tokens=n, ttft_ms=m, q1_ms=q1, q3_ms=q3)
                for n, m, q1, q3 in zip(self.fit_tokens, self.fit_median_ms, self.fit_q1_ms, self.fit_q3_ms)]
        rows += [dict(role="measured, held out: cold run", prefill_tokens=self.prompt_tokens,
                      ttft_ms=self.held_out_measured_ms, q1_ms=nan, q3_ms=nan),
                 dict(role="measured: warm run", prefill_tokens=self.warm_prefill_tokens, ttft_ms=self.warm_measured_ms,
                      q1_ms=nan, q3_ms=nan),
                 dict(role="predicted: warm, a + b·n + copies", prefill_tokens=self.warm_prefill_tokens,
                      ttft_ms=self.warm_predicted_ms, q1_ms=nan, q3_ms=nan),
                 dict(role="predicted: warm, without a", prefill_tokens=self.warm_prefill_tokens,
                      ttft_ms=self.proportional_ms, q1_ms=nan, q3_ms=nan)]
        return [r | dict(fit_ms=line.at(r["prefill_tokens"])) for r in rows]


def forward_fit(prefill: Sequence[tuple[int, Timing]], cold: Timing, warm: Timing, prompt_tokens: int,
                hit_tokens: int, warm_copies_ms: float) -> ForwardFit:
    """Fit ``a + b·n`` to the medians of ``prefill`` ((n, cache-off TTFT timing) pairs, seconds), validate it
    on ``cold`` (the cache-off run of all ``prompt_tokens`` = L, which must not be one of the fitted n) and
    predict ``warm`` (hit of ``hit_tokens``, its measured restore + checkpoint ``warm_copies_ms``).

    Raises ValueError for fewer than two distinct fitted n, a fitted n equal to L (it would not be held
    out), a hit outside [0, L) or non-positive times."""
    check_int("prompt_tokens", prompt_tokens)
    check_int("hit_tokens", hit_tokens, 0)
    if hit_tokens >= prompt_tokens:
        raise ValueError(f"hit_tokens must be < prompt_tokens = {prompt_tokens}, got {hit_tokens}")
    ns = [n for n, _ in prefill]
    if prompt_tokens in ns:
        raise ValueError(f"the held-out length L = {prompt_tokens} must not be among the fitted lengths {ns}")
    for t in (cold, warm, *(t for _, t in prefill)):
        if not t.median_s > 0:
            raise ValueError(f"{t.label}: times must be > 0 s, got median {t.median_s!r}")
    fit = fit_linear(ns, [t.median_s * 1e3 for _, t in prefill])
    cold_ms, warm_ms, left = cold.median_s * 1e3, warm.median_s * 1e3, prompt_tokens - hit_tokens
    return ForwardFit(fit.a_s, fit.b_s, fit.r2, tuple(ns), tuple(t.median_s * 1e3 for _, t in prefill),
                      tuple(t.q1_s * 1e3 for _, t in prefill), tuple(t.q3_s * 1e3 for _, t in prefill),
                      prompt_tokens, cold_ms, fit.at(prompt_tokens), left, warm_copies_ms, warm_ms,
                      fit.at(left) + warm_copies_ms, cold_ms * left / prompt_tokens + warm_copies_ms)
