"""Published latency points of the Kimi Linear tech report, as data with their sources.

Source: Kimi Team, "Kimi Linear: An Expressive, Efficient Attention Architecture", arXiv 2510.26692,
PDF ``tech_report.pdf`` in https://github.com/MoonshotAI/Kimi-Linear (commit 858dba5). The figures
are pgfplots vector graphics; the values below are the plotted polyline vertices read from the PDF's
content streams and converted with the axes' own tick positions (not read off a bitmap), rounded to
3 significant digits. Contexts are 4K, 8K, ..., 1M (1K = 1024 tokens, the x ticks are evenly spaced
powers of two). The models are Kimi Linear (48B-A3B) and the full-MLA baseline "with the same number
of layers and attention heads" (Sec. 5.6). Hardware, GPU count and parallelism are not stated.

- Fig. 7a: prefill latency (s) vs prefill length, batch size 1. Labelled ratios 2.3x at 512K and
  2.9x at 1M; Sec. 5.6 text: "outperforming MLA by a factor of 2.3 for 512k sequences and 2.9 for
  1M sequences".
- Fig. 7b: TPOT (ms) vs decoding length, "We use batch size=1 here for tests". Labelled ratios
  1.8x at 512K and 2.2x at 1M (Sec. 6.3's text says "2.3x speedup at a 1M token context" for the
  same figure; the plotted points give 2.22x).
- Fig. 1b: TPOT (ms) vs decoding length with "larger batches"; Sec. 6.3 calls it "a theoretical
  decoding speedup of up to 6.3x"; caption "6.3x faster TPOT (1.84ms vs. 11.48ms) than MLA at 1M
  tokens"; labelled 4.8x (256K), 5.7x (512K), 6.3x (1M). The batch sizes are not stated.
"""
from __future__ import annotations

from typing import NamedTuple

from serve.errors import check_choice

K = 1024
CONTEXTS = tuple(4 * K * 2 ** i for i in range(9))  # 4K .. 1M
SOURCE = "Kimi Linear tech report, arXiv 2510.26692 (github.com/MoonshotAI/Kimi-Linear tech_report.pdf)"


class PublishedCurve(NamedTuple):
    """One figure's two curves: ``mla`` and ``kimi_linear`` values at ``CONTEXTS`` (``unit``), the
    ratios the figure labels (context -> MLA / Kimi Linear), and where it comes from."""

    figure: str
    quantity: str
    unit: str
    batch: str
    mla: tuple[float, ...]
    kimi_linear: tuple[float, ...]
    labelled_ratios: dict[int, float]
    source: str

    def ratio(self, context: int) -> float:
        """MLA / Kimi Linear at a plotted context (from the plotted values, not the labels)."""
        check_choice("context", context, CONTEXTS)
        i = CONTEXTS.index(context)
        return self.mla[i] / self.kimi_linear[i]


PREFILL_FIG7A = PublishedCurve(
    "Fig. 7a", "prefill latency", "s", "1",
    mla=(0.0640, 0.0990, 0.182, 0.359, 0.796, 2.00, 5.76, 18.6, 65.5),
    kimi_linear=(0.0960, 0.125, 0.186, 0.327, 0.643, 1.40, 3.21, 8.07, 22.8),
    labelled_ratios={512 * K: 2.3, 1024 * K: 2.9},
    source=SOURCE + ", Fig. 7a and Sec. 5.6 text")

TPOT_FIG7B = PublishedCurve(
    "Fig. 7b", "TPOT", "ms", "1",
    mla=(5.32, 5.37, 6.20, 6.52, 6.88, 7.67, 9.10, 12.0, 17.8),
    kimi_linear=(5.09, 5.12, 5.37, 5.41, 5.53, 5.74, 6.00, 6.66, 7.99),
    labelled_ratios={512 * K: 1.8, 1024 * K: 2.2},
    source=SOURCE + ", Fig. 7b (batch size 1 stated in the caption)")

TPOT_FIG1B = PublishedCurve(
    "Fig. 1b", "TPOT, larger batches (theoretical)", "ms", "unstated, larger for Kimi Linear",
    mla=(0.0926, 0.134, 0.213, 0.400, 0.781, 1.83, 3.10, 5.88, 11.5),
    kimi_linear=(0.100, 0.0900, 0.0900, 0.100, 0.150, 0.460, 0.650, 1.05, 1.84),
    labelled_ratios={256 * K: 4.8, 512 * K: 5.7, 1024 * K: 6.3},
    source=SOURCE + ", Fig. 1b, caption and Sec. 6.3 text")

CURVES = (PREFILL_FIG7A, TPOT_FIG7B, TPOT_FIG1B)
