"""Page 04's experiments: measured bytes equal the formulas, commit timings cover every accepted length,
the ring run reports write-backs and the overflow path."""
import pytest
import torch

from kda_core.model import cache_equal, encode
from lab.models import demo_model
from lab.ring import (
    WIDTHS,
    bytes_vs_draft,
    commit_fits,
    commit_times,
    commit_timing,
    greedy_continuation,
    head_tail_labels,
    is_trained_width,
    prompt_state,
    ring_model,
    ring_run,
    ring_view,
    tradeoff_table,
    verify_prefix,
)
from lab.verify import PROMPT_TEXT
from serve.spec_decode.raw_input_ring import RawInputRing
from serve.spec_decode.replay_ssm import replay_ssm_bytes_per_token
from serve.spec_decode.rollback import (
    LayerShape,
    projection_bytes_per_token,
    raw_input_bytes_per_token,
    snapshot_bytes_per_token,
)
from serve.spec_decode.verify import verify
from tests.serve.spec_decode.helpers import model, one_thread

pytestmark = pytest.mark.usefixtures(one_thread.__name__)
__all__ = ["model"]  # shared fixture


def test_bytes_vs_draft_equal_formulas(model):
    rows = bytes_vs_draft(model, 3)
    shape, L = LayerShape.from_config(model.cfg), model.cfg.num_kda_layers
    per_token = {"snapshot": snapshot_bytes_per_token(shape, 4), "projection replay": projection_bytes_per_token(shape, 4),
                 "raw-input ring": raw_input_bytes_per_token(shape, 4), "ReplaySSM": replay_ssm_bytes_per_token(shape, 4)}
    assert len(rows) == 12
    for r in rows:
        assert r["bytes"] == (1 + r["draft_tokens"]) * L * per_token[r["strategy"]] > 0


def test_commit_times_and_tradeoff(model):
    rows, cond = commit_times(model, 2)
    assert cond.repeats >= 5 and all(r["samples"] == cond.repeats >= 5 for r in rows)
    assert all(r["min_ms"] <= r["q1_ms"] <= r["commit_ms"] <= r["q3_ms"] <= r["max_ms"] for r in rows)
    with pytest.raises(ValueError, match="repeats"):
        commit_times(model, 2, repeats=3)          # 3 samples are no spread
    assert sorted((r["accepted"], r["strategy"]) for r in rows) == sorted(
        (a, s) for a in range(3) for s in ("snapshot", "projection replay", "raw-input ring", "ReplaySSM"))
    assert all(r["commit_ms"] > 0 for r in rows)
    table = tradeoff_table(bytes_vs_draft(model, 2), rows, 2)
    snap = next(t for t in table if t["strategy"] == "snapshot")
    assert snap["memory vs snapshot"] == 1.0 and snap["commit time vs snapshot"] == 1.0
    assert all(t["memory vs snapshot"] < 1.0 for t in table if t is not snap)
    with pytest.raises(ValueError, match="num_draft"):
        tradeoff_table(bytes_vs_draft(model, 1), rows, 2)


def test_ring_run_write_backs_and_overflow(model):
    run = ring_run(model, capacity=6, window=4, requested_draft=5, max_new_tokens=24)
    assert run.overflow.startswith("ValueError") and "rollback window of 4" in run.overflow
    assert run.num_write_backs == sum(s["forced_write_back"] for s in run.steps) >= 2
    assert all(s["slots_in_use"] <= 6 for s in run.steps) and len(run.slots) == 6
    assert run.ring_bytes == 6 * model.cfg.num_kda_layers * model.cfg.hidden_size * 4
    fits = ring_run(model, capacity=8, window=4, requested_draft=2, max_new_tokens=12)
    assert fits.overflow.startswith("fits")
    with pytest.raises(ValueError, match="window"):
        ring_run(model, capacity=2, window=4, requested_draft=1)


def test_ring_run_write_backs_exclude_the_overflow_probe(model):
    """Regression (page 04 said "3 forced write-backs" while its chart marked 2): the ring ends full,
    so the overflow probe forces one more write-back; it is named in ``overflow``, not counted in the run."""
    run = ring_run(model, capacity=6, window=4, requested_draft=2, max_new_tokens=12)
    assert run.steps[-1]["slots_in_use"] == 6                      # full after the run
    assert "after a forced write-back" in run.overflow and run.overflow.startswith("fits")
    assert run.num_write_backs == sum(s["forced_write_back"] for s in run.steps) == 1


@pytest.mark.parametrize("drafter", ["n-gram", "noisy oracle"])
def test_ring_run_overflow_probe_verifies_n_drafts_whatever_the_drafter(model, drafter):
    """Regression (page 04 at d = 64, 1 slot, n = 4: "a verify of n = 4 drafts fits: 5 verify tokens <= window 1"):
    the probe drafted with the page's drafter, and prompt lookup proposed fewer than n tokens, so a too-long n
    looked as if it fit. The probe verifies exactly n drafts with every drafter."""
    refused = ring_run(model, capacity=1, window=1, requested_draft=4, max_new_tokens=12, drafter=drafter)
    assert refused.overflow.startswith("ValueError") and "rollback window of 1" in refused.overflow
    fits = ring_run(model, capacity=8, window=5, requested_draft=4, max_new_tokens=12, drafter=drafter)
    assert fits.overflow.startswith("fits: 5 verify tokens <= window 5")


