"""lab.prefix's page calls (home page, 07, 08): one call returns frames consistent with the engine runs."""
import pytest

from lab.prefix import PHASE_RUNS, anatomy, home, prefix_hit, prefix_hit_timing
from lab.prefix_anatomy import anatomy_view
from serve.config import ServeConfig


def test_prefix_hit_frames():
    run = prefix_hit(64, 16, 2, 16, 64, 1)
    assert [r["kind"] for r in run.rows] == list(PHASE_RUNS)
    assert run.warm["hit_tokens"] == 64 and run.warm["prefill_tokens"] == 80 - 64 and run.cold["hit_tokens"] == 0
    assert run.check.bitwise and run.num_generated == 2  # b = 64 is on the 64-token chunk grid
    assert run.state_bytes > 0


def test_prefix_hit_timing_frames():
    """Page 08's chart data: >= 5 engine TTFT samples per kind, median inside its IQR, and the conditions."""
    timed = prefix_hit_timing(64, 16, 2, 16, 64, 1, repeats=5)
    assert list(timed.ttft.kind) == list(PHASE_RUNS) and (timed.ttft.repeats == 5).all()
    assert (timed.ttft.q1_ms <= timed.ttft.median_ms).all() and (timed.ttft.median_ms <= timed.ttft.q3_ms).all()
    assert (timed.ttft.min_ms <= timed.ttft.q1_ms).all() and (timed.ttft.q3_ms <= timed.ttft.max_ms).all()
    assert timed.rows.groupby("kind").size().to_dict() == dict.fromkeys(PHASE_RUNS, 5)
    assert list(timed.phases_ms.kind) == list(PHASE_RUNS)
    assert set(timed.phases_ms.columns) == {"kind", *[f"{p}_ms" for p in timed.phases]}
    assert timed.summary["warm_ttft_ms"] == pytest.approx(timed.ttft.set_index("kind").median_ms["warm"])
    assert timed.conditions.repeats == 5 and "5 interleaved repeats" in timed.conditions.stamp()


def test_home_decodes_and_masks_control_bytes():
    run = home("a" * 40, "a" * 40 + "b", 3, 8, 64)
    assert run.num_generated == 3 and all(c.isprintable() or c == "\n" for c in run.warm_text)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        home("a", "", 1, 8, 64)


def test_anatomy_view_matches_anatomy():
    prompts = ["x" * 40, "x" * 40 + "y" * 7]
    raw, view = anatomy(prompts, ServeConfig(8, 16, 2)), anatomy_view(prompts, 8, 16, 2)
    assert view.blocks.to_dict("records") == raw.blocks
    assert list(view.tails.itertuples(index=False, name=None)) == [(1, 40, 7)]  # prompt 0 is 5 full blocks
    prev = {b["end"]: b["key"] for b in raw.blocks if b["prompt"] == 0}
    assert view.droppable == sorted({c["boundary"] for c in raw.checkpoints if prev.get(c["boundary"]) == c["key"][:8]})
    assert (view.checkpoints.y > view.checkpoints.prompt).all()
    dropped = anatomy_view(prompts, 8, 16, 2, drop=(view.droppable[-1], 1))
    assert dropped.num_tokens < view.num_tokens or view.droppable[-1] > view.num_tokens


def test_anatomy_view_bounds_the_prompts():
    """Page 07's text box was unbounded: two prompts of 30,000 characters took 99 s and 2.46 GB, and 2,000 short
    prompts asked torch for 3.9 GB of pages. The bounds are checked before any engine is built."""
    from lab.prefix_anatomy import MAX_INTERVALS, MAX_PROMPTS, MAX_TEXT_BYTES, prompt_intervals

    with pytest.raises(ValueError, match=rf"prompts: 2,000 prompts, over the limit of {MAX_PROMPTS}"):
        anatomy_view([str(i) for i in range(2_000)])
    with pytest.raises(ValueError, match=r"prompts: 60,000 bytes in all .* over the limit of 4,000"):
        anatomy_view(["a" * 30_000, "b" * 30_000])
    with pytest.raises(ValueError, match=r"prompts: 4,002 bytes in all"):       # UTF-8 bytes, not characters
        anatomy_view(["é" * 1_000, "é" * 1_001])
    # the wait grows with the checkpoint intervals (C = 4: 2,000 tokens took 16 s): 601 tokens at C = 4 are 151
    with pytest.raises(ValueError, match=rf"prompts: 152 checkpoint intervals of C = 4 tokens in all, over the limit "
                                         rf"of {MAX_INTERVALS}"):
        anatomy_view(["x" * 601, "y"], block_size=4, interval=4)
    assert prompt_intervals(["x" * 601, "y"], 4) == 152 and prompt_intervals([[1] * 64, "ab"], 32) == 3
    with pytest.raises(ValueError, match="interval must be an int >= 1, got 0"):
        anatomy_view(["a", "b"], interval=0)
    rest = [f"{i:03d}" + "x" * 97 for i in range(MAX_PROMPTS - 1)]                     # 100 bytes each
    at_limit = anatomy_view(["x" * (MAX_TEXT_BYTES - 100 * len(rest))] + rest, interval=64)   # at both limits
    assert len(at_limit.prompt_tokens) == MAX_PROMPTS and sum(at_limit.prompt_tokens) == MAX_TEXT_BYTES
    longest = ["x" * (4 * (MAX_INTERVALS - 1)), "y"]                                    # exactly MAX_INTERVALS at C = 4
    assert prompt_intervals(longest, 4) == MAX_INTERVALS and anatomy_view(longest, 4, 4).num_tokens == 0
