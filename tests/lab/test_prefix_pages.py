"""lab.prefix's page calls (home page, 07, 08): one call returns frames consistent with the engine runs."""
import pytest

from lab.prefix import PHASE_RUNS, anatomy, home, prefix_hit
from lab.prefix_anatomy import anatomy_view


def test_prefix_hit_frames():
    run = prefix_hit(64, 16, 2, 16, 64, 1, repeats=1)
    assert list(run.rows.kind) == ["cold", "first", "warm"]
    assert list(run.phases_ms.kind) == list(PHASE_RUNS)
    assert set(run.phases_ms.columns) == {"kind", *[f"{p}_ms" for p in run.phases]}
    assert run.warm["hit_tokens"] == 64 and run.warm["prefill_tokens"] == 80 - 64
    assert run.check.bitwise and run.num_generated == 2  # b = 64 is on the 64-token chunk grid
    assert run.summary["cold_ttft_ms"] > 0 and run.state_bytes > 0


def test_home_decodes_and_masks_control_bytes():
    run = home("a" * 40, "a" * 40 + "b", 3, 8, 64, repeats=1)
    assert run.num_generated == 3 and all(c.isprintable() for c in run.warm_text)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        home("a", "", 1, 8, 64, repeats=1)


def test_anatomy_view_matches_anatomy():
    prompts = ["x" * 40, "x" * 40 + "y" * 7]
    raw, view = anatomy(prompts, 8, 16, 2), anatomy_view(prompts, 8, 16, 2)
    assert view.blocks.to_dict("records") == raw.blocks
    assert list(view.tails.itertuples(index=False, name=None)) == [(1, 40, 7)]  # prompt 0 is 5 full blocks
    prev = {b["end"]: b["key"] for b in raw.blocks if b["prompt"] == 0}
    assert view.droppable == sorted({c["boundary"] for c in raw.checkpoints if prev.get(c["boundary"]) == c["key"][:8]})
    assert (view.checkpoints.y > view.checkpoints.prompt).all()
    dropped = anatomy_view(prompts, 8, 16, 2, drop=(view.droppable[-1], 1))
    assert dropped.num_tokens < view.num_tokens or view.droppable[-1] > view.num_tokens