def test_ring_run_emits_exactly_the_run_length(model):
    """The run goes through the one speculative loop and its draft budget: it never over-emits (the
    prefill token plus accepted + 1 per step is exactly max_new_tokens)."""
    for max_new in (9, 12, 13):
        run = ring_run(model, capacity=8, window=5, requested_draft=4, acceptance=1.0, max_new_tokens=max_new)
        assert 1 + sum(s["accepted"] + 1 for s in run.steps) == max_new


def test_ring_view_and_commit_timing_are_the_parts(model):
    """Page 04's two calls return what the separate experiments return for the same arguments: the view (bytes, the
    ring run) and, on request, the commit timing at n, whose trade-off table reads the bytes of a verify of 1 + n."""
    view = ring_view(model, capacity=6, window=4, num_draft=2)
    assert view.bytes_rows == bytes_vs_draft(model, 16)
    assert view.run == ring_run(model, 6, 4, 2)
    assert view.labels == head_tail_labels(view.run.slots)
    timing = commit_timing(model, 2)
    assert {(r["accepted"], r["strategy"]) for r in timing.commit_rows} == {
        (a, s) for a in range(3) for s in ("snapshot", "projection replay", "raw-input ring", "ReplaySSM")}
    at_n = {r["strategy"]: r["bytes"] for r in view.bytes_rows if r["draft_tokens"] == 2}
    assert {t["strategy"]: t["bytes per verify"] for t in timing.tradeoff} == at_n
    assert [t["strategy"] for t in timing.tradeoff] == ["snapshot", "projection replay", "raw-input ring", "ReplaySSM"]


def test_head_tail_labels():
    """One label when head and tail share a slot (full or empty ring), else two at different heights."""
    ring = RawInputRing(capacity=4, window=2)
    assert head_tail_labels(ring.slot_table()) == [("head = tail (ring empty)", 0, 30)]
    ring.head, ring.commit_end, ring.tail = 1, 3, 3
    assert head_tail_labels(ring.slot_table()) == [("head", 1, 50), ("tail", 3, 25)]
    ring.head, ring.commit_end, ring.tail = 2, 6, 6
    assert head_tail_labels(ring.slot_table()) == [("head = tail (ring full)", 2, 30)]


def test_ring_model_widths():
    assert ring_model(WIDTHS[0]).cfg.num_heads == WIDTHS[0] // 32
    with pytest.raises(ValueError, match="width"):
        ring_model(100)


def test_commit_fits_split_overhead_from_per_token_cost():
    """t(a) = a0 + b a per strategy over the measured medians; a line through exact points is recovered."""
    rows = [{"accepted": a, "strategy": "raw-input ring", "commit_ms": 5.0 + 0.5 * a} for a in range(5)]
    rows += [{"accepted": a, "strategy": "snapshot", "commit_ms": 0.1} for a in range(5)]
    fits = commit_fits(rows)
    assert fits["raw-input ring"].a_s == pytest.approx(5.0) and fits["raw-input ring"].b_s == pytest.approx(0.5)
    assert fits["snapshot"].b_s == pytest.approx(0.0, abs=1e-12)


def test_commit_timing_has_spread_and_fits(model):
    timing = commit_timing(model, 3)
    assert set(timing.fits) == {"snapshot", "projection replay", "raw-input ring", "ReplaySSM"}
    assert timing.conditions.repeats >= 5 and all(r["samples"] >= 5 for r in timing.commit_rows)
    with pytest.raises(ValueError, match="repeats"):
        commit_timing(model, 3, repeats=4)


def test_verify_prefix_is_the_shorter_verify(model):
    """The first 1 + n positions of one long verify are bitwise the verify of 1 + n tokens alone (logits,
    every aux tensor, caches): bytes_vs_draft records them instead of running 16 verifies."""
    start = prompt_state(model)
    drafts = [7, 99, 3, 250, 42, 42, 0, 17]
    full = verify(model, start, drafts)
    for num_tokens in (1, 2, 5, 1 + len(drafts)):
        cut, alone = verify_prefix(model, start.cache, full, num_tokens), verify(model, start, drafts[: num_tokens - 1])
        assert torch.equal(cut.logits, alone.logits) and cache_equal(cut.cache, alone.cache)
        assert cut.aux.keys() == alone.aux.keys()
        for i in alone.aux:
            assert all(torch.equal(a, b) for a, b in zip(cut.aux[i], alone.aux[i], strict=True))
    with pytest.raises(ValueError, match="num_tokens"):
        verify_prefix(model, start.cache, full, 2 + len(drafts))
    with pytest.raises(ValueError, match="num_tokens"):
        verify_prefix(model, start.cache, full, 0)


def test_greedy_continuation_is_generate(model):
    """The ring run's oracle reference from the shared prefill equals the target's own greedy generation."""
    prompt = encode(PROMPT_TEXT)
    reference, _ = model.generate(prompt.reshape(1, -1), 9)
    assert greedy_continuation(model, prompt_state(model), 9) == reference[0].tolist()


def test_ring_model_is_the_trained_demo_model_at_the_demo_width():
    """d = 128 runs the shipped trained weights (the model every other page runs); d = 64 / 256 have none."""
    assert ring_model(128) is demo_model("demo") and is_trained_width(128)
    assert ring_model(64).cfg.name == "demo-d64" and not is_trained_width(64) and not is_trained_width(256)
    with pytest.raises(ValueError, match="width must be one of"):
        is_trained_width(96)
