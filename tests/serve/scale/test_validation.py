"""The roofline against the Kimi Linear tech report (arXiv 2510.26692): ratios within +-25 %."""
import pytest

from serve.scale.published import CONTEXTS, CURVES, PREFILL_FIG7A, TPOT_FIG1B, TPOT_FIG7B, K
from serve.scale.validation import RATIO_TOLERANCE, PrefillFit, decode_ratios, fit_prefill, prefill_ratios


@pytest.mark.parametrize("curve", CURVES, ids=[c.figure for c in CURVES])
def test_plotted_points_agree_with_the_labels(curve):
    """The points read from the PDF reproduce the ratios the figure prints (to its 1 decimal)."""
    assert len(curve.mla) == len(curve.kimi_linear) == len(CONTEXTS)
    for context, label in curve.labelled_ratios.items():
        assert curve.ratio(context) == pytest.approx(label, abs=0.11)


@pytest.mark.parametrize("context", list(TPOT_FIG7B.labelled_ratios), ids=["512K", "1M"])
def test_decode_ratio_pure_roofline(context):
    (row,) = decode_ratios(contexts=(context,))
    assert abs(row.rel_error) <= RATIO_TOLERANCE, row


def test_decode_ratio_every_plotted_context():
    assert all(abs(r.rel_error) <= RATIO_TOLERANCE for r in decode_ratios()), decode_ratios()


@pytest.mark.parametrize("context", list(PREFILL_FIG7A.labelled_ratios), ids=["512K", "1M"])
def test_prefill_ratio_with_the_fit(context):
    (row,) = prefill_ratios(contexts=(context,))
    assert abs(row.rel_error) <= RATIO_TOLERANCE, row


def test_prefill_fit_predicts_kimi_linear_from_16k():
    """Fitted on two MLA points only; Kimi Linear's ratio is predicted at every context >= 16K."""
    rows = prefill_ratios(contexts=tuple(c for c in CONTEXTS if c >= 16 * K))
    assert all(abs(r.rel_error) <= RATIO_TOLERANCE for r in rows), rows


def test_prefill_fit_is_physical():
    """alpha >= 1 (attention no faster than peak) and the fit reproduces its own MLA points."""
    fit = fit_prefill()
    assert 1.0 <= fit.alpha < fit.beta
    assert 1 / fit.alpha == pytest.approx(0.68, abs=0.05)  # ~ FlashAttention-3's 75 % of H100 peak


def test_pure_roofline_prefill_gap_is_reported():
    """Without the fit the roofline overshoots 512K by more than the tolerance: the gap the docs state."""
    (row,) = prefill_ratios(PrefillFit(1.0, 1.0), tp=1, contexts=(512 * K,))
    assert row.rel_error > RATIO_TOLERANCE


def test_fig1b_is_not_reproduced():
    """Fig. 1b (unstated larger batches) is out of reach: the batch-1 roofline is below it by more
    than the tolerance at every labelled point, and at 512K and 1M even the KV-bytes ratio 27 / 7
    (the bound for equal batches) is."""
    for context, label in TPOT_FIG1B.labelled_ratios.items():
        (row,) = decode_ratios(TPOT_FIG1B, contexts=(context,))
        assert row.rel_error < -RATIO_TOLERANCE
        if context >= 512 * K:
            assert 27 / 7 < label / (1 + RATIO_TOLERANCE)
