"""lab.forward_cost: the fixed + per-token cost of a forward, fitted, checked on a held-out point and used to
predict warm TTFT (Home and page 08). The old pages predicted warm TTFT as restore + (L − hit) tokens of prefill,
leaving out the fixed cost of a forward, which their own numbers contradicted (75 % of tokens skipped, TTFT 41 %
lower)."""
import pytest

from lab.forward_cost import FIT_FRACTIONS, fit_lengths, forward_fit
from lab.prefix import prefix_hit_timing, time_cold_warm
from lab.timing import summarize
from serve.config import ServeConfig


def _t(label, *ms):
    return summarize(label, [m / 1e3 for m in ms])


def _line(n, a=20.0, b=0.1):
    return a + b * n


@pytest.mark.parametrize("L", [1, 2, 3, 8, 16, 144, 256, 2000])
def test_fit_lengths_hold_out_the_prompt(L):
    ns = fit_lengths(L)
    assert L not in ns and len(set(ns)) == len(ns) >= 2 and all(n >= 1 for n in ns)
    if L >= 16:
        assert ns == tuple(sorted({round(f * L) for f in FIT_FRACTIONS}))


def test_fit_lengths_rejects_bad_input():
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="prompt_tokens"):
            fit_lengths(bad)


def test_warm_prediction_keeps_the_fixed_cost():
    """A 256-token prompt with a 192-token hit: 75 % of the tokens skipped. With a fixed cost a = 20 ms per
    forward and b = 0.1 ms/token the warm run takes 20 + 6.4 + copies, not a quarter of the cold run."""
    L, hit, copies = 256, 192, 0.5
    prefill = [(n, _t(f"prefill {n}", _line(n) - 1, _line(n), _line(n) + 1, _line(n), _line(n))) for n in (32, 96, 192)]
    cold = _t("cold", *[_line(L)] * 5)
    warm = _t("warm", *[_line(L - hit) + copies] * 5)
    fit = forward_fit(prefill, cold, warm, L, hit, copies)
    assert fit.fixed_ms == pytest.approx(20.0) and fit.per_token_ms == pytest.approx(0.1) and fit.r2 == pytest.approx(1)
    assert fit.prompt_tokens not in fit.fit_tokens                                # the held-out point is not fitted
    assert fit.held_out_predicted_ms == pytest.approx(_line(L)) and fit.held_out_error == pytest.approx(0, abs=1e-9)
    assert fit.warm_predicted_ms == pytest.approx(20 + 0.1 * 64 + copies) and fit.warm_error == pytest.approx(0, abs=1e-9)
    # the per-token-only formula (no fixed cost) predicts a quarter of the cold run: far too fast
    assert fit.proportional_ms == pytest.approx(_line(L) * 64 / 256 + copies) and fit.proportional_error < -0.5
    assert fit.fixed_share == pytest.approx(20 / fit.warm_measured_ms)
    roles = [r["role"] for r in fit.points()]
    assert roles.count("measured, used in the fit") == 3 and "measured, held out: cold run" in roles
    assert "predicted: warm, a + b·n + copies" in roles and "measured: warm run" in roles


def test_forward_fit_rejects_bad_input():
    pts = [(n, _t("p", _line(n))) for n in (10, 20)]
    cold, warm = _t("cold", 40), _t("warm", 25)
    with pytest.raises(ValueError, match="held-out length"):
        forward_fit([*pts, (100, _t("p", 30))], cold, warm, 100, 50, 0.0)
    with pytest.raises(ValueError, match="hit_tokens"):
        forward_fit(pts, cold, warm, 100, 100, 0.0)
    with pytest.raises(ValueError, match="two distinct"):
        forward_fit(pts[:1], cold, warm, 100, 50, 0.0)
    with pytest.raises(ValueError, match="times must be > 0"):
        forward_fit(pts, _t("cold", 0), warm, 100, 50, 0.0)


def test_engine_runs_give_the_fit_points_interleaved():
    """time_cold_warm times the fit's cache-off prefills in the same interleaved rounds as cold and warm (>= 5 each
    after a warm-up), at fit_lengths(L), never L; the page-level call fits them and validates on the cold run."""
    first, second = [7] * 96 + [1] * 16, [7] * 96 + [2] * 16
    run = time_cold_warm(first, second, max_new_tokens=1, config=ServeConfig(16, 32), repeats=5)
    assert [n for n, _ in run.prefill] == list(fit_lengths(len(second))) == [14, 70]
    assert all(len(t.samples_s) == 5 and t.min_s > 0 for _, t in run.prefill)
    timed = prefix_hit_timing(96, 16, 1, 16, 32, 1, repeats=5)
    fit = timed.fit
    assert fit.prompt_tokens == 112 and fit.prompt_tokens not in fit.fit_tokens
    warm = timed.rows[timed.rows.kind == "warm"]
    assert fit.warm_prefill_tokens == 112 - int(warm.hit_tokens.iloc[0]) == int(warm.prefill_tokens.iloc[0])
    assert fit.held_out_measured_ms == pytest.approx(float(timed.ttft.set_index("kind").median_ms["cold"]))
    assert fit.warm_measured_ms == pytest.approx(float(timed.ttft.set_index("kind").median_ms["warm"]))
    assert fit.warm_predicted_ms == pytest.approx(fit.fixed_ms + fit.per_token_ms * fit.warm_prefill_tokens
                                                  + fit.warm_copies_ms)
    assert fit.fixed_ms > 0                          # a forward has a fixed cost on this engine


def test_two_point_line_is_labelled_an_estimate_and_a_fit_has_residuals():
    """Two sizes give a line through both (no residual, R² = 1 by construction): ``two_point`` says so and the held-out
    error in ms is its only check; three noisy sizes give a least-squares fit with a non-zero residual."""
    cold, warm = _t("cold", *[_line(256)] * 5), _t("warm", *[_line(64)] * 5)
    two = forward_fit([(n, _t("p", _line(n))) for n in (32, 160)], cold, warm, 256, 192, 0.0)
    assert two.two_point and two.max_residual_ms == pytest.approx(0, abs=1e-9)
    assert two.held_out_error_ms == pytest.approx(two.held_out_predicted_ms - two.held_out_measured_ms)
    three = forward_fit([(n, _t("p", _line(n) + d)) for n, d in ((32, 1.0), (96, -1.0), (160, 1.0))], cold, warm,
                        256, 192, 0.0)
    assert not three.two_point and three.max_residual_ms > 0.5
