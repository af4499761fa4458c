"""lab.timing: interleaved repeats, summaries, conditions and the a + b n fit."""
import time

import numpy as np
import pytest

from kda_core.chunk import kernel_in_use
from lab.timing import MIN_REPEATS, fit_linear, measure, summarize


def test_measure_interleaves_after_warmup():
    calls = []
    cases = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    timings, cond = measure(cases, repeats=5, warmup=2)
    assert calls[:6] == list("abcabc")                      # warm-up: each case twice, untimed
    rounds = [calls[6 + 3 * r: 9 + 3 * r] for r in range(5)]
    assert rounds == [list("abc"), list("bca"), list("cab"), list("abc"), list("bca")]   # rotating order
    assert [t.label for t in timings] == list("abc") and all(len(t.samples_s) == 5 for t in timings)
    assert cond.repeats == 5 and cond.warmup == 2 and cond.cores >= 1 and cond.torch_threads >= 1
    assert "median of 5 interleaved repeats" in cond.stamp()
    # the stamp names the form kda_chunk ran in (a timing from the torch form is ~2x slower)
    assert cond.chunk_kernel in ("fused C (AVX-512)", "fused C (AVX2)", "torch form")
    assert cond.chunk_kernel == kernel_in_use() and cond.stamp().endswith(f"chunk kernel {cond.chunk_kernel}")


def test_measure_times_what_runs():
    timings, _ = measure({"sleep": lambda: time.sleep(0.004), "noop": lambda: None}, repeats=5, warmup=0)
    sleep, noop = timings
    assert sleep.min_s >= 0.004 > noop.max_s
    assert sleep.q1_s <= sleep.median_s <= sleep.q3_s and sleep.min_s <= sleep.q1_s and sleep.q3_s <= sleep.max_s


def test_summarize_quartiles():
    t = summarize("x", [5.0, 1.0, 3.0, 2.0, 4.0])
    assert (t.median_s, t.q1_s, t.q3_s, t.min_s, t.max_s, t.iqr_s) == (3.0, 2.0, 4.0, 1.0, 5.0, 2.0)


@pytest.mark.parametrize("kwargs, match", [({"repeats": MIN_REPEATS - 1}, "repeats"), ({"warmup": -1}, "warmup"),
                                           ({"repeats": True}, "repeats")])
def test_measure_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        measure({"a": lambda: None}, **kwargs)
    with pytest.raises(ValueError, match="cases"):
        measure({})


def test_fit_linear_separates_overhead_from_per_token_cost():
    fit = fit_linear([0, 1, 2, 4], [5.0, 5.5, 6.0, 7.0])     # t = 5 + 0.5 n exactly
    assert fit.a_s == pytest.approx(5.0) and fit.b_s == pytest.approx(0.5) and fit.r2 == pytest.approx(1.0)
    assert fit.at(8) == pytest.approx(9.0)
    with pytest.raises(ValueError, match="two distinct"):
        fit_linear([3, 3], [1.0, 2.0])


def test_fit_linear_slope_standard_error():
    """The slope's standard error (page 04 says "no measurable per-token cost" instead of printing a
    slope such as b = -0.000 ms/token that is within it): the textbook formula, inf with two points."""
    ns, ts = [0, 1, 2, 3, 4], [1.0, 1.2, 0.9, 1.1, 1.0]
    f = fit_linear(ns, ts)
    resid = np.asarray(ts) - (f.a_s + f.b_s * np.asarray(ns))
    want = np.sqrt((resid ** 2).sum() / 3 / ((np.asarray(ns) - 2.0) ** 2).sum())
    assert f.b_se_s == pytest.approx(want) and abs(f.b_s) < f.b_se_s and not f.b_measurable
    assert fit_linear([0, 1], [1.0, 2.0]).b_se_s == float("inf")
    steep = fit_linear([0, 1, 2, 3], [1.0, 2.01, 2.99, 4.0])
    assert steep.b_measurable and steep.b_se_s < 0.01
    assert not fit_linear([0, 1, 2, 3], [4.0, 2.99, 2.01, 1.0]).b_measurable       # negative: never measurable
